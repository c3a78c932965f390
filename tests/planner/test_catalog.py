"""The built-in model catalog: entries, shipped specs, parameter counts and name lookup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner import catalog
from planner.catalog.build import VERSION_FIELDS, build_entry, relative_difference
from planner.catalog.build import main as build_main

NAMES = catalog.names()

REQUIRED = [
    "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B",
    "Qwen/Qwen3-0.6B-Base", "Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-4B-Base", "Qwen/Qwen3-8B-Base",
    "Qwen/Qwen3-14B-Base", "Qwen/Qwen3-32B",
    "Qwen/Qwen3-30B-A3B-Base", "Qwen/Qwen3-235B-A22B",
    "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.3-70B-Instruct",
    "mistralai/Mistral-7B-v0.3", "mistralai/Mixtral-8x7B-v0.1",
    "google/gemma-2-2b", "google/gemma-2-9b", "google/gemma-2-27b",
    "google/gemma-3-1b-pt", "google/gemma-3-4b-pt", "google/gemma-3-12b-pt",
    "google/gemma-3-27b-pt",
    "microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-medium-4k-instruct",
    "microsoft/phi-4", "microsoft/Phi-4-mini-instruct",
    "deepseek-ai/DeepSeek-V2-Lite", "allenai/OLMoE-1B-7B-0924",
]
MOE = ["Qwen/Qwen3-30B-A3B-Base", "Qwen/Qwen3-235B-A22B", "mistralai/Mixtral-8x7B-v0.1",
       "deepseek-ai/DeepSeek-V2-Lite", "allenai/OLMoE-1B-7B-0924"]


# -- the shipped specs ------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_shipped_spec_equals_a_fresh_build(name):
    shipped = catalog.load_spec(name)
    fresh = build_entry(catalog.entry(name))
    a, b = shipped.model_dump(exclude=VERSION_FIELDS), fresh.model_dump(exclude=VERSION_FIELDS)
    differ = sorted(k for k in a if a[k] != b[k])
    assert not differ, (f"{name}: shipped spec differs in {differ}; "
                        f"rebuild with `python -m planner.catalog.build {name}`")


def test_spec_files_are_exactly_the_entries():
    shipped = {p.name for p in catalog.SPECS_DIR.glob("*.json")}
    assert shipped == {catalog.entry(n).spec_path.name for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_total_params_match_the_published_figure(name):
    e, spec = catalog.entry(name), catalog.load_spec(name)
    diff = abs(spec.total_params - e.published_params)
    relative = relative_difference(spec.total_params, e.published_params)
    message = (f"{name}: built {spec.total_params:,} vs published {e.published_params:,} "
               f"({relative:+.2%}); fix the config")
    if e.published_precision is None:
        assert diff <= 0.01 * e.published_params, message
    else:
        # a coarse figure ("1.7B"): within its rounding, and only where 1% is too tight
        assert diff <= e.published_precision / 2, message
        assert diff > 0.01 * e.published_params, f"{name}: published_precision is not needed"
        assert e.published_note, f"{name}: say what the card states"


@pytest.mark.parametrize("name", NAMES)
def test_entry_is_well_formed(name):
    e = catalog.entry(name)
    assert e.source == f"https://huggingface.co/{e.name}/blob/main/config.json"
    assert e.published_source.startswith("https://")
    if e.published_source != f"https://huggingface.co/{e.name}":
        assert e.published_note, f"{name}: the figure is not from its model card; say which it is"
    assert "model_type" in e.config
    assert e.aliases and all(a == a.lower() and "/" not in a for a in e.aliases)
    assert catalog.load_spec(name).name == e.name


@pytest.mark.parametrize("name", catalog.names())
def test_every_config_passes_the_checks_the_trainer_and_planner_apply(name):
    from agilerl.utils.sources import check_causal_lm_type, check_config

    config = catalog.entry(name).config
    check_config(config, name)
    check_causal_lm_type(config, name)


def test_required_coverage():
    missing = [n for n in REQUIRED if n not in NAMES]
    assert not missing, f"catalog lacks {missing}"
    assert all(catalog.load_spec(n).is_moe for n in MOE)
    assert not any(catalog.load_spec(n).is_moe for n in REQUIRED if n not in MOE)
    for size in ("4b", "12b", "27b"):  # the text models of the multimodal Gemma 3 checkpoints
        assert catalog.entry(f"google/gemma-3-{size}-pt").config["model_type"] == "gemma3_text"
    assert catalog.load_spec("gemma-2-9b").final_logit_softcapping == 30.0
    # MLA as Hugging Face runs it caches each head's decompressed key (128 nope + 64 rope)
    # and value (128): 2 x kv_dim = 16 heads x (192 + 128).
    assert 2 * catalog.load_spec("deepseek-v2-lite").block(1).attention.kv_dim == 16 * (192 + 128)
    # Sliding windows: Gemma 2 alternates local (4096) and global layers.
    assert [b.attention.sliding_window for b in catalog.load_spec("gemma-2-9b").blocks[:2]] == [4096, None]


def test_using_the_catalog_does_not_import_torch():
    code = ("import sys\n"
            "import planner.catalog as c\n"
            "specs = [c.load_spec(n) for n in c.names()]\n"
            "c.resolve('qwen2.5-7b'); c.suggest('qwen2-7b')\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\n"
            "print(len(specs), heavy)\n"
            "sys.exit(1 if heavy else 0)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[0] == str(len(NAMES))


def test_build_check_mode_compares_without_writing(capsys):
    assert build_main(["--check", "qwen2.5-0.5b"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-0.5B" in out and "494,032,768" in out


# -- lookup -----------------------------------------------------------------------------------

def test_resolve_hub_ids_any_case_and_aliases():
    assert catalog.resolve("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("qwen/qwen2.5-7b") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("  QWEN2.5-7B ") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("qwen2.5-7b-instruct") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("llama-3.1-8b") == "meta-llama/Llama-3.1-8B"
    assert catalog.resolve("qwen3-30b-a3b") == "Qwen/Qwen3-30B-A3B-Base"
    assert catalog.resolve("gemma-3-27b-it") == "google/gemma-3-27b-pt"
    assert catalog.resolve("Qwen/Qwen2-7B") is None
    assert catalog.resolve("") is None
    assert catalog.entry("mixtral-8x7b").name == "mistralai/Mixtral-8x7B-v0.1"
    assert catalog.load_spec("phi-4").name == "microsoft/phi-4"


def test_every_alias_and_id_resolves_to_its_entry():
    for name in NAMES:
        assert catalog.resolve(name) == name
        for alias in catalog.entry(name).aliases:
            assert catalog.resolve(alias) == name


@pytest.mark.parametrize("typo, expected", [
    ("qwen2.5-7", "Qwen/Qwen2.5-7B"),
    ("Qwen2-7B", "Qwen/Qwen2.5-7B"),
    ("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2.5-7B"),
    ("lama-3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("mixtral-8x7", "mistralai/Mixtral-8x7B-v0.1"),
    ("gemma2-9b-it", "google/gemma-2-9b"),
    ("deepseek-v2-light", "deepseek-ai/DeepSeek-V2-Lite"),
])
def test_suggest_finds_the_intended_model(typo, expected):
    close = catalog.suggest(typo)
    assert expected in close[:3], close
    assert len(close) <= 5 and len(set(close)) == len(close)


def test_suggest_respects_n_and_finds_nothing_for_nonsense():
    assert len(catalog.suggest("qwen", n=2)) <= 2
    assert catalog.suggest("zzzzzzzz") == []


def test_unknown_names_raise_key_error_with_suggestions():
    with pytest.raises(KeyError, match=r"Qwen2-7B.*not in the model catalog.*Qwen/Qwen2\.5-7B"):
        catalog.entry("Qwen2-7B")
    with pytest.raises(KeyError, match="did you mean"):
        catalog.load_spec("qwen2.5-7")
    with pytest.raises(KeyError, match="known models: Qwen/Qwen2.5-0.5B"):
        catalog.entry("zzzzzzzz")


def test_entries_are_copies():
    e = catalog.entry("llama-3.1-8b")
    e.config["rope_scaling"]["factor"] = 99.0
    assert catalog.entry("llama-3.1-8b").config["rope_scaling"]["factor"] == 8.0
    assert [x.name for x in catalog.entries()] == NAMES
