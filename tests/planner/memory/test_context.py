"""planner.memory._context: the inputs resolved and validated once."""

from __future__ import annotations

import pytest

from agilerl.distributed import FSDPConfig
from planner.memory._context import checkpointed_layers, resolve_workload

from .conftest import WL, make_context


def test_ranks_and_batch(dense_spec):
    ctx = make_context(dense_spec, gpus=4, fsdp=FSDPConfig(tp=2), micro_batch_size_per_gpu=None, prompts_per_step=4)
    assert (ctx.tp, ctx.data_parallel_ranks, ctx.shard_group) == (2, 2, 2)
    assert ctx.completions_per_rank == 4 * 8 // 2
    assert ctx.micro_batch == ctx.completions_per_rank  # the trainer's default: every completion at once
    assert ctx.micro_batches == 1
    assert ctx.sequence_tokens == 128 and ctx.micro_batch_tokens == ctx.micro_batch * 128
    hsdp = make_context(dense_spec, gpus=4, fsdp=FSDPConfig(shard_group_size=2), prompts_per_step=4)
    assert (hsdp.data_parallel_ranks, hsdp.shard_group) == (4, 2)
    assert make_context(dense_spec, gpus=4, fsdp=None, prompts_per_step=4).shard_group == 1


def test_dtypes(dense_spec):
    sharded = make_context(dense_spec, fsdp=FSDPConfig(param_dtype="float32"), weights_dtype="bfloat16")
    assert (sharded.weight_bytes, sharded.compute_bytes) == (2, 4)
    unsharded = make_context(dense_spec, fsdp=None, weights_dtype="float32")
    assert (unsharded.weight_bytes, unsharded.compute_bytes) == (4, 4)


def test_layers_of_a_block_type_share_a_representative(ple_spec):
    ctx = make_context(ple_spec)
    assert ctx.distinct_layers == (0, 3)  # three sliding-window layers, then a global one
    assert ctx.representative == (0, 0, 0, 3)
    assert (ctx.carried_hidden, ctx.extra_streams) == (4 * 64, 3)


def test_experts(moe_spec):
    ctx = make_context(moe_spec, gpus=4, fsdp=FSDPConfig(ep=2), prompts_per_step=4)
    assert ctx.packed == (True, True) and ctx.expert_lora == (True, True)
    assert ctx.expert_rowwise and ctx.expert_group == 2
    hf = make_context(moe_spec, fsdp=FSDPConfig(routed_expert_chunk_mib=None))
    assert not hf.expert_rowwise and hf.expert_group is None


def test_checkpointed_layers(ple_spec):
    kind = ple_spec.block(0).kind
    assert checkpointed_layers(ple_spec, WL, None) == {0, 1, 2, 3}
    assert checkpointed_layers(ple_spec, WL, FSDPConfig(checkpoint_every_n_blocks=2)) == {0, 2}
    assert checkpointed_layers(ple_spec, WL.model_copy(update={"gradient_checkpointing": False}), None) == set()
    every = checkpointed_layers(ple_spec, WL, FSDPConfig(checkpoint_skip_layer_types=[kind]))
    assert every == set()  # every tiny Gemma-3n block is of one kind


def test_resolve_workload_fills_the_trainers_defaults():
    wl = resolve_workload(WL.model_copy(update={"micro_batch_size_per_gpu": None, "gradient_checkpointing": None}),
                          data_parallel_ranks=4)
    assert wl.micro_batch_size_per_gpu == 2 * 8 // 4
    assert wl.gradient_checkpointing is True


def test_what_the_trainer_refuses(dense_spec, moe_spec):
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        make_context(dense_spec, gpus=3, fsdp=FSDPConfig())
    with pytest.raises(KeyError, match="no LoRA coverage"):
        make_context(dense_spec, lora_targets=("q_proj",))
    with pytest.raises(ValueError, match="KV heads"):
        make_context(dense_spec, gpus=4, fsdp=FSDPConfig(tp=4), prompts_per_step=4)
    with pytest.raises(ValueError, match="needs packed MoE experts"):
        make_context(dense_spec, fsdp=FSDPConfig(ep=2))
    with pytest.raises(ValueError, match=r"allowed: \[1, 2\]"):
        make_context(moe_spec, gpus=6, fsdp=FSDPConfig(ep=3), prompts_per_step=6)
