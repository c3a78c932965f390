"""planner.memory.estimate: exact terms against independent arithmetic, directions of the rest."""

from __future__ import annotations

import math

import pytest

from agilerl.distributed import FSDPConfig
from planner.hardware import CPU_DEVICE, GPUS, Cluster
from planner.memory import Coefficients, estimate
from planner.models import load_model_spec
from planner.names import COMPONENTS, PHASES
from planner.workload import Workload

TINY = "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096"
WL = Workload(
    prompts_per_step=2,
    group_size=8,
    prompt_tokens=64,
    completion_tokens=64,
    micro_batch_size_per_gpu=2,
    logprob_chunk_size=128,
    gradient_checkpointing=True,
    lora_rank=8,
    weights_dtype="bfloat16",
)
SHARD_ALL = FSDPConfig(param_persistence_threshold=0)


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(TINY)


def _cluster(n=2, gpu=CPU_DEVICE, per_node=None):
    return Cluster(gpu=gpu, num_gpus=n, gpus_per_node=per_node)


def _sharded_bytes(spec, shards: int, bytes_per: int, threshold: int) -> tuple[int, int]:
    """(sharded local, replicated) base bytes, from the spec's shapes: FSDP2 gives rank 0 ceil(d0/S) rows."""
    shapes = [spec.embed_shape] + ([spec.lm_head_shape] if spec.lm_head_shape else [])
    shapes += [s for _, s in spec.root_tensors] + [s for b in spec.blocks for _, s in b.tensors]
    local = replicated = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        if math.prod(shape) >= threshold:
            local += math.ceil(shape[0] / shards) * rest * bytes_per
        else:
            replicated += math.prod(shape) * bytes_per
    return local, replicated


def test_phases_and_components_use_the_shared_names(spec):
    est = estimate(spec, WL.model_copy(update={"generation": "hf"}), _cluster(), SHARD_ALL)
    assert set(est.phases) <= set(PHASES)
    assert {"load", "rollout", "reference", "learn", "step", "save"} <= set(est.phases)
    for phase in est.phases.values():
        assert set(phase.components) <= set(COMPONENTS)
        assert all(k.startswith("host_") for k in phase.host)
    assert est.peak_bytes == max(p.total for p in est.phases.values())


@pytest.mark.parametrize("gpus,threshold", [(1, 0), (2, 0), (4, 0), (3, 0), (2, 100_000), (4, 5_000)])
def test_weights_are_exact_per_rank(spec, gpus, threshold):
    fsdp = FSDPConfig(param_persistence_threshold=threshold)
    workload = WL.model_copy(update={"prompts_per_step": 3}) if gpus == 3 else WL  # 24 completions split by 3
    est = estimate(spec, workload, _cluster(gpus), fsdp)
    local, replicated = _sharded_bytes(spec, gpus, 2, threshold)
    learn = est.phases["learn"].components
    assert learn.get("weights", 0) == local
    assert learn.get("weights_replicated", 0) == replicated


def test_unsharded_holds_the_whole_model(spec):
    est = estimate(spec, WL, _cluster(2), None)
    assert est.phases["learn"].components["weights"] == spec.total_params * 2
    assert "weights_gathered" not in est.phases["learn"].components


def test_lora_and_optimizer_state_are_exact(spec):
    lora_params = spec.lora_params("all-linear", 8)
    est = estimate(spec, WL, _cluster(1), None)
    step = est.phases["step"].components
    num_tensors = 2 * len(spec.lora_shapes("all-linear"))
    assert step["lora"] == lora_params * 4  # fp32 adapters
    assert step["optimizer_state"] == lora_params * 8 + num_tensors * 4 * 2  # moments + a step tensor (+ its update)
    ref = estimate(spec, WL.model_copy(update={"use_separate_reference_adapter": True}), _cluster(1), None)
    assert ref.phases["step"].components["lora"] == 2 * lora_params * 4
    assert ref.phases["step"].components["optimizer_state"] == step["optimizer_state"]  # the reference is frozen


def test_optimizer_offload_moves_adam_to_the_host(spec):
    on_gpu = estimate(spec, WL, _cluster(2), SHARD_ALL)
    offload = estimate(spec, WL, _cluster(2), SHARD_ALL.model_copy(update={"optim_cpu_offload": True}))
    assert "optimizer_state" not in offload.phases["learn"].components
    assert on_gpu.phases["learn"].components["optimizer_state"] > 0
    assert offload.phases["learn"].host["host_optimizer_state"] > on_gpu.phases["learn"].components["optimizer_state"]


def test_directions(spec):
    c2 = _cluster(2)
    base = estimate(spec, WL, c2, SHARD_ALL)
    no_reshard = estimate(spec, WL, c2, SHARD_ALL.model_copy(update={"reshard_after_forward": False}))
    assert (
        no_reshard.phases["learn"].components["weights_gathered"] > base.phases["learn"].components["weights_gathered"]
    )
    no_gc = estimate(spec, WL.model_copy(update={"gradient_checkpointing": False}), c2, SHARD_ALL)
    assert no_gc.phases["learn"].components["activations"] > base.phases["learn"].components["activations"]
    big_chunk = estimate(spec, WL.model_copy(update={"logprob_chunk_size": 4096}), c2, SHARD_ALL)
    assert big_chunk.phases["reference"].components["logits"] > base.phases["reference"].components["logits"]
    big_micro = estimate(spec, WL.model_copy(update={"micro_batch_size_per_gpu": 8}), c2, SHARD_ALL)
    assert big_micro.phases["learn"].total > base.phases["learn"].total
    wrap = estimate(spec, WL, c2, SHARD_ALL.model_copy(update={"wrap_every_n_blocks": 2}))
    # Generation runs unit after unit: bigger units put more gathered weights in flight.
    assert wrap.phases["rollout"].components["weights_gathered"] > base.phases["rollout"].components["weights_gathered"]
    assert wrap.phases["learn"].total >= base.phases["learn"].total
    more = estimate(spec, WL, _cluster(4), SHARD_ALL)
    assert more.phases["learn"].components["weights"] < base.phases["learn"].components["weights"]


def test_gpu_terms_only_on_gpus(spec):
    cpu = estimate(spec, WL, _cluster(2), SHARD_ALL)
    gpu = estimate(spec, WL, _cluster(2, GPUS["A100-80GB"]), SHARD_ALL)
    assert "cuda_context" not in cpu.phases["learn"].components
    comps = gpu.phases["learn"].components
    assert comps["cuda_context"] == GPUS["A100-80GB"].cuda_context_bytes
    assert comps["allocator_slack"] > 0
    single = estimate(spec, WL, _cluster(1, GPUS["A100-80GB"]), None)
    assert single.phases["learn"].components.get("nccl_buffers", 0) == 0  # no NCCL on one GPU


def test_vllm_terms_are_labelled(spec):
    wl = WL.model_copy(update={"generation": "vllm", "vllm_gpu_memory_utilization": 0.4})
    est = estimate(spec, wl, _cluster(2, GPUS["H100-80GB"]), SHARD_ALL)
    k = Coefficients()
    profiled = 8192 * (3 * 512 + 128) * 2  # 256 seqs x 128 tokens = 32768, capped at 8192 tokens
    assert est.phases["rollout"].components["vllm"] == (
        int(0.4 * GPUS["H100-80GB"].memory_bytes) - profiled + k.vllm_outside_budget_bytes
    )
    assert "kv_cache" not in est.phases["rollout"].components
    assert any("not yet measured" in n for n in est.notes)
    assert est.phases["learn"].host["host_vllm_weights"] == spec.total_params * 2


def test_qlora_stores_nf4(spec):
    est = estimate(spec, WL.model_copy(update={"load_in_4bit": True}), _cluster(1), None)
    full = estimate(spec, WL, _cluster(1), None)
    kept = (math.prod(spec.embed_shape) + math.prod(spec.lm_head_shape or (0,))) * 2  # embeddings stay bf16
    quantised = est.phases["learn"].components["weights"] - kept
    bf16 = full.phases["learn"].components["weights"] - kept
    assert 0.25 < quantised / bf16 < 0.3  # 4 bits + quantisation constants vs 16 bits


def test_qlora_under_fsdp_shards_the_packed_bytes_and_keeps_the_constants_whole(spec):
    """Counted from the spec's shapes, independently of the estimate's layout: every 2-D block weight
    (all linears, in this dense model) is packed two values per byte and its rows sharded over the
    ranks (ceil), its quantisation state whole on every rank, sized by quantising a tensor of its
    shape with bitsandbytes itself; the rest in bf16 rows."""
    import bitsandbytes as bnb
    import torch

    def state_bytes(shape) -> int:
        _, state = bnb.functional.quantize_4bit(
            torch.ones(shape, dtype=torch.bfloat16), quant_type="nf4", compress_statistics=True
        )
        tensors = [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
        return sum(t.numel() * t.element_size() for t in tensors)

    qlora = WL.model_copy(update={"load_in_4bit": True})
    world = 2
    packed = constants = other = 0
    for i in range(spec.num_layers):
        for name, shape in spec.block(i).tensors:
            numel = math.prod(shape)
            if len(shape) == 2 and name.endswith("weight"):
                packed += math.ceil(numel // 2 / world)
                constants += state_bytes(shape)
            else:
                other += math.ceil(shape[0] / world) * (numel // shape[0]) * 2
    outside = [s for _, s in spec.root_tensors] + ([spec.embed_shape] if not spec.tie_word_embeddings else [])
    for shape in outside:
        numel = math.prod(shape)
        other += math.ceil(shape[0] / world) * (numel // shape[0]) * 2
    if spec.lm_head_shape and not spec.tie_word_embeddings:
        other += math.ceil(spec.lm_head_shape[0] / world) * spec.lm_head_shape[1] * 2
    est = estimate(spec, qlora, _cluster(world), SHARD_ALL.model_copy(update={"param_dtype": "bfloat16"}))
    assert est.phases["step"].components["weights"] == packed + constants + other
    unsharded = estimate(spec, qlora, _cluster(1), None).phases["step"].components["weights"]
    assert est.phases["step"].components["weights"] < 0.6 * unsharded


def test_host_per_node_counts_the_saved_checkpoint_on_rank_0_only(spec):
    for workload in (WL, WL.model_copy(update={"full_finetune": True})):
        alone = estimate(spec, workload, _cluster(8, GPUS["H100-80GB"], per_node=1), SHARD_ALL)
        assert alone.host_per_node_bytes == alone.host_peak_bytes  # a node of one rank: rank 0's peak
        est = estimate(spec, workload, _cluster(8, GPUS["H100-80GB"], per_node=4), SHARD_ALL)
        assert est.host_per_node_bytes < 4 * est.host_peak_bytes
    # Llama-3.1-8B fully fine-tuned on a node of 8: rank 0 gathers the whole checkpoint (its host
    # peak, in the save phase); the other seven ranks hold the save phase's other terms only
    from planner import catalog

    llama = catalog.load_spec("meta-llama/Llama-3.1-8B")
    est = estimate(llama, WL.model_copy(update={"full_finetune": True}), _cluster(8, GPUS["H100-80GB"]), SHARD_ALL)
    save = est.phases["save"].host
    assert est.host_peak_bytes == sum(save.values()) and save["host_checkpoint"] > 40 * 2**30
    assert est.host_per_node_bytes == sum(save.values()) + 7 * (sum(save.values()) - save["host_checkpoint"])


def test_estimate_is_deterministic_and_coefficients_matter(spec):
    a = estimate(spec, WL, _cluster(2), SHARD_ALL)
    assert a == estimate(spec, WL, _cluster(2), SHARD_ALL)
    b = estimate(spec, WL, _cluster(2), SHARD_ALL, coefficients=Coefficients(all_gather_overlap=10.0))
    assert b.phases["learn"].components["weights_gathered"] > a.phases["learn"].components["weights_gathered"]


def test_tensor_parallel_weights_are_exact(spec):
    """tp=2 on 4 GPUs: q/k/v/gate/up split on their outputs, o/down on their inputs, then
    FSDP2 shards dim 0 of the local piece over the 2 data-parallel ranks."""
    tp, dp = 2, 2
    est = estimate(spec, WL, _cluster(4), FSDPConfig(param_persistence_threshold=0, tp=tp))
    expected = 0
    shapes = [("embed", spec.embed_shape)] + ([("lm_head", spec.lm_head_shape)] if spec.lm_head_shape else [])
    shapes += list(spec.root_tensors) + [t for b in spec.blocks for t in b.tensors]
    for name, shape in shapes:
        local = list(shape)
        module = name.split(".")[-2] if "." in name else ""
        if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            local[0] //= tp
        elif module in ("o_proj", "down_proj") and name.endswith("weight"):
            local[1] //= tp
        expected += math.ceil(local[0] / dp) * math.prod(local[1:]) * 2
    assert est.phases["learn"].components["weights"] == expected
    with pytest.raises(ValueError, match="not divisible: .*num_key_value_heads"):
        estimate(spec, WL.model_copy(update={"prompts_per_step": 4}), _cluster(4), FSDPConfig(tp=4))


def test_unsharded_lm_head_is_not_gathered_again_for_the_chunked_head(spec):
    """reshard_after_forward=False leaves the lm_head unit unsharded after the forward, so the
    chunked log-prob head uses that weight; with True it gathers one vocab x hidden copy."""
    # a vocabulary large enough that both phases peak at the head
    spec = load_model_spec(TINY.replace("vocab_size=4096", "vocab_size=65536"))
    reshard = estimate(spec, WL, _cluster(2), SHARD_ALL)
    keep = estimate(spec, WL, _cluster(2), SHARD_ALL.model_copy(update={"reshard_after_forward": False}))
    head_copy = spec.vocab_size * spec.hidden_size * 2  # bf16 compute dtype
    for phase in ("reference", "learn"):
        a, b = reshard.phases[phase].components, keep.phases[phase].components
        assert a["logits"] - b["logits"] == head_copy  # both peak at the head on this workload


@pytest.mark.parametrize("prompt,completion", [(120, 8), (8, 120)])
def test_generation_peaks_at_prefill_or_at_the_last_decode_step(spec, prompt, completion):
    """The KV cache at the rollout peak: the prompt's cache at prefill (long prompts), or the
    whole cache, grown by concatenation (one layer's worth extra), at the end of decoding."""
    workload = WL.model_copy(
        update={
            "generation": "hf",
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "share_prompt_prefix": False,
        }
    )
    est = estimate(spec, workload, _cluster(1), None)
    n = workload.completions_per_step
    per_token = sum(2 * b.attention.kv_dim * 2 for b in spec.blocks)  # K and V, bf16, every layer
    kv = est.phases["rollout"].components["kv_cache"]
    if prompt > completion:
        assert kv == n * prompt * per_token
        # Each of the 2 prompts prefilled once (all columns but the last), then copied to its 8 rows:
        # the decode's full cache is the peak.
        shared = estimate(spec, workload.model_copy(update={"share_prompt_prefix": True}), _cluster(1), None)
        decode = estimate(spec, workload.model_copy(update={"prompt_tokens": completion, "completion_tokens": prompt}),
                          _cluster(1), None).phases["rollout"].components["kv_cache"]  # fmt: skip
        assert shared.phases["rollout"].components["kv_cache"] == decode
    else:
        from planner.memory import Coefficients
        from planner.memory._context import build_context
        from planner.memory._generation import hf_rollout_moments
        from planner.memory._units import build_layout

        ctx = build_context(spec, workload, _cluster(1), None, coefficients=Coefficients())
        _, decode, sampling = hf_rollout_moments(ctx, build_layout(ctx))
        full = n * (prompt + completion) * per_token
        # The last decode step: the whole cache and less than one layer's more while a layer
        # concatenates (the growth is measured against Hugging Face generate in
        # tests/planner/memory/test_generation.py), beside the step before's fp32 logits and their
        # softmax, which the sampling loop's locals keep; its sampling: the whole cache.
        assert full < decode["kv_cache"] < full * (1 + 1 / spec.num_layers)
        assert decode["logits"] == n * spec.vocab_size * 4 * 2
        assert sampling["kv_cache"] == full
        assert kv in (decode["kv_cache"], full)  # the rollout peaks at one of them


# -- mixture of experts ---------------------------------------------------------------------------
MOE = (
    "tiny:qwen3_moe?hidden_size=128&moe_intermediate_size=512&num_experts=8&num_experts_per_tok=2"
    "&num_layers=2&num_heads=4&num_kv_heads=2&vocab_size=1024"
)
MOE_WL = WL.model_copy(
    update={
        "prompts_per_step": 4,
        "group_size": 4,
        "prompt_tokens": 256,
        "completion_tokens": 256,
        "micro_batch_size_per_gpu": 4,
        "weights_dtype": "float32",
    }
)
FP32 = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


@pytest.fixture(scope="module")
def moe_spec():
    return load_model_spec(MOE)


def _is_expert(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts"


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_expert_weights_split_by_ep_then_sharded_over_the_rest(moe_spec, world, ep):
    """Rank 0 keeps experts [0, E/ep) of each packed tensor, FSDP-sharded over world/ep ranks;
    everything else shards over all ranks (agilerl.distributed's expert mesh)."""
    est = estimate(moe_spec, MOE_WL, _cluster(world), FSDPConfig(**FP32, ep=ep))
    shapes = [("embed", moe_spec.embed_shape)] + (
        [("lm_head", moe_spec.lm_head_shape)] if moe_spec.lm_head_shape else []
    )
    shapes += list(moe_spec.root_tensors) + [t for b in moe_spec.blocks for t in b.tensors]
    expected = 0
    for name, shape in shapes:
        if _is_expert(name):
            assert len(shape) == 3
            experts = shape[0] // ep
            expected += math.ceil(experts / (world // ep)) * math.prod(shape[1:]) * 4
        else:
            expected += math.ceil(shape[0] / world) * math.prod(shape[1:]) * 4
    assert est.phases["learn"].components["weights"] == expected


def test_tensor_parallel_moe_splits_attention_only(moe_spec):
    """tp=2 on 4 GPUs: a MoE block's q/k/v split on their outputs and o on its input; the
    router and packed experts stay whole on every TP rank; then FSDP shards dim 0 over dp=2."""
    tp, dp = 2, 2
    wl = MOE_WL.model_copy(update={"prompts_per_step": 2})
    est = estimate(moe_spec, wl, _cluster(4), FSDPConfig(**FP32, tp=tp, routed_expert_chunk_mib=1))
    shapes = [("embed", moe_spec.embed_shape), ("lm_head", moe_spec.lm_head_shape)]
    shapes += list(moe_spec.root_tensors) + [t for b in moe_spec.blocks for t in b.tensors]
    expected = 0
    for name, shape in shapes:
        local = list(shape)
        module = name.split(".")[-2] if "." in name else ""
        if name.startswith("self_attn.") and module in ("q_proj", "k_proj", "v_proj"):
            local[0] //= tp
        elif name.startswith("self_attn.") and module == "o_proj":
            local[1] //= tp
        expected += math.ceil(local[0] / dp) * math.prod(local[1:]) * 4
    assert est.phases["learn"].components["weights"] == expected
    with pytest.raises(ValueError, match="with tp > 1"):
        estimate(moe_spec, wl, _cluster(4), FSDPConfig(**FP32, tp=2, ep=2))


def test_expert_parallel_gathers_a_fraction_of_the_experts(moe_spec):
    """A unit all-gathers E/ep experts over world/ep ranks: the gathered stack shrinks by ep."""
    no_grad = {
        ep: estimate(moe_spec, MOE_WL, _cluster(4), FSDPConfig(**FP32, ep=ep, routed_expert_chunk_mib=1))
        .phases["reference"]
        .components["weights_gathered"]
        for ep in (1, 2, 4)
    }
    assert no_grad[1] > no_grad[2] > no_grad[4]
    stack = sum(math.prod(s) for _, s in moe_spec.block(0).tensors if _is_expert(_))
    # Same prefetch window and buffer in each: the difference is the experts no longer gathered.
    assert no_grad[1] - no_grad[2] > stack * 4 / 2


def test_expert_chunk_slope_comes_from_the_chunk_rows(moe_spec):
    """Between two chunk sizes that both bind, the learn peak moves by the chunk's extra rows times
    what a row costs in the chunk's recompute, less the hidden-sized input gradient of a later
    chunk it no longer is: inside one expert's rows, gate_up's three products (base, LoRA,
    scaled LoRA: 2 x expert width each); across experts, what each finished expert keeps for
    backward (4 x expert width + hidden)."""
    k = Coefficients()
    wl = MOE_WL.model_copy(update={"micro_batch_size_per_gpu": 8})  # 8,192 routed rows, 2,048 per local expert
    chunks = (6, 8, 12, 16)  # each below the 8,192 rows: several chunks, the adapters' gradients summed
    peaks = {
        c: estimate(moe_spec, wl, _cluster(2), FSDPConfig(**FP32, ep=2, routed_expert_chunk_mib=c), coefficients=k)
        .phases["learn"]
        .total
        for c in chunks
    }
    mlp = moe_spec.block(0).mlp
    width, hidden = mlp.intermediate_size, moe_spec.hidden_size
    row_bytes = max(2 * width, hidden) * 4
    rows = {c: int(c * 2**20) // row_bytes for c in chunks}
    per_expert = wl.micro_batch_size_per_gpu * wl.sequence_tokens * mlp.experts_per_token // (mlp.num_experts // 2)
    assert rows[6] < per_expert == rows[8] < rows[12] < rows[16]
    inside = (k.moe_chunk * 3 * 2 * width - hidden) * 4
    assert peaks[8] - peaks[6] == pytest.approx((rows[8] - rows[6]) * inside, rel=1e-6, abs=8)
    across = (k.moe_chunk * (4 * width + hidden) - hidden) * 4
    assert peaks[12] - peaks[8] == pytest.approx((rows[12] - rows[8]) * across, rel=1e-6, abs=8)
    assert peaks[16] - peaks[12] == pytest.approx((rows[16] - rows[12]) * across, rel=1e-6, abs=8)
    # A chunk past every routed row of a micro-batch computes them all at once: no further growth.
    routed = MOE_WL.micro_batch_size_per_gpu * MOE_WL.sequence_tokens * mlp.experts_per_token * row_bytes
    big = [c for c in (64, 128) if c * 2**20 >= routed]
    at = [
        estimate(moe_spec, MOE_WL, _cluster(2), FSDPConfig(**FP32, routed_expert_chunk_mib=c)).peak_bytes for c in big
    ]
    assert len(set(at)) == 1


def test_chunk_none_is_resolved_as_the_trainer_does(moe_spec):
    """FSDPConfig.routed_expert_chunk_mib=None: the largest of 64/128/256/512 MiB that fits."""
    big = MOE_WL.model_copy(
        update={
            "prompt_tokens": 8192,
            "completion_tokens": 8192,
            "prompts_per_step": 2,
            "group_size": 4,
            "micro_batch_size_per_gpu": 4,
        }
    )  # 512 MiB routed
    roomy = _cluster(2, gpu=CPU_DEVICE.model_copy(update={"memory_bytes": 2**40}))
    none = estimate(moe_spec, big, roomy, FSDPConfig(**FP32))
    assert none.peak_bytes == estimate(moe_spec, big, roomy, FSDPConfig(**FP32, routed_expert_chunk_mib=512)).peak_bytes
    assert "picks 512 MiB" in none.notes[-1]
    peaks = {
        c: estimate(moe_spec, big, roomy, FSDPConfig(**FP32, routed_expert_chunk_mib=c)).peak_bytes for c in (64, 128)
    }
    assert peaks[64] < peaks[128]
    tight = _cluster(2, gpu=CPU_DEVICE.model_copy(update={"memory_bytes": int((peaks[64] + peaks[128]) / 2 / 0.95)}))
    assert estimate(moe_spec, big, tight, FSDPConfig(**FP32)).peak_bytes == peaks[64]


def test_unsharded_moe_keeps_peft_merged_expert_stacks(moe_spec):
    """Unsharded (one GPU, or data parallel) the trainer runs the Hugging Face experts, whose
    linears save PEFT's merged copy of each layer's expert stack for backward."""
    stack = sum(math.prod(s) for _, s in moe_spec.block(0).tensors if _is_expert(_)) * 4
    wl = MOE_WL.model_copy(update={"prompts_per_step": 1, "gradient_checkpointing": False})
    single = estimate(moe_spec, wl, _cluster(1), None)
    assert single.phases["learn"].components["activations"] > moe_spec.num_layers * stack


def test_reference_pass_on_the_base_merges_no_expert_stacks(moe_spec):
    """The reference pass runs the base model with adapters disabled, so PEFT builds no merged
    expert stacks; a separate reference adapter (or the old-policy pass) does, each stack as
    the experts first read it: these wide experts peak at the end of their gate, beside
    gate_up's merged stack."""
    gate_up = sum(math.prod(s) for n, s in moe_spec.block(0).tensors if _is_expert(n) and "gate_up" in n)
    wl = MOE_WL.model_copy(update={"prompts_per_step": 1, "logprob_chunk_size": 16})
    base = estimate(moe_spec, wl, _cluster(1), None).phases["reference"].components
    adapter = (
        estimate(moe_spec, wl.model_copy(update={"use_separate_reference_adapter": True}), _cluster(1), None)
        .phases["reference"]
        .components
    )
    # At least gate_up's merged stack (what PEFT builds is measured in
    # tests/planner/memory/test_moe.py against its real forward).
    assert gate_up > 0
    assert adapter["activations"] - base["activations"] >= gate_up * 4


def test_lora_off_the_expert_stacks_merges_none(moe_spec):
    """PEFT merges an expert stack only when LoRA adapts it: with attention-only LoRA an
    active adapter changes no expert temporaries, and the stacks' backward has no merged
    gradient (the learn peak gains only the attention adapters' own activations)."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    spec = load_model_spec(MOE, lora_targets=targets)
    wl = MOE_WL.model_copy(update={"prompts_per_step": 1, "logprob_chunk_size": 16, "lora_targets": targets})
    base = estimate(spec, wl, _cluster(1), None).phases["reference"].components
    adapter = (
        estimate(spec, wl.model_copy(update={"use_separate_reference_adapter": True}), _cluster(1), None)
        .phases["reference"]
        .components
    )
    assert adapter["activations"] == base["activations"]
    stack = sum(math.prod(s) for _, s in spec.block(0).tensors if _is_expert(_)) * 4
    nogc = wl.model_copy(update={"gradient_checkpointing": False})
    attention_only = estimate(spec, nogc, _cluster(1), None).phases["learn"].components["activations"]
    everything = (
        estimate(moe_spec, nogc.model_copy(update={"lora_targets": "all-linear"}), _cluster(1), None)
        .phases["learn"]
        .components["activations"]
    )
    # Every layer saves its merged stack for backward; at the activation product's moment the
    # running layer's merged down stack (a third of the stack) is already freed.
    assert everything - attention_only >= spec.num_layers * stack - stack // 3


def test_expert_units_are_gathered_inside_their_block(moe_spec):
    """With ep > 1 each layer's packed experts are an FSDP unit nested in the block's (on the
    expert mesh): a no-grad forward holds the experts, their block's own parameters and
    the next unit in order, not two whole blocks. With ep=1 agilerl.distributed shards
    the experts inside their block's unit, so a window is two whole blocks. In forward
    FSDP2 frees a unit's all-gather output only at the next unit's copy-out, so a running
    unit is held twice, except on a one-rank shard group (the experts with ep=2 on two
    GPUs), where nothing is all-gathered. (Plus the root; no buffer allowance here.)"""
    wl = MOE_WL.model_copy(update={"prompts_per_step": 2, "logprob_chunk_size": 16})
    r = wl.lora_rank

    def lora(entries, experts):
        return r * sum(ar * ac + br * bc for n, ar, ac, br, bc in entries if ("experts" in n) == experts)

    outer = [
        sum(math.prod(s) for n, s in b.tensors if not _is_expert(n)) + lora(b.lora["all-linear"], False)
        for b in moe_spec.blocks
    ]
    experts = [
        sum(math.prod(s) for n, s in b.tensors if _is_expert(n)) + lora(b.lora["all-linear"], True)
        for b in moe_spec.blocks
    ]
    embed, head = math.prod(moe_spec.embed_shape), math.prod(moe_spec.lm_head_shape)
    root = sum(math.prod(s) for _, s in moe_spec.root_tensors)
    assert moe_spec.num_layers == 2 and not moe_spec.tie_word_embeddings

    def gathered(ep, prefetch=1):
        fsdp = FSDPConfig(**FP32, routed_expert_chunk_mib=1, prefetch_units=prefetch, ep=ep)
        est = estimate(moe_spec, wl, _cluster(2), fsdp, coefficients=Coefficients(all_gather_overlap=0.0))
        return est.phases["reference"].components["weights_gathered"]

    # ep=2: each rank holds half of every layer's experts (and of their LoRA factors).
    # Forward order: embed, outer0, experts0, outer1, experts1, lm_head.
    local = [e // 2 for e in experts]
    # A unit prefetches the next outer unit (blocks, head), never a nested expert unit.
    held = [
        2 * embed + outer[0],
        2 * outer[0] + outer[1],
        outer[0] + local[0] + outer[1],
        2 * outer[1] + head,
        outer[1] + local[1] + head,
        2 * head,
    ]
    assert gathered(2) == (max(held) + root) * 4
    assert max(held) < outer[0] + local[0] + outer[1] + local[1]
    held = [
        2 * embed + outer[0] + outer[1],
        2 * outer[0] + outer[1] + head,
        outer[0] + local[0] + outer[1] + head,
        2 * outer[1] + head,
        outer[1] + local[1] + head,
        2 * head,
    ]
    assert gathered(2, prefetch=2) == (max(held) + root) * 4
    # ep=1: embed, block0, block1, lm_head with the experts inside each block.
    blocks = [o + e for o, e in zip(outer, experts)]
    held = [2 * embed + blocks[0], 2 * blocks[0] + blocks[1], 2 * blocks[1] + head, 2 * head]
    assert gathered(1) == (max(held) + root) * 4


def test_invalid_expert_parallel_degrees_say_what_is_allowed(moe_spec, spec):
    with pytest.raises(ValueError, match=r"experts per layer \(allowed: 1, 2\)"):
        estimate(moe_spec, MOE_WL.model_copy(update={"prompts_per_step": 6}), _cluster(6), FSDPConfig(**FP32, ep=3))
    with pytest.raises(ValueError, match="needs packed MoE experts"):
        estimate(spec, WL, _cluster(2), FSDPConfig(ep=2))
    with pytest.raises(ValueError, match="HSDP"):
        estimate(moe_spec, MOE_WL, _cluster(4), FSDPConfig(**FP32, ep=2, shard_group_size=2))


# -- per-layer embeddings (Gemma-3n) ------------------------------------------------------------
# A large per-layer table (4096 x 4 layers x 16) so its unit is the largest one.
PLE = (
    "tiny:gemma3n?hidden_size=64&intermediate_size=128&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=512"
    "&vocab_size_per_layer_input=4096&hidden_size_per_layer_input=16"
)


@pytest.fixture(scope="module")
def ple_spec():
    return load_model_spec(PLE)


def test_gemma3n_spec_reads_altup_and_per_layer_inputs(ple_spec):
    names = [n for n, _ in ple_spec.root_tensors]
    assert "model.embed_tokens_per_layer.weight" in names
    assert dict(ple_spec.root_tensors)["model.embed_tokens_per_layer.weight"] == (4096, 4 * 16)
    assert ple_spec.hidden_streams == 4  # Gemma3nTextConfig's altup_num_inputs default
    assert ple_spec.per_layer_input_width == 4 * 16
    assert ple_spec.lora_shapes("all-linear")[0][0].startswith("model.")  # AltUp / PLE projections adapted


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_per_layer_embedding_weights_are_exact_per_rank(ple_spec, gpus):
    est = estimate(ple_spec, WL, _cluster(gpus), SHARD_ALL)
    local, replicated = _sharded_bytes(ple_spec, gpus, 2, 0)
    assert est.phases["learn"].components["weights"] == local
    assert replicated == 0


def test_per_layer_embeddings_are_gathered_as_their_own_unit(ple_spec):
    """Units run PLE table, block 0, ..., block 3 (the embeddings are tied, so in the root).
    With one unit prefetched and no buffer allowance, a no-grad forward holds at most the
    table (twice: FSDP2 frees its all-gather output at the next unit's copy-out) and block 0
    beside the root (norms, tied embeddings, AltUp / PLE projections and their LoRA); were
    the table in the root it would sit beside two blocks for the whole step."""
    fsdp = FSDPConfig(param_persistence_threshold=0, prefetch_units=1, param_dtype="float32")
    workload = WL.model_copy(update={"logprob_chunk_size": 4, "weights_dtype": "float32"})
    est = estimate(ple_spec, workload, _cluster(2), fsdp, coefficients=Coefficients(all_gather_overlap=0.0))
    ple_name = "model.embed_tokens_per_layer.weight"
    table = math.prod(dict(ple_spec.root_tensors)[ple_name])
    root = math.prod(ple_spec.embed_shape) + sum(math.prod(s) for n, s in ple_spec.root_tensors if n != ple_name)
    root += WL.lora_rank * sum(ar * ac + br * bc for _, ar, ac, br, bc in ple_spec.lora_outside_blocks["all-linear"])
    blocks = [
        sum(math.prod(s) for _, s in b.tensors)
        + WL.lora_rank * sum(ar * ac + br * bc for _, ar, ac, br, bc in b.lora["all-linear"])
        for b in ple_spec.blocks
    ]
    assert table > max(blocks)
    from planner.memory._context import build_context
    from planner.memory._gathered import build_gathered, nograd_gathered_bytes
    from planner.memory._units import build_layout

    ctx = build_context(ple_spec, workload, _cluster(2), fsdp, coefficients=Coefficients(all_gather_overlap=0.0))
    gathered = build_gathered(ctx, build_layout(ctx))
    assert nograd_gathered_bytes(ctx, gathered, moment="running") == (2 * table + blocks[0] + root) * 4
    # its copy-out, the forward's first, beside the root's all-gather output
    assert nograd_gathered_bytes(ctx, gathered, moment="copying") == (2 * table + 2 * root) * 4
    # the reference pass holds those windows beside the embeddings' output only; a block's forward
    # runs under its own unit's (the root, the block twice and the next one prefetched)
    assert est.phases["reference"].components["weights_gathered"] <= (2 * table + blocks[0] + root) * 4


def test_altup_streams_raise_the_activation_estimate(ple_spec):
    """The same model read as one hidden stream (no AltUp) saves less per token."""
    one_stream = ple_spec.model_copy(update={"hidden_streams": 1, "per_layer_input_width": 0})
    for checkpointing in (True, False):
        workload = WL.model_copy(update={"gradient_checkpointing": checkpointing})
        a = estimate(ple_spec, workload, _cluster(2), SHARD_ALL).phases["learn"].components["activations"]
        b = estimate(one_stream, workload, _cluster(2), SHARD_ALL).phases["learn"].components["activations"]
        assert a > b


def test_gathering_every_unit_for_generation_holds_what_reshard_off_holds(spec):
    hf = WL.model_copy(update={"generation": "hf"})
    resharding = FSDPConfig(param_persistence_threshold=0)
    per_unit = estimate(spec, hf, _cluster(2), resharding).phases["rollout"].components["weights_gathered"]
    once = (
        estimate(spec, hf.model_copy(update={"gather_weights_for_rollout": True}), _cluster(2), resharding)
        .phases["rollout"]
        .components["weights_gathered"]
    )
    kept = estimate(spec, hf, _cluster(2), resharding.model_copy(update={"reshard_after_forward": False}))
    # Every unit unsharded, and the all-gather output of the unit being gathered beside its copy;
    # without resharding, every unit and the last one's all-gather output, which generate's later
    # steps never drop (the head here, the largest unit: the same).
    assert once == kept.phases["rollout"].components["weights_gathered"]
    assert once > per_unit
    # Every unit in the compute dtype: the whole model's sharded tensors, gathered.
    assert once >= sum(math.prod(s) for i in range(spec.num_layers) for _, s in spec.block(i).tensors) * 2


def test_a_node_without_rank_0_holds_each_ranks_own_host_terms_only():
    """Only rank 0 gathers the saved checkpoint on the host: a node without it holds its ranks'
    own terms at their highest (the process, the offloaded Adam state and, as each rank loads,
    its own share of the checkpoint)."""
    from planner.hardware import GPUS

    spec8 = load_model_spec("meta-llama/Llama-3.1-8B")
    est = estimate(
        spec8,
        Workload(full_finetune=True),
        Cluster(gpu=GPUS["H100-80GB"], num_gpus=16, gpus_per_node=8),
        FSDPConfig(optim_cpu_offload=True),
    )
    load, learn = est.phases["load"].host, est.phases["learn"].host
    assert learn["host_optimizer_state"] > 0 and load["host_checkpoint"] > 0
    assert est.node_host_bytes(8, rank0=False) == 8 * sum(load.values()) > 8 * sum(learn.values())
    # rank 0's node: 8 processes (2 GiB each) and 8 of 16 shards of Adam's 16 bytes a parameter,
    # and at the save the whole fp32 master and moments (12 bytes a parameter) rank 0 gathers
    expected = 8 * (2 * 2**30 + 16 * spec8.total_params // 16) + 12 * spec8.total_params
    assert abs(est.node_host_bytes(8) - expected) < 0.001 * expected
    assert est.node_host_bytes(0) == 0
