"""Read Hugging Face checkpoints one tensor at a time.

Sharded loading fills each rank's slices from a full state dict. Reading the
checkpoint lazily (a Mapping that opens safetensors on access) keeps each
rank's host memory at about one tensor, instead of a full model per rank.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

__all__ = ["LazyCheckpoint", "PeftKeyView", "ChainedState"]


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


class PeftKeyView(Mapping[str, torch.Tensor]):
    """A base checkpoint seen under the keys of a PEFT-wrapped model.

    ``base_model.model.X.base_layer.weight`` reads ``X.weight``; adapter keys
    (``lora_A``/``lora_B``) are not part of the base checkpoint.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], model_keys: list[str]) -> None:
        self.base = base
        self._map: dict[str, str] = {}
        for key in model_keys:
            plain = _PEFT_PREFIX.sub("", key).replace(".base_layer.", ".")
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
