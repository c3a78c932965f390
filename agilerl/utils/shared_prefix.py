"""A group's prompt, run once: the shared-prefix forward of GRPO-style batches.

GRPO samples ``group_size`` completions of every prompt, so the rows of a batch come in
groups whose first columns (the left-padded prompt) are identical. The prompt's hidden
states, and so its keys and values in every layer, are then identical across the group too.
Hugging Face's forward recomputes them once per row. Here a forward over such a batch runs
in two passes:

1. the **prefix pass** runs the distinct prompt rows alone, columns ``[0, split)``, and
   records every attention layer's (rotated) keys and values;
2. the **suffix pass** runs every row's columns ``[split, T)``, each attention layer reading
   its row's recorded prefix keys and values followed by its own.

The outputs at columns ``>= split`` equal the one-pass forward's (the same arithmetic on
the same values, up to float summation order), and so do the gradients: backward reaches
the shared prefix through the row selection, which sums the group's contributions. With
``prompt`` tokens of ``prompt + completion`` and groups of ``G``, the blocks run
``prompt / G + completion`` tokens per row instead of ``prompt + completion``.

Both passes are stateless towards the cache object a checkpointed block's recompute calls
again: :class:`~agilerl.utils.prefix_cache.RecordingCache` keeps only the first keys and values it sees per layer and
:class:`~agilerl.utils.prefix_cache.PrefixedCache` stores nothing, so recomputing a block returns what its forward did.

What runs it, and where it falls back to the one-pass forward, is :func:`shared_prefix_problem`
(one rule for the trainer and the planner; torch-free, so the planner imports it): the model
families whose attention reads and writes a plain key/value cache, SDPA or eager attention,
every layer attending to the whole row (no sliding window or chunk shorter than it), and no
tensor parallelism. Rows are grouped by their content
(:func:`~agilerl.utils.prefix_cache.prompt_groups`), so a batch without repeated prompts runs
in one pass.

One difference in randomness: with LoRA dropout, a group's rows share the prompt's
dropout masks (one prefix pass), where the one-pass forward draws one per row.
"""

from __future__ import annotations

__all__ = ["SHARED_PREFIX_MODEL_TYPES", "ADDITIVE_MASK_ATTENTION", "shared_prefix_problem"]

#: Model families whose attention calls ``cache.update(k, v, layer_idx)`` on a plain key/value
#: cache and nothing else (each is tested against its one-pass forward in tests/agilerl/utils).
SHARED_PREFIX_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmo2"})


#: Attention implementations that take a ready-made 4D additive mask: the suffix pass's, and
#: :func:`agilerl.utils.logprobs.shared_attention_mask`'s.
ADDITIVE_MASK_ATTENTION = ("sdpa", "eager")


def shared_prefix_problem(
    model_type: str | None, attention: str | None, *, full_causal: bool, tp: int = 1
) -> str | None:
    """Why a forward of this model cannot run in two passes; None if it can.

    ``full_causal``: every layer attends to the whole row (no sliding window or attention chunk
    shorter than it). The trainer asks with the model's config, the planner with its spec."""
    if model_type not in SHARED_PREFIX_MODEL_TYPES:
        return f"model type {model_type!r} is not one whose attention cache is known to be plain"
    if (attention or "sdpa") not in ADDITIVE_MASK_ATTENTION:
        return f"attention {attention!r} does not take the offset mask the suffix pass needs"
    if not full_causal:
        return "a sliding window or attention chunk is shorter than the row"
    if tp > 1:
        return "tensor parallelism splits the heads the cache holds"
    return None
