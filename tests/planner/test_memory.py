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
WL = Workload(prompts_per_step=2, group_size=8, prompt_tokens=64, completion_tokens=64, micro_batch_size_per_gpu=2,
              logprob_chunk_size=128, gradient_checkpointing=True, lora_rank=8, weights_dtype="bfloat16")
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
    assert no_reshard.phases["learn"].components["weights_gathered"] > base.phases["learn"].components["weights_gathered"]
    no_gc = estimate(spec, WL.model_copy(update={"gradient_checkpointing": False}), c2, SHARD_ALL)
    assert no_gc.phases["learn"].components["activations"] > base.phases["learn"].components["activations"]
    big_chunk = estimate(spec, WL.model_copy(update={"logprob_chunk_size": 4096}), c2, SHARD_ALL)
    assert big_chunk.phases["learn"].components["logits"] > base.phases["learn"].components["logits"]
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
    assert single.phases["learn"].components.get("comm_buffers", 0) == 0  # no NCCL on one GPU


def test_vllm_terms_are_labelled(spec):
    wl = WL.model_copy(update={"generation": "vllm", "vllm_gpu_memory_utilization": 0.4})
    est = estimate(spec, wl, _cluster(2, GPUS["H100-80GB"]), SHARD_ALL)
    assert est.phases["rollout"].components["vllm"] == int(0.4 * GPUS["H100-80GB"].memory_bytes)
    assert "kv_cache" not in est.phases["rollout"].components
    assert any("not yet validated" in n for n in est.notes)
    assert est.phases["learn"].host["host_vllm_weights"] == spec.total_params * 2


def test_qlora_stores_nf4(spec):
    est = estimate(spec, WL.model_copy(update={"load_in_4bit": True}), _cluster(1), None)
    full = estimate(spec, WL, _cluster(1), None)
    kept = (math.prod(spec.embed_shape) + math.prod(spec.lm_head_shape or (0,))) * 2  # embeddings stay bf16
    quantised = est.phases["learn"].components["weights"] - kept
    bf16 = full.phases["learn"].components["weights"] - kept
    assert 0.25 < quantised / bf16 < 0.3  # 4 bits + quantisation constants vs 16 bits


def test_host_per_node(spec):
    est = estimate(spec, WL, _cluster(8, GPUS["H100-80GB"], per_node=4), SHARD_ALL)
    assert est.host_per_node_bytes == 4 * est.host_peak_bytes


def test_estimate_is_deterministic_and_coefficients_matter(spec):
    a = estimate(spec, WL, _cluster(2), SHARD_ALL)
    assert a == estimate(spec, WL, _cluster(2), SHARD_ALL)
    b = estimate(spec, WL, _cluster(2), SHARD_ALL, coefficients=Coefficients(act_hidden=100.0))
    assert b.phases["learn"].components["activations"] > a.phases["learn"].components["activations"]


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
    with pytest.raises(ValueError, match="KV heads"):
        estimate(spec, WL.model_copy(update={"prompts_per_step": 4}), _cluster(4), FSDPConfig(tp=4))
