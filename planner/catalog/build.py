"""Rebuild the catalog's shipped specs from ``entries.yaml``.

    python -m planner.catalog.build             # every entry (and drop stale spec files)
    python -m planner.catalog.build qwen3-8b    # only these (hub ids or aliases)
    python -m planner.catalog.build --check     # build and compare, write nothing

Each spec is built on the meta device (torch, transformers and peft are needed here, not
where the specs are used). Prints each model's built and published parameter counts.
"""

from __future__ import annotations

import argparse
import copy
import sys

from planner.catalog import (
    ENTRIES_JSON_PATH,
    ENTRIES_PATH,
    INDEX_PATH,
    NOT_ARCHITECTURE,
    SPECS_DIR,
    CatalogEntry,
    content_key,
    entries,
    entries_digest,
    entry,
    parse_entries_yaml,
)
from planner.spec import ModelSpec, build_spec

#: Fields that record the builder's library versions, not the model.
VERSION_FIELDS = frozenset({"transformers_version", "peft_version"})


def build_entry(e: CatalogEntry) -> ModelSpec:
    # a copy: transformers rewrites nested config dicts (rope settings) in place
    return build_spec(copy.deepcopy(e.config), name=e.name, text_model_of=e.multimodal)


def model_type_defaults(model_type: str) -> dict:
    """The config transformers builds for ``model_type`` with no fields given, as JSON values,
    without the fields no content key reads (:data:`NOT_ARCHITECTURE`: the version of
    transformers that built it among them, so the index does not go stale with each release)."""
    import json

    from transformers import AutoConfig

    config = json.loads(json.dumps(AutoConfig.for_model(model_type).to_dict(), default=str))
    return {k: v for k, v in config.items() if k not in NOT_ARCHITECTURE}


def attribute_aliases(model_type: str) -> dict[str, str]:
    """The config class's attribute map: a field name a config.json may use -> the name it is saved as."""
    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(model_type))
    saved = set(AutoConfig.for_model(model_type).to_dict())
    aliases = {}
    for alias, target in dict(getattr(cls, "attribute_map", {}) or {}).items():
        if target in saved and alias not in saved:
            aliases[alias] = target
        elif alias in saved and target not in saved:
            aliases[target] = alias
    return aliases


def build_index(todo: list[CatalogEntry]) -> dict:
    """Each model type's defaults and attribute aliases, and each entry's content key (the first
    entry of a content wins: its variants with the same content have the same spec)."""
    types = sorted({e.config["model_type"] for e in todo})
    defaults = {t: model_type_defaults(t) for t in types}
    aliases = {t: attribute_aliases(t) for t in types}
    keys: dict[str, str] = {}
    for e in todo:
        t = e.config["model_type"]
        keys.setdefault(content_key(e.config, defaults[t], e.multimodal, aliases[t]), e.name)
    return {"defaults": defaults, "aliases": aliases, "entries": keys}


def same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs describe the same model, whatever library versions built them."""
    return a.model_dump(exclude=set(VERSION_FIELDS)) == b.model_dump(exclude=set(VERSION_FIELDS))


def relative_difference(built: int, published: int) -> float:
    return (built - published) / published


def entries_json() -> dict:
    """What ``_entries.json`` holds: entries.yaml parsed, and the digest of its text."""
    text = ENTRIES_PATH.read_text(encoding="utf-8")
    return {"entries_yaml_sha256": entries_digest(text), "entries": parse_entries_yaml(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m planner.catalog.build", description="Rebuild the catalog's shipped specs."
    )
    parser.add_argument("names", nargs="*", help="hub ids or aliases (default: every entry)")
    parser.add_argument(
        "--check", action="store_true", help="compare with the shipped specs, write nothing; exit 1 if any differ"
    )
    args = parser.parse_args(argv)

    todo = [entry(n) for n in args.names] if args.names else entries()
    SPECS_DIR.mkdir(exist_ok=True)
    stale = []
    print(f"{'model':<36} {'built':>16} {'published':>16} {'diff':>8}")
    for e in todo:
        spec = build_entry(e)
        if args.check:
            path = e.spec_path
            shipped = ModelSpec.model_validate_json(path.read_text()) if path.exists() else None
            if shipped is None or not same_model(spec, shipped):
                stale.append(e.name)
        else:
            e.spec_path.write_text(spec.model_dump_json(indent=None) + "\n", encoding="utf-8")
        diff = relative_difference(spec.total_params, e.published_params)
        print(f"{e.name:<36} {spec.total_params:>16,} {e.published_params:>16,} {diff:>+8.2%}", flush=True)

    import json

    index = build_index(entries())
    parsed = entries_json()
    if args.check:
        shipped = json.loads(INDEX_PATH.read_text()) if INDEX_PATH.exists() else None
        if shipped != index:
            stale.append(INDEX_PATH.name)
        if not ENTRIES_JSON_PATH.exists() or json.loads(ENTRIES_JSON_PATH.read_text()) != parsed:
            stale.append(ENTRIES_JSON_PATH.name)
    else:
        INDEX_PATH.write_text(json.dumps(index, sort_keys=True, indent=None) + "\n", encoding="utf-8")
        ENTRIES_JSON_PATH.write_text(json.dumps(parsed, indent=None) + "\n", encoding="utf-8")
    if not args.names and not args.check:
        keep = {e.spec_path for e in todo} | {INDEX_PATH, ENTRIES_JSON_PATH}
        for path in SPECS_DIR.glob("*.json"):
            if path not in keep:
                path.unlink()
                print(f"removed stale {path.name}")
    if stale:
        print(f"out of date: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
