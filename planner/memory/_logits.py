"""The log-prob workspace: fp32 logits of a chunk of token rows (agilerl.utils.logprobs),
the lm_head weight the chunked head multiplies by, and the log-probs kept for the step.

The copies of a chunk's logits alive at the peak are coefficients (``logits_copies_*``):
measured on CPU with torch's MemTracker, 4 with grad either way (chunked: the recomputed
logits, their exp and two gradients in backward; unchunked: one copy saved in forward,
three made in backward).
"""

from __future__ import annotations

from ._context import Context


def head_weight_bytes(ctx: Context) -> int:
    """V x H x p, or 0.

    The chunked head multiplies by the dense lm_head weight: under FSDP a gathered copy
    (materialize_dtensors), unless reshard_after_forward=False left the unit unsharded
    after the forward, when the head uses that unsharded weight as it is.
    """
    fsdp = ctx.fsdp
    return ctx.vocab_size * ctx.hidden_size * ctx.compute_bytes if fsdp and fsdp.reshard_after_forward else 0


def learn_rows(ctx: Context) -> int:
    """Token rows a micro-batch's loss takes log-probs of: m x (T - 1)."""
    return ctx.micro_batch * (ctx.sequence_tokens - 1)


def learn_logits_bytes(ctx: Context) -> int:
    """With grad: rows x V x 4 x logits_copies_unchunked when one chunk takes every row,
    else chunk x V x 4 x logits_copies_grad; plus the head weight and the one-position
    logits (m x V x 4)."""
    k, V = ctx.coefficients, ctx.vocab_size
    rows, chunk = learn_rows(ctx), ctx.workload.logprob_chunk_size
    if chunk is None or chunk >= rows:
        logits = rows * V * 4 * k.logits_copies_unchunked
    else:
        logits = chunk * V * 4 * k.logits_copies_grad
    return int(logits + head_weight_bytes(ctx) + ctx.micro_batch * V * 4)  # + the one-position logits


def reference_logits_bytes(ctx: Context) -> int:
    """Without grad: min(chunk, rows) x V x 4 x logits_copies_nograd, the head weight and the
    one-position logits."""
    rows = learn_rows(ctx)
    chunk = min(ctx.workload.logprob_chunk_size or rows, rows)
    V = ctx.vocab_size
    return int(chunk * V * 4 * ctx.coefficients.logits_copies_nograd + head_weight_bytes(ctx) + ctx.micro_batch * V * 4)


def kept_logprob_bytes(ctx: Context) -> int:
    """n x T x 4 per kept log-prob tensor: the reference's (beta > 0) and the old policy's
    (update_epochs > 1), held from their pass through the step."""
    workload = ctx.workload
    kept = (1 if workload.beta > 0 else 0) + (1 if workload.update_epochs > 1 else 0)
    return ctx.completions_per_rank * ctx.sequence_tokens * 4 * kept
