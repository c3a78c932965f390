"""The spec's LoRA coverage read without PEFT agrees with PEFT itself, on a model of every family."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner import catalog
from planner.spec import _peft_lora, _plain_linear_lora


def _smallest_of_each_family() -> list[str]:
    best: dict[str, tuple[int, str]] = {}
    for name in catalog.names():
        e = catalog.entry(name)
        kind = str(e.config.get("model_type"))  # a multimodal entry's config is its text model's
        if kind not in best or e.published_params < best[kind][0]:
            best[kind] = (e.published_params, name)
    return sorted(name for _, name in best.values())


def _meta_model(name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(catalog.entry(name).config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


TARGETS = ["all-linear", ("q_proj", "v_proj"), ("o_proj", "down_proj", "up_proj", "gate_proj")]


@pytest.mark.parametrize("name", _smallest_of_each_family())
def test_plain_linear_reading_equals_peft_on_every_family(name):
    checked = 0
    for targets in TARGETS:
        fast = _plain_linear_lora(_meta_model(name), targets)
        if fast is None:  # declined: PEFT itself is what the spec uses, nothing to compare
            continue
        assert fast == _peft_lora(_meta_model(name), targets), (name, targets)
        checked += 1
    if name in ("Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M"):  # qwen2, llama
        assert checked == len(TARGETS)  # the plain dense families are read without PEFT


def test_packed_experts_and_regexes_are_left_to_peft():
    moe = _meta_model("allenai/OLMoE-1B-7B-0924")
    assert _plain_linear_lora(moe, "all-linear") is None  # packed experts and the router: PEFT wraps parameters
    dense = _meta_model("Qwen/Qwen2.5-0.5B")
    assert _plain_linear_lora(dense, r".*\.q_proj") is None  # a regex: PEFT matches it
    assert _plain_linear_lora(dense, ("no_such_module",)) is None  # nothing matched: PEFT's own error
    assert _plain_linear_lora(dense, ("mlp",)) is None  # a non-linear module named


def test_gpt2_conv1d_and_a_tied_head():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        with torch.device("meta"):
            return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128))

    fast = _plain_linear_lora(build(), "all-linear")
    assert fast == _peft_lora(build(), "all-linear")
    assert ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_attn", (1, 64, 192, 1)) in fast
    assert not any(n == "lm_head" for n, _, _ in fast)


def test_a_dense_config_json_is_planned_without_importing_peft(tmp_path):
    config = dict(catalog.entry("Qwen/Qwen2.5-0.5B").config)
    config["num_hidden_layers"] = 3  # no catalog entry has this content: the spec is built
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = (
        "import sys, os\n"
        f"os.environ['AGILERL_CACHE'] = {str(tmp_path / 'cache')!r}\n"
        "from planner.models import load_model_spec\n"
        f"spec = load_model_spec({str(tmp_path)!r})\n"
        "print(spec.num_layers, len(spec.lora_shapes('all-linear')), 'peft' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["3", str(3 * 7), "False"]
