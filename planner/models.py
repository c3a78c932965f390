"""Find a model's spec, in this order: a local directory or config.json, a built-in tiny
model (``tiny:ARCH``), the built-in catalog, the local Hugging Face cache, or the hub only
when allowed.

Specs are cached on disk keyed by the config digest, the LoRA target spec and
the transformers/peft versions; a cached spec loads without importing torch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from agilerl.utils.sources import (
    LoraTargetError,
    cached_config,
    check_causal_lm_type,
    check_config,
    check_model_source,
    local_path,
    looks_like_path,
    multimodal_architecture,
    multimodal_text_model,
    parse_tiny,
    read_config,
)

from .spec import (
    DEFAULT_LORA_TARGETS,
    SPEC_SCHEMA_VERSION,
    ModelSpec,
    config_digest,
    spec_cache_dir,
)

__all__ = ["load_model_spec", "ModelNotFound"]


class ModelNotFound(KeyError):
    """No config for this model here (and downloads are off); the message suggests close names."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "model not found"


def _installed_versions() -> tuple[str, str]:
    from importlib.metadata import version

    return version("transformers"), version("peft")


def _cache_path(digest: str, targets: tuple[str | tuple[str, ...], ...]) -> Path:
    tv, pv = _installed_versions()
    targets_key = "+".join(ModelSpec.target_key(t) for t in targets).replace("/", "_")
    if len(targets_key) > 64:  # module lists (a LoraConfig whose targets PEFT expanded) would overflow a file name
        import hashlib

        targets_key = "t" + hashlib.sha1(targets_key.encode()).hexdigest()[:16]
    key = f"{digest}-{targets_key}-tf{tv}-peft{pv}-v{SPEC_SCHEMA_VERSION}"
    return spec_cache_dir() / f"{key}.json"


def _from_config_dict(config: dict, *, name: str, targets: tuple[str | tuple[str, ...], ...]) -> ModelSpec:
    check_config(config, name)
    # A config.json with a catalog entry's content (a downloaded or copied checkpoint): its shipped spec.
    from . import catalog

    hub_id = catalog.by_content(config)
    if hub_id is not None:
        shipped = catalog.load_spec(hub_id)
        if all(shipped.has_lora_targets(t) for t in targets):
            return shipped.model_copy(update={"name": name})
    path = _cache_path(config_digest(config), targets)
    if (cached := _read_cached(path)) is not None:
        # the spec of these contents, under the name asked for (a fine-tune shares its base's config)
        return cached.model_copy(update={"name": name})
    from .spec import UnsupportedArchitecture, build_spec

    check_causal_lm_type(config, name)

    # A multimodal checkpoint: its text model, which is what the trainer fine-tunes once exported
    # (agilerl.utils.text_model); the vision / audio encoders are not counted.
    multimodal = multimodal_architecture(config)
    build_from = multimodal_text_model(config) if multimodal else config
    try:
        spec = build_spec(build_from, name=name, lora_targets=targets, text_model_of=multimodal)
    except (UnsupportedArchitecture, LoraTargetError):
        raise
    except Exception as err:  # transformers' own checks (a strict dataclass's among them), or torch's
        raise ValueError(f"transformers cannot build {name} from its config: {_first_line(err)}") from err
    _write_cached(path, spec)
    return spec


def _first_line(err: Exception) -> str:
    """``Type: message``, the message cut at its first line (torch appends C++ frames)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _read_cached(path: Path) -> ModelSpec | None:
    """The cached spec at ``path``; None when there is none or it cannot be read (it is rebuilt)."""
    from pydantic import ValidationError

    try:
        return ModelSpec.model_validate_json(path.read_text())
    except (OSError, ValueError, ValidationError):
        return None


def _write_cached(path: Path, spec: ModelSpec) -> None:
    """Cache ``spec``; a cache folder that cannot be written (AGILERL_CACHE a file, read-only)
    costs the next plan the rebuild, nothing else."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(spec.model_dump_json())
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def load_model_spec(
    model: str,
    *,
    lora_targets: str | tuple[str, ...] = DEFAULT_LORA_TARGETS[0],
    allow_download: bool = False,
) -> ModelSpec:
    """The spec of ``model`` covering ``lora_targets``; see the module docstring for the lookup order."""
    # Module names stay a tuple: PEFT reads a string as one regular expression.
    wanted = lora_targets if isinstance(lora_targets, str) else tuple(sorted(lora_targets))
    targets = tuple(dict.fromkeys([*DEFAULT_LORA_TARGETS, wanted]))
    want = ModelSpec.target_key(lora_targets)

    try:
        path = local_path(model)
    except ValueError as err:
        raise ModelNotFound(str(err)) from None
    if path.is_dir() and (path / "config.json").exists():
        return _from_config_dict(read_config(path / "config.json"), name=str(path), targets=targets)
    if path.is_file() and path.suffix == ".json":
        return _from_config_dict(read_config(path), name=str(path), targets=targets)
    if looks_like_path(model) and not path.exists():
        raise ModelNotFound(f"{model}: no such file or directory (expected a model directory or a config.json)")
    if looks_like_path(model) and path.is_dir():
        raise ModelNotFound(f"{model}: a directory without a config.json (expected a model directory or a config.json)")
    if model.startswith("tiny:"):
        from agilerl.utils.tiny import char_tokenizer, tiny_config

        arch, kwargs = parse_tiny(model)
        kwargs.pop("seed", None)
        kwargs.setdefault("vocab_size", len(char_tokenizer()))
        config = tiny_config(arch, **kwargs).to_dict()
        return _from_config_dict(config, name=model, targets=targets)

    from . import catalog

    name = catalog.resolve(model)
    if name is not None:
        spec = catalog.load_spec(name)
        if spec.has_lora_targets(want):
            return spec
        return _from_config_dict(catalog.entry(name).config, name=name, targets=targets)

    cached = cached_config(model)
    if cached is not None:
        return _from_config_dict(read_config(cached), name=model, targets=targets)
    if allow_download:
        return _from_config_dict(read_config(_download_config(model)), name=model, targets=targets)
    close = catalog.suggest(model)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    if path.is_dir():
        local = "a local directory without a config.json"
    elif path.exists():
        local = "a local file, not a config.json"
    else:
        local = "not a local directory or config.json"
    raise ModelNotFound(
        f"unknown model {model!r}: {local}, not in the local Hugging Face cache, "
        f"not in the built-in catalog.{hint} Pass --allow-download to fetch its config from the hub."
    )


def _download_config(model: str) -> Path:
    """``model``'s config.json from the hub (``--allow-download``); ModelNotFound in one line when
    the hub cannot give it (offline, unreachable, no such repository, gated)."""
    check_model_source(model, allow_download=True, for_training=False)  # offline or unreachable: in 3 s
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json"))
    except Exception as err:  # the hub client's errors share no base class short of Exception
        raise ModelNotFound(f"{model}: could not fetch its config.json from the hub: {_first_line(err)}") from None
