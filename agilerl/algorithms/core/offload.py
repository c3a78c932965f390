"""The trainer's weights parked in host memory while a colocated rollout engine generates.

``offload_weights_during_rollout=True`` (upstream AgileRL calls it
``use_memory_efficient_params``): after the engine has received the new
weights, the trainer copies its weights (the frozen base and the LoRA
adapters) to host memory and frees their device storage, the engine takes the
freed memory for its KV cache, and after generation the weights are copied back
before training. Only one copy of the base is then on the device at any time.

The device storage is released with ``untyped_storage().resize_(0)`` and
restored in place, so every parameter, view and FSDP2 shard keeps pointing at
the same storage object: nothing is re-registered, and sharded and unsharded
models are handled alike. Host buffers are allocated once (pinned on CUDA) and
reused every rollout. The optimizer state and buffers stay on the device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["WeightOffload"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class WeightOffload:
    """Moves every parameter of ``model`` (base and adapters) to host memory and back."""

    def __init__(self, model: nn.Module) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for name, p in model.named_parameters():
            if not _local(p).untyped_storage().resizable():
                # Weights memory-mapped from a checkpoint file (CPU only; device storages resize).
                if isinstance(p, DTensor):
                    raise ValueError(f"{name}: its storage cannot be freed in place (memory-mapped shard)")
                p.data = p.data.clone()
            storage = _local(p).untyped_storage()
            if storage.device.type != "meta" and storage.nbytes():
                storages.setdefault(storage.data_ptr(), storage)
        self._storages = list(storages.values())
        self._sizes = [s.nbytes() for s in self._storages]
        self._host: list[torch.Tensor] | None = None
        self.offloaded = False

    @property
    def nbytes(self) -> int:
        """Device bytes the offload frees."""
        return sum(self._sizes)

    @staticmethod
    def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def offload(self) -> None:
        if self.offloaded:
            return
        if self._host is None:
            self._host = [
                torch.empty(size, dtype=torch.uint8, pin_memory=s.device.type == "cuda")
                for s, size in zip(self._storages, self._sizes)
            ]
        for storage, host in zip(self._storages, self._host):
            host.copy_(self._bytes_view(storage), non_blocking=True)
        if any(s.device.type == "cuda" for s in self._storages):
            torch.cuda.synchronize()
        for storage in self._storages:
            storage.resize_(0)
        self.offloaded = True

    def restore(self) -> None:
        if not self.offloaded:
            return
        for storage, size, host in zip(self._storages, self._sizes, self._host):
            storage.resize_(size)
            self._bytes_view(storage).copy_(host, non_blocking=True)
        if any(s.device.type == "cuda" for s in self._storages):
            torch.cuda.synchronize()
        self.offloaded = False
