"""How agilerl.distributed splits a model: which tensors are packed experts, which linears
tensor parallelism splits, and the TP / EP degrees it accepts."""

from __future__ import annotations

from agilerl.distributed import (
    COLWISE,
    ROWWISE,
    expert_parallel_problem,
    tp_dim,
    tp_split_problem,
)

from ..spec import BlockSpec, ModelSpec

__all__ = [
    "COLWISE",
    "ROWWISE",
    "tp_dim",
    "is_packed_expert",
    "is_packed",
    "has_packed_experts",
    "row_wise_experts",
    "expert_parallel_degrees",
    "tp_problem",
    "tensor_parallel_degrees",
    "check_ep",
]


def is_packed_expert(name: str, shape: tuple[int, ...] | None = None) -> bool:
    """A routed-expert tensor: ``...experts.gate_up_proj`` [E, ., .], or its LoRA ``...experts:gate_up_proj``.

    Only packed experts (3-D, transformers 5) count: shared experts and per-expert
    module lists are ordinary linears.
    """
    path = name.split(":", 1)[0]
    if "experts" not in path.split("."):
        return False
    return ":" in name or (shape is not None and len(shape) == 3)


def is_packed(block: BlockSpec) -> bool:
    """Whether a block's routed experts are packed per layer ([E, ., .] tensors)."""
    return any(is_packed_expert(n, s) for n, s in block.tensors)


def has_packed_experts(spec: ModelSpec) -> bool:
    return any(is_packed(b) for b in spec.block_types.values())


def row_wise_experts(spec: ModelSpec) -> bool:
    """Whether agilerl.distributed's row-wise experts (expert parallel, routed_expert_chunk_mib)
    can run the model: packed experts in the layout they support (not gpt-oss's)."""
    return has_packed_experts(spec) and spec.expert_layout_problem is None


def _expert_counts(spec: ModelSpec) -> tuple[int, ...]:
    return tuple(sorted({b.mlp.num_experts for b in spec.block_types.values() if b.mlp.kind == "moe"}))


def expert_parallel_degrees(spec: ModelSpec, world: int) -> list[int]:
    """EP degrees agilerl.distributed accepts on ``world`` GPUs: [1] unless the model has packed
    experts the row-wise experts can run, else every degree dividing the GPUs and each layer's
    expert count (agilerl.distributed.expert_parallel_problem)."""
    counts = _expert_counts(spec)
    if not counts or not row_wise_experts(spec):
        return [1]
    return [d for d in range(1, world + 1) if expert_parallel_problem(world, d, counts) is None]


def tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why agilerl.distributed cannot split ``spec`` over ``tp`` ranks, or None: every block's
    attention and KV heads and each dense MLP's width must divide by it
    (agilerl.distributed.tp_split_problem; a MoE block splits its attention only, and needs
    its experts packed)."""
    for b in spec.block_types.values():
        if tp > 1 and b.mlp.kind == "moe" and not is_packed(b):
            return f"tp={tp} needs MoE experts packed per layer ({b.kind} loops over expert modules)"
        problem = tp_split_problem(
            tp,
            num_heads=b.attention.num_heads,
            num_kv_heads=b.attention.num_kv_heads,
            intermediate_size=None if b.mlp.kind == "moe" else b.mlp.intermediate_size,
            sinks=any(n.split(".")[-1] == "sinks" for n, _ in b.tensors),
        )
        if problem:
            return problem
    return None


def tensor_parallel_degrees(spec: ModelSpec, world: int) -> list[int]:
    """TP degrees agilerl.distributed accepts on ``world`` GPUs (see :func:`tp_problem`)."""
    return [d for d in range(1, world + 1) if world % d == 0 and (d == 1 or tp_problem(spec, d) is None)]


def check_ep(spec: ModelSpec, ep: int, world: int) -> None:
    """The EP degree agilerl.distributed accepts: packed experts, dividing the world and every expert count."""
    if not _expert_counts(spec) or not row_wise_experts(spec):
        if spec.expert_layout_problem:
            raise ValueError(f"ep={ep}: {spec.expert_layout_problem}")
        raise ValueError(f"ep={ep} needs packed MoE experts; {spec.name} has none. Use ep=1.")
    if problem := expert_parallel_problem(world, ep, _expert_counts(spec)):
        raise ValueError(problem)
