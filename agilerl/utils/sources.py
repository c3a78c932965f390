"""Where a model comes from, checked before anything heavy runs.

The trainer, the probe and the planner take the same model names: a local
directory or ``config.json``, a hub id (the local Hugging Face cache first), or
a built-in tiny model ``tiny:<arch>?key=value&...``. This module holds the
rules they share, so a bad name or a config that cannot describe a causal LM
is refused the same way everywhere, in well under a second, with one line
naming the field:

- :func:`parse_tiny`: the tiny-model syntax, values typed;
- :func:`check_config`: what the memory estimate and the trainer need from a
  ``config.json`` (present, positive sizes; heads divisible by KV heads; a
  decoder-only causal LM), never filled in from a library's defaults;
- :func:`check_causal_lm_type`: the model type has a causal-LM class in the
  installed transformers and is not an encoder (imports transformers' name
  tables, about 2 s cold, so it runs only where a model is about to be built);
- :func:`multimodal_architecture` / :func:`check_trainable`: a checkpoint with
  vision or audio encoders beside its ``text_config``. The planner plans its text
  model (the encoders are not counted); the trainer refuses it in one line and
  names the command that exports the text model (``agilerl.utils.text_model``);
- :func:`build_config`: the config as transformers builds it (its strict
  field validation included; imports transformers, so the trainer's check only);
- :func:`check_model_source`: a name the trainer can load without waiting on
  an unreachable hub;
- :func:`four_bit_linears`: the linears QLoRA stores in NF4 (the trainer's both
  loading paths and the planner's spec read them here).

No torch here: the planner's fast path imports it.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

__all__ = [
    "TINY_PREFIX",
    "parse_tiny",
    "check_config",
    "check_causal_lm_type",
    "build_config",
    "check_model_source",
    "looks_like_path",
    "local_path",
    "existing_path",
    "text_config",
    "rope_position_factor",
    "model_positions",
    "described_positions",
    "stretched_positions",
    "positions_words",
    "cached_config",
    "read_config",
    "multimodal_architecture",
    "multimodal_text_model",
    "encoder_configs",
    "check_trainable",
    "check_lora_targets",
    "LoraTargetError",
    "four_bit_linears",
    "kv_sharing_roles",
]

TINY_PREFIX = "tiny:"

#: Config fields every estimate and every build needs; a config without them is refused, not defaulted.
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_POSITIVE_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
)
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
#: Model types without attention layers, and the fields only state-space models' configs have:
#: a config of one without num_attention_heads is such a model (hybrids name their heads).
_ATTENTION_FREE_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
_STATE_SPACE_FIELDS = ("state_size", "ssm_state_size", "d_state", "ssm_cfg")
#: Sizes no model comes near (the largest released: ~130 layers, a 25k hidden size, a 262k
#: vocabulary, 512 experts): a config beyond them is a typo, and building it would not end.
_LARGEST = {
    "num_hidden_layers": 10_000,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 24,
    "num_experts": 1 << 16,
    "num_local_experts": 1 << 16,
}


def parse_tiny(name: str) -> tuple[str, dict[str, Any]]:
    """``tiny:qwen2?hidden_size=64&num_layers=2`` -> ("qwen2", {"hidden_size": 64, "num_layers": 2})."""
    body = name[len(TINY_PREFIX) :]
    arch, _, query = body.partition("?")
    if not arch:
        raise ValueError(f"{name!r}: a tiny model is 'tiny:<arch>[?key=value&...]', e.g. 'tiny:qwen2?num_layers=2'")
    kwargs: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        kwargs[key] = _typed(value)
    return arch, kwargs


def _typed(value: str) -> int | float | bool | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def text_config(config: dict) -> dict:
    """The part of a config that describes the language model (a multimodal config's ``text_config``)."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and "hidden_size" not in config:
        return inner
    return config


#: Rope scalings whose config gives ``max_position_embeddings`` stretched already, as
#: transformers' YaRN and Llama 3 code assumes: their ``factor`` is not applied again. Every other
#: scaling with a ``factor`` (Hugging Face's linear interpolation, dynamic NTK, Gemma 4's
#: proportional...) stretches the positions by it, or shrinks them where it is below 1. This is
#: how vLLM 0.32 derives its default max_model_len. A YaRN config that keeps the original length
#: there (Qwen's long-context recipe: 32768 and factor 4) is therefore held to it, as vLLM holds it.
PRESCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def rope_position_factor(config: dict) -> float:
    """How far a config's rope scaling stretches its positions: the ``factor`` of a scaling not in
    :data:`PRESCALED_ROPE_TYPES` (``rope_scaling``, or transformers 5's ``rope_parameters``, one
    set or one per layer type: the least of them, where vLLM takes the last and assumes they
    agree), else 1. Gemma 3's ``max_position_embeddings`` counts its linear factor already, as
    vLLM reads it: 1."""
    text = text_config(config)
    if any("gemma3" in str(c.get("model_type", "")) for c in (config, text)):
        return 1.0
    factors = [factor for _, factor in _stretching_factors(text) if math.isfinite(factor) and factor > 0]
    return min(factors, default=1.0)


#: The largest rope stretch a config may give: more is a typo.
MAX_ROPE_FACTOR = 1024


def _stretching_factors(text: dict) -> list[tuple[str, float]]:
    """(config key, factor) of every rope scaling in a text config that stretches its positions
    (not in :data:`PRESCALED_ROPE_TYPES`, with a numeric ``factor``): its ``rope_scaling`` or
    transformers 5's ``rope_parameters``, one set or one per layer type."""
    out = []
    for key in ("rope_parameters", "rope_scaling"):
        value = text.get(key)
        if not isinstance(value, dict):
            continue
        sets = [value] if any(k in value for k in ("rope_type", "type", "factor")) else list(value.values())
        for params in sets:
            if not isinstance(params, dict):
                continue
            kind = params.get("rope_type", params.get("type"))
            factor = params.get("factor")
            if kind not in PRESCALED_ROPE_TYPES and isinstance(factor, int | float) and not isinstance(factor, bool):
                out.append((key, float(factor)))
    return out


def stretched_positions(max_position_embeddings: int, factor: float) -> int:
    """``max_position_embeddings`` stretched by a rope scaling's :func:`rope_position_factor`."""
    return int(max_position_embeddings * factor)


def model_positions(config: dict) -> int | None:
    """The positions a causal LM takes (its text config's ``max_position_embeddings`` times its
    :func:`rope_position_factor`), or None where the config does not give them."""
    known = described_positions(config)
    return None if known is None else known[0]


def described_positions(config: dict) -> tuple[int, str] | None:
    """:func:`model_positions` and where they come from, in words (:func:`positions_words`), for a
    refusal; None where the config does not give them."""
    positions = text_config(config).get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        return None
    factor = rope_position_factor(config)
    return stretched_positions(positions, factor), positions_words(positions, factor)


def positions_words(max_position_embeddings: int, factor: float) -> str:
    """Where a model's positions come from, for a message: "max_position_embeddings=4096", with
    " x its rope scaling's factor 4" where a scaling stretches them (:func:`rope_position_factor`)."""
    words = f"max_position_embeddings={max_position_embeddings}"
    return words if factor == 1 else f"{words} x its rope scaling's factor {factor:g}"


#: Config keys of the encoders a multimodal checkpoint keeps beside its language model.
ENCODER_CONFIG_KEYS = ("vision_config", "audio_config", "speech_config", "vision_tower_config")


def encoder_configs(config: dict) -> list[str]:
    """The encoder sub-configs (``vision_config``, ``audio_config``...) beside a ``text_config``."""
    if not isinstance(config.get("text_config"), dict):
        return []
    return [k for k in ENCODER_CONFIG_KEYS if isinstance(config.get(k), dict)]


def multimodal_architecture(config: dict) -> str | None:
    """The class name of a multimodal checkpoint (``Gemma3ForConditionalGeneration``), else None."""
    if not encoder_configs(config):
        return None
    archs = config.get("architectures") or []
    return archs[0] if archs and isinstance(archs[0], str) else f"model_type {config.get('model_type')!r}"


def multimodal_text_model(config: dict) -> dict:
    """A multimodal config's text model as a config of its own (an outer tie flag carried in)."""
    text = dict(config["text_config"])
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def check_trainable(config: dict, name: str) -> None:
    """Raise ValueError for a checkpoint the trainer cannot train: a multimodal one (vision or
    audio encoders beside the language model). Its text model can be exported and trained."""
    arch = multimodal_architecture(config)
    if arch is not None:
        raise ValueError(
            f"{name}: {arch} is a multimodal model ({', '.join(encoder_configs(config))} beside its text_config); "
            "the trainer trains decoder-only causal LMs: export its text model with `python -m "
            f"agilerl.utils.text_model {name} OUT_DIR` and train OUT_DIR"
        )


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _named_otherwise(model_type: Any, missing: list[str], text: dict) -> list[str]:
    """``missing`` fields ``text`` holds under another name its ``model_type`` gives them (GPT-2's
    ``n_embd`` for hidden_size), as ``hidden_size as n_embd``; empty where transformers knows no
    such name."""
    if not missing or not isinstance(model_type, str):
        return []
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        renamed = getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {}
    except (ImportError, KeyError, ValueError):
        return []
    return [f"{key} as {renamed[key]}" for key in missing if renamed.get(key) in text]


def check_config(config: dict, name: str) -> None:
    """Raise ValueError naming the field when ``config`` cannot describe a decoder-only causal LM."""
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{name} is not a transformers config (no model_type field)")
    if config.get("is_encoder_decoder"):
        raise ValueError(
            f"{name}: model_type {config['model_type']!r} is an encoder-decoder model; only decoder-only "
            "causal LMs (…ForCausalLM) are supported"
        )
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{name}: config field architectures={archs!r} must be a list of class names")
    multimodal = isinstance(config.get("text_config"), dict)
    unsupported = [
        a
        for a in archs
        if not a.endswith(_CAUSAL_SUFFIXES) and not (multimodal and a.endswith("ForConditionalGeneration"))
    ]
    if unsupported:
        raise ValueError(
            f"{name}: architecture {unsupported[0]} is not a causal LM; only decoder-only causal LMs "
            "(…ForCausalLM, or a multimodal model's text part) are supported"
        )
    text = text_config(config)
    missing = [key for key in REQUIRED_FIELDS if key not in text]
    if "num_attention_heads" in missing and (
        text.get("model_type") in _ATTENTION_FREE_TYPES or any(k in text for k in _STATE_SPACE_FIELDS)
    ):
        # a state-space or recurrent model: refused by what it is, not as a config missing a field
        kind = archs[0] if archs else f"model_type {text.get('model_type')!r}"
        raise ValueError(
            f"{name}: {kind} has no softmax attention (a state-space or recurrent model, as Mamba and "
            "RWKV are): only attention decoders are supported"
        )
    if otherwise := _named_otherwise(text.get("model_type"), missing, text):
        raise ValueError(
            f"{name}: model_type {text.get('model_type')!r} names its sizes {', '.join(otherwise)}; the trainer "
            f"and the estimate support the causal LMs whose configs name {', '.join(REQUIRED_FIELDS)} (the "
            "Llama, Qwen, Mistral, Gemma, OLMo, Phi, DeepSeek and GPT-OSS families and their kind), not this family"
        )
    if missing:
        raise ValueError(
            f"{name}: config has no {', '.join(missing)}; the estimate needs "
            f"{', '.join(REQUIRED_FIELDS)} given, not a library's defaults"
        )
    for key in _POSITIVE_INT_FIELDS:
        value = text.get(key)
        if key == "intermediate_size" and isinstance(value, list):  # per layer (Gemma-3n)
            if value and all(_positive(v) for v in value):
                continue
            raise ValueError(f"{name}: config field {key}={value!r} must be positive integers, one per layer")
        if value is not None and not _positive(value):
            raise ValueError(f"{name}: config field {key}={value!r} must be a positive integer")
    for key, largest in _LARGEST.items():
        values = text.get(key)
        if any(isinstance(v, int) and v > largest for v in (values if isinstance(values, list) else [values])):
            raise ValueError(f"{name}: config field {key}={values!r} is more than {largest:,}: a typo?")
    positions = text.get("max_position_embeddings")
    if positions is not None and not _positive(positions):
        raise ValueError(f"{name}: config field max_position_embeddings={positions!r} must be a positive integer")
    for key, factor in _stretching_factors(text):
        if not (math.isfinite(factor) and 0 < factor <= MAX_ROPE_FACTOR):
            raise ValueError(
                f"{name}: config field {key} has factor={factor:g}: a rope scaling's factor "
                f"must be a number above 0 and at most {MAX_ROPE_FACTOR:,}"
            )
    experts = text.get("num_local_experts") or text.get("num_experts")
    top_k = text.get("num_experts_per_tok")
    if _positive(experts) and _positive(top_k) and top_k > experts:
        raise ValueError(
            f"{name}: config field num_experts_per_tok={top_k} is more than the {experts} experts a layer has"
        )
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    kv = text.get("num_key_value_heads") or heads
    if heads % kv:
        raise ValueError(
            f"{name}: config field num_key_value_heads={kv} must divide num_attention_heads={heads} "
            "(each KV head serves a whole group of query heads)"
        )
    if text.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"{name}: config field hidden_size={hidden} is not divisible by num_attention_heads={heads} "
            "(and no head_dim is set)"
        )


def check_causal_lm_type(config: dict, name: str) -> None:
    """Raise unless the installed transformers has a causal-LM class for the config's model type
    and the type is not an encoder (BERT-like types have a causal head only as ``is_decoder``)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = text_config(config).get("model_type", config["model_type"])
    outer = config["model_type"]
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and outer not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{name}: model_type {outer!r} has no causal-LM class in transformers "
            f"{transformers.__version__}; only decoder-only causal LMs are supported"
        )
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not text_config(config).get("is_decoder"):
        raise ValueError(
            f"{name}: model_type {kind!r} is an encoder (masked LM); only decoder-only causal LMs are supported"
        )


def build_config(config: dict, name: str):
    """transformers' config object of ``config`` (offline, no weights), or a ValueError naming
    ``name`` with what transformers refuses: a field of the wrong type under its strict validation
    (``max_position_embeddings: "x"``, ``rope_scaling: "yes"``), a model type it does not know."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING

    kind = config["model_type"]
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"{name}: model_type {kind!r} is not a model type of transformers {transformers.__version__}")
    try:
        return CONFIG_MAPPING[kind].from_dict(config)
    except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError) as err:
        raise ValueError(f"{name}: transformers refuses this config: {' '.join(str(err).split())}") from None


def looks_like_path(name: str) -> bool:
    """A name meant as a local path: it starts with . / ~, ends in .json, or has more than one '/'."""
    return not name.startswith(TINY_PREFIX) and (
        name.startswith((".", "/", "~")) or name.endswith(".json") or name.count("/") > 1
    )


def local_path(name: str) -> Path:
    """``name`` as a local path, ``~`` expanded, or a one-line ValueError for a name no path can
    have: ``~user`` of no such user, or longer than the file system allows (which every later
    ``exists()`` would raise on). The one guard of the trainer's, the planner's and the probe's
    model lookups."""
    try:
        path = Path(name).expanduser()
        path.exists()  # a name longer than the file system allows raises here, not later
    except RuntimeError:  # ~user of a user without a home directory
        raise ValueError(f"{name}: no home directory for {name.split('/')[0]!r} (no such user?)") from None
    except OSError as err:
        shown = name if len(name) <= 80 else f"{name[:77]}..."
        raise ValueError(f"{shown} ({len(name)} characters): not a usable path: {err.strerror or err}") from None
    return path


def existing_path(name: str) -> Path | None:
    """``name`` as an existing local path (``~`` expanded), or None: nothing there, or a name no
    path can have (:func:`local_path` refuses it), such as a hub id or a catalog name."""
    try:
        path = local_path(name)
    except ValueError:
        return None
    return path if path.exists() else None


def read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (a config.json is JSON in UTF-8)") from None
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{path} is not a transformers config (no model_type field)")
    return data


def cached_config(repo_id: str) -> Path | None:
    """The config.json of ``repo_id`` in the local Hugging Face cache, or None (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except (ImportError, ValueError):  # no hub client, or not a valid repo id: not in the cache either
        return None
    return Path(found) if isinstance(found, str) else None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    try:
        with socket.create_connection((parsed.hostname or "huggingface.co", parsed.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_model_source(name: str, *, allow_download: bool, for_training: bool = True) -> dict | None:
    """Raise ValueError, within a few seconds, when the trainer could not load ``name``; return
    its config's fields where they are at hand (a tiny model, a directory, the cache), else None.

    ``for_training=False`` (the planner) accepts a multimodal checkpoint, whose text model it plans,
    and leaves out transformers' own validation of the config (it imports transformers).

    A tiny model must parse and build a valid config; a path must exist and hold
    a valid ``config.json`` that transformers builds; a hub id must be in the local
    Hugging Face cache, or else downloads must be allowed, ``HF_HUB_OFFLINE`` unset
    and the hub reachable (one TCP connect, 3 s at most, instead of the hub client's retries).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError("model name is empty: give a model directory, a hub id or 'tiny:<arch>'")
    if name.startswith(TINY_PREFIX):
        from .tiny import tiny_config

        arch, kwargs = parse_tiny(name)
        kwargs.pop("seed", None)
        return tiny_config(arch, **kwargs).to_dict()
    path = local_path(name)
    is_dir, exists = path.is_dir(), path.exists()
    if is_dir:
        if not (path / "config.json").exists():
            raise ValueError(f"{name}: directory has no config.json (expected a Hugging Face model directory)")
        return _checked_config(path / "config.json", name, for_training=for_training)
    if exists:
        raise ValueError(
            f"{name}: a file, not a model directory (expected a Hugging Face model directory holding its "
            "config.json, tokenizer and weights; give that folder)"
        )
    if looks_like_path(name):
        raise ValueError(f"{name}: no such file or directory (expected a Hugging Face model directory)")
    cached = cached_config(name)
    if cached is not None:
        return _checked_config(cached, name, for_training=for_training)
    if not allow_download:
        raise ValueError(
            f"model {name!r} is not a local directory, not a built-in tiny model and not in the local "
            "Hugging Face cache; pass --allow-download to let the trainer fetch it from the hub"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline or not _hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ValueError(
            f"model {name!r} is not a local directory, not a built-in tiny model and not in the local "
            f"Hugging Face cache, and {why}: download it first (huggingface-cli download {name}) "
            "or give its local directory"
        )
    return None


def _checked_config(file: Path, name: str, *, for_training: bool) -> dict:
    """``file``'s fields, refused (a ValueError naming ``name``, or the file where transformers
    refuses it) when they cannot describe a model the planner plans or the trainer trains."""
    config = read_config(file)
    check_config(config, name)
    if for_training:
        check_trainable(config, name)
        build_config(config, str(file))
    return config


class LoraTargetError(ValueError):
    """A LoRA target that names no module of the model (one line, naming what it has)."""


def _is_linear(module: Any, head: Any) -> bool:
    """A linear layer by what it keeps (no torch import here): ``nn.Linear`` and its 4- and 8-bit
    subclasses have in_features and out_features, transformers' Conv1D (GPT-2) nf and nx; the
    output head is not one a LoRA target names."""
    if module is head:
        return False
    return (hasattr(module, "in_features") and hasattr(module, "out_features")) or (
        hasattr(module, "nf") and hasattr(module, "nx")
    )


def check_lora_targets(model: Any, target_modules: str | Iterable[str] | None, name: str) -> None:
    """Raise LoraTargetError when a LoRA target names no module of ``model`` (which may be on the meta
    device, before any weight loads), listing the names its linear layers have.

    PEFT matches a module name ``t`` in a list to every module called ``t`` or ending in ``.t``,
    and a string to the module names it fully matches as a regex; it fails only when nothing at
    all matches, so a misspelt name beside a right one trained only the right one, silently.
    Here every name must match. None (PEFT's defaults for the model type) and 'all-linear' pass.
    """
    if target_modules is None or (isinstance(target_modules, str) and target_modules.lower() == "all-linear"):
        return
    keys = [key for key, _ in model.named_modules() if key]
    if isinstance(target_modules, str):
        missing = [] if any(re.fullmatch(target_modules, key) for key in keys) else [target_modules]
    else:
        missing = [t for t in target_modules if not any(key == t or key.endswith("." + t) for key in keys)]
    if not missing:
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = dict.fromkeys(key.rsplit(".", 1)[-1] for key, module in model.named_modules() if _is_linear(module, head))
    what = "no module matches the pattern" if isinstance(target_modules, str) else "no module named"
    raise LoraTargetError(
        f"{name}: LoRA targets: {what} {' or '.join(missing)}; its linear layers are named "
        f"{', '.join(linear) or '(none)'} (or give 'all-linear')"
    )


#: Linears whose weight the model's own code edits or multiplies by directly while training, so
#: they cannot hold packed 4-bit bytes: Gemma-3n's AltUp clamps its prediction coefficients in
#: place and applies its clamped correction coefficients with F.linear (transformers' loader
#: quantises both, and the first training step then fails on a uint8 weight).
FLOAT_WEIGHT_LINEARS = ("altup.prediction_coefs", "altup.correction_coefs")


def kv_sharing_roles(model: Any) -> dict[Any, str | None]:
    """Each attention module's part in K/V sharing across layers (Gemma-3n's and Gemma 4's
    ``num_kv_shared_layers``), by module: "reuse" reads the K and V of the last earlier layer of its
    attention type, "store" is that layer, None the rest. A store no layer reads is None too:
    transformers marks the last layer of each type as one even then (for assistant models that read
    the forward's stores), the trainer stops it storing (agilerl.algorithms.core.loading) and the
    planner's spec records none. Empty for a model without the mechanism."""
    attention = [m for m in model.modules() if hasattr(m, "store_full_length_kv")]
    read = any(getattr(m, "is_kv_shared_layer", False) for m in attention)
    return {
        m: "reuse" if getattr(m, "is_kv_shared_layer", False) else "store" if read and m.store_full_length_kv else None
        for m in attention
    }


def four_bit_linears(model: Any) -> list[str]:
    """Module names of the linears QLoRA (``load_in_4bit``) stores in NF4, on ``model`` before any
    adapter is added (on the meta device or not).

    They are the ones transformers' bitsandbytes loader replaces in ``from_pretrained``: every
    module whose type is exactly ``nn.Linear`` (subclasses, MoE routers that keep a bare weight and
    packed 3-D expert tensors stay in the weights dtype), less those its skip list names, matched
    as that loader matches them: the output head, modules tied to another's weight, the module of
    the last parameter as loading sees it (before any tying, so the head's), and the model class's
    ``_keep_in_fp32_modules``; and the :data:`FLOAT_WEIGHT_LINEARS`, which stay in the weights
    dtype (the trainer hands its list to the loader). The trainer's meta-device path swaps exactly
    these, and the planner's spec records them, so both loading paths and the estimate count the
    same weights (tests/agilerl/algorithms/test_qlora.py checks it against the loader itself). A
    transformers without that matcher (before 5.0) is taken to skip the output head only.
    """
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m is not head and not name.endswith(FLOAT_WEIGHT_LINEARS)
    ]
    try:
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:
        return [name for name, _ in linears]
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    last = [name for name, _ in model.named_parameters(remove_duplicate=False)][-1:]
    skip = [key.removesuffix(".weight") for key in {*tied.keys(), *tied.values(), *last}]
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [name for name, _ in linears if should_convert_module(name, skip)]
