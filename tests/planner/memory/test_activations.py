"""planner.memory._activations: saved activations, recompute, boundary, forward temporaries."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.memory import Coefficients
from planner.memory._activations import (
    attention_scores_bytes,
    block_forward_temps,
    block_saved_bytes,
    boundary_bytes,
    recompute_bytes,
    saved_activation_bytes,
    saved_by_type,
)
from planner.memory._units import build_layout

from .conftest import WL, make_context

K = Coefficients()
TOKENS = WL.micro_batch_size_per_gpu * WL.sequence_tokens  # 2 x 128, bf16 (p = 2) unsharded


def test_a_dense_block_saves_its_hidden_qkv_mlp_and_adapter_inputs(dense_spec):
    ctx = make_context(dense_spec)
    b = dense_spec.block(0)
    hidden, qkv, width = dense_spec.hidden_size, b.attention.q_dim + 2 * b.attention.kv_dim, b.mlp.intermediate_size
    per_token = (K.act_hidden * hidden + K.act_qkv * qkv + K.act_mlp * width) * 2
    per_token += K.act_lora * WL.lora_rank * len(b.lora["all-linear"]) * 4  # fp32 adapter inputs
    assert block_saved_bytes(ctx, build_layout(ctx), 2, 0) == int(TOKENS * per_token)


def test_eager_attention_saves_one_copy_of_the_scores(dense_spec):
    sdpa = make_context(dense_spec)
    eager = make_context(dense_spec, attn_implementation="eager")
    scores = 2 * dense_spec.block(0).attention.num_heads * WL.sequence_tokens**2 * 2  # batch x heads x T x T, bf16
    assert attention_scores_bytes(eager, 2, WL.sequence_tokens, 0, 1.0) == scores
    assert attention_scores_bytes(sdpa, 2, WL.sequence_tokens, 0, 1.0) == 0
    assert (block_saved_bytes(eager, build_layout(eager), 2, 0)
            - block_saved_bytes(sdpa, build_layout(sdpa), 2, 0)) == scores


def test_checkpointed_blocks_keep_their_input(dense_spec):
    hidden = dense_spec.hidden_size
    boundary = K.act_boundary * TOKENS * hidden * 2
    every = make_context(dense_spec)
    saved = saved_by_type(every, build_layout(every))
    assert boundary_bytes(every) == boundary
    assert saved_activation_bytes(every, saved) == 4 * K.act_checkpointed * TOKENS * hidden * 2 + boundary
    half = make_context(dense_spec, fsdp=FSDPConfig(checkpoint_every_n_blocks=2, param_dtype="bfloat16"))
    full_block = block_saved_bytes(half, build_layout(half), 2, 0)
    assert saved_activation_bytes(half, saved_by_type(half, build_layout(half))) == (
        2 * K.act_checkpointed * TOKENS * hidden * 2 + 2 * full_block + boundary)
    # Recomputing a checkpointed dense block re-creates what it would have saved.
    assert recompute_bytes(half, build_layout(half), saved_by_type(half, build_layout(half))) == full_block
    none = make_context(dense_spec, gradient_checkpointing=False)
    assert recompute_bytes(none, build_layout(none), saved_by_type(none, build_layout(none))) == 0


def test_altup_streams_add_to_the_boundary(ple_spec):
    ctx = make_context(ple_spec)
    hidden, width = ple_spec.hidden_size, ple_spec.per_layer_input_width
    expected = int(K.act_boundary * TOKENS * (hidden + width) * 2) + (5 * 3 + 3) * TOKENS * hidden * 2
    assert boundary_bytes(ctx) == expected


def test_a_dense_blocks_no_grad_forward(dense_spec):
    ctx = make_context(dense_spec)
    hidden, width = dense_spec.hidden_size, dense_spec.block(0).mlp.intermediate_size
    assert block_forward_temps(ctx, build_layout(ctx), 3, 10, 0) == int(3 * 10 * (K.fwd_hidden * hidden
                                                                                 + K.fwd_mlp * width) * 2)
