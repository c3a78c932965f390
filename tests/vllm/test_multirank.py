"""A real vLLM engine per rank under torchrun (2 gloo ranks): data parallel and FSDP2.

Each rank's engine starts with ``distributed_executor_backend="external_launcher"`` inside the
trainer's process group. Under FSDP2 the sync streams the merged weights module by module: the
test counts how many sharded parameters are unsharded at each tensor the engine receives.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.tensor import DTensor

from agilerl.distributed import FSDPConfig
from tests._dist import REPO_ROOT, DistCases
from tests.vllm._common import VLLM_TINY, engine_greedy, hf_greedy, learn_steps, vllm_agent

pytestmark = pytest.mark.vllm

cases = DistCases(__name__, nproc=2, launch_timeout_s=420)


def all_gather_object(value):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


FP32_SHARDED = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def _weights_arrive(agent):
    before = engine_greedy(agent)
    assert before == hf_greedy(agent)
    learn_steps(agent)
    after = engine_greedy(agent)
    assert after == hf_greedy(agent)
    assert after != before
    return after


@cases.case
def data_parallel_one_engine_per_rank(ctx):
    agent = vllm_agent(dtype="float32")
    assert not agent.sharded and agent.data_parallel_ranks == 2
    after = _weights_arrive(agent)
    # Data parallel keeps the ranks' weights equal, so their engines agree.
    first, second = all_gather_object(after)
    assert first == second


@cases.case
def fsdp2_sync_gathers_one_module_at_a_time(ctx):
    _sync_gathers_one_module_at_a_time(FSDPConfig(**FP32_SHARDED))


@cases.case
def fsdp2_sync_gathers_one_module_at_a_time_after_forwards_that_kept_every_unit(ctx):
    # reshard_after_forward=False: the greedy HF forward before the sync leaves every unit gathered
    _sync_gathers_one_module_at_a_time(FSDPConfig(**{**FP32_SHARDED, "reshard_after_forward": False}))


def _sync_gathers_one_module_at_a_time(config: FSDPConfig) -> None:
    agent = vllm_agent(dtype="float32", fsdp_config=config)
    assert agent.sharded and any(isinstance(p, DTensor) for p in agent.model.parameters())
    sharded = {n for n, p in agent.model.named_parameters() if isinstance(p, DTensor)}
    engine = agent.engine
    load = engine.load_weights
    seen = {"most": 0, "tensors": 0}

    def counting(weights):
        def watched():
            for name, tensor in weights:
                full_now = sum(
                    1 for n, p in agent.model.named_parameters() if n in sharded and not isinstance(p, DTensor)
                )
                seen["most"] = max(seen["most"], full_now)
                seen["tensors"] += 1
                yield name, tensor

        load(watched())

    engine.load_weights = counting
    try:
        after = _weights_arrive(agent)
    finally:
        engine.load_weights = load
    # One linear, its bias and its two LoRA matrices at most, never the whole model.
    assert 0 < seen["most"] <= 4 < len(sharded), seen
    assert seen["tensors"] > 0
    first, second = all_gather_object(after)
    assert first == second


test_dist = cases.pytest_test()


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_manifest_with_vllm_trains_under_torchrun_with_fsdp2(tmp_path):
    manifest = tmp_path / "vllm.yaml"
    manifest.write_text(
        textwrap.dedent(f"""\
        algorithm:
          model_name: "{VLLM_TINY}"
          group_size: 4
          max_output_tokens: 6
          max_model_len: 64
          dtype: float32
          fsdp: {{param_dtype: float32, reduce_dtype: float32}}
          vllm: {{kv_cache_memory_bytes: 33554432, max_num_seqs: 16, enforce_eager: true}}
        lora: {{r: 4, alpha: 8}}
        training: {{max_steps: 2, rollout_batch_size: 2, training_gpus_per_agent: 2, population_size: 2}}
        """)
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "-m",
            "agilerl.train",
            str(manifest),
            "--device",
            "cpu",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "built 2 GRPO agent(s) on 2 rank(s)" in run.stdout
    for agent in (0, 1):
        assert f"agent {agent} step    2" in run.stdout, run.stdout
