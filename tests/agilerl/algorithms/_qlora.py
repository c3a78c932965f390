"""Builders for the QLoRA tests: a 4-bit agent and its independently built, dequantised bf16 twin."""

from __future__ import annotations

import bitsandbytes as bnb
import torch

from tests.agilerl.algorithms._common import lora_state, make_agent

QLORA = dict(load_in_4bit=True, dtype="bfloat16", beta=0.1, use_separate_reference_adapter=False)


def four_bit_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def dequantised_twin(agent) -> torch.nn.Module:
    """A plain bf16 causal LM with the agent's base weights, every 4-bit one dequantised (no bitsandbytes layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(agent.model_source)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    base = agent.model.get_base_model()
    state = {}
    for name, module in base.named_modules():
        clean = name.replace(".base_layer", "")
        if isinstance(module, bnb.nn.Linear4bit):
            state[f"{clean}.weight"] = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            if module.bias is not None:
                state[f"{clean}.bias"] = module.bias.detach()
    for name, p in base.named_parameters():
        clean = name.replace(".base_layer", "")
        if ".lora_" not in name and clean not in state and not isinstance(p, bnb.nn.Params4bit):
            state[clean] = p.detach()
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied lm_head
    twin.tie_weights()
    return twin


def pair(**overrides):
    """A QLoRA agent and its dequantised twin with the same adapters, B drawn non-zero so that the
    actor differs from the reference (disabled adapters) and the KL term is not zero."""
    qlora = make_agent(**QLORA, **overrides)
    twin = make_agent(actor_network=dequantised_twin(qlora), model_name=None, dtype="bfloat16", beta=0.1, **overrides)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for agent in (qlora, twin):
            g.manual_seed(5)
            for name, p in sorted(agent.model.named_parameters()):
                if ".lora_B.actor." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    start = lora_state(qlora)
    for k, v in lora_state(twin).items():  # the same adapters
        assert torch.equal(v, start[k]), k
    return qlora, twin
