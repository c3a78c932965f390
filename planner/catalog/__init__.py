"""The built-in offline model catalog.

``entries.yaml`` lists popular models by Hugging Face hub id, with the architecture fields
of their public config.json; ``specs/`` ships each one's :class:`~planner.spec.ModelSpec`
precomputed as JSON (``python -m planner.catalog.build`` regenerates them). Looking a model
up and loading its spec reads only those files: no torch, transformers or peft.
"""

from __future__ import annotations

import copy
import difflib
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from planner.spec import ModelSpec

__all__ = [
    "CatalogEntry",
    "ENTRIES_PATH",
    "ENTRIES_JSON_PATH",
    "INDEX_PATH",
    "parse_entries_yaml",
    "entries_digest",
    "by_content",
    "content_key",
    "SPECS_DIR",
    "entries",
    "entry",
    "load_spec",
    "names",
    "resolve",
    "root",
    "slug",
    "suggest",
]

ENTRIES_PATH = Path(__file__).with_name("entries.yaml")
SPECS_DIR = Path(__file__).with_name("specs")
#: Written by ``python -m planner.catalog.build``: each model type's transformers defaults and
#: every entry's content key (:func:`content_key`), so a config.json with an entry's content
#: finds its shipped spec without importing transformers.
INDEX_PATH = SPECS_DIR / "_index.json"
#: Also written by the build: entries.yaml as parsed, beside the digest of the text it was
#: parsed from. A plan reads it (under 1 ms) instead of importing yaml and parsing (~35 ms);
#: an entries.yaml edited since the build no longer matches the digest and is parsed itself.
ENTRIES_JSON_PATH = SPECS_DIR / "_entries.json"

#: config.json fields that describe the checkpoint or its use, not the architecture: two
#: configs that differ only in these build the same model.
NOT_ARCHITECTURE = frozenset(
    {
        "architectures",
        "auto_map",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "use_cache",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "problem_type",
        "id2label",
        "label2id",
        "chunk_size_feed_forward",
        "quantization_config",
        "attn_implementation",
        "_attn_implementation_autoset",
        "tokenizer_class",
        "task_specific_params",
        "prefix",
        "finetuning_task",
    }
)


class CatalogEntry(BaseModel):
    """One model of the catalog, as written in ``entries.yaml``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # hub id
    family: str  # e.g. "Qwen2.5", "Llama 3.1": suggestions rank a family's variants together
    extends: str | None = None  # the entry whose config this variant starts from
    aliases: tuple[str, ...] = ()
    config: dict[str, Any]  # for AutoConfig.for_model(model_type, **rest), ``extends`` merged in
    source: str  # the config.json it was read from
    # the class of the multimodal checkpoint whose text model ``config`` is (its text_config)
    multimodal: str | None = None
    published_params: int
    published_source: str
    published_note: str | None = None
    # unit of the figure's last stated digit, only where rounding to it exceeds 1% (1.7B: 10**8)
    published_precision: int | None = None

    @property
    def slug(self) -> str:
        return slug(self.name)

    @property
    def spec_path(self) -> Path:
        return SPECS_DIR / f"{self.slug}.json"


def slug(name: str) -> str:
    """File stem of a hub id's shipped spec: ``Qwen/Qwen2.5-7B`` -> ``qwen__qwen2.5-7b``."""
    return name.lower().replace("/", "__")


def _merged(item: dict[str, Any], by_name: dict[str, CatalogEntry]) -> dict[str, Any]:
    """A variant's entry with its base's config (and family) filled in.

    A variant (``extends: <hub id of an earlier entry>``) writes only the config fields in
    which its own config.json differs from its base's; every other field is the base's.
    """
    base_name = item.get("extends")
    if base_name is None:
        return item
    base = by_name.get(base_name)
    if base is None:
        raise ValueError(f"entries.yaml: {item.get('name')} extends {base_name!r}, which is not an earlier entry")
    merged = dict(item)
    merged["config"] = {**copy.deepcopy(base.config), **(item.get("config") or {})}
    merged.setdefault("family", base.family)
    return merged


def parse_entries_yaml(text: str) -> list[dict[str, Any]]:
    """entries.yaml's items, as written (before ``extends`` is applied)."""
    import yaml

    # libyaml's loader where installed: 8-17 ms for the catalog instead of 67-122 ms in pure Python.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader)


def entries_digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _raw_entries() -> list[dict[str, Any]]:
    import json

    text = ENTRIES_PATH.read_text(encoding="utf-8")
    if ENTRIES_JSON_PATH.exists():
        parsed = json.loads(ENTRIES_JSON_PATH.read_text(encoding="utf-8"))
        if parsed.get("entries_yaml_sha256") == entries_digest(text):
            return parsed["entries"]
    return parse_entries_yaml(text)


@cache
def _catalog() -> tuple[dict[str, CatalogEntry], dict[str, str]]:
    """Entries by hub id, and every lower-cased hub id and alias -> hub id."""
    raw = _raw_entries()
    by_name: dict[str, CatalogEntry] = {}
    keys: dict[str, str] = {}
    for item in raw:
        e = CatalogEntry.model_validate(_merged(item, by_name))
        for key in (e.name.lower(), *e.aliases):
            if key != key.lower():
                raise ValueError(f"entries.yaml: alias {key!r} of {e.name} is not lower-case")
            if key in keys:
                raise ValueError(f"entries.yaml: {key!r} of {e.name} is taken by {keys[key]}")
            keys[key] = e.name
        by_name[e.name] = e
    return by_name, keys


def entries() -> list[CatalogEntry]:
    """Every entry, in file order (copies, like :func:`entry`)."""
    return [e.model_copy(deep=True) for e in _catalog()[0].values()]


def names() -> list[str]:
    """Hub id of every entry, in file order."""
    return list(_catalog()[0])


def resolve(name: str) -> str | None:
    """The catalog hub id for a hub id (any case) or alias; None when not in the catalog."""
    return _catalog()[1].get(name.strip().lower())


def root(name: str) -> str:
    """The hub id at the bottom of an entry's ``extends`` chain (the entry itself if none)."""
    by_name = _catalog()[0]
    e = by_name[name]
    while e.extends is not None:
        e = by_name[e.extends]
    return e.name


def suggest(name: str, n: int = 5) -> list[str]:
    """Hub ids of up to ``n`` catalog models whose id or an alias is close to ``name``.

    The closest match comes first, then the other variants of the same base model
    (``Qwen/Qwen2.5-7B-Chat`` -> Qwen2.5-7B-Instruct, Qwen2.5-7B, Qwen2.5-Math-7B ...), then
    the rest of its family, then everything else that is close, each group by closeness.
    """
    query = name.strip().lower()
    queries = {query, query.rsplit("/", 1)[-1]}  # "org/model" also matches on "model"
    scores: dict[str, float] = {}
    for key, hub_id in _catalog()[1].items():
        matcher = difflib.SequenceMatcher(None, b=key)
        score = 0.0
        for q in queries:
            matcher.set_seq1(q)
            score = max(score, matcher.ratio())
        if score > 0.6 and score > scores.get(hub_id, 0.0):
            scores[hub_id] = score
    if not scores:
        return []
    by_name = _catalog()[0]
    best = max(scores, key=lambda hub_id: scores[hub_id])
    best_root, best_family = root(best), by_name[best].family

    def rank(hub_id: str) -> tuple[int, int, float]:
        return (hub_id != best and root(hub_id) != best_root, by_name[hub_id].family != best_family, -scores[hub_id])

    return sorted(scores, key=rank)[:n]


#: Fields the estimate never reads that transformers derives from others when they are absent
#: (a config saved by transformers 5 spells them out, one saved by an older version does not).
DERIVED = frozenset({"layer_types", "rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq"})


def _canonical(value: Any) -> Any:
    """JSON values compared by meaning: 1e6 == 1000000.0 == 1000000, tuples are lists."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items()) if k not in NOT_ARCHITECTURE}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return str(value)


def content_key(
    config: dict[str, Any],
    defaults: dict[str, Any],
    multimodal: str | None = None,
    aliases: dict[str, str] | None = None,
) -> str:
    """A digest of what a config says about the architecture: its fields over its model type's
    transformers defaults, without :data:`NOT_ARCHITECTURE`. ``multimodal``: the checkpoint class
    whose text model ``config`` is (a multimodal model plans as its text model). ``aliases``: the
    config class's attribute map (Qwen3-MoE's ``num_experts`` is saved as ``num_local_experts``)."""
    import hashlib
    import json

    aliases = aliases or {}
    config = {aliases.get(k, k): v for k, v in config.items()}
    merged = _canonical({**{k: v for k, v in defaults.items() if k != "head_dim"}, **config})
    merged = {k: v for k, v in merged.items() if k not in DERIVED}
    if merged.get("use_sliding_window") is False:  # Qwen2/3 keep a window only when it is used
        merged.pop("sliding_window", None)
        merged.pop("max_window_layers", None)
    heads, hidden = merged.get("num_attention_heads"), merged.get("hidden_size")
    if merged.get("head_dim") is None or (
        isinstance(heads, int) and isinstance(hidden, int) and heads and merged["head_dim"] == hidden // heads
    ):
        merged.pop("head_dim", None)  # the head width transformers derives anyway
    text = json.dumps({"config": merged, "multimodal": multimodal}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@cache
def _index() -> dict[str, Any]:
    import json

    if not INDEX_PATH.exists():
        return {"defaults": {}, "aliases": {}, "entries": {}}
    return json.loads(INDEX_PATH.read_text(encoding="utf-8"))


def by_content(config: dict[str, Any]) -> str | None:
    """The catalog hub id whose config has the content of ``config`` (a config.json's dict), else None.

    A multimodal config.json matches the entry of its text model. No transformers import: the
    model types' defaults come from the index the build writes.
    """
    from agilerl.utils.sources import multimodal_architecture, multimodal_text_model

    multimodal = multimodal_architecture(config)
    if multimodal is not None:
        config = multimodal_text_model(config)
    defaults = _index()["defaults"].get(config.get("model_type"))
    if defaults is None:
        return None
    aliases = _index()["aliases"].get(config["model_type"], {})
    return _index()["entries"].get(content_key(config, defaults, multimodal, aliases))


def _unknown(name: str) -> KeyError:
    close = suggest(name)
    if close:
        return KeyError(f"{name!r} is not in the model catalog; did you mean {', '.join(close)}?")
    return KeyError(f"{name!r} is not in the model catalog; known models: {', '.join(names())}")


def entry(name: str) -> CatalogEntry:
    """The entry for a hub id or alias; KeyError (with suggestions) when unknown.

    A deep copy: transformers rewrites nested config dicts (rope settings) in place, so a
    caller building from ``entry(name).config`` must not reach the cached original.
    """
    hub_id = resolve(name)
    if hub_id is None:
        raise _unknown(name)
    return _catalog()[0][hub_id].model_copy(deep=True)


def load_spec(name: str) -> ModelSpec:
    """The shipped spec of a catalog model (hub id or alias), read without torch."""
    hub_id = resolve(name)
    if hub_id is None:
        raise _unknown(name)
    return _load_spec(hub_id)


@cache
def _load_spec(hub_id: str) -> ModelSpec:
    path = _catalog()[0][hub_id].spec_path
    return ModelSpec.model_validate_json(path.read_text(encoding="utf-8"))
