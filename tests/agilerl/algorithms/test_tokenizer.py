"""The trainer loads a saved tokenizer as its tokenizer.json says, whatever the model type."""

from __future__ import annotations

import json

import pytest

from agilerl.algorithms.core.loading import load_tokenizer
from agilerl.utils.tiny import char_tokenizer, save_tiny_model

TEXTS = ["what is 12 + 30?", "hello world", "a  b"]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    # A qwen2 directory whose tokenizer is not Qwen2's: what a user's own tokenizer looks like.
    return save_tiny_model(
        tmp_path_factory.mktemp("tok") / "m",
        "qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
    )


def test_saved_generic_tokenizer_keeps_its_pre_tokenizer(qwen2_dir):
    reference = char_tokenizer()
    loaded = load_tokenizer(str(qwen2_dir))
    for text in TEXTS:
        # Every character is one token, spaces included.
        assert loaded(text)["input_ids"] == reference(text)["input_ids"]
        assert len(loaded(text)["input_ids"]) == len(text)
        assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.padding_side == "left"
    assert (loaded.pad_token, loaded.eos_token_id) == ("<pad>", reference.eos_token_id)


def test_model_specific_class_still_goes_through_auto_tokenizer(qwen2_dir, tmp_path):
    # A config naming a real class is left to AutoTokenizer: here that class's rebuild
    # drops the spaces, which is the behaviour the generic path avoids.
    import shutil

    other = tmp_path / "named"
    shutil.copytree(qwen2_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(str(other))
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert len(loaded("hello world")["input_ids"]) < len("hello world")


def test_agent_without_a_tokenizer_loads_the_saved_one(qwen2_dir):
    # GRPO(model_name=...) and agilerl.train both come through load_tokenizer.
    from agilerl.algorithms import GRPO

    agent = GRPO(
        str(qwen2_dir),
        pad_token_id=0,
        pad_token="<pad>",
        batch_size=1,
        group_size=2,
        max_output_tokens=2,
        dtype="float32",
        device="cpu",
    )
    assert agent.tokenizer("hello world")["input_ids"] == char_tokenizer()("hello world")["input_ids"]
