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
    wl = resolve_workload(
        WL.model_copy(update={"micro_batch_size_per_gpu": None, "gradient_checkpointing": None}), data_parallel_ranks=4
    )
    assert wl.micro_batch_size_per_gpu == 2 * 8 // 4
    assert wl.gradient_checkpointing is True


def test_what_the_trainer_refuses(dense_spec, moe_spec):
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        make_context(dense_spec, gpus=3, fsdp=FSDPConfig())
    with pytest.raises(KeyError, match="no LoRA coverage"):
        make_context(dense_spec, lora_targets=("q_proj",))
    with pytest.raises(ValueError, match=r"tp=4 must divide .* not divisible: \{'num_key_value_heads': 2\}"):
        make_context(dense_spec, gpus=4, fsdp=FSDPConfig(tp=4), prompts_per_step=4)
    with pytest.raises(ValueError, match="needs packed MoE experts"):
        make_context(dense_spec, fsdp=FSDPConfig(ep=2))
    with pytest.raises(ValueError, match=r"ep=3 must divide the 8 experts per layer \(allowed: 1, 2\)"):
        make_context(moe_spec, gpus=6, fsdp=FSDPConfig(ep=3), prompts_per_step=6)


def test_the_shared_prefix_forward_runs_each_distinct_prompt_once(dense_spec):
    from planner.memory._activations import learn_passes
    from planner.memory._context import distinct_prompts

    # Micro-batches of 2 rows inside groups of 8: one prompt each, over its first 63 of 64 columns.
    ctx = make_context(dense_spec, share_prompt_prefix=True)
    assert (ctx.prefix_split, ctx.prefix_rows) == (63, 1)
    prefix, suffix = learn_passes(ctx)
    assert (prefix.rows, prefix.queries, prefix.keys) == (1, 63, 63)
    assert (suffix.rows, suffix.queries, suffix.keys, suffix.prefix_kv_rows) == (2, 65, 128, 2)
    assert ctx.rollout_prefix_rows == 1  # a rank's 8 completions: one prompt
    whole = make_context(dense_spec)  # rows that share nothing
    assert whole.prefix_split == 0 and [p.tokens for p in learn_passes(whole)] == [2 * 128]
    # Where the trainer runs every row whole, so does the estimate.
    assert make_context(dense_spec, share_prompt_prefix=True, micro_batch_size_per_gpu=1).prefix_split == 0
    assert make_context(dense_spec, share_prompt_prefix=True, attn_implementation="flash_attention_2").prefix_split == 0
    assert make_context(dense_spec, share_prompt_prefix=True, gpus=2, fsdp=FSDPConfig(tp=2)).prefix_split == 0
    # Slices of consecutive completions: whole groups, inside one, or across a boundary.
    assert [distinct_prompts(rows, 4) for rows in (1, 2, 4, 8, 6)] == [1, 1, 1, 2, 3]


def test_a_sliding_window_shorter_than_the_row_runs_it_whole():
    from planner.models import load_model_spec

    short = load_model_spec(
        "tiny:mistral?hidden_size=64&intermediate_size=128&num_layers=2&num_heads=4"
        "&num_kv_heads=2&vocab_size=512&sliding_window=32"
    )
    assert make_context(short, share_prompt_prefix=True).prefix_split == 0
    wide = load_model_spec(
        "tiny:mistral?hidden_size=64&intermediate_size=128&num_layers=2&num_heads=4"
        "&num_kv_heads=2&vocab_size=512&sliding_window=4096"
    )
    assert make_context(wide, share_prompt_prefix=True).prefix_split == 63
