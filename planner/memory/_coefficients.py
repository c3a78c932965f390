"""The constants of the estimate that depend on kernels and devices, not on shapes.

Everything the code keeps is counted (planner.memory._tape and the other term
modules); what is left here is what a count cannot give: buffers of kernels
the trainer does not own (FSDP's, the experts' dispatch), and the GPU-only terms
(the caching allocator's slack, what a sleeping vLLM engine leaves on the device,
NCCL). benchmarks/moe_memory.py fits the ``moe_*`` ones on one half of its probes;
benchmarks/gpu_public.py fits the GPU terms on one half of the public GPU rows
(planner/coefficients_cuda.json) and reports the other half.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..hardware import GIB, MIB


class Coefficients(BaseModel):
    """Kernel- and device-dependent constants of the estimate (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def from_json(cls, text: str) -> Coefficients:
        """Coefficients from a JSON file, ignoring fields an older release wrote (its fitted
        activation factors are now counted). ValueError for anything else than a JSON object of
        finite, non-negative numbers."""
        import json

        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object of coefficients, got a {type(data).__name__}")
        return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})

    @model_validator(mode="after")
    def _finite_and_not_negative(self) -> Coefficients:
        import math

        for name in type(self).model_fields:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} = {value}: every coefficient is a finite number >= 0")
        return self

    # Mixture-of-experts blocks (planner.memory._moe). Per (token, expert) row:
    moe_rows_saved: Annotated[
        float, Field(description="chunked / expert-parallel experts: saved per routed row, x hidden_size")
    ] = 2.0
    moe_chunk: Annotated[
        float, Field(description="one expert chunk's recompute in backward, x its counted tensors")
    ] = 1.0
    moe_dispatch: Annotated[
        float,
        Field(
            description="row-wise experts: buffers in the dispatch's backward beyond the four row gradients, "
            "x routed rows of a token block x hidden (none on CPU probes)"
        ),
    ] = 0.0
    moe_stack_grad: Annotated[
        float,
        Field(
            description="Hugging Face experts with LoRA on the stacks: copies of PEFT's merged down stack "
            "made in its backward (its gradient)"
        ),
    ] = 1.0
    # FSDP2: buffers beside the backward's gathered window (fraction of the largest edge unit).
    all_gather_overlap: Annotated[
        float,
        Field(
            description="FSDP buffers beside the gathered window, x the largest of the embeddings, head and root units"
        ),
    ] = 1.0
    # GPU-only terms.
    nccl_bytes: Annotated[int, Field(description="NCCL communicator buffers per rank (multi-GPU)")] = 256 * MIB
    allocator_slack_fraction: Annotated[float, Field(description="caching-allocator fragmentation, x allocated")] = 0.07
    vllm_sleep_residual_bytes: Annotated[int, Field(description="what a sleeping vLLM engine keeps on the GPU")] = (
        512 * MIB
    )
    vllm_outside_budget_bytes: Annotated[
        int,
        Field(
            description="what an awake vLLM engine allocates beyond gpu_memory_utilization "
            "(CUDA graph and sampler buffers)"
        ),
    ] = 512 * MIB
    host_process_bytes: Annotated[int, Field(description="host memory of a trainer process before the model")] = 2 * GIB
