"""Hugging Face generate as the trainer samples with it: the trainer's own rollout
(agilerl.algorithms.GRPO) and an engine rank's (agilerl.utils.remote_engine.HFGenerateEngine)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from agilerl.utils.logprobs import causal_lm

__all__ = ["neutral_generation_config"]


@contextlib.contextmanager
def neutral_generation_config(model: nn.Module) -> Iterator[None]:
    """The model's generation_config, for the duration, transformers' defaults: generate fills
    every sampling setting it is not given from the checkpoint's generation_config.json
    (Qwen2.5-Instruct ships repetition_penalty, top_k and top_p), which would sample the
    rollout from another distribution than the policy the objective scores. Only the settings
    the caller passes (GRPO's, and ``generation_kwargs``, the user's own) shape the sampling, as
    with vLLM, whose SamplingParams are built from the same few."""
    from transformers import GenerationConfig

    lm = causal_lm(model)
    shipped = lm.generation_config
    lm.generation_config = GenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = shipped
