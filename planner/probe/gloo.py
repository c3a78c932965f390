"""FSDP2's collectives on gloo, made to free and allocate where NCCL's would (imports torch).

The CPU probe measures FSDP2 on gloo; the GPUs it stands for run NCCL. Two things gloo does
differ, and both made a probe's phase peak move from run to run on the same input:

- **Late frees.** A gloo collective returns once its result is ready, but gloo's worker thread
  (``pt_gloo_runloop``) still holds its own references to the tensors it was handed until it
  next takes its queue's lock: in loops of 300 2-rank all-gathers, 40 to 55 outputs were still
  held when the call returned. FSDP2 drops its own reference on time; the storage is freed
  only when the worker drops the last one, sometimes several allocations later, and a tracker
  counts it live past the moment FSDP2 freed it.
- **Scratch freed late.** Gloo's reduce-scatter reduces a copy of its input of its own and
  splits it while the caller waits, on the caller's thread, where a tracker sees it: the unit's
  gradients again, in the reduce dtype. The estimate counts that copy on CPU for as long as the
  call runs (planner.memory._static.reduce_scatter_copies); the worker freed it when it next
  took its lock, so it too was sometimes still counted allocations later.

In a 2-rank full fine-tune of a tied Qwen2, these moved the learn peak by up to 1.9 MB (3.6%) in
four runs of eight; an all-gather output freed late made a forward's three gathered units read
as two in one run of six.

``settle_fsdp_collectives`` gives every FSDP2 module an all-gather and a reduce-scatter that run
the collective to completion where it is issued and then wait (yielding the CPU) until gloo's
worker has let go of the tensors it was handed and freed the buffers it made inside the call:
every buffer is then freed where FSDP2 drops it, the copy when the call returns. An asynchronous
all-gather (``async_op``) completes at its issue point too: gloo on CPU overlaps it with nothing
a tracker could see, and FSDP2 treats a missing work handle as done. NCCL needs none of it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["settle_fsdp_collectives", "SETTLE_LIMIT_S", "SETTLE_MISSES"]

SETTLE_LIMIT_S = 2.0
"""The longest a collective waits for gloo's worker to let go of its tensors. Past it that
collective goes on as it would unsettled (a memory reading may then move; nothing else does)."""

SETTLE_MISSES = 3
"""Collectives in a row past :data:`SETTLE_LIMIT_S` after which the process waits no more: a
torch whose gloo keeps the tensors for good would otherwise cost the limit per collective,
while one rank descheduled that long on a loaded machine costs one unsettled collective, not
every later one."""

_waiting = [True]
_misses = [0]  # collectives in a row that ran past the limit


class _Scratch(TorchDispatchMode):
    """The storages made inside a collective on the calling thread (gloo's own buffers, seen
    through the views it splits them into), but for the caller's ``own``."""

    def __init__(self, own: set[int]) -> None:
        super().__init__()
        self.own = own
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.own:
                self.made.append(weakref.ref(t.untyped_storage()))
        return out


def _holders(tensor: torch.Tensor) -> tuple[int, int]:
    """References to ``tensor`` itself and to its memory (gloo may hold either, or a view)."""
    own = tensor._use_count()  # type: ignore[attr-defined]
    return own, torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


@contextlib.contextmanager
def _settled(*tensors: torch.Tensor) -> Iterator[None]:
    """Run a collective on ``tensors``; return once gloo holds no more references to them than
    the caller did before it, and has freed the buffers it made inside it."""
    held = [_holders(t) for t in tensors]
    scratch = _Scratch({t.untyped_storage().data_ptr() for t in tensors})
    with scratch:
        yield
    deadline = time.monotonic() + SETTLE_LIMIT_S

    def settled() -> bool:
        for tensor, (own, shared) in zip(tensors, held, strict=True):
            now_own, now_shared = _holders(tensor)
            if now_own > own or now_shared > shared:
                return False
        return all(ref() is None for ref in scratch.made)

    while _waiting[0] and not settled():
        if time.monotonic() > deadline:
            _misses[0] += 1
            if _misses[0] >= SETTLE_MISSES:
                _waiting[0] = False
                print(
                    f"probe: gloo held {SETTLE_MISSES} collectives' tensors in a row over {SETTLE_LIMIT_S:g} s "
                    "each; no longer waiting",
                    file=sys.stderr,
                )
            return
        os.sched_yield()
    _misses[0] = 0


class _SettledAllGather(DefaultAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        with _settled(output_tensor, input_tensor):
            super().__call__(output_tensor, input_tensor, group, async_op=False)
        return None


class _SettledReduceScatter(DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with _settled(output_tensor, input_tensor):
            super().__call__(output_tensor, input_tensor, group, op, async_op=False)
        return None


def settle_fsdp_collectives(*models: nn.Module | None) -> int:
    """Give every FSDP2 module of ``models`` (None skipped) the settled collectives; the number
    of modules changed. Only under a gloo process group: NCCL needs none of it."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return 0
    changed = 0
    for model in models:
        for module in model.modules() if model is not None else ():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_SettledAllGather())
                module.set_custom_reduce_scatter(_SettledReduceScatter())
                changed += 1
    return changed
