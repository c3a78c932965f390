"""The public surface of planner.memory: what __all__ exports, and nothing private leaks."""

from __future__ import annotations

import planner.memory as memory


def test_public_names_are_pinned():
    assert sorted(memory.__all__) == sorted(
        [
            "CachingAllocator",
            "Coefficients",
            "Estimate",
            "PhaseEstimate",
            "estimate",
            "DTYPE_BYTES",
            "resolve_workload",
            "expert_parallel_degrees",
            "tensor_parallel_degrees",
            "resolve_expert_chunk",
            "EXPERT_CHUNKS_MIB",
            "MARGIN_FRACTION",
            "check_ep",
            "tp_problem",
            "row_wise_experts",
            "vllm_floor",
            "vllm_budget_problem",
            "engine_rank_count",
            "engine_completions",
            "engine_rank_estimate",
            "node_host_bytes",
            "node_host_phase",
            "node_ranks",
            "ranks_per_node",
        ]
    )
    assert all(hasattr(memory, name) for name in memory.__all__)
    assert memory.EXPERT_CHUNKS_MIB == (64, 128, 256, 512)
    assert memory.DTYPE_BYTES == {"float32": 4, "bfloat16": 2, "float16": 2}
