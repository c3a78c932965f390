"""plan(...): pick the FSDPConfig choices the docs leave to "the memory estimate".

Strategy, deterministic and fast (tens of estimates, a few ms each):

1. Data parallel (no sharding) when the whole actor fits on every GPU with the
   margin (and, where the host memory is given, every rank's copy on its node's
   host): it needs no weight gathers. Otherwise FSDP2.
2. Start from the most frugal settings (reshard after forward, one block per
   unit, prefetch 1, micro-batch 1, checkpointing on, the smallest log-prob
   chunk, Adam state on the GPU unless only the host can hold it, for full
   fine-tuning a reduce-scatter every micro-batch; for MoE
   models the smallest expert chunk). Where that does not fit: a
   reduce-scatter every micro-batch for LoRA too, then expert parallelism,
   then Adam on the host alone and with each expert-parallel degree, and CPU
   parameter offload only as a last resort and only where Hugging Face
   generate does not run (with a colocated vLLM, or for SFT and DPO).
3. Relax one knob at a time, in order of what it buys in throughput, keeping
   the estimated peak under capacity minus a safety margin: Adam on the GPU,
   the largest micro-batch, no checkpointing, node-local sharding (HSDP),
   deferred gradient sync, no resharding, the largest log-prob chunk, bigger units, deeper prefetch,
   and for MoE models the largest expert chunk of 64/128/256/512 MiB that
   fits (FSDPConfig.routed_expert_chunk_mib's documented choice).

Fields the user fixed are never changed. When nothing fits, the plan says so
and names the smallest changes that would.

A rollout on engine ranks of their own (``generation='none'`` with a rollout objective) is
judged too: each engine rank's GPU holds the whole model and Hugging Face generate's cache of
its share of the completions (:func:`planner.memory.engine_rank_estimate`). Nothing chosen for
the trainers changes it, so an engine rank over the limit makes the plan not fit whatever the
trainers' settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict

from agilerl.distributed import FSDPConfig

from . import calibration
from .hardware import GIB, MARGIN_FRACTION, MAX_MEMORY_GIB, MIB, Cluster, memory_words
from .memory import (
    EXPERT_CHUNKS_MIB,
    Coefficients,
    Estimate,
    PhaseEstimate,
    check_ep,
    engine_completions,
    engine_rank_count,
    engine_rank_estimate,
    estimate,
    expert_parallel_degrees,
    node_host_bytes,
    node_host_phase,
    row_wise_experts,
    tp_problem,
    vllm_budget_problem,
    vllm_floor,
)
from .request import Decision, PlanRequest, RequestError, request_problems
from .spec import ModelSpec
from .workload import OFFLINE_SEQUENCES, Workload, resolved

__all__ = [
    "Decision",
    "Plan",
    "Limit",
    "plan",
    "plan_request",
    "check_inputs",
    "suggest_fixes",
    "LOGPROB_CHUNKS",
    "EXPERT_CHUNKS_MIB",
]

LOGPROB_CHUNKS = (256, 512, 1024, 2048, 4096)
#: vllm_gpu_memory_utilization the planner tries, largest first (a larger KV cache: more sequences
#: in flight, faster rollouts).
VLLM_UTILIZATIONS = tuple(round(0.9 - 0.05 * i, 2) for i in range(17))
#: vLLM's own max_num_seqs default, the most the planner picks.
VLLM_MAX_NUM_SEQS = 256


class Limit(BaseModel):
    """One limit a plan is judged by and what it needs of it: the trainer GPUs' (``gpu``), an
    engine rank of its own's (``engine_rank``), a node's host memory (``host``, where given)."""

    model_config = ConfigDict(frozen=True)

    what: Literal["gpu", "engine_rank", "host"]
    need_bytes: int
    limit_bytes: int
    phase: str = ""  # where the need peaks ("" for an engine rank: it generates only)
    completions: int = 0  # an engine rank's: the completions it generates at once

    @property
    def over(self) -> bool:
        return self.need_bytes > self.limit_bytes

    def words(self) -> str:
        """What it needs against its limit, as plans, the table and the trainer say it."""
        need, limit = (memory_words(n, self.limit_bytes) for n in (self.need_bytes, self.limit_bytes))
        if self.what == "gpu":
            return f"{need} per GPU in phase {self.phase}, over the {limit} available"
        if self.what == "host":
            return host_over_words(self.need_bytes, self.limit_bytes, self.phase)
        return (
            f"an engine rank of its own (generation 'none') needs {need} on its GPU, over the {limit} available: "
            f"the whole model and Hugging Face generate's cache of {self.completions} completions"
        )

    def short(self, *, limit: bool = True) -> str:
        """The same in a few words, in GiB as the explorer speaks throughout (its verdict line),
        without the limit where not ``limit`` (:attr:`short_limit`: the trainers' and an engine
        rank's GPUs share theirs)."""
        need = self.need_bytes / GIB
        where = f" in {self.phase}" if self.phase else ""
        words = f"host {need:.2f} GiB a node{where}" if self.what == "host" else f"{need:.2f} GiB "
        if self.what != "host":
            words += f"in {self.phase}" if self.what == "gpu" else "in an engine rank of its own"
        return f"{words} > {self.short_limit}" if limit else words

    @property
    def short_limit(self) -> str:
        return f"{self.limit_bytes / GIB:.2f} usable"

    def as_json(self) -> dict[str, Any]:
        return {"what": self.what, "need_bytes": self.need_bytes, "limit_bytes": self.limit_bytes, "phase": self.phase}


class Plan(BaseModel):
    """The chosen configuration, its estimate and why."""

    model_config = ConfigDict(frozen=True)

    model: str
    cluster: Cluster
    fsdp: FSDPConfig | None
    workload: Workload  # with micro-batch, log-prob chunk and checkpointing resolved
    estimate: Estimate
    decisions: tuple[Decision, ...]
    fits: bool
    margin_bytes: int
    suggestions: tuple[str, ...] = ()
    coefficients_source: str = "defaults"  # which coefficients the estimate used (planner.calibration)
    #: The busiest engine rank's GPU where the rollout runs on ranks of its own (generation='none'
    #: with a rollout objective: planner.memory.engine_rank_estimate), else None.
    engine_rank: PhaseEstimate | None = None
    #: The busiest node's host memory: its trainer ranks' and any engine ranks' of their own
    #: (planner.memory.node_host_bytes).
    host_per_node_bytes: int = 0
    #: What a node's host may hold: the cluster's host memory less the safety margin's fraction;
    #: None where the host memory was not given (the host is then reported, not judged).
    host_limit_bytes: int | None = None
    #: The phase where the busiest node's host memory peaks ("save": rank 0 gathers the checkpoint).
    host_peak_phase: str = ""

    @property
    def headroom_bytes(self) -> int:
        return self.estimate.headroom_bytes

    @property
    def host_over(self) -> bool:
        """Whether the busiest node's host needs more than its limit (never where not given)."""
        return self.host_limit_bytes is not None and self.host_per_node_bytes > self.host_limit_bytes

    @property
    def gpu_limit_bytes(self) -> int:
        """What a GPU may hold: its capacity less the safety margin."""
        return self.cluster.gpu.memory_bytes - self.margin_bytes

    @property
    def trainers_over(self) -> bool:
        """Whether the trainer ranks' estimated peak is over a GPU's limit."""
        return self.estimate.peak_bytes > self.gpu_limit_bytes

    @property
    def engine_rank_over(self) -> bool:
        """Whether an engine rank of its own needs more than a GPU's limit."""
        return self.engine_rank is not None and self.engine_rank.total > self.gpu_limit_bytes

    def limits(self) -> tuple[Limit, ...]:
        """Every limit the plan is judged by, with what it needs of each (:func:`_limits`)."""
        limit = self.host_limit_bytes
        return _limits(
            self.estimate,
            self.gpu_limit_bytes,
            engine=_engine_limit(self.engine_rank, self.gpu_limit_bytes, self.workload, self.cluster),
            host=None
            if limit is None
            else Limit(what="host", need_bytes=self.host_per_node_bytes, limit_bytes=limit, phase=self.host_peak_phase),
        )

    def over(self) -> tuple[Limit, ...]:
        """The limits the plan is over: the GPUs', an engine rank's, a node's host."""
        return tuple(limit for limit in self.limits() if limit.over)

    def reasons(self) -> dict[str, str]:
        return {d.field: d.reason for d in self.decisions}


def _limits(est: Estimate, gpu_limit: int, *, engine: Limit | None, host: Limit | None) -> tuple[Limit, ...]:
    """The limits of one estimate: its trainer GPUs'; an engine rank of its own's, where the run
    has them; a node's host, where its limit is given."""
    gpu = Limit(what="gpu", need_bytes=est.peak_bytes, limit_bytes=gpu_limit, phase=est.peak_phase)
    return tuple(limit for limit in (gpu, engine, host) if limit is not None)


def _engine_limit(engine: PhaseEstimate | None, gpu_limit: int, workload: Workload, cluster: Cluster) -> Limit | None:
    """An engine rank of its own's limit (its GPU's), None where the run has none."""
    if engine is None:
        return None
    rows = engine_completions(workload, cluster)
    return Limit(what="engine_rank", need_bytes=engine.total, limit_bytes=gpu_limit, completions=rows)


def _host_limit(cluster: Cluster, margin_fraction: float) -> int | None:
    """What a node's host may hold (None where its memory is not given): the host keeps the same
    fraction back as the GPUs (the OS and the page cache take some)."""
    host = cluster.host_memory_per_node_bytes
    return None if host is None else host - int(host * margin_fraction)


class _Search:
    """The fixed inputs of one plan and the estimate they are judged by."""

    def __init__(
        self,
        spec: ModelSpec,
        cluster: Cluster,
        coefficients: Coefficients | None,
        margin_fraction: float,
        *,
        workload: Workload,
        fixed: dict[str, Any],
        engine_ranks: bool = True,
    ):
        self.spec, self.cluster, self.coefficients = spec, cluster, coefficients
        self.margin = int(cluster.gpu.memory_bytes * margin_fraction)
        self.row_wise = row_wise_experts(spec)  # the project's row-wise experts can run this model's
        self.workload, self.fixed = workload, fixed  # as the user gave them
        self.limit = cluster.gpu.memory_bytes - self.margin
        self.host_limit = _host_limit(cluster, margin_fraction)
        # nothing chosen for the trainers changes an engine rank's memory: judged once
        self.engine_rank = (
            engine_rank_estimate(spec, workload, cluster, coefficients=coefficients) if engine_ranks else None
        )

    @property
    def engine_rank_fits(self) -> bool:
        return self.engine_rank is None or self.engine_rank.total <= self.limit

    def estimate(self, workload: Workload, fsdp: FSDPConfig | None) -> Estimate:
        return estimate(self.spec, workload, self.cluster, fsdp, coefficients=self.coefficients)

    def node_host(self, est: Estimate) -> int:
        """The busiest node's host memory under ``est``, engine ranks of their own included."""
        return node_host_bytes(est, self.workload, self.cluster, self.engine_rank)

    def node_host_phase(self, est: Estimate) -> str:
        """The phase where :meth:`node_host` peaks."""
        return node_host_phase(est, self.workload, self.cluster, self.engine_rank)

    def gpu_words(self, n: float) -> str:
        """``n`` bytes in the unit the plan's table uses for its GPUs (GiB; MiB for a small one)."""
        return memory_words(n, self.cluster.gpu.memory_bytes)

    def host_fits(self, est: Estimate) -> bool:
        return self.host_limit is None or self.node_host(est) <= self.host_limit

    def fits(self, workload, fsdp) -> bool:
        """Whether it fits its GPUs and, where given, its nodes' host memory; a layout the runtime
        refuses on these GPUs (expert parallel with tensor parallel or HSDP, say) is never a
        candidate, and fits nothing."""
        if fsdp is not None and self.layout_problem(fsdp) is not None:
            return False
        est = self.estimate(workload, fsdp)
        return est.peak_bytes <= self.limit and self.host_fits(est)

    def excess(self, workload: Workload, fsdp: FSDPConfig | None) -> tuple[float, float]:
        """How far it is from fitting: the bytes its GPU peak, then its busiest node's host, are
        over their limits ((0, 0) where it fits; infinite for a layout the runtime refuses). In
        that order: where nothing fits, the plan reports the combination whose GPUs are nearest to
        fitting, then whose host is."""
        if fsdp is not None and self.layout_problem(fsdp) is not None:
            return math.inf, math.inf
        est = self.estimate(workload, fsdp)
        host = 0 if self.host_limit is None else max(0, self.node_host(est) - self.host_limit)
        return max(0, est.peak_bytes - self.limit), host

    def host_limit_of(self, est: Estimate) -> Limit | None:
        """A node's host limit under ``est`` (its need and the phase where it peaks), None where
        the host memory is not given."""
        if self.host_limit is None:
            return None
        need, phase = self.node_host(est), self.node_host_phase(est)
        return Limit(what="host", need_bytes=need, limit_bytes=self.host_limit, phase=phase)

    def limits(self, est: Estimate) -> tuple[Limit, ...]:
        """The limits ``est`` is judged by, as a plan of it would give them (:meth:`Plan.limits`)."""
        engine = _engine_limit(self.engine_rank, self.limit, self.workload, self.cluster)
        return _limits(est, self.limit, engine=engine, host=self.host_limit_of(est))

    def over(self, est: Estimate, *, engine: bool = True) -> list[str]:
        """What of ``est`` is over its limit, in words: the trainer GPUs, an engine rank (unless not
        ``engine``), a node's host."""
        return [limit.words() for limit in self.limits(est) if limit.over and (engine or limit.what != "engine_rank")]

    def layout_problem(self, fsdp: FSDPConfig) -> str | None:
        """Why ``fsdp`` cannot run on the cluster's ranks (agilerl.distributed's own check), or None."""
        try:
            fsdp.check_world(self.cluster.num_gpus)
        except ValueError as err:
            return str(err)
        return None


@dataclass
class _Draft:
    """What plan() has chosen so far: the workload and FSDPConfig the next step starts from, and why."""

    workload: Workload
    fsdp: FSDPConfig | None = None
    decisions: list[Decision] = field(default_factory=list)

    def note(self, field: str, value: Any, reason: str) -> None:
        self.decisions.append(Decision(field=field, value=value, reason=reason))

    def trying(self, **update: Any) -> Workload:
        """The current workload with ``update`` applied."""
        return self.workload.model_copy(update=update)

    def plan(self, search: _Search, est: Estimate, *, fits: bool, source: str, suggestions: list[str]) -> Plan:
        """The plan of what was chosen, judged by ``est``."""
        return Plan(
            model=search.spec.name,
            cluster=search.cluster,
            fsdp=self.fsdp,
            workload=self.workload,
            estimate=est,
            decisions=tuple(self.decisions),
            fits=fits,
            margin_bytes=search.margin,
            suggestions=tuple(suggestions),
            coefficients_source=source,
            engine_rank=search.engine_rank,
            host_per_node_bytes=search.node_host(est),
            host_limit_bytes=search.host_limit,
            host_peak_phase=search.node_host_phase(est),
        )


def _divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending (trial division to its square root: a count may be huge)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _expert_parallel_degrees(spec: ModelSpec, cluster: Cluster) -> list[int]:
    """EP degrees above 1 the runtime accepts, within a node first."""
    allowed = [d for d in expert_parallel_degrees(spec, cluster.num_gpus) if d > 1]
    return sorted(allowed, key=lambda d: (d > cluster.per_node, d))


def check_inputs(
    spec: ModelSpec, workload: Workload, cluster: Cluster, fixed: dict[str, Any] | None = None, sharding: str = "auto"
) -> None:
    """Raise ValueError naming the field when the inputs describe a run the trainer would refuse.

    Nothing the user gave is dropped or defaulted: the rules that need no model
    (:func:`planner.request.request_problems`: FSDPConfig fields with ``sharding='none'``, a
    layout the GPUs cannot take, a batch that does not split), then those of the model's layout:
    tp and ep it cannot take, block counts and kinds it does not have, a sequence longer than its
    positions.
    """
    fixed = dict(fixed or {})
    problems = request_problems(workload, cluster, fixed, sharding)
    if problems:
        raise RequestError(problems)
    fsdp = FSDPConfig(**fixed)
    if fsdp.tp > 1 and (problem := tp_problem(spec, fsdp.tp)):
        raise ValueError(problem)
    if fsdp.ep > 1:
        check_ep(spec, fsdp.ep, cluster.num_gpus)
    if fsdp.ep_token_blocks > 1 and fsdp.ep == 1:
        raise ValueError(
            f"ep_token_blocks={fsdp.ep_token_blocks} splits expert parallel's all-to-alls into blocks: it needs ep > 1"
        )
    if fsdp.routed_expert_chunk_mib is not None and not spec.is_moe:
        raise ValueError(
            f"routed_expert_chunk_mib={fsdp.routed_expert_chunk_mib:g} sizes routed-expert chunks: "
            f"{spec.name} has no routed experts"
        )
    if fsdp.routed_expert_chunk_mib is not None and spec.expert_layout_problem:
        raise ValueError(f"routed_expert_chunk_mib={fsdp.routed_expert_chunk_mib:g}: {spec.expert_layout_problem}")
    packed = (
        # "model.layers.0.mlp.experts:gate_up_proj" -> "experts.gate_up_proj" (a router's: "gate.weight")
        sorted(
            {
                label.rsplit(".", 1)[-1].replace(":", ".")
                for label, *_ in spec.lora_shapes(workload.lora_targets)
                if ":" in label
            }
        )
        if not workload.full_finetune
        else []
    )
    if not workload.full_finetune and (problem := lora_rank_problem(spec, workload)):
        raise ValueError(problem)
    if workload.lora_dropout and packed:
        raise ValueError(
            f"lora_dropout={workload.lora_dropout:g}: these LoRA targets adapt {spec.name}'s MoE parameters "
            f"({', '.join(packed)}), whose inputs PEFT cannot drop out: give lora_dropout 0, or targets without "
            "the experts"
        )
    if fsdp.tp > 1 and engine_rank_count(workload, cluster):
        raise ValueError(  # the manifest refuses it too
            f"tp={fsdp.tp} with generation='none': the rollout runs on engine ranks of their own, which a "
            "tensor-parallel group cannot share (agilerl.train refuses it); use tp=1, or generation 'hf' or 'vllm'"
        )
    if workload.generation == "vllm" and packed:  # the trainer refuses it too (GRPO's engine sync)
        raise ValueError(
            f"generation='vllm': these LoRA targets adapt {spec.name}'s MoE parameters "
            f"({', '.join(packed)}), which cannot be merged into the engine's weights yet: give lora_targets "
            "without the experts (q_proj,k_proj,v_proj,o_proj), or generation='hf'"
        )
    if fsdp.wrap_every_n_blocks > spec.num_layers:
        raise ValueError(
            f"wrap_every_n_blocks={fsdp.wrap_every_n_blocks} is more than the {spec.num_layers} blocks of {spec.name}"
        )
    unknown = sorted(set(fsdp.checkpoint_skip_layer_types) - set(spec.block_kinds))
    if unknown:
        raise ValueError(
            f"checkpoint_skip_layer_types names block kinds {spec.name} does not have: {unknown}; "
            f"its blocks are of kinds {spec.block_kinds}"
        )
    if problem := vllm_budget_problem(spec, workload, cluster, fsdp if fsdp.tp > 1 else None):
        raise ValueError(problem)
    if workload.sequence_tokens > spec.positions:
        raise ValueError(
            f"prompt_tokens + completion_tokens = {workload.sequence_tokens} is longer than the "
            f"{spec.positions} positions of {spec.name} ({spec.positions_words()})"
        )
    if (engine_len := workload.vllm_max_model_len) is not None and engine_len > spec.positions:
        raise ValueError(
            f"vllm_max_model_len={engine_len} is longer than the {spec.positions} positions of "
            f"{spec.name} ({spec.positions_words()}, as prompt + completion tokens are checked): at most "
            f"{spec.positions}, or leave it unset (prompt + completion tokens)"
        )


def _vllm_frugal(
    spec: ModelSpec, workload: Workload, cluster: Cluster, fixed: dict[str, Any]
) -> tuple[Workload, list[Decision]]:
    """The colocated engine's settings the plan starts from: ``max_num_seqs`` a rank's completions
    (at most 256) and, unless given, the least ``gpu_memory_utilization`` the engine starts with
    (its weights and one sequence's KV cache), raised later to the largest that fits."""
    notes: list[Decision] = []
    tp = int(fixed.get("tp", 1) or 1)
    update: dict[str, Any] = {}
    if workload.vllm_max_num_seqs is None:
        n = workload.completions_per_rank(max(1, cluster.num_gpus // tp))
        # no more in flight than a step's token budget schedules (vLLM refuses more at start-up)
        budget = workload.vllm_max_num_batched_tokens or VLLM_MAX_NUM_SEQS
        seqs = min(VLLM_MAX_NUM_SEQS, n, budget)
        update["vllm_max_num_seqs"] = seqs
        if seqs == n:
            reason = f"a rank's {n} completions per rollout all in flight at once"
        elif seqs == budget and budget < VLLM_MAX_NUM_SEQS:
            reason = (
                f"as many as vllm_max_num_batched_tokens={budget} schedules; a rank has {n} completions per rollout"
            )
        else:
            reason = f"vLLM's default; a rank has {n} completions per rollout"
        notes.append(Decision(field="vllm_max_num_seqs", value=seqs, reason=reason))
    if workload.vllm_gpu_memory_utilization is None and workload.vllm_kv_cache_memory_bytes is None:
        sized = workload.model_copy(update={**update, "vllm_gpu_memory_utilization": 1.0})
        floor = vllm_floor(spec, sized, cluster, None) / cluster.gpu.memory_bytes
        # above the largest fraction the planner gives, the least the engine starts with (the
        # whole GPU when not even that: the rollout then cannot fit)
        least = next((u for u in reversed(VLLM_UTILIZATIONS) if u >= floor), min(1.0, math.ceil(floor * 100) / 100))
        update["vllm_gpu_memory_utilization"] = least
    return workload.model_copy(update=update), notes


def lora_rank_problem(spec: ModelSpec, workload: Workload) -> str | None:
    """Why ``lora_rank`` is a typo, or None: more than every dimension of every weight the targets
    adapt. A rank-r adapter ``B A`` of a d_in x d_out weight has rank at most min(d_in, d_out)
    (per expert, on a packed expert stack), so a larger rank adds parameters and optimizer state
    and nothing the adapter can express; PEFT builds it all the same, and a narrow target at a
    usual rank is a choice (a router's 8 outputs at the default rank 16), so only a rank past the
    largest dimension of them all is refused. The message names the most that helps."""
    if not spec.has_lora_targets(workload.lora_targets):
        return None  # the estimate says the spec lacks them
    shapes = [(a_cols, b_rows) for _, _, a_cols, b_rows, _ in spec.lora_shapes(workload.lora_targets)]
    largest = max((max(shape) for shape in shapes), default=0)
    if not largest or workload.lora_rank <= largest:
        return None
    usable = max(min(shape) for shape in shapes)
    return (
        f"lora_rank={workload.lora_rank} is more than every dimension of the weights {spec.name}'s targets "
        f"({ModelSpec.target_key(workload.lora_targets)}) adapt, the largest being {largest}: an adapter of a "
        f"d_in x d_out weight has rank at most min(d_in, d_out), {usable} for the widest; give lora_rank <= {usable}"
    )


def plan(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    *,
    fixed: dict[str, Any] | None = None,
    sharding: str = "auto",
    colocated_vllm: bool | None = None,
    coefficients: Coefficients | None = None,
    coefficients_source: str | None = None,
    margin_fraction: float = MARGIN_FRACTION,
    suggest: bool = True,
    engine_ranks: bool = True,
) -> Plan:
    """Choose FSDPConfig fields and workload knobs the user left open.

    ``fixed``: FSDPConfig fields the user set (never changed). ``sharding``:
    "auto" (data parallel when it fits, else FSDP2), "fsdp" or "none". ``engine_ranks``: a rollout
    planned with ``generation='none'`` runs on engine ranks of their own, one per node, as the
    manifest launches them (planner.emit), and the plan fits only if they do too; False plans the
    trainer ranks alone (a rollout engine the caller runs and sizes elsewhere).
    """
    fixed = dict(fixed or {})
    source = coefficients_source or ("given" if coefficients is not None else "defaults")
    check_inputs(spec, workload, cluster, fixed, sharding)
    colocated = workload.generation == "vllm" if colocated_vllm is None else colocated_vllm

    # 1. the most frugal settings, sharded only where data parallel does not fit
    search, draft, vllm_notes = _most_frugal(
        spec, workload, cluster, fixed, sharding, colocated, coefficients, margin_fraction, engine_ranks=engine_ranks
    )
    if not search.fits(draft.workload, draft.fsdp):
        est = search.estimate(draft.workload, draft.fsdp)
        suggestions = (
            _suggest(spec, workload, cluster, fixed, sharding, coefficients, margin_fraction, engine_ranks=engine_ranks)
            if suggest
            else []
        )
        over = search.over(est) or [f"{search.gpu_words(est.peak_bytes)} per GPU in phase {est.peak_phase}"]
        draft.note("fits", False, "the most frugal settings need " + "; ".join(over))
        return draft.plan(search, est, fits=False, source=source, suggestions=suggestions)

    # 2. relax, in order of throughput value
    _note_optimizer_offload(search, draft)
    completions = workload.completions_per_rank(cluster.num_gpus // (draft.fsdp.tp if draft.fsdp else 1))
    _choose_micro_batch(search, draft, completions)
    _choose_checkpointing(search, draft)
    if draft.fsdp is not None:
        _choose_gradient_flow(search, draft, completions)
    _choose_rollout_gather(search, draft)
    _choose_logprob_chunk(search, draft)
    if draft.fsdp is not None:
        _choose_unit_sizes(search, draft)
        _choose_experts(search, draft)
    draft.decisions.extend(vllm_notes)
    _choose_vllm_utilization(search, draft)

    est = search.estimate(draft.workload, draft.fsdp)
    if not search.engine_rank_fits:
        suggestions = (
            _suggest(spec, workload, cluster, fixed, sharding, coefficients, margin_fraction, engine_ranks=engine_ranks)
            if suggest
            else []
        )
        draft.note("fits", False, f"the trainers fit, but {_engine_rank_over(search)}")
        return draft.plan(search, est, fits=False, source=source, suggestions=suggestions)
    host, host_limit = "", search.host_limit
    if host_limit is not None:
        node = memory_words(search.node_host(est), host_limit)
        host = f"; {node} of host memory on a node, of {memory_words(host_limit, host_limit)}"
    draft.note(
        "fits",
        True,
        f"peak {search.gpu_words(est.peak_bytes)} per GPU in phase {est.peak_phase}, "
        f"{search.gpu_words(est.headroom_bytes)} headroom of {search.gpu_words(cluster.gpu.memory_bytes)}{host}",
    )
    return draft.plan(search, est, fits=True, source=source, suggestions=[])


def engine_rank_problem(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    *,
    coefficients: Coefficients | None = None,
    margin_fraction: float = MARGIN_FRACTION,
) -> str | None:
    """Why the run's engine ranks of their own cannot fit their GPUs, as plan() judges them, or
    None (also without engine ranks). Nothing chosen for the trainers changes it."""
    search = _Search(spec, cluster, coefficients, margin_fraction, workload=workload, fixed={})
    return None if search.engine_rank_fits else _engine_rank_over(search)


def host_judge(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    *,
    coefficients: Coefficients | None = None,
    margin_fraction: float = MARGIN_FRACTION,
    engine_ranks: bool = True,
) -> Callable[[Estimate], Limit] | None:
    """What plan() judges a node's host by, for any estimate of this run (whatever its FSDPConfig
    and knobs): a function giving the host :class:`Limit` under an estimate (the busiest node's
    need, engine ranks of their own included unless not ``engine_ranks``, as plan()'s; what a
    node's host may hold; the phase where it peaks); None where the host memory is not given.
    The engine ranks are estimated once, here."""
    if cluster.host_memory_per_node_bytes is None:
        return None
    search = _Search(
        spec, cluster, coefficients, margin_fraction, workload=workload, fixed={}, engine_ranks=engine_ranks
    )
    return lambda est: cast(Limit, search.host_limit_of(est))  # given: never None


def host_over_words(need: int, limit: int, phase: str = "") -> str:
    """A host over its limit, as plans and the tuner say it (``phase``: where it peaks, if known)."""
    need_words, limit_words = (memory_words(n, limit) for n in (need, limit))
    return f"{need_words} of host memory on a node{host_phase_words(phase)}, over the {limit_words} available"


def host_phase_words(phase: str) -> str:
    """Where a node's host memory peaks, as plans say it: the save's is rank 0's gathered checkpoint."""
    if not phase:
        return ""
    return " in phase save (rank 0 gathers the checkpoint)" if phase == "save" else f" in phase {phase}"


def _engine_rank_over(search: _Search) -> str:
    """Why the engine ranks of their own do not fit."""
    engine = _engine_limit(search.engine_rank, search.limit, search.workload, search.cluster)
    assert engine is not None
    return engine.words()


def plan_request(
    spec: ModelSpec,
    request: PlanRequest,
    *,
    coefficients: Coefficients | None = None,
    coefficients_source: str | None = None,
    suggest: bool = True,
) -> Plan:
    """:func:`plan` for a validated request, with the coefficients its GPU gets unless given
    (:func:`planner.calibration.coefficients_for`: the user's calibration for the GPU kind, else the
    shipped ones); the request's own decisions are reported after the plan's."""
    if coefficients is None:
        coefficients = calibration.coefficients_for(request.cluster.gpu)
        coefficients_source = coefficients_source or calibration.coefficients_source(request.cluster.gpu)
    result = plan(
        spec,
        request.workload,
        request.cluster,
        fixed=dict(request.fixed),
        sharding=request.sharding,
        coefficients=coefficients,
        coefficients_source=coefficients_source,
        margin_fraction=request.margin_fraction,
        suggest=suggest,
    )
    if request.decisions:
        result = result.model_copy(update={"decisions": (*result.decisions, *request.decisions)})
    return result


def _most_frugal(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    fixed: dict[str, Any],
    sharding: str,
    colocated: bool,
    coefficients: Coefficients | None,
    margin_fraction: float,
    *,
    engine_ranks: bool = True,
) -> tuple[_Search, _Draft, list[Decision]]:
    """What plan() starts from, and judges a fit by: the open knobs at their most frugal, the
    colocated engine at the least it starts with, sharded only where data parallel does not fit."""
    search = _Search(
        spec, cluster, coefficients, margin_fraction, workload=workload, fixed=fixed, engine_ranks=engine_ranks
    )
    draft = _Draft(_frugal_workload(workload))
    vllm_notes: list[Decision] = []
    if workload.generation == "vllm":
        draft.workload, vllm_notes = _vllm_frugal(spec, draft.workload, cluster, fixed)
    draft.fsdp = _choose_sharding(search, draft, sharding, colocated)
    return search, draft, vllm_notes


def _frugal_workload(workload: Workload) -> Workload:
    """The user's workload with the knobs left open at their most frugal: one example per
    micro-batch, the smallest log-prob chunk, checkpointing on."""
    return workload.model_copy(
        update=dict(
            micro_batch_size_per_gpu=workload.micro_batch_size_per_gpu or (2 if workload.algorithm == "dpo" else 1),
            logprob_chunk_size=workload.logprob_chunk_size or LOGPROB_CHUNKS[0],
            gradient_checkpointing=True if workload.gradient_checkpointing is None else workload.gradient_checkpointing,
        )
    )


def _choose_sharding(search: _Search, draft: _Draft, sharding: str, colocated: bool) -> FSDPConfig | None:
    """The most frugal FSDPConfig (:func:`_frugal_fsdp`) where the run shards with FSDP2: asked
    for, FSDPConfig fields given, or data parallel does not fit; on one GPU, only where FSDP2's
    offload to the host then fits. None: unsharded."""
    fixed, gpus = search.fixed, search.cluster.num_gpus
    if sharding == "none":
        return None
    if sharding == "fsdp":
        return _frugal_fsdp(search, draft, colocated)
    if fixed:
        draft.note("sharding", "fsdp", f"FSDPConfig fields were given ({', '.join(sorted(fixed))})")
        return _frugal_fsdp(search, draft, colocated)
    unsharded = search.estimate(draft.workload, None)
    need = unsharded.peak_bytes
    if need <= search.limit and search.host_fits(unsharded):
        if gpus == 1:
            draft.note("sharding", "none", "one device: no sharding needed")
        else:
            draft.note("sharding", "data parallel", "the whole actor fits on each GPU, so no weight gathers are needed")
        return None
    why = "; ".join(search.over(unsharded, engine=False))
    if gpus > 1:
        draft.note("sharding", "fsdp", f"unsharded it needs {why}")
        return _frugal_fsdp(search, draft, colocated)
    trial = _Draft(draft.workload)  # its notes join the plan's only if it is taken
    offloaded = _frugal_fsdp(search, trial, colocated)
    how = (
        "keeping the optimizer (or the parameters) on the host"
        if offloaded.optim_cpu_offload or offloaded.cpu_offload
        # FSDP2's load reads a shard's tensors one at a time, where from_pretrained builds the
        # whole model on the host: what a host too small for one copy of the model needs
        else "loading the weights a tensor at a time through the host"
    )
    if not search.fits(draft.workload, offloaded):
        # neither fits: the nearer to fitting, its GPU first (what the plan then reports)
        if search.excess(draft.workload, None) <= search.excess(draft.workload, offloaded):
            draft.note("sharding", "none", f"one device: unsharded it needs {why}, and offloading does not fit")
            return None
        draft.note(
            "sharding",
            "fsdp",
            f"one device: unsharded it needs {why}; FSDP2 {how} comes nearer to fitting",
        )
        draft.decisions.extend(trial.decisions)
        return offloaded
    draft.note(
        "sharding",
        "fsdp",
        f"unsharded it needs {why}: FSDP2 on one GPU, {how}",
    )
    draft.decisions.extend(trial.decisions)
    return offloaded


def _frugal_fsdp(search: _Search, draft: _Draft, colocated: bool) -> FSDPConfig:
    """The most frugal FSDPConfig: resharding, one block a unit, prefetch 1, the smallest expert
    chunk; then, each only when what came before does not fit: a reduce-scatter every
    micro-batch, expert parallelism, Adam on the host (with each expert-parallel degree too),
    and parameter offload. Where nothing fits, the combination nearest to fitting (:meth:`_Search.excess`)."""
    spec, fixed, workload, frugal = search.spec, search.fixed, search.workload, draft.workload
    # Deferred gradient sync holds every unsharded gradient between micro-batches (the whole
    # model's with full fine-tuning): full fine-tuning starts without it; LoRA starts with it
    # (its adapters are small) and drops it before anything costlier. _choose_gradient_flow
    # takes it back where it fits.
    base: dict[str, Any] = dict(
        reshard_after_forward=True,
        wrap_every_n_blocks=1,
        prefetch_units=1,
        backward_prefetch_units=1,
        optim_cpu_offload=False,
        cpu_offload=False,
        shard_group_size=None,
        defer_grad_sync=not workload.full_finetune,
    )
    # the row-wise experts in chunks: far below PEFT's merged expert stacks
    row_wise = search.row_wise
    if row_wise:
        base["routed_expert_chunk_mib"] = EXPERT_CHUNKS_MIB[0]
    base.update(fixed)
    fsdp = FSDPConfig(**base)
    if search.fits(frugal, fsdp):
        return fsdp
    if "defer_grad_sync" not in fixed and fsdp.defer_grad_sync:
        fsdp = fsdp.model_copy(update={"defer_grad_sync": False})
    # Expert parallel (each rank gathers E / ep experts, sharded over world / ep ranks), then
    # Adam on the host, alone and with each degree: the first that fits, in that order.
    degrees = [1] + (_expert_parallel_degrees(spec, search.cluster) if row_wise and "ep" not in fixed else [])
    offloads = [False] + ([True] if "optim_cpu_offload" not in fixed and not fsdp.cpu_offload else [])
    candidates = [
        fsdp.model_copy(
            update={"optim_cpu_offload": fsdp.optim_cpu_offload or offload, "ep": fsdp.ep if ep == 1 else ep}
        )
        for offload in offloads
        for ep in degrees
    ]
    # each judged once; where none fits, the one nearest to fitting (its GPUs first, then its host)
    excess: dict[int, tuple[float, float]] = {}

    def over(i: int) -> tuple[float, float]:
        if i not in excess:
            excess[i] = search.excess(frugal, candidates[i])
        return excess[i]

    fitting = next((c for i, c in enumerate(candidates) if over(i) == (0, 0)), None)
    fsdp = fitting if fitting is not None else candidates[min(range(len(candidates)), key=over)]
    if fsdp.ep > 1 and "ep" not in fixed:
        draft.note(
            "ep", fsdp.ep, f"experts split over {fsdp.ep} GPUs: each gathers {1 / fsdp.ep:.3g} of a layer's experts"
        )
    # cpu_offload parks the weights on the host: only where Hugging Face generate does not need
    # them, and not beside offload_weights_during_rollout (which parks them itself)
    offloadable = (colocated or workload.algorithm in OFFLINE_SEQUENCES) and not workload.offload_weights_during_rollout
    if fitting is None and offloadable and "cpu_offload" not in fixed and not workload.load_in_4bit:
        candidate = fsdp.model_copy(update={"cpu_offload": True, "optim_cpu_offload": False})
        if search.fits(frugal, candidate):
            fsdp = candidate
            draft.note("cpu_offload", True, "last resort: parameters and gradients on the host; nothing else fits")
    return fsdp


def _note_optimizer_offload(search: _Search, draft: _Draft) -> None:
    """Say where Adam's state went (the frugal FSDPConfig moved it to the host only if it had to)."""
    fsdp = draft.fsdp
    if fsdp is None or fsdp.cpu_offload or "optim_cpu_offload" in search.fixed:
        return
    if fsdp.optim_cpu_offload:
        on_gpu = search.estimate(draft.workload, fsdp.model_copy(update={"optim_cpu_offload": False})).peak_bytes
        draft.note(
            "optim_cpu_offload",
            True,
            f"Adam state on the GPU would need {search.gpu_words(on_gpu)} per GPU; on the host it fits",
        )
    else:
        draft.note("optim_cpu_offload", False, "Adam state fits on the GPU (fused AdamW there is fastest)")


def _choose_micro_batch(search: _Search, draft: _Draft, completions: int) -> None:
    """The largest micro-batch dividing a rank's completions (whole examples) that fits."""
    workload = search.workload
    if workload.micro_batch_size_per_gpu is not None:
        return
    choices = [mb for mb in _divisors(completions) if workload.micro_batch_fits_examples(mb)]
    best = choices[0]
    for mb in choices:
        if search.fits(draft.trying(micro_batch_size_per_gpu=mb), draft.fsdp):
            best = mb
    draft.workload = draft.trying(micro_batch_size_per_gpu=best)
    draft.note(
        "micro_batch_size_per_gpu",
        best,
        f"the largest divisor of the {completions} completions per GPU that fits"
        if best < completions
        else f"all {completions} completions per GPU in one micro-batch fit",
    )


def _choose_checkpointing(search: _Search, draft: _Draft) -> None:
    """Checkpointing off when every block's activations fit."""
    if search.workload.gradient_checkpointing is not None:
        return
    off = draft.trying(gradient_checkpointing=False)
    if search.fits(off, draft.fsdp):
        draft.workload = off
        draft.note("gradient_checkpointing", False, "activations of every block fit: no recompute in backward")
    else:
        without = search.estimate(off, draft.fsdp)
        draft.note(
            "gradient_checkpointing",
            True,
            f"without it the {without.peak_phase} phase needs {search.gpu_words(without.peak_bytes)}",
        )


def _choose_gradient_flow(search: _Search, draft: _Draft, completions: int) -> None:
    """FSDP2's sharding and gathers: node-local shard groups (HSDP), deferred gradient sync,
    and no resharding between forward and backward, each where it fits."""
    fixed, cluster, current = search.fixed, search.cluster, draft.workload
    fsdp = draft.fsdp
    assert fsdp is not None
    per_node = cluster.per_node
    if "shard_group_size" not in fixed and cluster.num_nodes > 1 and (fsdp.tp > 1 or fsdp.ep > 1):
        parallel = f"tp={fsdp.tp}" if fsdp.tp > 1 else f"ep={fsdp.ep}"
        draft.note("shard_group_size", None, f"HSDP does not combine with {parallel} yet: sharding across all GPUs")
    elif "shard_group_size" not in fixed and cluster.num_nodes > 1:
        hsdp = fsdp.model_copy(update={"shard_group_size": per_node})
        if search.fits(current, hsdp):
            fsdp = hsdp
            draft.note(
                "shard_group_size",
                per_node,
                f"weights sharded within a node of {per_node} GPUs fit, so "
                "all-gathers stay on the node's fast links (HSDP)",
            )
        else:
            draft.note("shard_group_size", None, f"sharding only within a node of {per_node} GPUs does not fit")
    elif "shard_group_size" not in fixed:
        draft.note("shard_group_size", None, "one node: sharding across all its GPUs")
    micro_batches = completions // resolved(current.micro_batch_size_per_gpu, "micro_batch_size_per_gpu")
    if "defer_grad_sync" not in fixed and micro_batches == 1:
        fsdp = fsdp.model_copy(update={"defer_grad_sync": True})  # one micro-batch: nothing to defer (the default)
    elif "defer_grad_sync" not in fixed:
        defer = fsdp.model_copy(update={"defer_grad_sync": True})
        if fsdp.defer_grad_sync or search.fits(current, defer):
            fsdp = defer
            draft.note(
                "defer_grad_sync",
                True,
                f"the {micro_batches} micro-batches' unsharded gradients fit until "
                "the last one reduce-scatters them: one reduce-scatter per step",
            )
        else:
            need = search.estimate(current, defer).peak_bytes
            draft.note(
                "defer_grad_sync",
                False,
                f"holding every unsharded gradient between micro-batches would "
                f"need {search.gpu_words(need)}: each micro-batch reduce-scatters",
            )
    if "reshard_after_forward" not in fixed:
        keep = fsdp.model_copy(update={"reshard_after_forward": False})
        if search.fits(current, keep):
            fsdp = keep
            draft.note(
                "reshard_after_forward",
                False,
                "every unit can stay gathered from forward to backward: no second all-gather",
            )
        else:
            draft.note("reshard_after_forward", True, "keeping all units gathered does not fit")
    draft.fsdp = fsdp


def _choose_rollout_gather(search: _Search, draft: _Draft) -> None:
    """gather_weights_for_rollout under Hugging Face generate, where it fits.

    Unsharded: a merged copy of each adapted linear; under FSDP2: every unit gathered at once
    (with reshard_after_forward=False generate's forwards would keep them gathered anyway, but
    only gathering once lets it run LoRA merged and without per-token synced steps).
    """
    workload = search.workload
    if workload.generation != "hf" or workload.gather_weights_for_rollout is not None:
        return
    once = draft.trying(gather_weights_for_rollout=True)
    fits = search.fits(once, draft.fsdp)
    draft.workload = once if fits else draft.trying(gather_weights_for_rollout=False)
    if draft.fsdp is None:
        draft.note(
            "gather_weights_for_rollout",
            fits,
            "a merged copy of every adapted linear fits beside "
            "generation's KV cache: one matmul per linear per token, not three"
            if fits
            else "LoRA stays unmerged in generation: a merged copy of the adapted weights does not fit beside "
            "the KV cache",
        )
    else:
        draft.note(
            "gather_weights_for_rollout",
            fits,
            "every unit gathered at once fits beside generation's KV "
            "cache: one all-gather per unit per rollout, not one per token"
            if fits
            else "generation re-gathers unit by unit: all units at once do not fit beside the KV cache",
        )


def _choose_logprob_chunk(search: _Search, draft: _Draft) -> None:
    """The largest log-prob chunk whose logits workspace fits."""
    if search.workload.logprob_chunk_size is not None:
        return
    best = LOGPROB_CHUNKS[0]
    for chunk in LOGPROB_CHUNKS:
        if search.fits(draft.trying(logprob_chunk_size=chunk), draft.fsdp):
            best = chunk
    draft.workload = draft.trying(logprob_chunk_size=best)
    draft.note("logprob_chunk_size", best, "the largest log-prob chunk (token rows) whose logits workspace fits")


def _choose_unit_sizes(search: _Search, draft: _Draft) -> None:
    """Bigger FSDP units (2 or 4 blocks) and deeper prefetch, where they fit."""
    fixed, current, fsdp = search.fixed, draft.workload, draft.fsdp
    assert fsdp is not None
    if "wrap_every_n_blocks" not in fixed:
        best = 1
        for wrap in (2, 4):
            if wrap <= search.spec.num_layers and search.fits(
                current, fsdp.model_copy(update={"wrap_every_n_blocks": wrap})
            ):
                best = wrap
        fsdp = fsdp.model_copy(update={"wrap_every_n_blocks": best})
        draft.note("wrap_every_n_blocks", best, "fewer, bigger collectives" if best > 1 else "bigger units do not fit")
    for name in ("prefetch_units", "backward_prefetch_units"):
        if name in fixed:
            continue
        deeper = fsdp.model_copy(update={name: 2})
        if search.fits(current, deeper):
            fsdp = deeper
            draft.note(name, 2, "a second unit in flight fits: more overlap of gathers with compute")
        else:
            draft.note(name, 1, "only one neighbouring unit fits in flight")
    draft.fsdp = fsdp


def _choose_experts(search: _Search, draft: _Draft) -> None:
    """The largest expert chunk that fits (FSDPConfig.routed_expert_chunk_mib's documented choice),
    and why ep is what it is."""
    spec, fixed, fsdp = search.spec, search.fixed, draft.fsdp
    assert fsdp is not None
    row_wise = search.row_wise
    if row_wise and "routed_expert_chunk_mib" not in fixed:
        best = EXPERT_CHUNKS_MIB[0]
        for chunk in EXPERT_CHUNKS_MIB[1:]:
            if search.fits(draft.workload, fsdp.model_copy(update={"routed_expert_chunk_mib": chunk})):
                best = chunk
        fsdp = draft.fsdp = fsdp.model_copy(update={"routed_expert_chunk_mib": best})
        draft.note(
            "routed_expert_chunk_mib",
            best,
            "the largest of 64/128/256/512 MiB whose expert chunk fits: fewer kernel launches per MoE layer"
            if best > EXPERT_CHUNKS_MIB[0]
            else "only the smallest expert chunk fits",
        )
    if row_wise and "ep" not in fixed and not any(d.field == "ep" for d in draft.decisions):
        draft.note("ep", fsdp.ep, "every rank holds a shard of every expert: no all-to-all needed")
    if spec.is_moe and not row_wise:
        draft.note(
            "ep",
            fsdp.ep,
            "Hugging Face's expert loop runs the experts (their layout has no "
            "expert parallel or chunked experts here): ep=1, routed_expert_chunk_mib unset",
        )


def _choose_vllm_utilization(search: _Search, draft: _Draft) -> None:
    """The colocated engine's gpu_memory_utilization: the largest that leaves training within budget."""
    workload = search.workload
    if (
        workload.generation != "vllm"
        or workload.vllm_gpu_memory_utilization is not None
        or workload.vllm_kv_cache_memory_bytes is not None
    ):
        return
    floor = resolved(draft.workload.vllm_gpu_memory_utilization, "vllm_gpu_memory_utilization")
    for util in VLLM_UTILIZATIONS:
        if util > floor and search.fits(draft.trying(vllm_gpu_memory_utilization=util), draft.fsdp):
            draft.workload = draft.trying(vllm_gpu_memory_utilization=util)
            break
    chosen = resolved(draft.workload.vllm_gpu_memory_utilization, "vllm_gpu_memory_utilization")
    draft.note(
        "vllm_gpu_memory_utilization",
        chosen,
        "the largest fraction (in 0.05 steps, at most 0.9) with training and sync within budget: the "
        "engine's KV cache takes what training leaves"
        if chosen > floor
        else "the least the engine starts with (its weights and one sequence's KV cache); no larger fraction fits",
    )


def suggest_fixes(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    *,
    fixed: dict[str, Any] | None = None,
    sharding: str = "auto",
    coefficients: Coefficients | None = None,
    margin_fraction: float = MARGIN_FRACTION,
    engine_ranks: bool = True,
) -> list[str]:
    """The smallest changes that would make a plan fit (what plan() reports when nothing does)."""
    return _suggest(
        spec, workload, cluster, dict(fixed or {}), sharding, coefficients, margin_fraction, engine_ranks=engine_ranks
    )


def _suggest(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    fixed: dict[str, Any],
    sharding: str,
    coefficients: Coefficients | None,
    margin_fraction: float,
    *,
    engine_ranks: bool = True,
) -> list[str]:
    """The smallest changes that make a plan fit, by kind. Each is judged as plan() judges the
    run it describes: the same checks the command line makes of its inputs (a batch that splits
    over the GPUs, whole prompts per GPU, an engine budget it starts with), then the most frugal
    settings plan() starts from (:func:`_most_frugal`), so that applying one gives a plan that fits."""
    out: list[str] = []

    def taken(wl: Workload, cl: Cluster, how: str = sharding, margin_of: float = margin_fraction) -> Workload | None:
        """The workload validated where the command line takes the run, else None."""
        try:  # model_copy does not validate: a combination the trainer refuses is no suggestion
            wl = Workload.model_validate(wl.model_dump())
            request = PlanRequest(cluster=cl, workload=wl, fixed=fixed, sharding=how, margin_fraction=margin_of)
            if request.manifest_problem() is not None:
                return None
            check_inputs(spec, wl, cl, fixed, how)
        except ValueError:
            return None
        return wl

    def feasible(wl: Workload, cl: Cluster, how: str = sharding, margin_of: float = margin_fraction) -> bool:
        checked = taken(wl, cl, how, margin_of)
        if checked is None:
            return False
        try:
            colocated = checked.generation == "vllm"
            search, draft, _ = _most_frugal(
                spec, checked, cl, fixed, how, colocated, coefficients, margin_of, engine_ranks=engine_ranks
            )
            return search.engine_rank_fits and search.fits(draft.workload, draft.fsdp)
        except ValueError:
            return False

    # a node's host holds every rank's process at least: no more ranks than that on one node
    host, process = _host_limit(cluster, margin_fraction), (coefficients or Coefficients()).host_process_bytes
    most = None if host is None or not process else host // process
    if (gpus := _fewest_gpus(workload, cluster, feasible, taken, most_per_node=most)) is not None:
        cl, whole = _on_gpus(workload, cluster, gpus)
        where = f" ({cl.num_nodes} nodes of {cl.per_node})" if cl.num_nodes > 1 else ""
        more = f" with prompts_per_step={whole.prompts_per_step}" if whole != workload else ""
        out.append(f"use {gpus} GPUs{where}{more}")
    if cluster.host_memory_per_node_bytes is not None and (need := _least_host_gib(cluster, workload, feasible)):
        out.append(f"give each node at least {need} GiB of host memory (--host-memory {need})")
    tp = int(fixed.get("tp", 1) or 1)  # a tensor-parallel group takes its prompts together
    if (micro := _largest_micro_cut(workload, cluster, feasible, tp=tp)) is not None:
        out.append(f"use micro_batch_size_per_gpu={micro}")
    if sharding == "none" and feasible(workload, cluster, "fsdp"):
        out.append("shard with FSDP2 (sharding='fsdp', or 'auto' to let the plan decide)")
    if workload.full_finetune:
        wl = workload.model_copy(update={"full_finetune": False})
        if feasible(wl, cluster):
            out.append("train LoRA adapters instead of every parameter (full_finetune=False)")
    elif not workload.load_in_4bit:
        wl = workload.model_copy(update={"load_in_4bit": True})
        if feasible(wl, cluster):
            out.append("use QLoRA (load_in_4bit=True)")
    rank = workload.lora_rank
    while not workload.full_finetune and rank > 8:
        rank //= 2
        if feasible(workload.model_copy(update={"lora_rank": rank}), cluster):
            out.append(f"use a smaller LoRA rank (lora_rank={rank})")
            break
    if workload.generation == "vllm":
        # A colocated engine takes its fraction of the GPU while awake: the fix GRPO users are
        # given is a smaller fraction (down to a tenth), or parking the trainer's weights.
        # (left to the planner, or a KV cache size given, the fraction is already the least that works)
        util = workload.vllm_gpu_memory_utilization
        steps = (
            []
            if util is None or workload.vllm_kv_cache_memory_bytes is not None
            else [round(util - 0.05 * i, 2) for i in range(1, 40) if util - 0.05 * i >= 0.1 - 1e-9]
        )
        for lower in steps:
            if feasible(workload.model_copy(update={"vllm_gpu_memory_utilization": lower}), cluster):
                out.append(f"lower vllm_gpu_memory_utilization to {lower:.2f}")
                break
        kv = workload.vllm_kv_cache_memory_bytes
        while kv is not None and kv > 256 * MIB:  # a KV cache size the user gave: halve it
            kv //= 2
            if feasible(workload.model_copy(update={"vllm_kv_cache_memory_bytes": kv}), cluster):
                out.append(f"lower vllm_kv_cache_memory_bytes to {kv / GIB:.2f} GiB ({kv})")
                break
        if not workload.offload_weights_during_rollout:
            wl = workload.model_copy(update={"offload_weights_during_rollout": True})
            if feasible(wl, cluster):
                out.append(
                    "set offload_weights_during_rollout=True (the trainer's weights wait on the host "
                    "while the engine generates)"
                )
        # without an engine beside the trainer: Hugging Face generate on the actor's own weights
        # (slower, but it takes no fraction of the GPU)
        defaults = Workload()
        engine_fields = {
            k: getattr(defaults, k)
            for k in Workload.model_fields
            if k.startswith("vllm_") or k == "offload_weights_during_rollout"
        }
        wl = workload.model_copy(update={**engine_fields, "generation": "hf"})
        if feasible(wl, cluster):
            # the engine's own settings go with it: generation='hf' beside one is refused
            given = [k for k, default in engine_fields.items() if getattr(workload, k) != default]
            dropped = f", without {', '.join(given)}" if given else ""
            out.append(
                f"generate with Hugging Face generate instead of a colocated vLLM engine (generation='hf'{dropped})"
            )
    if engine_ranks and engine_rank_count(workload, cluster):
        # the rollout on the trainer GPUs instead of engine ranks holding the whole model each
        for generation, how in (("vllm", "a colocated vLLM engine"), ("hf", "Hugging Face generate")):
            if feasible(workload.model_copy(update={"generation": generation}), cluster):
                out.append(f"generate on the trainer GPUs with {how} (generation='{generation}')")
                break
    if workload.generation == "hf":
        # generate holds every completion of a rank's rollout at once; a colocated engine pages
        # its KV cache within a fixed budget
        wl = workload.model_copy(update={"generation": "vllm"})
        if feasible(wl, cluster):
            out.append("generate with a colocated vLLM engine (generation='vllm')")
    if margin_fraction > MARGIN_FRACTION and feasible(workload, cluster, margin_of=MARGIN_FRACTION):
        out.append(f"keep the default safety margin (margin_fraction={MARGIN_FRACTION}, --margin {MARGIN_FRACTION})")
    if (fewer := _fewest_prompts_cut(workload, cluster, feasible, tp=tp)) is not None:
        out.append(f"use prompts_per_step={fewer} (fewer completions per rank)")
    if (smaller := _largest_group_cut(workload, cluster, feasible, tp=tp)) is not None:
        out.append(f"use group_size={smaller} (fewer completions per prompt)")
    for key, what in (("completion_tokens", "completions"), ("prompt_tokens", "prompts")):
        if (length := _longest_cut(workload, cluster, feasible, key)) is not None:
            out.append(f"shorten {what} to {length} tokens ({key}={length})")
    if not out:
        out.append("nothing nearby fits: a smaller model, or GPUs with more memory")
    return out


def _on_gpus(workload: Workload, cluster: Cluster, gpus: int) -> tuple[Cluster, Workload]:
    """The cluster with ``gpus`` GPUs (nodes of the cluster's size, or one node of fewer) and the
    workload with every GPU taking whole prompts: as many more prompts as that takes."""
    per = cluster.gpus_per_node
    cl = cluster.model_copy(update={"num_gpus": gpus, "gpus_per_node": min(per, gpus) if per else None})
    whole = -(-workload.prompts_per_step // gpus) * gpus
    return cl, workload if whole == workload.prompts_per_step else workload.model_copy(
        update={"prompts_per_step": whole}
    )


def _fewest_gpus(
    workload: Workload,
    cluster: Cluster,
    feasible: Callable[[Workload, Cluster], bool],
    taken: Callable[[Workload, Cluster], Workload | None],
    *,
    most_per_node: int | None = None,
) -> int | None:
    """The fewest GPUs above the cluster's with which the run fits (None where not even 64 times
    as many do), among the counts a cluster of its nodes can have (any count within one node,
    whole nodes beyond it) that the command line takes (a tp, ep or micro batch the user fixed
    refuses some).

    Memory per GPU only falls with the count (everything sharded is sharded finer, and each GPU
    takes no more prompts), so the fewest count whose GPUs hold the run is found by doublings and
    a bisection (:func:`_fewest_rising`). A node's host memory is not monotone in it: within one
    node it holds every rank's process, so it rises with the count, until enough GPUs let the run
    drop an offload the fewer needed. So with the host judged, a count the host refuses is
    followed by the node's counts above it, one by one, to the first that fits: up to the node's
    GPUs (with no node size given the whole cluster is one node) and to ``most_per_node`` (the
    ranks whose processes alone the host holds); only where none fits are the counts past them
    searched. Past one node every node keeps its GPUs and takes a finer shard as nodes are added,
    so there the bisection holds."""

    def fits(gpus: int, on: Cluster = cluster) -> bool:
        cl, wl = _on_gpus(workload, on, gpus)
        return feasible(wl, cl)

    def takes(gpus: int) -> bool:
        cl, wl = _on_gpus(workload, cluster, gpus)
        return taken(wl, cl) is not None

    if cluster.host_memory_per_node_bytes is None:
        return _fewest_rising(cluster, fits, takes)
    unjudged = cluster.model_copy(update={"host_memory_per_node_bytes": None})
    least = _fewest_rising(cluster, lambda gpus: fits(gpus, unjudged), takes)
    if least is None or fits(least):
        return least
    most = 64 * cluster.num_gpus
    node = min(cluster.gpus_per_node or most, most if most_per_node is None else most_per_node)
    in_node = next((gpus for gpus in range(least + 1, node + 1) if takes(gpus) and fits(gpus)), None)
    return in_node if in_node is not None else _fewest_rising(cluster, fits, takes)  # past the host's refusals


def _fewest_rising(cluster: Cluster, fits: Callable[[int], bool], takes: Callable[[int], bool]) -> int | None:
    """The fewest GPUs above the cluster's, among the counts of :func:`_fewest_gpus`, for which
    ``fits`` holds, where it holds of every count above one that fits: doublings (in whole nodes
    past one node) until one fits, then a bisection down to the count above the last one tried
    that did not (None where not even 64 times the cluster's fits)."""
    per = cluster.gpus_per_node
    below, gpus = cluster.num_gpus, cluster.num_gpus
    while True:
        gpus *= 2
        if per and gpus > per:
            gpus = -(-gpus // per) * per  # whole nodes
        if gpus > 64 * cluster.num_gpus:
            return None
        if not takes(gpus):
            continue
        if fits(gpus):
            break
        below = gpus
    step = per or gpus
    # the counts between, largest first: whole nodes, then (below one node) any count
    counts = [*range(gpus - step, max(below, step - 1), -step), *range(min(gpus, step) - 1, below, -1)]
    found = _last_that_fits(0, len(counts) - 1, lambda i: fits(counts[i]), taken=lambda i: takes(counts[i]))
    return gpus if found is None else counts[found]


def _least_host_gib(cluster: Cluster, workload: Workload, feasible: Callable[[Workload, Cluster], bool]) -> int | None:
    """The least whole GiB of host memory per node above the cluster's with which the run fits,
    or None where it does not fit with the host not judged either: doubling, then a binary search
    (more host only adds choices: data parallel, offloading)."""
    given = cluster.host_memory_per_node_bytes
    assert given is not None
    if not feasible(workload, cluster.model_copy(update={"host_memory_per_node_bytes": None})):
        return None

    def fits(gib: int) -> bool:
        return feasible(workload, cluster.model_copy(update={"host_memory_per_node_bytes": gib * GIB}))

    low = given // GIB  # whole GiB that do not fit (the host given, rounded down, does not)
    high = max(low + 1, 2 * low)
    while not fits(high):
        if high >= MAX_MEMORY_GIB:
            return None
        low, high = high, min(2 * high, MAX_MEMORY_GIB)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _largest_micro_cut(
    workload: Workload, cluster: Cluster, feasible: Callable[[Workload, Cluster], bool], *, tp: int
) -> int | None:
    """The largest micro batch below the one the user fixed that fits (None if none was fixed, or
    even the most frugal does not fit), among the sizes the run takes: those that divide a rank's
    completions (48 completions and a given 16: 12 is one), down to the most frugal the plan
    starts from."""
    given = workload.micro_batch_size_per_gpu
    least = _frugal_workload(workload.model_copy(update={"micro_batch_size_per_gpu": None})).micro_batch_size_per_gpu
    if not given or least is None or given <= least:
        return None
    try:
        completions = workload.completions_per_rank(max(1, cluster.num_gpus // tp))
    except ValueError:
        return None  # examples that do not split over the ranks: no micro batch makes it fit
    sizes = [m for m in _divisors(completions) if least <= m < given and workload.micro_batch_fits_examples(m)]
    found = _last_that_fits(
        0,
        len(sizes) - 1,
        lambda i: feasible(workload.model_copy(update={"micro_batch_size_per_gpu": sizes[i]}), cluster),
    )
    return None if found is None else sizes[found]


def _longest_cut(
    workload: Workload, cluster: Cluster, feasible: Callable[[Workload, Cluster], bool], key: str
) -> int | None:
    """The longest ``key`` (prompt or completion tokens) below the workload's that fits, or None
    where even 16 tokens do not: halvings until one fits, then a bisection up from it in steps of
    an eighth of the largest power of two in that length (64 tokens from 512 or 1000: 576, 640,
    ...; 32 from 500)."""
    length = getattr(workload, key)
    while length > 16:
        length //= 2
        if feasible(workload.model_copy(update={key: length}), cluster):
            step = max(1, 2 ** (length.bit_length() - 1) // 8)
            return _largest_cut(workload, cluster, feasible, key, step, length) or length
    return None


def _largest_group_cut(
    workload: Workload, cluster: Cluster, feasible: Callable[[Workload, Cluster], bool], *, tp: int = 1
) -> int | None:
    """The largest group_size below the workload's that fits (None if even the least does not, or
    the algorithm fixes its sequences per example), on the sizes whose completions split over the
    data-parallel ranks (the GPUs, or their groups under ``tp``; and over a micro batch the user
    fixed). PPO takes groups of 1; the group-relative objectives at least 2."""
    if workload.algorithm in OFFLINE_SEQUENCES:
        return None
    ranks = max(1, cluster.num_gpus // tp) * (workload.micro_batch_size_per_gpu or 1)
    step = ranks // math.gcd(ranks, workload.prompts_per_step)
    least = 1 if workload.algorithm == "ppo" else 2
    return _largest_cut(workload, cluster, feasible, "group_size", step, least)


def _fewest_prompts_cut(
    workload: Workload, cluster: Cluster, feasible: Callable[[Workload, Cluster], bool], *, tp: int = 1
) -> int | None:
    """The largest prompts_per_step below the workload's that fits (None if even the fewest
    does not)."""
    # The counts a run can take: whole prompts on every data-parallel rank (every GPU, or every
    # group of a tp the user fixed: PlanRequest.manifest_problem), and with a micro batch the
    # user fixed, completions per rank it divides (between them the plan is refused, not short
    # of memory, and a bisection needs the fits to fall only with the count).
    step = max(1, cluster.num_gpus // tp)
    if micro := workload.micro_batch_size_per_gpu:
        step *= micro // math.gcd(micro, workload.group_size)
    return _largest_cut(workload, cluster, feasible, "prompts_per_step", step, 1)


def _largest_cut(
    workload: Workload,
    cluster: Cluster,
    feasible: Callable[[Workload, Cluster], bool],
    field: str,
    step: int,
    least: int,
) -> int | None:
    """The largest multiple of ``step``, at least ``least`` and below the workload's ``field``,
    with which the run fits (None if none does): a bisection on the multiple, since memory only
    falls with the count, and never a list of counts (one may be astronomically large)."""
    found = _last_that_fits(
        -(-least // step),
        (getattr(workload, field) - 1) // step,
        lambda multiple: feasible(workload.model_copy(update={field: multiple * step}), cluster),
    )
    return None if found is None else found * step


def _last_that_fits(
    lo: int, hi: int, fits: Callable[[int], bool], *, taken: Callable[[int], bool] | None = None
) -> int | None:
    """The largest ``i`` in ``lo..hi`` with ``fits(i)`` (None if none), by bisection: the
    callers' candidates grow with ``i`` and memory only rises with them. With ``taken``, only the
    candidates it takes are judged: from the middle, the nearest one taken (a refused run is not
    one short of memory, and judged as one it would end the bisection on the wrong side)."""
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if taken is not None:
            near = (k for d in range(hi - lo + 1) for k in ((mid - d, mid + d) if d else (mid,)) if lo <= k <= hi)
            if (mid := next((k for k in near if taken(k)), -1)) < 0:
                break
        if fits(mid):
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    return found
