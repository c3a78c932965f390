"""gpt-oss's decoder layer counted by planner.memory against a real tiny one: eager attention
with learned sinks (a softmax in the compute dtype over one more column), Hugging Face's grouped
experts with per-row gathered biases and the clamped SwiGLU gate, and the attention weights the
layer keeps through its MLP in a forward without grad. A tiny Qwen3-MoE (a SiLU gate, no
biases, no sinks) is the control the general rules were located on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.memory._activations import block_activations, nograd_block_bytes
from planner.memory._units import build_layout

from ._real_layers import BATCH, LENGTH, TOKENS, H, _context, _layer_moments, _nograd_moment, _saved_by_region

GPT_OSS = (
    "tiny:gpt_oss?hidden_size=64&intermediate_size=128&num_layers=2&num_heads=4&num_kv_heads=2"
    "&vocab_size=512&num_local_experts=8&num_experts_per_tok=2"
)
QWEN3_MOE = (
    "tiny:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=128&num_layers=2&num_heads=4"
    "&num_kv_heads=2&vocab_size=512&num_experts=8&num_experts_per_tok=2"
)

# OLMoE's shape: the expert width is half the hidden size, so the combine, not the gate, is where
# the experts hold the most; LoRA on the attention only, as OLMoE is fine-tuned (the stacks frozen)
OLMOE = (
    "tiny:olmoe?hidden_size=64&intermediate_size=32&num_layers=2&num_heads=4&num_kv_heads=4"
    "&vocab_size=512&num_experts=16&num_experts_per_tok=4"
)
ATTENTION = ("k_proj", "o_proj", "q_proj", "v_proj")


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_the_count_matches_real_frozen_experts_that_peak_at_their_combine(adapter_dtype):
    ctx = _context(adapter_dtype, OLMOE, targets=ATTENTION)
    assert not ctx.expert_lora[1] and not ctx.expert_rowwise  # Hugging Face's experts, frozen
    layout = build_layout(ctx)
    counted = block_activations(ctx, layout, 1)
    saved = _saved_by_region(adapter_dtype, OLMOE, targets=ATTENTION)["layer1"]
    assert counted.saved == pytest.approx(saved, rel=0.03)
    forward, backward = _layer_moments(adapter_dtype, OLMOE, targets=ATTENTION)
    # the gate's end (the saved tensors, the residual and the product: 4 rows of width 32 a token)
    # is a fifth short of the forward: the un-permuted weighted rows beside the gathered ones are its peak
    p = ctx.compute_bytes
    assert counted.saved + TOKENS * H * p + TOKENS * 4 * 32 * p < 0.85 * forward
    assert counted.forward == pytest.approx(forward, rel=0.03)
    flowing_beyond_given = H * ctx.compute_bytes * TOKENS
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.03)
    nograd = nograd_block_bytes(ctx, layout, BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(adapter_dtype, OLMOE, targets=ATTENTION), rel=0.03)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_the_count_matches_a_real_gpt_oss_layer(adapter_dtype):
    ctx = _context(adapter_dtype, GPT_OSS, "eager")
    layout = build_layout(ctx)
    counted = block_activations(ctx, layout, 1)
    saved = _saved_by_region(adapter_dtype, GPT_OSS, "eager")
    assert counted.saved == pytest.approx(saved["layer1"], rel=0.03)
    forward, backward = _layer_moments(adapter_dtype, GPT_OSS, "eager", 1)
    assert counted.forward == pytest.approx(forward, rel=0.03)
    flowing_beyond_given = H * ctx.compute_bytes * TOKENS  # the residual's gradient beside the one given
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.03)
    nograd = nograd_block_bytes(ctx, layout, BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(adapter_dtype, GPT_OSS, "eager", 1), rel=0.03)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", [QWEN3_MOE, OLMOE], ids=["qwen3_moe", "olmoe"])
def test_the_silu_experts_without_grad(name, adapter_dtype):
    # a SiLU gate holds gate_up's output, the activation and the product, no biases; with the
    # adapter on the stacks PEFT's merged gate_up stack is made at the gate and down's at down,
    # both kept by parametrize's cache, beside the factors' casts (fp32 adapters): Qwen3-MoE's
    # wide experts peak at the gate, before down's merged stack exists; OLMoE's at the combine
    ctx = _context(adapter_dtype, name, "sdpa")
    assert ctx.expert_lora[1] and not ctx.expert_rowwise
    nograd = nograd_block_bytes(ctx, build_layout(ctx), BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(adapter_dtype, name, "sdpa", 1), rel=0.03)


def test_the_count_matches_real_hugging_face_experts_with_lora_on_the_stacks():
    # one device, PEFT's fp32 adapters on the bf16 base: the grouped experts over PEFT's merged
    # stacks save the gathered rows and down's input too, and the fold saves the factors' casts
    ctx = _context(torch.float32, QWEN3_MOE, "sdpa")
    assert not ctx.expert_rowwise and ctx.expert_lora[1]
    counted = block_activations(ctx, build_layout(ctx), 1)
    assert counted.saved == pytest.approx(_saved_by_region(torch.float32, QWEN3_MOE, "sdpa")["layer1"], rel=0.03)
    forward, backward = _layer_moments(torch.float32, QWEN3_MOE, "sdpa", 1)
    assert counted.forward == pytest.approx(forward, rel=0.04)
    flowing_beyond_given = H * ctx.compute_bytes * TOKENS
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.03)


def test_sinks_and_the_clamped_gate_are_what_the_gpt_oss_count_adds():
    # the same layer counted as if it had neither (a SiLU gate, no sinks, no biases) misses most
    # of what the real layer keeps and holds: the rules are doing the work, not a margin
    from planner.memory import _moe

    ctx = _context(torch.bfloat16, GPT_OSS, "eager")
    saved = _saved_by_region(torch.bfloat16, GPT_OSS, "eager")["layer1"]
    forward, _ = _layer_moments(torch.bfloat16, GPT_OSS, "eager", 1)
    nograd = _nograd_moment(torch.bfloat16, GPT_OSS, "eager", 1)
    none = (False,) * len(ctx.attention_sinks)
    ctx = dataclasses.replace(ctx, attention_sinks=none, expert_biases=none, tapes={})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_moe, "_CLAMPED_SWIGLU", ())
        plain = build_layout(ctx)
        # (with the rules each is within 3%: test_the_count_matches_a_real_gpt_oss_layer)
        assert abs(block_activations(ctx, plain, 1).saved / saved - 1) > 0.1
        assert abs(block_activations(ctx, plain, 1).forward / forward - 1) > 0.05
        assert abs(nograd_block_bytes(ctx, plain, BATCH, LENGTH, 1) / nograd - 1) > 0.05


# the row-wise experts' chunk bounds: one chunk holds every routed row of the narrow layer; the
# wide one's 1 MiB chunk holds half of them (4 experts' rows each), its 64 MiB chunk all of them
WIDE_QWEN3_MOE = QWEN3_MOE.replace("moe_intermediate_size=128", "moe_intermediate_size=1024")


@pytest.mark.parametrize(("name", "chunk_mib"), [(QWEN3_MOE, 64), (WIDE_QWEN3_MOE, 64), (WIDE_QWEN3_MOE, 1)])
def test_the_count_matches_real_row_wise_experts(name, chunk_mib):
    # agilerl.distributed's row-wise experts on one rank, LoRA on the stacks in bf16 (FSDP2's
    # param_dtype), every expert routed the same rows: what the layer saves, its forward with grad
    # (a chunk's forward, or the combine's fp32 rows), its backward (a chunk's recompute, or an
    # expert's backward reaching its adapters' stacked factors) and its forward without grad
    ctx = _context(torch.bfloat16, name, chunk_mib=chunk_mib)
    assert ctx.expert_rowwise
    layout = build_layout(ctx)
    counted = block_activations(ctx, layout, 1)
    saved = _saved_by_region(torch.bfloat16, name, chunk_mib=chunk_mib)["layer1"]
    assert counted.saved == pytest.approx(saved, rel=0.03)
    forward, backward = _layer_moments(torch.bfloat16, name, "sdpa", 1, chunk_mib=chunk_mib)
    assert counted.forward == pytest.approx(forward, rel=0.04)
    flowing_beyond_given = H * ctx.compute_bytes * TOKENS
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.04)
    nograd = nograd_block_bytes(ctx, layout, BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(torch.bfloat16, name, "sdpa", 1, chunk_mib=chunk_mib), rel=0.05)


def test_the_row_wise_moments_are_what_the_count_adds():
    # without the combine's fp32 rows, the previous expert's product, or the adapters' gradients
    # summed through the experts' backward, the wide layer's count falls well short
    from planner.memory import _moe

    ctx = _context(torch.bfloat16, WIDE_QWEN3_MOE, chunk_mib=1)
    layout = build_layout(ctx)
    counted = block_activations(ctx, layout, 1)
    _, backward = _layer_moments(torch.bfloat16, WIDE_QWEN3_MOE, "sdpa", 1, chunk_mib=1)
    none = (0,) * len(layout.expert_adapters)
    without = dataclasses.replace(layout, expert_adapters=none, expert_adapter_factor=none, sums={})
    assert block_activations(ctx, without, 1).backward < 0.9 * counted.backward < backward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_moe, "_combine_forward", lambda ctx, rows, top_k: 0.0)
        narrow = _context(torch.bfloat16, QWEN3_MOE, chunk_mib=64)
        forward, _ = _layer_moments(torch.bfloat16, QWEN3_MOE, "sdpa", 1, chunk_mib=64)
        assert block_activations(narrow, build_layout(narrow), 1).forward < 0.95 * forward
