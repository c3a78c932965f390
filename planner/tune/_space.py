"""The tuner's search space: the knobs ``plan()`` chooses, as Optuna suggestions.

A :class:`Space` holds, per knob, the values worth trying; a knob the user
fixed, or with one sensible value, has a single choice and is not suggested.
The FSDP knobs only exist for sharded candidates, so the space is conditional
(Optuna's define-by-run handles that; :func:`grid` enumerates it the same way).
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from agilerl.distributed import FSDPConfig

from ..choose import EXPERT_CHUNKS_MIB, LOGPROB_CHUNKS, Plan
from ..hardware import Cluster
from ..memory import DTYPE_BYTES, expert_parallel_degrees, row_wise_experts, tensor_parallel_degrees
from ..spec import ModelSpec
from ..workload import OFFLINE_SEQUENCES, Workload

__all__ = [
    "Candidate",
    "Space",
    "FSDP_KNOBS",
    "TUNED_FSDP",
    "WORKLOAD_KNOBS",
    "search_space",
    "suggest_candidate",
    "grid",
    "plan_params",
]

#: FSDPConfig fields the planner fills, in the order it relaxes them (cpu_offload and defer_grad_sync are
#: searched for full fine-tuning only, the last two for MoE models only).
FSDP_KNOBS = (
    "cpu_offload",
    "optim_cpu_offload",
    "defer_grad_sync",
    "shard_group_size",
    "reshard_after_forward",
    "wrap_every_n_blocks",
    "prefetch_units",
    "backward_prefetch_units",
    "ep",
    "routed_expert_chunk_mib",
)
#: FSDPConfig fields the tuner sets: the planner's, and tp (searched for MoE models only).
TUNED_FSDP = (*FSDP_KNOBS, "tp")
#: Knobs shown in tables only when searched or not at their default (dense models never have them).
_MOE_KNOBS = ("ep", "routed_expert_chunk_mib", "tp")
#: Workload fields left to the planner when None.
WORKLOAD_KNOBS = ("micro_batch_size_per_gpu", "gradient_checkpointing", "logprob_chunk_size")


class SuggestsCategorical(Protocol):
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


class Candidate(BaseModel):
    """One configuration to measure: the sharding settings and the resolved workload."""

    model_config = ConfigDict(frozen=True)

    fsdp: FSDPConfig | None
    workload: Workload

    @property
    def key(self) -> str:
        """Identity of the configuration (equal keys measure the same run)."""
        return json.dumps(
            {
                "fsdp": self.fsdp.model_dump(mode="json") if self.fsdp else None,
                "workload": self.workload.model_dump(mode="json"),
            },
            sort_keys=True,
        )

    def knobs(self) -> dict[str, Any]:
        """The tuned fields and their values, for tables."""
        out: dict[str, Any] = {"sharding": "fsdp" if self.fsdp else "none"}
        if self.fsdp:
            out.update(
                {
                    k: getattr(self.fsdp, k)
                    for k in TUNED_FSDP
                    if k not in _MOE_KNOBS or getattr(self.fsdp, k) != FSDPConfig.model_fields[k].default
                }
            )
        out.update({k: getattr(self.workload, k) for k in WORKLOAD_KNOBS})
        return out


class Space(BaseModel):
    """Per knob, the values to try (one value: not searched)."""

    model_config = ConfigDict(frozen=True)

    choices: dict[str, tuple[Any, ...]]
    fsdp_base: dict[str, Any]  # FSDPConfig fields every sharded candidate shares (the user's, and defaults)
    workload: Workload

    @property
    def searched(self) -> tuple[str, ...]:
        return tuple(name for name, values in self.choices.items() if len(values) > 1)

    def candidate(self, params: dict[str, Any]) -> Candidate:
        """The candidate for a full assignment (single-choice knobs may be left out)."""
        value = {name: params.get(name, values[0]) for name, values in self.choices.items()}
        if value["tp"] > 1:
            value["ep"] = 1  # tensor parallel is not combined with expert parallel or HSDP
            value["shard_group_size"] = None
        if value["ep"] > 1:
            value["shard_group_size"] = None  # expert parallel is not combined with HSDP
        if value["cpu_offload"]:
            value["optim_cpu_offload"] = False  # the two are exclusive: the optimizer steps where the shards are
        fsdp = None
        if value["sharding"] == "fsdp":
            fsdp = FSDPConfig(**{**self.fsdp_base, **{k: value[k] for k in TUNED_FSDP}})
        workload = self.workload.model_copy(update={k: value[k] for k in WORKLOAD_KNOBS})
        return Candidate(fsdp=fsdp, workload=workload)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _chunks(max_rows: int) -> tuple[int, ...]:
    """LOGPROB_CHUNKS up to the first that holds every row at once (larger ones run identically)."""
    out = []
    for chunk in LOGPROB_CHUNKS:
        out.append(chunk)
        if chunk >= max_rows:
            break
    return tuple(out)


def _expert_chunks(spec: ModelSpec, workload: Workload, max_micro: int, param_dtype: str) -> tuple[int, ...]:
    """EXPERT_CHUNKS_MIB up to the first that holds a micro-batch's routed rows at once."""
    moe = [b.mlp for b in spec.block_types.values() if b.mlp.kind == "moe"]
    need = max(
        max_micro
        * workload.sequence_tokens
        * m.experts_per_token
        * max(2 * m.intermediate_size, spec.hidden_size)
        * DTYPE_BYTES[param_dtype]
        for m in moe
    )
    out = []
    for chunk in EXPERT_CHUNKS_MIB:
        out.append(chunk)
        if chunk * 2**20 >= need:
            break
    return tuple(out)


def _tp_degrees(spec: ModelSpec, workload: Workload, cluster: Cluster) -> tuple[int, ...]:
    """TP degrees the runtime accepts, within a node (TP all-reduces every block), that leave
    whole micro-batches: the micro-batch choices are tp=1's, which divide every larger share."""
    return tuple(d for d in tensor_parallel_degrees(spec, cluster.num_gpus) if d <= cluster.per_node)


def _ep_degrees(spec: ModelSpec, cluster: Cluster) -> tuple[int, ...]:
    """EP degrees the runtime accepts, within a node (all-to-alls off the node are slow)."""
    return tuple(d for d in expert_parallel_degrees(spec, cluster.num_gpus) if d <= cluster.per_node)


def search_space(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    *,
    fixed: dict[str, Any],
    sharding: str,
    engine_in_trials: bool = True,
) -> Space:
    """What ``plan(spec, workload, cluster, fixed=fixed, sharding=sharding)`` would choose, as choices.

    ``sharding``: "auto" searches sharded and unsharded (data parallel) on more than one GPU;
    "fsdp" and "none" fix it. A fixed ``tp`` > 1 implies FSDP. ``engine_in_trials``: a vLLM
    workload's trials start its engine (not with --skip-rollout); without one the trainer
    refuses parameter offload, so it is not searched.
    """
    match sharding:
        case "auto":  # QLoRA shards too (the trainer's FSDP2 keeps the packed 4-bit base)
            options = ("fsdp", "none") if cluster.num_gpus > 1 else ("none",)
        case "fsdp":
            options = ("fsdp",)
        case "none":
            options = ("none",)
        case _:
            raise ValueError(f"sharding must be 'auto', 'fsdp' or 'none', got {sharding!r}")
    tp = int(fixed.get("tp", 1))
    if tp > 1:
        if options == ("none",):
            raise ValueError(f"tp={tp} needs FSDP; sharding='none' cannot use it")
        options = ("fsdp",)
    FSDPConfig(**fixed)  # the user's fields, validated with FSDPConfig's own errors

    def one_or(name: str, values: tuple[Any, ...]) -> tuple[Any, ...]:
        return (fixed[name],) if name in fixed else values

    base = dict(fixed)
    choices: dict[str, tuple[Any, ...]] = {"sharding": options}
    # Full fine-tuning's optimizer state and gradients are the model's size: parameter offload (where
    # Hugging Face generate does not need the weights) and deferring the gradient sync are worth a try.
    full = workload.full_finetune
    offloadable = (
        (workload.generation == "vllm" and engine_in_trials) or workload.algorithm in OFFLINE_SEQUENCES
    ) and not workload.offload_weights_during_rollout  # the trainer refuses the pair (weight_offload_problem)
    choices["cpu_offload"] = one_or("cpu_offload", (False, True) if full and offloadable else (False,))
    choices["optim_cpu_offload"] = (False,) if fixed.get("cpu_offload") else one_or("optim_cpu_offload", (False, True))
    choices["defer_grad_sync"] = one_or("defer_grad_sync", (False, True) if full else (True,))
    per_node = cluster.per_node
    choices["shard_group_size"] = one_or("shard_group_size", (None, per_node) if cluster.num_nodes > 1 else (None,))
    choices["reshard_after_forward"] = one_or("reshard_after_forward", (True, False))
    choices["wrap_every_n_blocks"] = one_or(
        "wrap_every_n_blocks", tuple(w for w in (1, 2, 4) if w <= max(1, spec.num_layers))
    )
    choices["prefetch_units"] = one_or("prefetch_units", (1, 2))
    choices["backward_prefetch_units"] = one_or("backward_prefetch_units", (1, 2))

    # Completions per GPU: under tp the ranks of a group share a batch shard.
    per_gpu = workload.completions_per_rank(cluster.num_gpus // tp)
    user = workload.micro_batch_size_per_gpu
    choices["micro_batch_size_per_gpu"] = (user,) if user else _divisors(per_gpu)
    # MoE: expert parallel and tensor parallel (attention only; neither with the other nor
    # with HSDP, which the runtime refuses), and the expert chunk. Dense models keep tp as given.
    if row_wise_experts(spec) and "fsdp" in options:
        hsdp_fixed = fixed.get("shard_group_size") is not None
        choices["ep"] = one_or("ep", (1,) if tp > 1 or hsdp_fixed else _ep_degrees(spec, cluster))
        choices["tp"] = one_or(
            "tp", (1,) if hsdp_fixed or "ep" in fixed and fixed["ep"] > 1 else _tp_degrees(spec, workload, cluster)
        )
        dtype = fixed.get("param_dtype", FSDPConfig.model_fields["param_dtype"].default)
        dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        choices["routed_expert_chunk_mib"] = one_or(
            "routed_expert_chunk_mib", _expert_chunks(spec, workload, max(choices["micro_batch_size_per_gpu"]), dtype)
        )
    else:
        choices["ep"] = one_or("ep", (1,))
        choices["tp"] = (tp,)
        choices["routed_expert_chunk_mib"] = one_or("routed_expert_chunk_mib", (None,))
    for name in TUNED_FSDP:
        base.pop(name, None)
    gc = workload.gradient_checkpointing
    choices["gradient_checkpointing"] = (gc,) if gc is not None else (True, False)
    chunk = workload.logprob_chunk_size
    max_rows = max(choices["micro_batch_size_per_gpu"]) * (workload.sequence_tokens - 1)
    choices["logprob_chunk_size"] = (chunk,) if chunk else _chunks(max_rows)
    return Space(choices=choices, fsdp_base=base, workload=workload)


def suggest_candidate(trial: SuggestsCategorical, space: Space) -> Candidate:
    """Build a candidate with ``trial.suggest_categorical`` for every searched knob.

    FSDP knobs are only suggested for sharded candidates (a conditional space).
    """

    def pick(name: str) -> Any:
        values = space.choices[name]
        return values[0] if len(values) == 1 else trial.suggest_categorical(name, values)

    params = {"sharding": pick("sharding")}
    if params["sharding"] == "fsdp":
        params["tp"] = pick("tp")
        params["ep"] = pick("ep") if params["tp"] == 1 else 1
        alone = params["ep"] > 1 or params["tp"] > 1  # neither is combined with HSDP
        params["cpu_offload"] = pick("cpu_offload")
        params.update(
            {
                name: pick(name)
                for name in FSDP_KNOBS
                if name not in ("ep", "cpu_offload")
                and not (name == "shard_group_size" and alone)
                and not (name == "optim_cpu_offload" and params["cpu_offload"])
            }
        )
    params.update({name: pick(name) for name in WORKLOAD_KNOBS})
    return space.candidate(params)


def _searched_params(space: Space, value: dict[str, Any]) -> dict[str, Any]:
    """The Optuna params of a full assignment: searched knobs that apply to it."""
    names = ["sharding", *(TUNED_FSDP if value["sharding"] == "fsdp" else ()), *WORKLOAD_KNOBS]
    if value["sharding"] == "fsdp" and value["tp"] > 1:
        names.remove("ep")  # not suggested under tensor parallel
    if value["sharding"] == "fsdp" and (value["ep"] > 1 or value["tp"] > 1):
        names.remove("shard_group_size")  # not suggested under expert or tensor parallel
    if value["sharding"] == "fsdp" and value["cpu_offload"]:
        names.remove("optim_cpu_offload")  # not suggested with parameter offload
    return {n: value[n] for n in names if len(space.choices[n]) > 1}


def grid(space: Space) -> list[dict[str, Any]]:
    """Every distinct assignment of the searched knobs, as Optuna params (for exhaustive grids)."""
    out, seen = [], set()
    names = list(space.choices)
    for combo in itertools.product(*(space.choices[n] for n in names)):
        value = dict(zip(names, combo))
        if value["ep"] > 1 and value["shard_group_size"] is not None:
            continue
        if value["tp"] > 1 and (value["ep"] > 1 or value["shard_group_size"] is not None):
            continue
        params = _searched_params(space, value)
        key = json.dumps(params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(params)
    return out


def plan_params(space: Space, plan: Plan) -> dict[str, Any] | None:
    """The Optuna params reproducing the planner's pick; None when it lies outside the space."""
    value: dict[str, Any] = {"sharding": "fsdp" if plan.fsdp is not None else "none"}
    if plan.fsdp is not None:
        value.update({k: getattr(plan.fsdp, k) for k in TUNED_FSDP})
    value.update({k: getattr(plan.workload, k) for k in WORKLOAD_KNOBS})
    chunks = space.choices["logprob_chunk_size"]
    if value["logprob_chunk_size"] > chunks[-1]:
        value["logprob_chunk_size"] = chunks[-1]  # every chunk past the last runs all rows at once
    if plan.fsdp is None:
        value.update(
            ep=1, tp=space.choices["tp"][0], routed_expert_chunk_mib=space.choices["routed_expert_chunk_mib"][0]
        )
    chunks_mib = space.choices["routed_expert_chunk_mib"]
    if value["routed_expert_chunk_mib"] is not None and chunks_mib[-1] is not None:
        value["routed_expert_chunk_mib"] = min(value["routed_expert_chunk_mib"], chunks_mib[-1])
    names = ["sharding", *(TUNED_FSDP if plan.fsdp is not None else ()), *WORKLOAD_KNOBS]
    if plan.fsdp is not None and value["cpu_offload"]:
        value["optim_cpu_offload"] = space.choices["optim_cpu_offload"][0]  # not a knob with parameter offload
    if any(value[n] not in space.choices[n] for n in names):
        return None  # e.g. the planner's last resort for LoRA, cpu_offload, which the tuner does not search
    if plan.fsdp is not None and any(getattr(plan.fsdp, k) != v for k, v in space.fsdp_base.items()):
        return None
    return _searched_params(space, value)
