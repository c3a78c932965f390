"""Read Hugging Face checkpoints one tensor at a time.

Sharded loading fills each rank's slices from a full state dict. Reading the
checkpoint lazily (a Mapping that opens safetensors on access) keeps each
rank's host memory at about one tensor, instead of a full model per rank.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

__all__ = ["LazyCheckpoint", "PeftKeyView", "ChainedState", "ConvertedCheckpoint", "QuantisedView", "atomic_save"]


def atomic_save(obj, file: Path) -> None:
    """``torch.save`` that a kill cannot tear: a temporary file beside ``file``, fsync, rename, fsync the folder.

    A reader sees the old file or the whole new one, never half of either.
    """
    import os

    file = Path(file)
    tmp = file.with_name(f".{file.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(file.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint directory (safetensors or .bin), loaded on access."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._key_to_file: dict[str, Path] = {}
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._key_to_file = {k: self.directory / f for k, f in weight_map.items()}
        elif single.exists():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                self._key_to_file = {k: single for k in f.keys()}
        else:
            bins = sorted(self.directory.glob("pytorch_model*.bin"))
            if not bins:
                raise FileNotFoundError(f"no safetensors or pytorch_model*.bin weights in {self.directory}")
            self._bin: dict[str, torch.Tensor] = {}
            for b in bins:
                # mmap keeps the pages in the page cache, shared between ranks.
                self._bin.update(torch.load(b, map_location="cpu", mmap=True, weights_only=True))
            self._key_to_file = {k: Path("") for k in self._bin}

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self._key_to_file[key]
        if path == Path(""):
            return self._bin[key]
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._key_to_file)

    def __len__(self) -> int:
        return len(self._key_to_file)


_PEFT_PREFIX = re.compile(r"^base_model\.model\.")
_BASE_LAYERS = re.compile(r"(\.base_layer)+\.")  # PEFT nests one per adapted parameter of a module


class PeftKeyView(Mapping[str, torch.Tensor]):
    """A base checkpoint seen under the keys of a PEFT-wrapped model.

    ``base_model.model.X.base_layer.weight`` reads ``X.weight`` (packed MoE
    experts with LoRA on both tensors nest two ``base_layer``); adapter keys
    (``lora_A``/``lora_B``) are not part of the base checkpoint.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], model_keys: list[str]) -> None:
        self.base = base
        self._map: dict[str, str] = {}
        for key in model_keys:
            plain = _BASE_LAYERS.sub(".", _PEFT_PREFIX.sub("", key))
            if plain in base:
                self._map[key] = plain

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.base[self._map[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


class ChainedState(Mapping[str, torch.Tensor]):
    """Several state mappings seen as one (first hit wins)."""

    def __init__(self, *parts: Mapping[str, torch.Tensor]) -> None:
        self.parts = parts

    def __getitem__(self, key: str) -> torch.Tensor:
        for part in self.parts:
            if key in part:
                return part[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for part in self.parts:
            for k in part:
                if k not in seen:
                    seen.add(k)
                    yield k

    def __len__(self) -> int:
        return sum(1 for _ in self)


class QuantisedView(Mapping[str, torch.Tensor]):
    """A full-precision state seen as QLoRA's NF4: each 4-bit module's weight is quantised when read.

    ``modules`` maps state-dict keys to their ``bitsandbytes.nn.Linear4bit``.
    Reading such a key quantises the one full-precision tensor as transformers'
    bitsandbytes loader does (NF4, blocks of 64, double quantisation, in the
    compute ``dtype``), gives the module its whole quantisation state and
    returns the packed uint8 weight, which a sharded model slices like any
    other tensor. Host memory holds one tensor at a time. ``fallback`` supplies
    keys ``base`` lacks (a config without weights: random tensors drawn per key).
    """

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        modules: Mapping[str, torch.nn.Module],
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        fallback: Callable[[str, torch.nn.Module], torch.Tensor] | None = None,
    ) -> None:
        self.base, self.modules, self.dtype, self.device, self.fallback = base, modules, dtype, device, fallback

    def __getitem__(self, key: str) -> torch.Tensor:
        module = self.modules.get(key)
        if module is None:
            return self.base[key]
        import bitsandbytes as bnb

        full = self.base[key] if key in self.base else self.fallback(key, module)
        packed, state = bnb.functional.quantize_4bit(
            full.to(self.dtype), blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
        )
        state.to(self.device)  # in place
        module.quant_state = state
        return packed

    def __contains__(self, key: object) -> bool:
        return key in self.base or (self.fallback is not None and key in self.modules)

    def __iter__(self) -> Iterator[str]:
        yield from self.base
        if self.fallback is not None:
            yield from (k for k in self.modules if k not in self.base)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ConvertedCheckpoint(Mapping[str, torch.Tensor]):
    """A checkpoint seen through transformers' own load-time conversion for ``model_type``.

    Transformers 5 keeps MoE experts packed (``mlp.experts.gate_up_proj`` [E, 2I, H])
    while checkpoints store them per expert (``mlp.experts.3.gate_proj.weight``);
    ``from_pretrained`` converts with a mapping of renamings and weight converters
    (``transformers.conversion_mapping``). This reads that mapping as data and
    applies its renamings and the two operations MoE packing uses, stacking per-expert
    tensors along a dim (``MergeModulelist``) and concatenating sources
    (``Concatenate``), lazily: a packed tensor is built when it is read, so host
    memory holds one layer's experts at a time. Other operations are refused by name.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], model_type: str) -> None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        self.base = base
        transforms = get_checkpoint_conversion_mapping(model_type) or []
        renames: list[tuple[str, str]] = []
        converters = []
        for t in transforms:
            ops = [type(o).__name__ for o in getattr(t, "operations", None) or []]
            if not ops:
                for src, dst in zip(t.source_patterns, t.target_patterns):
                    renames.append((src, dst))
                continue
            unknown = set(ops) - {"MergeModulelist", "Concatenate"}
            if unknown:
                raise NotImplementedError(
                    f"checkpoint conversion for {model_type} uses {sorted(unknown)}, "
                    "which the sharded loader does not apply"
                )
            converters.append(t)
        self._renamed: dict[str, str] = {}
        for key in base:
            new = key
            for src, dst in renames:
                new = new.replace(src, dst)
            self._renamed[new] = key
        self._packed: dict[str, tuple[list[dict[int, str]], list]] = {}
        consumed: set[str] = set()
        for t in converters:
            regexes = [re.compile(re.escape(p).replace(r"\*", r"(\d+)")) for p in t.source_patterns]
            groups: dict[str, list[dict[int, str]]] = {}
            for key in self._renamed:
                for i, rx in enumerate(regexes):
                    m = rx.search(key)
                    if m:
                        prefix = key[: m.start()]
                        groups.setdefault(prefix, [dict() for _ in regexes])[i][int(m.group(1))] = key
                        consumed.add(key)
            for prefix, sources in groups.items():
                self._packed[prefix + t.target_patterns[0]] = (sources, list(t.operations))
        self._plain = {k: v for k, v in self._renamed.items() if k not in consumed}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._plain:
            return self.base[self._plain[key]]
        sources, ops = self._packed[key]
        stacked = []
        merge_dim = next((o.dim for o in ops if type(o).__name__ == "MergeModulelist"), 0)
        for per_expert in sources:
            tensors = [self.base[self._renamed[per_expert[e]]] for e in sorted(per_expert)]
            stacked.append(torch.stack(tensors, dim=merge_dim))
        concat = next((o for o in ops if type(o).__name__ == "Concatenate"), None)
        return torch.cat(stacked, dim=concat.dim) if concat is not None and len(stacked) > 1 else stacked[0]

    def __iter__(self) -> Iterator[str]:
        yield from self._plain
        yield from self._packed

    def __len__(self) -> int:
        return len(self._plain) + len(self._packed)
