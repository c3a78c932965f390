"""The layout rules the runtime and the planner share (agilerl.distributed._plan): torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agilerl.distributed import (
    BLOCK_PLAN,
    COLWISE,
    ROWWISE,
    FSDPConfig,
    ParallelDims,
    expert_chunk_rows,
    expert_parallel_problem,
    expert_row_bytes,
    fsdp_units,
    tp_dim,
    tp_split_problem,
)


def test_the_rules_import_no_torch():
    code = (
        "import sys; from agilerl.distributed import ParallelDims, fsdp_units, tp_split_problem; "
        "ParallelDims(8, tp=2); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("dims", "dp", "shard", "replicate", "expert_shard", "mesh"),
    [
        (ParallelDims(8), 8, 8, 1, 8, ((8,), ("shard",))),
        (ParallelDims(8, tp=2), 4, 4, 1, 8, ((4, 2), ("dp", "tp"))),
        (ParallelDims(8, tp=2, shard_group_size=4), 4, 4, 1, 8, ((4, 2), ("dp", "tp"))),
        (ParallelDims(16, shard_group_size=8), 16, 8, 2, 16, ((2, 8), ("replicate", "shard"))),
        (ParallelDims(8, shard_group_size=8), 8, 8, 1, 8, ((8,), ("shard",))),
        (ParallelDims(8, ep=4), 8, 8, 1, 2, ((8,), ("shard",))),
    ],
)
def test_groups_and_meshes(dims, dp, shard, replicate, expert_shard, mesh):
    assert (dims.dp, dims.shard, dims.replicate, dims.expert_shard) == (dp, shard, replicate, expert_shard)
    assert dims.fsdp_mesh() == mesh
    shape, names = dims.fsdp_mesh()
    assert len(shape) == len(names) and shape[0] * (shape[1] if len(shape) > 1 else 1) == dims.world
    assert dims.expert_mesh() == ((expert_shard, dims.ep), ("expert_shard", "ep"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world=0), "world size must be positive"),
        (dict(world=8, tp=0), "tp=0 must be positive"),
        (dict(world=8, tp=3), r"tp=3 must divide the 8 ranks \(allowed: 1, 2, 4, 8\)"),
        (dict(world=6, ep=4), r"ep=4 must divide the 6 ranks \(allowed: 1, 2, 3, 6\)"),
        (
            dict(world=12, shard_group_size=5),
            r"shard_group_size=5 must divide the 12 ranks \(allowed: 1, 2, 3, 4, 6, 12\)",
        ),
        (dict(world=8, tp=2, shard_group_size=2), "HSDP.*not supported yet"),
        (dict(world=8, ep=2, tp=2), "ep=2 with tp > 1"),
        (dict(world=8, ep=2, shard_group_size=4), "ep=2 with tp > 1 or shard_group_size"),
    ],
)
def test_invalid_dims_name_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_fsdp_config_validates_through_the_same_dims():
    assert FSDPConfig(tp=2).dims(8) == ParallelDims(8, tp=2)
    with pytest.raises(ValueError, match=r"tp=3 must divide the 8 ranks"):
        FSDPConfig(tp=3).check_world(8)
    # The world-free half of the rule holds without a world size, on the config itself.
    with pytest.raises(ValueError, match="ep=2 with tp > 1"):
        FSDPConfig(ep=2, tp=2)


def test_tensor_parallel_plan():
    # Megatron's split: q/k/v and gate/up by output columns, o and down by input rows.
    assert set(COLWISE) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert set(ROWWISE) == {"o_proj", "down_proj"}
    assert {p.rsplit(".", 1)[1] for p in BLOCK_PLAN} == set(COLWISE) | set(ROWWISE)
    assert tp_dim("self_attn.q_proj.weight") == 0
    assert tp_dim("self_attn.q_proj.bias") == 0  # a colwise bias follows its output rows
    assert tp_dim("mlp.down_proj.weight") == 1
    assert tp_dim("self_attn.o_proj.bias") is None  # a rowwise bias is added after the all-reduce
    assert tp_dim("input_layernorm.weight") is None
    assert tp_dim("mlp.experts.gate_up_proj") is None


def test_tp_split_problem():
    assert tp_split_problem(1, num_heads=9, num_kv_heads=3, intermediate_size=7) is None
    assert tp_split_problem(2, num_heads=8, num_kv_heads=2, intermediate_size=64) is None
    problem = tp_split_problem(4, num_heads=8, num_kv_heads=2, intermediate_size=64)
    assert "not divisible: {'num_key_value_heads': 2}" in problem and "allowed: 1, 2)" in problem
    # Without a dense MLP (every block MoE) only the heads count.
    assert tp_split_problem(2, num_heads=8, num_kv_heads=2, intermediate_size=65) is not None
    assert tp_split_problem(2, num_heads=8, num_kv_heads=2) is None
    assert "attention sinks" in tp_split_problem(2, num_heads=8, num_kv_heads=2, sinks=True)


def test_expert_parallel_problem():
    assert expert_parallel_problem(8, 4, (128,)) is None
    assert expert_parallel_problem(8, 3) == "ep=3 must divide the 8 ranks (allowed: 1, 2, 4, 8)"
    assert expert_parallel_problem(8, 8, (60, 64)) == "ep=8 must divide the 60 experts per layer (allowed: 1, 2, 4)"


def test_expert_chunk_rows():
    # gate_up's output is 2 x 512 wide in bf16: 2 KiB a row, so 1 MiB holds 512 rows.
    row = expert_row_bytes(expert_width=512, hidden_size=256, element_size=2)
    assert row == 2048
    assert expert_chunk_rows(chunk_mib=1, row_bytes=row) == 512
    # A hidden state wider than gate_up's output sets the row.
    assert expert_row_bytes(expert_width=64, hidden_size=1024, element_size=4) == 4096
    assert expert_chunk_rows(chunk_mib=None, row_bytes=row) is None
    assert expert_chunk_rows(chunk_mib=1 / 2**20, row_bytes=row) == 1  # never below one row


def test_fsdp_unit_order():
    names = [u.name for u in fsdp_units(4, 3)]
    assert names == ["embed", "blocks.0", "blocks.3", "lm_head"]
    units = fsdp_units(5, 2, separate_embedding=False, per_layer_embeddings=1, separate_head=False)
    assert [(u.kind, u.start, u.stop) for u in units] == [
        ("per_layer_embed", 0, 1),
        ("blocks", 0, 2),
        ("blocks", 2, 4),
        ("blocks", 4, 5),
    ]
    with pytest.raises(ValueError, match="wrap_every_n_blocks=0"):
        fsdp_units(4, 0)
