"""Every agilerl.distributed helper at world size 2 (real gloo ranks)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import agilerl.distributed as ad
from agilerl.distributed import FSDPConfig
from tests._dist import DistCases, count_calls

cases = DistCases(__name__, nproc=2)


@cases.case
def init_and_ranks(ctx):
    assert ad.init_distributed() is True  # reuses the existing group
    assert ad.is_distributed()
    assert ad.get_world_size() == 2 and ad.get_rank() == ctx.rank
    assert ad.get_local_rank() == ctx.rank
    assert ad.is_main_process() == (ctx.rank == 0)
    assert ad.resolve_device() == (f"cuda:{ctx.rank}" if torch.cuda.is_available() else "cpu")
    ad.barrier()


@cases.case
def broadcast_and_gather_objects(ctx):
    objs = [{"x": 1}, "hello"] if ctx.rank == 0 else [None, None]
    out = ad.broadcast_object_list(objs, src=0)
    assert out is objs and objs == [{"x": 1}, "hello"]
    objs = ["a"] if ctx.rank == 1 else [None, None]
    if ctx.rank == 0:
        objs = [None]
    ad.broadcast_object_list(objs, src=1)
    assert objs == ["a"]
    gathered = ad.gather_objects([ctx.rank] * (ctx.rank + 1))
    assert gathered == [0, 1, 1]


@cases.case
def gather_tensor_shapes(ctx):
    scalar = ad.gather_tensor(torch.tensor(float(ctx.rank) + 0.5))
    assert torch.equal(scalar, torch.tensor([0.5, 1.5]))
    from_float = ad.gather_tensor(float(ctx.rank))
    assert from_float.tolist() == [0.0, 1.0]
    mat = ad.gather_tensor(torch.full((2, 3), ctx.rank))
    assert mat.shape == (4, 3) and mat[:2].eq(0).all() and mat[2:].eq(1).all()
    ragged = ad.gather_tensor(np.arange(ctx.rank + 1))  # rank 0: [0], rank 1: [0, 1]
    assert ragged.tolist() == [0, 0, 1]


@cases.case
def minmax(ctx):
    assert ad.allreduce_minmax_int(10 + 5 * ctx.rank) == (10, 15)


@cases.case
def metrics_mean(ctx):
    value = torch.tensor([1.0, 3.0]) if ctx.rank == 0 else np.array([10.0])
    assert math.isclose(ad.aggregate_metrics_across_gpus(value), (2.0 + 10.0) / 2)


@cases.case
def metrics_dict_excluded_maximized_nan(ctx):
    metrics = {
        "loss": float(ctx.rank),  # 0, 1 -> mean 0.5
        "reward": 4.0 if ctx.rank == 0 else 100.0,  # rank 1 excludes -> 4
        "gone": 7.0,  # every rank excludes -> NaN
        "peak": 3.0 + ctx.rank,  # maximized -> 4, even though rank 1 also lists it as excluded
    }
    excluded = ("gone",) + (("reward", "peak") if ctx.rank == 1 else ())
    with count_calls(dist, "all_reduce") as calls:
        out = ad.aggregate_metrics_dict(metrics, excluded=excluded, maximized=("peak",))
    assert calls.n == 1, "all metrics must be reduced in one all-reduce"
    assert out["loss"] == 0.5 and out["reward"] == 4.0 and out["peak"] == 4.0
    assert math.isnan(out["gone"])
    assert list(out) == list(metrics)


@cases.case
def sync_grads_averages_in_one_collective(ctx):
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2, 2))
    a.grad = torch.full((3,), float(ctx.rank + 1))  # 1, 2 -> 1.5
    b.grad = torch.full((2, 2), 10.0 * ctx.rank)  # 0, 10 -> 5
    with count_calls(dist, "all_reduce") as calls:
        ad.sync_grads([a, b])
    assert calls.n == 1
    assert torch.equal(a.grad, torch.full((3,), 1.5)) and torch.equal(b.grad, torch.full((2, 2), 5.0))


@cases.case
def all_reduce_grads_fills_missing_with_zeros(ctx):
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(2))
    if ctx.rank == 0:
        p.grad = torch.tensor([4.0, 8.0])
    q.grad = torch.ones(2)
    ad.all_reduce_grads([p, q])
    assert torch.equal(p.grad, torch.tensor([2.0, 4.0]))  # (4 + 0) / 2 on both ranks
    assert torch.equal(q.grad, torch.ones(2))


def _sharded_linear_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, full


@cases.case
def materialize_dtensors_gathers_differentiably(ctx):
    model, full = _sharded_linear_model()
    w = model[0].weight
    assert isinstance(w, DTensor) and w.to_local().shape == (3, 4)
    with ad.materialize_dtensors(w, model[0].bias) as (dense_w, dense_b):
        assert not isinstance(dense_w, DTensor)
        assert torch.equal(dense_w, full["0.weight"]) and torch.equal(dense_b, full["0.bias"])
        dense_w.sum().backward()
    assert w.grad is not None and torch.equal(w.grad.full_tensor(), torch.ones(6, 4))
    with ad.materialize_dtensors(w, None, model[1].weight) as many:
        assert isinstance(many, list) and many[1] is None and many[2].shape == (2, 6)


@cases.case
def gather_params_installs_and_restores(ctx):
    model, full = _sharded_linear_model()
    params = list(model.parameters())
    with ad.gather_params(model, params) as dense:
        assert all(not isinstance(t, DTensor) for t in dense)
        sd = model.state_dict()
        assert set(sd) == set(full)
        for k in full:
            assert not isinstance(sd[k], DTensor) and torch.equal(sd[k], full[k])
        dense[0].data.fill_(123.0)  # writes are discarded on exit
    after = list(model.parameters())
    assert all(a is b for a, b in zip(after, params))
    assert all(isinstance(p, DTensor) for p in after)
    assert torch.equal(model[0].weight.full_tensor(), full["0.weight"])


@cases.case
def full_shape_views_zero_storage(ctx):
    model, _ = _sharded_linear_model()
    params = list(model.parameters())
    with ad.full_shape_views(model, params + [params[0], None]):
        w = model[0].weight
        assert not isinstance(w, DTensor)
        assert w.shape == (6, 4) and w.dtype == torch.float32
        assert w.untyped_storage().nbytes() == 4  # one scalar behind the expanded view
    assert all(a is b for a, b in zip(model.parameters(), params))


@cases.case
def clip_grad_norm_mixed_dtensor_and_plain(ctx):
    model, _ = _sharded_linear_model()
    plain = torch.nn.Parameter(torch.zeros(3))
    for p in model.parameters():
        p.grad = DTensor.from_local(torch.ones_like(p.to_local()), p.device_mesh, p.placements)
    plain.grad = torch.full((3,), 2.0)
    total_elems = sum(p.numel() for p in model.parameters())
    expected = math.sqrt(total_elems * 1.0 + 3 * 4.0)
    norm = ad.clip_grad_norm_(list(model.parameters()) + [plain], max_norm=1.0)
    assert math.isclose(float(norm), expected, rel_tol=1e-5)
    after = math.sqrt(
        sum(float(p.grad.full_tensor().pow(2).sum()) for p in model.parameters()) + float(plain.grad.pow(2).sum())
    )
    assert math.isclose(after, 1.0, rel_tol=1e-4)


@cases.case
def fsdpconfig_needs_no_process_group_but_apply_needs_one(ctx):
    # Constructing is pure; this rank has a group so apply works (covered elsewhere).
    cfg = FSDPConfig(shard_group_size=2)
    assert cfg.shard_group_size == 2


test_dist = cases.pytest_test()
