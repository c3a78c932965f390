"""Type names shared across the package (no torch import)."""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["HFModule", "AttnImplementation"]

#: A Hugging Face or PEFT module read by duck typing: a router, a packed experts module, an
#: attention or decoder block. Its attributes are its family's (``top_k``, ``num_experts``,
#: ``gate_up_proj``, ``lora_A``, ...), which ``nn.Module``'s typing cannot know (it types every
#: unknown attribute as ``Tensor | Module``), and the runtime attaches its own state to it
#: (``_agilerl_*``). Code that reads such attributes takes an ``HFModule``.
HFModule = Any

#: The attention kernels a run is planned and trained with (transformers' ``attn_implementation``):
#: SDPA and FlashAttention never hold the ``batch x heads x length^2`` scores, eager does.
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
