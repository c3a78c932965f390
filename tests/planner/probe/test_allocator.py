"""planner.probe.allocator: the CUDA caching allocator's rules, replayed."""

from __future__ import annotations

import torch

from planner.probe.allocator import CachingAllocator, TraceRecorder, free_by_origin, replay

MIB = 2**20


def test_a_freed_block_is_cached_and_served_again():
    a = CachingAllocator()
    tile = a.malloc(594 * MIB)
    a.free(tile)
    assert (a.reserved, a.allocated) == (594 * MIB, 0)  # nothing is given back
    a.malloc(594 * MIB)
    assert a.reserved == 594 * MIB


def test_a_cached_block_carved_by_a_smaller_request_cannot_take_the_next_tile():
    a = CachingAllocator()
    a.free(a.malloc(594 * MIB))
    activation = a.malloc(38 * MIB)  # the smallest cached block that fits: the tile's, split
    a.malloc(594 * MIB)  # 556 MiB left there: a second segment
    assert (a.reserved, a.allocated) == (1188 * MIB, 632 * MIB)
    a.free(activation)  # merges with the 556 MiB left beside it: one 594 MiB block again
    a.malloc(594 * MIB)
    assert (a.reserved, a.allocated) == (1188 * MIB, 1188 * MIB)


def test_segment_sizes_rounding_and_splits():
    a = CachingAllocator()
    a.malloc(2048 * 11008 * 2)  # 43 MiB: a 44 MiB segment, the 1 MiB left is not split off
    assert (a.reserved, a.allocated) == (44 * MIB, 44 * MIB)
    a = CachingAllocator()
    a.malloc(8 * MIB)  # under 10 MiB: a 20 MiB segment, 12 MiB split off and cached
    a.malloc(8 * MIB)
    a.malloc(8 * MIB)  # 4 MiB left in the first: a second segment
    assert (a.reserved, a.allocated) == (40 * MIB, 24 * MIB)
    a = CachingAllocator()
    for _ in range(3):
        a.malloc(100)  # the small pool: 512-byte blocks of one 2 MiB segment
    assert (a.reserved, a.allocated) == (2 * MIB, 3 * 512)


def test_replay_reports_each_marked_spans_peaks():
    events = [
        ("alloc", "w", 10 * MIB),
        ("mark", "learn", 0),
        ("alloc", "x", 30 * MIB),
        ("free", "x", 0),
        ("mark", "step", 0),
        ("alloc", "y", 4 * MIB),
    ]
    spans = replay(events)
    assert spans["learn"] == {"reserved": 40 * MIB, "allocated": 40 * MIB}
    # the peaks restart at a mark from what is held then (40 MiB reserved, 10 allocated); the
    # 4 MiB request is served from x's cached 30 MiB block, split: no new segment
    assert spans["step"] == {"reserved": 40 * MIB, "allocated": 14 * MIB}


def test_the_recorder_sees_each_new_storage_and_its_free():
    x = torch.ones(1000)
    recorder = TraceRecorder(exclude={x.untyped_storage().data_ptr()})
    with recorder:
        y = x * 2
        z = y.view(10, 100)  # a view: no new storage
        recorder.mark("between")
        del y, z
    kinds = [(kind, size) for kind, _, size in recorder.events]
    assert kinds == [("alloc", 4000), ("mark", 0), ("free", 0)]


def test_the_recorder_takes_each_threads_workspaces_at_its_first_matmul_forward_and_backward():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    recorder = TraceRecorder(
        exclude={w.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}, workspaces=(1000, 10)
    )
    with recorder:
        y = torch.relu(x @ w)  # the first GEMM: its output (128 bytes), then the forward handle's workspaces
        z = (y @ w).sum()  # a second GEMM on the same thread: no new workspace
        recorder.mark("backward")
        z.backward()  # the first GEMM in backward: autograd's handle takes its own
    ws = [(i, kind, key[1]) for i, (kind, key, _) in enumerate(recorder.events) if key[0] == "workspace"]
    assert [(kind, thread) for _, kind, thread in ws] == [("alloc", "forward")] * 2 + [("alloc", "backward")] * 2
    assert recorder.events[0][2] == 4 * 8 * 4 and ws[0][0] == 1  # after the matmul's output
    mark = recorder.events.index(("mark", "backward", 0))
    assert ws[1][0] < mark < ws[2][0]
    assert sum(n for kind, key, n in recorder.events if kind == "alloc" and key[0] == "workspace") == 2 * 1010


def test_a_bf16_gemm_is_recorded_as_its_bf16_output_alone():
    # bf16 GEMMs run in fp32 inside the recorder (fast on every CPU); the trace is the bf16
    # kernel's: one storage of the output's shape in bf16, nothing of the fp32 copies.
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    b = torch.randn(32, dtype=torch.bfloat16)
    recorder = TraceRecorder(exclude={t.untyped_storage().data_ptr() for t in (w, x, b)})
    with recorder:
        y = x @ w
        z = torch.addmm(b, x, w)
    assert [(kind, n) for kind, _, n in recorder.events] == [("alloc", 16 * 32 * 2)] * 2
    assert y.dtype == z.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.float() @ w.float()).to(torch.bfloat16))
    torch.testing.assert_close(z, torch.addmm(b, x, w), rtol=2e-2, atol=2e-2)


def test_free_space_at_the_allocated_peak_is_told_by_the_span_and_kind_of_its_segment():
    events = [
        ("alloc", "w", 30 * MIB),  # before any mark: a "start" segment of its own
        ("mark", "ref", 0),
        ("alloc", "x", 8 * MIB),  # under 10 MiB: a 20 MiB segment, 12 MiB of it cached
        ("alloc", "tile", 594 * MIB),
        ("free", "tile", 0),
        ("alloc", "act", 38 * MIB),  # the smallest cached block that fits is the tile's: 556 MiB left
        ("alloc", "tile2", 594 * MIB),  # cannot fit in 556: a second segment
        ("free", "x", 0),
        ("mark", "learn", 0),
        ("free", "act", 0),
        ("alloc", "small", 1000),
    ]
    spans = free_by_origin(events)
    ref = spans["ref"]
    assert ref["allocated"] == (30 + 8 + 38 + 594) * MIB  # the peak, before x is freed
    assert ref["free"] == {"ref large": 556 * MIB, "ref 20 MiB": 12 * MIB}
    assert ref["reserved_then"] == ref["reserved"] == (30 + 594 + 20 + 594) * MIB
    learn = spans["learn"]  # its peak is its start: act freed merges back into a whole 594 MiB block
    assert learn["allocated"] == (30 + 38 + 594) * MIB
    assert learn["free"] == {"ref large": 556 * MIB, "ref 20 MiB": 20 * MIB}
    assert learn["reserved"] == learn["reserved_then"] + 2 * MIB  # the small pool's first segment
    assert ref["made"] == {"start large": 30 * MIB, "ref 20 MiB": 20 * MIB, "ref large": 2 * 594 * MIB}
    assert learn["made"] == {**ref["made"], "learn small": 2 * MIB}
