"""PyTorch's CUDA caching allocator, simulated: what it reserves (its segments) and hands out
(its blocks) for a sequence of requests and frees, under its default rules
(c10/cuda/CUDACachingAllocator.cpp: no ``max_split_size``, no expandable segments, one
stream, nothing released):

- a request is rounded up to 512 bytes; up to 1 MiB it is served from the small pool, whose
  segments are 2 MiB; above, from the large pool, whose segments are 20 MiB for requests
  under 10 MiB, else the request rounded up to 2 MiB;
- a request takes the smallest cached block of its pool that fits (the lowest address on a
  tie), or a new segment; what the block has beyond the request is split off when it is at
  least 512 bytes (small pool) or over 1 MiB (large), else handed out with it;
- a freed block merges with free neighbours of its segment and is cached.

The estimate replays the base weights through it (planner.memory._overheads); the probe
replays a whole trace recorded on CPU (planner.probe.allocator).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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
    # per segment: its bytes (the small pool's are SMALL_SEGMENT, no large pool's is)
    _sizes: list[int] = field(default_factory=list)

    def malloc(self, request: int) -> _Block:
        size = rounded(request)
        small = size <= SMALL_REQUEST
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, seg, off = pool.pop(i)
            block = self._blocks[(seg, off)]
        else:
            block = _Block(len(self._sizes), 0, segment_size(size))
            self._sizes.append(block.size)
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
        pool = self._free[self._is_small(block.segment)]
        self.allocated -= block.size
        block.free = True
        after, before = block.next, block.prev
        if after is not None and after.free:
            pool.remove((after.size, after.segment, after.offset))
            self._join(block, after)
        if before is not None and before.free:
            pool.remove((before.size, before.segment, before.offset))
            self._join(before, block)
            block = before
        bisect.insort(pool, (block.size, block.segment, block.offset))

    def _join(self, left: _Block, right: _Block) -> None:
        """``right`` merged into its neighbour ``left`` (neither is in a pool)."""
        del self._blocks[(right.segment, right.offset)]
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left

    def free_by_segment(self) -> dict[int, int]:
        """Bytes of the cached (free) blocks of each segment that has any, by segment number
        (segments are numbered in the order they were reserved)."""
        out: dict[int, int] = {}
        for block in self._blocks.values():
            if block.free:
                out[block.segment] = out.get(block.segment, 0) + block.size
        return out

    @property
    def segments(self) -> int:
        """How many segments are reserved; the next one made gets this number."""
        return len(self._sizes)

    def segment_bytes(self, segment: int) -> int:
        return self._sizes[segment]

    def _is_small(self, segment: int) -> bool:
        return self._sizes[segment] == SMALL_SEGMENT

    def kind_of(self, segment: int) -> str:
        """A segment's kind by its size: "small" (the small pool's 2 MiB), "20 MiB" (requests of
        1-10 MiB) or "large" (one request of 10 MiB or more, rounded to 2 MiB)."""
        if self._is_small(segment):
            return "small"
        return "20 MiB" if self._sizes[segment] == LARGE_SEGMENT else "large"

    def reset_peaks(self) -> None:
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated
