"""Memory that stays put through the step: base weights, adapters, optimizer state, and
the adapters' gradients. Per rank, from the FSDP layout.

PEFT keeps adapters in fp32 (4 bytes per element); AdamW keeps two fp32 moments per
trainable element and a step tensor per trainable tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._context import DTYPE_BYTES, Context
from ._units import Layout

#: Per quantised value: the double-quantised absmax (one uint8 per block of 64) and its fp32 scales (one per 256 blocks).
NF4_CONSTANT_BYTES = 1 / 64 + 4 / (64 * 256)
NF4_BYTES_PER_PARAM = 0.5 + NF4_CONSTANT_BYTES  # 4-bit values and their constants
QLORA_NOTE = "QLoRA: NF4 block linears (embeddings, lm_head and norms kept in the weights dtype)"


@dataclass(frozen=True, slots=True)
class StaticMemory:
    weights: int  # base weights on the device (sharded, or all of them unsharded)
    weights_replicated: int  # tensors under the persistence threshold, whole on every rank
    lora_device: int  # adapters on the device (all copies)
    optimizer_device: int
    host_optimizer: int
    host_weights: int  # cpu_offload: the parameters on the host
    gradients_sharded: int
    lora_elements: int  # every adapter copy, on this rank
    trainable_elements: int  # the trained adapter, on this rank
    trainable_tensors: int


def base_weight_bytes(ctx: Context, layout: Layout) -> tuple[int, int]:
    """(weights, weights_replicated) on rank 0 before any offload.

    Unsharded every rank holds the whole base; under FSDP rank 0 holds ceil(d0 / S) rows of
    each sharded tensor, and the replicated ones whole. QLoRA stores each block linear's
    weight packed in NF4 (one byte per two values, sharded like any tensor) and keeps its
    quantisation constants whole on every rank (NF4_CONSTANT_BYTES per value); the
    embeddings, lm_head, norms and biases stay in the weights dtype.
    """
    w = ctx.weight_bytes
    key = ("base", w, ctx.fsdp is None, ctx.shard_group)
    if key in layout.sums:
        return layout.sums[key]

    def nbytes(t, elements: int) -> int:
        return elements * (1 if t.four_bit else w)

    constants = int(sum(2 * t.numel for t in layout.base_tensors if t.four_bit) * NF4_CONSTANT_BYTES)
    if ctx.fsdp is None:
        result = sum(nbytes(t, t.numel) for t in layout.base_tensors) + constants, 0
    else:
        result = (sum(nbytes(t, t.local(ctx.shard_group)) for t in layout.base_tensors if t.sharded) + constants,
                  sum(nbytes(t, t.numel) for t in layout.base_tensors if not t.sharded))
    layout.sums[key] = result
    return result


def static_memory(ctx: Context, layout: Layout) -> StaticMemory:
    """Weights, adapters, optimizer state and sharded gradients of rank 0.

    Optimizer state on the device: 8 bytes per trainable element and 4 per trainable
    tensor; offloaded (optim_cpu_offload or cpu_offload) the host holds 16 per element
    and 4 per tensor instead. cpu_offload also moves the sharded weights and adapters to
    the host, leaving only the replicated adapters on the device.
    """
    weights, weights_replicated = base_weight_bytes(ctx, layout)
    key = ("lora", ctx.shard_group)
    if key not in layout.sums:
        layout.sums[key] = sum(t.local(ctx.shard_group) for t in layout.lora_tensors)
    lora_elements = layout.sums[key]  # elements, all adapters
    adapters = ctx.num_adapters
    trainable = lora_elements // adapters if adapters else lora_elements
    trainable_tensors = len(layout.lora_tensors) // adapters
    lora_bytes = lora_elements * 4  # PEFT keeps adapters in fp32
    offload_optim = bool(ctx.fsdp and ctx.fsdp.optim_cpu_offload)
    cpu_offload = bool(ctx.fsdp and ctx.fsdp.cpu_offload)
    offloaded = offload_optim or cpu_offload
    if cpu_offload:
        host_weights = weights + lora_bytes
        weights, lora_device = 0, sum(t.numel * 4 for t in layout.lora_tensors if not t.sharded)
    else:
        host_weights, lora_device = 0, lora_bytes
    return StaticMemory(
        weights=weights, weights_replicated=weights_replicated, lora_device=lora_device,
        optimizer_device=0 if offloaded else trainable * 8 + trainable_tensors * 4,
        host_optimizer=(trainable * 16 + trainable_tensors * 4) if offloaded else 0,
        host_weights=host_weights, gradients_sharded=trainable * 4,
        lora_elements=lora_elements, trainable_elements=trainable, trainable_tensors=trainable_tensors,
    )


def static_components(memory: StaticMemory) -> dict[str, int]:
    """The components every phase holds."""
    return {
        "weights": memory.weights,
        "weights_replicated": memory.weights_replicated,
        "lora": memory.lora_device,
        "optimizer_state": memory.optimizer_device,
    }


@dataclass(frozen=True, slots=True)
class GradientTerms:
    prior: int  # gradients of the earlier micro-batches of this step
    reducing: int  # a unit's unsharded gradients being reduced
    reduce_buffer: int  # their reduce-scatter buffer in reduce_dtype


def gradient_terms(ctx: Context, layout: Layout, memory: StaticMemory) -> GradientTerms:
    """Gradients at the learn phase's first block's backward.

    With more than one micro-batch the earlier ones' gradients are held: unsharded with
    defer_grad_sync, in reduce_dtype (FSDP2's post-backward upcasts a gradient it does not
    reduce into ``unsharded_accumulated_grad``: read from its source, and measured by the
    probe since it registers them), else sharded in fp32 (unsharded: fp32 local).
    Under FSDP the running block unit's adapter gradients are unsharded (compute dtype)
    and reduce-scattered through a buffer in reduce_dtype; the largest unit counts.
    """
    if not ctx.sharded:
        prior = memory.trainable_elements * 4 if ctx.micro_batches > 1 else 0
        return GradientTerms(prior=prior, reducing=0, reduce_buffer=0)
    p, adapters = ctx.compute_bytes, ctx.num_adapters
    if "lora_full" not in layout.sums:  # the largest block unit's sharded adapters, and all adapters
        layout.sums["lora_full"] = (max((sum(t.numel for t in u.lora if t.sharded) for u in layout.block_units),
                                        default=0), sum(t.numel for t in layout.lora_tensors))
    largest_unit_lora, all_lora = layout.sums["lora_full"]
    unit_lora_full = largest_unit_lora // adapters
    if ctx.micro_batches > 1:
        trainable_full = all_lora // adapters
        accumulated = DTYPE_BYTES[ctx.fsdp.reduce_dtype]
        prior = trainable_full * accumulated if ctx.fsdp.defer_grad_sync else memory.gradients_sharded
    else:
        prior = 0
    return GradientTerms(prior=prior, reducing=unit_lora_full * p,
                         reduce_buffer=unit_lora_full * DTYPE_BYTES[ctx.fsdp.reduce_dtype])


def step_optimizer_bytes(ctx: Context, memory: StaticMemory) -> int:
    """Optimizer state during clip and AdamW: on the device, plus the step's update per
    tensor (4 bytes) when it runs there; on a CPU run the "host" moments are in the same memory."""
    step = memory.optimizer_device + (0 if memory.host_optimizer else memory.trainable_tensors * 4)
    if memory.host_optimizer and not ctx.on_gpu:
        step += memory.trainable_elements * 8
    return step


def load_gathered_bytes(ctx: Context, layout: Layout) -> int:
    """Loading under FSDP materialises one tensor at a time: the largest, in the weights dtype."""
    if "largest_base" not in layout.sums:
        layout.sums["largest_base"] = max((t.numel for t in layout.base_tensors), default=0)
    return layout.sums["largest_base"] * ctx.weight_bytes if ctx.sharded else 0


def load_host_checkpoint_bytes(ctx: Context, layout: Layout) -> int:
    """Host memory of the checkpoint being loaded: a tensor at a time under FSDP, else the whole model."""
    if ctx.sharded:
        return load_gathered_bytes(ctx, layout)
    return ctx.spec.total_params * ctx.weight_bytes


def save_gathered_bytes(layout: Layout) -> int:
    """Saving gathers the adapters one tensor at a time (fp32): the largest."""
    if "largest_lora" not in layout.sums:
        layout.sums["largest_lora"] = max((t.numel for t in layout.lora_tensors), default=0)
    return layout.sums["largest_lora"] * 4


def save_host_checkpoint_bytes(ctx: Context, memory: StaticMemory) -> int:
    """Rank 0 keeps every rank's adapters and AdamW moments (fp32) on the host."""
    return memory.lora_elements * 4 * ctx.shard_group + memory.trainable_elements * 8 * ctx.shard_group
