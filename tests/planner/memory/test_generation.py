"""planner.memory._generation: KV cache and vLLM terms."""

from __future__ import annotations

from planner.hardware import GPUS
from planner.memory import Coefficients
from planner.memory._generation import (
    host_vllm_weight_bytes,
    kv_cache_bytes,
    vllm_asleep_bytes,
    vllm_awake_bytes,
)

from .conftest import make_context


def test_kv_cache_caps_sliding_window_layers(ple_spec):
    ctx = make_context(ple_spec)  # 8 completions a rank, bf16
    kv_dim = ple_spec.block(0).attention.kv_dim
    # Three layers capped at their 1,024-token window, one global layer.
    assert kv_cache_bytes(ctx, 2000) == 2 * 8 * kv_dim * 2 * (3 * 1024 + 2000)
    assert kv_cache_bytes(ctx, 100) == 2 * 8 * kv_dim * 2 * 4 * 100




def test_vllm_awake_asleep_and_offloaded(dense_spec):
    gpu = GPUS["H100-80GB"]
    ctx = make_context(dense_spec, gpu=gpu, generation="vllm", vllm_gpu_memory_utilization=0.4)
    assert vllm_awake_bytes(ctx) == int(0.4 * gpu.memory_bytes)
    assert vllm_asleep_bytes(ctx) == Coefficients().vllm_sleep_residual_bytes
    assert host_vllm_weight_bytes(ctx) == dense_spec.total_params * 2
    assert vllm_asleep_bytes(make_context(dense_spec, generation="vllm")) == 0  # no residue on a CPU run
    hf = make_context(dense_spec, gpu=gpu)
    assert vllm_awake_bytes(hf) == vllm_asleep_bytes(hf) == host_vllm_weight_bytes(hf) == 0
