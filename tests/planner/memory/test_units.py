"""planner.memory._units: tensors as FSDP sees them on rank 0, and the units they form."""

from __future__ import annotations

import math

from agilerl.distributed import FSDPConfig
from planner.memory._units import build_layout, make_tensor

from .conftest import make_context


def test_a_tensor_split_by_tp_then_sharded():
    t = make_tensor((10, 6), 0, tp=4, tp_dim=0)  # ceil(10 / 4) = 3 rows on this TP rank
    assert (t.rows, t.rest, t.numel, t.sharded) == (3, 6, 18, True)
    assert t.local(2) == 2 * 6  # ceil(3 / 2) rows
    cols = make_tensor((10, 6), 0, tp=4, tp_dim=1)
    assert (cols.rows, cols.rest) == (10, 2)


def test_the_threshold_applies_to_the_global_size():
    small = make_tensor((10, 6), 61, tp=2, tp_dim=0)
    assert not small.sharded and small.local(4) == small.numel == 30
    assert make_tensor((10, 6), 60, tp=2, tp_dim=0).sharded


def test_experts_split_by_ep_always_shard():
    t = make_tensor((8, 4, 2), 10**9, ep=4, ep_dim=0, group=2)
    assert (t.rows, t.rest, t.sharded) == (2, 8, True)
    assert t.local(8) == 1 * 8  # FSDP over its group of 2, not the 8 given


def test_units_in_forward_order(dense_spec):
    layout = build_layout(make_context(dense_spec, fsdp=FSDPConfig(wrap_every_n_blocks=3)))
    assert [u.name for u in layout.units] == ["embed", "blocks.0", "blocks.3", "lm_head"]
    per_block = len(dense_spec.block(0).tensors)
    assert [len(u.base) for u in layout.block_units] == [3 * per_block, per_block]
    adapters = len(dense_spec.block(0).lora["all-linear"])
    assert len(layout.block_units[1].lora) == 2 * adapters  # A and B
    assert sum(t.numel for t in layout.base_tensors) == dense_spec.total_params


def test_expert_units_nest_in_their_block_under_ep(moe_spec):
    ctx = make_context(moe_spec, gpus=4, fsdp=FSDPConfig(ep=2), prompts_per_step=4)
    layout = build_layout(ctx)
    assert [u.name for u in layout.nested["blocks.0"]] == ["blocks.0.experts"]
    stack = sum(math.prod(s) for n, s in moe_spec.block(0).tensors if n.startswith("mlp.experts."))
    assert layout.expert_stack == (stack // 2, stack // 2)
    assert layout.expert_down[0] == 8 * 128 * 512 // 2
    assert build_layout(make_context(moe_spec, fsdp=FSDPConfig())).nested["blocks.0"] == ()


def test_tied_embeddings_and_per_layer_tables(ple_spec):
    sharded = build_layout(make_context(ple_spec, fsdp=FSDPConfig()))
    assert [u.name for u in sharded.units][:2] == ["embed_tokens_per_layer", "blocks.0"]
    assert sharded.head is None and sharded.embed in sharded.root.base
    unsharded = build_layout(make_context(ple_spec, gpus=1))
    assert unsharded.units[0].name == "blocks.0"  # the table sits in the root
    assert len(unsharded.root.base) == len(sharded.root.base) + 1


def test_a_reused_layout_gives_the_estimate_a_fresh_one_gives_on_every_catalog_model():
    # build_layout keeps layouts (and their sums) across estimates; an estimate must not depend on
    # what was asked before it.
    from planner import catalog
    from planner.hardware import GPUS, Cluster
    from planner.memory import _units, estimate
    from planner.models import load_model_spec
    from planner.workload import Workload

    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8, gpus_per_node=8)
    # the gathered sizes are kept per compute dtype, their windows per prefetch depth: vary both
    configs = (
        None,
        FSDPConfig(wrap_every_n_blocks=2),
        FSDPConfig(wrap_every_n_blocks=2, param_dtype="float32", prefetch_units=2, backward_prefetch_units=3),
    )
    workloads = [Workload(), Workload(micro_batch_size_per_gpu=1, gradient_checkpointing=False, lora_rank=64)]
    combos = [(fsdp, wl) for fsdp in configs for wl in workloads]
    seen = set()
    for name in catalog.names():
        spec = load_model_spec(name)
        if spec.name in seen:
            continue
        seen.add(spec.name)
        fresh = []
        for fsdp, wl in combos:
            _units._LAYOUTS.clear()
            fresh.append(estimate(spec, wl, cluster, fsdp).phases)
        # The cache now holds what the last combination made: the earlier ones must not reuse it.
        warm = [estimate(spec, wl, cluster, fsdp).phases for fsdp, wl in combos]
        assert fresh == warm, name
