"""The log-prob workspace: the logits of a chunk of token rows (agilerl.utils.logprobs'
linear_token_logprobs), the lm_head weight the chunked head multiplies by, and the
log-probs kept for the step.

The fused linear head holds one tile of a chunk's logits in the compute dtype (the
matmul output, until it is cast) beside their fp32 copy, in forward and in backward,
where the recomputed fp32 logits become their own gradient in place; a soft-capped head
adds one fp32 tile for tanh's derivative in backward. Measured with torch's MemTracker:
1.50 fp32 tiles in bf16, 1.00 in fp32 (tests/agilerl/algorithms/test_grpo_single.py).
"""

from __future__ import annotations

from ._context import Context


def head_weight_bytes(ctx: Context) -> int:
    """V x H x p, or 0.

    The chunked head multiplies by the dense lm_head weight: under FSDP a gathered copy
    (materialize_dtensors), unless reshard_after_forward=False left the unit unsharded
    after the forward, when the head uses that unsharded weight as it is. A tied head is
    the embedding table, which lives in the root unit: FSDP2 keeps the root unsharded
    from its forward to its backward, so the head reads that copy too.
    """
    fsdp = ctx.fsdp
    if ctx.spec.tie_word_embeddings:
        return 0
    return ctx.vocab_size * ctx.hidden_size * ctx.compute_bytes if fsdp and fsdp.reshard_after_forward else 0


def learn_rows(ctx: Context) -> int:
    """Token rows a micro-batch's head takes log-probs of: GRPO's head starts at the earliest
    completion token's position (``first``), so m x (C + 1): the position before each
    completion token, and the last one, which has no next token and is dropped after. With
    ``logprob_rows="all"`` (a trainer that scores the prompt too), m x T."""
    if ctx.workload.logprob_rows == "all":
        return ctx.micro_batch * ctx.sequence_tokens
    return ctx.micro_batch * min(ctx.sequence_tokens, ctx.workload.completion_tokens + 1)


def tile_bytes(ctx: Context, rows: int) -> int:
    """One chunk of ``rows`` logits: rows x V x (4 + p), or rows x V x 4 when the compute
    dtype is fp32 (the cast is a no-op)."""
    p = ctx.compute_bytes
    return rows * ctx.vocab_size * (4 + (p if p != 4 else 0))


def chunk_rows(ctx: Context) -> int:
    """Rows of the largest log-prob chunk: the chunk size, or every row of the micro-batch."""
    rows, chunk = learn_rows(ctx), ctx.workload.logprob_chunk_size
    return rows if chunk is None or chunk >= rows else chunk


def learn_logits_bytes(ctx: Context, *, backward: bool) -> int:
    """With grad: one tile of a chunk (plus an fp32 tile for a soft cap's derivative in
    backward), the head weight, and the one-position logits the model's own head makes
    (m x V x p)."""
    rows = chunk_rows(ctx)
    softcap = rows * ctx.vocab_size * 4 if backward and ctx.spec.final_logit_softcapping else 0
    return (
        tile_bytes(ctx, rows) + softcap + head_weight_bytes(ctx) + ctx.micro_batch * ctx.vocab_size * ctx.compute_bytes
    )


def model_head_gradient_bytes(ctx: Context) -> int:
    """As the model's own one-position head runs backward (the trainer keeps it in the graph):
    its logits' gradient (m x V x p), and with a trained head the weight's two
    gradients, the chunked head's and this head's (zero, from the zero-weighted term), and their
    sum, which autograd makes in the weight's input buffer (3 x V x H x p; traced on 2 gloo
    ranks, a tied head). The sum stays until the embeddings' backward when the head is tied
    (planner.memory._static.tied_head_gradient_bytes)."""
    logits = ctx.micro_batch * ctx.vocab_size * ctx.compute_bytes
    if not ctx.full_finetune:
        return logits
    return logits + 3 * ctx.vocab_size * ctx.hidden_size * ctx.compute_bytes


def reference_logits_bytes(ctx: Context) -> int:
    """Without grad: one tile of a chunk, the head weight and the one-position logits."""
    return (
        tile_bytes(ctx, chunk_rows(ctx)) + head_weight_bytes(ctx) + ctx.micro_batch * ctx.vocab_size * ctx.compute_bytes
    )


def kept_logprob_bytes(ctx: Context, phase: str = "learn") -> int:
    """n x T x 4 per per-token tensor of the rank's batch the trainer keeps, in the ``reference``
    phase (at its end) or from there through ``learn`` and the step:

    - GRPO's loop: the reference's log-probs (beta > 0) and the old policy's (update_epochs > 1);
    - DPO: the reference's, until they are summed per sequence (nothing per token in learn);
    - LLMPPO: the reference's (beta > 0), the sampling policy's log-probs and values; in learn
      also the per-token rewards, the KL estimate, the advantages, the returns and the float mask;
    - SFT: none.
    """
    workload = ctx.workload
    reference = 1 if workload.has_reference else 0
    match workload.algorithm:
        case "sft":
            kept = 0
        case "dpo":
            kept = 1 if phase == "reference" else 0
        case "ppo":
            kept = reference + (2 if phase == "reference" else 7)
        case _:
            kept = reference + (1 if workload.update_epochs > 1 else 0)
    return ctx.completions_per_rank * ctx.sequence_tokens * 4 * kept


def head_gradient_bytes(ctx: Context) -> int:
    """A trained lm_head (full fine-tuning), beside the chunk's tile (:func:`learn_logits_bytes`):
    the head's backward (agilerl.utils.logprobs' linear head) accumulates the weight's gradient
    over the chunks in fp32 (V x H x 4), each chunk's from an fp32 copy of its logits' gradient
    and of its hidden states (rows x (V + H) x 4 when the compute dtype is not fp32); once the
    chunks are done, the tile freed, it casts the gradient to the compute dtype (V x H x p more)
    before FSDP2 reduce-scatters it or it is added to its fp32 master: the larger of the two.
    Traced on 2 gloo ranks: the peak at the accumulation, counted as the tile beside the cast,
    read 0.35 MiB low on a tiny Qwen2 (rows x V x 4 is 0.75 MiB there). 0 with LoRA (the head is
    frozen)."""
    if not ctx.full_finetune:
        return 0
    p = ctx.compute_bytes
    weight = ctx.vocab_size * ctx.hidden_size
    upcast = chunk_rows(ctx) * (ctx.vocab_size + ctx.hidden_size) * 4 if p != 4 else 0
    cast = weight * p if p != 4 else 0
    return weight * 4 + max(upcast, cast - tile_bytes(ctx, chunk_rows(ctx)))
