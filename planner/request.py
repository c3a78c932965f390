"""One plan request: the cluster, the workload, the FSDPConfig fields the user fixed, the
sharding and the margin, validated once.

The command line, the explorer and the tuner each build a :class:`PlanRequest` from their own
input (flags, knobs, a study) and hand it on; the rules that decide whether a request is valid
live here, and only here. :func:`request_problems` holds the rules that need no model (the
ones :func:`planner.choose.check_inputs` adds need its layout), so the explorer can mark every
bad knob in place and the command line can print one line.

Decision, taken for the front ends alike: a ``vllm_*`` field set away from its default with a
generation other than ``vllm`` is refused (it would be silently ignored); one left at its
default is not, so a form that always carries every field does not trip it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from agilerl.distributed import FSDPConfig
from agilerl.utils.algo_utils import four_bit_problem, weight_offload_problem

from .hardware import MARGIN_FRACTION, Cluster
from .workload import Workload

__all__ = [
    "Decision",
    "PlanRequest",
    "RequestError",
    "SHARDINGS",
    "SHARDING_HELP",
    "MARGIN_HELP",
    "request_problems",
    "fixed_problems",
]

SHARDINGS = ("auto", "fsdp", "none")
SHARDING_HELP = (
    "auto: data parallel when the whole actor fits on each GPU (and every rank's copy on its node's host, where "
    "--host-memory is given), else FSDP2; fsdp: always FSDP2; none: never shard"
)
MARGIN_HELP = "the share of GPU memory a plan leaves free (and of host memory, where given), a fraction in [0, 1)"
_VLLM_FIELDS = tuple(name for name in Workload.model_fields if name.startswith("vllm_"))
_LAYOUT_FIELDS = ("tp", "ep", "shard_group_size")


class Decision(BaseModel):
    """One choice the plan made (or the request, for a default it had to change), and why."""

    model_config = ConfigDict(frozen=True)

    field: str
    value: Any
    reason: str


class RequestError(ValueError):
    """A request the trainer would refuse. ``problems`` maps a key (``"workload.<field>"``,
    ``"fsdp.<field>"``, ``"cluster.<field>"``, ``"plan.sharding"``, ``"plan.margin_fraction"``;
    ``"fsdp"`` for a combination of fields) to one sentence naming the field; ``str()`` is all of
    them on one line."""

    def __init__(self, problems: Mapping[str, str]):
        self.problems = dict(problems)
        super().__init__("; ".join(self.problems.values()) or "invalid plan request")


def _fixed_config(fixed: Mapping[str, Any]) -> tuple[FSDPConfig | None, dict[str, str]]:
    """The FSDPConfig of the fields the user fixed, or None and FSDPConfig's own errors by key."""
    try:
        return FSDPConfig(**fixed), {}
    except ValidationError as err:
        out: dict[str, str] = {}
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            out.setdefault(f"fsdp.{loc}" if loc else "fsdp", f"{loc}: {msg}" if loc else msg)
        return None, out


def fixed_problems(fixed: Mapping[str, Any]) -> dict[str, str]:
    """What is wrong with the FSDPConfig fields the user fixed, by key (FSDPConfig's own errors)."""
    return _fixed_config(fixed)[1]


def _layout_key(message: str) -> str:
    """The FSDPConfig field a layout error names first (the explorer marks that knob)."""
    named = sorted((message.find(f"{name}="), name) for name in _LAYOUT_FIELDS if f"{name}=" in message)
    return f"fsdp.{named[0][1]}" if named else "fsdp"


def request_problems(
    workload: Workload, cluster: Cluster, fixed: Mapping[str, Any] | None = None, sharding: str = "auto"
) -> dict[str, str]:
    """Every rule a run must meet that needs no model, by key; empty when there is none.

    Nothing the user gave is dropped or defaulted: FSDPConfig fields with ``sharding='none'``,
    a layout the GPUs cannot take (tp, shard_group_size, ep), a batch that does not split over
    the data-parallel ranks or into micro-batches, offloads the trainer refuses.
    """
    fixed = dict(fixed or {})
    problems: dict[str, str] = {}
    if sharding not in SHARDINGS:
        problems["plan.sharding"] = f"sharding must be 'auto', 'fsdp' or 'none', got {sharding!r}"
    fsdp, bad_fixed = _fixed_config(fixed)
    if fsdp is None:
        return {**problems, **bad_fixed}
    if fixed and sharding == "none":
        problems["plan.sharding"] = (
            f"sharding='none' trains without FSDP2, so the FSDPConfig fields given "
            f"({', '.join(sorted(fixed))}) would be ignored; use sharding 'auto' or 'fsdp'"
        )
    if problem := four_bit_problem(workload.load_in_4bit, cpu_offload=fsdp.cpu_offload, tp=fsdp.tp):
        problems["fsdp.cpu_offload" if fsdp.cpu_offload else "fsdp.tp"] = problem
    try:
        fsdp.check_world(cluster.num_gpus)
    except ValueError as err:
        problems[_layout_key(str(err))] = str(err)
        return problems
    data_parallel = cluster.num_gpus // fsdp.tp
    try:
        per_gpu = workload.completions_per_rank(data_parallel)
    except ValueError as err:
        problems["workload.prompts_per_step"] = str(err)
        return problems
    micro = workload.micro_batch_size_per_gpu
    if micro is not None and per_gpu % micro:
        problems["workload.micro_batch_size_per_gpu"] = (
            f"micro_batch_size_per_gpu={micro} does not divide the {per_gpu} completions per GPU "
            f"(prompts_per_step x group_size / {data_parallel} GPUs)"
        )
    elif micro is not None and not workload.micro_batch_fits_examples(micro):
        problems["workload.micro_batch_size_per_gpu"] = (
            f"micro_batch_size_per_gpu={micro}: dpo runs a pair's chosen and rejected sequences in one "
            "micro-batch, so it must be even"
        )
    if problem := weight_offload_problem(fsdp.cpu_offload, workload.offload_weights_during_rollout):
        problems["fsdp.cpu_offload"] = problem
    if fsdp.cpu_offload and workload.generation == "hf":
        problems.setdefault(
            "fsdp.cpu_offload",
            (
                "cpu_offload=True with generation='hf': Hugging Face generate runs on the trainer's weights, which "
                "must stay on the GPU; use a colocated vLLM engine or optim_cpu_offload"
            ),
        )
    return problems


def _front_end_problems(request: PlanRequest) -> dict[str, str]:
    """The rules of a request beyond :func:`request_problems`: the margin, the engine's fields."""
    problems: dict[str, str] = {}
    margin = request.margin_fraction
    if not (isinstance(margin, int | float) and math.isfinite(margin) and 0.0 <= margin < 1.0):
        problems["plan.margin_fraction"] = f"margin must be a fraction in [0, 1) of GPU memory, got {margin!r}"
    workload = request.workload
    if workload.generation != "vllm":
        for name in _VLLM_FIELDS:
            value = getattr(workload, name)
            if value != Workload.model_fields[name].default:
                problems[f"workload.{name}"] = (
                    f"{name}={value} sets the colocated vLLM engine: it needs "
                    f"generation='vllm' (got {workload.generation!r})"
                )
    return problems


@dataclass(frozen=True)
class PlanRequest:
    """What one plan needs besides the model, valid by construction (RequestError otherwise).

    ``fixed``: the FSDPConfig fields the user set, never changed by the plan (read-only here).
    ``decisions``: defaults the request itself changed, reported with the plan's own. Build one
    with :meth:`build` to get the command line's defaults; plan it with
    :func:`planner.choose.plan_request`.
    """

    cluster: Cluster
    workload: Workload
    fixed: Mapping[str, Any] = field(default_factory=dict)
    sharding: str = "auto"
    margin_fraction: float = MARGIN_FRACTION
    decisions: tuple[Decision, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))
        # On a key both name, the rule that needs no manifest says it.
        problems = {
            **_front_end_problems(self),
            **request_problems(self.workload, self.cluster, self.fixed, self.sharding),
        }
        if problems:
            raise RequestError(problems)

    @classmethod
    def build(
        cls,
        cluster: Cluster,
        workload: Workload,
        fixed: Mapping[str, Any] | None = None,
        *,
        sharding: str = "auto",
        margin_fraction: float = MARGIN_FRACTION,
    ) -> PlanRequest:
        """A request with the defaults a plan needs: a ``prompts_per_step`` the user left at its
        default is raised to a multiple of the GPUs (every GPU gets whole prompts), and says so."""
        decisions: tuple[Decision, ...] = ()
        default = Workload.model_fields["prompts_per_step"].default
        if "prompts_per_step" not in workload.model_fields_set and default % cluster.num_gpus:
            raised = -(-default // cluster.num_gpus) * cluster.num_gpus
            workload = workload.model_copy(update={"prompts_per_step": raised})
            decisions = (
                Decision(
                    field="prompts_per_step",
                    value=raised,
                    reason=(
                        f"the default {default} raised to a multiple of the {cluster.num_gpus} GPUs, so every GPU gets "
                        "whole prompts; set --prompts-per-step to choose"
                    ),
                ),
            )
        return cls(
            cluster=cluster,
            workload=workload,
            fixed=dict(fixed or {}),
            sharding=sharding,
            margin_fraction=margin_fraction,
            decisions=decisions,
        )

    def manifest_problem(self) -> str | None:
        """Why a manifest of this request would not validate, or None. A manifest's
        ``rollout_batch_size`` gives every data-parallel rank whole prompts (every GPU, or each
        group of a ``tp`` the user fixed: :meth:`agilerl.manifest.TrainingSection.batch_problem`),
        so ``prompts_per_step`` must be a multiple of them. The plan itself does not need it (the
        explorer plans such a request and marks its manifest); the command line, which always
        writes a manifest, refuses it."""
        from agilerl.manifest import TrainingSection

        prompts, gpus, tp = self.workload.prompts_per_step, self.cluster.num_gpus, int(self.fixed.get("tp") or 1)
        if TrainingSection(rollout_batch_size=prompts).batch_problem(gpus, tp) is None:
            return None
        if gpus % tp:
            return f"tp={tp} must divide the {gpus} GPUs"
        ranks = f"the {gpus} GPUs" if tp == 1 else f"the {gpus // tp} data-parallel ranks of the {gpus} GPUs (tp={tp})"
        return (
            f"prompts_per_step = {prompts} must be a multiple of {ranks}: the manifest's "
            "rollout_batch_size gives each whole prompts"
        )

    def with_cluster(self, cluster: Cluster) -> PlanRequest:
        """The same request on other GPUs (validated again)."""
        return replace(self, cluster=cluster)

    @property
    def margin_bytes(self) -> int:
        return int(self.cluster.gpu.memory_bytes * self.margin_fraction)
