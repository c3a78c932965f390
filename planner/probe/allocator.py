"""PyTorch's CUDA caching allocator replayed over an allocation trace recorded anywhere.

A GPU's device peak is what the caching allocator has reserved, not what tensors hold: it
keeps freed blocks cached in their segments and serves a later request from the smallest
cached block that fits, splitting it, so a segment once carved by a small request can no
longer take a large one. On CPU nothing reserves anything, but the order and sizes of the
storages a run makes and frees are the same as on a GPU (what kernels allocate inside
themselves aside). :class:`TraceRecorder` records them as a TorchDispatchMode with storage
finalizers; :class:`CachingAllocator` replays them under the allocator's rules (its defaults,
c10/cuda/CUDACachingAllocator.cpp: no ``max_split_size``, no expandable segments, one stream,
nothing released):

- a request is rounded up to 512 bytes; up to 1 MiB it is served from the small pool, whose
  segments are 2 MiB; above, from the large pool, whose segments are 20 MiB for requests
  under 10 MiB, else the request rounded up to 2 MiB;
- a request takes the smallest cached block of its pool that fits (the lowest address on a
  tie), or a new segment; what the block has beyond the request is split off when it is at
  least 512 bytes (small pool) or over 1 MiB (large), else handed out with it;
- a freed block merges with free neighbours of its segment and is cached.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIB = 2**20
BLOCK_ROUND = 512
SMALL_REQUEST = MIB
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
LARGE_ROUND = 2 * MIB


def rounded(request: int) -> int:
    return max(BLOCK_ROUND, -(-request // BLOCK_ROUND) * BLOCK_ROUND)


def segment_size(size: int) -> int:
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // LARGE_ROUND) * LARGE_ROUND


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocator:
    """The allocator's bookkeeping: ``reserved`` (segments) and ``allocated`` (blocks handed
    out) now and at their peaks since :meth:`reset_peaks`."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _blocks: dict[tuple[int, int], _Block] = field(default_factory=dict)
    _small: dict[int, bool] = field(default_factory=dict)  # per segment: of the small pool

    def malloc(self, request: int) -> _Block:
        size = rounded(request)
        small = size <= SMALL_REQUEST
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, seg, off = pool.pop(i)
            block = self._blocks[(seg, off)]
        else:
            block = _Block(len(self._small), 0, segment_size(size))
            self._small[block.segment] = small
            self._blocks[(block.segment, 0)] = block
            self.reserved += block.size
        rest = block.size - size
        if rest >= BLOCK_ROUND if small else rest > SMALL_REQUEST:
            tail = _Block(block.segment, block.offset + size, rest, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._blocks[(tail.segment, tail.offset)] = tail
            bisect.insort(pool, (tail.size, tail.segment, tail.offset))
        block.free = False
        self.allocated += block.size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        pool = self._free[self._small[block.segment]]
        self.allocated -= block.size
        block.free = True
        after, before = block.next, block.prev
        if after is not None and after.free:
            pool.remove((after.size, after.segment, after.offset))
            del self._blocks[(after.segment, after.offset)]
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        if before is not None and before.free:
            pool.remove((before.size, before.segment, before.offset))
            del self._blocks[(block.segment, block.offset)]
            before.size += block.size
            before.next = block.next
            if block.next is not None:
                block.next.prev = before
            block = before
        bisect.insort(pool, (block.size, block.segment, block.offset))

    def reset_peaks(self) -> None:
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated


class TraceRecorder(TorchDispatchMode):
    """Every storage made while active, in order, and when it is freed: ``events`` holds
    ``("alloc", key, nbytes)``, ``("free", key, 0)`` and ``("mark", name, 0)`` (:meth:`mark`).
    ``exclude``: storage pointers not to record (what existed before)."""

    def __init__(self, exclude: set[int] | None = None) -> None:
        super().__init__()
        self.exclude = set(exclude or ())
        self.live: set[int] = set()
        self.events: list[tuple[str, object, int]] = []
        self._serial = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.live and ptr not in self.exclude and storage.nbytes():
                    self._serial += 1
                    key = (ptr, self._serial)
                    self.live.add(ptr)
                    self.events.append(("alloc", key, storage.nbytes()))
                    weakref.finalize(storage, self._free, ptr, key)
        return out

    def _free(self, ptr: int, key: tuple[int, int]) -> None:
        self.live.discard(ptr)
        self.events.append(("free", key, 0))

    def mark(self, name: str) -> None:
        self.events.append(("mark", name, 0))


def replay(events: list[tuple[str, object, int]], allocator: CachingAllocator | None = None) -> dict[str, dict]:
    """Replay ``events`` through ``allocator`` (a new one by default); per span between marks,
    named by the mark that opens it, the allocator's reserved and allocated peaks."""
    alloc = allocator or CachingAllocator()
    blocks: dict[object, _Block] = {}
    spans: dict[str, dict] = {}
    name = "start"
    alloc.reset_peaks()
    for kind, key, nbytes in events:
        if kind == "alloc":
            blocks[key] = alloc.malloc(nbytes)
        elif kind == "free":
            block = blocks.pop(key, None)
            if block is not None:
                alloc.free(block)
        else:
            spans[name] = {"reserved": alloc.peak_reserved, "allocated": alloc.peak_allocated}
            name = str(key)
            alloc.reset_peaks()
    spans[name] = {"reserved": alloc.peak_reserved, "allocated": alloc.peak_allocated}
    return spans
