"""Activations: what autograd saves per block for backward, the recompute of a
checkpointed block, what is saved outside the blocks, the temporaries of a no-grad
forward, and eager attention's scores.

Sizes that depend on kernels carry a coefficient (``act_*``, ``fwd_*``, ``attn_scores_*``)
fitted on measured probes by benchmarks/accuracy.py, which reports the measured error.
Layers of one block type have equal terms, so the maxima over layers are taken over
``Context.distinct_layers``.
"""

from __future__ import annotations

from ._context import Context
from ._moe import (
    backward_transient_bytes,
    expert_forward_temps,
    experts_saved_per_token,
    merged_stack_saved_bytes,
    routed_experts,
    router_saved_per_token,
)
from ._units import Layout


def attention_scores_bytes(ctx: Context, batch: int, t_q: int, index: int, copies: float) -> int:
    """``copies`` x batch x heads / tp x Tq x Tk scores, where eager attention materialises them.

    Eager attention materialises batch x heads x Tq x Tk scores (one copy saved per block
    for backward, two alive in a forward; counted with saved-tensor hooks). SDPA does not,
    on GPUs nor on CPU (torch's CPU flash kernel: a 448-token call whose scores would take
    73.5 MiB peaks at 5.4 MiB). Padded batches add Hugging Face's boolean
    batch x Tq x Tk mask (a float copy on CPU), which fixed-length probes never have and
    the estimate does not model yet.
    """
    if not ctx.scores_materialised:
        return 0
    att = ctx.spec.block(index).attention
    t_k = min(t_q, att.sliding_window) if att.sliding_window and ctx.workload.attn_implementation != "eager" else t_q
    return int(copies * batch * att.num_heads // ctx.tp * t_q * t_k * ctx.compute_bytes)


def block_saved_bytes(ctx: Context, layout: Layout, batch: int, index: int) -> int:
    """Bytes autograd saves for one block's backward (LoRA on a frozen base), ``batch`` x T tokens.

    Per token: (act_hidden H + act_qkv (q + 2 kv) / tp + act_mlp width / tp) p, plus
    AltUp's streams, act_lora x r x 4 per adapted linear, and a MoE block's router and
    experts (:mod:`._moe`); plus PEFT's merged expert stack and eager attention's scores.
    """
    k, H, p = ctx.coefficients, ctx.hidden_size, ctx.compute_bytes
    b = ctx.spec.block(index)
    width = b.mlp.shared_intermediate_size if b.mlp.kind == "moe" else b.mlp.intermediate_size
    qkv = b.attention.q_dim + 2 * b.attention.kv_dim
    # Tensor parallelism splits heads and MLP columns; the hidden stream is whole.
    mlp_tp = 1 if ctx.packed[index] else ctx.tp  # a MoE block's MLP is whole on every TP rank
    per_token = (k.act_hidden * H + k.act_qkv * qkv / ctx.tp + k.act_mlp * width / mlp_tp) * p
    # AltUp's predict / correct over every stream and its router save about 7.5 hidden-sized
    # tensors per token per extra stream (counted on Gemma-3n's forward with LoRA).
    per_token += 7.5 * ctx.extra_streams * H * p
    per_token += k.act_lora * ctx.lora_rank * len(ctx.lora_shapes[index]) * 4
    extra = 0
    if b.mlp.kind == "moe":
        per_token += router_saved_per_token(ctx, index)
        per_token += experts_saved_per_token(ctx, index)
        extra = merged_stack_saved_bytes(ctx, layout, index)
    return (int(batch * ctx.sequence_tokens * per_token) + extra
            + attention_scores_bytes(ctx, batch, ctx.sequence_tokens, index, k.attn_scores_saved))


def block_forward_temps(ctx: Context, layout: Layout, batch: int, length: int, index: int,
                        adapters_on: bool = True) -> int:
    """Peak temporaries of one block's forward without grad over ``batch`` x ``length`` tokens:
    (fwd_hidden H + fwd_mlp width / tp) p per token, the routed experts' (:mod:`._moe`),
    AltUp's streams and eager attention's scores.

    ``adapters_on=False``: the reference pass on the base model (adapters disabled), where
    PEFT merges no expert stacks."""
    k, H, p = ctx.coefficients, ctx.hidden_size, ctx.compute_bytes
    b = ctx.spec.block(index)
    width = b.mlp.intermediate_size * max(1, b.mlp.experts_per_token) + b.mlp.shared_intermediate_size
    experts = 0
    if routed_experts(ctx, index) is not None:
        width = b.mlp.shared_intermediate_size
        experts = expert_forward_temps(ctx, layout, batch, length, index, adapters_on)
    temps = batch * length * (k.fwd_hidden * H + k.fwd_mlp * width / (1 if ctx.packed[index] else ctx.tp)) * p + experts
    if ctx.extra_streams:  # AltUp: input, predictions, the correction and its result, every stream
        temps += (4 * ctx.extra_streams + 2) * batch * length * H * p
    return int(temps) + attention_scores_bytes(ctx, batch, length, index, k.attn_scores_fwd)


def largest_forward_temps(ctx: Context, layout: Layout, batch: int, length: int, adapters_on: bool = True) -> int:
    """The largest block's no-grad forward temporaries (a no-grad pass runs block after block)."""
    return max(block_forward_temps(ctx, layout, batch, length, i, adapters_on) for i in ctx.distinct_layers)


def saved_by_type(ctx: Context, layout: Layout) -> dict[int, int]:
    """block_saved_bytes of one micro-batch, per distinct layer."""
    return {i: block_saved_bytes(ctx, layout, ctx.micro_batch, i) for i in ctx.distinct_layers}


def checkpointed_block_bytes(ctx: Context) -> float:
    """A checkpointed block saves its input: act_checkpointed x N x H x p; under Gemma-3n's
    AltUp every stream of it."""
    return (ctx.coefficients.act_checkpointed + ctx.extra_streams) * ctx.micro_batch_tokens * ctx.hidden_size * ctx.compute_bytes


def boundary_bytes(ctx: Context) -> float:
    """Saved outside the blocks: act_boundary x N x (H + per-layer input width) x p.

    The embedding output, final norm in/out (the captured hidden), Gemma-3n's per-layer
    inputs. Under Gemma-3n's AltUp the per-stream magnitude rescaling at the embeddings
    and at the unembedding saves about 5 x (streams - 1) + 3 hidden-sized tensors per
    token besides (counted on its forward).
    """
    k, N, H, p, extra = ctx.coefficients, ctx.micro_batch_tokens, ctx.hidden_size, ctx.compute_bytes, ctx.extra_streams
    altup_outside = (5 * extra + 3) * N * H * p if extra else 0
    return int(k.act_boundary * N * (H + ctx.spec.per_layer_input_width) * p) + altup_outside


def saved_activation_bytes(ctx: Context, saved: dict[int, int]) -> float:
    """Everything saved for backward after one micro-batch's forward: every block's saved
    tensors (a checkpointed block its input only) and the boundary."""
    checkpointed = checkpointed_block_bytes(ctx)
    total = 0
    for i in range(ctx.spec.num_layers):
        total += checkpointed if i in ctx.checkpointed else saved[ctx.representative[i]]
    return int(total) + boundary_bytes(ctx)


def recompute_bytes(ctx: Context, layout: Layout, saved: dict[int, int]) -> int:
    """The largest of one block's backward extras.

    Recomputing the largest checkpointed block in backward re-creates its saved tensors;
    a MoE block's backward also makes its experts' transients (a chunk, all-to-all buffers).
    """
    transient = {i: backward_transient_bytes(ctx, layout, ctx.micro_batch, i) for i in ctx.distinct_layers}
    return max((saved[rep] if i in ctx.checkpointed else 0) + transient[rep]
               for i, rep in enumerate(ctx.representative))
