"""estimate(spec, workload, cluster, fsdp) -> per-rank, per-phase memory by component.

Pure and fast (no torch; ~1 ms for a 70B once the spec exists). It models what
*this project's* GRPO trainer does (agilerl.algorithms.GRPO on
agilerl.distributed.apply_fsdp2), phase by phase; peak is the largest phase
(DESIGN.md decision 3). Every number is per rank: rank 0, which holds the
largest shards (FSDP2 gives rank i rows ``[i*ceil(d/S), (i+1)*ceil(d/S))``).

Notation: ``S`` ranks share a weight shard (``shard_group_size`` or all), ``D``
data-parallel ranks, ``n = prompts x group / D`` completions per rank, ``m``
the micro-batch, ``T`` prompt + completion tokens, ``N = m T`` tokens per
micro-batch, ``c`` the log-prob chunk (token rows), ``V`` the vocabulary,
``H`` hidden size, ``p`` bytes of the compute dtype (FSDP ``param_dtype``,
or the weights' dtype unsharded), ``w`` bytes of the stored weights.

Where a term's size depends on kernels rather than shapes (activations saved
for backward, logits temporaries, the all-gather copy-out), it carries a
coefficient from :class:`Coefficients`, fitted on measured probes
(benchmarks/accuracy.py fits on one half of its configurations and reports
the other). The measured error of the whole estimate is in the README.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from agilerl.distributed import FSDPConfig

from .hardware import Cluster
from .spec import BlockSpec, ModelSpec, is_per_layer_embedding
from .workload import Workload

__all__ = ["Coefficients", "Estimate", "PhaseEstimate", "estimate", "DTYPE_BYTES", "resolve_workload",
           "expert_parallel_degrees", "resolve_expert_chunk", "EXPERT_CHUNKS_MIB", "MARGIN_FRACTION"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: What FSDPConfig.routed_expert_chunk_mib=None picks from, as documented: the largest that fits.
EXPERT_CHUNKS_MIB = (64, 128, 256, 512)
#: Share of a GPU the chunk resolution (and plan()) keeps free.
MARGIN_FRACTION = 0.05
MIB = 2**20
GIB = 2**30
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 * 1.0 + 4 / (64 * 256)  # 4-bit + double-quantised absmax per 64


class Coefficients(BaseModel):
    """Kernel-dependent constants of the estimate (fitted; see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Bytes of activations autograd saves per token of one block, as multiples of p x width:
    act_hidden: Annotated[float, Field(description="saved per token per block, x hidden_size")] = 8.0
    act_qkv: Annotated[float, Field(description="saved per token per block, x (q + 2 kv) width")] = 2.0
    act_mlp: Annotated[float, Field(description="saved per token per block, x MLP width")] = 4.0
    act_lora: Annotated[float, Field(description="saved per token per adapted linear, x rank")] = 1.0
    act_checkpointed: Annotated[float, Field(description="saved per token per checkpointed block, x hidden_size")] = 1.0
    act_boundary: Annotated[float, Field(description="saved per token outside the blocks, x hidden_size")] = 3.0
    # Peak temporaries of one block's forward without grad, as multiples of p x width per token:
    fwd_hidden: Annotated[float, Field(description="no-grad forward temporaries, x hidden_size")] = 3.0
    fwd_mlp: Annotated[float, Field(description="no-grad forward temporaries, x MLP width")] = 3.0
    gen_hidden: Annotated[float, Field(description="generation prefill: hidden-state copies alive, x hidden_size per prompt token")] = 1.0
    # Attention scores, where a kernel materialises them (eager; SDPA's math fallback on CPU):
    attn_scores_fwd: Annotated[float, Field(description="eager attention: batch x heads x Tq x Tk score copies alive in a forward")] = 2.0
    attn_scores_saved: Annotated[float, Field(description="eager attention: score copies saved per block for backward")] = 1.0
    # Log-prob workspace: fp32 copies of a chunk's logits alive at the peak. Measured on CPU
    # with torch's MemTracker: 4 either way (chunked: the recomputed logits, their exp and two
    # gradients in backward; unchunked: one copy saved in forward, three made in backward).
    logits_copies_grad: Annotated[float, Field(description="fp32 logits copies, chunked with grad")] = 4.0
    logits_copies_unchunked: Annotated[float, Field(description="fp32 logits copies, all rows at once with grad")] = 4.0
    logits_copies_nograd: Annotated[float, Field(description="fp32 logits copies without grad")] = 2.0
    # Mixture-of-experts blocks (see the module docstring's MoE section). Per (token, expert) row:
    moe_rows_saved: Annotated[float, Field(description="chunked / expert-parallel experts: saved per routed row, x hidden_size")] = 2.0
    moe_rows_hf: Annotated[float, Field(description="Hugging Face experts loop: saved per routed row, x hidden_size (besides act_mlp x width)")] = 2.0
    moe_chunk: Annotated[float, Field(description="one expert chunk's recompute in backward, x its counted tensors")] = 1.0
    moe_dispatch: Annotated[float, Field(description="row-wise experts: buffers in the dispatch's backward beyond the four row gradients, x routed rows of a token block x hidden (none on CPU probes)")] = 0.0
    moe_stack_grad: Annotated[float, Field(description="Hugging Face experts with LoRA on the stacks: copies of PEFT's merged down stack made in its backward (its gradient)")] = 1.0
    # FSDP2: buffers beside the backward's gathered window (fraction of the largest edge unit).
    all_gather_overlap: Annotated[float, Field(description="FSDP buffers beside the gathered window, x the largest of the embeddings, head and root units")] = 1.0
    # GPU-only terms.
    nccl_bytes: Annotated[int, Field(description="NCCL communicator buffers per rank (multi-GPU)")] = 256 * MIB
    allocator_slack_fraction: Annotated[float, Field(description="caching-allocator fragmentation, x allocated")] = 0.07
    vllm_sleep_residual_bytes: Annotated[int, Field(description="what a sleeping vLLM engine keeps on the GPU")] = 512 * MIB
    host_process_bytes: Annotated[int, Field(description="host memory of a trainer process before the model")] = 2 * GIB


class PhaseEstimate(BaseModel):
    model_config = ConfigDict(frozen=True)

    components: dict[str, int]
    host: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


class Estimate(BaseModel):
    """Per-rank memory of one GRPO run, per phase and component, against capacity."""

    model_config = ConfigDict(frozen=True)

    phases: dict[str, PhaseEstimate]
    capacity_bytes: int
    gpus_per_node: int
    notes: tuple[str, ...] = ()

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k].total)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase].total

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def host_peak_bytes(self) -> int:
        return max(p.host_total for p in self.phases.values())

    @property
    def host_per_node_bytes(self) -> int:
        return self.host_peak_bytes * self.gpus_per_node


@dataclass
class _Tensor:
    rows: int
    rest: int
    sharded: bool
    group: int | None = None  # ranks its FSDP shard spans, when not the dense mesh's (experts under EP)

    @property
    def numel(self) -> int:
        return self.rows * self.rest

    def local(self, shards: int) -> int:
        if not self.sharded:
            return self.numel
        return math.ceil(self.rows / (self.group or shards)) * self.rest


@dataclass
class _Unit:
    name: str
    base: list[_Tensor] = field(default_factory=list)
    lora: list[_Tensor] = field(default_factory=list)

    def full_sharded_numel(self) -> tuple[int, int]:
        return (sum(t.numel for t in self.base if t.sharded), sum(t.numel for t in self.lora if t.sharded))


def _tensor(shape: tuple[int, ...], threshold: float, *, tp: int = 1, tp_dim: int | None = None,
            ep: int = 1, ep_dim: int | None = None, group: int | None = None) -> _Tensor:
    """A tensor as FSDP sees it on one rank: split by tensor parallelism along ``tp_dim``, or
    by expert parallelism along ``ep_dim`` (then FSDP-sharded over ``group`` ranks), first.

    The persistence threshold applies to the global size (a TP DTensor's numel); expert
    parameters always shard (agilerl.distributed keeps them on the expert mesh).
    """
    numel = 1
    for d in shape:
        numel *= d
    local = list(shape) or [1]
    if tp > 1 and tp_dim is not None:
        local[tp_dim] = -(-local[tp_dim] // tp)
    if ep_dim is not None:
        local[ep_dim] //= ep
    rest = 1
    for d in local[1:]:
        rest *= d
    return _Tensor(rows=local[0], rest=rest, sharded=ep_dim is not None or numel >= threshold, group=group)


def _reversed_with_parents(order: list[tuple[int, int | None, int]]) -> list[tuple[int, int | None, int]]:
    """Backward order of (bytes, parent index, prefetched bytes) entries: reversed, parents
    re-indexed.

    In backward a block's own unit is gathered first (its pre-backward), then
    its nested units, so each parent moves ahead of its children."""
    groups: list[list[tuple[int, int | None, int]]] = []
    for size, parent, ahead in order:
        if parent is None:
            groups.append([(size, None, ahead)])
        else:
            groups[-1].append((size, parent, ahead))
    out: list[tuple[int, int | None, int]] = []
    for group in reversed(groups):
        head = len(out)
        out.append(group[0])
        out.extend((size, head, ahead) for size, _, ahead in reversed(group[1:]))
    return out


def _is_packed_expert(name: str, shape: tuple[int, ...] | None = None) -> bool:
    """A routed-expert tensor: ``...experts.gate_up_proj`` [E, ., .], or its LoRA ``...experts:gate_up_proj``.

    Only packed experts (3-D, transformers 5) count: shared experts and per-expert
    module lists are ordinary linears.
    """
    path = name.split(":", 1)[0]
    if "experts" not in path.split("."):
        return False
    return ":" in name or (shape is not None and len(shape) == 3)


#: Linears tensor parallelism splits (agilerl.distributed._tp): colwise split their output
#: (weight dim 0, bias), rowwise their input (weight dim 1).
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def _tp_dim(tensor_name: str) -> int | None:
    parts = tensor_name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _COLWISE:
        return 0
    if module in _ROWWISE and parts[-1] == "weight":
        return 1
    return None


def _has_packed_experts(spec: ModelSpec) -> bool:
    return any(_is_packed_expert(n, s) for b in spec.block_types.values() for n, s in b.tensors)


def expert_parallel_degrees(spec: ModelSpec, world: int) -> list[int]:
    """EP degrees agilerl.distributed accepts on ``world`` GPUs: [1] unless the model has packed
    experts, else every degree dividing the GPUs and each layer's expert count."""
    counts = {b.mlp.num_experts for b in spec.block_types.values() if b.mlp.kind == "moe"}
    if not counts or not _has_packed_experts(spec):
        return [1]
    return [d for d in range(1, world + 1) if world % d == 0 and all(c % d == 0 for c in counts)]


def _packed(block: BlockSpec) -> bool:
    """Whether a block's routed experts are packed per layer ([E, ., .] tensors)."""
    return any(_is_packed_expert(n, s) for n, s in block.tensors)


def _tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why agilerl.distributed cannot split ``spec`` over ``tp`` ranks, or None: every block's
    attention and KV heads and each dense MLP's width must divide by it (a MoE block splits
    its attention only, and needs its experts packed)."""
    for b in spec.block_types.values():
        if b.attention.num_heads % tp or b.attention.num_kv_heads % tp:
            return (f"tp={tp} needs attention heads ({b.attention.num_heads}) and KV heads "
                    f"({b.attention.num_kv_heads}) divisible by it")
        if b.mlp.kind == "moe" and not _packed(b):
            return f"tp={tp} needs MoE experts packed per layer ({b.kind} loops over expert modules)"
        if b.mlp.kind != "moe" and b.mlp.intermediate_size % tp:
            return f"tp={tp} needs the MLP width ({b.mlp.intermediate_size}) divisible by it"
    return None


def tensor_parallel_degrees(spec: ModelSpec, world: int) -> list[int]:
    """TP degrees agilerl.distributed accepts on ``world`` GPUs (see :func:`_tp_problem`)."""
    return [d for d in range(1, world + 1) if world % d == 0 and (d == 1 or _tp_problem(spec, d) is None)]


def _check_ep(spec: ModelSpec, ep: int, world: int, fsdp: FSDPConfig) -> None:
    """The EP degree agilerl.distributed accepts: packed experts, dividing the world and every expert count."""
    allowed = expert_parallel_degrees(spec, world)
    if allowed == [1]:
        raise ValueError(f"ep={ep} needs packed MoE experts; {spec.name} has none. Use ep=1.")
    if fsdp.tp > 1 or fsdp.shard_group_size is not None:
        raise ValueError(f"ep={ep} with tp > 1 or shard_group_size (HSDP) is not supported yet")
    counts = sorted({b.mlp.num_experts for b in spec.block_types.values() if b.mlp.kind == "moe"})
    if ep not in allowed:
        raise ValueError(f"ep={ep} must divide the {world} GPUs and the {counts[-1]} experts per layer; "
                         f"allowed: {allowed}")


def resolve_expert_chunk(spec: ModelSpec, workload: Workload, cluster: Cluster, fsdp: FSDPConfig, *,
                         coefficients: Coefficients | None = None) -> tuple[int, dict[int, int]]:
    """routed_expert_chunk_mib=None as the trainer resolves it: the largest of EXPERT_CHUNKS_MIB
    whose estimated peak leaves MARGIN_FRACTION of the GPU free, else the smallest.

    Returns the chunk and the estimated peak at every candidate.
    """
    limit = cluster.gpu.memory_bytes * (1 - MARGIN_FRACTION)
    peaks = {chunk: estimate(spec, workload, cluster, fsdp.model_copy(update={"routed_expert_chunk_mib": chunk}),
                             coefficients=coefficients).peak_bytes for chunk in EXPERT_CHUNKS_MIB}
    fitting = [chunk for chunk, peak in peaks.items() if peak <= limit]
    return (fitting[-1] if fitting else EXPERT_CHUNKS_MIB[0]), peaks


def resolve_workload(workload: Workload, *, data_parallel_ranks: int) -> Workload:
    """The workload with the trainer's own defaults for fields left to the planner."""
    n = workload.completions_per_rank(data_parallel_ranks)
    return workload.model_copy(update={
        "micro_batch_size_per_gpu": workload.micro_batch_size_per_gpu or n,
        "gradient_checkpointing": True if workload.gradient_checkpointing is None else workload.gradient_checkpointing,
    })


def _lora_shapes(spec: ModelSpec, workload: Workload) -> list[list[tuple[int, int, int, int]]]:
    """Per block: every adapter's (a_rows, a_cols, b_rows, b_cols) at rank 1."""
    key = ModelSpec._target_key(workload.lora_targets)
    if not spec.has_lora_targets(workload.lora_targets):
        raise KeyError(f"the spec of {spec.name} has no LoRA coverage for targets {key!r}; rebuild it with them")
    return [[shape[1:] for shape in b.lora[key]] for b in spec.blocks]


def estimate(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    fsdp: FSDPConfig | None,
    *,
    coefficients: Coefficients | None = None,
) -> Estimate:
    """Per-rank memory of a GRPO run by phase and component (see the module docstring)."""
    k = coefficients or Coefficients()
    if (fsdp is not None and fsdp.routed_expert_chunk_mib is None and spec.is_moe
            and _has_packed_experts(spec)):
        # agilerl's GRPO resolves None before sharding (FSDPConfig's documented choice).
        chunk, _ = resolve_expert_chunk(spec, workload, cluster, fsdp, coefficients=k)
        est = estimate(spec, workload, cluster, fsdp.model_copy(update={"routed_expert_chunk_mib": chunk}),
                       coefficients=k)
        note = f"routed_expert_chunk_mib=None: the trainer picks {chunk} MiB (the largest of 64/128/256/512 that fits)"
        return est.model_copy(update={"notes": (*est.notes, note)})
    gpu_terms = cluster.gpu.kind != "cpu"
    W = cluster.num_gpus
    tp = fsdp.tp if fsdp else 1
    D = max(1, W // tp)
    workload = resolve_workload(workload, data_parallel_ranks=D)
    S = (fsdp.shard_group_size or D) if fsdp else 1  # with tp, FSDP shards over the dp axis
    threshold = fsdp.param_persistence_threshold if fsdp else math.inf
    w = DTYPE_BYTES[workload.weights_dtype]
    p = DTYPE_BYTES[fsdp.param_dtype] if fsdp else w
    n = workload.completions_per_rank(D)
    m = workload.micro_batch_size_per_gpu
    T = workload.sequence_tokens
    N = m * T
    V, H = spec.vocab_size, spec.hidden_size
    Hs = H * spec.hidden_streams  # the hidden state every block carries (x4 under Gemma-3n's AltUp)
    extra_streams = spec.hidden_streams - 1
    r = workload.lora_rank
    adapters = 2 if workload.use_separate_reference_adapter else 1
    notes: list[str] = []

    # -- tensors and FSDP units --------------------------------------------------------------
    lora_shapes = _lora_shapes(spec, workload)
    lora_key = ModelSpec._target_key(workload.lora_targets)
    lora_names = [[entry[0] for entry in b.lora[lora_key]] for b in spec.blocks]
    if tp > 1 and (problem := _tp_problem(spec, tp)):
        raise ValueError(problem)
    ep = fsdp.ep if fsdp else 1
    if ep > 1:
        _check_ep(spec, ep, W, fsdp)
    # Which expert code runs (agilerl.distributed._moe): PEFT's merged expert stack in the
    # Hugging Face loop, or the project's row-wise experts (expert parallel or a chunk size).
    chunk_mib = fsdp.routed_expert_chunk_mib if fsdp else None
    expert_rowwise = ep > 1 or chunk_mib is not None
    expert_group = W // ep if ep > 1 else None
    units: list[_Unit] = []
    embed = _tensor(spec.embed_shape, threshold)
    head = _tensor(spec.lm_head_shape, threshold) if spec.lm_head_shape else None
    root = _Unit("root", base=[_tensor(s, threshold) for name, s in spec.root_tensors if not is_per_layer_embedding(name)])
    for _, (a_rows, a_cols, b_rows, b_cols) in ((e[0], e[1:]) for e in spec.lora_outside_blocks.get(lora_key, ())):
        for _ in range(adapters):  # adapted linears outside the blocks (Gemma-3n's AltUp projections)
            root.lora.append(_tensor((r * a_rows, a_cols), threshold))
            root.lora.append(_tensor((b_rows, r * b_cols), threshold))
    if spec.tie_word_embeddings:
        root.base.append(embed)
    else:
        units.append(_Unit("embed", base=[embed]))
    # Per-layer embeddings (PLE) are a unit of their own, looked up right after the embeddings.
    ple = [_tensor(s, threshold) for name, s in spec.root_tensors if is_per_layer_embedding(name)]
    if ple and fsdp is not None:
        units.append(_Unit("embed_tokens_per_layer", base=ple))
    elif ple:
        root.base.extend(ple)
    wrap = fsdp.wrap_every_n_blocks if fsdp else 1
    packed = [_packed(spec.block(i)) for i in range(spec.num_layers)]
    # Under FSDP with ep > 1 each layer's packed experts are a unit nested in its block's
    # (also counted there).
    expert_units = {i: _Unit(f"blocks.{i}.experts") for i in range(spec.num_layers) if packed[i]}
    nested: dict[str, list[_Unit]] = {}  # block unit name -> its nested expert units
    expert_down = [0] * spec.num_layers  # elements of each layer's down_proj stack on one EP rank
    for start in range(0, spec.num_layers, wrap):
        unit = _Unit(f"blocks.{start}")
        layers = range(start, min(start + wrap, spec.num_layers))
        for i in layers:
            for tname, shape in spec.block(i).tensors:
                if packed[i] and _is_packed_expert(tname, shape):  # [E, ., .]: split by ep, FSDP over world / ep
                    t = _tensor(shape, threshold, ep=ep, ep_dim=0, group=expert_group)
                    expert_units[i].base.append(t)
                    if tname.endswith("down_proj"):
                        expert_down[i] += t.numel
                else:
                    # A MoE block splits its attention only (agilerl.distributed._tp).
                    split = not packed[i] or tname.startswith("self_attn.")
                    t = _tensor(shape, threshold, tp=tp, tp_dim=_tp_dim(tname) if split else None)
                unit.base.append(t)
            for name, (a_rows, a_cols, b_rows, b_cols) in zip(lora_names[i], lora_shapes[i]):
                module = name.rsplit(".", 1)[-1]
                for _ in range(adapters):
                    if packed[i] and _is_packed_expert(name):  # A (r E, in) by its rows, B (out, r E) by its columns
                        pair = (_tensor((r * a_rows, a_cols), threshold, ep=ep, ep_dim=0, group=expert_group),
                                _tensor((b_rows, r * b_cols), threshold, ep=ep, ep_dim=1, group=expert_group))
                        unit.lora.extend(pair)
                        expert_units[i].lora.extend(pair)
                        continue
                    # colwise base: B split on its output; rowwise: A on its input
                    split = tp if not packed[i] or name.startswith("self_attn.") else 1
                    unit.lora.append(_tensor((r * a_rows, a_cols), threshold, tp=split,
                                             tp_dim=1 if module in _ROWWISE else None))
                    unit.lora.append(_tensor((b_rows, r * b_cols), threshold, tp=split,
                                             tp_dim=0 if module in _COLWISE else None))
        units.append(unit)
        # With ep=1 agilerl.distributed shards the experts inside their block's unit.
        nested[unit.name] = [expert_units[i] for i in layers if packed[i]] if ep > 1 else []
    # Elements of each layer's routed experts held by one EP rank.
    expert_stack = [sum(t.numel for t in expert_units[i].base) if packed[i] else 0 for i in range(spec.num_layers)]
    if head is not None:
        units.append(_Unit("lm_head", base=[head]))
    all_units = units + [root]
    block_units = [u for u in units if u.name.startswith("blocks.")]

    base_tensors = [t for u in all_units for t in u.base]
    lora_tensors = [t for u in all_units for t in u.lora]
    if workload.load_in_4bit:
        weights = int(sum(t.numel for t in base_tensors if t is not embed and t is not head) * NF4_BYTES_PER_PARAM)
        weights += embed.numel * w + (head.numel * w if head else 0)
        weights_replicated = 0
        notes.append("QLoRA: NF4 base weights (embeddings and lm_head kept in the weights dtype)")
    elif fsdp is None:  # unsharded: every rank holds the whole base
        weights = sum(t.numel * w for t in base_tensors)
        weights_replicated = 0
    else:
        weights = sum(t.local(S) * w for t in base_tensors if t.sharded)
        weights_replicated = sum(t.numel * w for t in base_tensors if not t.sharded)
    lora_local = sum(t.local(S) for t in lora_tensors)  # elements, all adapters
    trainable_local = lora_local // adapters if adapters else lora_local
    trainable_tensors = len(lora_tensors) // adapters
    lora_bytes = lora_local * 4  # PEFT keeps adapters in fp32

    offload_optim = bool(fsdp and fsdp.optim_cpu_offload)
    cpu_offload = bool(fsdp and fsdp.cpu_offload)
    optimizer_device = 0 if (offload_optim or cpu_offload) else trainable_local * 8 + trainable_tensors * 4
    host_optimizer = (trainable_local * 16 + trainable_tensors * 4) if (offload_optim or cpu_offload) else 0
    if cpu_offload:
        host_params = weights + lora_bytes
        weights, lora_bytes_device = 0, sum(t.numel * 4 for t in lora_tensors if not t.sharded)
    else:
        host_params = 0
        lora_bytes_device = lora_bytes
    grads_sharded = trainable_local * 4

    def unit_gathered(unit: _Unit) -> int:
        """Full bytes of a unit's sharded tensors in the compute dtype."""
        if not fsdp:
            return 0
        base, lora = unit.full_sharded_numel()
        return int((base + lora) * p)

    sizes = [unit_gathered(u) for u in units]  # in forward order
    root_gathered = unit_gathered(root)
    all_gathered = sum(sizes) + root_gathered
    # The order FSDP2 gathers in: a block's own parameters, then each of its layers'
    # nested expert units. Entries are (bytes, index of the enclosing entry or None, bytes
    # a prefetch of it holds). Prefetching a unit holds its all-gather output until it
    # runs; on a one-rank shard group FSDP2 all-gathers nothing and makes the unsharded
    # parameters when the unit runs, so a prefetch there holds nothing.
    order: list[tuple[int, int | None, int]] = []
    for u, size in zip(units, sizes):
        inner = [unit_gathered(x) for x in nested.get(u.name, ())]
        outer = len(order)
        own = size - sum(inner)
        order.append((own, None, own if S > 1 else 0))
        order.extend((b, outer, b if (expert_group or S) > 1 else 0) for b in inner)
    largest_unit = max((b for b, _, _ in order), default=0)
    # Beside the window of gathered units (the current ones, and the prefetched ones whose
    # all-gather output is in flight) the peak holds more FSDP buffers than the window
    # counts: an allowance of all_gather_overlap x the largest of the embeddings, PLE,
    # head and root units, fitted on the dense probes (which buffer it stands for there is
    # not pinned down). It does not scale with the blocks: MoE probes (a tensor-level
    # tracker on 2 and 4 gloo ranks) show no expert- or block-sized buffer at the experts'
    # backward, and a dense two-block unit's probe none beyond the prefetched embeddings.
    edges = [size for u, size in zip(units, sizes) if not u.name.startswith("blocks.")]
    gather_buffer = int(k.all_gather_overlap * max(edges + [root_gathered]))

    def in_flight(prefetch: int, *, forward: bool) -> int:
        """The most gathered at once: a unit, its enclosing block, the next ``prefetch``
        units in order, the root and the buffer allowance.

        Units run in order (embeddings, blocks with their nested expert units,
        lm_head; reversed in backward), so the gathered set is a sliding window
        over that order. In forward FSDP2 defers freeing a unit's all-gather output
        until the next unit's copy-out (to overlap the two), so a running unit is
        held twice; in backward it is freed at the copy-out. With
        reshard_after_forward=False every unit stays gathered from its forward to
        its backward, and after a no-grad forward until the next backward (FSDP2
        reshards in post-backward only).
        """
        if not fsdp:
            return 0
        if not fsdp.reshard_after_forward:
            return all_gathered + gather_buffer
        direction = order if forward else _reversed_with_parents(order)
        # agilerl.distributed prefetches the next outer units (blocks, embeddings, head);
        # a nested expert unit is gathered when its own forward or backward starts.
        outer = [j for j, (_, parent, _) in enumerate(direction) if parent is None]
        window = 0
        for j, (size, parent, ahead) in enumerate(direction):
            held = size + (direction[parent][0] if parent is not None else 0) + (ahead if forward else 0)
            first = bisect.bisect_right(outer, j)
            held += sum(direction[i][2] for i in outer[first : first + prefetch])
            window = max(window, held)
        return window + root_gathered + (0 if forward else gather_buffer)

    bwd_gathered = in_flight(fsdp.backward_prefetch_units if fsdp else 0, forward=False)
    nograd_gathered = (in_flight(fsdp.prefetch_units, forward=True) if fsdp.reshard_after_forward
                       else all_gathered) if fsdp else 0

    # -- activations ---------------------------------------------------------------------------
    # Eager attention materialises batch x heads x Tq x Tk scores (one copy saved per block
    # for backward, two alive in a forward; counted with saved-tensor hooks). SDPA does not,
    # on GPUs nor on CPU (torch's CPU flash kernel: a 448-token call whose scores would take
    # 73.5 MiB peaks at 5.4 MiB). Padded batches add Hugging Face's boolean
    # batch x Tq x Tk mask (a float copy on CPU), which fixed-length probes never have and
    # the estimate does not model yet.
    scores_materialised = workload.attn_implementation == "eager"

    def scores(batch: int, t_q: int, index: int, copies: float) -> int:
        if not scores_materialised:
            return 0
        att = spec.block(index).attention
        t_k = min(t_q, att.sliding_window) if att.sliding_window and workload.attn_implementation != "eager" else t_q
        return int(copies * batch * att.num_heads // tp * t_q * t_k * p)

    expert_lora = [any(_is_packed_expert(n) for n in names) for names in lora_names]  # LoRA on the stacks

    def routed(index: int) -> tuple[int, int] | None:
        """(experts per token, expert width) of a block with packed routed experts, else None."""
        b = spec.block(index)
        if b.mlp.kind != "moe" or not packed[index]:
            return None
        return max(1, b.mlp.experts_per_token), b.mlp.intermediate_size

    def expert_chunk(rows: int, width: int) -> int:
        """Rows one expert chunk computes at once (agilerl.distributed._moe.expert_chunk_rows)."""
        if chunk_mib is None:
            return rows
        return min(rows, max(1, int(chunk_mib * MIB) // (max(2 * width, H) * p)))

    def block_saved(batch: int, index: int) -> int:
        """Bytes autograd saves for one block's backward (LoRA on a frozen base), ``batch`` x T tokens."""
        b = spec.block(index)
        width = b.mlp.shared_intermediate_size if b.mlp.kind == "moe" else b.mlp.intermediate_size
        qkv = b.attention.q_dim + 2 * b.attention.kv_dim
        # Tensor parallelism splits heads and MLP columns; the hidden stream is whole.
        mlp_tp = 1 if packed[index] else tp  # a MoE block's MLP is whole on every TP rank
        per_token = (k.act_hidden * H + k.act_qkv * qkv / tp + k.act_mlp * width / mlp_tp) * p
        # AltUp's predict / correct over every stream and its router save about 7.5 hidden-sized
        # tensors per token per extra stream (counted on Gemma-3n's forward with LoRA).
        per_token += 7.5 * extra_streams * H * p
        per_token += k.act_lora * r * len(lora_shapes[index]) * 4
        extra = 0
        moe = routed(index)
        if b.mlp.kind == "moe":
            # The router saves its input (the MLP input, which in a dense block gate_proj saves
            # and act_mlp counts), its fp32 scores and the top-k (counted with saved-tensor hooks:
            # 1.12 and 1.10 hidden-sized tensors per token on the tiny Mixtral and Qwen3-MoE).
            per_token += (H * p if moe is not None else 0) + (b.mlp.num_experts + 3 * b.mlp.experts_per_token) * 4
        if moe is None and b.mlp.kind == "moe":  # unpacked experts: the active ones, like a dense MLP
            per_token += k.act_mlp * b.mlp.intermediate_size * b.mlp.experts_per_token * p
        elif moe is not None:
            top_k, expert_width = moe
            if expert_rowwise and chunk_mib is not None:
                # Each chunk is checkpointed: only the dispatched rows and the combine's inputs stay.
                per_token += k.moe_rows_saved * top_k * H * p
            else:
                per_token += (k.act_mlp * expert_width + k.moe_rows_hf * H) * top_k * p
                if not expert_rowwise and expert_lora[index]:  # PEFT folds LoRA into a copy of the stack
                    extra = expert_stack[index] * p                   # the expert linears save
        return int(batch * T * per_token) + extra + scores(batch, T, index, k.attn_scores_saved)

    def block_backward_transient(batch: int, index: int) -> int:
        """What a MoE block's backward allocates beyond its saved tensors (0 for a dense block)."""
        moe = routed(index)
        if moe is None:
            return 0
        top_k, expert_width = moe
        rows = batch * T * top_k
        if not expert_rowwise:
            # Hugging Face's grouped GEMMs peak at one of two moments of the backward (located
            # with a tracker on the tiny Qwen3-MoE and Mixtral):
            # - down's: its input's gradient (rows x width) and, with LoRA on the stacks, the
            #   gradient of PEFT's merged down stack;
            # - the activation product's: its output gradient and its two input gradients
            #   (3 x rows x width), once down's saved input (rows x width) and its merged
            #   stack are freed.
            merged_down = expert_down[index] if expert_lora[index] else 0  # the saved merged copy
            down = rows * expert_width + k.moe_stack_grad * merged_down
            product = 2 * rows * expert_width - merged_down
            return int(max(down, product) * p)
        # Row-wise experts (agilerl.distributed._moe): per token block, the backward peaks at one
        # of two moments (each located with a tracker on 2 and 4 gloo ranks):
        # - the dispatch: row gradients of the combine, the un-permute (or the all-to-all's
        #   receive buffer), the regrouping, and the concatenation of the chunks' gradients;
        # - a chunk's recompute: the experts of the chunk run one after another, each keeping
        #   its intermediates for backward (gate_up's output, the activation, the product:
        #   4 x width per row, and down's output, hidden) while the last one's gate_up is
        #   made: the base product, the LoRA product and its scaled copy (2 x width each),
        #   beside the block's row gradient and the chunk's input.
        block_rows = rows / (fsdp.ep_token_blocks if fsdp else 1)
        dispatch = (4 + k.moe_dispatch) * block_rows * H
        chunk_rows = expert_chunk(int(block_rows), expert_width)
        per_expert = min(chunk_rows, block_rows / (spec.block(index).mlp.num_experts // ep))
        gate_up_copies = 3 if expert_lora[index] else 1
        recompute = 2 * block_rows * H + k.moe_chunk * ((chunk_rows - per_expert) * (4 * expert_width + H)
                                                        + gate_up_copies * per_expert * 2 * expert_width)
        return int(max(dispatch, recompute) * p)

    def block_forward_temps(batch: int, length: int, index: int, adapters_on: bool = True) -> int:
        """Peak temporaries of one block's forward without grad over ``batch`` x ``length`` tokens.

        ``adapters_on=False``: the reference pass on the base model (adapters disabled), where
        PEFT merges no expert stacks."""
        b = spec.block(index)
        width = b.mlp.intermediate_size * max(1, b.mlp.experts_per_token) + b.mlp.shared_intermediate_size
        moe = routed(index)
        experts = 0
        if moe is not None:
            top_k, expert_width = moe
            width = b.mlp.shared_intermediate_size
            rows = batch * length * top_k
            if expert_rowwise:
                # agilerl.distributed._moe without grad: the dispatched rows and the output
                # buffer, and inside a chunk the outputs of its experts so far (then their
                # concatenation) beside one expert's intermediates: gate_up's output (three
                # 2 x width products with an active adapter on the stacks), or the gate's
                # activation and product (width each) beside it; and the block's normed input,
                # which the experts' caller holds until they return.
                chunk_rows = expert_chunk(rows, expert_width)
                per_expert = min(chunk_rows, rows / max(1, b.mlp.num_experts // ep))
                gate_up = (3 if adapters_on and expert_lora[index] else 1) * 2 * expert_width
                one_expert = per_expert * (max(gate_up, 4 * expert_width) + H)
                in_chunk = max(2 * chunk_rows * H, (chunk_rows - per_expert) * H + one_expert)
                experts = (2 * rows * H + in_chunk + batch * length * H) * p
            else:
                # Hugging Face's grouped-GEMM experts run every routed row at once: the
                # gathered rows, gate_up's output (2 x width), the activation and the
                # product (width each); with the adapter on the stacks, PEFT's merged stacks
                # beside them (three copies of gate_up's, two of down's, about 8/3 of the stack;
                # counted on a no-grad forward with transformers 5).
                experts = (rows * (4 * expert_width + H) + (8 / 3 * expert_stack[index] if adapters_on and expert_lora[index] else 0)) * p
        temps = batch * length * (k.fwd_hidden * H + k.fwd_mlp * width / (1 if packed[index] else tp)) * p + experts
        if extra_streams:  # AltUp: input, predictions, the correction and its result, every stream
            temps += (4 * extra_streams + 2) * batch * length * H * p
        return int(temps) + scores(batch, length, index, k.attn_scores_fwd)

    checkpointed = workload.gradient_checkpointing
    ckpt_blocks = set()
    if checkpointed:
        skip = set(fsdp.checkpoint_skip_layer_types) if fsdp else set()
        every = fsdp.checkpoint_every_n_blocks if fsdp else 1
        eligible = [i for i in range(spec.num_layers) if spec.block(i).kind not in skip]
        ckpt_blocks = set(eligible[::every])
    # Gemma-3n's AltUp: a checkpointed block keeps every stream of its input, and outside the
    # blocks the per-stream magnitude rescaling at the embeddings and at the unembedding saves
    # about 5 x (streams - 1) + 3 hidden-sized tensors per token (counted on its forward).
    altup_outside = (5 * extra_streams + 3) * N * H * p if extra_streams else 0
    saved = 0
    for i in range(spec.num_layers):
        saved += (k.act_checkpointed + extra_streams) * N * H * p if i in ckpt_blocks else block_saved(m, i)
    # Recomputing the largest checkpointed block in backward re-creates its saved tensors;
    # a MoE block's backward also makes its experts' transients (a chunk, all-to-all buffers).
    recompute = max((block_saved(m, i) if i in ckpt_blocks else 0) + block_backward_transient(m, i)
                    for i in range(spec.num_layers))
    # Embedding output, final norm in/out (the captured hidden), Gemma-3n's per-layer inputs.
    boundary = int(k.act_boundary * N * (H + spec.per_layer_input_width) * p) + altup_outside
    saved_total = int(saved) + boundary

    rows_learn = m * (T - 1)
    chunk = workload.logprob_chunk_size
    # The chunked head multiplies by the dense lm_head weight: under FSDP a gathered copy
    # (materialize_dtensors), unless reshard_after_forward=False left the unit unsharded
    # after the forward, when the head uses that unsharded weight as it is.
    head_weight = V * H * p if fsdp and fsdp.reshard_after_forward else 0
    if chunk is None or chunk >= rows_learn:
        logits_learn = rows_learn * V * 4 * k.logits_copies_unchunked
    else:
        logits_learn = chunk * V * 4 * k.logits_copies_grad
    logits_learn = int(logits_learn + head_weight + m * V * 4)  # + the one-position logits
    chunk_nograd = min(chunk or rows_learn, rows_learn)
    logits_ref = int(chunk_nograd * V * 4 * k.logits_copies_nograd + head_weight + m * V * 4)
    outputs_ref = n * T * 4 * ((1 if workload.beta > 0 else 0) + (1 if workload.update_epochs > 1 else 0))

    # Gradients. Components peak at different moments of a micro-batch, so the learn
    # phase is the larger of two sub-peaks: the head's backward (every activation still
    # saved, the logits workspace at its largest) and the first block's backward
    # (activations, the recomputed block, a unit's unsharded gradients being reduced).
    micro_batches = n // m
    trainable_full = sum(t.numel for t in lora_tensors) // adapters
    if fsdp:
        unit_lora_full = max((sum(t.numel for t in u.lora if t.sharded) for u in block_units), default=0) // adapters
        if micro_batches > 1:  # gradients of the earlier micro-batches of this step
            prior_grads = trainable_full * p if fsdp.defer_grad_sync else grads_sharded
        else:
            prior_grads = 0
        reducing = unit_lora_full * p
        reduce_buffer = unit_lora_full * DTYPE_BYTES[fsdp.reduce_dtype]
    else:
        prior_grads = trainable_local * 4 if micro_batches > 1 else 0
        reducing = reduce_buffer = 0

    # -- GPU-only terms -------------------------------------------------------------------------
    def gpu_overheads(allocated: int) -> dict[str, int]:
        if not gpu_terms:
            return {}
        return {
            "cuda_context": cluster.gpu.cuda_context_bytes,
            "allocator_slack": int(allocated * k.allocator_slack_fraction),
            **({"comm_buffers": k.nccl_bytes} if W > 1 else {}),
        }

    vllm_awake = int(workload.vllm_gpu_memory_utilization * cluster.gpu.memory_bytes) if workload.generation == "vllm" else 0
    vllm_asleep = k.vllm_sleep_residual_bytes if workload.generation == "vllm" and gpu_terms else 0
    if workload.generation == "vllm":
        notes.append("vLLM terms are not yet validated by a measurement")

    static = {
        "weights": weights,
        "weights_replicated": weights_replicated,
        "lora": lora_bytes_device,
        "optimizer_state": optimizer_device,
    }
    host_base = {"host_process": k.host_process_bytes}
    if host_optimizer:
        host_base["host_optimizer_state"] = host_optimizer
    if host_params:
        host_base["host_weights"] = host_params
    if workload.generation == "vllm" and workload.vllm_sleep_level == 1:
        host_base["host_vllm_weights"] = spec.total_params * w

    def phase(components: dict[str, int], host: dict[str, int] | None = None) -> PhaseEstimate:
        merged = {name: int(v) for name, v in components.items() if v}
        allocated = sum(merged.values())
        for name, v in gpu_overheads(allocated).items():
            merged[name] = merged.get(name, 0) + v
        return PhaseEstimate(components=merged, host={**host_base, **(host or {})})

    phases: dict[str, PhaseEstimate] = {}
    largest_tensor = max([t.numel for t in base_tensors] or [0]) * w
    phases["load"] = phase(
        {**static, "optimizer_state": 0, "weights_gathered": largest_tensor if fsdp else 0},
        {"host_checkpoint": largest_tensor if fsdp else spec.total_params * w},
    )

    def larger(*candidates: dict[str, int]) -> dict[str, int]:
        return max(candidates, key=lambda c: sum(c.values()))

    # rollout
    if workload.generation == "hf":
        def kv_cache(tokens: int) -> int:
            out = 0
            for i in range(spec.num_layers):
                att = spec.block(i).attention
                length = min(tokens, att.sliding_window) if att.sliding_window else tokens
                out += 2 * n * length * att.kv_dim // tp * p
            return out

        # Two moments: the prefill of the prompts (its largest block's temporaries beside
        # the prompt's cache and hidden states; logits of the last position only), and
        # the last decode steps (the whole cache, grown by concatenation, and sampling).
        prefill = max(block_forward_temps(n, workload.prompt_tokens, i) for i in range(spec.num_layers))
        residual = int(k.gen_hidden * n * workload.prompt_tokens * Hs * p)
        full_kv = kv_cache(T)
        phases["rollout"] = phase({**static, "weights_gathered": nograd_gathered, **larger(
            {"kv_cache": kv_cache(workload.prompt_tokens), "activations": prefill + residual, "logits": n * V * 4},
            {"kv_cache": int(full_kv * (1 + 1 / max(1, spec.num_layers))), "logits": n * V * 4 * 3},
        )})
    elif workload.generation == "vllm":
        phases["rollout"] = phase({**static, "vllm": vllm_awake})
        phases["sync"] = phase({**static, "vllm": vllm_awake, "weights_gathered": largest_unit if fsdp else 0})

    # After a forward: the root stays gathered; with reshard_after_forward=False every unit.
    if fsdp and not fsdp.reshard_after_forward:
        after_forward = all_gathered
    else:
        after_forward = root_gathered if fsdp else 0

    # reference (no grad), per micro-batch: a block's forward, or the chunked head
    if workload.beta > 0 or workload.update_epochs > 1:
        # The old-policy pass (update_epochs > 1) runs the actor; the reference pass runs the
        # base model with adapters disabled unless the reference is an adapter of its own.
        adapters_on = workload.use_separate_reference_adapter or workload.update_epochs > 1
        fwd = max(block_forward_temps(m, T, i, adapters_on) for i in range(spec.num_layers))
        phases["reference"] = phase({**static, "vllm": vllm_asleep, **larger(
            {"weights_gathered": nograd_gathered, "activations": fwd + 2 * N * Hs * p + outputs_ref},
            {"weights_gathered": after_forward, "activations": N * Hs * p + outputs_ref, "logits": logits_ref},
        )})

    # learn: forward + backward of one micro-batch (the last of the step)
    phases["learn"] = phase({**static, "vllm": vllm_asleep, **larger(
        {"weights_gathered": after_forward, "gradients": prior_grads,
         "activations": saved_total + outputs_ref, "logits": logits_learn},
        {"weights_gathered": bwd_gathered, "gradients": prior_grads + reducing,
         "activations": saved_total + recompute + outputs_ref, "comm_buffers": reduce_buffer},
    )})

    # step: clip and AdamW (on a CPU run the "host" moments are in the same memory)
    step_optimizer = optimizer_device + (0 if host_optimizer else trainable_tensors * 4)
    if host_optimizer and not gpu_terms:
        step_optimizer += trainable_local * 8
    phases["step"] = phase({**static, "vllm": vllm_asleep, "gradients": grads_sharded,
                            "optimizer_state": step_optimizer})

    # save: adapters gathered one tensor at a time; rank 0 keeps them and the optimizer state on the host
    largest_lora = max((t.numel for t in lora_tensors), default=0) * 4
    phases["save"] = phase({**static, "vllm": vllm_asleep, "weights_gathered": largest_lora},
                           {"host_checkpoint": lora_local * 4 * S + trainable_local * 8 * S})
    return Estimate(phases=phases, capacity_bytes=cluster.gpu.memory_bytes, gpus_per_node=cluster.per_node,
                    notes=tuple(notes))
