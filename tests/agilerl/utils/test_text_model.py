"""Multimodal checkpoints: the planner plans their text model, the trainer refuses them in one
line, and agilerl.utils.text_model exports the text model the trainer then fine-tunes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from agilerl.utils.text_model import export_text_model
from agilerl.utils.tiny import char_tokenizer

TOKENIZER = char_tokenizer()


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny random Gemma 3 vision-language checkpoint (SigLIP tower + Gemma 3 text model)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=len(TOKENIZER) + 8,
        sliding_window=16,
    )
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=len(TOKENIZER) + 7
        )
    )
    path = tmp_path_factory.mktemp("gemma3-vlm")
    model.save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def exported(multimodal, tmp_path_factory):
    path, _ = multimodal
    return export_text_model(str(path), tmp_path_factory.mktemp("gemma3-text"), dtype="float32")


def test_the_export_keeps_the_language_model_bit_for_bit(multimodal, exported):
    from transformers import AutoModelForCausalLM

    _, full = multimodal
    text = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(text).__name__ == "Gemma3ForCausalLM"
    language = full.model.language_model
    expected = sum(p.numel() for p in language.parameters())
    assert sum(p.numel() for p in text.model.parameters()) == expected
    assert sum(p.numel() for p in full.parameters()) > expected  # the vision tower is left behind
    ids = torch.randint(4, len(TOKENIZER), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(text(input_ids=ids).logits, full(input_ids=ids).logits)
    assert (exported / "tokenizer.json").exists()


def test_the_planner_plans_the_text_model_of_a_multimodal_checkpoint(multimodal, exported):
    from planner.hardware import Cluster, gpu_by_name
    from planner.memory import estimate
    from planner.models import load_model_spec
    from planner.workload import Workload

    path, full = multimodal
    spec, text_spec = load_model_spec(str(path)), load_model_spec(str(exported))
    assert spec.text_model_of == "Gemma3ForConditionalGeneration" and text_spec.text_model_of is None
    assert spec.total_params == text_spec.total_params == sum(p.numel() for p in full.model.language_model.parameters())
    est = estimate(spec, Workload(), Cluster(gpu=gpu_by_name("H100-80GB"), num_gpus=1), None)
    assert any("vision/audio encoders are not counted" in n for n in est.notes)


def test_the_trainer_refuses_a_multimodal_checkpoint_and_trains_its_export(multimodal, exported):
    from tests.agilerl.algorithms._common import make_agent

    path, _ = multimodal
    with pytest.raises(
        ValueError,
        match=r"Gemma3ForConditionalGeneration is a multimodal model \(vision_config "
        r"beside its text_config\).*python -m agilerl.utils.text_model",
    ):
        make_agent(model_name=str(path))
    agent = make_agent(model_name=str(exported))
    assert type(agent.model.get_base_model()).__name__ == "Gemma3ForCausalLM"


def test_exporting_a_text_checkpoint_is_refused_in_one_line(exported, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "agilerl.utils.text_model", str(exported), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a multimodal checkpoint" in lines[0], run.stderr
