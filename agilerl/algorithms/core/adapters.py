"""LoRA adapter selection that never touches ``requires_grad``.

PEFT's ``set_adapter`` and ``disable_adapter`` flip ``requires_grad`` on adapter
weights. Under FSDP2 that would change what the optimizer and the reduce-
scatters see mid-step, so the reference pass switches adapters through the
layers' own ``_active_adapter`` / ``_disable_adapters`` state instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["use_adapter", "tuner_layers", "mark_trainable", "copy_adapter_", "adapter_state_dict", "ACTOR", "REFERENCE"]

ACTOR = "actor"
REFERENCE = "reference"


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def use_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    """Run with adapter ``name`` active, or with adapters disabled when None."""
    layers = tuner_layers(model)
    saved = [(layer._active_adapter, layer._disable_adapters) for layer in layers]
    try:
        for layer in layers:
            if name is None:
                layer._disable_adapters = True
            else:
                layer._active_adapter = [name]
                layer._disable_adapters = False
        yield
    finally:
        for layer, (active, disabled) in zip(layers, saved):
            layer._active_adapter = active
            layer._disable_adapters = disabled


def _adapter_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.lora_\w+\.{re.escape(name)}(\.|$)")


def mark_trainable(model: nn.Module, adapter: str = ACTOR) -> list[nn.Parameter]:
    """Freeze everything but ``adapter``'s LoRA weights; return those, in order."""
    pattern = _adapter_pattern(adapter)
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(bool(pattern.search(name)))
        if p.requires_grad:
            trainable.append(p)
    if not trainable:
        raise ValueError(f"no LoRA parameters found for adapter {adapter!r}; check lora_config.target_modules")
    return trainable


def adapter_state_dict(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The (possibly sharded) parameters of one adapter, by state-dict key."""
    pattern = _adapter_pattern(adapter)
    return {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters() if pattern.search(n)}


@torch.no_grad()
def copy_adapter_(model: nn.Module, source: str, target: str) -> None:
    """Copy adapter ``source``'s weights into ``target`` (same shapes and sharding)."""
    src = adapter_state_dict(model, source)
    dst = adapter_state_dict(model, target)
    for key, p in dst.items():
        other = src[_adapter_pattern(target).sub(lambda m: m.group(0).replace(f".{target}", f".{source}", 1), key)]
        local_dst = p.to_local() if hasattr(p, "to_local") else p
        local_src = other.to_local() if hasattr(other, "to_local") else other
        local_dst.copy_(local_src)
