"""planner.memory._logits: the log-prob workspace."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.memory._logits import (
    kept_logprob_bytes,
    learn_logits_bytes,
    model_head_gradient_bytes,
    reference_logits_bytes,
)

from .conftest import WL, make_context


def test_chunked_and_unchunked_logits(dense_spec):
    V, m = dense_spec.vocab_size, WL.micro_batch_size_per_gpu
    # GRPO's head starts at the earliest completion token's position: 64 completion tokens + 1
    # (the last position, dropped after) per sequence, 130 rows > the 128-row chunk.
    rows = m * (WL.completion_tokens + 1)
    one_position = m * V * 2  # the model's own head on the last position, bf16
    ctx = make_context(dense_spec)
    # a bf16 tile of the chunk's logits beside its fp32 copy (measured: 1.5 fp32 tiles)
    assert learn_logits_bytes(ctx, backward=True) == 128 * V * (2 + 4) + one_position
    assert reference_logits_bytes(ctx) == 128 * V * (2 + 4) + one_position
    whole = make_context(dense_spec, logprob_chunk_size=None)
    assert learn_logits_bytes(whole, backward=True) == rows * V * (2 + 4) + one_position
    every_row = make_context(dense_spec, logprob_chunk_size=None, logprob_rows="all")  # a trainer scoring prompts too
    assert learn_logits_bytes(every_row, backward=True) == m * WL.sequence_tokens * V * (2 + 4) + one_position
    fp32 = make_context(dense_spec, weights_dtype="float32")
    assert learn_logits_bytes(fp32, backward=False) == 128 * V * 4 + m * V * 4  # the cast is a no-op


def test_the_chunked_head_gathers_the_lm_head_when_resharded(dense_spec):
    head = dense_spec.vocab_size * dense_spec.hidden_size * 2
    resharded = make_context(dense_spec, fsdp=FSDPConfig())
    kept = make_context(dense_spec, fsdp=FSDPConfig(reshard_after_forward=False))
    assert learn_logits_bytes(resharded, backward=True) - learn_logits_bytes(kept, backward=True) == head
    assert learn_logits_bytes(kept, backward=True) == learn_logits_bytes(make_context(dense_spec), backward=True)


def test_kept_log_probs(dense_spec):
    per = 8 * WL.sequence_tokens * 4  # 8 completions a rank, fp32
    assert kept_logprob_bytes(make_context(dense_spec)) == per  # the reference's
    assert kept_logprob_bytes(make_context(dense_spec, update_epochs=2)) == 2 * per  # and the old policy's
    assert kept_logprob_bytes(make_context(dense_spec, beta=0.0)) == 0


def test_a_tied_head_reads_the_root_units_unsharded_embeddings(ple_spec):
    assert ple_spec.tie_word_embeddings  # Gemma-3n's tiny spec ties its head to the embeddings
    resharded = make_context(ple_spec, fsdp=FSDPConfig())
    kept = make_context(ple_spec, fsdp=FSDPConfig(reshard_after_forward=False))
    assert learn_logits_bytes(resharded, backward=True) == learn_logits_bytes(kept, backward=True)


def test_the_model_heads_backward_sums_a_trained_heads_two_gradients(ple_spec):
    V, H, m = ple_spec.vocab_size, ple_spec.hidden_size, WL.micro_batch_size_per_gpu
    # its one-position logits' gradient; a trained head's, the chunked head's and this head's
    # (zero) gradient and their sum beside (V x H each, bf16), under FSDP
    assert model_head_gradient_bytes(make_context(ple_spec, fsdp=FSDPConfig())) == m * V * 2
    full = make_context(ple_spec, fsdp=FSDPConfig(), full_finetune=True)
    assert model_head_gradient_bytes(full) == m * V * 2 + 3 * V * H * 2
