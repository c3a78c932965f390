"""The inputs of one estimate, resolved and validated once: a frozen :class:`Context`.

Every term of the estimate is a pure function of a context (and of the FSDP layout built
from it, :mod:`._units`). Building it raises what the trainer would refuse: a batch that
does not split over the data-parallel ranks, a spec without the LoRA targets, a TP or
EP degree agilerl.distributed does not accept.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from dataclasses import dataclass, field

from agilerl.distributed import FSDPConfig, ParallelDims
from agilerl.utils.shared_prefix import shared_prefix_problem

from ..hardware import Cluster
from ..spec import ModelSpec
from ..workload import VLLM_DEFAULT_MAX_NUM_SEQS, VLLM_DEFAULT_UTILIZATION, Workload
from ._coefficients import Coefficients
from ._parallel import check_ep, is_packed, is_packed_expert, tp_problem

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: One adapter's (a_rows, a_cols, b_rows, b_cols) at rank 1.
LoraShape = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class Context:
    """What one estimate needs, per rank (rank 0, which holds the largest shards).

    Per-layer fields are tuples indexed by layer. Layers of one block type have equal
    terms, so the maxima over layers are taken over ``distinct_layers`` only.
    """

    spec: ModelSpec
    workload: Workload  # with the trainer's defaults (resolve_workload)
    cluster: Cluster
    fsdp: FSDPConfig | None
    coefficients: Coefficients
    merged_stack_copies: float  # expert stacks PEFT builds for a forward with an adapter on them
    sharded: bool  # under FSDP
    on_gpu: bool  # GPU-only terms apply
    num_gpus: int
    tp: int
    ep: int
    data_parallel_ranks: int
    shard_group: int  # ranks a weight shard spans (with tp, FSDP shards over the dp axis)
    persistence_threshold: float  # tensors smaller than this stay replicated
    weight_bytes: int  # per element of the weights dtype (the loaded checkpoint, a vLLM engine's copy)
    stored_bytes: int  # per element of the actor's base parameters: fp32 shards under FSDP with full_finetune
    full_finetune: bool  # every parameter trains (no adapters)
    reference_copy: bool  # full fine-tuning with a reference: a frozen copy of the model in the weights dtype
    compute_bytes: int  # per element of the compute dtype (FSDP param_dtype, else the weights')
    adapter_compute_bytes: int  # the adapters' compute dtype: fp32 (PEFT) unsharded, param_dtype under FSDP
    completions_per_rank: int
    micro_batch: int
    micro_batches: int  # per step
    sequence_tokens: int  # prompt + completion
    micro_batch_tokens: int
    vocab_size: int
    hidden_size: int
    carried_hidden: int  # the hidden state every block carries (x4 under Gemma-3n's AltUp)
    extra_streams: int  # AltUp streams beyond the first
    lora_rank: int
    num_adapters: int  # 2 with a separate reference adapter
    lora_key: str
    lora_names: tuple[tuple[str, ...], ...]  # per layer
    lora_shapes: tuple[tuple[LoraShape, ...], ...]  # per layer
    packed: tuple[bool, ...]  # per layer: routed experts packed per layer
    expert_lora: tuple[bool, ...]  # per layer: LoRA on the expert stacks
    attention_sinks: tuple[bool, ...]  # per layer: BlockSpec.has_attention_sinks
    expert_biases: tuple[bool, ...]  # per layer: BlockSpec.has_expert_biases
    expert_chunk_mib: int | None
    expert_rowwise: bool  # the project's row-wise experts rather than the Hugging Face loop
    expert_group: int | None  # ranks an expert shard spans under EP
    checkpointed: frozenset[int]  # layers wrapped for activation checkpointing
    scores_materialised: bool  # eager attention
    distinct_layers: tuple[int, ...]  # the first layer of each block type
    representative: tuple[int, ...]  # per layer: the first layer of its block type
    layer_counts: tuple[tuple[int, int], ...]  # (first layer of a block type, its layers), per type
    # The shared-prefix forward (agilerl.utils.shared_prefix), 0 / the row count where it does not run:
    prefix_split: int  # columns a learn / reference micro-batch runs once per distinct prompt
    prefix_rows: int  # distinct prompts in such a micro-batch (its prefix pass's rows)
    rollout_prefix_rows: int  # distinct prompts of a rank's rollout (its shared prefill's rows)
    # per distinct layer, its block's counted tape (planner.memory._activations.tape_of), made once
    tapes: dict = field(default_factory=dict, compare=False, repr=False)


@functools.cache
def peft_merged_stack_copies() -> float:
    """Copies of a layer's expert stack PEFT's forward builds with one adapter active on the
    stacks, by the installed PEFT (its version read from its metadata, nothing imported): from
    0.21 it folds ``W + s B A`` into one copy of each stack (``baddbmm``): 1; before, it built the
    delta beside the sum (three copies of gate_up's, two of down's): 8/3. Measured with a
    live-tensor tracker on PEFT's real forward (tests/planner/memory/test_moe.py)."""
    try:
        version = importlib.metadata.version("peft")
    except importlib.metadata.PackageNotFoundError:
        return 1.0  # the trainer needs PEFT; planning without it, assume a current one
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    return 1.0 if tuple(parts) >= (0, 21) else 8 / 3


def resolve_workload(workload: Workload, *, data_parallel_ranks: int) -> Workload:
    """The workload with the trainer's own defaults for fields left to the planner."""
    n = workload.completions_per_rank(data_parallel_ranks)
    return workload.model_copy(
        update={
            "micro_batch_size_per_gpu": workload.micro_batch_size_per_gpu or n,
            "gradient_checkpointing": True
            if workload.gradient_checkpointing is None
            else workload.gradient_checkpointing,
            # VLLMConfig's defaults
            "vllm_gpu_memory_utilization": workload.vllm_gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION,
            "vllm_max_num_seqs": workload.vllm_max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS,
        }
    )


def distinct_prompts(rows: int, group_size: int) -> int:
    """Distinct prompts among ``rows`` consecutive completions that start at a multiple of ``rows``
    (a rank's share, or a micro-batch of it), with ``group_size`` completions per prompt."""
    if group_size % rows == 0:
        return 1
    if rows % group_size == 0:
        return rows // group_size
    return min(rows, -(-rows // group_size) + 1)  # a slice that straddles a group boundary


def shared_prefix_split(spec: ModelSpec, workload: Workload, tp: int) -> int:
    """The columns the trainer runs once per distinct prompt, every prompt column but the last
    (whose hidden state scores the first completion token); 0 where the shared-prefix forward does
    not run (agilerl.utils.shared_prefix.shared_prefix_problem, with the spec's windows)."""
    if not workload.share_prompt_prefix or workload.prompt_tokens < 2:
        return 0
    length = workload.sequence_tokens
    full_causal = all(
        b.attention.sliding_window is None or b.attention.sliding_window >= length for b in spec.block_types.values()
    )
    if shared_prefix_problem(spec.model_type, workload.attn_implementation, full_causal=full_causal, tp=tp):
        return 0
    return workload.prompt_tokens - 1


def checkpointed_layers(spec: ModelSpec, workload: Workload, fsdp: FSDPConfig | None) -> frozenset[int]:
    """The layers agilerl.distributed.apply_activation_checkpointing wraps: of the blocks whose
    kind is not in ``checkpoint_skip_layer_types``, the first and then every n-th."""
    if not workload.gradient_checkpointing:
        return frozenset()
    skip = set(fsdp.checkpoint_skip_layer_types) if fsdp else set()
    every = fsdp.checkpoint_every_n_blocks if fsdp else 1
    eligible = [i for i in range(spec.num_layers) if spec.block(i).kind not in skip]
    return frozenset(eligible[::every])


def _lora_by_type(spec: ModelSpec, workload: Workload) -> dict[str, tuple[tuple[str, ...], tuple[LoraShape, ...]]]:
    """Per block type: its adapters' names and (a_rows, a_cols, b_rows, b_cols) at rank 1 (none
    with full fine-tuning)."""
    if workload.full_finetune:
        return {kind: ((), ()) for kind in spec.block_types}
    key = ModelSpec.target_key(workload.lora_targets)
    if not spec.has_lora_targets(workload.lora_targets):
        raise KeyError(f"the spec of {spec.name} has no LoRA coverage for targets {key!r}; rebuild it with them")
    return {
        kind: (tuple(e[0] for e in b.lora[key]), tuple(e[1:] for e in b.lora[key]))
        for kind, b in spec.block_types.items()
    }


def build_context(
    spec: ModelSpec, workload: Workload, cluster: Cluster, fsdp: FSDPConfig | None, *, coefficients: Coefficients
) -> Context:
    """Resolve and validate the inputs of one estimate (raises ValueError / KeyError as the trainer would)."""
    num_gpus = cluster.num_gpus
    # The ranks' split, validated as agilerl.distributed validates it (ValueError naming what divides).
    dims = fsdp.dims(num_gpus) if fsdp else ParallelDims(num_gpus)
    tp, ep = dims.tp, dims.ep
    data_parallel_ranks = dims.dp
    workload = resolve_workload(workload, data_parallel_ranks=data_parallel_ranks)
    weight_bytes = DTYPE_BYTES[workload.weights_dtype]
    completions = workload.completions_per_rank(data_parallel_ranks)
    micro_batch = workload.micro_batch_size_per_gpu or completions  # as resolve_workload resolved it
    lora = _lora_by_type(spec, workload)
    if tp > 1 and (problem := tp_problem(spec, tp)):
        raise ValueError(problem)
    if ep > 1:
        check_ep(spec, ep, num_gpus)
    # Which expert code runs (agilerl.distributed._moe): PEFT's merged expert stack in the
    # Hugging Face loop, or the project's row-wise experts (expert parallel or a chunk size).
    chunk_mib = fsdp.routed_expert_chunk_mib if fsdp else None
    first: dict[str, int] = {}
    for i, kind in enumerate(spec.layers):
        first.setdefault(kind, i)
    packed = {kind: is_packed(b) for kind, b in spec.block_types.items()}
    split = shared_prefix_split(spec, workload, tp)
    group = workload.group_size
    rollout_rows = distinct_prompts(completions, group) if split else completions
    prefix_rows = distinct_prompts(micro_batch, group) if split else micro_batch
    if prefix_rows >= micro_batch:  # a micro-batch of distinct prompts runs in one pass
        split, prefix_rows = 0, micro_batch
    expert_lora = {kind: any(is_packed_expert(n) for n in names) for kind, (names, _) in lora.items()}
    sinks = {kind: b.has_attention_sinks for kind, b in spec.block_types.items()}
    biases = {kind: b.has_expert_biases for kind, b in spec.block_types.items()}
    return Context(
        spec=spec,
        workload=workload,
        cluster=cluster,
        fsdp=fsdp,
        coefficients=coefficients,
        merged_stack_copies=peft_merged_stack_copies(),
        sharded=fsdp is not None,
        on_gpu=cluster.gpu.kind != "cpu",
        num_gpus=num_gpus,
        tp=tp,
        ep=ep,
        data_parallel_ranks=data_parallel_ranks,
        shard_group=dims.shard if fsdp else 1,
        persistence_threshold=fsdp.param_persistence_threshold if fsdp else math.inf,
        weight_bytes=weight_bytes,
        # agilerl.algorithms.core.loading: full fine-tuning under FSDP2 keeps fp32 shards (the masters)
        stored_bytes=4 if workload.full_finetune and fsdp else weight_bytes,
        full_finetune=workload.full_finetune,
        reference_copy=workload.full_finetune and workload.has_reference,
        compute_bytes=DTYPE_BYTES[fsdp.param_dtype] if fsdp else weight_bytes,
        # the adapters' compute dtype (PEFT's fp32 unsharded); without adapters the compute dtype
        adapter_compute_bytes=(
            DTYPE_BYTES[fsdp.param_dtype] if fsdp else (weight_bytes if workload.full_finetune else 4)
        ),
        completions_per_rank=completions,
        micro_batch=micro_batch,
        micro_batches=completions // micro_batch,
        sequence_tokens=workload.sequence_tokens,
        micro_batch_tokens=micro_batch * workload.sequence_tokens,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        carried_hidden=spec.hidden_size * spec.hidden_streams,
        extra_streams=spec.hidden_streams - 1,
        lora_rank=workload.lora_rank,
        num_adapters=2 if workload.use_separate_reference_adapter else 1,
        lora_key="full" if workload.full_finetune else ModelSpec.target_key(workload.lora_targets),
        lora_names=tuple(lora[kind][0] for kind in spec.layers),
        lora_shapes=tuple(lora[kind][1] for kind in spec.layers),
        packed=tuple(packed[kind] for kind in spec.layers),
        expert_lora=tuple(expert_lora[kind] for kind in spec.layers),
        attention_sinks=tuple(sinks[kind] for kind in spec.layers),
        expert_biases=tuple(biases[kind] for kind in spec.layers),
        expert_chunk_mib=chunk_mib,
        expert_rowwise=ep > 1 or chunk_mib is not None,
        expert_group=dims.expert_shard if ep > 1 else None,
        checkpointed=checkpointed_layers(spec, workload, fsdp),
        scores_materialised=workload.attn_implementation == "eager",
        distinct_layers=tuple(first.values()),
        representative=tuple(first[kind] for kind in spec.layers),
        layer_counts=tuple((i, spec.layers.count(kind)) for kind, i in first.items()),
        prefix_split=split,
        prefix_rows=prefix_rows,
        rollout_prefix_rows=rollout_rows,
    )
