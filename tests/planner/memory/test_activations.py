"""planner.memory._activations: the tape scaled to a micro-batch, what the blocks keep,
the moments of learn, the boundary and a no-grad forward."""

from __future__ import annotations

import pytest

from agilerl.distributed import FSDPConfig
from planner.memory._activations import (
    activations_by_type,
    attention_scores_bytes,
    block_activations,
    boundary_bytes,
    checkpointed_block_bytes,
    kept_bytes,
    learn_block_moments,
    nograd_forward_moment,
    saved_activation_bytes,
    tape_of,
)
from planner.memory._units import build_layout

from .conftest import WL, make_context

TOKENS = WL.micro_batch_size_per_gpu * WL.sequence_tokens  # 2 x 128, bf16 (p = 2) unsharded


def test_a_block_scales_its_tape_to_the_micro_batch(dense_spec):
    ctx = make_context(dense_spec)
    tape, acts = tape_of(ctx, 0), block_activations(ctx, build_layout(ctx), 0)
    assert acts.saved == int(TOKENS * tape.saved)
    assert acts.recompute == int(TOKENS * tape.recompute_peak)


def test_eager_attention_saves_its_softmax_in_fp32_and_its_cast(dense_spec):
    sdpa = make_context(dense_spec)
    eager = make_context(dense_spec, attn_implementation="eager")
    scores = 2 * dense_spec.block(0).attention.num_heads * WL.sequence_tokens**2  # batch x heads x T x T
    assert attention_scores_bytes(eager, 2, WL.sequence_tokens, 0, "saved") == scores * (4 + 2)  # fp32 and bf16
    assert attention_scores_bytes(sdpa, 2, WL.sequence_tokens, 0, "saved") == 0
    # beside the scores, eager saves q and K and V repeated to every query head (3 q), where SDPA
    # saves q, K, V, its output and a log-sum-exp per head; the adapters are fp32 (unsharded), so
    # o's cast copy is its input either way
    att = dense_spec.block(0).attention
    per_token = 3 * att.q_dim * 2 - (2 * att.q_dim * 2 + 2 * att.kv_dim * 2 + 4 * att.num_heads)
    assert (
        block_activations(eager, build_layout(eager), 0).saved - block_activations(sdpa, build_layout(sdpa), 0).saved
    ) == scores * (4 + 2) + TOKENS * per_token


def test_checkpointed_blocks_keep_exactly_their_input(dense_spec):
    hidden = dense_spec.hidden_size
    every = make_context(dense_spec)
    assert checkpointed_block_bytes(every) == TOKENS * hidden * 2
    blocks = activations_by_type(every, build_layout(every))
    assert kept_bytes(every, blocks) == [TOKENS * hidden * 2] * 4
    half = make_context(dense_spec, fsdp=FSDPConfig(checkpoint_every_n_blocks=2, param_dtype="bfloat16"))
    blocks = activations_by_type(half, build_layout(half))
    full = blocks[0].saved
    assert kept_bytes(half, blocks) == [TOKENS * hidden * 2, full, TOKENS * hidden * 2, full]
    assert saved_activation_bytes(half, blocks) == 2 * TOKENS * hidden * 2 + 2 * full + boundary_bytes(half)


def test_the_boundary_is_the_final_norm_the_head_input_and_the_rotary_tables(dense_spec):
    ctx = make_context(dense_spec)
    hidden, head_dim = dense_spec.hidden_size, dense_spec.block(0).attention.head_dim
    # fp32 norm input + its rsqrt, bf16 hidden states, 20 bytes of per-row head state, cos and sin
    assert boundary_bytes(ctx) == TOKENS * (4 * hidden + 4 + 2 * hidden + 20) + 2 * head_dim * 2 * TOKENS


def test_the_last_block_holds_every_earlier_blocks_keep(dense_spec):
    ctx = make_context(dense_spec)
    blocks = activations_by_type(ctx, build_layout(ctx))
    hidden, b = dense_spec.hidden_size, blocks[0]
    checkpoint = TOKENS * hidden * 2
    recompute = b.recompute + TOKENS * (2 * hidden * 2 + 4 * hidden)  # with the gradients flowing in
    backward = b.backward + TOKENS * 2 * hidden * 2
    # every block checkpointed: the forward's moments are its units' copy-outs, before each block
    # runs: the last one's with what the three before it keep and its input (a checkpoint's size)
    assert learn_block_moments(ctx, blocks) == (
        (4 * checkpoint, 0),
        (4 * checkpoint + recompute, 0, 0, 0),
        (4 * checkpoint + backward, 0, 0, 0),
    )
    none = make_context(dense_spec, gradient_checkpointing=False)
    blocks = activations_by_type(none, build_layout(none))
    b = blocks[0]
    forward = b.forward + TOKENS * hidden * 2  # its input, held by the caller
    assert learn_block_moments(none, blocks) == (
        (3 * b.saved + forward, 0),
        (0, 0, 0, 0),  # nothing recomputes
        (3 * b.saved + b.backward + TOKENS * 2 * hidden * 2, 0, 0, 0),
    )
    # Gradients made so far in the backward (one micro-batch): the moment at the block where the
    # two together are largest, which for growing gradients is a later one.
    grown = tuple(1000 * (3 - j) for j in range(4))
    (_, g_forward), _, (act, g_back, _, _) = learn_block_moments(none, blocks, grown=grown)
    assert g_forward == 0 and (act, g_back) == (3 * b.saved + b.backward + TOKENS * 2 * hidden * 2, 0)
    huge = tuple(10**9 * (3 - j) for j in range(4))  # the first block (backward's last) made after every other
    assert learn_block_moments(none, blocks, grown=huge)[2] == (b.backward + TOKENS * 2 * hidden * 2, 3 * 10**9, 0, 0)
    # Likewise the backward's window: under reshard_after_forward=False it shrinks as the backward
    # goes, each unit resharded once through; a first block with a window wide enough peaks there.
    wide = (10**9, 0, 0, 0)
    assert learn_block_moments(none, blocks, backward_windows=wide)[2] == (
        b.backward + TOKENS * 2 * hidden * 2, 0, 10**9, 0,
    )  # fmt: skip
    # And the reduce-scatter input FSDP2 still holds: the unit after a block's, until its own
    # post-backward; a first block beside a wide one peaks there.
    assert learn_block_moments(none, blocks, reduce_held=wide)[2] == (
        b.backward + TOKENS * 2 * hidden * 2, 0, 0, 10**9,
    )  # fmt: skip


def test_a_no_grad_forward_holds_the_embeddings_and_the_block_input(dense_spec):
    ctx = make_context(dense_spec)
    tape = tape_of(ctx, 0)
    hidden, head_dim = dense_spec.hidden_size, dense_spec.block(0).attention.head_dim
    tokens = 3 * 10
    expected = 2 * tokens * hidden * 2 + 2 * head_dim * 2 * tokens + int(tokens * tape.nograd_peak)
    assert nograd_forward_moment(ctx, build_layout(ctx), 3, 10).activations == expected
    base = nograd_forward_moment(ctx, build_layout(ctx), 3, 10, adapters_on=False).activations
    assert base < expected  # the base model casts nothing to fp32


# -- a padded batch's attention mask ---------------------------------------------------------------
@pytest.mark.parametrize("gc", [True, False])
def test_a_padded_batch_adds_one_shared_mask_to_learn_and_reference(dense_spec, gc):
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import estimate

    fixed = make_context(dense_spec, gradient_checkpointing=gc)
    padded = make_context(dense_spec, padded_batches=True, gradient_checkpointing=gc)
    m, T = WL.micro_batch_size_per_gpu, WL.prompt_tokens + WL.completion_tokens
    one_mask = m * T * T * 2  # one bf16 additive mask for the micro-batch, whatever the layer count
    cluster = Cluster(gpu=CPU_DEVICE, num_gpus=2)
    learn = {
        p: estimate(dense_spec, WL.model_copy(update=dict(padded_batches=p, gradient_checkpointing=gc)), cluster, None)
        .phases["learn"]
        .total
        for p in (False, True)
    }
    # Given a mask, SDPA gets K and V repeated from 2 to 4 heads (Hugging Face's repeat_kv) and saves
    # those: 2 x (128 - 64) more bf16 values per token, in every layer without checkpointing, in the
    # block being recomputed with it.
    repeated = 2 * (128 - 64) * 2 * m * T * (1 if gc else dense_spec.num_layers)
    assert learn[True] - learn[False] == one_mask + repeated  # the mask alive at every moment of learn
    layout = build_layout(fixed)
    # Without grad the repeated copies sit beside the originals at the attention's moment, which
    # here stays below the block's MLP moment: the mask alone is added.
    assert (
        nograd_forward_moment(padded, layout, m, T).activations - nograd_forward_moment(fixed, layout, m, T).activations
        == one_mask
    )


def test_generate_keeps_hugging_faces_boolean_mask_and_one_float_copy(dense_spec):
    fixed, padded = make_context(dense_spec), make_context(dense_spec, padded_batches=True)
    layout, n, P = build_layout(fixed), 16, WL.prompt_tokens
    extra = (
        nograd_forward_moment(padded, layout, n, P, forward="generate").activations
        - nograd_forward_moment(fixed, layout, n, P, forward="generate").activations
    )
    assert extra == n * P * P * (1 + 2)


@pytest.mark.parametrize(
    "update",
    [
        dict(micro_batch_size_per_gpu=1),
        dict(attn_implementation="flash_attention_2"),
    ],
)
def test_no_mask_term_for_one_row_or_flash_attention(dense_spec, update):
    # (eager attention builds its own float masks, padded or not: tests/planner/memory/test_eager_scores.py)
    from planner.memory._activations import attention_mask_bytes

    ctx = make_context(dense_spec, padded_batches=True, **update)
    assert attention_mask_bytes(ctx, ctx.micro_batch, ctx.sequence_tokens, forward="learn") == 0


def test_qlora_on_packed_experts_says_they_stay_in_the_weights_dtype(dense_spec, moe_spec):
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import estimate

    cluster = Cluster(gpu=CPU_DEVICE, num_gpus=1)
    qlora = WL.model_copy(update=dict(load_in_4bit=True))
    moe_notes = estimate(moe_spec, qlora, cluster, None).notes
    assert any("packed routed experts stay in bfloat16" in n for n in moe_notes)
    assert not any("packed routed experts" in n for n in estimate(dense_spec, qlora, cluster, None).notes)
    assert not any("packed routed experts" in n for n in estimate(moe_spec, WL, cluster, None).notes)


def test_a_layers_window_is_paired_with_that_layers_own_activations():
    from planner.memory._activations import LayerMoment, paired

    # the widest layer (5) runs under a narrow window; the widest window (9) beside a narrow layer
    assert paired([5, 1, 2], (1, 9, 3)) == LayerMoment(1, 9, 0)
    assert paired([5, 1, 2], (1, 2, 3)) == LayerMoment(5, 1, 0)
    # a prefill's cache grows layer by layer: whole at the last layer only
    assert paired([5, 1, 2], (1, 1, 1), (1, 2, 6)) == LayerMoment(2, 1, 6)
    assert paired([5, 1, 2]) == LayerMoment(5, 0, 0)  # unsharded: no window
