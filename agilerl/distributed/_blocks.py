"""Where a causal LM's transformer blocks are, and what kind each is.

Apart from the sharding code so that reading a model's structure (the planner builds its
spec on the meta device) imports torch.nn only, not torch.distributed's FSDP and DTensor.
"""

from __future__ import annotations

from torch import nn

__all__ = ["block_kind", "find_transformer_blocks", "unwrap_checkpointed"]


def unwrap_checkpointed(module: nn.Module) -> nn.Module:
    """The module inside an activation-checkpoint wrapper (the module itself when unwrapped)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def block_kind(block: nn.Module) -> str:
    """A block's kind: its ``block_type``, else its ``layer_type`` (hybrid models in
    transformers 5, e.g. 'linear_attention' / 'full_attention'), else its class name."""
    inner = unwrap_checkpointed(block)
    for attr in ("block_type", "layer_type"):
        kind = getattr(inner, attr, None)
        if isinstance(kind, str) and kind:
            return kind
    return type(inner).__name__


def _no_split_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        value = getattr(module, "_no_split_modules", None)
        if value:
            names.update(value)
    return names


def find_transformer_blocks(model: nn.Module) -> tuple[nn.ModuleList, list[nn.Module]]:
    """The ModuleList holding the transformer blocks, and its blocks in order.

    Blocks are the classes a Hugging Face model lists in ``_no_split_modules``;
    without that hint, the longest ModuleList of same-class modules.
    """
    block_names = _no_split_names(model)
    best: nn.ModuleList | None = None
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        # Class names along the MRO: fully_shard swaps a block's class for FSDP<Name>.
        kinds = {c.__name__ for m in module for c in type(unwrap_checkpointed(m)).__mro__}
        if block_names and not kinds & block_names:
            continue
        if not block_names and len({type(unwrap_checkpointed(m)).__name__ for m in module}) != 1:
            continue
        if best is None or len(module) > len(best):
            best = module
    if best is None:
        raise ValueError(
            f"could not find the transformer blocks of {type(model).__name__}: no nn.ModuleList of "
            f"{sorted(block_names) or 'same-class modules'}"
        )
    return best, list(best)
