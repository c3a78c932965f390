"""plan(...): pick the FSDPConfig choices the docs leave to "the memory estimate".

Strategy, deterministic and fast (tens of estimates, a few ms each):

1. Data parallel (no sharding) when the whole actor fits on every GPU with the
   margin: it needs no weight gathers. Otherwise FSDP2.
2. Start from the most frugal settings (reshard after forward, one block per
   unit, prefetch 1, micro-batch 1, checkpointing on, the smallest log-prob
   chunk, Adam state on the GPU unless only the host can hold it, for full
   fine-tuning a reduce-scatter every micro-batch; for MoE
   models the smallest expert chunk, and expert parallelism only when the
   experts' gathered weights do not fit without it; CPU parameter offload
   only as a last resort and only where Hugging Face generate does not run:
   with a colocated vLLM, or for SFT and DPO).
3. Relax one knob at a time, in order of what it buys in throughput, keeping
   the estimated peak under capacity minus a safety margin: Adam on the GPU,
   the largest micro-batch, no checkpointing, node-local sharding (HSDP),
   deferred gradient sync, no resharding, the largest log-prob chunk, bigger units, deeper prefetch,
   and for MoE models the largest expert chunk of 64/128/256/512 MiB that
   fits (FSDPConfig.routed_expert_chunk_mib's documented choice).

Fields the user fixed are never changed. When nothing fits, the plan says so
and names the smallest changes that would.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from agilerl.distributed import FSDPConfig

from .hardware import GIB, MARGIN_FRACTION, Cluster
from .memory import (
    EXPERT_CHUNKS_MIB,
    Coefficients,
    Estimate,
    check_ep,
    estimate,
    expert_parallel_degrees,
    row_wise_experts,
    tp_problem,
    vllm_floor,
)
from .spec import ModelSpec
from .workload import OFFLINE_SEQUENCES, Workload

__all__ = ["Decision", "Plan", "plan", "check_inputs", "suggest_fixes", "LOGPROB_CHUNKS", "EXPERT_CHUNKS_MIB"]

LOGPROB_CHUNKS = (256, 512, 1024, 2048, 4096)
#: vllm_gpu_memory_utilization the planner tries, largest first (a larger KV cache: more sequences
#: in flight, faster rollouts).
VLLM_UTILIZATIONS = tuple(round(0.9 - 0.05 * i, 2) for i in range(17))
#: vLLM's own max_num_seqs default, the most the planner picks.
VLLM_MAX_NUM_SEQS = 256


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    field: str
    value: Any
    reason: str


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

    @property
    def headroom_bytes(self) -> int:
        return self.estimate.headroom_bytes

    def reasons(self) -> dict[str, str]:
        return {d.field: d.reason for d in self.decisions}


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


class _Search:
    def __init__(self, spec, cluster, coefficients, margin):
        self.spec, self.cluster, self.coefficients, self.margin = spec, cluster, coefficients, margin
        self.limit = cluster.gpu.memory_bytes - margin

    def estimate(self, workload: Workload, fsdp: FSDPConfig | None) -> Estimate:
        return estimate(self.spec, workload, self.cluster, fsdp, coefficients=self.coefficients)

    def fits(self, workload, fsdp) -> bool:
        return self.estimate(workload, fsdp).peak_bytes <= self.limit


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expert_parallel_degrees(spec: ModelSpec, cluster: Cluster) -> list[int]:
    """EP degrees above 1 the runtime accepts, within a node first."""
    allowed = [d for d in expert_parallel_degrees(spec, cluster.num_gpus) if d > 1]
    return sorted(allowed, key=lambda d: (d > cluster.per_node, d))


def check_inputs(spec: ModelSpec, workload: Workload, cluster: Cluster, fixed: dict[str, Any] | None = None,
                 sharding: str = "auto") -> None:
    """Raise ValueError naming the field when the inputs describe a run the trainer would refuse.

    Nothing the user gave is dropped or defaulted: FSDPConfig fields with
    ``sharding='none'``, a layout the GPUs cannot take (tp, shard_group_size,
    ep), block counts and kinds the model does not have, a sequence longer than
    the model's positions, a micro-batch that does not divide a GPU's share.
    """
    fixed = dict(fixed or {})
    if sharding not in ("auto", "fsdp", "none"):
        raise ValueError(f"sharding must be 'auto', 'fsdp' or 'none', got {sharding!r}")
    fsdp = FSDPConfig(**fixed)  # the user's fields, with FSDPConfig's own errors
    if fixed and sharding == "none":
        raise ValueError(f"sharding='none' trains without FSDP2, so the FSDPConfig fields given "
                         f"({', '.join(sorted(fixed))}) would be ignored; use sharding 'auto' or 'fsdp'")
    if fsdp.cpu_offload and workload.load_in_4bit:
        raise ValueError("QLoRA (load_in_4bit) with cpu_offload=True is not supported: the 4-bit quantisation "
                         "state stays on the device; use optim_cpu_offload=True")
    fsdp.check_world(cluster.num_gpus)
    if fsdp.tp > 1 and (problem := tp_problem(spec, fsdp.tp)):
        raise ValueError(problem)
    if fsdp.ep > 1:
        check_ep(spec, fsdp.ep, cluster.num_gpus, fsdp)
    if fsdp.routed_expert_chunk_mib is not None and spec.expert_layout_problem:
        raise ValueError(f"routed_expert_chunk_mib={fsdp.routed_expert_chunk_mib:g}: {spec.expert_layout_problem}")
    if fsdp.wrap_every_n_blocks > spec.num_layers:
        raise ValueError(f"wrap_every_n_blocks={fsdp.wrap_every_n_blocks} is more than the {spec.num_layers} "
                         f"blocks of {spec.name}")
    unknown = sorted(set(fsdp.checkpoint_skip_layer_types) - set(spec.block_kinds))
    if unknown:
        raise ValueError(f"checkpoint_skip_layer_types names block kinds {spec.name} does not have: {unknown}; "
                         f"its blocks are of kinds {spec.block_kinds}")
    if workload.sequence_tokens > spec.max_position_embeddings:
        raise ValueError(f"prompt_tokens + completion_tokens = {workload.sequence_tokens} is longer than the "
                         f"{spec.max_position_embeddings} positions of {spec.name} (max_position_embeddings; "
                         "a longer context needs rope scaling in its config.json)")
    data_parallel = cluster.num_gpus // fsdp.tp
    per_gpu = workload.completions_per_rank(data_parallel)
    micro = workload.micro_batch_size_per_gpu
    if micro is not None and per_gpu % micro:
        raise ValueError(f"micro_batch_size_per_gpu={micro} does not divide the {per_gpu} completions per GPU "
                         f"(prompts_per_step x group_size / {data_parallel} GPUs)")
    if micro is not None and not workload.micro_batch_fits_examples(micro):
        raise ValueError(f"micro_batch_size_per_gpu={micro}: dpo runs a pair's chosen and rejected sequences in "
                         "one micro-batch, so it must be even")
    if fsdp.cpu_offload and workload.generation == "hf":
        raise ValueError("cpu_offload=True with generation='hf': Hugging Face generate runs on the trainer's "
                         "weights, which must stay on the GPU; use a colocated vLLM engine or optim_cpu_offload")


def _vllm_frugal(spec: ModelSpec, workload: Workload, cluster: Cluster,
                 fixed: dict[str, Any]) -> tuple[Workload, list[Decision]]:
    """The colocated engine's settings the plan starts from: ``max_num_seqs`` a rank's completions
    (at most 256) and, unless given, the least ``gpu_memory_utilization`` the engine starts with
    (its weights and one sequence's KV cache), raised later to the largest that fits."""
    notes: list[Decision] = []
    tp = int(fixed.get("tp", 1) or 1)
    update: dict[str, Any] = {}
    if workload.vllm_max_num_seqs is None:
        n = workload.completions_per_rank(max(1, cluster.num_gpus // tp))
        seqs = min(VLLM_MAX_NUM_SEQS, n)
        update["vllm_max_num_seqs"] = seqs
        notes.append(Decision(field="vllm_max_num_seqs", value=seqs, reason=(
            f"a rank's {n} completions per rollout all in flight at once" if seqs == n else
            f"vLLM's default; a rank has {n} completions per rollout")))
    if workload.vllm_gpu_memory_utilization is None and workload.vllm_kv_cache_memory_bytes is None:
        sized = workload.model_copy(update={**update, "vllm_gpu_memory_utilization": 1.0})
        floor = vllm_floor(spec, sized, cluster, None) / cluster.gpu.memory_bytes
        least = next((u for u in reversed(VLLM_UTILIZATIONS) if u >= floor), VLLM_UTILIZATIONS[0])
        update["vllm_gpu_memory_utilization"] = least
    return workload.model_copy(update=update), notes


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
) -> Plan:
    """Choose FSDPConfig fields and workload knobs the user left open.

    ``fixed``: FSDPConfig fields the user set (never changed). ``sharding``:
    "auto" (data parallel when it fits, else FSDP2), "fsdp" or "none".
    """
    fixed = dict(fixed or {})
    source = coefficients_source or ("given" if coefficients is not None else "defaults")
    check_inputs(spec, workload, cluster, fixed, sharding)
    colocated = workload.generation == "vllm" if colocated_vllm is None else colocated_vllm
    margin = int(cluster.gpu.memory_bytes * margin_fraction)
    search = _Search(spec, cluster, coefficients, margin)
    W = cluster.num_gpus
    decisions: list[Decision] = []
    user_micro = workload.micro_batch_size_per_gpu
    user_chunk = workload.logprob_chunk_size
    user_gc = workload.gradient_checkpointing

    def with_(wl: Workload, **kw) -> Workload:
        return wl.model_copy(update=kw)

    frugal = with_(workload, micro_batch_size_per_gpu=user_micro or (2 if workload.algorithm == "dpo" else 1),
                   logprob_chunk_size=user_chunk or LOGPROB_CHUNKS[0],
                   gradient_checkpointing=True if user_gc is None else user_gc)
    vllm_notes: list[Decision] = []
    user_util = workload.vllm_gpu_memory_utilization
    if workload.generation == "vllm":
        frugal, vllm_notes = _vllm_frugal(spec, frugal, cluster, fixed)

    # 1. data parallel or FSDP2
    use_fsdp = sharding == "fsdp" or (sharding == "auto" and (W > 1 or bool(fixed)))
    if sharding == "auto" and fixed:
        decisions.append(Decision(field="sharding", value="fsdp",
                                  reason=f"FSDPConfig fields were given ({', '.join(sorted(fixed))})"))
    elif sharding == "auto" and W > 1:
        if search.fits(frugal, None):
            use_fsdp = False
            decisions.append(Decision(field="sharding", value="data parallel",
                                      reason="the whole actor fits on each GPU, so no weight gathers are needed"))
        else:
            need = search.estimate(frugal, None).peak_bytes
            decisions.append(Decision(field="sharding", value="fsdp",
                                      reason=f"unsharded it needs {_gib(need)} per GPU, over {_gib(search.limit)}"))
    elif W == 1 and sharding != "fsdp":
        use_fsdp = False
        decisions.append(Decision(field="sharding", value="none", reason="one device: no sharding needed"))
    if sharding == "none":
        use_fsdp = False

    fsdp: FSDPConfig | None = None
    if use_fsdp:
        # Full fine-tuning holds every unsharded gradient between micro-batches under defer_grad_sync:
        # reduce-scatter each micro-batch instead until the deferral is known to fit.
        base = dict(reshard_after_forward=True, wrap_every_n_blocks=1, prefetch_units=1, backward_prefetch_units=1,
                    optim_cpu_offload=False, cpu_offload=False, shard_group_size=None,
                    defer_grad_sync=not workload.full_finetune)
        # the row-wise experts in chunks: far below PEFT's merged expert stacks
        row_wise = row_wise_experts(spec)
        if row_wise:
            base["routed_expert_chunk_mib"] = EXPERT_CHUNKS_MIB[0]
        base.update(fixed)
        fsdp = FSDPConfig(**base)
        if row_wise and "ep" not in fixed and not search.fits(frugal, fsdp):
            # Expert parallel: each rank gathers E / ep experts, sharded over world / ep ranks.
            for ep in _expert_parallel_degrees(spec, cluster):
                candidate = fsdp.model_copy(update={"ep": ep})
                if search.fits(frugal, candidate):
                    fsdp = candidate
                    decisions.append(Decision(field="ep", value=ep, reason=(
                        f"experts split over {ep} GPUs: each gathers {1 / ep:.3g} of a layer's experts")))
                    break
        if not search.fits(frugal, fsdp) and "optim_cpu_offload" not in fixed and not fsdp.cpu_offload:
            fsdp = fsdp.model_copy(update={"optim_cpu_offload": True})
        # cpu_offload parks the weights on the host: only where Hugging Face generate does not need them
        offloadable = colocated or workload.algorithm in OFFLINE_SEQUENCES
        if not search.fits(frugal, fsdp) and offloadable and "cpu_offload" not in fixed and not workload.load_in_4bit:
            candidate = fsdp.model_copy(update={"cpu_offload": True, "optim_cpu_offload": False})
            if search.fits(frugal, candidate):
                fsdp = candidate
                decisions.append(Decision(field="cpu_offload", value=True, reason=(
                    "last resort: parameters and gradients on the host; nothing else fits")))

    current = frugal
    if not search.fits(current, fsdp):
        est = search.estimate(current, fsdp)
        suggestions = _suggest(spec, workload, cluster, coefficients, margin, fixed) if suggest else []
        decisions.append(Decision(field="fits", value=False, reason=(
            f"the most frugal settings need {_gib(est.peak_bytes)} per GPU in phase {est.peak_phase}, "
            f"over the {_gib(search.limit)} available")))
        return Plan(model=spec.name, cluster=cluster, fsdp=fsdp, workload=current, estimate=est,
                    decisions=tuple(decisions), fits=False, margin_bytes=margin, suggestions=tuple(suggestions),
                    coefficients_source=source)

    def note(field: str, value: Any, reason: str) -> None:
        decisions.append(Decision(field=field, value=value, reason=reason))

    # 2. relax, in order of throughput value
    if fsdp is not None and not fsdp.cpu_offload and "optim_cpu_offload" not in fixed:
        if fsdp.optim_cpu_offload:
            on_gpu = search.estimate(current, fsdp.model_copy(update={"optim_cpu_offload": False})).peak_bytes
            note("optim_cpu_offload", True, f"Adam state on the GPU would need {_gib(on_gpu)} per GPU; "
                                            f"on the host it fits")
        else:
            note("optim_cpu_offload", False, "Adam state fits on the GPU (fused AdamW there is fastest)")

    n = workload.completions_per_rank(W // (fsdp.tp if fsdp else 1))
    if user_micro is None:
        choices = [mb for mb in _divisors(n) if workload.micro_batch_fits_examples(mb)]
        best = choices[0]
        for mb in choices:
            if search.fits(with_(current, micro_batch_size_per_gpu=mb), fsdp):
                best = mb
        current = with_(current, micro_batch_size_per_gpu=best)
        note("micro_batch_size_per_gpu", best, f"the largest divisor of the {n} completions per GPU that fits"
             if best < n else f"all {n} completions per GPU in one micro-batch fit")

    if user_gc is None:
        if search.fits(with_(current, gradient_checkpointing=False), fsdp):
            current = with_(current, gradient_checkpointing=False)
            note("gradient_checkpointing", False, "activations of every block fit: no recompute in backward")
        else:
            off = search.estimate(with_(current, gradient_checkpointing=False), fsdp).peak_bytes
            note("gradient_checkpointing", True, f"without it the learn phase needs {_gib(off)}")

    if fsdp is not None:
        per_node = cluster.per_node
        if "shard_group_size" not in fixed and cluster.num_nodes > 1:
            hsdp = fsdp.model_copy(update={"shard_group_size": per_node})
            if search.fits(current, hsdp):
                fsdp = hsdp
                note("shard_group_size", per_node, f"weights sharded within a node of {per_node} GPUs fit, so "
                                                   "all-gathers stay on the node's fast links (HSDP)")
            else:
                note("shard_group_size", None, f"sharding only within a node of {per_node} GPUs does not fit")
        elif "shard_group_size" not in fixed:
            note("shard_group_size", None, "one node: sharding across all its GPUs")
        micro_batches = n // current.micro_batch_size_per_gpu
        if "defer_grad_sync" not in fixed and micro_batches == 1:
            fsdp = fsdp.model_copy(update={"defer_grad_sync": True})  # one micro-batch: nothing to defer (the default)
        elif "defer_grad_sync" not in fixed:
            defer = fsdp.model_copy(update={"defer_grad_sync": True})
            if fsdp.defer_grad_sync or search.fits(current, defer):
                fsdp = defer
                note("defer_grad_sync", True, f"the {micro_batches} micro-batches' unsharded gradients fit until the "
                                              "last one reduce-scatters them: one reduce-scatter per step")
            else:
                need = search.estimate(current, defer).peak_bytes
                note("defer_grad_sync", False, f"holding every unsharded gradient between micro-batches would need "
                                               f"{_gib(need)}: each micro-batch reduce-scatters")
        if "reshard_after_forward" not in fixed:
            keep = fsdp.model_copy(update={"reshard_after_forward": False})
            if search.fits(current, keep):
                fsdp = keep
                note("reshard_after_forward", False, "every unit can stay gathered from forward to backward: "
                                                     "no second all-gather")
            else:
                note("reshard_after_forward", True, "keeping all units gathered does not fit")

    if workload.generation == "hf" and workload.gather_weights_for_rollout is None:
        # Unsharded: a merged copy of each adapted linear; under FSDP2: every unit gathered at once
        # (with reshard_after_forward=False generate's forwards would keep them gathered anyway, but
        # only gathering once lets it run LoRA merged and without per-token synced steps).
        once = with_(current, gather_weights_for_rollout=True)
        fits = search.fits(once, fsdp)
        current = once if fits else with_(current, gather_weights_for_rollout=False)
        if fsdp is None:
            note("gather_weights_for_rollout", fits, "a merged copy of every adapted linear fits beside generation's "
                 "KV cache: one matmul per linear per token, not three" if fits else
                 "LoRA stays unmerged in generation: a merged copy of the adapted weights does not fit beside the KV cache")
        else:
            note("gather_weights_for_rollout", fits, "every unit gathered at once fits beside generation's KV cache: "
                 "one all-gather per unit per rollout, not one per token" if fits else
                 "generation re-gathers unit by unit: all units at once do not fit beside the KV cache")

    if user_chunk is None:
        best = LOGPROB_CHUNKS[0]
        for chunk in LOGPROB_CHUNKS:
            if search.fits(with_(current, logprob_chunk_size=chunk), fsdp):
                best = chunk
        current = with_(current, logprob_chunk_size=best)
        note("logprob_chunk_size", best, "the largest log-prob chunk (token rows) whose logits workspace fits")

    if fsdp is not None:
        if "wrap_every_n_blocks" not in fixed:
            best = 1
            for wrap in (2, 4):
                if wrap <= spec.num_layers and search.fits(current, fsdp.model_copy(update={"wrap_every_n_blocks": wrap})):
                    best = wrap
            fsdp = fsdp.model_copy(update={"wrap_every_n_blocks": best})
            note("wrap_every_n_blocks", best, "fewer, bigger collectives" if best > 1 else
                 "bigger units do not fit")
        for field in ("prefetch_units", "backward_prefetch_units"):
            if field in fixed:
                continue
            deeper = fsdp.model_copy(update={field: 2})
            if search.fits(current, deeper):
                fsdp = deeper
                note(field, 2, "a second unit in flight fits: more overlap of gathers with compute")
            else:
                note(field, 1, "only one neighbouring unit fits in flight")
        if row_wise and "routed_expert_chunk_mib" not in fixed:
            best = EXPERT_CHUNKS_MIB[0]
            for chunk in EXPERT_CHUNKS_MIB[1:]:
                if search.fits(current, fsdp.model_copy(update={"routed_expert_chunk_mib": chunk})):
                    best = chunk
            fsdp = fsdp.model_copy(update={"routed_expert_chunk_mib": best})
            note("routed_expert_chunk_mib", best, "the largest of 64/128/256/512 MiB whose expert chunk fits: "
                 "fewer kernel launches per MoE layer" if best > EXPERT_CHUNKS_MIB[0] else
                 "only the smallest expert chunk fits")
        if row_wise and "ep" not in fixed and not any(d.field == "ep" for d in decisions):
            note("ep", fsdp.ep, "every rank holds a shard of every expert: no all-to-all needed")
        if spec.is_moe and not row_wise:
            note("ep", fsdp.ep, "Hugging Face's expert loop runs the experts (their layout has no "
                 "expert parallel or chunked experts here): ep=1, routed_expert_chunk_mib unset")

    decisions.extend(vllm_notes)
    if workload.generation == "vllm" and user_util is None and workload.vllm_kv_cache_memory_bytes is None:
        floor = current.vllm_gpu_memory_utilization
        for util in VLLM_UTILIZATIONS:
            if util > floor and search.fits(with_(current, vllm_gpu_memory_utilization=util), fsdp):
                current = with_(current, vllm_gpu_memory_utilization=util)
                break
        note("vllm_gpu_memory_utilization", current.vllm_gpu_memory_utilization,
             "the largest fraction (in 0.05 steps, at most 0.9) with training and sync within budget: the engine's "
             "KV cache takes what training leaves" if current.vllm_gpu_memory_utilization > floor else
             "the least the engine starts with (its weights and one sequence's KV cache); no larger fraction fits")

    est = search.estimate(current, fsdp)
    note("fits", True, f"peak {_gib(est.peak_bytes)} per GPU in phase {est.peak_phase}, "
                       f"{_gib(est.headroom_bytes)} headroom of {_gib(cluster.gpu.memory_bytes)}")
    return Plan(model=spec.name, cluster=cluster, fsdp=fsdp, workload=current, estimate=est,
                decisions=tuple(decisions), fits=True, margin_bytes=margin, coefficients_source=source)


def suggest_fixes(spec: ModelSpec, workload: Workload, cluster: Cluster, *, fixed: dict[str, Any] | None = None,
                  coefficients: Coefficients | None = None, margin_fraction: float = MARGIN_FRACTION) -> list[str]:
    """The smallest changes that would make a plan fit (what plan() reports when nothing does)."""
    return _suggest(spec, workload, cluster, coefficients, int(cluster.gpu.memory_bytes * margin_fraction),
                    dict(fixed or {}))


def _suggest(spec, workload, cluster, coefficients, margin, fixed) -> list[str]:
    """The smallest changes that make the most frugal plan fit, by kind."""
    out: list[str] = []

    def feasible(wl: Workload, cl: Cluster) -> bool:
        """Whether the most frugal settings fit (what plan() starts from), sharded or not."""
        limit = cl.gpu.memory_bytes - margin
        try:  # model_copy does not validate: a combination the trainer refuses is no suggestion
            wl = Workload.model_validate(wl.model_dump())
        except ValueError:
            return False
        frugal = wl.model_copy(update={
            "micro_batch_size_per_gpu": wl.micro_batch_size_per_gpu or 1,
            "logprob_chunk_size": wl.logprob_chunk_size or LOGPROB_CHUNKS[0],
            "gradient_checkpointing": True if wl.gradient_checkpointing is None else wl.gradient_checkpointing,
        })
        try:
            candidates: list[FSDPConfig | None] = [None]
            if cl.num_gpus > 1:
                candidates.append(FSDPConfig(**{"optim_cpu_offload": True, "defer_grad_sync": not wl.full_finetune,
                                                **fixed}))
            return any(estimate(spec, frugal, cl, f, coefficients=coefficients).peak_bytes <= limit
                       for f in candidates)
        except ValueError:
            return False

    for factor in (2, 4, 8, 16, 32, 64):
        gpus = cluster.num_gpus * factor
        total = workload.completions_per_step
        if total % gpus:
            continue
        per = cluster.gpus_per_node
        cl = cluster.model_copy(update={"num_gpus": gpus, "gpus_per_node": min(per, gpus) if per else None})
        if feasible(workload, cl):
            where = f" ({cl.num_nodes} nodes of {cl.per_node})" if cl.num_nodes > 1 else ""
            out.append(f"use {gpus} GPUs{where}")
            break
    if workload.micro_batch_size_per_gpu and workload.micro_batch_size_per_gpu > 1:
        wl = workload.model_copy(update={"micro_batch_size_per_gpu": 1})
        if feasible(wl, cluster):
            out.append("use micro_batch_size_per_gpu=1")
    if workload.full_finetune:
        wl = workload.model_copy(update={"full_finetune": False})
        if feasible(wl, cluster):
            out.append("train LoRA adapters instead of every parameter (full_finetune=False)")
    elif not workload.load_in_4bit and cluster.num_gpus == 1:
        wl = workload.model_copy(update={"load_in_4bit": True})
        if feasible(wl, cluster):
            out.append("use QLoRA (load_in_4bit=True; one device or data parallel)")
    if workload.generation == "vllm":
        # A colocated engine takes its fraction of the GPU while awake: the fix GRPO users are
        # given is a smaller fraction (down to a tenth), or parking the trainer's weights.
        # (left to the planner, or a KV cache size given, the fraction is already the least that works)
        util = workload.vllm_gpu_memory_utilization
        steps = [] if util is None or workload.vllm_kv_cache_memory_bytes is not None else [
            round(util - 0.05 * i, 2) for i in range(1, 40) if util - 0.05 * i >= 0.1 - 1e-9]
        for lower in steps:
            if feasible(workload.model_copy(update={"vllm_gpu_memory_utilization": lower}), cluster):
                out.append(f"lower vllm_gpu_memory_utilization to {lower:.2f}")
                break
        if not workload.offload_weights_during_rollout:
            wl = workload.model_copy(update={"offload_weights_during_rollout": True})
            if feasible(wl, cluster):
                out.append("set offload_weights_during_rollout=True (the trainer's weights wait on the host "
                           "while the engine generates)")
    completion = workload.completion_tokens
    while completion > 16:
        completion //= 2
        wl = workload.model_copy(update={"completion_tokens": completion})
        if feasible(wl, cluster):
            out.append(f"shorten completions to {completion} tokens")
            break
    if not out:
        out.append("nothing nearby fits: a smaller model, or GPUs with more memory")
    return out
