"""PyTorch's CUDA caching allocator replayed over an allocation trace recorded anywhere.

A GPU's device peak is what the caching allocator has reserved, not what tensors hold: it
keeps freed blocks cached in their segments and serves a later request from the smallest
cached block that fits, splitting it, so a segment once carved by a small request can no
longer take a large one. On CPU nothing reserves anything, but the order and sizes of the
storages a run makes and frees are the same as on a GPU (what kernels allocate inside
themselves aside). :class:`TraceRecorder` records them as a TorchDispatchMode with storage
finalizers; :func:`replay` runs them through the allocator's rules
(planner.memory._allocator.CachingAllocator).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.memory import CachingAllocator

__all__ = ["CachingAllocator", "MATMULS", "TraceRecorder", "free_by_origin", "replay"]


#: the operators that run a cuBLAS GEMM on a GPU (linear decomposes into them)
MATMULS = frozenset(
    getattr(torch.ops.aten, name) for name in ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm")
)


class TraceRecorder(TorchDispatchMode):
    """Every storage made while active, in order, and when it is freed: ``events`` holds
    ``("alloc", key, nbytes)``, ``("free", key, 0)`` and ``("mark", name, 0)`` (:meth:`mark`).
    ``exclude``: storage pointers not to record (what existed before).

    ``workspaces``: the bytes of the cuBLAS workspaces one thread's handle takes from the caching
    allocator at its first GEMM on a GPU (each as its own allocation, never freed). They are
    recorded where the GPU allocates them: after the output of the first matmul outside
    backward (the Python thread's handle) and of the first inside it (autograd's device
    thread's): on CPU both run on the calling thread, but autograd's graph task tells them apart.

    A bf16 GEMM on a CPU tensor runs in fp32 and is cast back (:func:`_gemm_via_fp32`): its output
    is the same bf16 storage, and the fp32 copies live inside this handler, where nothing is
    recorded. A CPU without AVX-512 BF16 runs a bf16 GEMM through a reference kernel 100-150x
    slower than fp32 (1,024 x 4,096 x 896: 5.8 s against 0.04 s on an AVX2 EPYC core), which made
    recording Qwen2.5-0.5B's two steps there take over 20 minutes; the trace is what is recorded,
    not the values.
    """

    def __init__(self, exclude: set[int] | None = None, workspaces: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.exclude = set(exclude or ())
        self.live: set[int] = set()
        self.events: list[tuple[str, object, int]] = []
        self._serial = 0
        self.workspaces = tuple(workspaces)
        self._threads: set[str] = set()  # whose handle has its workspaces

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        gemm = func.overloadpacket in MATMULS
        kwargs = kwargs or {}
        out = _gemm_via_fp32(func, args, kwargs) if gemm and _bf16_on_cpu(args) else func(*args, **kwargs)
        self._record(out)
        if self.workspaces and gemm:
            thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            if thread not in self._threads:
                self._threads.add(thread)
                self.events += [("alloc", ("workspace", thread, i), n) for i, n in enumerate(self.workspaces)]
        return out

    def _record(self, out) -> None:
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

    def _free(self, ptr: int, key: tuple[int, int]) -> None:
        self.live.discard(ptr)
        self.events.append(("free", key, 0))

    def mark(self, name: str) -> None:
        self.events.append(("mark", name, 0))


def _bf16_on_cpu(args) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors)


def _gemm_via_fp32(func, args, kwargs) -> torch.Tensor:
    """``func`` (a GEMM whose tensor arguments are all bf16 on the CPU) computed in fp32 and cast
    back: a new bf16 tensor of the output's shape, as the bf16 kernel would make."""
    up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    return func(*up, **kwargs).to(torch.bfloat16)


def _applied(events: list[tuple[str, object, int]], alloc: CachingAllocator) -> Iterator[tuple[str, str]]:
    """Apply ``events`` to ``alloc`` one at a time, yielding after each its kind and the span it
    falls in (for a mark, the span it closes), then ``("end", last span)``. Spans
    are named by the mark that opens them, the first "start"."""
    blocks: dict[object, Any] = {}  # the allocator's blocks, by trace key
    name = "start"
    for kind, key, nbytes in events:
        if kind == "alloc":
            blocks[key] = alloc.malloc(nbytes)
        elif kind == "free":
            block = blocks.pop(key, None)
            if block is not None:
                alloc.free(block)
        yield kind, name
        if kind == "mark":
            name = str(key)
    yield "end", name


def replay(events: list[tuple[str, object, int]], allocator: CachingAllocator | None = None) -> dict[str, dict]:
    """Replay ``events`` through ``allocator`` (a new one by default); per span between marks,
    named by the mark that opens it, the allocator's reserved and allocated peaks."""
    alloc = allocator or CachingAllocator()
    spans: dict[str, dict] = {}
    alloc.reset_peaks()
    for kind, name in _applied(events, alloc):
        if kind in ("mark", "end"):
            spans[name] = {"reserved": alloc.peak_reserved, "allocated": alloc.peak_allocated}
            alloc.reset_peaks()
    return spans


def free_by_origin(events: list[tuple[str, object, int]]) -> dict[str, dict]:
    """Where a span's reserved-beyond-allocated sits: per span between marks, at the moment its
    allocated peak is reached, the free bytes of the caching allocator's segments grouped by
    where each segment was made ("<span that made it> <pool>", the pool "small" (2 MiB
    segments), "20 MiB" or "large"), beside ``allocated`` (the peak), ``reserved_then`` and
    ``reserved`` (at the span's end), and ``made``: the bytes of the segments of each origin
    reserved by the span's end. Segments reserved after the peak moment are what ``reserved``
    has beyond ``reserved_then``. The estimate's slack terms are judged against it
    (benchmarks/allocator_replay.py --segments)."""
    alloc = CachingAllocator()
    origin: dict[int, str] = {}  # per segment
    made: dict[str, int] = {}  # bytes of the segments of each origin
    out: dict[str, dict] = {}

    def snapshot() -> dict:
        free: dict[str, int] = {}
        for segment, nbytes in alloc.free_by_segment().items():
            free[origin[segment]] = free.get(origin[segment], 0) + nbytes
        return {"allocated": alloc.allocated, "reserved_then": alloc.reserved, "free": free}

    at_peak = snapshot()
    for kind, name in _applied(events, alloc):
        for segment in range(len(origin), alloc.segments):  # at most one, made by this event
            origin[segment] = f"{name} {alloc.kind_of(segment)}"
            made[origin[segment]] = made.get(origin[segment], 0) + alloc.segment_bytes(segment)
        if kind in ("mark", "end"):
            out[name] = {**at_peak, "reserved": alloc.reserved, "made": dict(made)}
            at_peak = snapshot()
        elif alloc.allocated > at_peak["allocated"]:
            at_peak = snapshot()
    return out
