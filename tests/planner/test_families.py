"""Architecture features of the newer families, read off tiny random models and planned.

SmolLM3 (NoPE layers), OLMo 2 (full-width q/k norms, norms after each sublayer), gpt-oss
(attention sinks, biased transposed experts, alternating sliding windows) and Gemma 4
(per-layer embeddings, global layers wider than the sliding ones).
"""

from __future__ import annotations

import pytest

from agilerl.distributed import FSDPConfig
from planner import catalog
from planner.choose import plan
from planner.hardware import Cluster, gpu_by_name
from planner.memory import estimate, expert_parallel_degrees, row_wise_experts
from planner.models import load_model_spec
from planner.workload import Workload

GPT_OSS = (
    "tiny:gpt_oss?hidden_size=64&intermediate_size=96&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=512&num_local_experts=8&num_experts_per_tok=2"
)
OLMO2 = "tiny:olmo2?hidden_size=64&intermediate_size=128&num_layers=2&num_heads=4&num_kv_heads=4&vocab_size=512"
SMOLLM3 = "tiny:smollm3?hidden_size=64&intermediate_size=128&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=512"
WL = Workload(
    prompts_per_step=2,
    group_size=4,
    prompt_tokens=32,
    completion_tokens=32,
    micro_batch_size_per_gpu=2,
    lora_rank=8,
    weights_dtype="bfloat16",
    generation="none",
)


@pytest.fixture(scope="module")
def gpt_oss():
    return load_model_spec(GPT_OSS)


def test_gpt_oss_spec_reads_sinks_biased_experts_and_alternating_windows(gpt_oss):
    block = gpt_oss.block(0)
    tensors = dict(block.tensors)
    assert tensors["self_attn.sinks"] == (4,)  # one learnt logit per head
    assert tensors["mlp.experts.gate_up_proj"] == (8, 64, 2 * 96)  # transposed: [E, H, 2I]
    assert tensors["mlp.experts.gate_up_proj_bias"] == (8, 2 * 96)
    assert tensors["mlp.experts.down_proj_bias"] == (8, 64)
    assert [b.attention.sliding_window for b in gpt_oss.blocks] == [8, None, 8, None]
    assert block.mlp.kind == "moe" and block.mlp.num_experts == 8 and block.mlp.experts_per_token == 2
    # "all-linear" LoRA adapts attention only: the experts are 3-D parameters, the router no nn.Linear.
    assert [name for name, *_ in block.lora["all-linear"]] == [f"self_attn.{p}_proj" for p in "qkvo"]


def test_gpt_oss_experts_run_in_hugging_faces_loop(gpt_oss):
    assert "is_transposed" in gpt_oss.expert_layout_problem and not row_wise_experts(gpt_oss)
    assert expert_parallel_degrees(gpt_oss, 8) == [1]
    qwen3_moe = catalog.load_spec("Qwen/Qwen3-30B-A3B")
    assert qwen3_moe.expert_layout_problem is None and row_wise_experts(qwen3_moe)
    # routed_expert_chunk_mib=None is not resolved to a chunk: there is none to pick.
    cluster, fsdp = Cluster(gpu=gpu_by_name("H100-80GB"), num_gpus=2), FSDPConfig(param_persistence_threshold=0)
    assert not any("routed_expert_chunk_mib" in n for n in estimate(gpt_oss, WL, cluster, fsdp).notes)
    tiny_qwen3_moe = load_model_spec(
        GPT_OSS.replace("gpt_oss", "qwen3_moe").replace("num_local_experts", "num_experts")
    )
    assert any("routed_expert_chunk_mib" in n for n in estimate(tiny_qwen3_moe, WL, cluster, fsdp).notes)


@pytest.mark.parametrize("name", ["openai/gpt-oss-20b", "openai/gpt-oss-120b"])
def test_gpt_oss_plans_leave_expert_parallel_and_chunks_unset(name):
    p = plan(catalog.load_spec(name), Workload(), Cluster(gpu=gpu_by_name("H100-80GB"), num_gpus=8), sharding="fsdp")
    assert p.fits and p.fsdp.ep == 1 and p.fsdp.routed_expert_chunk_mib is None
    assert any(d.field == "ep" and "Hugging Face's expert loop" in d.reason for d in p.decisions)


def test_gpt_oss_weights_are_counted_in_bf16_not_mxfp4():
    # The planner counts what the trainer keeps: the dequantised bf16 checkpoint, 2 bytes a parameter.
    spec = catalog.load_spec("openai/gpt-oss-20b")
    est = estimate(spec, Workload(), Cluster(gpu=gpu_by_name("H100-80GB"), num_gpus=1), None)
    assert est.phases["learn"].components["weights"] == 2 * spec.total_params


def test_olmo2_qk_norms_span_the_whole_projection():
    spec = load_model_spec(OLMO2)
    tensors = dict(spec.block(0).tensors)
    assert tensors["self_attn.q_norm.weight"] == (64,) and tensors["self_attn.k_norm.weight"] == (64,)
    # norms after attention and MLP, none before
    assert "post_attention_layernorm.weight" in tensors and "post_feedforward_layernorm.weight" in tensors
    assert "input_layernorm.weight" not in tensors


def test_smollm3_no_rope_layers_share_one_block_type():
    spec = load_model_spec(SMOLLM3)
    # NoPE changes no tensor: every layer is the same block type, its parameters a Llama block's.
    assert len(spec.block_types) == 1 and spec.num_layers == 4
    assert spec.architecture == "SmolLM3ForCausalLM"


def test_a_multimodal_config_json_plans_the_same_text_model_as_its_catalog_entry(tmp_path):
    import json

    e = catalog.entry("mistralai/Mistral-Small-3.1-24B-Instruct-2503")
    config = {
        "model_type": "mistral3",
        "architectures": [e.multimodal],
        "text_config": e.config,
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": 1024,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "intermediate_size": 4096,
            "image_size": 1540,
            "patch_size": 14,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec, shipped = load_model_spec(str(tmp_path)), catalog.load_spec(e.name)
    assert spec.text_model_of == shipped.text_model_of == "Mistral3ForConditionalGeneration"
    assert spec.total_params == shipped.total_params and spec.layers == shipped.layers


def test_gemma4_spec_reads_each_layers_own_head_width_and_the_per_layer_table():
    spec = load_model_spec(
        "tiny:gemma4?hidden_size=64&intermediate_size=128&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=512"
    )
    widths = [(b.attention.head_dim, b.attention.q_dim, b.attention.kv_dim) for b in spec.blocks]
    assert widths == [(16, 64, 32)] * 3 + [(32, 128, 64)]  # the global layer: per_layer_config head_dim 32
    assert [b.attention.sliding_window for b in spec.blocks] == [1024, 1024, 1024, None]
    assert dict(spec.root_tensors)["model.embed_tokens_per_layer.weight"] == (512, 4 * 8)
    assert spec.per_layer_input_width == 4 * 8 and len(spec.block_types) == 2


GEMMA3N_SHARED = (
    "tiny:gemma3n?hidden_size=64&intermediate_size=128&num_layers=6&num_heads=4&num_kv_heads=2"
    "&vocab_size=512&num_kv_shared_layers=2"
)
GEMMA4_SHARED = GEMMA3N_SHARED.replace("gemma3n", "gemma4")


def _tiny(name: str):
    from agilerl.utils.sources import parse_tiny
    from agilerl.utils.tiny import tiny_model

    arch, sizes = parse_tiny(name)
    return tiny_model(arch, **sizes)


@pytest.mark.parametrize("name", [GEMMA3N_SHARED, GEMMA4_SHARED])
def test_kv_sharing_is_read_per_layer_as_transformers_builds_it(name):
    """The last two layers read the K and V of the last earlier layer of their attention type
    (num_kv_shared_layers=2): they have no K/V projections and no cache entry; the two layers
    they read store theirs. One rotary table per attention type, as wide as the forward's."""
    import torch

    spec, model = load_model_spec(name), _tiny(name)
    modes = [
        "reuse" if layer.self_attn.is_kv_shared_layer else "store" if layer.self_attn.store_full_length_kv else None
        for layer in model.model.layers
    ]
    assert modes == [None, None, "store", "store", "reuse", "reuse"]
    assert [b.attention.kv_sharing for b in spec.blocks] == modes
    for block, layer in zip(spec.blocks, model.model.layers):
        assert any(path.endswith("k_proj") for path, _, _ in block.linears) == hasattr(layer.self_attn, "k_proj")
    widths: list[int] = []
    model.model.rotary_emb.register_forward_hook(lambda m, args, out: widths.append(out[0].shape[-1]))
    with torch.no_grad():
        model(input_ids=torch.randint(3, 500, (1, 8)))
    assert len(widths) == 2 and sorted(spec.rotary_widths) == sorted(widths)


@pytest.mark.parametrize("name", [GPT_OSS, SMOLLM3])
def test_the_rotary_table_is_as_wide_as_the_forward_makes_it(name):
    """gpt-oss's rotary module returns cos and sin as wide as its frequencies (half a head),
    where most concatenate them twice (a head): read off the module's forward, not assumed
    (read as a head, gpt-oss's tables were counted double)."""
    import torch

    spec, model = load_model_spec(name), _tiny(name)
    widths: list[int] = []
    model.model.rotary_emb.register_forward_hook(lambda m, args, out: widths.append(out[0].shape[-1]))
    with torch.no_grad():
        model(input_ids=torch.randint(3, 500, (1, 8)))
    head = spec.block(0).attention.head_dim
    assert spec.rotary_widths == tuple(widths) == ((head // 2,) if "gpt_oss" in name else (head,))


def test_a_store_no_layer_reads_is_not_sharing():
    """transformers marks Gemma 4's last layer of each attention type as storing its K and V even
    when no layer reads them (for assistant models); the trainer stops it, and the spec has none."""
    name = GEMMA4_SHARED.replace("&num_kv_shared_layers=2", "")
    assert any(layer.self_attn.store_full_length_kv for layer in _tiny(name).model.layers)
    assert all(b.attention.kv_sharing is None for b in load_model_spec(name).blocks)
