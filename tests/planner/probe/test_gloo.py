"""The probe's settled gloo collectives (planner.probe.gloo), on 2 real gloo ranks."""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests._dist import DistCases

cases = DistCases(__name__, nproc=2)


def _sharded_stack() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


@cases.case
def every_buffer_fsdp2_hands_gloo_is_freed_by_the_training_thread(ctx):
    """Unsettled, gloo's worker thread still held about one all-gather output in seven when the
    call returned (a 2-rank loop of them), so the storage was freed on that thread, at no moment
    FSDP2 chose. Settled, 10 steps' 80 all-gathers and 40 reduce-scatters free every buffer on
    the training thread (unsettled, all 80 all-gathers would have to be on time: about 2e-6 at
    that rate; without settling, this case failed in each of 3 runs)."""
    from planner.probe.gloo import settle_fsdp_collectives

    model = _sharded_stack()
    assert settle_fsdp_collectives(model) == 5
    handed, late = [0], []

    def note(kind: str) -> None:
        if threading.get_ident() != threading.main_thread().ident:
            late.append(kind)

    def following(fn, kind):
        def wrapper(output, input, *args, **kwargs):
            for t in (output, input):
                weakref.finalize(t.untyped_storage(), note, kind)
            handed[0] += 1
            return fn(output, input, *args, **kwargs)

        return wrapper

    originals = dist.all_gather_single, dist.reduce_scatter_single
    dist.all_gather_single = following(originals[0], "all-gather")
    dist.reduce_scatter_single = following(originals[1], "reduce-scatter")
    try:
        for _ in range(10):
            model(torch.randn(8, 256)).sum().backward()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals
    assert handed[0] == 10 * (4 + 4 + 4), handed[0]  # each block's forward and backward gathers, its reduce-scatter
    assert late == [], late


@cases.case
def gloos_copy_of_a_reduce_scatter_input_is_freed_when_the_call_returns(ctx):
    """Gloo's reduce-scatter reduces a copy of its input and splits it on the calling thread while
    it waits, where a tracker sees it; the estimate counts it on CPU while the call runs
    (planner.memory._static.reduce_scatter_copies). Settled, every buffer made inside the call is
    freed by the time it returns, in each of 50 calls (unsettled, gloo's worker freed it when it
    next took its lock)."""
    from planner.probe.gloo import _SettledReduceScatter

    made: list[weakref.ref] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace != "c10d":
                made.extend(
                    weakref.ref(t.untyped_storage()) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                )
            return out

    alive, copies = 0, 0
    for _ in range(50):
        full = torch.arange(1 << 16, dtype=torch.float32) + ctx.rank
        out = torch.empty(1 << 15)
        with Record():
            _SettledReduceScatter()(out, full, dist.group.WORLD, dist.ReduceOp.SUM)
        theirs = {t.untyped_storage().data_ptr() for t in (out, full)}
        scratch = [ref for ref in made if ref() is None or ref().data_ptr() not in theirs]
        copies += len(scratch) > 0
        alive += sum(ref() is not None for ref in scratch)
        made.clear()
        expected = (torch.arange(1 << 16, dtype=torch.float32) * 2 + 1)[(1 << 15) * ctx.rank :][: 1 << 15]
        assert torch.equal(out, expected)
    assert copies == 50, copies  # gloo made one in every call: the estimate's CPU term stands
    assert alive == 0, alive


test_dist = cases.pytest_test()


def test_a_holder_that_never_lets_go_stops_the_waiting_after_three_misses(monkeypatch, capsys):
    """A torch whose gloo kept a collective's tensors for good would cost the limit per
    collective: past it three times in a row, the process waits no more, and says so on stderr.
    One miss (a rank descheduled that long on a loaded machine) leaves the next collectives
    settled."""
    import time
    from types import SimpleNamespace

    from planner.probe import gloo

    monkeypatch.setattr(gloo, "SETTLE_LIMIT_S", 0.2)
    monkeypatch.setattr(gloo, "_waiting", [True])
    monkeypatch.setattr(gloo, "_misses", [0])
    tensor, kept = torch.zeros(4), []

    def missed() -> float:
        start = time.monotonic()
        with gloo._settled(tensor):
            kept.append(tensor.view(2, 2))  # a holder the "collective" never drops
        return time.monotonic() - start

    assert missed() >= 0.2 and gloo._waiting == [True] and gloo._misses == [1]
    with gloo._settled(tensor):  # a collective that lets go: settled, and the count starts again
        pass
    assert gloo._misses == [0]
    for _ in range(3):
        assert missed() >= 0.2
    assert gloo._waiting == [False]
    assert "3 collectives' tensors in a row" in capsys.readouterr().err

    def waited() -> None:
        raise AssertionError("waited again")

    monkeypatch.setattr(gloo, "os", SimpleNamespace(sched_yield=waited))
    with gloo._settled(tensor):
        kept.append(tensor.view(4, 1))
