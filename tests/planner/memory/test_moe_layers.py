"""gpt-oss's decoder layer counted by planner.memory against a real tiny one: eager attention
with learned sinks (a softmax in the compute dtype over one more column), Hugging Face's grouped
experts with per-row gathered biases and the clamped SwiGLU gate, and the attention weights the
layer keeps through its MLP in a forward without grad. A tiny Qwen3-MoE (a SiLU gate, no
biases, no sinks) is the control the general rules were located on."""

from __future__ import annotations

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


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_the_count_matches_a_real_gpt_oss_layer(adapter_dtype):
    ctx = _context(adapter_dtype, GPT_OSS, "eager")
    layout = build_layout(ctx)
    counted = block_activations(ctx, layout, 1)
    saved = _saved_by_region(adapter_dtype, GPT_OSS, "eager")
    assert counted.saved == pytest.approx(saved["layer1"], rel=0.08)
    forward, backward = _layer_moments(adapter_dtype, GPT_OSS, "eager", 1)
    assert counted.forward == pytest.approx(forward, rel=0.03)
    flowing_beyond_given = H * ctx.compute_bytes * TOKENS  # the residual's gradient beside the one given
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.03)
    nograd = nograd_block_bytes(ctx, layout, BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(adapter_dtype, GPT_OSS, "eager", 1), rel=0.03)


def test_the_silu_experts_without_grad():
    # the control: a SiLU gate holds gate_up's output, the activation and the product, no biases
    ctx = _context(torch.float32, QWEN3_MOE, "sdpa")
    nograd = nograd_block_bytes(ctx, build_layout(ctx), BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(torch.float32, QWEN3_MOE, "sdpa", 1), rel=0.03)


def test_sinks_and_the_clamped_gate_are_what_the_gpt_oss_count_adds():
    # the same layer counted as if it had neither (a SiLU gate, no sinks, no biases) misses most
    # of what the real layer keeps and holds: the rules are doing the work, not a margin
    from planner.memory import _activations, _moe

    ctx = _context(torch.bfloat16, GPT_OSS, "eager")
    saved = _saved_by_region(torch.bfloat16, GPT_OSS, "eager")["layer1"]
    nograd = _nograd_moment(torch.bfloat16, GPT_OSS, "eager", 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_moe, "_CLAMPED_SWIGLU", ())
        patch.setattr(_moe, "_bias_width", lambda ctx, index: 0)
        patch.setattr(_activations, "_has_sinks", lambda block: False)
        plain = build_layout(ctx)
        assert abs(block_activations(ctx, plain, 1).saved / saved - 1) > 0.1
        assert nograd_block_bytes(ctx, plain, BATCH, LENGTH, 1) < 0.85 * nograd
