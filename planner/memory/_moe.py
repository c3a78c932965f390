"""Routed experts of mixture-of-experts blocks: the rows an expert chunk computes, what
the experts save for backward, their backward's transients and their no-grad forward's
temporaries.

Two expert codes run (agilerl.distributed._moe): Hugging Face's grouped-GEMM experts over
PEFT's merged expert stacks (unsharded, or FSDP with ep=1 and no chunk size), or the
project's row-wise experts (expert parallel or a chunk size), which dispatch the routed
(token, expert) rows and run each chunk of them checkpointed. Every term was located with
a tensor-level tracker on the tiny Qwen3-MoE and Mixtral (2 and 4 gloo ranks for the
row-wise experts), gpt-oss's gate and biases on its tiny layer; benchmarks/moe_memory.py and
benchmarks/family_memory.py report the measured error.
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


def _gate_widths(ctx: Context, index: int) -> tuple[int, int]:
    """(saved, held without grad) widths per routed row from gate_up's output through the gate,
    gate_up's output (2 x width) included. Counted with saved-tensor hooks and a live-tensor
    tracker on the tiny Qwen3-MoE and gpt-oss (tests/planner/memory/test_moe_layers.py):

    - a SiLU gate keeps gate_up's output and the activation (3) and holds them with the
      product (4);
    - gpt-oss's clamped gate keeps gate_up's output (both clamps read its views), the clamped
      gate, the sigmoid, their product and up + 1 (6), and at once holds gate_up's output, both
      clamps, the product, up + 1 and the gated output (7).
    """
    if ctx.spec.block(index).kind in _CLAMPED_SWIGLU:
        return 6, 7
    return GATED_MLP_SAVED, 4


def _bias_width(ctx: Context, index: int) -> int:
    """Widths per routed row of the gate_up biases Hugging Face's grouped experts gather for
    every row (``gate_up_proj_bias[expert_ids]``: 2 x width, gpt-oss), alive through gate_up
    and the gate; 0 without biases."""
    names = {name for name, _ in ctx.spec.block(index).tensors}
    return 2 if any(n.endswith("experts.gate_up_proj_bias") for n in names) else 0


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
    (:func:`_gate_widths`) and moe_rows_hf x H.

    (With LoRA on the stacks the tiny Qwen3-MoE's layer saves 4 x width + 2 H a row: down's
    input too, because the merged stack takes a gradient. Counting it alone reads the
    checkpointed one-device probes 7% high: the backward's transient, located against the
    count without it, has to be recounted with it.)
    """
    k, p, mlp = ctx.coefficients, ctx.compute_bytes, ctx.spec.block(index).mlp
    moe = routed_experts(ctx, index)
    if moe is None:
        return GATED_MLP_SAVED * mlp.intermediate_size * mlp.experts_per_token * p
    top_k, expert_width = moe
    if ctx.expert_rowwise and ctx.expert_chunk_mib is not None:
        return k.moe_rows_saved * top_k * ctx.hidden_size * p
    gate, _ = _gate_widths(ctx, index)
    return (gate * expert_width + k.moe_rows_hf * ctx.hidden_size) * top_k * p


def expert_forward_grad_transient(ctx: Context, tokens: int, index: int) -> int:
    """What Hugging Face's grouped experts hold beyond their saved tensors at the end of the
    gate in a forward with grad over ``tokens`` tokens (0 for row-wise or no packed experts):
    what the gate holds (:func:`_gate_widths`) less what it saves, the product when the stacks
    are frozen (down does not save it), the gathered biases, and the gathered rows, which
    gate_up saves only when the stacks train."""
    moe = routed_experts(ctx, index)
    if moe is None or ctx.expert_rowwise:
        return 0
    top_k, expert_width = moe
    saved, held = _gate_widths(ctx, index)
    inputs = _stacks_train(ctx, index)
    widths = held - saved - inputs + _bias_width(ctx, index)
    return int(tokens * top_k * (widths * expert_width + (not inputs) * ctx.hidden_size) * ctx.compute_bytes)


def merged_stack_saved_bytes(ctx: Context, layout: Layout, index: int) -> int:
    """PEFT folds LoRA into a copy of the expert stack in the Hugging Face experts, and
    the expert linears save it: the layer's stack in the compute dtype (else 0)."""
    if routed_experts(ctx, index) is None or ctx.expert_rowwise or not ctx.expert_lora[index]:
        return 0
    return layout.expert_stack[index] * ctx.compute_bytes


def _hf_backward_transient(ctx: Context, layout: Layout, rows: int, expert_width: int, index: int) -> int:
    """Hugging Face's grouped GEMMs peak at one of two moments of the backward (located
    with a tracker on the tiny Qwen3-MoE and Mixtral):

    - down's: its input's gradient (rows x width) and, with LoRA on the stacks, the
      gradient of PEFT's merged down stack;
    - the activation product's: its output gradient and its two input gradients
      (3 x rows x width), once down's saved input (rows x width) and its merged
      stack are freed.
    """
    merged_down = layout.expert_down[index] if ctx.expert_lora[index] else 0  # the saved merged copy
    down = rows * expert_width + ctx.coefficients.moe_stack_grad * merged_down
    product = 2 * rows * expert_width - merged_down
    return int(max(down, product) * ctx.compute_bytes)


def _rowwise_backward_transient(ctx: Context, rows: int, expert_width: int, index: int) -> int:
    """Row-wise experts (agilerl.distributed._moe): per token block, the backward peaks at one
    of two moments (each located with a tracker on 2 and 4 gloo ranks):

    - the dispatch: row gradients of the combine, the un-permute (or the all-to-all's
      receive buffer), the regrouping, and the concatenation of the chunks' gradients;
    - a chunk's recompute: the experts of the chunk run one after another, each keeping
      its intermediates for backward (gate_up's output, the activation, the product:
      4 x width per row, and down's output, hidden) while the last one's gate_up is
      made: the base product, the LoRA product and its scaled copy (2 x width each),
      beside the block's row gradient and the chunk's input.
    """
    k, H = ctx.coefficients, ctx.hidden_size
    block_rows = rows / (ctx.fsdp.ep_token_blocks if ctx.fsdp else 1)
    dispatch = (4 + k.moe_dispatch) * block_rows * H
    chunk_rows = expert_chunk_rows(ctx, int(block_rows), expert_width)
    per_expert = min(chunk_rows, block_rows / (ctx.spec.block(index).mlp.num_experts // ctx.ep))
    gate_up_copies = 3 if ctx.expert_lora[index] else 1
    recompute = 2 * block_rows * H + k.moe_chunk * (
        (chunk_rows - per_expert) * (4 * expert_width + H) + gate_up_copies * per_expert * 2 * expert_width
    )
    return int(max(dispatch, recompute) * ctx.compute_bytes)


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
    return _rowwise_backward_transient(ctx, rows, expert_width, index)


def expert_forward_temps(ctx: Context, layout: Layout, batch: int, length: int, index: int, adapters_on: bool) -> float:
    """Peak temporaries of a block's routed experts in a forward without grad over ``batch`` x
    ``length`` tokens (0 for a block without packed experts).

    agilerl.distributed._moe without grad: the dispatched rows and the output buffer, and
    inside a chunk the outputs of its experts so far (then their concatenation) beside one
    expert's intermediates: gate_up's output (three 2 x width products with an active
    adapter on the stacks), or the gate's activation and product (width each) beside it;
    and the block's normed input, which the experts' caller holds until they return.

    Hugging Face's grouped-GEMM experts run every routed row at once: the gathered rows (H)
    and what the gate holds (:func:`_gate_widths`: gate_up's output, the activation and the
    product for a SiLU gate), with the gathered gate_up biases (:func:`_bias_width`); with the
    adapter on the stacks, PEFT's merged stacks beside them (:func:`merged_stack_copies`
    of the stack).
    """
    moe = routed_experts(ctx, index)
    if moe is None:
        return 0
    top_k, expert_width = moe
    H, p = ctx.hidden_size, ctx.compute_bytes
    rows = batch * length * top_k
    merged = adapters_on and ctx.expert_lora[index]
    if not ctx.expert_rowwise:
        stacks = ctx.merged_stack_copies * layout.expert_stack[index] if merged else 0
        _, held = _gate_widths(ctx, index)
        return (rows * ((held + _bias_width(ctx, index)) * expert_width + H) + stacks) * p
    chunk_rows = expert_chunk_rows(ctx, rows, expert_width)
    per_expert = min(chunk_rows, rows / max(1, ctx.spec.block(index).mlp.num_experts // ctx.ep))
    gate_up = (3 if merged else 1) * 2 * expert_width
    one_expert = per_expert * (max(gate_up, 4 * expert_width) + H)
    in_chunk = max(2 * chunk_rows * H, (chunk_rows - per_expert) * H + one_expert)
    return (2 * rows * H + in_chunk + batch * length * H) * p
