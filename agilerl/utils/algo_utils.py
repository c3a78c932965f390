"""Small configuration pieces shared by the LLM algorithms."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["VLLMConfig"]


class VLLMConfig(BaseModel):
    """A colocated vLLM engine for rollouts (one engine per trainer rank).

    Not yet validated by a measurement: vLLM cannot be installed beside the
    CPU torch build the tests run on, so this path is exercised through the
    engine protocol with a fake engine only.
    """

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: Annotated[
        float,
        Field(gt=0.0, le=1.0, description="Fraction of each GPU's total memory vLLM may take (weights, KV cache, CUDA graphs)."),
    ] = 0.3
    max_num_seqs: Annotated[
        int, Field(ge=1, description="Most sequences vLLM schedules at once.")
    ] = 256
    sleep_mode: Annotated[
        bool,
        Field(description="Put the engine to sleep between rollouts so training can use its memory."),
    ] = True
    sleep_level: Annotated[
        Literal[1, 2],
        Field(description="1 moves weights to CPU and drops the KV cache; 2 drops both (weights are re-synced on wake)."),
    ] = 1
    tensor_parallel_size: Annotated[
        int, Field(ge=1, description="GPUs one engine spans with tensor parallelism.")
    ] = 1
    enforce_eager: Annotated[
        bool, Field(description="Disable CUDA graphs (saves their ~2 GiB pool, slower decoding).")
    ] = False
    max_model_len: Annotated[
        int | None, Field(ge=1, description="Longest prompt + completion the engine accepts; None uses the model's.")
    ] = None
