"""The shared-prefix forward's machinery (see :mod:`agilerl.utils.shared_prefix`): the
distinct prompts of a batch, the two caches and the suffix pass's mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from agilerl.utils.logprobs import additive_attention_mask

__all__ = [
    "cache_argument",
    "PrefixGroups",
    "prompt_groups",
    "RecordingCache",
    "PrefixedCache",
    "suffix_attention_mask",
]


def cache_argument(lm) -> str:
    """The name under which this transformers version's forward and generate take a KV cache:
    ``cache`` (5.2x on) or ``past_key_values`` (earlier; later ones still accept it, with a warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"


@dataclass(frozen=True)
class PrefixGroups:
    """Rows with identical prefixes: ``rows`` (one row of each distinct prefix) and ``inverse``
    (each row's position in ``rows``)."""

    rows: torch.Tensor
    inverse: torch.Tensor

    @property
    def distinct(self) -> int:
        return int(self.rows.numel())


def prompt_groups(ids: torch.Tensor, attention_mask: torch.Tensor, split: int) -> PrefixGroups | None:
    """The distinct ``[:, :split]`` prefixes (tokens and mask) of a batch, or None where no two
    rows share one (a two-pass forward would then only add work) or ``split`` is 0."""
    n = ids.shape[0]
    if split < 1 or n < 2:
        return None
    key = torch.cat([ids[:, :split], attention_mask[:, :split].to(ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == n:
        return None
    # the first row of each distinct prefix, in order of first appearance
    first = torch.full((distinct,), n, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(n, device=ids.device), reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(distinct, device=ids.device)
    return PrefixGroups(rows=first[order], inverse=rank[inverse])


class RecordingCache(Cache):
    """The prefix pass's cache: each layer's first keys and values are kept and returned as
    they are (a checkpointed block's recompute gets its own back, and nothing is appended)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(num_layers)])
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv.setdefault(layer_idx, (key_states, value_states))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class PrefixedCache(Cache):
    """The suffix pass's cache: each layer returns its rows' recorded prefix keys and values
    followed by the new ones, and stores nothing. The rows' copies of the prefix are made
    layer by layer, when the layer asks (one layer's copy alive at a time, besides what its
    attention saves)."""

    def __init__(self, recorded: RecordingCache, inverse: torch.Tensor, prefix_length: int) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(len(recorded.layers))])
        self.recorded, self.inverse, self.length = recorded, inverse, prefix_length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.recorded.kv[layer_idx]
        return (torch.cat([k[self.inverse], key_states], dim=-2), torch.cat([v[self.inverse], value_states], dim=-2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def suffix_attention_mask(attention_mask: torch.Tensor, split: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of the suffix pass: queries at columns ``[split, T)`` over keys ``[0, T)``,
    causal and without pad keys (:func:`agilerl.utils.logprobs.additive_attention_mask`). Pad
    queries keep a finite row; no loss term reads them."""
    return additive_attention_mask(attention_mask, dtype, first_query=split)
