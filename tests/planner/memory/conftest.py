"""Tiny specs and a context builder for the per-term tests of planner.memory."""

from __future__ import annotations

import pytest

from agilerl.distributed import FSDPConfig
from planner.hardware import CPU_DEVICE, Cluster
from planner.memory import Coefficients
from planner.memory._context import Context, build_context
from planner.models import load_model_spec
from planner.workload import Workload

DENSE = "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096"
MOE = (
    "tiny:qwen3_moe?hidden_size=128&moe_intermediate_size=512&num_experts=8&num_experts_per_tok=2"
    "&num_layers=2&num_heads=4&num_kv_heads=2&vocab_size=1024"
)
# Three sliding-window layers and one global one; tied embeddings; AltUp's 4 streams.
PLE = (
    "tiny:gemma3n?hidden_size=64&intermediate_size=128&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=512"
    "&vocab_size_per_layer_input=4096&hidden_size_per_layer_input=16"
)
WL = Workload(
    prompts_per_step=2,
    group_size=8,
    prompt_tokens=64,
    completion_tokens=64,
    micro_batch_size_per_gpu=2,
    logprob_chunk_size=128,
    gradient_checkpointing=True,
    lora_rank=8,
    lora_dropout=0.0,  # the real layers are built without it; dropout's terms have tests of their own
    weights_dtype="bfloat16",
    padded_batches=False,  # rows of one length; the padded-batch mask has tests of its own
    share_prompt_prefix=False,
)  # every row whole; the shared-prefix forward has tests of its own


@pytest.fixture(scope="package")
def dense_spec():
    return load_model_spec(DENSE)


@pytest.fixture(scope="package")
def moe_spec():
    return load_model_spec(MOE)


@pytest.fixture(scope="package")
def ple_spec():
    return load_model_spec(PLE)


def make_context(
    spec,
    workload: Workload = WL,
    *,
    gpus: int = 2,
    fsdp: FSDPConfig | None = None,
    gpu=CPU_DEVICE,
    coefficients: Coefficients | None = None,
    **workload_update,
) -> Context:
    if workload_update:
        workload = workload.model_copy(update=workload_update)
    return build_context(
        spec, workload, Cluster(gpu=gpu, num_gpus=gpus), fsdp, coefficients=coefficients or Coefficients()
    )
