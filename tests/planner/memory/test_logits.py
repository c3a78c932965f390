"""planner.memory._logits: the log-prob workspace."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.memory import Coefficients
from planner.memory._logits import kept_logprob_bytes, learn_logits_bytes, reference_logits_bytes

from .conftest import WL, make_context

K = Coefficients()


def test_chunked_and_unchunked_logits(dense_spec):
    V, m = dense_spec.vocab_size, WL.micro_batch_size_per_gpu
    rows = m * (WL.sequence_tokens - 1)  # 254 > the 128-row chunk
    one_position = m * V * 4
    ctx = make_context(dense_spec)
    assert learn_logits_bytes(ctx) == int(128 * V * 4 * K.logits_copies_grad + one_position)
    assert reference_logits_bytes(ctx) == int(128 * V * 4 * K.logits_copies_nograd + one_position)
    whole = make_context(dense_spec, logprob_chunk_size=None)
    assert learn_logits_bytes(whole) == int(rows * V * 4 * K.logits_copies_unchunked + one_position)
    assert reference_logits_bytes(whole) == int(rows * V * 4 * K.logits_copies_nograd + one_position)


def test_the_chunked_head_gathers_the_lm_head_when_resharded(dense_spec):
    head = dense_spec.vocab_size * dense_spec.hidden_size * 2
    resharded = make_context(dense_spec, fsdp=FSDPConfig())
    kept = make_context(dense_spec, fsdp=FSDPConfig(reshard_after_forward=False))
    assert learn_logits_bytes(resharded) - learn_logits_bytes(kept) == head
    assert learn_logits_bytes(kept) == learn_logits_bytes(make_context(dense_spec))


def test_kept_log_probs(dense_spec):
    per = 8 * WL.sequence_tokens * 4  # 8 completions a rank, fp32
    assert kept_logprob_bytes(make_context(dense_spec)) == per  # the reference's
    assert kept_logprob_bytes(make_context(dense_spec, update_epochs=2)) == 2 * per  # and the old policy's
    assert kept_logprob_bytes(make_context(dense_spec, beta=0.0)) == 0
