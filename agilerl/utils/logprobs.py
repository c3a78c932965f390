"""Per-token log-probabilities without holding batch x length x vocab logits.

The logits are the largest GRPO memory term for 150k-token vocabularies
(DESIGN.md decision 4). ``chunked_token_logprobs`` computes them ``chunk_size``
token rows at a time and, when gradients are on, wraps each chunk in
non-reentrant activation checkpointing so autograd saves only the chunk's
inputs and recomputes its logits in backward. Naive chunking does not help:
autograd would keep every chunk's logits alive until backward.

Peak log-prob workspace, per the equation the planner uses
(``planner.memory``): about ``3 * chunk_rows * vocab * 4`` bytes (fp32 logits,
their exp/softmax temporary in logsumexp and its gradient), instead of the
same with ``rows = batch * length`` for every chunk kept until backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_token_logprobs", "final_norm", "output_head", "position_ids_from_mask", "causal_lm"]


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


def causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def output_head(model: nn.Module) -> nn.Module:
    head = causal_lm(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return head


def final_norm(model: nn.Module) -> nn.Module:
    """The module whose output is the final hidden state fed to the lm_head."""
    lm = causal_lm(model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", lm)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(f"cannot find the final norm of {type(decoder).__name__}")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens, as Hugging Face generate does for left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
