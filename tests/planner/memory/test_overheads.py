"""planner.memory._overheads: GPU-only terms."""

from __future__ import annotations

from planner.hardware import GPUS
from planner.memory import Coefficients
from planner.memory._overheads import gpu_overheads

from .conftest import make_context


def test_gpu_terms_only_on_gpus(dense_spec):
    k = Coefficients()
    gpu = GPUS["A100-80GB"]
    components = {"weights": 5 * 10**9, "activations": 10**9, "vllm": 10**9}
    assert gpu_overheads(make_context(dense_spec), components) == {}
    # slack only on what the allocator hands out and takes back within a step
    assert gpu_overheads(make_context(dense_spec, gpu=gpu), components) == {
        "cuda_context": gpu.cuda_context_bytes,
        "allocator_slack": int(10**9 * k.allocator_slack_fraction),
        "comm_buffers": k.nccl_bytes,
    }
    single = gpu_overheads(make_context(dense_spec, gpu=gpu, gpus=1), components)
    assert "comm_buffers" not in single  # no NCCL on one GPU
