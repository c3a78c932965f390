"""Rollout engines: a small protocol, implemented by a colocated vLLM engine.

The trainer only needs four operations (DESIGN.md decision 15): generate
completions for token-id prompts, sleep (free GPU memory for training), wake
up, and load new weights. Tests drive the trainer through a fake engine; the
vLLM implementation below follows vLLM's public ``LLM`` API and is not yet
validated by a measurement (vLLM cannot be installed beside the CPU torch used
here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from .algo_utils import VLLMConfig

__all__ = ["RolloutEngine", "VLLMEngine", "require_vllm"]


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float, seed: int | None = None
    ) -> list[list[int]]:
        """Completion token ids (without the prompt) for each prompt, in order."""

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Reallocate what sleep freed: everything, or only ``tags`` ("weights", "kv_cache")."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights (full, merged, Hugging Face names)."""


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "vllm_config needs vLLM, which is not installed: `pip install 'agilerl-fsdp-planner[vllm]'` "
            "(CUDA machines only). Leave vllm_config=None to generate with Hugging Face generate."
        ) from err
    return vllm


class VLLMEngine:
    """A colocated vLLM engine on this rank's GPU (not yet validated by a measurement)."""

    def __init__(self, model_path: str, config: VLLMConfig, *, dtype: str, seed: int, max_model_len: int | None) -> None:
        vllm = require_vllm()
        self.config = config
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            tensor_parallel_size=config.tensor_parallel_size,
            enforce_eager=config.enforce_eager,
            enable_sleep_mode=config.sleep_mode,
            max_model_len=config.max_model_len or max_model_len,
            distributed_executor_backend="external_launcher",
        )
        self._sampling = vllm.SamplingParams

    def generate(self, prompts, *, max_tokens, temperature, seed=None):
        params = self._sampling(max_tokens=max_tokens, temperature=temperature, seed=seed)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def sleep(self, level: int) -> None:
        if self.config.sleep_mode:
            self.llm.sleep(level=level)

    def wake_up(self, tags=None) -> None:
        if self.config.sleep_mode:
            self.llm.wake_up(tags=list(tags)) if tags else self.llm.wake_up()

    def load_weights(self, weights):
        weights = list(weights)
        self.llm.collective_rpc("load_weights", kwargs={"weights": weights}) if hasattr(
            self.llm, "collective_rpc"
        ) else self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)
