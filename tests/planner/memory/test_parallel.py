"""planner.memory._parallel: what tensor and expert parallelism split."""

from __future__ import annotations

from planner.memory import expert_parallel_degrees, tensor_parallel_degrees
from planner.memory._parallel import is_packed_expert, tp_dim


def test_tp_dims_follow_the_tp_plan():
    assert tp_dim("self_attn.q_proj.weight") == 0 and tp_dim("self_attn.q_proj.bias") == 0
    assert tp_dim("mlp.up_proj.weight") == 0
    assert tp_dim("self_attn.o_proj.weight") == 1 and tp_dim("mlp.down_proj.weight") == 1
    assert tp_dim("self_attn.o_proj.bias") is None  # a rowwise bias is whole
    assert tp_dim("input_layernorm.weight") is None


def test_packed_experts_are_three_dimensional_or_their_adapters():
    assert is_packed_expert("mlp.experts.gate_up_proj", (8, 1024, 128))
    assert is_packed_expert("mlp.experts:down_proj")
    assert not is_packed_expert("mlp.experts.0.down_proj.weight", (128, 512))  # a module list
    assert not is_packed_expert("mlp.shared_expert.down_proj.weight", (128, 512))


def test_degrees(dense_spec, moe_spec):
    assert expert_parallel_degrees(dense_spec, 8) == [1]
    assert expert_parallel_degrees(moe_spec, 8) == [1, 2, 4, 8]  # 8 experts per layer
    assert expert_parallel_degrees(moe_spec, 6) == [1, 2]
    assert tensor_parallel_degrees(dense_spec, 8) == [1, 2]  # 2 KV heads
