"""Lazy checkpoint reading: PEFT key views and transformers' MoE packing, against from_pretrained."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agilerl.utils.checkpoint_io import (
    ChainedState,
    ConvertedCheckpoint,
    LazyCheckpoint,
    PeftKeyView,
)
from agilerl.utils.tiny import save_tiny_model


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2"])
def test_converted_checkpoint_equals_from_pretrained(tmp_path, arch):
    save_tiny_model(tmp_path, arch, hidden_size=32, intermediate_size=64, num_layers=2)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    raw = LazyCheckpoint(tmp_path)
    if arch != "qwen2":  # MoE checkpoints store experts one by one; the model packs them
        assert not any("gate_up_proj" in k for k in raw) and any(".experts.0." in k for k in raw)
    converted = ConvertedCheckpoint(raw, arch)
    assert set(converted) == set(expected) - {"lm_head.weight"} or set(converted) == set(expected)
    for key in converted:
        assert torch.equal(converted[key], expected[key]), key


def test_peft_key_view_collapses_nested_base_layers(tmp_path):
    save_tiny_model(tmp_path, "qwen3_moe", hidden_size=32, intermediate_size=64, num_layers=1)
    converted = ConvertedCheckpoint(LazyCheckpoint(tmp_path), "qwen3_moe")
    key = "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"
    view = PeftKeyView(converted, [key, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert torch.equal(view[key], converted["model.layers.0.mlp.experts.gate_up_proj"])
    chained = ChainedState(view, {"extra": torch.ones(1)})
    assert len(chained) == 3 and torch.equal(chained["extra"], torch.ones(1))
