"""A model's positions: max_position_embeddings, stretched by its rope scaling's factor.

The trainer's max_model_len check, vLLM's engine check and the planner read them from one rule
(agilerl.utils.sources.model_positions); vLLM derives its own default max_model_len the same way.
"""

from __future__ import annotations

import json

import pytest

from agilerl.utils.sources import model_positions, rope_position_factor

LLAMA = {"model_type": "llama", "max_position_embeddings": 4096}


@pytest.mark.parametrize(
    "rope, positions",
    [
        ({}, 4096),
        # config.json as transformers 4 wrote it: "type" or "rope_type"
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2}}, 8192),
        # transformers 5's rope_parameters, one set
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, 8192),
        # one set per layer type: the least stretch of those that stretch
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                }
            },
            32768,
        ),
        # these give max_position_embeddings stretched already
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512}}, 4096),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}, 4096),
        (
            {"rope_scaling": {"rope_type": "deepseek_yarn", "factor": 40, "original_max_position_embeddings": 4096}},
            4096,
        ),
        ({"rope_scaling": {"type": "longrope", "long_factor": [2.0], "short_factor": [1.0]}}, 4096),
        ({"rope_scaling": {"rope_type": "default"}}, 4096),
        ({"rope_scaling": None}, 4096),
        # any other scaling's factor stretches them (Gemma 4's proportional, say), and one below 1
        # shrinks them, as vLLM reads it: a longer max_model_len would pass here and fail there
        ({"rope_parameters": {"rope_type": "proportional", "factor": 4.0}}, 16384),
        ({"rope_scaling": {"type": "linear", "factor": 0.5}}, 2048),
        # a set with no type and a factor, as vLLM multiplies it too
        ({"rope_scaling": {"factor": 2.0}}, 8192),
    ],
    ids=[
        "none",
        "v4-linear",
        "v4-dynamic",
        "v5-linear",
        "v5-per-layer",
        "llama3",
        "yarn",
        "deepseek-yarn",
        "longrope",
        "default",
        "null",
        "proportional",
        "below-1",
        "untyped",
    ],
)
def test_a_rope_scalings_factor_stretches_the_positions_unless_they_count_it_already(rope, positions):
    assert model_positions({**LLAMA, **rope}) == positions


def test_gemma_3s_positions_count_its_linear_factor_already():
    """Gemma 3's 131072 positions are stretched already (its config says linear, factor 8), as
    vLLM reads them; its text config inside a multimodal one says the same."""
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    assert model_positions(text) == 131072
    assert model_positions({"model_type": "gemma3", "text_config": text}) == 131072
    assert rope_position_factor({**text, "model_type": "llama"}) == 8.0  # the same scaling, another model


def test_a_multimodal_configs_positions_are_its_text_models():
    outer = {
        "model_type": "llava",
        "text_config": {**LLAMA, "hidden_size": 64, "rope_scaling": {"type": "linear", "factor": 2}},
    }
    assert model_positions(outer) == 8192


@pytest.mark.parametrize("value", [None, 0, "4096", True])
def test_positions_a_config_does_not_give_are_unknown(value):
    assert model_positions({"model_type": "llama", "max_position_embeddings": value}) is None


def test_the_engine_checks_vllm_max_model_len_against_the_stretched_positions(tmp_path):
    from agilerl.utils.engine import model_max_len

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    assert model_max_len(str(tmp_path)) == (8192, "max_position_embeddings=4096 x its rope scaling's factor 2")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert model_max_len(str(tmp_path)) == (4096, "max_position_embeddings=4096")
    assert model_max_len(str(tmp_path / "missing")) is None
