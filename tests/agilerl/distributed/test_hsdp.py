"""HSDP: shard_group_size=2 on 4 gloo ranks (2 replicas x 2 shards)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard

from agilerl.distributed import FSDPConfig, fsdp_layout
from tests._dist import DistCases
from tests.agilerl.distributed._parity import assert_parity

cases = DistCases(__name__, nproc=4)


@cases.case
def hsdp_2x2_parity_and_layout(ctx):
    config = FSDPConfig(
        param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0, shard_group_size=2
    )
    model = assert_parity("qwen2", config)
    mesh = fsdp_layout(model).mesh
    assert mesh.shape == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")
    w = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(w, DTensor) and w.placements == (Replicate(), Shard(0))
    assert w.to_local().shape[0] == w.shape[0] // 2  # sharded over 2 ranks, not 4


@cases.case
def hsdp_2x2_with_replicated_params_and_micro_batches(ctx):
    config = FSDPConfig(
        param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=100, shard_group_size=2
    )
    assert_parity("llama", config, micro_batches=1, max_norm=0.5)


@cases.case
def flat_fsdp_on_four_ranks(ctx):
    config = FSDPConfig(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)
    model = assert_parity("qwen2", config)
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.placements == (Shard(0),) and w.to_local().shape[0] == w.shape[0] // 4


test_dist = cases.pytest_test()
