"""planner.memory._static: weights, adapters, optimizer state and gradients of rank 0."""

from __future__ import annotations

import math

from agilerl.distributed import FSDPConfig
from planner.hardware import GPUS
from planner.memory._static import (
    gradient_terms,
    reduce_input_held_at_end,
    reduce_inputs_held,
    static_memory,
    step_optimizer_bytes,
)
from planner.memory._units import build_layout
from planner.models import load_model_spec

from .conftest import DENSE, WL, make_context

SHARD_ALL = FSDPConfig(param_persistence_threshold=0)


def _lora_local(spec, rank: int, shards: int) -> tuple[int, int]:
    """(elements on rank 0, adapter tensors): A (r a_rows, a_cols) and B (b_rows, r b_cols), ceil(d0 / S) rows."""
    entries = [e for b in spec.blocks for e in b.lora["all-linear"]]
    local = sum(
        math.ceil(rank * ar / shards) * ac + math.ceil(br / shards) * rank * bc for _, ar, ac, br, bc in entries
    )
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
    # On a CPU run the host is the same memory as the step's: CPUOffloadAdamW's fp32 masters and
    # their gradients beside the moments (with the moments alone a 2-rank tiny Qwen2's step read
    # 12.5% low against the probe).
    assert step_optimizer_bytes(ctx, optim) == local * 16 + tensors * 4
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
    local = _lora_local(dense_spec, WL.lora_rank, 2)[0] // dense_spec.num_layers  # a block's on rank 0
    # a block's post-backward adds its bf16 gradient into the accumulated one (freed), copies that
    # into an fp32 reduce-scatter input (and gloo's copy of it, on CPU), frees it and reduce-scatters
    # into a new fp32 shard, which stays
    assert grads.unit_reducing == ((local * 4 - block * 4, block * 4 * 2),) * dense_spec.num_layers
    assert grads.per_unit == (local * 4 - block * 4,) * dense_spec.num_layers
    on_gpu = make_context(dense_spec, fsdp=SHARD_ALL, gpu=GPUS["H100-80GB"])
    assert gradient_terms(on_gpu, build_layout(on_gpu), memory).unit_reducing[0][1] == block * 4  # NCCL: no copy
    # without deferring: the earlier micro-batches' shards; the block's bf16 gradient is freed once copied in
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL.model_copy(update={"defer_grad_sync": False}))
    grads = gradient_terms(ctx, layout, memory)
    assert grads.prior == memory.trainable_elements * 4 and grads.per_unit == ()
    assert grads.unit_reducing[0] == (local * 4, block * 4 * 2)
    assert grads.unit_entering[-1] == (block * 2, 0)  # as it starts: its bf16 gradient all made
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL, micro_batch_size_per_gpu=8)
    grads = gradient_terms(ctx, layout, memory)
    assert grads.prior == 0 and grads.per_unit == (local * 4,) * dense_spec.num_layers  # one micro-batch


def _base_elements(spec, shards: int, *, sharded: bool = True) -> tuple[int, int]:
    """(every base parameter's elements on rank 0, base tensors), rows ceil(d0 / S) when sharded."""
    shapes = [s for _, s in spec.root_tensors] + [s for b in spec.blocks for _, s in b.tensors]
    shapes += [spec.embed_shape] + ([spec.lm_head_shape] if spec.lm_head_shape else [])
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        total += (math.ceil(shape[0] / shards) if sharded else shape[0]) * rest
    return total, len(shapes)


def test_full_finetuning_trains_every_parameter_with_fp32_state(dense_spec):
    # FSDP2: fp32 shards (4), fp32 sharded gradients (4), AdamW's moments (8) and its step (4 a tensor)
    _, _, memory = _memory(dense_spec, SHARD_ALL, full_finetune=True)
    local, tensors = _base_elements(dense_spec, 2)
    assert memory.trainable_elements == local and memory.trainable_tensors == tensors
    assert memory.lora_elements == 0 and memory.lora_device == 0
    assert memory.weights == local * 4 and memory.gradients_sharded == local * 4
    assert memory.optimizer_device == local * 8 + tensors * 4
    # The reference pass (beta > 0) runs on a frozen copy in the weights dtype, sharded alike.
    assert memory.reference_device == local * 2
    _, _, no_reference = _memory(dense_spec, SHARD_ALL, full_finetune=True, beta=0.0)
    assert no_reference.reference_device == 0
    # Unsharded bf16: MasterWeightAdamW's fp32 master beside the moments, the bf16 weights themselves.
    _, _, plain = _memory(dense_spec, None, full_finetune=True, gpus=1)
    every, _ = _base_elements(dense_spec, 1, sharded=False)
    assert plain.weights == every * 2 and plain.optimizer_device == every * 12 + tensors * 4
    assert plain.gradients_sharded == every * 4
    # cpu_offload: the fp32 shards, their gradients and fused AdamW's moments on the host.
    _, _, off = _memory(dense_spec, SHARD_ALL.model_copy(update={"cpu_offload": True}), full_finetune=True)
    assert off.weights == 0 and off.host_weights == local * 4 and off.host_gradients == local * 4
    assert off.host_optimizer == local * 8 + tensors * 4 and off.optimizer_device == 0
    assert off.reference_device == 0 and off.host_reference == local * 2


def test_full_finetuning_gradients_grow_through_one_micro_batch(dense_spec):
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL, full_finetune=True, micro_batch_size_per_gpu=8)
    grads = gradient_terms(ctx, layout, memory)
    assert grads.prior == 0 and grads.final == memory.gradients_sharded
    # per block unit, its sharded fp32 gradients; the untied head's first; the embeddings' last
    assert len(grads.per_unit) == dense_spec.num_layers and grads.head > 0
    vocab, hidden = dense_spec.embed_shape
    assert grads.embed == vocab * hidden * 2  # unsharded bf16; its fp32 reduce-scatter input twice on CPU, the shard
    assert grads.embed_buffer == vocab * hidden * 4 * 2 + math.ceil(vocab / 2) * hidden * 4
    ctx, layout, memory = _memory(dense_spec, SHARD_ALL, full_finetune=True)  # 4 micro-batches, defer_grad_sync
    grads = gradient_terms(ctx, layout, memory)
    every, _ = _base_elements(dense_spec, 1, sharded=False)
    vocab, hidden = dense_spec.lm_head_shape
    # every unsharded gradient held in fp32 but the untied head's: resharded after forward, the chunked
    # head gathers its own copy, whose backward reduce-scatters the head's gradient into its fp32 shard
    # each micro-batch (materialize_dtensors), and the head's unit has none to accumulate or reduce
    head_shard = math.ceil(vocab / 2) * hidden * 4
    assert grads.prior == (every - vocab * hidden) * 4 + head_shard
    assert grads.head == grads.head_reducing == grads.head_buffer == grads.head_output == 0
    # kept gathered after forward, the chunked head reads the unit's weight: FSDP2 accumulates the
    # head's gradient and its post-backward reduce-scatters it into a new shard, freeing the rest
    kept = SHARD_ALL.model_copy(update={"reshard_after_forward": False})
    ctx, layout, memory = _memory(dense_spec, kept, full_finetune=True)
    grads = gradient_terms(ctx, layout, memory)
    assert grads.prior == every * 4
    assert grads.head == head_shard - vocab * hidden * 4 and grads.head_reducing == 0
    assert grads.head_buffer == vocab * hidden * 4 * 2 and grads.head_output == head_shard


def test_a_block_runs_backward_beside_the_reduce_scatter_input_of_the_unit_after_it(dense_spec):
    # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward: layer j runs
    # backward beside the input of the unit after its own (one block a unit here)
    block = WL.lora_rank * sum(ar * ac + br * bc for _, ar, ac, br, bc in dense_spec.block(0).lora["all-linear"])
    ctx = make_context(dense_spec, fsdp=SHARD_ALL)
    layout = build_layout(ctx)
    # LoRA: the untied head trains nothing, so the last block holds none
    assert reduce_inputs_held(ctx, layout) == (block * 4,) * (dense_spec.num_layers - 1) + (0,)
    assert reduce_input_held_at_end(ctx, layout) == block * 4  # the first block's; gloo's copy is the call's only
    # a full fine-tune: the trained head's unit reduce-scatters only when kept gathered after forward
    # (else the chunked head's own copy reduces the gradient)
    full = make_context(dense_spec, fsdp=SHARD_ALL, full_finetune=True)
    kept = make_context(
        dense_spec, fsdp=SHARD_ALL.model_copy(update={"reshard_after_forward": False}), full_finetune=True
    )
    vocab, hidden = dense_spec.lm_head_shape
    assert reduce_inputs_held(full, build_layout(full))[-1] == 0
    assert reduce_inputs_held(kept, build_layout(kept))[-1] == vocab * hidden * 4  # the trained head's
    unsharded = make_context(dense_spec, gpus=1)
    assert reduce_inputs_held(unsharded, build_layout(unsharded)) == ()


def test_offloaded_and_replicated_gradients_are_not_new_device_shards(dense_spec):
    block = WL.lora_rank * sum(ar * ac + br * bc for _, ar, ac, br, bc in dense_spec.block(0).lora["all-linear"])
    layers = dense_spec.num_layers
    # cpu_offload: FSDP2 copies each new shard to the host, so a reduce-scattered unit only frees
    # its accumulated gradient (deferred sync) and a first micro-batch's adds nothing on the device
    offload = SHARD_ALL.model_copy(update={"cpu_offload": True})
    ctx, layout, memory = _memory(dense_spec, offload)
    assert gradient_terms(ctx, layout, memory).per_unit == (-block * 4,) * layers
    ctx, layout, memory = _memory(dense_spec, offload, micro_batch_size_per_gpu=8)
    assert gradient_terms(ctx, layout, memory).per_unit == (0,) * layers
    # under the persistence threshold the adapters are replicated: whole gradients of their own,
    # accumulated and kept, none reduce-scattered
    ctx, layout, memory = _memory(dense_spec, FSDPConfig(param_persistence_threshold=10**9))
    grads = gradient_terms(ctx, layout, memory)
    assert grads.prior == layers * block * 4 and grads.per_unit == (0,) * layers
    assert set(grads.unit_reducing) == {(0, 0)}


def test_a_tied_heads_gradient_is_held_through_the_blocks_backward():
    # The tied head is the embedding table, one leaf the chunked head, the model's own head and the
    # embeddings all use: autograd sums the heads' gradients (V x H, bf16) in its input buffer and
    # holds the sum until the embeddings' backward, so every block runs backward beside it.
    from planner.memory._phases import backward_gradients

    tied = load_model_spec(DENSE + "&tie_word_embeddings=true")
    vocab, hidden = tied.embed_shape
    for fsdp, micro in ((SHARD_ALL, 8), (SHARD_ALL, 2), (SHARD_ALL.model_copy(update={"defer_grad_sync": False}), 2)):
        ctx, layout, memory = _memory(tied, fsdp, full_finetune=True, micro_batch_size_per_gpu=micro)
        grads = gradient_terms(ctx, layout, memory)
        assert grads.tied_head == vocab * hidden * 2
        # no head unit reduce-scatters: the held sum is the head's whole change
        assert grads.head == vocab * hidden * 2 and grads.head_buffer == 0
        # the last block runs backward first, beside that sum and nothing else this micro-batch made
        held = backward_gradients(layout, grads)
        assert len(held) == tied.num_layers and held[-1] == vocab * hidden * 2
    # LoRA trains no head; an untied head is its own unit's
    ctx, layout, memory = _memory(tied, SHARD_ALL)
    assert gradient_terms(ctx, layout, memory).tied_head == 0
    ctx, layout, memory = _memory(load_model_spec(DENSE), SHARD_ALL, full_finetune=True)
    assert gradient_terms(ctx, layout, memory).tied_head == 0
