"""The built-in model catalog: entries, shipped specs, parameter counts and name lookup."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

import pytest

from planner import catalog
from planner.catalog.build import VERSION_FIELDS, build_entry, relative_difference
from planner.catalog.build import main as build_main

NAMES = catalog.names()

REQUIRED = [
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-3B",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen2.5-14B",
    "Qwen/Qwen2.5-32B",
    "Qwen/Qwen2.5-72B",
    "Qwen/Qwen3-0.6B-Base",
    "Qwen/Qwen3-1.7B-Base",
    "Qwen/Qwen3-4B-Base",
    "Qwen/Qwen3-8B-Base",
    "Qwen/Qwen3-14B-Base",
    "Qwen/Qwen3-32B",
    "Qwen/Qwen3-30B-A3B-Base",
    "Qwen/Qwen3-235B-A22B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.3-70B-Instruct",
    "mistralai/Mistral-7B-v0.3",
    "mistralai/Mixtral-8x7B-v0.1",
    "google/gemma-2-2b",
    "google/gemma-2-9b",
    "google/gemma-2-27b",
    "google/gemma-3-1b-pt",
    "google/gemma-3-4b-pt",
    "google/gemma-3-12b-pt",
    "google/gemma-3-27b-pt",
    "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/Phi-3-medium-4k-instruct",
    "microsoft/phi-4",
    "microsoft/Phi-4-mini-instruct",
    "deepseek-ai/DeepSeek-V2-Lite",
    "allenai/OLMoE-1B-7B-0924",
]
# The first names a GRPO user types: post-trained, instruct and distilled checkpoints.
FIRST_TYPED = [
    "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-30B-A3B",
    "meta-llama/Llama-3.1-8B-Instruct",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "google/gemma-3-4b-it",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "openai/gpt-oss-20b",
]
# One of each family RL users run, post-trained where there is a post-trained release.
FAMILIES = {
    "Qwen3": [
        "Qwen/Qwen3-0.6B",
        "Qwen/Qwen3-1.7B",
        "Qwen/Qwen3-4B",
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-14B",
        "Qwen/Qwen3-32B",
        "Qwen/Qwen3-30B-A3B",
        "Qwen/Qwen3-235B-A22B",
        "Qwen/Qwen3-4B-Instruct-2507",
    ],
    "Qwen2.5": ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-Math-7B-Instruct", "Qwen/Qwen2.5-Coder-7B-Instruct"],
    "DeepSeek-R1-Distill": [
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
    ],
    "Llama": [
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.2-1B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct",
    ],
    "Gemma 3": ["google/gemma-3-1b-it", "google/gemma-3-27b-it"],
    "SmolLM": ["HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM3-3B"],
    "OLMo 2": ["allenai/OLMo-2-1124-7B-Instruct", "allenai/OLMo-2-0325-32B-Instruct"],
    "Mistral": [
        "mistralai/Mistral-7B-Instruct-v0.1",
        "mistralai/Mistral-7B-Instruct-v0.2",
        "mistralai/Mistral-7B-Instruct-v0.3",
        "mistralai/Mistral-Small-24B-Instruct-2501",
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
    ],
    "Phi-4": ["microsoft/phi-4", "microsoft/Phi-4-reasoning", "microsoft/Phi-4-mini-reasoning"],
    "gpt-oss": ["openai/gpt-oss-20b", "openai/gpt-oss-120b"],
}
MOE = [
    "Qwen/Qwen3-30B-A3B-Base",
    "Qwen/Qwen3-235B-A22B",
    "mistralai/Mixtral-8x7B-v0.1",
    "deepseek-ai/DeepSeek-V2-Lite",
    "allenai/OLMoE-1B-7B-0924",
    "Qwen/Qwen3-30B-A3B",
    "openai/gpt-oss-20b",
    "openai/gpt-oss-120b",
]


@cache
def _fresh(config_json: str, multimodal: str | None):
    """A meta-device build of one config; variants with their base's config share it."""

    e = catalog.CatalogEntry(
        name="x",
        family="x",
        config=json.loads(config_json),
        multimodal=multimodal,
        source="x",
        published_params=1,
        published_source="x",
    )
    return build_entry(e)


# -- the shipped specs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_shipped_spec_equals_a_fresh_build(name):
    shipped = catalog.load_spec(name)
    e = catalog.entry(name)
    fresh = _fresh(json.dumps(e.config, sort_keys=True), e.multimodal).model_copy(update={"name": name})
    a, b = shipped.model_dump(exclude=VERSION_FIELDS), fresh.model_dump(exclude=VERSION_FIELDS)
    differ = sorted(k for k in a if a[k] != b[k])
    assert not differ, (
        f"{name}: shipped spec differs in {differ}; rebuild with `python -m planner.catalog.build {name}`"
    )


def test_spec_files_are_exactly_the_entries():
    shipped = {
        p.name for p in catalog.SPECS_DIR.glob("*.json") if p not in (catalog.INDEX_PATH, catalog.ENTRIES_JSON_PATH)
    }
    assert shipped == {catalog.entry(n).spec_path.name for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_total_params_match_the_published_figure(name):
    e, spec = catalog.entry(name), catalog.load_spec(name)
    diff = abs(spec.total_params - e.published_params)
    relative = relative_difference(spec.total_params, e.published_params)
    message = (
        f"{name}: built {spec.total_params:,} vs published {e.published_params:,} ({relative:+.2%}); fix the config"
    )
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
    wanted = REQUIRED + FIRST_TYPED + [n for names in FAMILIES.values() for n in names]
    missing = [n for n in wanted if n not in NAMES]
    assert not missing, f"catalog lacks {missing}"
    assert all(catalog.load_spec(n).is_moe for n in MOE)
    assert not any(catalog.load_spec(n).is_moe for n in wanted if n not in MOE)
    for size in ("4b", "12b", "27b"):  # the text models of the multimodal Gemma 3 checkpoints
        assert catalog.entry(f"google/gemma-3-{size}-pt").config["model_type"] == "gemma3_text"
    assert catalog.load_spec("gemma-2-9b").final_logit_softcapping == 30.0
    # MLA as Hugging Face runs it caches each head's decompressed key (128 nope + 64 rope)
    # and value (128): 2 x kv_dim = 16 heads x (192 + 128).
    assert 2 * catalog.load_spec("deepseek-v2-lite").block(1).attention.kv_dim == 16 * (192 + 128)
    # Sliding windows: Gemma 2 alternates local (4096) and global layers.
    assert [b.attention.sliding_window for b in catalog.load_spec("gemma-2-9b").blocks[:2]] == [4096, None]


def test_the_shipped_parse_of_entries_yaml_is_current():
    from planner.catalog.build import entries_json

    shipped = json.loads(catalog.ENTRIES_JSON_PATH.read_text())
    assert shipped == entries_json(), "rebuild with `python -m planner.catalog.build`"
    assert shipped["entries"] == catalog.parse_entries_yaml(catalog.ENTRIES_PATH.read_text())


def test_build_check_mode_compares_without_writing(capsys):
    assert build_main(["--check", "qwen2.5-0.5b"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-0.5B" in out and "494,032,768" in out


# -- lookup -----------------------------------------------------------------------------------


def test_resolve_hub_ids_any_case_and_aliases():
    assert catalog.resolve("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("qwen/qwen2.5-7b") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("  QWEN2.5-7B ") == "Qwen/Qwen2.5-7B"
    assert catalog.resolve("qwen2.5-7b-instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert catalog.resolve("llama-3.1-8b") == "meta-llama/Llama-3.1-8B"
    assert catalog.resolve("qwen3-30b-a3b") == "Qwen/Qwen3-30B-A3B"
    assert catalog.resolve("qwen3-30b-a3b-base") == "Qwen/Qwen3-30B-A3B-Base"
    assert catalog.resolve("gemma-3-27b-it") == "google/gemma-3-27b-it"
    assert catalog.resolve("gemma-3-27b") == "google/gemma-3-27b-pt"
    assert catalog.resolve("Qwen/Qwen2-7B") is None
    assert catalog.resolve("") is None
    assert catalog.entry("mixtral-8x7b").name == "mistralai/Mixtral-8x7B-v0.1"
    assert catalog.load_spec("phi-4").name == "microsoft/phi-4"


def test_every_alias_and_id_resolves_to_its_entry():
    for name in NAMES:
        assert catalog.resolve(name) == name
        for alias in catalog.entry(name).aliases:
            assert catalog.resolve(alias) == name


@pytest.mark.parametrize(
    "typo, expected",
    [
        ("qwen2.5-7", "Qwen/Qwen2.5-7B"),
        ("Qwen2-7B", "Qwen/Qwen2.5-7B"),
        ("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ("lama-3.1-8b", "meta-llama/Llama-3.1-8B"),
        ("mixtral-8x7", "mistralai/Mixtral-8x7B-v0.1"),
        ("gemma2-9b-it", "google/gemma-2-9b-it"),
        ("Qwen/Qwen2.5-7B-Instruct-AWQ", "Qwen/Qwen2.5-7B-Instruct"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B-GGUF", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"),
        ("openai/gpt-oss-20", "openai/gpt-oss-20b"),
        ("deepseek-v2-light", "deepseek-ai/DeepSeek-V2-Lite"),
    ],
)
def test_suggest_finds_the_intended_model(typo, expected):
    close = catalog.suggest(typo)
    assert expected in close[:3], close
    assert len(close) <= 5 and len(set(close)) == len(close)


def test_suggest_respects_n_and_finds_nothing_for_nonsense():
    assert len(catalog.suggest("qwen", n=2)) <= 2
    assert catalog.suggest("zzzzzzzz") == []
    # a bare "model" shares three letters in order with the alias "olmoe": no suggestion
    assert catalog.suggest("nonexistent/model") == []


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


@pytest.mark.parametrize("name", FIRST_TYPED)
def test_the_first_names_users_type_resolve_under_their_own_hub_id(name):
    assert catalog.resolve(name) == name
    assert catalog.load_spec(name).name == name


@pytest.mark.parametrize("name", [n for n in NAMES if catalog.entry(n).extends])
def test_a_variant_is_its_base_config_with_its_own_fields(name):
    variant = catalog.entry(name)
    base = catalog.entry(variant.extends)
    assert NAMES.index(variant.extends) < NAMES.index(name), "a variant comes after its base"
    assert variant.family == base.family or variant.family == "DeepSeek-R1-Distill"
    differ = {k for k in variant.config if variant.config[k] != base.config.get(k)}
    assert set(variant.config) == set(base.config), "a variant only changes fields of its base"
    assert catalog.root(name) == catalog.root(variant.extends)
    assert differ <= {
        "max_position_embeddings",
        "original_max_position_embeddings",
        "rope_theta",
        "sliding_window",
        "max_window_layers",
        "tie_word_embeddings",
        "num_hidden_layers",
        "num_local_experts",
        "layer_types",
    }, differ


def test_variants_differ_from_their_base_where_their_config_does():
    # DeepSeek-R1-Distill-Qwen-1.5B unties the embeddings of its Qwen2.5-Math-1.5B base:
    # 151,936 x 1,536 more parameters, and an lm_head of its own.
    distill, base = catalog.load_spec("deepseek-r1-distill-qwen-1.5b"), catalog.load_spec("qwen2.5-math-1.5b")
    assert distill.total_params - base.total_params == 151936 * 1536
    assert base.lm_head_shape is None and distill.lm_head_shape == (151936, 1536)
    # The post-trained Qwen3 releases read 40,960 positions, their base checkpoints 32,768.
    assert catalog.load_spec("Qwen/Qwen3-8B").max_position_embeddings == 40960
    assert catalog.load_spec("Qwen/Qwen3-8B-Base").max_position_embeddings == 32768
    assert catalog.load_spec("Qwen/Qwen3-4B-Instruct-2507").max_position_embeddings == 262144


def test_suggestions_rank_the_same_models_variants_first():
    close = catalog.suggest("Qwen/Qwen2.5-7B-Chat")
    assert set(close[:2]) <= {"Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"}, close
    assert all(catalog.root(n) == "Qwen/Qwen2.5-7B" for n in close[:3]), close
    close = catalog.suggest("meta-llama/Llama-3.1-8B-Instruct-FP8")
    assert close[0] == "meta-llama/Llama-3.1-8B-Instruct", close
    assert catalog.root(close[1]) == "meta-llama/Llama-3.1-8B", close


def test_extends_must_name_an_earlier_entry(tmp_path, monkeypatch):
    bad = tmp_path / "entries.yaml"
    bad.write_text(
        "- name: a/B-Instruct\n  extends: a/B\n  aliases: [b-instruct]\n  source: x\n"
        "  published_params: 1\n  published_source: x\n"
    )
    monkeypatch.setattr(catalog, "ENTRIES_PATH", bad)
    catalog._catalog.cache_clear()
    try:
        with pytest.raises(ValueError, match="extends 'a/B', which is not an earlier entry"):
            catalog.names()
    finally:
        monkeypatch.undo()
        catalog._catalog.cache_clear()


# -- a config.json with an entry's content uses the shipped spec --------------------------------


def _hub_style(name: str) -> dict:
    """An entry's config as a hub config.json spells it: checkpoint fields added, floats as ints."""
    e = catalog.entry(name)
    config = {k: (int(v) if isinstance(v, float) and v.is_integer() else v) for k, v in e.config.items()}
    config.update(
        architectures=["XForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        transformers_version="4.51.0",
        use_cache=True,
        initializer_range=0.02,
    )
    if e.multimodal:
        config = {
            "model_type": "gemma3",
            "architectures": [e.multimodal],
            "text_config": config,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
        }
    return config


def _transformers_saved(name: str, folder) -> dict:
    """An entry's config as transformers 5 saves it (every field, aliases resolved, derived ones spelled out)."""
    from transformers import AutoConfig

    config = dict(catalog.entry(name).config)
    AutoConfig.for_model(config.pop("model_type"), **config).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize(
    "name",
    [
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen3-30B-A3B",
        "google/gemma-3-4b-it",
        "openai/gpt-oss-20b",
        "meta-llama/Llama-3.1-8B-Instruct",
    ],
)
def test_a_config_json_with_an_entrys_content_finds_its_shipped_spec(name, tmp_path):
    hub = _hub_style(name)
    if name == "openai/gpt-oss-20b":  # the released checkpoint's MXFP4 note changes nothing planned
        hub["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    found = catalog.by_content(hub)
    same = {"name", "config_digest"}
    assert found is not None, name
    assert catalog.load_spec(found).model_dump(exclude=same) == catalog.load_spec(name).model_dump(exclude=same)
    if not catalog.entry(name).multimodal:
        assert catalog.by_content(_transformers_saved(name, tmp_path)) == found
    # One architectural field changed: no match, the spec is built from the file.
    changed = json.loads(json.dumps(hub))
    (changed.get("text_config") or changed)["intermediate_size"] += 128
    assert catalog.by_content(changed) is None


def test_planning_a_catalog_config_json_imports_no_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hub_style("Qwen/Qwen2.5-7B-Instruct")))
    code = (
        "import sys\n"
        "from planner.models import load_model_spec\n"
        f"spec = load_model_spec({str(tmp_path)!r})\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)\n"
        "print(spec.name, spec.total_params, heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[:2] == [str(tmp_path), str(catalog.load_spec("Qwen/Qwen2.5-7B-Instruct").total_params)]
