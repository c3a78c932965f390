"""From knob values to a plan: validate them into a request, run plan(), check its manifest.

Headless (no textual). Validation uses the planner's own models (Cluster, Workload,
FSDPConfig) and reports every problem by knob key, so the screen can mark each in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from agilerl.distributed import FSDPConfig
from planner.choose import Plan, plan
from planner.hardware import GPUS, Cluster, with_memory
from planner.spec import ModelSpec
from planner.workload import Workload

from ._knobs import AUTO, KnobErrors, knob_table, parse

__all__ = ["Request", "build_request", "compute", "manifest_problem"]


@dataclass(frozen=True)
class Request:
    """What one plan() call needs, already validated."""

    cluster: Cluster
    workload: Workload
    fixed: Mapping[str, Any]
    sharding: str


def _validation_errors(err: ValidationError, group: str, fallback: str) -> dict[str, str]:
    """Field errors under their knob; an error of a combination under the first knob of the group its
    message names (else ``fallback``)."""
    from ._knobs import knob_table

    # Workload messages name fields (cluster ones name CLI flags, which do not match knob names).
    names = [k.key.split(".", 1)[1] for k in knob_table() if k.key.startswith(group + ".")] \
        if group == "workload" else []
    out: dict[str, str] = {}
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        msg = e["msg"].removeprefix("Value error, ")
        if loc:
            key = f"{group}.{loc[0]}"
        else:
            named = sorted((msg.find(n), n) for n in names if n in msg)
            key = f"{group}.{named[0][1]}" if named else fallback
        out.setdefault(key, msg)
    return out


def build_request(values: Mapping[str, str | bool]) -> Request:
    """Validate the raw knob values into a plan request; KnobErrors names every bad knob."""
    errors: dict[str, str] = {}
    parsed: dict[str, Any] = {}
    for knob in knob_table():
        try:
            parsed[knob.key] = parse(knob, values.get(knob.key, AUTO if knob.auto else ""))
        except ValueError as err:
            errors[knob.key] = str(err)

    def group(name: str) -> dict[str, Any]:
        return {
            k.split(".", 1)[1]: v
            for k, v in parsed.items()
            if k.startswith(name + ".") and v != AUTO and k not in errors
        }

    workload = cluster = None
    try:
        workload = Workload(**group("workload"))
    except ValidationError as err:
        errors.update(_validation_errors(err, "workload", "workload.generation"))
    fixed = group("fsdp")
    try:
        FSDPConfig(**fixed)
    except ValidationError as err:
        errors.update(_validation_errors(err, "fsdp", ""))
    c = group("cluster")
    try:
        gpu = GPUS[c.pop("gpu")]
        memory = c.pop("gpu_memory_gib", None)
        if memory is not None:
            if memory <= 0:
                raise KnobErrors({"cluster.gpu_memory_gib": "must be more than 0"})
            gpu = with_memory(gpu, memory)  # as `agilerl-plan --gpu-memory`: the calibration applies
        cluster = Cluster(gpu=gpu, **c)
    except KnobErrors as err:
        errors.update(err.errors)
    except ValidationError as err:
        errors.update(_validation_errors(err, "cluster", "cluster.gpus_per_node"))
    except KeyError:
        pass  # an unknown GPU kind is already reported by its choice
    if errors or workload is None or cluster is None:
        raise KnobErrors(errors)
    _check_split(workload, cluster, fixed, errors)
    if errors:
        raise KnobErrors(errors)
    return Request(
        cluster=cluster, workload=workload, fixed=fixed, sharding=parsed["plan.sharding"]
    )


def _check_split(
    workload: Workload, cluster: Cluster, fixed: Mapping[str, Any], errors: dict[str, str]
) -> None:
    """The batch must split evenly over the data-parallel ranks and into micro-batches."""
    ranks = max(1, cluster.num_gpus // int(fixed.get("tp", 1)))
    try:
        per_rank = workload.completions_per_rank(ranks)
    except ValueError as err:
        errors["workload.prompts_per_step"] = str(err)
        return
    micro = workload.micro_batch_size_per_gpu
    if micro is not None and per_rank % micro:
        errors["workload.micro_batch_size_per_gpu"] = (
            f"does not divide the {per_rank} completions per GPU"
        )


def compute(spec: ModelSpec, request: Request) -> Plan:
    """plan() for a validated request with the GPU kind's coefficients; ValueError -> KnobErrors."""
    from planner.calibration import coefficients_for, coefficients_source

    try:
        return plan(
            spec,
            request.workload,
            request.cluster,
            fixed=dict(request.fixed),
            sharding=request.sharding,
            coefficients=coefficients_for(request.cluster.gpu),
            coefficients_source=coefficients_source(request.cluster.gpu),
        )
    except (ValueError, KeyError) as err:
        raise KnobErrors({"": str(err).strip("'\"")}) from err


def manifest_problem(result: Plan) -> str | None:
    """Why the manifest of ``result`` would not validate (agilerl.manifest); None if it does."""
    from agilerl.manifest import ManifestError, load_manifest
    from planner.emit import manifest_dict

    try:
        load_manifest(manifest_dict(result))
    except ManifestError as err:
        return str(err).split(" is not a valid manifest: ", 1)[-1]
    return None
