"""What a probe loads for a model name: its weights where they are local, else its config alone,
which the trainer builds with random weights, so that a probe never downloads unasked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from agilerl.utils.sources import existing_path

__all__ = ["probe_model", "random_weights"]


def probe_model(model: str) -> str:
    """What the probe loads for ``model``: local paths and tiny models as given, a hub id with
    weights in the local Hugging Face cache as given; otherwise (a catalog model, or a hub id
    whose config alone is cached) a cached directory holding only its config.json, which the
    trainer builds with random weights (memory and speed do not depend on their values), so a
    trial never downloads."""
    if model.startswith("tiny:") or existing_path(model) is not None:
        return model
    from .. import catalog
    from ..spec import config_digest

    name = catalog.resolve(model) or model
    if _cached_file(name, "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        return name
    if catalog.resolve(model) is not None:
        config = catalog.entry(name).config
    else:
        cached = _cached_file(name, "config.json")
        if cached is None:
            return model  # nothing local: the probe reports what the trainer says
        config = json.loads(Path(cached).read_text())
    folder = _config_folders() / f"{catalog.slug(name)}-{config_digest(config)}"
    target = folder / "config.json"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".config.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(config, indent=1))
        tmp.replace(target)
    return str(folder)


def _cached_file(repo_id: str, *names: str) -> str | None:
    """The local Hugging Face cache path of the first of ``names`` cached for ``repo_id``."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    for filename in names:
        try:
            found = try_to_load_from_cache(repo_id, filename)
        except ValueError:  # not a valid repo id
            return None
        if isinstance(found, str):
            return found
    return None


def random_weights(loaded: str) -> bool:
    """Whether ``loaded``, what :func:`probe_model` gave, is one of its config-only folders."""
    return Path(loaded).parent == _config_folders()


def _config_folders() -> Path:
    from ..spec import spec_cache_dir

    return spec_cache_dir().parent / "tune-models"
