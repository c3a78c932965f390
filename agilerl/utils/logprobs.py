"""Per-token log-probabilities without holding batch x length x vocab logits.

The logits are the largest GRPO memory term for 150k-token vocabularies
(docs/runtime.md). Two paths, both ``chunk_size`` token rows at a time:

- ``linear_token_logprobs`` (the head is a linear layer: every model the
  trainer ships): one autograd function that keeps only the hidden states and
  each row's log-sum-exp for backward, and in backward recomputes a chunk's
  logits and turns them into their gradient in place. Its workspace is one
  logits tile in the compute dtype (the matmul output, freed once cast) and
  one fp32 tile: ``chunk x V x (p + 4)`` bytes at the peak, in forward and in
  backward alike (with ``softcap`` one more fp32 tile for tanh's derivative).
  On an fp32 model the cast is a no-op and one tile remains. Counted by
  ``planner.memory``'s logits term.
- ``chunked_token_logprobs`` (any head callable): each chunk under
  non-reentrant activation checkpointing, so autograd saves only the chunk's
  inputs and recomputes its logits in backward (naive chunking does not help:
  autograd would keep every chunk's logits alive until backward). Its backward
  holds about four fp32 tiles (the logits, their softmax and two gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from agilerl.typing import HFModule
from agilerl.utils.shared_prefix import ADDITIVE_MASK_ATTENTION

__all__ = [
    "chunked_token_logprobs",
    "linear_token_logprobs",
    "final_norm",
    "output_head",
    "position_ids_from_mask",
    "last_position_only",
    "shared_attention_mask",
    "additive_attention_mask",
    "causal_lm",
    "full_causal",
    "logit_multiplier",
]


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    softcap: float | None,
) -> torch.Tensor:
    logits = head(hidden).float()
    if not torch.is_grad_enabled():  # nothing is saved: rescale the one logits buffer in place
        if softcap:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        if temperature != 1.0:
            logits = logits.div_(temperature)
    else:
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_size: int | None,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """log p(targets) from final hidden states, ``chunk_size`` token rows at a time.

    ``hidden``: ``[..., H]``; ``targets``: ``[...]`` token ids; ``head`` maps
    hidden states to logits. ``chunk_size=None`` computes all rows at once (no
    checkpointing), the baseline the chunked path must equal. Returns fp32
    log-probs shaped like ``targets``.
    """
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    rows = flat_h.shape[0]
    if chunk_size is None or chunk_size >= rows:
        return _chunk_logprobs(flat_h, flat_t, head, temperature, softcap).view(shape)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    out = []
    grad = torch.is_grad_enabled()
    for start in range(0, rows, chunk_size):
        h = flat_h[start : start + chunk_size]
        t = flat_t[start : start + chunk_size]
        if grad:
            out.append(checkpoint(_chunk_logprobs, h, t, head, temperature, softcap, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(h, t, head, temperature, softcap))
    return torch.cat(out).view(shape)


# -- the fused linear head ---------------------------------------------------------------------
def _scaled_logits(hidden, weight, bias, temperature: float, softcap: float | None) -> torch.Tensor:
    """fp32 logits of one chunk, soft-capped and tempered in place (the compute-dtype matmul
    output is freed as soon as it is cast)."""
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _logsumexp_(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp that overwrites ``logits`` (with ``exp(logits - max)``) instead of
    allocating a second tile, as ``torch.logsumexp`` does."""
    top = logits.amax(dim=-1, keepdim=True)
    sums = logits.sub_(top).exp_().sum(dim=-1)
    return sums.log_().add_(top.squeeze(-1))


def _chunks(rows: int, chunk_size: int | None) -> range:
    step = rows if chunk_size is None or chunk_size >= rows else chunk_size
    return range(0, rows, max(1, step))


def _row_chunks(rows: int, chunk_size: int | None, index: torch.Tensor | None):
    """Chunks of the rows to compute: slices of all ``rows``, or pieces of ``index`` (a row subset;
    indexing with it copies only one chunk of hidden states at a time)."""
    if index is None:
        step = chunk_size or rows
        return [slice(start, start + step) for start in _chunks(rows, chunk_size)]
    step = chunk_size or max(1, index.numel())
    return [index[start : start + step] for start in range(0, index.numel(), step)]


def _linear_logprobs_nograd(
    hidden, weight, bias, targets, chunk_size, temperature, softcap, index=None
) -> torch.Tensor:
    make = torch.empty if index is None else torch.zeros
    out = make(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for rows in _row_chunks(hidden.shape[0], chunk_size, index):
        logits = _scaled_logits(hidden[rows], weight, bias, temperature, softcap)
        picked = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
        out[rows] = picked - _logsumexp_(logits)
        del logits
    return out


class _LinearLogprobs(torch.autograd.Function):
    """log p(targets) through a linear head; saves the hidden states and one fp32 value per row."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, softcap, index):
        make = torch.empty if index is None else torch.zeros
        out = make(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for rows in _row_chunks(hidden.shape[0], chunk_size, index):
            logits = _scaled_logits(hidden[rows], weight, bias, temperature, softcap)
            picked = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            lse[rows] = _logsumexp_(logits)
            out[rows] = picked - lse[rows]
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse, index)
        ctx.chunk_size, ctx.temperature, ctx.softcap = chunk_size, temperature, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse, index = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = (torch.empty_like if index is None else torch.zeros_like)(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for rows in _row_chunks(hidden.shape[0], ctx.chunk_size, index):
            g = grad_out[rows].float().unsqueeze(-1)
            logits = _scaled_logits(hidden[rows], weight, bias, ctx.temperature, ctx.softcap)
            # d/dz tanh(z / s) s = 1 - (tanh(z / s))^2, from the capped logits before the temperature
            cap = 1 - (logits * (ctx.temperature / ctx.softcap)).square_() if ctx.softcap else None
            # d log p_t / d y = onehot(t) - softmax(y), times the incoming gradient, in place
            grad = logits.sub_(lse[rows].unsqueeze(-1)).exp_().mul_(-g)
            grad.scatter_add_(-1, targets[rows].unsqueeze(-1), g)
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if cap is not None:
                grad.mul_(cap)
                del cap
            grad = grad.to(hidden.dtype)
            if need_h:
                grad_h[rows] = grad @ weight.to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad.t().float(), hidden[rows].float())
            if need_b:
                grad_b.add_(grad.float().sum(0))
            del grad, logits
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None,
    temperature: float = 1.0,
    softcap: float | None = None,
    first: int = 0,
) -> torch.Tensor:
    """log p(targets) for logits ``hidden @ weight.T + bias``, ``chunk_size`` rows at a time.

    Equal to :func:`chunked_token_logprobs` with a linear head (values and
    gradients, including the weight's when it trains), in a smaller workspace
    (see the module docstring). ``hidden``: ``[..., T, H]`` in the compute dtype;
    returns fp32 log-probs shaped like ``targets``. ``first``: positions before it
    (in each sequence, along ``T``) are not computed and read 0, with no gradient:
    GRPO needs the completion's positions only, so the prompt's skip the head.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    index = None
    if first > 0:
        length = shape[-1]
        if first >= length:
            raise ValueError(f"first={first} leaves no position of {length}")
        starts = torch.arange(0, flat_t.numel(), length, device=flat_t.device)
        index = (starts[:, None] + torch.arange(first, length, device=flat_t.device)).reshape(-1)
    if torch.is_grad_enabled() and (
        flat_h.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        out = _LinearLogprobs.apply(flat_h, weight, bias, flat_t, chunk_size, temperature, softcap, index)
    else:
        out = _linear_logprobs_nograd(flat_h, weight, bias, flat_t, chunk_size, temperature, softcap, index)
    return out.view(shape)


def causal_lm(model: nn.Module) -> HFModule:
    """The Hugging Face causal LM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def output_head(model: nn.Module) -> nn.Module:
    head = causal_lm(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return head


#: Causal LMs whose forward scales the lm_head's output before the softmax: model_type ->
#: (config field, whether the logits are divided by it rather than multiplied). MiniCPM3
#: divides the final hidden state instead, the same for a head without bias.
LOGIT_SCALES = {
    **{t: ("logits_scaling", True) for t in ("granite", "granite_swa", "granitemoe", "granitemoe_swa")},
    **{t: ("logits_scaling", True) for t in ("granitemoeshared", "granitemoehybrid", "minicpm3")},
    "hyperclovax": ("logits_scaling", False),
    **{t: ("logit_scale", False) for t in ("cohere", "cohere2", "cohere2_moe", "cohere_compass")},
    "falcon_h1": ("lm_head_multiplier", False),
}


def logit_multiplier(config: Any) -> float:
    """What ``config``'s model multiplies its lm_head's output by before the softmax (1.0 for
    most): the log-probs computed from the final hidden state and the head's weight divide the
    temperature by it, so that they are the model's own, which it samples from."""
    field, divides = LOGIT_SCALES.get(getattr(config, "model_type", ""), (None, False))
    value = getattr(config, field, None) if field is not None else None
    if value is None:
        return 1.0
    return 1.0 / float(value) if divides else float(value)


def final_norm(model: nn.Module) -> nn.Module:
    """The module whose output is the final hidden state fed to the lm_head."""
    lm = causal_lm(model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", lm)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(f"cannot find the final norm of {type(decoder).__name__}")


def last_position_only(ids: torch.Tensor) -> torch.Tensor:
    """``logits_to_keep`` for a forward whose log-probs come from its final hidden states (caught
    by a hook on :func:`final_norm`): the model's own head runs on the last position only, every
    position still runs through every layer. A tensor, not the int 1: transformers' Gemma 4 reads
    an int as leave to drop every earlier position before its K/V-sharing layers (generate's
    prefill shortcut, ``_maybe_slice_kv_shared_inputs``), which leaves one position of the hidden
    states the log-probs need."""
    return torch.arange(ids.shape[1] - 1, ids.shape[1], device=ids.device)  # made on the device: no copy


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens, as Hugging Face generate does for left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


#: Attention implementations that read a ready-made 4D additive mask as it is.


def shared_attention_mask(config, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One additive ``[B, 1, T, T]`` mask for a padded batch, shared by every layer; else ``attention_mask``.

    Hugging Face builds a boolean causal-and-padding mask per forward and hands it to SDPA,
    which converts it to a float mask in every layer and saves that copy for backward: one
    ``B x T x T`` mask per layer alive until backward (268 MB a layer at 8 x 4096 in bf16). A
    ready-made 4D float mask is passed through unchanged, so all layers read (and save) the same
    tensor. Padded positions get the dtype's lowest value rather than -inf, so a pad query with
    no key to attend to stays finite; no loss term reads pad positions.

    A batch whose rows are padded only at their ends (one row, or completions that stopped
    early) needs no mask: causal attention never lets a real token see a later pad, and no loss
    term reads a pad position. An all-ones mask is returned for it, and Hugging Face then builds
    none (SDPA runs causal). The 2D mask is returned unchanged when the batch has no padding at
    all, for attention kernels that do not take a 4D mask (flash attention), and when a
    sliding-window or chunked layer would see more than its window: its mask differs from the
    full causal one.
    """
    if attention_mask.dim() != 2 or bool(attention_mask.all()):
        return attention_mask
    if not _pad_before_real(attention_mask.bool()):
        return torch.ones_like(attention_mask)
    length = attention_mask.shape[1]
    if getattr(config, "_attn_implementation", None) not in ADDITIVE_MASK_ATTENTION or not full_causal(config, length):
        return attention_mask
    return additive_attention_mask(attention_mask, dtype)


def additive_attention_mask(attention_mask: torch.Tensor, dtype: torch.dtype, first_query: int = 0) -> torch.Tensor:
    """The additive causal mask of queries at columns ``[first_query, T)`` over keys ``[0, T)``,
    pad keys masked: ``[1, 1, T - first_query, T]`` (shared by the batch) when no row has a pad,
    else ``[B, 1, T - first_query, T]``. Masked positions get the dtype's lowest value, so a pad
    query with no key to attend to keeps a finite row."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril_()[first_query:]
    allowed = (
        causal[None, None]
        if bool(attention_mask.all())
        else causal[None, None] & attention_mask.bool()[:, None, None, :]
    )
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _pad_before_real(real: torch.Tensor) -> bool:
    """Whether any row has a pad position before one of its real tokens (left or inner padding)."""
    later_real = real.flip(1).to(torch.uint8).cummax(dim=1).values.flip(1).bool()  # a real token at or after
    return bool((later_real & ~real).any())


def full_causal(config, length: int) -> bool:
    """Whether every layer of ``config`` attends causally to all earlier tokens of a ``length``-long row."""
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        limited = [t for t in types if t != "full_attention"]
        if any(t not in ("sliding_attention", "chunked_attention") for t in limited):
            return False  # a layer type with a mask of its own (linear attention, ...)
        if "sliding_attention" in limited and (window is None or length > window):
            return False
        return not ("chunked_attention" in limited and (chunk is None or length > chunk))
    if window is not None and getattr(config, "use_sliding_window", True) and length > window:
        return False
    return chunk is None or length <= chunk
