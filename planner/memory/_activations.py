"""Activations of a micro-batch: what each block keeps for backward, the moments of a
forward, a checkpointed block's recompute and a backward, what lives outside the blocks,
and a forward without grad.

Dense parts are counted op by op (:mod:`._tape`); a MoE block's routed experts add
:mod:`._moe`'s terms, Gemma-3n's AltUp its streams, eager attention its scores. Layers of
one block type have equal terms, so per-type values are computed once
(``Context.distinct_layers``) and sums run over every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ._context import Context
from ._moe import (
    backward_transient_bytes,
    expert_forward_grad_transient,
    expert_forward_temps,
    experts_saved_per_token,
    merged_stack_saved_bytes,
    routed_experts,
    router_saved_per_token,
)
from ._tape import AltUpTape, BlockTape, altup_tape, block_tape
from ._units import Layout

#: Per token outside the blocks with grad, besides the final norm and the hidden states:
#: the log-sum-exp of each row (4), the targets (8), the log-probs and their mask (8).
HEAD_ROW_BYTES = 20


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward over a micro-batch's blocks: ``rows`` x ``queries`` tokens attending over
    ``keys`` positions. The one-pass forward is m x T over T; the shared-prefix forward
    (agilerl.utils.shared_prefix) is a prefix pass (distinct prompts x split over split) and a
    suffix pass (m x (T - split) over T) whose attention reads its rows' copies of the prefix
    K and V (``prefix_kv_rows``)."""

    rows: int
    queries: int
    keys: int
    prefix_kv_rows: int = 0
    masked: bool = False  # SDPA gets a mask (planner.memory._tape.BlockTape.masked_kv_saved)

    @property
    def tokens(self) -> int:
        return self.rows * self.queries


def learn_passes(ctx: Context) -> tuple[Pass, ...]:
    """A learn or reference micro-batch's forwards: (one pass,) or (prefix, suffix). SDPA gets
    a mask in a padded batch (agilerl.utils.logprobs.shared_attention_mask) and, always, in a
    suffix pass (its queries start at the split)."""
    m, T, split = ctx.micro_batch, ctx.sequence_tokens, ctx.prefix_split
    sdpa = ctx.workload.attn_implementation == "sdpa"
    padded = sdpa and ctx.workload.padded_batches
    if not split:
        return (Pass(m, T, T, masked=padded and m > 1),)
    return (Pass(ctx.prefix_rows, split, split, masked=padded), Pass(m, T - split, T, prefix_kv_rows=m, masked=sdpa))


def one_pass(ctx: Context) -> Pass:
    """The one-pass forward over a micro-batch (what a trainer without the shared prefix runs)."""
    m, T = ctx.micro_batch, ctx.sequence_tokens
    return Pass(m, T, T, masked=ctx.workload.attn_implementation == "sdpa" and ctx.workload.padded_batches and m > 1)


def _softmax_converts(ctx: Context) -> bool:
    """Whether eager attention's ``softmax(x, dtype=float32)`` first makes an fp32 copy of its
    input: ATen converts any input of another dtype (bf16 included) before the kernel, except a
    float16 input on CUDA, which its fused half-to-float kernel reads as it is."""
    if ctx.compute_bytes == 4:
        return False
    dtype = ctx.fsdp.param_dtype if ctx.fsdp is not None else ctx.workload.weights_dtype
    return not (ctx.on_gpu and dtype == "float16")


def attention_scores_bytes(ctx: Context, batch: int, t_q: int, index: int, moment: str, t_k: int | None = None) -> int:
    """Eager attention's batch x heads / tp x Tq x Tk scores (0 for SDPA, which keeps none:
    torch's CPU flash kernel peaks at 5.4 MiB on a 448-token call whose scores would take
    73.5 MiB, and GPU kernels are flash or memory-efficient).

    Bytes per score, counted on Llama's, Gemma 2's and gpt-oss's eager attention with
    saved-tensor hooks and a live-tensor tracker (tests/planner/memory/test_eager_scores.py),
    with ``c`` the fp32 copy ``softmax(x, dtype=float32)`` makes of its input first (4 in bf16,
    :func:`_softmax_converts`) and ``k`` the cast of its output back (p; none in fp32):

    - ``saved``: the soft cap's tanh output (p, Gemma 2), the fp32 softmax and its cast
      to the compute dtype (4 + k);
    - ``nograd``: the softmax's input, its copy and its output (p + c + 4), or at the cast the
      input, the output and the cast (p + 4 + k);
    - ``grad``: the same moments in a forward with grad, the tanh output (saved) beside them;
    - ``backward``: the softmax's backward, its saved output, the gradient of it (fp32) and
      the gradient of its input (fp32 when the input was converted, else the compute dtype's),
      and the tanh output, saved for its own backward: 4 + 4 + (4 or p) [+ p];
    - ``returned``: the weights the attention returns (p): the decoder layer binds them to
      ``_`` (``hidden_states, _ = self.self_attn(...)``), so a forward without grad holds
      them until the layer returns, through its MLP.

    With attention sinks (gpt-oss: a learned logit per head joins every row's softmax) the
    scores gain a column and the softmax runs in the compute dtype after subtracting the row's
    max: it saves its output (p) and the max's indices (8 bytes a row). Its forward holds the
    masked scores, the concatenation with the sinks and the shifted copy at once (3 p, with
    grad or without); its backward the softmax's gradient, the zeros the slice's backward
    scatters into, and the scattered copy (3 p).

    The moments are the scores' alone: :func:`block_activations` adds what the block holds
    beside them. A padded batch's mask is :func:`attention_mask_bytes`.
    """
    if not ctx.scores_materialised:
        return 0
    att = ctx.spec.block(index).attention
    p = ctx.compute_bytes
    t_k = t_q if t_k is None else t_k
    rows = batch * att.num_heads // ctx.tp * t_q
    # Eager attention repeats grouped K and V to every query head (repeat_kv), alive with the scores.
    repeated = (
        2 * att.q_dim * p * batch * t_k // ctx.tp if moment == "nograd" and att.num_kv_heads < att.num_heads else 0
    )
    if ctx.attention_sinks[index]:
        per_score = {"saved": p, "nograd": 3 * p, "grad": 3 * p, "backward": 3 * p, "returned": p}[moment]
        per_row = 8 if moment in ("saved", "grad", "backward") else 0
        return int(per_score * rows * (t_k + 1) + per_row * rows) + repeated
    cast = p if p != 4 else 0
    converted = 4 if _softmax_converts(ctx) else 0
    tanh = p if att.logit_softcapping else 0
    at_softmax = p + 4 + max(converted, cast)  # the softmax's input and output, and its copy or the cast
    per_score = {
        "saved": tanh + 4 + cast,
        "nograd": at_softmax,
        "grad": tanh + at_softmax,
        "backward": tanh + 8 + (4 if converted or p == 4 else p),
        "returned": p,
    }[moment]
    return int(per_score * rows * t_k) + repeated


def tape_of(ctx: Context, index: int) -> BlockTape:
    """The counted tape of layer ``index``'s block type (:func:`._tape.block_tape`), made once per
    estimate (it is asked per pass and per moment)."""
    if (tape := ctx.tapes.get(index)) is not None:
        return tape
    block = ctx.spec.block(index)
    ctx.tapes[index] = tape = block_tape(
        block,
        hidden=ctx.hidden_size,
        adapted=frozenset(n.split(":", 1)[0] for n in ctx.lora_names[index]),
        rank=ctx.lora_rank,
        compute_bytes=ctx.compute_bytes,
        adapter_bytes=ctx.adapter_compute_bytes,
        tp=ctx.tp,
        mlp_tp=1 if ctx.packed[index] else ctx.tp,
        include_mlp=routed_experts(ctx, index) is None and block.mlp.kind != "moe",
        full=ctx.full_finetune,
        eager=ctx.scores_materialised,
        autocast=ctx.workload.autocast_forward,
        dropout_bytes=lora_dropout_bytes(ctx),
    )
    return tape


def lora_dropout_bytes(ctx: Context) -> int:
    """What LoRA dropout's backward keeps per element of an adapted linear's input (0 without
    dropout): a one-byte mask on a GPU (``native_dropout``), the scaled noise tensor it multiplies
    by on a CPU (``torch.dropout``'s CPU path), in the adapters' compute dtype. Read off saved-tensor
    hooks on PEFT's LoRA linear (tests/planner/memory/test_tape.py)."""
    if ctx.workload.lora_dropout == 0:
        return 0
    return 1 if ctx.on_gpu else ctx.adapter_compute_bytes


def altup_of(ctx: Context, index: int) -> AltUpTape | None:
    """Gemma-3n's AltUp layer beyond the tape (:func:`._tape.altup_tape`), or None without AltUp."""
    if not ctx.extra_streams:
        return None
    return altup_tape(
        ctx.spec.block(index),
        hidden=ctx.hidden_size,
        streams=ctx.extra_streams + 1,
        adapted=frozenset(n.split(":", 1)[0] for n in ctx.lora_names[index]),
        rank=ctx.lora_rank,
        compute_bytes=ctx.compute_bytes,
        adapter_bytes=ctx.adapter_compute_bytes,
    )


@dataclass(frozen=True, slots=True)
class BlockActivations:
    """One block type over one micro-batch, in bytes (see :class:`._tape.BlockTape`)."""

    saved: int  # kept for backward by the block when not checkpointed
    forward: int  # the most alive in its forward with grad beyond its input
    recompute: int  # checkpointed: the most alive in its recompute
    backward: int  # the most alive in its backward, its saved tensors included
    nograd_per_token: float  # a no-grad forward's most beyond its input, adapters on
    nograd_base_per_token: float  # the same with adapters disabled
    attention_live_per_token: float  # a no-grad attention's own tensors while it makes its scores


def _moe_saved_per_token(ctx: Context, index: int) -> float:
    """A MoE block's router and routed experts, per token (:mod:`._moe`)."""
    if ctx.spec.block(index).mlp.kind != "moe":
        return 0.0
    return router_saved_per_token(ctx, index) + experts_saved_per_token(ctx, index)


def block_activations(ctx: Context, layout: Layout, index: int, pass_: Pass | None = None) -> BlockActivations:
    """Scale the tape of layer ``index`` to one micro-batch's pass (the one-pass forward by
    default) and add the experts, Gemma-3n's AltUp layer (:func:`._tape.altup_tape`), eager
    attention's scores and, in a suffix pass, the rows' copies of the prefix K and V its
    attention saves.

    An AltUp layer saves its input streams (counted in ``saved``, which the next block's
    moments need, but not in the moments, which are beyond the block's input), and peaks at
    its end, where it still holds its predictions, its output and its named intermediates, or
    at the start of its backward.
    """
    tape = tape_of(ctx, index)
    pass_ = pass_ or one_pass(ctx)
    N = pass_.tokens
    moe = _moe_saved_per_token(ctx, index)
    alt = altup_of(ctx, index)
    altup = alt.saved if alt else 0.0
    # a masked SDPA under GQA saves K and V repeated to every head: the whole row's, in a suffix pass
    repeated = tape.masked_kv_saved * (pass_.rows * pass_.keys) if pass_.masked else 0
    extra_saved = (
        N * (moe + altup)
        + merged_stack_saved_bytes(ctx, layout, index)
        + prefix_kv_bytes(ctx, index, pass_.prefix_kv_rows)
        + repeated
    )
    # eager attention's saved scores outlive the attention; its softmax input does not
    scores = attention_scores_bytes(ctx, pass_.rows, pass_.queries, index, "saved", pass_.keys)
    saved = int(N * tape.saved + extra_saved) + scores
    transient = backward_transient_bytes(ctx, layout, ctx.micro_batch, index)  # a MoE block's experts
    forward = int(N * tape.grad_peak + extra_saved) + scores
    recompute = int(N * tape.recompute_peak + extra_saved) + scores
    backward = max(int(N * tape.backward_peak + extra_saved) + scores, saved + transient)
    if ctx.fsdp is not None and tape.backward_weight_grad:
        # a full fine-tune's MLP output weight gradient is made by the product's moment and held in
        # the unit's unsharded copy until its post-backward (traced on 2 gloo ranks: down_proj's
        # bf16 .grad beside the product's gradients; without it a block's backward read 0.7-1.0%
        # low). On one device the fp32 masters take it at once (MasterWeightAdamW's hook).
        backward = max(backward, int(N * tape.backward_product + extra_saved + tape.backward_weight_grad) + scores)
    # the experts' own moment: the block's saved tensors so far, the residual and the gate's temporaries
    at_experts = saved + N * ctx.hidden_size * ctx.compute_bytes + expert_forward_grad_transient(ctx, N, index)
    forward, recompute = max(forward, at_experts), max(recompute, at_experts)
    if ctx.scores_materialised:  # eager attention's own moments, at its softmax (forward and backward)
        before = N * altup + prefix_kv_bytes(ctx, index, pass_.prefix_kv_rows) + repeated
        at_scores = int(N * tape.attention_grad_live + before) + attention_scores_bytes(
            ctx, pass_.rows, pass_.queries, index, "grad", pass_.keys
        )
        forward, recompute = max(forward, at_scores), max(recompute, at_scores)
        at_softmax_backward = int(N * tape.attention_backward_live + before) + attention_scores_bytes(
            ctx, pass_.rows, pass_.queries, index, "backward", pass_.keys
        )
        backward = max(backward, at_softmax_backward)
    if alt:
        beyond_input = saved - N * ctx.carried_hidden * ctx.compute_bytes
        forward = max(forward, beyond_input + int(N * alt.forward_end))
        recompute = max(recompute, beyond_input + int(N * alt.recompute_end) + transient)
        backward = max(backward, beyond_input + int(N * alt.backward_start) + transient)
    return BlockActivations(
        saved=saved,
        forward=forward,
        recompute=recompute,
        backward=backward,
        nograd_per_token=tape.nograd_peak,
        nograd_base_per_token=tape.nograd_peak_base,
        attention_live_per_token=tape.attention_live,
    )


def activations_by_type(ctx: Context, layout: Layout, pass_: Pass | None = None) -> dict[int, BlockActivations]:
    """:func:`block_activations` of every distinct layer."""
    return {i: block_activations(ctx, layout, i, pass_) for i in ctx.distinct_layers}


def _trainer_mask(ctx: Context, batch: int, length: int, *, forward: str) -> bool:
    """Whether a forward reads the trainer's one additive mask (agilerl.utils.logprobs.
    shared_attention_mask): a padded batch of two rows or more under SDPA or eager attention, in
    the trainer's own forwards, where no sliding window is shorter than the row."""
    if not ctx.workload.padded_batches or batch < 2 or forward == "generate":
        return False
    if ctx.workload.attn_implementation not in ("sdpa", "eager"):
        return False
    return not any(w is not None and w < length for w in _sliding_windows(ctx))


def _sliding_windows(ctx: Context) -> list[int | None]:
    """Each block type's sliding window (None for full attention)."""
    return [ctx.spec.block(i).attention.sliding_window for i in ctx.distinct_layers]


def attention_mask_bytes(ctx: Context, batch: int, length: int, *, forward: str) -> int:
    """The attention masks a forward holds beside its blocks; 0 for SDPA when every row has one
    length or for a single row (it runs causal), and for flash attention (no mask).

    ``forward`` is ``"learn"`` (with grad), ``"reference"`` (the trainer's no-grad pass) or
    ``"generate"`` (Hugging Face generate's prefill over the left-padded prompts).

    The trainer's forwards of a padded batch hold one additive ``batch x length^2`` mask in the
    compute dtype, shared by every layer (:func:`_trainer_mask`). Otherwise Hugging Face builds
    its own, one per mask kind (full, sliding):

    - eager attention, padded or not: a float mask per kind in the compute dtype
      (``masking_utils.eager_mask``), which the layers add to their scores without saving it;
      alive while the model's forward runs, and under activation checkpointing until the
      backward's end (the checkpoint keeps its layers' arguments for the recompute);
    - SDPA over a padded batch: a boolean one per kind, which SDPA turns into a float copy in
      every layer; with grad each layer that is not checkpointed saves its copy for backward,
      otherwise one is alive at a time.

    Eager's masks were found with a live-tensor tracker at a tiny Gemma 2's no-grad peak (two
    ``2 x 1 x 512 x 512`` bf16 masks) and are measured in benchmarks/eager_attention_memory.py.
    """
    attn = ctx.workload.attn_implementation
    area = batch * length * length
    if _trainer_mask(ctx, batch, length, forward=forward):
        return area * ctx.compute_bytes
    kinds = 1 + any(w is not None for w in _sliding_windows(ctx))
    if attn == "eager":
        return kinds * area * ctx.compute_bytes
    if not ctx.workload.padded_batches or batch < 2 or attn != "sdpa":
        return 0
    copies = max(1, ctx.spec.num_layers - len(ctx.checkpointed)) if forward == "learn" else 1
    return area * (kinds + copies * ctx.compute_bytes)


def prefix_kv_bytes(ctx: Context, index: int, rows: int) -> int:
    """The shared-prefix forward (agilerl.utils.shared_prefix): the prefix keys and values of
    layer ``index`` copied to ``rows`` rows, 2 x rows x split x kv_dim / tp x p (what the suffix
    pass's attention reads, and with grad saves, beyond its own tokens); 0 without it, and for a
    layer reading another's K and V (it records none)."""
    if not ctx.prefix_split or not ctx.spec.block(index).attention.has_own_kv:
        return 0
    return 2 * rows * ctx.prefix_split * ctx.spec.block(index).attention.kv_dim // ctx.tp * ctx.compute_bytes


def stored_kv_bytes(ctx: Context, tokens: int) -> dict[int, int]:
    """K/V sharing (Gemma-3n, Gemma 4: ``AttentionSpec.kv_sharing``): per storing layer, the K and V
    it keeps for the layers that read them, 2 x tokens x kv_dim / tp x p over the whole row (a
    sliding layer's too: transformers keeps them uncut for its readers); empty without sharing."""
    p, out = ctx.compute_bytes, {}
    for j in range(ctx.spec.num_layers):
        att = ctx.spec.block(j).attention
        if att.kv_sharing == "store":
            out[j] = 2 * tokens * att.kv_dim // ctx.tp * p
    return out


def _last_reader(ctx: Context, store: int) -> int:
    """The last layer reading ``store``'s K and V: the last reuse layer of its attention type."""
    window = ctx.spec.block(store).attention.sliding_window
    readers = [
        j
        for j in range(store + 1, ctx.spec.num_layers)
        if not ctx.spec.block(j).attention.has_own_kv and ctx.spec.block(j).attention.sliding_window == window
    ]
    return max(readers, default=store)


def _stored_elsewhere(ctx: Context, store: int, masked: bool) -> bool:
    """The storing block's own keep holds its stored K and V: it is not checkpointed and SDPA saves
    them as they are (eager attention and a masked SDPA under GQA save repeated copies instead)."""
    att = ctx.spec.block(store).attention
    repeated = ctx.scores_materialised or (masked and att.num_kv_heads < att.num_heads)
    return store not in ctx.checkpointed and not repeated


def shared_kv_moments(ctx: Context, tokens: int, masked: bool = False) -> tuple[list[int], list[int]]:
    """Per layer j, the shared K and V (:func:`stored_kv_bytes`) alive beyond what the blocks keep
    (:func:`kept_bytes`) while j runs forward with grad, and while it runs backward or recomputes
    (``masked``: the pass's SDPA gets a mask).

    The storing layer's attention puts them in the forward's ``shared_kv_states``, which every
    decoder layer is called with. A block that is not checkpointed saves them (SDPA's k and v), so
    its keep holds them (:func:`_stored_elsewhere`); otherwise they live on beside the blocks. Every
    checkpointed layer's recompute keeps that dict (its call's arguments) until its backward, so
    they live until the first such layer's backward (:func:`stored_kv_kept`). In backward the
    readers' gradients for them build up (their size, in the compute dtype) from the end of the
    last reader's attention backward, through every layer between, to the storing layer's own
    backward. Counted on tiny Gemma-3n and Gemma 4 models sharing their last 2 of 6 layers' K and
    V, against the same models without (benchmarks/kv_sharing_memory.py)."""
    stores = stored_kv_bytes(ctx, tokens)
    L = ctx.spec.num_layers
    forward, backward = [0] * L, [0] * L
    first_checkpointed = min(ctx.checkpointed, default=L)
    for s, size in stores.items():
        last = _last_reader(ctx, s)
        elsewhere = _stored_elsewhere(ctx, s, masked)
        for j in range(L):
            if j > s and not elsewhere:
                forward[j] += size
            if j >= first_checkpointed and (not elsewhere or j < s):
                backward[j] += size
            if s <= j < last:
                backward[j] += size  # the accumulating gradients
    return forward, backward


def stored_kv_kept(ctx: Context, tokens: int, masked: bool = False) -> int:
    """Under activation checkpointing, the shared K and V no block's keep holds, alive from the
    forward to the end of the backward (:func:`shared_kv_moments`); 0 without checkpointing or
    K/V sharing."""
    if not ctx.checkpointed:
        return 0
    stores = stored_kv_bytes(ctx, tokens)
    return sum(size for s, size in stores.items() if not _stored_elsewhere(ctx, s, masked))


def recorded_prefix_bytes(ctx: Context) -> int:
    """The prefix pass's recorded keys and values of every layer (its distinct prompts' rows),
    alive through the suffix pass: what a checkpointed block's recompute reads again."""
    return sum(layers * prefix_kv_bytes(ctx, i, ctx.prefix_rows) for i, layers in ctx.layer_counts)


def checkpointed_block_bytes(ctx: Context, tokens: int | None = None) -> int:
    """A checkpointed block keeps its input: N x H x p (counted with saved-tensor hooks:
    exactly one hidden state per block, in the compute dtype); under Gemma-3n's AltUp
    every stream of it. N: the pass's tokens (the one-pass forward's m x T by default)."""
    N = ctx.micro_batch_tokens if tokens is None else tokens
    return (1 + ctx.extra_streams) * N * ctx.hidden_size * ctx.compute_bytes


def kept_bytes(
    ctx: Context, blocks: dict[int, BlockActivations], pass_: Pass | None = None, *, recorded: bool = False
) -> list[int]:
    """Per layer, what it keeps once its forward (or pass) has run: its input when
    checkpointed, else its saved tensors. ``recorded``: a prefix pass, whose checkpointed
    blocks also keep their recorded K and V alive (the recompute's cache argument)."""
    checkpoint = checkpointed_block_bytes(ctx, pass_.tokens if pass_ else None)
    kv = {i: prefix_kv_bytes(ctx, i, ctx.prefix_rows) if recorded else 0 for i in ctx.distinct_layers}
    return [checkpoint + kv[r] if i in ctx.checkpointed else blocks[r].saved for i, r in enumerate(ctx.representative)]


def rotary_bytes(ctx: Context, tokens: int | None = None) -> int:
    """The rotary cos and sin one forward computes and the blocks read: 2 x width x p per token
    (of every pass) for each table (``ModelSpec.rotary_widths``: one per attention type in Gemma 3,
    Gemma-3n and Gemma 4), else one table as wide as a head."""
    N = ctx.micro_batch_tokens if tokens is None else tokens
    widths = ctx.spec.rotary_widths
    width = sum(widths) if widths is not None else ctx.spec.block(0).attention.head_dim
    return 2 * width * ctx.compute_bytes * N


def boundary_bytes(ctx: Context, tokens: int | None = None) -> int:
    """Kept outside the blocks after a forward with grad: the head side, freed once the head and
    the final norm have run backward (the final RMSNorm's fp32 input, 4 H + 4; the final hidden
    states the log-prob head saves, H x p; the rotary tables; HEAD_ROW_BYTES per token;
    Gemma-3n's AltUp unembedding, 3 x (streams - 1) + 1 hidden states in the compute dtype, and
    its adapted projections), and :func:`embedding_kept_bytes`. With full fine-tuning the final
    norm's weight trains, and its product saves the normalised input (H x p)."""
    N = ctx.micro_batch_tokens if tokens is None else tokens
    H, p, extra = ctx.hidden_size, ctx.compute_bytes, ctx.extra_streams
    unembed = (3 * extra + 1) * H * p if extra else 0
    per_token: float = 4 * H + 4 + H * p + HEAD_ROW_BYTES + (H * p if ctx.full_finetune else 0)
    per_token += unembed + outside_saved_bytes(ctx, "head")
    return int(N * per_token) + rotary_bytes(ctx, N) + embedding_kept_bytes(ctx, N)


def embedding_kept_bytes(ctx: Context, tokens: int | None = None) -> int:
    """Kept from before the first block to the embeddings' backward, the last (0 for most
    models): per-layer inputs (Gemma-3n, Gemma 4: L x P per token in the compute dtype, which
    every layer's gate multiplies by, and the fp32 input and reciprocal RMS of their projection's
    norm, 4 L P + 8 L), AltUp's streams made from the embeddings (two hidden states per extra
    stream, what its magnitude rescaling saves) and the adapted linears reading the embeddings
    (:func:`outside_saved_bytes`).

    Counted with saved-tensor hooks on Gemma-3n's forward, split at its first and after its
    last layer, with the adapters in the compute dtype and in fp32: both sides within 1.4%
    (tests/planner/memory/test_gemma_layers.py)."""
    N = ctx.micro_batch_tokens if tokens is None else tokens
    H, p, width = ctx.hidden_size, ctx.compute_bytes, ctx.spec.per_layer_input_width
    per_layer = width * (p + 4) + 8 * ctx.spec.num_layers if width else 0
    streams = 2 * ctx.extra_streams * H * p
    return int(N * (per_layer + streams + outside_saved_bytes(ctx, "embed")))


def outside_saved_bytes(ctx: Context, side: str) -> float:
    """Per token, what the adapted linears outside the blocks save on one ``side``: ``"embed"``
    (Gemma-3n's AltUp projections and per-layer model projection, which read the embeddings) or
    ``"head"`` (its AltUp unembedding projections, which read the last layer's streams). Each
    saves its a x r output and its input: when PEFT casts it to the adapters' dtype, a copy of
    its own (a x in); otherwise the tensor itself, which the embedding side's share (H x p once)
    and the unembedding side's are views of the streams already counted."""
    if ctx.full_finetune:
        return 0.0
    p, a, r = ctx.compute_bytes, ctx.adapter_compute_bytes, ctx.lora_rank
    adapted = [e for e in ctx.spec.lora_outside_blocks.get(ctx.lora_key, ()) if ("unembed" in e[0]) == (side == "head")]
    if not adapted:
        return 0.0
    if a != p:
        return sum(a * a_cols + a * r for _, _, a_cols, _, _ in adapted)
    return (ctx.hidden_size * p if side == "embed" else 0) + len(adapted) * p * r


def gradients_in_flight(ctx: Context, *, recompute: bool, tokens: int | None = None) -> int:
    """Gradients flowing into a block's backward: the block output's and the residual's
    (2 x H x p per token of the pass; every stream's under Gemma-3n's AltUp, whose block
    carries S hidden states), and during the last block's recompute also the final norm's fp32
    input gradient (4 H), all seen with the tracker at the peak."""
    N = ctx.micro_batch_tokens if tokens is None else tokens
    H, p = ctx.hidden_size, ctx.compute_bytes
    return N * (2 * ctx.carried_hidden * p + (4 * H if recompute else 0))


def learn_block_moments(
    ctx: Context,
    blocks: dict[int, BlockActivations],
    pass_: Pass | None = None,
    grown: tuple[int, ...] = (),
    windows: tuple[tuple[int, int], ...] = (),
    backward_windows: tuple[int, ...] = (),
    reduce_held: tuple[int, ...] = (),
) -> tuple[tuple[int, int], tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The most alive while a block not checkpointed runs its forward with grad, while a
    checkpointed block recomputes in backward, and while the blocks run backward: three
    moments, as FSDP2 holds a different gathered window in the forward than in the backward
    (planner.memory._gathered.in_flight), and a unit's unsharded gradients exist only in the
    last. The recompute and backward moments are (activations, the change of the held gradients
    so far, gathered window): ``grown[j]`` when layer j runs backward (or recomputes: made by this
    micro-batch, or negative where deferred accumulated gradients gave way to their shards),
    under ``backward_windows[j]`` (planner.memory._gathered.backward_layer_windows;
    none: 0). A forward has made none: its moment is (activations, gathered window) where the
    two together are largest. ``windows``: per layer, the forward's window while it runs and at
    its unit's copy-out, before it runs (planner.memory._gathered.forward_layer_windows; none:
    0). ``reduce_held``: per layer, the reduce-scatter input FSDP2 still holds while it runs
    backward or recomputes (:func:`planner.memory._static.reduce_inputs_held`; none: 0), the
    moments' fourth element. A moment no block has is all zeros.

    At block j: everything the earlier blocks keep, and j's own most (its forward with
    grad or its recompute with the gradients flowing in, or its backward). The later
    blocks have not run (forward) or are freed (backward). Under K/V sharing the shared K
    and V, and in backward their gradients, are beside (:func:`shared_kv_moments`).
    """
    kept = kept_bytes(ctx, blocks, pass_)
    N = pass_.tokens if pass_ else ctx.micro_batch_tokens
    # The block's input, referenced by the caller (in fp32 the input norm saves it, so the
    # block's own terms count it).
    x_in = N * ctx.carried_hidden * ctx.compute_bytes if ctx.compute_bytes != 4 else 0
    flowing, recomputing = (
        gradients_in_flight(ctx, recompute=False, tokens=N),
        gradients_in_flight(ctx, recompute=True, tokens=N),
    )
    shared_forward, shared_backward = shared_kv_moments(ctx, N, (pass_ or one_pass(ctx)).masked)
    forward, before = (0, 0), 0
    recompute, backward = (0, 0, 0, 0), (0, 0, 0, 0)
    for j in range(ctx.spec.num_layers):
        b = blocks[ctx.representative[j]]
        g = grown[j] if grown else 0
        gathered = backward_windows[j] if backward_windows else 0
        reducing = reduce_held[j] if reduce_held else 0
        held = before + shared_backward[j]  # in backward (a recompute is one)
        running, copying = windows[j] if windows else (0, 0)
        if j in ctx.checkpointed:
            # its forward saves nothing: only its unit's copy-out is a moment of the forward here
            # (its forward is checkpointed_forward_moment's)
            forward = max(forward, (before + shared_forward[j] + x_in, copying), key=sum)
            recompute = max(recompute, (held + kept[j] + b.recompute + recomputing, g, gathered, reducing), key=sum)
            backward = max(backward, (held + kept[j] + b.backward + flowing, g, gathered, reducing), key=sum)
        else:
            forward = max(
                forward,
                (before + shared_forward[j] + b.forward + x_in, running),
                (before + shared_forward[j] + x_in, copying),
                key=sum,
            )
            backward = max(backward, (held + b.backward + flowing, g, gathered, reducing), key=sum)
        before += kept[j]
    return forward, recompute, backward


def checkpointed_forward_moment(
    ctx: Context,
    layout: Layout,
    blocks: dict[int, BlockActivations],
    pass_: Pass | None = None,
    *,
    embedding: int = 0,
    windows: tuple[int, ...] = (),
) -> LayerMoment:
    """The most alive while a checkpointed block runs its forward with grad; 0 when no block
    is checkpointed. Its activations: ``embedding`` (what stays from before the blocks), the
    earlier blocks' keep, its own input, and its forward, which under the checkpoint saves
    nothing and so holds what a forward without grad holds (:func:`nograd_block_bytes`,
    adapters on), and under K/V sharing the K and V stored before it (:func:`shared_kv_moments`).
    Its window is the forward's while it runs (``windows``, per layer, wider than the
    backward's: planner.memory._gathered.in_flight), paired by layer (:func:`paired`)."""
    if not ctx.checkpointed:
        return LayerMoment(0)
    pass_ = pass_ or one_pass(ctx)
    kept = kept_bytes(ctx, blocks, pass_)
    shared, _ = shared_kv_moments(ctx, pass_.tokens, pass_.masked)
    inner: dict[int, int] = {}  # per block type
    acts: list[int] = []
    gathered: list[int] = []  # their windows
    before = embedding
    for j in range(ctx.spec.num_layers):
        if j in ctx.checkpointed:
            r = ctx.representative[j]
            if r not in inner:
                inner[r] = nograd_block_bytes(
                    ctx, layout, pass_.rows, pass_.queries, r, keys=pass_.keys, masked=pass_.masked
                )
            acts.append(before + kept[j] + inner[r] + shared[j])
            gathered.extend(windows[j : j + 1])
        before += kept[j]
    return paired(acts, tuple(gathered))


@dataclass(frozen=True, slots=True)
class LearnActivations:
    """A learn micro-batch's activations at its moments (see planner.memory._phases.learn_phase)."""

    kept: int  # everything kept for backward once the forward has run, the boundary included
    blocks_kept: int  # what the blocks alone keep
    forward: int  # the most while a block not checkpointed runs forward, or a unit copies out (0: neither)
    forward_gathered: int  # the forward's gathered window then (0 without windows)
    recompute: int  # the most while a checkpointed block recomputes (0: none is)
    backward: int  # the most while a block runs backward
    recompute_gathered: int  # the backward's gathered window at the recompute moment (0 without windows)
    backward_gathered: int  # ... at the backward moment
    head_rows: int  # tokens whose final hidden states reach the head (its input gradient's)
    embedding_kept: int = 0  # kept through every block's backward (embedding_kept_bytes), in the moments
    recompute_grads: int = 0  # this micro-batch's gradients made by the recompute moment
    backward_grads: int = 0  # ... by the backward moment
    recompute_reducing: int = 0  # the reduce-scatter input held at the recompute moment
    backward_reducing: int = 0  # ... at the backward moment
    checkpointed_forward: int = 0  # the most while a checkpointed block runs forward (checkpointed_forward_moment)
    checkpointed_forward_gathered: int = 0  # the forward's gathered window then


def learn_activations(
    ctx: Context,
    layout: Layout,
    grown: tuple[int, ...] = (),
    windows: tuple[tuple[int, int], ...] = (),
    backward_windows: tuple[int, ...] = (),
    reduce_held: tuple[int, ...] = (),
) -> LearnActivations:
    """The one-pass forward's terms, or the shared-prefix forward's: the prefix pass runs every
    block first and its keep stays through the suffix pass, which runs and then back-propagates
    block by block beside it (the moments are the suffix pass's, plus everything the prefix
    pass keeps); the gradients of the recorded prefix K and V wait for the prefix pass's
    backward, after the suffix pass's. ``grown``: per layer, the gradients the micro-batch has
    made when that layer runs backward; ``windows`` and ``backward_windows``: per layer, the
    forward's and the backward's gathered windows, ``reduce_held`` the reduce-scatter input held
    (:func:`learn_block_moments`)."""
    passes = learn_passes(ctx)
    running = tuple(w for w, _ in windows)
    if len(passes) == 1:
        blocks = activations_by_type(ctx, layout)
        (forward, window), (recompute, g_run, w_run, r_run), (backward, g_back, w_back, r_back) = learn_block_moments(
            ctx, blocks, grown=grown, windows=windows, backward_windows=backward_windows, reduce_held=reduce_held
        )
        blocks_kept = sum(kept_bytes(ctx, blocks)) + stored_kv_kept(ctx, ctx.micro_batch_tokens, one_pass(ctx).masked)
        embedding = embedding_kept_bytes(ctx)
        checkpointed = checkpointed_forward_moment(ctx, layout, blocks, embedding=embedding, windows=running)
        return LearnActivations(
            kept=blocks_kept + boundary_bytes(ctx),
            blocks_kept=blocks_kept,
            forward=forward + embedding if forward or window else 0,
            forward_gathered=window,
            recompute=recompute + embedding if recompute else 0,
            backward=backward + embedding,
            recompute_gathered=w_run,
            backward_gathered=w_back,
            head_rows=ctx.micro_batch_tokens,
            embedding_kept=embedding,
            recompute_grads=g_run,
            backward_grads=g_back,
            recompute_reducing=r_run,
            backward_reducing=r_back,
            checkpointed_forward=checkpointed.activations,
            checkpointed_forward_gathered=checkpointed.window,
        )
    prefix, suffix = passes
    prefix_blocks = activations_by_type(ctx, layout, prefix)
    prefix_kept = sum(kept_bytes(ctx, prefix_blocks, prefix, recorded=True))
    suffix_blocks = activations_by_type(ctx, layout, suffix)
    (forward, window), (recompute, g_run, w_run, r_run), (backward, g_back, w_back, r_back) = learn_block_moments(
        ctx,
        suffix_blocks,
        suffix,
        grown=grown,
        windows=windows,
        backward_windows=backward_windows,
        reduce_held=reduce_held,
    )
    blocks_kept = prefix_kept + sum(kept_bytes(ctx, suffix_blocks, suffix))
    embedding = embedding_kept_bytes(ctx, prefix.tokens + suffix.tokens)
    checkpointed = max(
        checkpointed_forward_moment(ctx, layout, prefix_blocks, prefix, embedding=embedding, windows=running),
        checkpointed_forward_moment(
            ctx, layout, suffix_blocks, suffix, embedding=embedding + prefix_kept, windows=running
        ),
        key=sum,
    )
    return LearnActivations(
        kept=blocks_kept + boundary_bytes(ctx, prefix.tokens + suffix.tokens),
        blocks_kept=blocks_kept,
        forward=prefix_kept + forward + embedding if forward or window else 0,
        forward_gathered=window,
        recompute=prefix_kept + recompute + embedding if recompute else 0,
        backward=prefix_kept + backward + recorded_prefix_bytes(ctx) + embedding,
        recompute_gathered=w_run,
        backward_gathered=w_back,
        head_rows=suffix.tokens,
        embedding_kept=embedding,
        recompute_grads=g_run,
        backward_grads=g_back,
        recompute_reducing=r_run,
        backward_reducing=r_back,
        checkpointed_forward=checkpointed.activations,
        checkpointed_forward_gathered=checkpointed.window,
    )


def value_head_bytes(ctx: Context) -> int:
    """LLMPPO's value head reads the final hidden states of the scored positions in fp32: the
    m x C x H x 4 copy its linear saves for its weight's gradient (the same again as that copy's
    gradient in backward, and a transient of the no-grad sampling pass). 0 for the others."""
    if ctx.workload.algorithm != "ppo":
        return 0
    return ctx.micro_batch * min(ctx.sequence_tokens - 1, ctx.workload.completion_tokens) * ctx.hidden_size * 4


def saved_activation_bytes(ctx: Context, blocks: dict[int, BlockActivations]) -> int:
    """Everything kept for backward after one micro-batch's forward: every block's (a
    checkpointed block its input only) and the boundary."""
    return sum(kept_bytes(ctx, blocks)) + boundary_bytes(ctx)


def altup_nograd_bytes(ctx: Context, tape: BlockTape, tokens: int, adapters_on: bool) -> int:
    """Gemma-3n's decoder layer without grad, beyond its input streams: its forward names every
    intermediate, and Python keeps each until the layer returns. With ``S`` streams of ``h`` (a
    hidden state over ``tokens``), the most of three moments:

    - its attention's (the tape's), beside the predictions and Laurel's output: (S + 1) h;
    - its MLP's (the tape's, with the outputs Gemma-3n's MLP names), beside the predictions, the
      normed prediction, Laurel's output, the attention's output and their sum: (S + 4) h;
    - its end, at the per-layer projection's norm: the predictions and the corrected streams
      (2 S h), nine named hidden states (the normed prediction, Laurel's output, the attention's
      output and its two sums, the MLP's input, its output, its norm and its sum), the
      projection's output (h) and the norm's fp32 normed and weighted copies (8 H a token).

    Traced with a live-tensor tracker on tiny Gemma-3n layers, the MLP twice and eight times as
    wide as the hidden state (tests/planner/memory/test_gemma_layers.py); one constant for all
    three, (4 (S - 1) + 2) h beside the tape's most, read +9% and -4% there."""
    S = ctx.extra_streams + 1
    h = tokens * ctx.hidden_size * ctx.compute_bytes
    attention, mlp = tape.nograd_parts if adapters_on else tape.nograd_parts_base
    return int(
        max(
            tokens * attention + (S + 1) * h,
            tokens * mlp + (S + 4) * h,
            (2 * S + 10) * h + 8 * ctx.hidden_size * tokens,
        )
    )


def nograd_block_bytes(
    ctx: Context,
    layout: Layout,
    batch: int,
    length: int,
    index: int,
    adapters_on: bool = True,
    *,
    keys: int | None = None,
    masked: bool | None = None,
) -> int:
    """The most a block's forward without grad holds over ``batch`` x ``length`` tokens beyond
    its input: the tape's moments, or the experts' temporaries beside the stream; AltUp's
    streams, eager attention's scores, and a masked SDPA's K and V repeated to every head over
    ``keys`` positions (``masked`` None: a padded batch of two rows or more).

    ``adapters_on=False``: the reference pass on the base model (adapters disabled), where
    PEFT merges no expert stacks and casts nothing."""
    acts = block_activations(ctx, layout, index)
    keys = length if keys is None else keys
    if masked is None:
        masked = ctx.workload.padded_batches and batch > 1 and ctx.workload.attn_implementation == "sdpa"
    repeated = batch * keys * tape_of(ctx, index).masked_kv_nograd if masked else 0
    tokens = batch * length
    H, p = ctx.hidden_size, ctx.compute_bytes
    per_token = acts.nograd_per_token if adapters_on else acts.nograd_base_per_token
    peak = tokens * per_token
    if routed_experts(ctx, index) is not None:
        # beside the experts' temporaries the stream, and for Hugging Face's experts one more hidden
        # state (located on the tiny Qwen3-MoE); the row-wise experts' peak, their combine, has the stream only
        streams = 1 if ctx.expert_rowwise else 2
        experts = expert_forward_temps(ctx, layout, batch, length, index, adapters_on)
        peak = max(peak, streams * tokens * H * p + experts)
    if ctx.extra_streams:
        peak = max(peak, altup_nograd_bytes(ctx, tape_of(ctx, index), tokens, adapters_on))
    # eager attention's returned weights stay alive until the layer returns
    peak += attention_scores_bytes(ctx, batch, length, index, "returned")
    scores = attention_scores_bytes(ctx, batch, length, index, "nograd")  # at the attention's own moment
    return int(max(peak, tokens * acts.attention_live_per_token + scores + repeated))


class LayerMoment(NamedTuple):
    """What a forward holds while one of its layers runs."""

    activations: int
    window: int = 0  # the gathered window FSDP2 holds then (planner.memory._gathered.forward_layer_windows)
    held: int = 0  # what the caller holds beside that grows layer by layer (generate: the prompt's cache so far)


def paired(activations: list[int], windows: tuple[int, ...] = (), held: tuple[int, ...] = ()) -> LayerMoment:
    """The layer where its activations, the gathered window FSDP2 holds while it runs
    (``windows``, per layer; none unsharded) and what grows beside it (``held``, per layer;
    none: 0) are largest together. A window and an activation peak of different layers never
    coexist: the last block's unit may prefetch an untied head while a middle layer is the
    widest, and a prefill's cache is whole only at its last layer."""
    L = len(activations)
    return max(
        (LayerMoment(a, w, h) for a, w, h in zip(activations, windows or (0,) * L, held or (0,) * L)),
        key=sum,
    )


def nograd_beside_bytes(
    ctx: Context, batch: int, length: int, *, forward: str = "reference", mask_bytes: int | None = None
) -> int:
    """What a no-grad forward over ``batch`` x ``length`` tokens holds beside its blocks, from
    its embeddings to its end (:func:`nograd_forward_moment`'s list, K/V sharing's stores apart)."""
    tokens = batch * length
    H, p = ctx.hidden_size, ctx.compute_bytes
    beside = tokens * (2 * ctx.carried_hidden * p + (H * p if ctx.extra_streams else 0))
    beside += tokens * ctx.spec.per_layer_input_width * p + rotary_bytes(ctx, tokens)
    return beside + (attention_mask_bytes(ctx, batch, length, forward=forward) if mask_bytes is None else mask_bytes)


def nograd_forward_moment(
    ctx: Context,
    layout: Layout,
    batch: int,
    length: int,
    adapters_on: bool = True,
    *,
    forward: str = "reference",
    mask_bytes: int | None = None,
    keys: int | None = None,
    masked: bool | None = None,
    windows: tuple[int, ...] = (),
    held: tuple[int, ...] = (),
) -> LayerMoment:
    """A no-grad forward's most over its blocks: the layer where its activations, the window
    FSDP2 holds while it runs (``windows``, per layer) and what grows beside (``held``, per
    layer) are largest together (:func:`paired`). Its activations are the block's own, with
    what the model holds beside them (``forward``: "reference" or "generate"; ``mask_bytes``,
    ``keys``, ``masked``: a suffix pass's mask, key length and masking):

    - the embeddings' output (referenced until the forward returns) and the block's input: two
      hidden states, every stream of them under Gemma-3n's AltUp, and there one more: the last
      stream's projection, which its forward keeps in a local until it returns (transformers'
      Gemma3nTextModel.forward builds the streams from the embeddings one projection at a
      time), (2 S + [S > 1]) x N x H x p;
    - the per-layer inputs (Gemma-3n, Gemma 4), N x L x P x p, which every layer reads;
    - the rotary tables (:func:`rotary_bytes`) and a padded batch's attention mask;
    - under K/V sharing, the K and V the storing layers before a block keep for their readers
      (:func:`stored_kv_bytes`), except in generate, where they are the cache's own tensors, and
      whose prefill runs the readers over the last position only where the model does so
      (``ModelSpec.prefill_skips_readers``, Gemma 4).

    Gemma-3n's two terms were found with a live-tensor tracker at the reference pass's peak:
    on a 4-layer Gemma-3n (H 128, 512 tokens) the pass held 245 KiB more outside its blocks
    than counted; these two are 160 KiB of it, its second rotary table 64 KiB. Still not
    counted: the pass's int64 position ids."""
    tokens = batch * length
    beside = nograd_beside_bytes(ctx, batch, length, forward=forward, mask_bytes=mask_bytes)
    # transformers keeps every position under flash attention (it cannot slice that mask)
    flash = ctx.workload.attn_implementation == "flash_attention_2"
    skips = forward == "generate" and ctx.spec.prefill_skips_readers and not flash
    own = {
        i: nograd_block_bytes(
            ctx,
            layout,
            batch,
            1 if skips and not ctx.spec.block(i).attention.has_own_kv else length,
            i,
            adapters_on,
            keys=keys or length,
            masked=masked,
        )
        for i in ctx.distinct_layers
    }
    stores = stored_kv_bytes(ctx, tokens) if forward != "generate" else {}
    layers = [
        beside + own[r] + sum(size for s, size in stores.items() if s < j) for j, r in enumerate(ctx.representative)
    ]
    return paired(layers, windows, held)


def suffix_mask_bytes(ctx: Context) -> int:
    """The suffix pass's additive mask (agilerl.utils.prefix_cache.suffix_attention_mask):
    (T - split) x T queries by keys in the compute dtype, one for the batch when no row is
    padded, one per row otherwise; 0 without the shared-prefix forward."""
    if not ctx.prefix_split:
        return 0
    T = ctx.sequence_tokens
    rows = ctx.micro_batch if ctx.workload.padded_batches else 1
    return rows * (T - ctx.prefix_split) * T * ctx.compute_bytes


def learn_mask_bytes(ctx: Context) -> tuple[int, int]:
    """The masks of a learn micro-batch, as (held from its forward to its backward's end, held
    while its forward runs only): the one-pass forward's (:func:`attention_mask_bytes`), or the
    shared-prefix forward's two, the prefix pass's (over its rows and columns) and the suffix
    pass's. Hugging Face's eager masks, which no layer saves, are the forward's only when no layer
    is checkpointed to keep them for its recompute."""
    if ctx.prefix_split:
        batch, length, suffix = ctx.prefix_rows, ctx.prefix_split, suffix_mask_bytes(ctx)
    else:
        batch, length, suffix = ctx.micro_batch, ctx.sequence_tokens, 0
    masks = attention_mask_bytes(ctx, batch, length, forward="learn")
    if ctx.scores_materialised and not ctx.checkpointed and not _trainer_mask(ctx, batch, length, forward="learn"):
        return suffix, masks
    return masks + suffix, 0


def reference_forward_moment(
    ctx: Context, layout: Layout, adapters_on: bool, windows: tuple[int, ...] = ()
) -> LayerMoment:
    """A micro-batch's no-grad pass at its most (``windows``: per layer, as
    :func:`nograd_forward_moment`'s): one forward over m x T tokens, or the shared-prefix
    forward's larger pass: the prefix (the distinct prompts' split columns), or the suffix
    (every row's T - split columns) beside every layer's recorded prefix K and V, the layer's
    copy of them to the rows and the suffix mask."""
    if not ctx.prefix_split:
        return nograd_forward_moment(ctx, layout, ctx.micro_batch, ctx.sequence_tokens, adapters_on, windows=windows)
    split, m = ctx.prefix_split, ctx.micro_batch
    prefix = nograd_forward_moment(ctx, layout, ctx.prefix_rows, split, adapters_on, windows=windows)
    copies = max(2 * prefix_kv_bytes(ctx, i, m) for i in ctx.distinct_layers)  # the copy and the cat's output
    suffix = nograd_forward_moment(
        ctx,
        layout,
        m,
        ctx.sequence_tokens - split,
        adapters_on,
        mask_bytes=suffix_mask_bytes(ctx),
        keys=ctx.sequence_tokens,
        masked=ctx.workload.attn_implementation == "sdpa",
        windows=windows,
    )
    return max(prefix, suffix._replace(activations=suffix.activations + recorded_prefix_bytes(ctx) + copies), key=sum)
