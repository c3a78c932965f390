"""How agilerl.distributed splits a model: which tensors are packed experts, which linears
tensor parallelism splits, and the TP / EP degrees it accepts."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig

from ..spec import BlockSpec, ModelSpec

#: Linears tensor parallelism splits (agilerl.distributed._tp): colwise split their output
#: (weight dim 0, bias), rowwise their input (weight dim 1).
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def is_packed_expert(name: str, shape: tuple[int, ...] | None = None) -> bool:
    """A routed-expert tensor: ``...experts.gate_up_proj`` [E, ., .], or its LoRA ``...experts:gate_up_proj``.

    Only packed experts (3-D, transformers 5) count: shared experts and per-expert
    module lists are ordinary linears.
    """
    path = name.split(":", 1)[0]
    if "experts" not in path.split("."):
        return False
    return ":" in name or (shape is not None and len(shape) == 3)


def tp_dim(tensor_name: str) -> int | None:
    """The dimension tensor parallelism splits a block tensor along, or None when it is whole:
    0 for a colwise linear's weight and bias, 1 for a rowwise linear's weight."""
    parts = tensor_name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLWISE:
        return 0
    if module in ROWWISE and parts[-1] == "weight":
        return 1
    return None


def is_packed(block: BlockSpec) -> bool:
    """Whether a block's routed experts are packed per layer ([E, ., .] tensors)."""
    return any(is_packed_expert(n, s) for n, s in block.tensors)


def has_packed_experts(spec: ModelSpec) -> bool:
    return any(is_packed(b) for b in spec.block_types.values())


def row_wise_experts(spec: ModelSpec) -> bool:
    """Whether agilerl.distributed's row-wise experts (expert parallel, routed_expert_chunk_mib)
    can run the model: packed experts in the layout they support (not gpt-oss's)."""
    return has_packed_experts(spec) and spec.expert_layout_problem is None


def expert_parallel_degrees(spec: ModelSpec, world: int) -> list[int]:
    """EP degrees agilerl.distributed accepts on ``world`` GPUs: [1] unless the model has packed
    experts the row-wise experts can run, else every degree dividing the GPUs and each layer's
    expert count."""
    counts = {b.mlp.num_experts for b in spec.block_types.values() if b.mlp.kind == "moe"}
    if not counts or not row_wise_experts(spec):
        return [1]
    return [d for d in range(1, world + 1) if world % d == 0 and all(c % d == 0 for c in counts)]


def tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why agilerl.distributed cannot split ``spec`` over ``tp`` ranks, or None: every block's
    attention and KV heads and each dense MLP's width must divide by it (a MoE block splits
    its attention only, and needs its experts packed)."""
    for b in spec.block_types.values():
        if b.attention.num_heads % tp or b.attention.num_kv_heads % tp:
            return (f"tp={tp} needs attention heads ({b.attention.num_heads}) and KV heads "
                    f"({b.attention.num_kv_heads}) divisible by it")
        if b.mlp.kind == "moe" and not is_packed(b):
            return f"tp={tp} needs MoE experts packed per layer ({b.kind} loops over expert modules)"
        if any(n.split(".")[-1] == "sinks" for n, _ in b.tensors):
            return f"tp={tp} does not split attention sinks (one learnt logit per head in {b.kind}); use tp=1"
        if b.mlp.kind != "moe" and b.mlp.intermediate_size % tp:
            return f"tp={tp} needs the MLP width ({b.mlp.intermediate_size}) divisible by it"
    return None


def tensor_parallel_degrees(spec: ModelSpec, world: int) -> list[int]:
    """TP degrees agilerl.distributed accepts on ``world`` GPUs (see :func:`tp_problem`)."""
    return [d for d in range(1, world + 1) if world % d == 0 and (d == 1 or tp_problem(spec, d) is None)]


def check_ep(spec: ModelSpec, ep: int, world: int, fsdp: FSDPConfig) -> None:
    """The EP degree agilerl.distributed accepts: packed experts, dividing the world and every expert count."""
    allowed = expert_parallel_degrees(spec, world)
    if allowed == [1] and spec.expert_layout_problem:
        raise ValueError(f"ep={ep}: {spec.expert_layout_problem}")
    if allowed == [1]:
        raise ValueError(f"ep={ep} needs packed MoE experts; {spec.name} has none. Use ep=1.")
    counts = sorted({b.mlp.num_experts for b in spec.block_types.values() if b.mlp.kind == "moe"})
    if ep not in allowed:
        raise ValueError(f"ep={ep} must divide the {world} GPUs and the {counts[-1]} experts per layer; "
                         f"allowed: {allowed}")
