"""The probe measures a rollout through the real vLLM engine: the trainer's phases around it
(rollout, sync) and the engine's own KV cache report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm._common import VLLM_TINY

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(600)]

KV_BYTES = 32 << 20


def test_a_probe_rollout_runs_the_engine_and_reports_its_kv_cache():
    from agilerl.algorithms.core.loading import resolve_model_source
    from planner.probe import ProbeRequest, run_probe
    from planner.workload import Workload

    workload = Workload(
        prompts_per_step=2,
        group_size=2,
        prompt_tokens=16,
        completion_tokens=8,
        micro_batch_size_per_gpu=4,
        logprob_chunk_size=64,
        gradient_checkpointing=False,
        lora_rank=4,
        lora_alpha=8,
        weights_dtype="bfloat16",
        generation="vllm",
        vllm_max_num_seqs=8,
        vllm_kv_cache_memory_bytes=KV_BYTES,
        vllm_enforce_eager=True,
        padded_batches=False,
    )
    measurement = run_probe(
        ProbeRequest(model=VLLM_TINY, workload=workload, device="cpu", generate=True, timed_steps=1, timeout_s=500)
    )
    assert measurement.ok, measurement.failure
    rank = measurement.ranks[0]
    assert {"rollout", "sync", "learn"} <= set(rank.phases)
    report = rank.engine
    assert report["kv_cache_bytes"] == KV_BYTES  # the size asked for, allocated
    # Blocks x tokens per block x (K and V of every layer, bf16) is the same size, from the model's config.
    config = json.loads((Path(resolve_model_source(VLLM_TINY)) / "config.json").read_text())
    kv_dim = config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * kv_dim * 2
    assert report["kv_cache_blocks"] * report["block_size"] * per_token == KV_BYTES
