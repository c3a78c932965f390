"""planner.memory._static: weights, adapters, optimizer state and gradients of rank 0."""

from __future__ import annotations

import math

from agilerl.distributed import FSDPConfig
from planner.memory._static import gradient_terms, static_memory, step_optimizer_bytes
from planner.memory._units import build_layout

from .conftest import WL, make_context

SHARD_ALL = FSDPConfig(param_persistence_threshold=0)


def _lora_local(spec, rank: int, shards: int) -> tuple[int, int]:
    """(elements on rank 0, adapter tensors): A (r a_rows, a_cols) and B (b_rows, r b_cols), ceil(d0 / S) rows."""
    entries = [e for b in spec.blocks for e in b.lora["all-linear"]]
    local = sum(math.ceil(rank * ar / shards) * ac + math.ceil(br / shards) * rank * bc for _, ar, ac, br, bc in entries)
    return local, 2 * len(entries)


def _memory(spec, fsdp, **update):
    ctx = make_context(spec, fsdp=fsdp, **update)
    layout = build_layout(ctx)
    return ctx, layout, static_memory(ctx, layout)


def test_adapters_and_adam_on_the_device(dense_spec):
    _, _, memory = _memory(dense_spec, SHARD_ALL)
    local, tensors = _lora_local(dense_spec, WL.lora_rank, 2)
    assert (memory.lora_elements, memory.trainable_elements, memory.trainable_tensors) == (local, local, tensors)
    assert memory.lora_device == local * 4
    assert memory.optimizer_device == local * 8 + tensors * 4
    assert memory.host_optimizer == memory.host_weights == 0
    assert memory.gradients_sharded == local * 4


def test_offloads_move_state_to_the_host(dense_spec):
    local, tensors = _lora_local(dense_spec, WL.lora_rank, 2)
    ctx, _, optim = _memory(dense_spec, SHARD_ALL.model_copy(update={"optim_cpu_offload": True}))
    assert optim.optimizer_device == 0 and optim.host_optimizer == local * 16 + tensors * 4
    # On a CPU run the host moments are the same memory as the step's.
    assert step_optimizer_bytes(ctx, optim) == local * 8
    _, _, full = _memory(dense_spec, SHARD_ALL)
    _, _, params = _memory(dense_spec, SHARD_ALL.model_copy(update={"cpu_offload": True}))
    assert params.weights == 0 and params.lora_device == 0  # everything sharded goes
    assert params.host_weights == full.weights + local * 4


def test_a_separate_reference_adapter_is_stored_not_trained(dense_spec):
    _, _, one = _memory(dense_spec, SHARD_ALL)
    _, _, two = _memory(dense_spec, SHARD_ALL, use_separate_reference_adapter=True)
    assert two.lora_elements == 2 * one.lora_elements
    assert two.trainable_elements == one.trainable_elements and two.optimizer_device == one.optimizer_device


def test_step_adds_the_update_per_tensor(dense_spec):
    ctx, _, memory = _memory(dense_spec, SHARD_ALL)
    assert step_optimizer_bytes(ctx, memory) == memory.optimizer_device + memory.trainable_tensors * 4


def test_gradients_of_the_earlier_micro_batches_and_the_reduced_unit(dense_spec):
    block = WL.lora_rank * sum(ar * ac + br * bc for _, ar, ac, br, bc in dense_spec.block(0).lora["all-linear"])
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL)  # 8 completions a rank, 2 a micro-batch
    grads = gradient_terms(ctx, layout, memory)
    # defer_grad_sync: unsharded, upcast to reduce_dtype (float32) as FSDP2 keeps them
    assert grads.prior == dense_spec.num_layers * block * 4
    assert grads.reducing == block * 2 and grads.reduce_buffer == block * 4  # reduce_dtype float32
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL.model_copy(update={"defer_grad_sync": False}))
    assert gradient_terms(ctx, layout, memory).prior == memory.trainable_elements * 4
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL, micro_batch_size_per_gpu=8)
    assert gradient_terms(ctx, layout, memory).prior == 0  # one micro-batch
