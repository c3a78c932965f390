"""QLoRA with a real colocated vLLM engine: the engine runs the dequantised base with the adapters
merged (its own bf16 copy; merging into 4-bit would re-quantise the base every step)."""

from __future__ import annotations

import pytest
import torch

from tests.vllm._common import PROMPTS, engine_greedy, hf_greedy, learn_steps, vllm_agent

pytestmark = [pytest.mark.vllm, pytest.mark.qlora, pytest.mark.timeout(600)]


def test_weights_arrive_dequantised_with_the_adapters_merged():
    from tests.agilerl.algorithms._common import lora_state, make_agent
    from tests.agilerl.algorithms._qlora import dequantised_twin

    agent = vllm_agent(load_in_4bit=True, dtype="bfloat16")
    before = engine_greedy(agent)
    learn_steps(agent)
    after = engine_greedy(agent)
    assert after != before
    # The model the engine should run, built without bitsandbytes: every 4-bit weight dequantised,
    # the trained adapters on top, in bf16.
    twin = make_agent(actor_network=dequantised_twin(agent), model_name=None, dtype="bfloat16", max_output_tokens=6)
    trained = lora_state(agent)
    with torch.no_grad():
        for name, p in twin.model.named_parameters():
            if name in trained:
                p.copy_(trained[name])
    assert after == hf_greedy(twin, PROMPTS)
