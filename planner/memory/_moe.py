"""Routed experts of mixture-of-experts blocks: the rows an expert chunk computes, what
the experts save for backward, their backward's transients and their no-grad forward's
temporaries.

Two expert codes run (agilerl.distributed._moe): Hugging Face's grouped-GEMM experts over
PEFT's merged expert stacks (unsharded, or FSDP with ep=1 and no chunk size), or the
project's row-wise experts (expert parallel or a chunk size), which dispatch the routed
(token, expert) rows and run each chunk of them checkpointed. Every term is counted op by op
and checked against real tiny layers (tests/planner/memory/test_moe_layers.py: Qwen3-MoE with
either code, gpt-oss's gate and biases), with FSDP2's tracker on 2 and 4 gloo ranks for the
row-wise experts' dispatch; benchmarks/moe_memory.py and benchmarks/family_memory.py report
the measured error.
"""

from __future__ import annotations

from agilerl.distributed import expert_chunk_rows as chunk_rows
from agilerl.distributed import expert_row_bytes

from ._context import Context
from ._units import Layout

#: Widths a gated MLP saves per row: the gate's output, the activation's and up's (planner.memory._tape).
GATED_MLP_SAVED = 3

#: Layers whose experts gate with gpt-oss's clamped SwiGLU (``GptOssExperts._apply_gate``): gate
#: and up are clamped, the gate goes through a scaled sigmoid and up is shifted by one.
_CLAMPED_SWIGLU = ("GptOssDecoderLayer",)


def _gate_widths(ctx: Context, index: int) -> tuple[int, int, int]:
    """(saved, held with grad, held without grad) widths per routed row from gate_up's output
    through the gate, gate_up's output (2 x width) included. Counted with saved-tensor hooks
    and a live-tensor tracker on the tiny Qwen3-MoE and gpt-oss
    (tests/planner/memory/test_moe_layers.py):

    - a SiLU gate keeps gate_up's output and the activation (3) and holds them with the
      product (4);
    - gpt-oss's clamped gate keeps gate_up's output (both clamps read its views), the clamped
      gate, the sigmoid, their product and up + 1 (6); as the gated output is made it holds
      those, the clamped up (still bound to a name) and the output (8), and without grad the
      same less the sigmoid, freed once used (7).
    """
    if ctx.spec.block(index).kind in _CLAMPED_SWIGLU:
        return 6, 8, 7
    return GATED_MLP_SAVED, 4, 4


def _bias_width(ctx: Context, index: int) -> int:
    """Widths per routed row of the gate_up biases Hugging Face's grouped experts gather for
    every row (``gate_up_proj_bias[expert_ids]``: 2 x width, gpt-oss), alive through gate_up
    and the gate; 0 without biases."""
    return 2 if ctx.expert_biases[index] else 0


def _down_bias_width(ctx: Context, index: int) -> int:
    """Hidden widths per routed row of the down biases Hugging Face's grouped experts gather
    (``down_proj_bias[expert_ids]``: H, gpt-oss), bound by name through the combine; 0 without."""
    return 1 if ctx.expert_biases[index] else 0


def _routing_bytes(ctx: Context, tokens: float, index: int, *, grad: bool) -> float:
    """What the routing of Hugging Face's grouped experts holds through their combine over
    ``tokens`` tokens, beyond what it saves: per token the router's logits (E x p, bound by the
    block until it returns); per routed row the sorted expert ids and the inverse permutation
    (int64) and the top-k weight (p), and without grad, where nothing is saved, also the top-k
    choice and the permutation (int64) and the weight's sorted copy (p). Counted on the tiny
    OLMoE (tests/planner/memory/test_moe_layers.py); a fraction of a percent of the combine on
    real widths."""
    p, mlp = ctx.compute_bytes, ctx.spec.block(index).mlp
    per_row = 2 * 8 + p + (0 if grad else 2 * 8 + p)
    return tokens * (mlp.num_experts * p + max(1, mlp.experts_per_token) * per_row)


def _stacks_train(ctx: Context, index: int) -> bool:
    """The expert stacks take gradients (LoRA on them, or full fine-tuning): their grouped
    GEMMs then save their inputs."""
    return ctx.expert_lora[index] or ctx.full_finetune


def routed_experts(ctx: Context, index: int) -> tuple[int, int] | None:
    """(experts per token, expert width) of a block with packed routed experts, else None."""
    mlp = ctx.spec.block(index).mlp
    if mlp.kind != "moe" or not ctx.packed[index]:
        return None
    return max(1, mlp.experts_per_token), mlp.intermediate_size


def expert_chunk_rows(ctx: Context, rows: int, width: int) -> int:
    """Rows one expert chunk computes at once (agilerl.distributed.expert_chunk_rows):
    min(rows, chunk_mib MiB // (max(2 width, H) p)), all of them without a chunk size."""
    row_bytes = expert_row_bytes(expert_width=width, hidden_size=ctx.hidden_size, element_size=ctx.compute_bytes)
    chunk = chunk_rows(chunk_mib=ctx.expert_chunk_mib, row_bytes=row_bytes)
    return rows if chunk is None else min(rows, chunk)


def router_saved_per_token(ctx: Context, index: int) -> int:
    """Bytes per token a MoE block's router saves for backward.

    The router saves its input (the normed MLP input), its fp32 scores and the top-k (counted with saved-tensor hooks:
    1.12 and 1.10 hidden-sized tensors per token on the tiny Mixtral and Qwen3-MoE).
    """
    mlp = ctx.spec.block(index).mlp
    routed_input = ctx.hidden_size * ctx.compute_bytes if routed_experts(ctx, index) is not None else 0
    return routed_input + (mlp.num_experts + 3 * mlp.experts_per_token) * 4


def experts_saved_per_token(ctx: Context, index: int) -> float:
    """Bytes per token a MoE block's experts save for backward.

    Unpacked experts: the active ones, like a dense gated MLP (the gate's, the
    activation's and up's outputs: 3 x width x top-k).
    Row-wise experts with a chunk size: each chunk is checkpointed, so only the
    dispatched rows and the combine's inputs stay (moe_rows_saved x H per row).
    Otherwise (Hugging Face's grouped experts) every routed row saves its gate's widths
    (:func:`_gate_widths`) and the weighted output's input (H), and when the stacks take a
    gradient (LoRA on them, merged by PEFT into copies, or full fine-tuning) gate_up's input
    (the gathered row, H) and down's (its input, width) too: 4 x width + 2 H a row with a
    SiLU gate (saved-tensor hooks on the tiny Qwen3-MoE, tests/planner/memory/test_moe_layers.py).
    """
    k, p, mlp = ctx.coefficients, ctx.compute_bytes, ctx.spec.block(index).mlp
    moe = routed_experts(ctx, index)
    if moe is None:
        return GATED_MLP_SAVED * mlp.intermediate_size * mlp.experts_per_token * p
    top_k, expert_width = moe
    if ctx.expert_rowwise and ctx.expert_chunk_mib is not None:
        return k.moe_rows_saved * top_k * ctx.hidden_size * p
    gate, _, _ = _gate_widths(ctx, index)
    train = _stacks_train(ctx, index)
    return ((gate + train) * expert_width + (1 + train) * ctx.hidden_size) * top_k * p


def expert_forward_grad_transient(ctx: Context, tokens: int, index: int) -> int:
    """What a block's routed experts hold beyond its saved tensors at their peak in a forward with
    grad over ``tokens`` tokens (0 without packed experts).

    Hugging Face's grouped experts peak at one of two moments, beside their routing
    (:func:`_routing_bytes`):

    - the end of the gate: the gathered rows and biases and what the gate holds
      (:func:`_gate_widths`), less what the experts save (:func:`experts_saved_per_token`),
      which counts the weighted output (H) not made yet and, when the stacks train, the
      product down saves;
    - the combine's un-permute: the weighted output and its un-permuted copy (H each, the
      first freed only once the second is bound to its name) beside the gathered rows, which
      the experts' function keeps bound until it returns (H, saved when the stacks train),
      and gpt-oss's gathered down biases (H): 3 H a row beyond the saved tensors with frozen
      stacks. With an expert width under 2 H (OLMoE: 1,024 for H = 2,048) this is the larger,
      by 80 KB a token on OLMoE; located with a live-tensor tracker on the tiny OLMoE
      (tests/planner/memory/test_moe_layers.py).

    Row-wise experts (agilerl.distributed._moe), in a token block's last chunk: the chunks'
    checkpoints keep nothing of their forward, so beside the dispatched rows (saved) the block
    holds the earlier chunks' outputs ((rows - chunk) x H) and the chunk's own forward
    (:func:`_chunk_forward`), and the combine's input, which the saved count includes, is not
    made yet (rows x H): in all the chunk's forward less chunk x H; or the combine
    (:func:`_combine_forward`). Located with a live-tensor tracker on the tiny Qwen3-MoE
    (tests/planner/memory/test_moe_layers.py). Under expert parallel with several token blocks
    the next block's dispatch runs beside a block's experts, its sent and received rows
    (2 x rows x H) in flight: with balanced routing, as much as the block saves for its backward
    (``moe_rows_saved``), so the last block's moment, counted here, is about the earlier ones'
    (a 2-block probe reads learn as before: tests/planner/probe/test_probe.py). Routing that
    sends the next block more rows, or a checkpointed MoE block (whose forward saves nothing
    inside), holds up to those 2 x rows x H more; not counted.
    """
    moe = routed_experts(ctx, index)
    if moe is None:
        return 0
    top_k, expert_width = moe
    if ctx.expert_rowwise:
        rows = int(tokens * top_k / (ctx.fsdp.ep_token_blocks if ctx.fsdp else 1))
        chunk, in_chunk = _chunk_forward(ctx, rows, expert_width, index, merged=ctx.expert_lora[index])
        in_chunks = (in_chunk - chunk * ctx.hidden_size) * ctx.compute_bytes
        return int(max(in_chunks, _combine_forward(ctx, rows, top_k)))
    saved, held, _ = _gate_widths(ctx, index)
    train = _stacks_train(ctx, index)
    gate = (held - saved - train + _bias_width(ctx, index)) * expert_width - train * ctx.hidden_size
    combine = (3 - train + _down_bias_width(ctx, index)) * ctx.hidden_size
    rows = tokens * top_k * max(gate, combine) * ctx.compute_bytes
    return int(rows + _routing_bytes(ctx, tokens, index, grad=True))


def _rows_per_expert(ctx: Context, rows: float, chunk: int, index: int) -> float:
    """Rows one expert computes in a chunk: the rank's rows shared evenly by its local experts
    (the count takes routing as balanced), at most a chunk."""
    return min(chunk, rows / max(1, ctx.spec.block(index).mlp.num_experts // ctx.ep))


def _chunk_forward(ctx: Context, rows: int, expert_width: int, index: int, *, merged: bool) -> tuple[int, float]:
    """(rows of one chunk, the most its forward holds, in elements) for the row-wise experts over
    ``rows`` dispatched rows: the outputs of the chunk's experts so far (then their
    concatenation) beside one expert's intermediates, gate_up's output (three 2 x width
    products with an active adapter on the stacks: the base's, the adapter's and its scaled
    copy) beside the previous expert's product (width), or the gate's activation and product
    (width each) beside it."""
    H = ctx.hidden_size
    chunk_rows = expert_chunk_rows(ctx, rows, expert_width)
    per_expert = _rows_per_expert(ctx, rows, chunk_rows, index)
    # gate_up's output is made while the previous expert's product is still bound (and alive)
    previous = expert_width if chunk_rows > per_expert else 0
    gate_up = (3 if merged else 1) * 2 * expert_width + previous
    one_expert = per_expert * (max(gate_up, 4 * expert_width) + H)
    return chunk_rows, max(2 * chunk_rows * H, (chunk_rows - per_expert) * H + one_expert)


def _factor_casts(ctx: Context, layout: Layout, index: int) -> float:
    """Elements of the active adapter's expert factors cast to the stacks' dtype for PEFT's fold
    (held by its parametrization while the experts run; 0 when the adapters are in that dtype)."""
    cast = ctx.adapter_compute_bytes != ctx.compute_bytes
    return layout.expert_adapters[index] / ctx.num_adapters if cast else 0


def merged_stack_saved_bytes(ctx: Context, layout: Layout, index: int) -> int:
    """PEFT folds LoRA into a copy of the expert stack in the Hugging Face experts, and
    the expert linears save it: the layer's stack in the compute dtype (else 0). The fold's
    batched product saves the adapters' factors cast to the stack's dtype: copies when the
    adapters are in another (PEFT's fp32 on a bf16 base)."""
    if routed_experts(ctx, index) is None or ctx.expert_rowwise or not ctx.expert_lora[index]:
        return 0
    return int((layout.expert_stack[index] + _factor_casts(ctx, layout, index)) * ctx.compute_bytes)


def _hf_backward_transient(ctx: Context, layout: Layout, rows: int, expert_width: int, index: int) -> int:
    """Hugging Face's grouped experts peak at one of three moments of the backward (located
    with a tracker on the tiny Qwen3-MoE, Mixtral and OLMoE):

    - the un-permute's: the weighted output's gradient (the sum's, made contiguous), and the
      zero-filled rows and their copy the index's backward accumulates into (3 x rows x H);
    - down's: its input's gradient (rows x width) and, with LoRA on the stacks, the
      gradient of PEFT's merged down stack;
    - the activation product's: its output gradient and its two input gradients
      (3 x rows x width), once the weighted output's input (rows x H), down's saved input
      (rows x width, saved when the stacks train) and its merged stack are freed.
    """
    merged_down = layout.expert_down[index] if ctx.expert_lora[index] else 0  # the saved merged copy
    down = rows * expert_width + ctx.coefficients.moe_stack_grad * merged_down
    product = (3 - _stacks_train(ctx, index)) * rows * expert_width - rows * ctx.hidden_size - merged_down
    combine = 3 * rows * ctx.hidden_size
    return int(max(down, product, combine) * ctx.compute_bytes)


def _combine_parts(ctx: Context, tokens: float, top_k: int) -> tuple[float, bool]:
    """(rows of one part, whether there are several) of a token block's combine: parts of at
    most ``routed_expert_chunk_mib`` MiB of fp32 rows (agilerl.distributed._moe._combine_block)."""
    part_tokens = chunk_rows(chunk_mib=ctx.expert_chunk_mib, row_bytes=top_k * ctx.hidden_size * 4)
    part = min(tokens, part_tokens or tokens)
    return part * top_k, part < tokens


def _combine_forward(ctx: Context, block_rows: float, top_k: int) -> float:
    """Bytes beyond a token block's saved tensors (its rows, saved by the combine) while the
    combine runs in a forward with grad: a part's rows in fp32 (a copy unless the compute
    dtype is fp32) beside the fp32 outputs (tokens x H x 4; twice while the parts are
    concatenated), then the fp32 output beside its cast to the compute dtype."""
    H, p = ctx.hidden_size, ctx.compute_bytes
    tokens = block_rows / top_k
    part_rows, several = _combine_parts(ctx, tokens, top_k)
    upcast = part_rows * H * 4 if p != 4 else 0
    outputs = tokens * H * 4 * (2 if several else 1)
    return max(upcast + tokens * H * 4, outputs, tokens * H * (4 + p))


def _combine_backward(ctx: Context, block_rows: float, top_k: int) -> float:
    """Bytes beyond a token block's saved tensors while its rows' gradients are made
    (agilerl.distributed._moe._WeightedCombine, in fp32, in parts of at most
    ``routed_expert_chunk_mib`` MiB of fp32 rows): the output's fp32 gradient (tokens x H x 4),
    the parts' row gradients made so far, and the last part's fp32 product beside its cast
    to the compute dtype; then, once the combine's input is freed, two row-sized buffers at
    each step back to the chunks (the un-permute's, the all-to-all's, the split's concatenation)."""
    H, p = ctx.hidden_size, ctx.compute_bytes
    tokens = block_rows / top_k
    part_rows, _ = _combine_parts(ctx, tokens, top_k)
    cast = p if p != 4 else 0  # the product's cast to the compute dtype (none in fp32)
    last_part = tokens * H * 4 + (block_rows - part_rows) * H * p + part_rows * H * (4 + cast)
    return max(last_part, 2 * block_rows * H * p)


def _rowwise_backward_transient(ctx: Context, layout: Layout, rows: int, expert_width: int, index: int) -> int:
    """Row-wise experts (agilerl.distributed._moe): beyond the block's saved tensors, per token
    block, the backward peaks at one of three moments (located with a live-tensor tracker on the
    tiny Qwen3-MoE, one rank, and with FSDP2's tracker on 2 and 4 gloo ranks):

    - the dispatch (:func:`_combine_backward`);
    - a chunk's recompute: the experts of the chunk run one after another, each keeping its
      intermediates for backward (gate_up's output, the activation, the product: 4 x width
      per row, and down's output, hidden) while the last one's gate_up is made (its base
      product, the adapter's and its scaled copy: 2 x width each), beside the later chunks'
      input gradients ((rows - chunk) x H) and the gradients of the experts' adapters, which
      each expert's backward adds to (the whole stack of each factor). The rows' gradient
      from the combine (rows x H) has taken the place of the combine's saved input, freed by
      its backward;
    - an expert's backward at its adapters' factors, read as slices of the stacks: a factor's
      gradient is a zero-filled stack added to the sum so far into a new one (two of the
      largest factor), beside the earlier experts' intermediates, the expert's gate_up
      gradient (2 x width per row) and the later chunks' input gradients.

    The chunk's count takes the experts' rows as balanced (rows / local experts each); a
    router that sends one expert more than a chunk's share holds more (a tiny random router:
    up to 8% of the learn peak, benchmarks/moe_memory.py).
    """
    k, H, p = ctx.coefficients, ctx.hidden_size, ctx.compute_bytes
    block_rows = rows / (ctx.fsdp.ep_token_blocks if ctx.fsdp else 1)
    top_k = max(1, ctx.spec.block(index).mlp.experts_per_token)
    dispatch = _combine_backward(ctx, block_rows, top_k) + k.moe_dispatch * block_rows * H * p
    chunk = expert_chunk_rows(ctx, int(block_rows), expert_width)
    per_expert = _rows_per_expert(ctx, block_rows, chunk, index)
    gate_up_copies = 3 if ctx.expert_lora[index] else 1
    # the adapters' gradients, summed over the experts' backward: whole once a chunk's backward is done
    adapter_grads = layout.expert_adapters[index] / ctx.num_adapters if ctx.expert_lora[index] else 0
    later = (block_rows - chunk) * H
    recompute = (
        later
        + (adapter_grads if chunk < block_rows else 0)
        + k.moe_chunk * ((chunk - per_expert) * (4 * expert_width + H) + gate_up_copies * per_expert * 2 * expert_width)
    )
    # an expert's backward reaches its adapters' factors: each is a slice of the stack, so its gradient is
    # a zero-filled stack, added to the sum so far into a new one, beside the intermediates the chunk's
    # earlier experts still keep (once there is a sum: after an earlier chunk, else from the second expert)
    factor = 2 * layout.expert_adapter_factor[index] if ctx.expert_lora[index] else 0
    earlier = chunk - per_expert if chunk < block_rows else max(0.0, chunk - 2 * per_expert)
    reaching = later + adapter_grads + factor + earlier * 4 * expert_width + per_expert * 2 * expert_width
    return int(max(dispatch, max(recompute, reaching) * p))


def backward_transient_bytes(ctx: Context, layout: Layout, batch: int, index: int) -> int:
    """What a MoE block's backward allocates beyond its saved tensors (0 for a dense block)
    over ``batch`` x T tokens."""
    moe = routed_experts(ctx, index)
    if moe is None:
        return 0
    top_k, expert_width = moe
    rows = batch * ctx.sequence_tokens * top_k
    if not ctx.expert_rowwise:
        return _hf_backward_transient(ctx, layout, rows, expert_width, index)
    return _rowwise_backward_transient(ctx, layout, rows, expert_width, index)


def expert_forward_temps(ctx: Context, layout: Layout, batch: int, length: int, index: int, adapters_on: bool) -> float:
    """Peak temporaries of a block's routed experts in a forward without grad over ``batch`` x
    ``length`` tokens (0 for a block without packed experts).

    agilerl.distributed._moe without grad: the dispatched rows, the output buffer when there
    are several chunks, and one chunk's forward (:func:`_chunk_forward`); or the combine
    (:func:`_combine_forward`) beside the un-permuted rows, once the dispatched ones are
    freed; and the block's normed input, which the experts' caller holds until they return.

    Hugging Face's grouped-GEMM experts run every routed row at once, and hold the most at
    the end of the gate: the gathered rows (H) and what the gate holds (:func:`_gate_widths`:
    gate_up's output, the activation and the product for a SiLU gate), with the gathered
    gate_up biases (:func:`_bias_width`); or at the combine's un-permute: the gathered rows,
    down's output, the weighted output and its un-permuted copy (4 H a row, and gpt-oss's
    gathered down biases); and the routing (:func:`_routing_bytes`). With the adapter on the
    stacks PEFT folds it into merged stacks as each is first read (gate_up's at the gate, down's
    at down) and torch's parametrization cache keeps them until the experts return, beside the
    factors' casts (:func:`_factor_casts`): gate_up's merged stack at the gate's end, the whole
    stack at the combine (:func:`merged_stack_copies` of it). Located with a live-tensor
    tracker on the tiny OLMoE and Qwen3-MoE (tests/planner/memory/test_moe_layers.py).
    """
    moe = routed_experts(ctx, index)
    if moe is None:
        return 0
    top_k, expert_width = moe
    H, p = ctx.hidden_size, ctx.compute_bytes
    rows = batch * length * top_k
    merged = adapters_on and ctx.expert_lora[index]
    if not ctx.expert_rowwise:
        _, _, held = _gate_widths(ctx, index)
        gate: float = rows * ((held + _bias_width(ctx, index)) * expert_width + H)
        combine: float = rows * (4 + _down_bias_width(ctx, index)) * H
        casts = 0.0
        if merged:  # gate_up's merged stack from the gate on, down's from down on (parametrize's cache keeps both)
            casts = _factor_casts(ctx, layout, index)
            gate += ctx.merged_stack_copies * (layout.expert_stack[index] - layout.expert_down[index])
            combine += ctx.merged_stack_copies * layout.expert_stack[index]
        return (max(gate, combine) + casts) * p + _routing_bytes(ctx, batch * length, index, grad=False)
    chunk, in_chunk = _chunk_forward(ctx, rows, expert_width, index, merged=merged)
    buffers = 2 if chunk < rows else 1  # one chunk's output is the experts' output, else a buffer takes the chunks'
    chunks = (buffers * rows * H + in_chunk) * p
    combine = rows * H * p + _combine_forward(ctx, rows, top_k)  # the un-permuted rows, the dispatched ones freed
    return max(chunks, combine) + batch * length * H * p
