"""From knob values to a plan: validate them into a :class:`planner.request.PlanRequest`, run
plan(), check its manifest.

Headless (no textual). Validation uses the planner's own models and rules (Cluster, Workload,
FSDPConfig, PlanRequest: the command line's), and reports every problem by knob key, so the
screen can mark each in place.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from planner.choose import Plan, plan_request
from planner.hardware import GPUS, Cluster, memory_bytes, with_memory
from planner.request import PlanRequest, RequestError, fixed_problems
from planner.spec import ModelSpec
from planner.workload import Workload

from ._knobs import AUTO, KnobErrors, knob_table, parse

__all__ = ["build_request", "compute", "manifest_problem"]


def _validation_errors(err: ValidationError, group: str, fallback: str) -> dict[str, str]:
    """Field errors under their knob; an error of a combination under the first knob of the group its
    message names (else ``fallback``)."""
    # Workload messages name fields (cluster ones name CLI flags, which do not match knob names).
    names = (
        [k.key.split(".", 1)[1] for k in knob_table() if k.key.startswith(group + ".")] if group == "workload" else []
    )
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


def _combination_errors(fields: Mapping[str, Any], err: ValidationError) -> dict[str, str]:
    """The Workload's combination errors among its valid fields, which pydantic does not check
    while a field fails (a ``group_size`` that does not suit the algorithm would show only once a
    ``prompt_tokens`` of 0 is mended): the fields validated again without the failing ones, and
    each error whose message names none of them."""
    failing = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
    rest = {k: v for k, v in fields.items() if k not in failing}
    if not failing or len(rest) == len(fields):
        return {}
    try:
        Workload(**rest)
    except ValidationError as again:
        found = _validation_errors(again, "workload", "workload.generation")
        return {k: m for k, m in found.items() if not any(name in m for name in failing)}
    return {}


@functools.cache
def _knob_keys() -> frozenset[str]:
    return frozenset(k.key for k in knob_table())


def _by_knob(problems: Mapping[str, str]) -> dict[str, str]:
    """A request's problems under their knobs; one no knob holds (a combination) under ``""``."""
    keys = _knob_keys()
    out: dict[str, str] = {}
    for key, msg in problems.items():
        out.setdefault(key if key in keys else "", msg)
    return out


def build_request(values: Mapping[str, str | bool]) -> PlanRequest:
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
    fields = group("workload")
    if fields.get("prompts_per_step") == Workload.model_fields["prompts_per_step"].default:
        # at its default: left out, so that PlanRequest.build raises it to a multiple of the GPUs
        # (every GPU whole prompts) and says so, as the command line does
        del fields["prompts_per_step"]
    try:
        workload = Workload(**fields)
    except ValidationError as err:
        errors.update(_validation_errors(err, "workload", "workload.generation"))
        for key, msg in _combination_errors(fields, err).items():
            errors.setdefault(key, msg)
    if workload is not None and workload.full_finetune:  # as the command line refuses LoRA flags beside it
        for name in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"):
            default = Workload.model_fields[name].default
            if getattr(workload, name) != default:
                errors[f"workload.{name}"] = (
                    f"full_finetune trains no LoRA adapters: put it back to {default}, or clear full_finetune"
                )
    fixed = group("fsdp")
    errors.update(_by_knob(fixed_problems(fixed)))
    c = group("cluster")
    try:
        gpu = GPUS[c.pop("gpu")]
        memory = c.pop("gpu_memory_gib", None)
        if memory is not None:
            if memory <= 0:
                raise KnobErrors({"cluster.gpu_memory_gib": "must be more than 0"})
            try:
                gpu = with_memory(gpu, memory)  # as `agilerl-plan --gpu-memory`: the calibration applies
            except ValueError as err:  # inf, nan, too small or too large a figure
                raise KnobErrors({"cluster.gpu_memory_gib": str(err)}) from None
        host = c.pop("host_memory_gib", None)
        if host is not None:
            try:  # as `agilerl-plan --host-memory`
                c["host_memory_per_node_bytes"] = memory_bytes(host, "host memory")
            except ValueError as err:
                raise KnobErrors({"cluster.host_memory_gib": str(err)}) from None
        cluster = Cluster(gpu=gpu, **c)
    except KnobErrors as err:
        errors.update(err.errors)
    except ValidationError as err:
        errors.update(_validation_errors(err, "cluster", "cluster.gpus_per_node"))
    except KeyError:
        pass  # an unknown GPU kind is already reported by its choice
    if errors or workload is None or cluster is None:
        raise KnobErrors(errors)
    try:
        return PlanRequest.build(
            cluster,
            workload,
            fixed,
            sharding=parsed["plan.sharding"],
            margin_fraction=parsed["plan.margin_fraction"],
        )
    except RequestError as err:
        raise KnobErrors(_by_knob(err.problems)) from None


def compute(spec: ModelSpec, request: PlanRequest) -> Plan:
    """The plan of a validated request (as the command line's: the GPU kind's coefficients or
    the user's calibration); ValueError -> KnobErrors, under the knob the message opens with
    (``name=value ...``) where there is one."""
    try:
        return plan_request(spec, request)
    except (ValueError, KeyError) as err:
        message = str(err).strip("'\"")
        raise KnobErrors(_by_knob({_named_field(message): message})) from err


def _named_field(message: str) -> str:
    """The knob a model-level error opens with (``lora_rank=4096 is more than ...``), or ``""``."""
    head = message.split(" ", 1)[0]
    if "=" not in head:
        return ""
    name = head.split("=", 1)[0]
    return next((key for key in (f"workload.{name}", f"fsdp.{name}") if key in _knob_keys()), "")


def manifest_problem(result: Plan) -> str | None:
    """Why the manifest of ``result`` would not validate (agilerl.manifest); None if it does."""
    from agilerl.manifest import ManifestError, load_manifest
    from planner.emit import manifest_dict

    try:
        load_manifest(manifest_dict(result))
    except ManifestError as err:
        return str(err).split(" is not a valid manifest: ", 1)[-1]
    return None
