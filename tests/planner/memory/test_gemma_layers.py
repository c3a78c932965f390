"""Gemma-3n's AltUp layer, Gemma 4's layers (a per-layer-input tail, a weightless v norm, eager
attention, a global layer twice as wide) and what the models keep outside their layers, counted
by planner.memory against real tiny models with PEFT's LoRA on every linear: saved-tensor hooks
(what autograd keeps) and a live-tensor tracker (the most alive at once), with the adapters in
bf16 (FSDP2's param_dtype casts them) and in fp32 (PEFT's own, unsharded)."""

from __future__ import annotations

import pytest
import torch

from planner.memory._activations import (
    HEAD_ROW_BYTES,
    block_activations,
    boundary_bytes,
    embedding_kept_bytes,
    nograd_block_bytes,
    rotary_bytes,
)
from planner.memory._units import build_layout

from ._real_layers import (
    BATCH,
    GEMMA4,
    LENGTH,
    PLE,
    TOKENS,
    H,
    _context,
    _layer_moments,
    _nograd_moment,
    _saved_by_region,
)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_the_altup_layer_count_matches_a_real_gemma3n_layer(adapter_dtype):
    ctx = _context(adapter_dtype)
    assert ctx.micro_batch_tokens == TOKENS
    assert ctx.adapter_compute_bytes == (2 if adapter_dtype == torch.bfloat16 else 4)
    counted = block_activations(ctx, build_layout(ctx), 1)
    saved = _saved_by_region(adapter_dtype)
    # a layer's own saved tensors, its input streams included (the layer before made them)
    assert counted.saved == pytest.approx(saved["layer1"], rel=0.03)
    forward, backward = _layer_moments(adapter_dtype)
    assert counted.forward == pytest.approx(forward, rel=0.05)
    # the trainer counts the gradients flowing in beside the block: the output's (given here) and
    # the one its backward builds for its input streams, both stream-wide
    streams = ctx.carried_hidden * ctx.compute_bytes * TOKENS
    assert counted.backward + streams == pytest.approx(backward, rel=0.05)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [128, 512])  # the MLP twice and eight times the hidden size (E4B's)
def test_a_gemma3n_layer_without_grad_matches_a_real_one(adapter_dtype, width):
    # the layer names every intermediate and its MLP names its gate's, activation's and up's outputs:
    # the peak is the layer's end where the MLP is narrow, down's LoRA where it is wide. One constant
    # beside the tape's most read +9% to +11% at 128 and -3% to -4% at 512.
    name = PLE.replace("intermediate_size=128", f"intermediate_size={width}")
    ctx = _context(adapter_dtype, name)
    counted = nograd_block_bytes(ctx, build_layout(ctx), BATCH, LENGTH, 1)
    assert counted == pytest.approx(_nograd_moment(adapter_dtype, name), rel=0.01)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_what_gemma3n_keeps_outside_its_layers(adapter_dtype):
    ctx = _context(adapter_dtype)
    saved = _saved_by_region(adapter_dtype)
    embedding = embedding_kept_bytes(ctx)
    # the per-layer inputs are first saved in the layers that read them (a view of them each)
    per_layer_inputs = TOKENS * ctx.spec.per_layer_input_width * ctx.compute_bytes
    assert embedding - per_layer_inputs == pytest.approx(saved["embed"], rel=0.03)
    # the head side, less what the log-prob head (outside this forward) saves and the rotary tables
    head = boundary_bytes(ctx) - embedding - rotary_bytes(ctx) - TOKENS * (H * ctx.compute_bytes + HEAD_ROW_BYTES)
    assert head == pytest.approx(saved["head"], rel=0.03)


def test_casting_adapters_outside_the_layers_costs_their_copies():
    # PEFT's fp32 adapters on a bf16 base: every adapted linear outside the layers saves its own
    # fp32 copy of its input; with the adapters in bf16 they share or view the ones kept anyway
    fp32, bf16 = _context(torch.float32), _context(torch.bfloat16)
    assert boundary_bytes(fp32) > boundary_bytes(bf16)
    assert embedding_kept_bytes(fp32) > embedding_kept_bytes(bf16)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index", [1, 3])  # a sliding layer, the global one (twice the head width)
def test_the_count_matches_a_real_gemma4_layer(adapter_dtype, index):
    # eager attention: q and K and V repeated to every head, a copy of its output that o's adapter
    # saves, the fp32 scores; v normalised without a weight; the per-layer-input tail at the end
    ctx = _context(adapter_dtype, GEMMA4, "eager")
    counted = block_activations(ctx, build_layout(ctx), index)
    saved = _saved_by_region(adapter_dtype, GEMMA4, "eager")
    # (the global layer's own rotary table is first saved in it: 2 x its head_dim x p per position)
    assert counted.saved == pytest.approx(saved[f"layer{index}"], rel=0.03)
    forward, backward = _layer_moments(adapter_dtype, GEMMA4, "eager", index)
    assert counted.forward == pytest.approx(forward, rel=0.03)
    flowing_beyond_given = H * ctx.compute_bytes * TOKENS  # the residual's gradient beside the one given
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.04)
