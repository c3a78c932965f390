"""One block's activations, counted op by op as the trainer's code runs them.

A transformer block of the trainer is Hugging Face's decoder layer with PEFT's LoRA
linears. Its memory is a sequence of moments: each op saves some tensors for backward,
keeps some alive for the next ops, and allocates temporaries. :func:`block_tape`
walks that sequence once per block type and returns, per token, what the block saves
for backward and the most it holds at any moment of its forward with grad (or its
recompute), of its backward, and of a forward without grad. Every term below was
counted with saved-tensor hooks and a live-tensor tracker (a TorchDispatchMode with
storage finalizers) on tiny Qwen2 and Llama models in bf16 with fp32 adapters and in
fp32, 1k to 16k tokens per micro-batch, SDPA; the counted totals match to the byte
for saved tensors and within 1% for the moments (benchmarks/activation_census.py).

What the code keeps, with ``p`` the compute dtype's bytes and ``a`` the adapters'
(PEFT keeps LoRA in fp32 on a bf16 base, ``autocast_adapter_dtype``):

- an RMSNorm upcasts its input to fp32 and saves it and the reciprocal RMS: 4 H + 4
  (a head norm, Qwen3's q_norm / k_norm, the same over q or k);
- a LoRA linear casts its input to the adapter dtype when the two differ and lora_A
  saves that copy (``a x in``: one copy per adapted linear, q, k and v each make
  their own); with equal dtypes lora_A saves the input itself, once per input;
  lora_A's output (``a x r``) is saved by lora_B; the frozen base saves nothing;
- under torch.autocast (``autocast``, a trainer other than this one) lora_A casts that
  fp32 copy back to the compute dtype and saves the cast (``p x in``; the fp32 copy
  lives only while the linear runs), its output and lora_B's are in the compute dtype,
  and it saves compute-dtype copies of the adapter weights (per layer, not per token,
  so not on this tape);
- the LoRA forward's peak: the base output, lora_B's output and its scaled copy
  (``out x (p + 2a)``), which the sum with the base output promotes to fp32;
- SDPA saves the rotated q and k, v, its output and a log-sum-exp per head; its
  output is o_proj's input as a view, not a copy;
- LoRA dropout above 0, in a forward with grad (the learn forward and its recompute; the
  no-grad passes run in eval mode, without it): lora_A saves the dropped copy (``a x in``)
  instead of the input or its cast, and dropout what its backward reads per element
  (``dropout_bytes``): on CUDA a one-byte mask (``native_dropout``); on CPU, where
  ``torch.dropout`` multiplies by a scaled noise tensor, that noise (``a x in``). Each adapted
  linear makes its own, so with equal dtypes the one shared input is no longer what is saved,
  and the cast copy stays alive while the linear runs (PEFT rebinds its input to it);
- a gated MLP saves the gate's output (the activation's input), the activation's
  output and up's output (the product's inputs): 3 x width x p;
- the block's input stays referenced by the caller while the block runs, and the
  residual stream after attention until the block returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..spec import BlockSpec

ADAPTER_BYTES = 4  # PEFT's LoRA weights (and its casts of their inputs) are fp32

_ATTENTION_MODULES = ("self_attn", "attn", "attention", "self_attention")
_MLP_MODULES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
_ATTN_OUT = ("o_proj", "out_proj", "dense", "c_proj", "wo")
_MLP_OUT = ("down_proj", "fc2", "w2", "c_proj", "wo")
_GATES = ("gate_proj", "gate_up_proj", "w1", "w3")


@dataclass(frozen=True, slots=True)
class Linear:
    """One linear of a block as the tape sees it: widths on this rank, adapted or not."""

    name: str
    in_features: float
    out_features: float
    adapted: bool


@dataclass(frozen=True, slots=True)
class BlockTape:
    """Per token of a micro-batch, bytes of one block (see the module docstring).

    ``saved``: kept for backward after the block's forward with grad.
    ``grad_peak``: the most alive during its forward with grad beyond the block's input,
    the saved tensors so far included (in fp32 the input norm saves the input itself,
    which is then counted here).
    ``recompute_peak``: the same during a checkpointed block's recompute in backward,
    which stops at the op that saves the last tensor backward needs (torch's
    non-reentrant checkpoint stops early): down's lora_A with an adapted down, else the
    MLP's product.
    ``backward_peak``: the most alive during its backward beyond the input, every
    saved tensor included, besides the gradients flowing in.
    ``nograd_peak`` / ``nograd_peak_base``: the most alive during a forward without
    grad beyond the input, with the adapters on / disabled.
    ``attention_live``: without grad, what the attention holds while its scores are
    made (the normed input, q, k, v): eager attention's scores add to this moment only.
    ``attention_grad_live`` / ``attention_backward_live``: the same moment with grad (what the
    block saved so far, its normed input unless saved, and under grouped-query attention the
    rotated k and v beside their repeated copies) and in backward, at the softmax's (what the
    block saved up to its scores): eager attention's scores add to these.
    ``nograd_parts`` / ``nograd_parts_base``: ``nograd_peak`` (``_base``) split into the most
    of the attention's moments and the most of the MLP's, which a layer holding more beside
    each (Gemma-3n's AltUp) needs apart.
    ``masked_kv``: what SDPA given a mask adds under grouped-query attention. Hugging Face
    then repeats K and V to every query head before the call (``use_gqa_in_sdpa``: no GQA
    kernel with a mask), so the repeated copies, q-wide, are what SDPA saves (with grad:
    2 (q - kv) x p more than the tape's K and V) and hold beside the originals (without grad:
    2 q x p). 0 without GQA. Counted with a live-tensor tracker on the padded and the
    shared-prefix forwards (benchmarks/padded_memory.py, benchmarks/prefix_memory.py).
    """

    saved: float
    grad_peak: float
    recompute_peak: float
    backward_peak: float
    nograd_peak: float
    nograd_peak_base: float
    attention_live: float
    attention_grad_live: float = 0.0
    attention_backward_live: float = 0.0
    nograd_parts: tuple[float, float] = (0.0, 0.0)
    nograd_parts_base: tuple[float, float] = (0.0, 0.0)
    masked_kv_saved: float = 0.0
    masked_kv_nograd: float = 0.0
    # the backward at the MLP's product (within backward_peak), by when a trained MLP output
    # linear's weight gradient is made: ``backward_weight_grad``, bytes a block (not a token) in
    # the compute dtype, 0 without full fine-tuning
    backward_product: float = 0.0
    backward_weight_grad: float = 0.0


def _role(path: str) -> str | None:
    """Which part of the block a linear belongs to: attention or MLP, in or out."""
    parts = path.split(".")
    module = parts[-1]
    scope = parts[0] if len(parts) > 1 else ""
    if scope in _ATTENTION_MODULES:
        return "attn_out" if module in _ATTN_OUT else "attn_in"
    if scope in _MLP_MODULES:
        return "mlp_out" if module in _MLP_OUT else "mlp_in"
    return None


def block_linears(
    block: BlockSpec, adapted: frozenset[str], *, tp: int = 1, mlp_tp: int = 1
) -> dict[str, list[Linear]]:
    """The block's linears by role (attn_in, attn_out, mlp_in, mlp_out), widths per TP rank.

    Tensor parallelism splits the outputs of q, k, v, gate and up and the inputs of o and
    down (agilerl.distributed's block plan), so every width but the hidden stream's is
    divided by it.
    """
    out: dict[str, list[Linear]] = {"attn_in": [], "attn_out": [], "mlp_in": [], "mlp_out": []}
    for path, d_in, d_out in block.linears:
        role = _role(path)
        if role is None:
            continue
        split = tp if role.startswith("attn") else mlp_tp
        width_in, width_out = (d_in, d_out / split) if role.endswith("_in") else (d_in / split, d_out)
        out[role].append(Linear(path, width_in, width_out, path in adapted))
    return out


#: Decoder layers whose attention also normalises v per head, with a norm that has no weight
#: (``v_norm``, ``with_scale=False``), so the block's tensors do not show it.
_WEIGHTLESS_VALUE_NORM = ("Gemma3nTextDecoderLayer", "Gemma4TextDecoderLayer")

#: Decoder layers whose MLP binds the gate's, the activation's and up's outputs to names
#: (Gemma3nTextMLP: ``gate_proj``, ``activations``, ``up_proj``), which Python keeps until it
#: returns: a forward without grad holds them beside the product and down's transient.
_MLP_NAMES_ITS_OUTPUTS = ("Gemma3nTextDecoderLayer",)


def _norms(block: BlockSpec, hidden: int) -> tuple[int, int, float, frozenset[str]]:
    """(RMSNorms over the hidden stream, those after the MLP (Gemma's post_feedforward),
    widths of the head norms' inputs, the projections they norm: "q", "k", and "v" under a
    weightless v norm, which the block's tensors do not show)."""
    hidden_norms, after_mlp, head_width = 0, 0, 0.0
    normed: set[str] = set()
    att = block.attention
    for name, shape in block.tensors:
        leaf = name.rsplit(".", 1)
        if len(leaf) < 2 or leaf[1] != "weight" or "norm" not in leaf[0].rsplit(".", 1)[-1] or len(shape) != 1:
            continue
        module = leaf[0].rsplit(".", 1)[-1]
        if shape[0] == hidden and not module.startswith(("q_", "k_")):
            hidden_norms += 1
            after_mlp += module.startswith("post_feedforward")
        elif module.startswith("q_"):
            head_width += att.q_dim
            normed.add("q")
        elif module.startswith("k_"):
            head_width += att.kv_dim
            normed.add("k")
    if block.kind in _WEIGHTLESS_VALUE_NORM:
        normed.add("v")
    return hidden_norms, after_mlp, head_width, frozenset(normed)


def _lora_transient(lin: Linear, p: int, a: int, adapters_on: bool, full: bool = False) -> float:
    """Bytes a linear allocates at its peak beyond its input: out x (p + 2a) for an active
    adapter (base output, lora_B's output and its scaled copy), out x p for the base alone
    (a trained linear of full fine-tuning included: it has no adapter)."""
    if lin.adapted and adapters_on and not full:
        return lin.out_features * (p + 2 * a) if a != p else lin.out_features * 3 * p
    return lin.out_features * p


def _attention_moments(
    lin: dict[str, list[Linear]],
    terms: AdapterTerms,
    grad: list[float],
    nograd: list[float],
    nograd_base: list[float],
    *,
    p: float,
    H: float,
    rank_bytes: float,
    cast: bool,
    full: bool,
    q: float,
    kv: float,
    heads: float,
    head_width: float,
    norm_saved: float,
    eager: bool,
    dropped: bool,
    head_normed: frozenset[str] = frozenset(),
) -> tuple[float, float, float, float, tuple[float, float]]:
    """The attention half of :func:`block_tape`: appends its moments to ``grad``, ``nograd`` and
    ``nograd_base``; returns what it saved, the normed input, that input as held in a forward with
    grad (0 when saved), the attention's locals alive without grad, and what the block holds while
    eager attention makes its scores, with grad and in backward (:class:`BlockTape`). ``rank_bytes``: one
    token's lora_A output (rank x the adapters' dtype). ``kv``: the width of the layer's own K (and
    V), 0 for a layer reading an earlier layer's (Gemma-3n's and Gemma 4's K/V sharing), which SDPA
    saves and holds without a byte of this layer's: they are counted where they are made
    (planner.memory._activations.shared_kv_moments). ``head_normed``: the projections (q_proj,
    k_proj, v_proj: "q", "k", "v") whose output a norm reads, which without grad holds two fp32
    copies of it at a time: the upcast and its square, then the normalised one and its product
    with the weight (Qwen3's, OLMo 2's and Gemma's RMSNorm; traced op by op on a tiny Gemma 4,
    whose global layers' q is twice the hidden width, where it is the reference pass's peak)."""
    transient, cast_copy, cast_live, grad_live = terms
    saved = 0.0
    # -- attention --------------------------------------------------------------------------
    # input norm: fp32 upcast (saved) and its square's temporary, the bf16 output
    saved += norm_saved
    grad.append(saved + 4 * H + H * p)
    nograd.append((4 * H if p != 4 else 0) + 4 * H + H * p)  # the upcast (a no-op in fp32), its square
    nograd_base.append(nograd[-1])
    normed = H * p  # the normed input, alive through the attention's input projections
    held_normed = normed  # the same in a forward with grad, unless it is saved
    outputs = 0.0
    for x in lin["attn_in"]:
        grad.append(saved + normed + outputs + grad_live(x, H) + transient(x, True))
        nograd.append(normed + outputs + cast_live(x, H) + transient(x, True))
        nograd_base.append(normed + outputs + transient(x, False))
        saved += cast_copy(x, H) + (rank_bytes if x.adapted else 0)
        outputs += x.out_features * p
        if x.name.rsplit(".", 1)[-1] in {f"{h}_proj" for h in head_normed}:
            nograd.append(normed + outputs + 8 * x.out_features)
            nograd_base.append(nograd[-1])
    if not cast and not dropped and any(x.adapted for x in lin["attn_in"]):
        saved += p * H  # lora_A of q, k and v save the one normed input
        held_normed = 0.0  # which is then counted as saved
    saved += (4 + (p if full else 0)) * head_width + 4 * heads * (1 if head_width else 0)
    if "v" in head_normed:  # a weightless v norm: its fp32 upcast (its reciprocal RMS is in the heads' term)
        saved += 4 * kv
    if eager:  # q, and K and V repeated to every query head (repeat_kv): its two matmuls' inputs
        saved += 3 * q * p
    else:  # rotary embeddings, then SDPA saves q, k (rotated), v, its output and a log-sum-exp per head
        saved += 2 * q * p + 2 * kv * p + 4 * heads
    # Without grad the attention's locals (rotated q and k, v, the output) live until it returns,
    # as does its argument, the normed input.
    attention_locals = (2 * q + 2 * kv) * p
    # at eager attention's scores: with grad the rotated k and v beside their repeated copies (the
    # same tensors without GQA); in backward what was saved up to them
    at_scores = (saved + held_normed + (2 * kv * p if q > kv else 0.0), saved)
    for x in lin["attn_out"]:
        grad.append(saved + held_normed + grad_live(x, q) + transient(x, True))
        nograd.append(normed + attention_locals + cast_live(x, q) + transient(x, True))
        nograd_base.append(normed + attention_locals + transient(x, False))
        # the SDPA output is o's input as a view: with equal dtypes lora_A saves nothing new; eager
        # attention's output is transposed into a new tensor, which it then saves
        own_copy = p * q if eager and x.adapted and not cast and not dropped else 0.0
        saved += cast_copy(x, q) + (rank_bytes if x.adapted else 0) + own_copy
    return saved, normed, held_normed, attention_locals, at_scores


def _input_saved(
    block: BlockSpec, path: str, adapted: frozenset[str], *, rank: int, p: int, a: int, dropout: float = 0.0
) -> float:
    """What an adapted (or trained) linear of ``block`` outside the attention and the MLP saves
    per token: its input, a PEFT cast copy when the adapters' dtype differs (a x in) or the
    tensor itself (p x in), or with LoRA dropout the dropped copy and what dropout keeps
    ((a + dropout) x in), and its lora_A output (a x r); nothing when it is frozen."""
    widths = {name: d_in for name, d_in, _ in block.linears}
    if path not in adapted or path not in widths:
        return 0.0
    kept = a + dropout if dropout else (a if a != p else p)
    return kept * widths[path] + a * rank


def _per_layer_tail(
    block: BlockSpec, adapted: frozenset[str], *, rank: int, p: int, a: int, dropout: float = 0.0
) -> float:
    """Per token, what the per-layer-input tail of Gemma-3n's and Gemma 4's decoder layers saves
    (0 for other blocks): ``per_layer_input_gate`` and ``per_layer_projection`` their inputs,
    the activation its input and the product its other factor, both P wide (the per-layer input
    it multiplies by is a view of the model's, counted there). Its norm is one of the block's
    hidden norms. Counted with saved-tensor hooks on Gemma 4's and Gemma-3n's layers."""
    width = next((d_out for name, _, d_out in block.linears if name == "per_layer_input_gate"), 0)
    if not width:
        return 0.0
    saved = _input_saved(block, "per_layer_input_gate", adapted, rank=rank, p=p, a=a, dropout=dropout)
    projection = _input_saved(block, "per_layer_projection", adapted, rank=rank, p=p, a=a, dropout=dropout)
    return saved + projection + 2 * width * p


def _without_mlp(
    saved: float,
    grad: list[float],
    nograd: list[float],
    nograd_base: list[float],
    stream: float,
    attention_live: float,
    masked: dict[str, float],
    at_scores: tuple[float, float],
) -> BlockTape:
    """The tape of a block whose MLP is counted elsewhere (a MoE block's experts): its moments so
    far, the stream beside the no-grad ones, and a backward that starts from its saved tensors
    and one hidden state's gradient."""
    return BlockTape(
        saved=saved,
        grad_peak=max(grad),
        recompute_peak=max(grad),
        backward_peak=saved + stream,
        nograd_peak=max(nograd) + stream,
        nograd_peak_base=max(nograd_base) + stream,
        attention_live=attention_live,
        attention_grad_live=at_scores[0],
        attention_backward_live=at_scores[1],
        masked_kv_saved=masked["masked_kv_saved"],
        masked_kv_nograd=masked["masked_kv_nograd"],
    )


class AdapterTerms(NamedTuple):
    """What :func:`_adapter_terms` counts per linear (its docstring says what each is)."""

    transient: Callable[[Linear, bool], float]
    cast_copy: Callable[[Linear, float], float]
    cast_live: Callable[[Linear, float], float]
    grad_live: Callable[[Linear, float], float]


def _adapter_terms(p: int, a: int, s: int, *, full: bool, dropout: float = 0.0) -> AdapterTerms:
    """Per linear: its transient beyond its input (:func:`_lora_transient`), the copy of its
    input that lora_A saves in a forward with grad (``s`` bytes an element: the adapters'
    dtype, the compute dtype under autocast; with LoRA dropout the dropped copy and what
    dropout keeps, ``a + dropout``, with or without a cast), the copies alive while it runs
    without grad (under autocast, ``s != a``, the fp32 copy beside the saved one) and with
    grad (with dropout: the cast copy too, beside what is saved)."""
    cast = a != p

    def transient(x: Linear, adapters_on: bool) -> float:
        return _lora_transient(x, p, s, adapters_on, full)

    def cast_copy(x: Linear, input_width: float) -> float:
        if not x.adapted:
            return 0.0
        if dropout:
            return (a + dropout) * input_width
        return s * input_width if cast else 0.0

    def cast_live(x: Linear, input_width: float) -> float:  # eval mode: no dropout
        if not x.adapted or not cast:
            return 0.0
        return s * input_width + (a * input_width if s != a else 0.0)

    def grad_live(x: Linear, input_width: float) -> float:
        if not dropout:
            return cast_live(x, input_width)
        return cast_copy(x, input_width) + (a * input_width if cast and x.adapted else 0.0)

    return AdapterTerms(transient, cast_copy, cast_live, grad_live)


def block_tape(
    block: BlockSpec,
    *,
    hidden: int,
    adapted: frozenset[str],
    rank: int,
    compute_bytes: int,
    adapter_bytes: int = ADAPTER_BYTES,
    tp: int = 1,
    mlp_tp: int = 1,
    include_mlp: bool = True,
    full: bool = False,
    eager: bool = False,
    autocast: bool = False,
    dropout_bytes: float = 0.0,
) -> BlockTape:
    """Walk one block's ops (see the module docstring) and return its :class:`BlockTape`.

    ``adapter_bytes``: the adapters' compute dtype, fp32 unsharded (PEFT), FSDP's
    ``param_dtype`` under FSDP2 (its mixed precision casts every parameter it gathers,
    the adapters too, so PEFT casts nothing).

    ``include_mlp=False`` leaves the MLP out (a MoE block, whose experts
    planner.memory._moe counts); its two hidden-stream tensors and norms stay in.

    ``full``: full fine-tuning, no adapter. A trained linear saves its input as an adapted one
    with equal dtypes does (the normed input once for q, k and v; the product for down), a
    trained norm weight's product the normalised input in the compute dtype (H x p; over q
    and k for head norms). Counted with saved-tensor hooks on a tiny Qwen2 and Qwen3.

    ``dropout_bytes``: what LoRA dropout keeps an element of an adapted linear's input (module
    docstring); ignored with full fine-tuning and under ``autocast``.
    """
    if full:
        adapted, rank, adapter_bytes = frozenset(path for path, _, _ in block.linears), 0, compute_bytes
    p, a, H = compute_bytes, adapter_bytes, hidden
    cast = a != p
    s = p if autocast and cast and not full else a  # a saved cast copy's and lora_A's output's bytes an element
    att = block.attention
    q, kv = att.q_dim / tp, att.kv_dim / tp
    heads = att.num_heads / tp
    lin = block_linears(block, adapted, tp=tp, mlp_tp=mlp_tp)
    gqa, own_kv = q > kv, kv if att.has_own_kv else 0.0  # a K/V reader's are the storing layer's
    # a masked SDPA under GQA saves K and V repeated to every head: beyond the layer's own, if any
    masked = dict(masked_kv_saved=2 * (q - own_kv) * p if gqa else 0.0, masked_kv_nograd=2 * q * p if gqa else 0.0)
    hidden_norms, after_mlp, head_width, head_normed = _norms(block, hidden)
    norm_saved = 4 * H + 4 + (H * p if full else 0)
    dropped = dropout_bytes > 0 and not full and not autocast
    terms = _adapter_terms(p, a, s, full=full, dropout=dropout_bytes if dropped else 0)
    transient, cast_copy, cast_live, grad_live = terms
    grad: list[float] = []  # forward-with-grad moments
    nograd: list[float] = []  # without grad: adapters on (nograd), off (nograd_base)
    nograd_base: list[float] = []
    saved, normed, held_normed, attention_locals, at_scores = _attention_moments(
        lin,
        terms,
        grad,
        nograd,
        nograd_base,
        p=p,
        H=H,
        rank_bytes=s * rank,
        cast=cast,
        full=full,
        q=q,
        kv=own_kv,
        heads=heads,
        head_width=head_width,
        norm_saved=norm_saved,
        eager=eager,
        dropped=dropped,
        head_normed=head_normed,
    )
    attention_live = normed + attention_locals - q * p  # at the scores: no output yet
    stream: float = H * p  # the residual stream after attention, alive until the block returns
    # with grad an fp32 norm saves the stream itself rather than an upcast copy
    held_stream = 0.0 if p == 4 else stream
    # -- MLP ------------------------------------------------------------------------------------
    saved += (hidden_norms - 1 - after_mlp) * norm_saved  # the pre-MLP (and Gemma's post-attention) norms
    if not include_mlp or not lin["mlp_in"]:
        saved += after_mlp * norm_saved
        return _without_mlp(
            saved, grad + [saved + held_stream + H * p], nograd, nograd_base, stream, attention_live, masked, at_scores
        )
    gated = any(x.name.rsplit(".", 1)[-1] in _GATES for x in lin["mlp_in"])
    width = lin["mlp_out"][0].in_features if lin["mlp_out"] else lin["mlp_in"][-1].out_features
    normed = held_normed = H * p  # the normed MLP input: the MLP's argument, alive until it returns
    activated = 0.0  # the activation's output, alive while up runs
    named = gated and len(lin["mlp_in"]) > 1 and block.kind in _MLP_NAMES_ITS_OUTPUTS
    gate_named = 0.0  # without grad, the gate's output where the MLP names it
    attention_moments = len(nograd)
    for x in lin["mlp_in"]:
        grad.append(saved + held_stream + held_normed + activated + grad_live(x, H) + transient(x, True))
        nograd.append(stream + normed + activated + gate_named + cast_live(x, H) + transient(x, True))
        nograd_base.append(stream + normed + activated + gate_named + transient(x, False))
        saved += cast_copy(x, H) + (s * rank if x.adapted else 0)
        if gated and not activated and len(lin["mlp_in"]) > 1:
            saved += width * p  # the gate's output, saved by the activation
            activated = width * p  # which makes its own output
            gate_named = width * p if named else 0.0
    if not cast and not dropped and any(x.adapted for x in lin["mlp_in"]):
        saved += p * H  # lora_A of gate and up save the one normed input
        held_normed = 0.0
    if gated and len(lin["mlp_in"]) > 1:
        saved += 2 * width * p  # the product's inputs: the activation's and up's outputs
    elif gated:
        saved += 3 * width * p  # a fused gate_up output (the gate's and up's views) and the activation's
    else:
        saved += width * p  # the activation's input
    product = width * p
    # the product is made while its inputs are alive (saved with grad)
    grad.append(saved + held_stream + held_normed + product)
    nograd.append(stream + normed + (3 if gated else 2) * width * p + gate_named)
    nograd_base.append(nograd[-1])
    outputs_named = 3 * width * p if named else 0.0  # the gate's, the activation's and up's, through down
    recompute = list(grad)
    down_input_saved = 0.0
    for x in lin["mlp_out"]:
        held = saved + held_stream + held_normed + product + grad_live(x, width)
        grad.append(held + transient(x, True))
        if x.adapted and not full:  # the recompute runs down's base and lora_A, then stops
            recompute.append(held + x.out_features * p + s * rank)
        nograd.append(stream + normed + product + outputs_named + cast_live(x, width) + transient(x, True))
        nograd_base.append(stream + normed + product + outputs_named + transient(x, False))
        down_input_saved = cast_copy(x, width) if cast or dropped else (p * width if x.adapted else 0)
        saved += down_input_saved + (s * rank if x.adapted else 0)
    # The residual sum that ends the block: the stream, the MLP's output and the sum (what peaks last
    # when the linears have no adapter transient, full fine-tuning's).
    grad.append(saved + held_stream + 2 * H * p)
    saved += after_mlp * norm_saved  # Gemma's post-MLP norm
    tail = _per_layer_tail(block, adapted, rank=rank, p=p, a=s, dropout=dropout_bytes if dropped else 0)
    if tail:  # at its norm: the stream, the projection's output, the norm's fp32 normed and weighted copies
        saved += tail
        grad.append(saved + 2 * H * p + 8 * H)
    return BlockTape(
        saved=saved,
        grad_peak=max(grad),
        recompute_peak=max(recompute),
        **_mlp_backward(saved, lin["mlp_out"], down_input_saved, bool(tail), width=width, H=H, p=p, a=a, full=full),
        nograd_peak=max(nograd),
        nograd_peak_base=max(nograd_base),
        attention_live=attention_live,
        attention_grad_live=at_scores[0],
        attention_backward_live=at_scores[1],
        nograd_parts=(max(nograd[:attention_moments]), max(nograd[attention_moments:])),
        nograd_parts_base=(max(nograd_base[:attention_moments]), max(nograd_base[attention_moments:])),
        masked_kv_saved=masked["masked_kv_saved"],
        masked_kv_nograd=masked["masked_kv_nograd"],
    )


def _mlp_backward(
    saved: float,
    down: list[Linear],
    down_input_saved: float,
    tail: bool,
    *,
    width: float,
    H: float,
    p: int,
    a: int,
    full: bool,
) -> dict[str, float]:
    """A block's backward peak, everything it saved alive (the gradients flowing into the block are
    the caller's to count): at down, its input's gradient through the adapter (width x a, beside
    the saved cast it consumes) or through the base alone (width x p); at a per-layer tail's norm,
    where its backward starts in fp32, five hidden-wide tensors and the gradient of its input; at
    the product, its output's gradient and its two input gradients, once the input down's lora_A
    saved is freed. With full fine-tuning down's weight gradient is made by then (bytes a block).
    :class:`BlockTape`'s ``backward_peak``, ``backward_product`` and ``backward_weight_grad``."""
    at_down = saved + (width * a if any(x.adapted for x in down) else width * p)
    at_product = saved - down_input_saved + 3 * width * p
    at_tail = saved + 20 * H + H * p if tail else 0.0
    return {
        "backward_peak": max(at_down, at_product, at_tail),
        "backward_product": at_product,
        "backward_weight_grad": sum(x.in_features * x.out_features * p for x in down) if full else 0.0,
    }


@dataclass(frozen=True, slots=True)
class AltUpTape:
    """Per token, what Gemma-3n's decoder layer adds around the tape's attention and MLP (AltUp's
    predict and correct over its streams, Laurel, the per-layer input), in bytes.

    ``saved``: kept for backward beyond the tape's (the block's input streams included).
    ``forward_end``: alive beyond everything saved at the forward's last moment, its final norm.
    ``backward_start``: made at the start of its backward beyond everything saved and the
    gradients flowing in.
    """

    saved: float
    forward_end: float
    recompute_end: float
    backward_start: float


def altup_tape(
    block: BlockSpec,
    *,
    hidden: int,
    streams: int,
    adapted: frozenset[str],
    rank: int,
    compute_bytes: int,
    adapter_bytes: int = ADAPTER_BYTES,
) -> AltUpTape:
    """Count Gemma-3n's decoder layer beyond :func:`block_tape` (which walks its attention, its
    MLP and saves every hidden-wide norm once), with ``S`` streams of ``H``:

    - AltUp's predict multiplies the input streams by its coefficients and saves them (S H p,
      a view of the block's input); correct repeats the innovation to every stream and its
      product saves that (S H p);
    - the router runs twice (predict, correct): its norm saves an fp32 upcast each time (4 H + 4;
      the tape counts one), and an adapted ``modality_router`` saves its input each time (a H
      when PEFT casts it, else the distinct p H router input), and a r;
    - Laurel's ``linear_left`` takes the attention's normed input: a H when cast, nothing new
      when the attention's adapters already save that tensor; the small coefficient linears and
      ``linear_right`` save their rank-wide inputs (the per-layer tail and the weightless
      ``v_norm`` are the tape's);
    - the layer names every intermediate it makes, and Python keeps them until it returns: at
      its end the predictions and the corrected streams (2 S H p), seven hidden-wide locals
      (the Laurel output, the attention's and its sums, the MLP's and its sums: 7 H p), the
      per-layer projection's output (H p) and its final norm's fp32 normed and weighted copies
      (8 H); a checkpointed recompute stops before the weighted copy;
    - its backward starts at that norm: one stream-wide gradient beside those flowing in
      (S H p) and the norm's fp32 backward, five hidden-wide tensors (20 H).

    Counted with saved-tensor hooks and a live-tensor tracker on a tiny Gemma-3n layer with
    LoRA on every linear, adapters in bf16 (FSDP2's param_dtype) and in fp32 (PEFT unsharded):
    at hidden sizes 64 and 128, saved within 2.1%, the forward's peak within 4.2% and the
    backward's within 2.7%, all low (tests/planner/memory/test_gemma_layers.py).
    """
    p, a, H, S = compute_bytes, adapter_bytes, hidden, streams

    def saves_input(path: str) -> float:
        return _input_saved(block, path, adapted, rank=rank, p=p, a=a)

    # with equal dtypes Laurel's lora_A saves the normed input the attention's adapters save
    shared = a == p and any(_role(path) == "attn_in" and path in adapted for path, _, _ in block.linears)
    laurel = saves_input("laurel.linear_left") - (p * H if shared and "laurel.linear_left" in adapted else 0)
    saved = (
        2 * S * H * p  # the input streams (predict), the repeated innovation (correct)
        + 4 * H
        + 4  # the router norm's second upcast
        + 2 * saves_input("altup.modality_router")
        + saves_input("altup.prediction_coefs")
        + saves_input("altup.correction_coefs")
        + laurel
        + saves_input("laurel.linear_right")
    )
    end = 2 * S * H * p + 7 * H * p + H * p + 8 * H
    return AltUpTape(saved=saved, forward_end=end, recompute_end=end - 4 * H, backward_start=S * H * p + 20 * H)
