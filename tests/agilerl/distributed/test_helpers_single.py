"""Every agilerl.distributed helper on a single device (no launcher env)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import agilerl.distributed as ad
from agilerl.distributed import FSDPConfig


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_init_is_noop_without_launcher():
    assert ad.init_distributed() is False
    assert ad.is_distributed() is False
    assert (ad.get_rank(), ad.get_local_rank(), ad.get_world_size()) == (0, 0, 1)
    assert ad.is_main_process()
    ad.barrier()


def test_a_partial_launcher_env_for_several_processes_is_refused(monkeypatch):
    # as if one process of a two-process run were started by hand: run on as one device, it
    # would train on its half of the data alone
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT are not"):
        ad.init_distributed()
    with pytest.raises(RuntimeError, match="torchrun"):
        ad.resolve_device()


def test_a_world_size_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="WORLD_SIZE='two' is not a number of processes"):
        ad.init_distributed()


def test_a_partial_launcher_env_for_one_process_runs_on_one_device(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ad.init_distributed() is False
    assert ad.get_world_size() == 1


def test_object_helpers_are_identity():
    objs = [1, "a", {"b": 2}]
    assert ad.broadcast_object_list(objs) is objs
    assert ad.gather_objects([1, 2]) == [1, 2]
    assert ad.allreduce_minmax_int(7) == (7, 7)


def test_gather_tensor_identity_and_conversion():
    t = torch.arange(6).view(3, 2)
    assert ad.gather_tensor(t) is t
    scalar = ad.gather_tensor(2.5)
    assert scalar.shape == () and scalar.item() == 2.5
    arr = ad.gather_tensor(np.array([1.0, 2.0]))
    assert torch.equal(arr, torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_metric_means_are_local():
    assert ad.aggregate_metrics_across_gpus(torch.tensor([1.0, 2.0, 6.0])) == pytest.approx(3.0)
    assert ad.aggregate_metrics_across_gpus(np.array([4.0])) == 4.0
    out = ad.aggregate_metrics_dict(
        {"loss": torch.tensor([1.0, 3.0]), "reward": 5.0, "len": np.array([2, 4])},
        excluded=("reward",),
        maximized=("len",),
    )
    # On a single device each metric is its local mean (decision 10).
    assert out == {"loss": 2.0, "reward": 5.0, "len": 3.0}


def test_metrics_dict_rejects_unknown_names():
    with pytest.raises(KeyError, match="nope"):
        ad.aggregate_metrics_dict({"a": 1.0}, excluded=("nope",))


def test_grad_helpers_noop():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    ad.sync_grads([p])
    ad.all_reduce_grads([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))


def test_resolve_device():
    assert ad.resolve_device("cpu") == "cpu"
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert ad.resolve_device() == expected


def test_materialize_dtensors_passes_plain_tensors():
    a, b = torch.ones(2), None
    with ad.materialize_dtensors(a, b) as pair:
        assert isinstance(pair, tuple) and pair[0] is a and pair[1] is None
    with ad.materialize_dtensors(a, b, a) as many:
        assert isinstance(many, list) and len(many) == 3


def test_gather_params_and_full_shape_views_pass_plain_params():
    lin = torch.nn.Linear(2, 3)
    with ad.gather_params(lin, [lin.weight, None]) as got:
        assert got[0] is lin.weight and got[1] is None
    with ad.full_shape_views(lin, [lin.weight]):
        assert lin.weight.shape == (3, 2)


def test_apply_fsdp2_without_process_group_says_torchrun():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="torchrun"):
        ad.apply_fsdp2(model, FSDPConfig())


def test_expert_parallel_with_tp_or_hsdp_is_refused_at_construction():
    config = FSDPConfig(ep=2, ep_token_blocks=4, routed_expert_chunk_mib=128)
    assert (config.ep, config.ep_token_blocks, config.routed_expert_chunk_mib) == (2, 4, 128)
    with pytest.raises(ValueError, match="ep=2 with tp > 1"):
        FSDPConfig(ep=2, tp=2)
    with pytest.raises(ValueError, match="shard_group_size"):
        FSDPConfig(ep=2, shard_group_size=4)
    with pytest.raises(ValueError, match="ep=2 with tp > 1"):
        config.tp = 2  # validate_assignment: the same rule on assignment


def test_check_world_names_the_field_and_what_divides():
    FSDPConfig(tp=2, shard_group_size=4).check_world(8)
    FSDPConfig(shard_group_size=4).check_world(8)
    with pytest.raises(ValueError, match=r"tp=3 must divide the 8 ranks \(allowed: 1, 2, 4, 8\)"):
        FSDPConfig(tp=3).check_world(8)
    with pytest.raises(ValueError, match="tp=16 must divide the 8 ranks"):
        FSDPConfig(tp=16).check_world(8)
    with pytest.raises(ValueError, match="shard_group_size=3 must divide"):
        FSDPConfig(shard_group_size=3).check_world(8)
    with pytest.raises(ValueError, match="shard_group_size=16 must divide"):
        FSDPConfig(shard_group_size=16).check_world(8)
    with pytest.raises(ValueError, match="not supported yet"):
        FSDPConfig(tp=2, shard_group_size=2).check_world(8)
    with pytest.raises(ValueError, match="ep=3 must divide"):
        FSDPConfig(ep=3).check_world(8)


def test_lazy_names_cover_the_documented_api():
    documented = {
        "init_distributed",
        "is_distributed",
        "get_rank",
        "get_local_rank",
        "get_world_size",
        "is_main_process",
        "barrier",
        "broadcast_object_list",
        "gather_tensor",
        "gather_objects",
        "allreduce_minmax_int",
        "aggregate_metrics_across_gpus",
        "aggregate_metrics_dict",
        "sync_grads",
        "materialize_dtensors",
        "gather_params",
        "full_shape_views",
        "resolve_device",
        "FSDPConfig",
        "apply_fsdp2",
        "all_reduce_grads",
        "materialize_fsdp2_from_cpu_state",
        "set_full_model_state_dict",
    }
    assert documented <= set(ad.__all__)
    for name in documented:
        assert callable(getattr(ad, name))


def test_documented_signatures():
    import inspect

    sig = inspect.signature(ad.apply_fsdp2)
    assert list(sig.parameters) == ["model", "config", "mesh", "expert_mesh", "gradient_checkpointing"]
    assert sig.parameters["gradient_checkpointing"].default is False
    assert inspect.signature(ad.init_distributed).parameters["timeout_seconds"].default == 1800
    assert inspect.signature(ad.broadcast_object_list).parameters["src"].default == 0
    agg = inspect.signature(ad.aggregate_metrics_dict).parameters
    assert agg["excluded"].default == () and agg["maximized"].default == ()
    assert inspect.signature(ad.resolve_device).parameters["requested"].default is None


def test_nan_when_every_rank_excludes_is_a_cross_rank_rule():
    # On one device "excluded" does not apply (decision 10); the multi-rank test covers NaN.
    out = ad.aggregate_metrics_dict({"a": 1.0}, excluded=("a",))
    assert out["a"] == 1.0 and not math.isnan(out["a"])
