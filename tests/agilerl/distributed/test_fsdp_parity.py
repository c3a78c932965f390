"""FSDP2-sharded training equals single-process training (2 gloo ranks).

Tiny models shard nothing under the default persistence threshold, so every
case sets ``param_persistence_threshold=0`` (and asserts DTensors exist)
except the mixed case, which keeps norms and biases replicated on purpose.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from agilerl.distributed import FSDPConfig, fsdp_layout
from tests._dist import DistCases
from tests.agilerl.distributed._parity import assert_parity, batches

cases = DistCases(__name__, nproc=2)

FP32 = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def _all_sharded(model: torch.nn.Module) -> None:
    params = list(model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params), "every parameter should be a DTensor"


def _parity_cases(arch: str) -> None:
    def default(ctx):
        _all_sharded(assert_parity(arch, FSDPConfig(**FP32)))

    def reshard_off(ctx):
        assert_parity(arch, FSDPConfig(**FP32, reshard_after_forward=False))

    def wrap_two_blocks(ctx):
        model = assert_parity(arch, FSDPConfig(**FP32, wrap_every_n_blocks=2))
        assert len(fsdp_layout(model).units) == 2 + 4 // 2  # embed, 2 block pairs, lm_head

    def checkpointing(ctx):
        model = assert_parity(arch, FSDPConfig(**FP32), gradient_checkpointing=True)
        assert fsdp_layout(model).checkpointed_blocks == [0, 1, 2, 3]
        # a plain Hugging Face forward with labels: the recompute must not find its keys and
        # values cached twice (the forward with grad runs without a cache unless asked)
        ids = batches(model.config.vocab_size, steps=1, rows=2, seq=6)[0]
        out = model(input_ids=ids, labels=ids)
        assert out.past_key_values is None
        out.loss.backward()
        with torch.no_grad():
            assert model(input_ids=ids).past_key_values is not None

    def defer_grad_sync_two_micro_batches(ctx):
        assert_parity(arch, FSDPConfig(**FP32, defer_grad_sync=True), micro_batches=2)

    def eager_grad_sync_two_micro_batches(ctx):
        assert_parity(arch, FSDPConfig(**FP32, defer_grad_sync=False), micro_batches=2)

    def optim_cpu_offload(ctx):
        assert_parity(arch, FSDPConfig(**FP32, optim_cpu_offload=True))

    def optim_on_device(ctx):
        assert_parity(arch, FSDPConfig(**FP32, optim_cpu_offload=False))

    def mixed_sharded_and_replicated(ctx):
        # Threshold 100: norms (32 elements) and q/k/v biases stay replicated.
        config = FSDPConfig(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=100)
        model = assert_parity(arch, config, max_norm=0.5)
        params = list(model.parameters())
        assert any(isinstance(p, DTensor) for p in params)
        replicated = [p for p in params if not isinstance(p, DTensor)]
        assert replicated and all(p.numel() < 100 for p in replicated)
        assert fsdp_layout(model).num_replicated_grad_syncs == 3  # one per step

    def clipping(ctx):
        assert_parity(arch, FSDPConfig(**FP32), max_norm=0.5)

    for fn in (
        default,
        reshard_off,
        wrap_two_blocks,
        checkpointing,
        defer_grad_sync_two_micro_batches,
        eager_grad_sync_two_micro_batches,
        optim_cpu_offload,
        optim_on_device,
        mixed_sharded_and_replicated,
        clipping,
    ):
        fn.__name__ = f"{arch}_{fn.__name__}"
        cases.case(fn)


_parity_cases("qwen2")
_parity_cases("llama")


@cases.case
def gemma2_tied_embeddings(ctx):
    model = assert_parity("gemma2", FSDPConfig(**FP32))
    layout = fsdp_layout(model)
    assert len(layout.units) == 4  # tied: embeddings and lm_head stay in the root


@cases.case
def mistral_default(ctx):
    assert_parity("mistral", FSDPConfig(**FP32))


@cases.case
def gemma3_default(ctx):
    assert_parity("gemma3", FSDPConfig(**FP32))


@cases.case
def gemma3n_per_layer_embeddings_are_their_own_unit(ctx):
    model = assert_parity("gemma3n", FSDPConfig(**FP32), gradient_checkpointing=True)
    layout = fsdp_layout(model)
    names = [n.rsplit(".", 1)[-1] for n in layout.unit_names]
    # Tied embeddings stay in the root; the PLE table is looked up first, then the 4 blocks.
    assert names[0] == "embed_tokens_per_layer" and len(names) == 1 + 4, layout.unit_names
    ple = layout.units[0]
    assert all(isinstance(p, DTensor) for p in ple.parameters())
    assert ple.weight.to_local().shape[0] == ple.weight.shape[0] // 2  # vocabulary rows split over 2 ranks


@cases.case
def gemma4_per_layer_embeddings_and_a_wider_global_layer(ctx):
    model = assert_parity("gemma4", FSDPConfig(**FP32), gradient_checkpointing=True)
    names = [n.rsplit(".", 1)[-1] for n in fsdp_layout(model).unit_names]
    assert names[0] == "embed_tokens_per_layer" and len(names) == 1 + 4, names
    layers = model.model.layers
    assert layers[3].self_attn.q_proj.weight.shape[0] == 2 * layers[0].self_attn.q_proj.weight.shape[0]


@cases.case
def smollm3_no_rope_layers_with_checkpointing(ctx):
    assert_parity("smollm3", FSDPConfig(**FP32), gradient_checkpointing=True)


@cases.case
def olmo2_full_width_qk_norms(ctx):
    model = assert_parity("olmo2", FSDPConfig(**FP32))
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert isinstance(q_norm, DTensor) and q_norm.shape == (32,)  # over all heads, not per head


@cases.case
def gpt_oss_sinks_and_biased_experts_in_hugging_faces_loop(ctx):
    model = assert_parity("gpt_oss", FSDPConfig(**FP32), gradient_checkpointing=True)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.sinks, DTensor) and isinstance(layer.mlp.experts.gate_up_proj_bias, DTensor)
    assert fsdp_layout(model).moe is None  # Hugging Face's expert loop: no row-wise experts installed


@cases.case
def gpt_oss_refuses_expert_parallel_and_chunks_in_one_line(ctx):
    import pytest

    from agilerl.distributed import apply_fsdp2
    from agilerl.utils.tiny import tiny_model

    for config in (FSDPConfig(**FP32, ep=2), FSDPConfig(**FP32, routed_expert_chunk_mib=64)):
        with pytest.raises(ValueError, match=r"GptOssExperts: .*is_transposed.*use ep=1"):
            apply_fsdp2(tiny_model("gpt_oss"), config)


@cases.case
def bf16_mixed_precision_with_replicated_fp32_params(ctx):
    # bf16 compute with fp32 replicated norms: the output cast keeps dtypes
    # consistent. Compared loosely (bf16 has 8 bits of mantissa).
    from agilerl.utils.tiny import tiny_model
    from tests.agilerl.distributed._parity import batches, sharded_run

    model = tiny_model("qwen2")
    data = batches(model.config.vocab_size)
    config = FSDPConfig(param_dtype="bfloat16", param_persistence_threshold=100)
    _, _, losses, _ = sharded_run(model, data, config)
    ref = [model(input_ids=d, labels=d).loss.item() for d in data[:1]]
    assert abs(losses[0] - ref[0]) < 0.05 * abs(ref[0]), (losses[0], ref[0])
    assert losses[-1] < losses[0]


test_dist = cases.pytest_test()
