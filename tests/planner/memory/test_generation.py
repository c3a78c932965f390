"""planner.memory._generation: KV cache and vLLM terms."""

from __future__ import annotations

import pytest

from planner.hardware import GPUS
from planner.memory import Coefficients
from planner.memory._generation import (
    host_vllm_weight_bytes,
    kv_cache_bytes,
    vllm_asleep_bytes,
    vllm_awake_bytes,
    vllm_profile_bytes,
    vllm_weight_bytes,
)

from .conftest import make_context


def test_kv_cache_caps_sliding_window_layers(ple_spec):
    ctx = make_context(ple_spec)  # 8 completions a rank, bf16
    kv_dim = ple_spec.block(0).attention.kv_dim
    # Three layers capped at their 1,024-token window, one global layer.
    assert kv_cache_bytes(ctx, 2000) == 2 * 8 * kv_dim * 2 * (3 * 1024 + 2000)
    assert kv_cache_bytes(ctx, 100) == 2 * 8 * kv_dim * 2 * 4 * 100


def test_vllm_awake_asleep_and_offloaded(dense_spec):
    gpu = GPUS["H100-80GB"]
    ctx = make_context(dense_spec, gpu=gpu, generation="vllm", vllm_gpu_memory_utilization=0.4, vllm_max_num_seqs=8)
    # profiled: min(8 seqs x 128 tokens, max(128, 8192)) = 1024 tokens x (3 x 512 + 128) x bf16
    assert vllm_profile_bytes(ctx) == 1024 * (3 * 512 + 128) * 2
    assert vllm_awake_bytes(ctx) == int(0.4 * gpu.memory_bytes) - 1024 * (3 * 512 + 128) * 2
    assert vllm_weight_bytes(ctx) == dense_spec.total_params * 2
    # asleep: the residue, and the runner's input buffers for the 1,024 batched tokens (the
    # embeddings, H = 128 in bf16, and 30 bytes of ids, positions and masks a token)
    assert vllm_asleep_bytes(ctx) == Coefficients().vllm_sleep_residual_bytes + 1024 * (128 * 2 + 30)
    assert host_vllm_weight_bytes(ctx) == dense_spec.total_params * 2
    assert vllm_asleep_bytes(make_context(dense_spec, generation="vllm")) == 0  # no residue on a CPU run
    hf = make_context(dense_spec, gpu=gpu)
    assert vllm_awake_bytes(hf) == vllm_asleep_bytes(hf) == host_vllm_weight_bytes(hf) == 0


def test_offloading_the_trainer_weights_during_rollout(dense_spec):
    from planner.memory import estimate

    gpu = GPUS["A100-40GB"]
    kept = make_context(dense_spec, gpu=gpu, generation="vllm", gpus=1)
    parked = make_context(dense_spec, gpu=gpu, generation="vllm", gpus=1, offload_weights_during_rollout=True)
    a = estimate(kept.spec, kept.workload, kept.cluster, None).phases
    b = estimate(parked.spec, parked.workload, parked.cluster, None).phases
    weights, lora = a["rollout"].components["weights"], a["rollout"].components["lora"]
    assert "weights" not in b["rollout"].components and "lora" not in b["rollout"].components
    assert b["rollout"].host["host_weights"] == weights + lora
    # the sync holds the trainer's weights beside the engine's, before its KV cache wakes
    assert b["sync"].components["weights"] == weights and b["sync"].components["vllm"] == dense_spec.total_params * 2
    assert b["learn"] == a["learn"]


def test_folding_lora_into_gathered_weights_builds_one_delta_at_a_time(dense_spec):
    from agilerl.distributed import FSDPConfig
    from planner.memory._phases import lora_fold_bytes

    gpu = GPUS["H100-80GB"]
    sharded = FSDPConfig(param_persistence_threshold=0)  # bf16 compute
    widest = max(i * o for b in dense_spec.blocks for _, i, o in b.linears)  # the 512 x 128 MLP projections
    assert widest == 512 * 128
    once = make_context(dense_spec, gpu=gpu, fsdp=sharded, gather_weights_for_rollout=True)
    assert lora_fold_bytes(once) == widest * 2 * 2  # the product and its scaled copy, bf16
    on_cpu = make_context(dense_spec, fsdp=sharded, gather_weights_for_rollout=True)
    assert lora_fold_bytes(on_cpu) == widest * (4 + 4 + 2)  # PEFT builds it in fp32 on a CPU, then casts
    # Nothing is folded unit by unit, under tp or with 4-bit base weights; replicated weights are
    # folded into merged copies, one delta at a time too.
    assert lora_fold_bytes(make_context(dense_spec, gpu=gpu, fsdp=sharded)) == 0
    assert (
        lora_fold_bytes(
            make_context(
                dense_spec,
                gpu=gpu,
                fsdp=FSDPConfig(param_persistence_threshold=0, tp=2),
                gather_weights_for_rollout=True,
            )
        )
        == 0
    )
    assert (
        lora_fold_bytes(
            make_context(dense_spec, gpu=gpu, fsdp=sharded, gather_weights_for_rollout=True, load_in_4bit=True)
        )
        == 0
    )
    assert (
        lora_fold_bytes(
            make_context(
                dense_spec, gpu=gpu, fsdp=FSDPConfig(param_persistence_threshold=10**6), gather_weights_for_rollout=True
            )
        )
        == widest * 2 * 2
    )


def test_unsharded_gather_once_holds_a_merged_copy_of_every_adapted_linear(dense_spec):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    from agilerl.utils.sources import parse_tiny
    from agilerl.utils.tiny import tiny_model
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import estimate
    from planner.memory._phases import lora_fold_bytes, merged_copy_bytes
    from tests.planner.memory.conftest import DENSE

    # Counted from the real model: the base weight of every linear PEFT adapts, at 2 bytes (bf16).
    arch, kwargs = parse_tiny(DENSE)
    model = get_peft_model(tiny_model(arch, **kwargs), LoraConfig(r=8, target_modules="all-linear"))
    adapted = sum(m.get_base_layer().weight.numel() for m in model.modules() if isinstance(m, LoraLinear))
    widest = max(m.get_base_layer().weight.numel() for m in model.modules() if isinstance(m, LoraLinear))
    once = make_context(dense_spec, gpus=1, gather_weights_for_rollout=True)
    assert merged_copy_bytes(once) == adapted * 2
    assert lora_fold_bytes(once) == widest * (4 + 4 + 2)  # one delta at a time, built in fp32 on a CPU
    assert merged_copy_bytes(make_context(dense_spec, gpus=1)) == 0
    assert merged_copy_bytes(make_context(dense_spec, gpus=1, gather_weights_for_rollout=True, load_in_4bit=True)) == 0
    # In the rollout phase: the copies beside the weights, through generation.
    one = Cluster(gpu=CPU_DEVICE, num_gpus=1)
    wl = once.workload
    with_copies = estimate(dense_spec, wl, one, None).phases["rollout"].components
    without = estimate(dense_spec, wl.model_copy(update={"gather_weights_for_rollout": False}), one, None)
    assert with_copies["weights_gathered"] == adapted * 2
    assert "weights_gathered" not in without.phases["rollout"].components


def test_fsdp_gather_once_holds_merged_copies_of_the_replicated_adapted_linears_only(dense_spec):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    from agilerl.distributed import FSDPConfig
    from agilerl.utils.sources import parse_tiny
    from agilerl.utils.tiny import tiny_model
    from planner.memory._phases import merged_copy_bytes
    from tests.planner.memory.conftest import DENSE

    # Counted from the real model: under FSDP2 a base weight below the persistence threshold stays a
    # plain (replicated) tensor, and GRPO generates on a merged copy of it; the sharded ones fold
    # into their gathered copies, which the gathered window already holds.
    arch, kwargs = parse_tiny(DENSE)
    model = get_peft_model(tiny_model(arch, **kwargs), LoraConfig(r=8, target_modules="all-linear"))
    sizes = sorted({m.get_base_layer().weight.numel() for m in model.modules() if isinstance(m, LoraLinear)})
    assert len(sizes) > 1
    threshold = sizes[-1]  # every adapted weight but the widest stays replicated
    replicated = sum(
        m.get_base_layer().weight.numel()
        for m in model.modules()
        if isinstance(m, LoraLinear) and m.get_base_layer().weight.numel() < threshold
    )
    assert replicated > 0
    split = FSDPConfig(param_persistence_threshold=threshold)  # bf16 base
    assert merged_copy_bytes(make_context(dense_spec, fsdp=split, gather_weights_for_rollout=True)) == replicated * 2
    assert (
        merged_copy_bytes(
            make_context(dense_spec, fsdp=FSDPConfig(param_persistence_threshold=0), gather_weights_for_rollout=True)
        )
        == 0
    )
    assert merged_copy_bytes(make_context(dense_spec, fsdp=split)) == 0  # unit by unit: nothing merged
    assert (
        merged_copy_bytes(
            make_context(
                dense_spec,
                fsdp=FSDPConfig(param_persistence_threshold=threshold, tp=2),
                gather_weights_for_rollout=True,
            )
        )
        == 0
    )


#: the logits dominating: a 32k vocabulary, narrow K/V heads
LOGITS_DOMINATING = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 32768}


@pytest.mark.parametrize(
    "arch, extra, temperature",
    [
        ("qwen2", {}, 1.0),
        # the last 2 of 6 layers read the K and V of two earlier ones: no cache entry of their own
        ("gemma3n", {"num_layers": 6, "num_kv_shared_layers": 2}, 1.0),
        ("gemma3n", {"num_layers": 6}, 1.0),
        ("qwen2", LOGITS_DOMINATING, 1.0),
        ("qwen2", LOGITS_DOMINATING, 0.7),
    ],
)
def test_the_decode_peak_is_measured_on_hugging_face_generate(arch, extra, temperature):
    """Measured, not pinned: the live tensors of a real ``generate`` sampling as GRPO does
    (at its temperature, no top-k or top-p; bf16) against the estimate's decode moment (its KV
    cache and sampling's logits). The cache grows by concatenation, one layer's keys (then its
    values) at a time; a sliding-window layer (Gemma-3n's) concatenates both before rebinding
    either (counted as one layer's keys, it read -7.4% here). Under Gemma-3n's K/V sharing the
    layers reading another's K and V add no entry (counted, it read +29% here). Sampling holds
    the bf16 logits and three fp32 copies at temperature 1, four at 0.7 (counted as three, the
    32k vocabulary read -16% there)."""
    import torch

    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import estimate
    from planner.models import load_model_spec
    from planner.probe.tracking import LiveBytes
    from planner.workload import Workload

    sizes = dict(hidden_size=256, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=8, vocab_size=32)
    sizes.update(extra)
    model = _bf16_sdpa_model(arch, sizes)
    prompts, group, prompt, completion = 4, 2, 8, 120
    ids = torch.randint(3, sizes["vocab_size"], (prompts * group, prompt))
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    live = LiveBytes(params)
    with torch.no_grad(), live:
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion, do_sample=True,
            temperature=temperature, top_k=0, top_p=1.0, use_cache=True, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    spec = load_model_spec(f"tiny:{arch}?" + "&".join(f"{k}={v}" for k, v in sizes.items()))
    workload = Workload(
        prompts_per_step=prompts, group_size=group, prompt_tokens=prompt, completion_tokens=completion,
        generation="hf", share_prompt_prefix=False, weights_dtype="bfloat16", temperature=temperature,
    )  # fmt: skip
    rollout = estimate(spec, workload, Cluster(gpu=CPU_DEVICE), None).phases["rollout"].components
    estimated = rollout["kv_cache"] + rollout["logits"]
    assert abs(estimated - live.peak) <= 0.02 * live.peak, (estimated, live.peak)


@pytest.mark.parametrize("temperature, copies", [(1.0, 2), (0.7, 3)])
def test_a_decode_step_runs_beside_the_step_befores_sampling_locals(temperature, copies):
    """Measured, not pinned: while a decode step's head runs, transformers' sampling loop still
    holds the step before's fp32 logits and their softmax in its locals, and at a temperature
    other than 1 the divided scores too (the estimate's decode moment, its cache's growth
    apart). Counted as three copies at temperature 1, the accuracy benchmark's rollouts whose
    peak is a decode step read up to 3% high."""
    import torch

    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import Coefficients
    from planner.memory._context import build_context
    from planner.memory._generation import hf_rollout_moments, kv_cache_bytes
    from planner.memory._units import build_layout
    from planner.models import load_model_spec
    from planner.probe.tracking import LiveBytes
    from planner.workload import Workload

    sizes = dict(intermediate_size=64, num_layers=2, **LOGITS_DOMINATING)
    model = _bf16_sdpa_model("qwen2", sizes)
    prompts, group, prompt, completion = 4, 2, 8, 24
    ids = torch.randint(3, sizes["vocab_size"], (prompts * group, prompt))
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    live = LiveBytes(params)
    at_head: list[int] = []  # live bytes as each forward's head starts

    def before_head(module, args):
        at_head.append(live.total)

    model.lm_head.register_forward_pre_hook(before_head)
    with torch.no_grad(), live:
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion, do_sample=True,
            temperature=temperature, top_k=0, top_p=1.0, use_cache=True, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    spec = load_model_spec("tiny:qwen2?" + "&".join(f"{k}={v}" for k, v in sizes.items()))
    workload = Workload(
        prompts_per_step=prompts, group_size=group, prompt_tokens=prompt, completion_tokens=completion,
        generation="hf", share_prompt_prefix=False, weights_dtype="bfloat16", temperature=temperature,
    )  # fmt: skip
    ctx = build_context(spec, workload, Cluster(gpu=CPU_DEVICE), None, coefficients=Coefficients())
    _, decode, _ = hf_rollout_moments(ctx, build_layout(ctx))
    n, V = prompts * group, sizes["vocab_size"]
    assert decode["logits"] == copies * n * V * 4
    # the last step's head: the whole cache but its last position, the locals, the step's hidden state
    assert at_head[-1] == pytest.approx(kv_cache_bytes(ctx, prompt + completion) + decode["logits"], rel=0.02)


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("qwen2", {}),
        # sliding and full layers interleaved; the last 2 of 6 read earlier layers' K and V
        ("gemma3n", {"num_layers": 6, "num_kv_shared_layers": 2}),
    ],
)
def test_a_prefills_cache_holds_the_layers_that_have_run(arch, extra):
    """Measured, not pinned: while each decoder layer of a real ``generate``'s prefill runs, the
    cache holds the K and V of that layer and the ones before it only (a layer reading another's
    adds none), so the prefill's widest block is not paired with the whole prompt's cache."""
    import torch
    from transformers.cache_utils import Cache

    from planner.memory._generation import kv_cache_bytes, prefill_cache_bytes
    from planner.models import load_model_spec
    from planner.workload import Workload

    sizes = dict(hidden_size=64, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=64)
    sizes.update(extra)
    model = _bf16_sdpa_model(arch, sizes)
    config = model.config
    rows, prompt = 4, 24
    seen: list[int] = []  # the cache's bytes as each layer of the prefill returns

    def cached(module, args, kwargs, output):
        cache = next(v for v in kwargs.values() if isinstance(v, Cache))
        if len(seen) < config.get_text_config().num_hidden_layers:
            tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
            seen.append(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))

    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for layer in layers:
        layer.register_forward_hook(cached, with_kwargs=True)
    ids = torch.randint(3, 64, (rows, prompt))
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
            do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    spec = load_model_spec(f"tiny:{arch}?" + "&".join(f"{k}={v}" for k, v in sizes.items()))
    ctx = make_context(
        spec,
        Workload(
            prompts_per_step=rows // 2,
            group_size=2,
            prompt_tokens=prompt,
            completion_tokens=2,
            generation="hf",
            share_prompt_prefix=False,
            weights_dtype="bfloat16",
        ),  # fmt: skip
        gpus=1,
    )
    assert len(seen) == spec.num_layers
    assert list(prefill_cache_bytes(ctx, prompt, rows)) == seen
    assert seen[0] < seen[-1] == kv_cache_bytes(ctx, prompt, rows)


def _bf16_sdpa_model(arch: str, sizes: dict):
    """A tiny random model of ``arch`` in bf16 with SDPA attention, seeded, in eval mode."""
    import torch
    import transformers

    from agilerl.utils.tiny import tiny_config

    config = tiny_config(arch, **sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
