"""planner.choose.plan: choices, reasons, user-fixed fields, and what to do when nothing fits."""

from __future__ import annotations

import pytest

from agilerl.distributed import FSDPConfig
from planner.choose import check_inputs
from planner.choose import plan as plan_with_engines
from planner.hardware import GPU, Cluster
from planner.memory import estimate
from planner.models import load_model_spec
from planner.workload import Workload

TINY = "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096"
MIB = 2**20
# Weight-dominated (no rollout measured, short sequences) so that sharding decides what fits.
WL = Workload(
    prompts_per_step=2,
    group_size=8,
    prompt_tokens=16,
    completion_tokens=16,
    lora_rank=8,
    weights_dtype="float32",
    generation="none",
)


def plan(*args, **kwargs):
    """plan() of the trainer ranks alone: this module's workloads use generation='none' for "no
    rollout measured", whose manifest would put the rollout on engine ranks of their own, judged
    by the engine tests below (plan_with_engines)."""
    return plan_with_engines(*args, **{"engine_ranks": False, **kwargs})


# Tiny models' tensors are under the default persistence threshold: shard everything, as the
# multi-rank tests do, so that sharding changes what fits.
ALL = {"param_persistence_threshold": 0}


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(TINY)


def _gpu(mib: float) -> GPU:
    return GPU(name=f"test-{mib}MiB", memory_bytes=int(mib * MIB), kind="cpu", cuda_context_bytes=0)


def test_roomy_multi_gpu_picks_data_parallel_and_the_fastest_knobs(spec):
    p = plan(spec, WL, Cluster(gpu=_gpu(4096), num_gpus=2))
    assert p.fits and p.fsdp is None
    assert p.reasons()["sharding"].startswith("the whole actor fits")
    assert p.workload.micro_batch_size_per_gpu == 8  # the whole share of 16 / 2
    assert p.workload.gradient_checkpointing is False
    assert p.workload.logprob_chunk_size == 4096


def test_tight_memory_shards_and_every_choice_has_a_reason(spec):
    frugal = WL.model_copy(
        update={"micro_batch_size_per_gpu": 1, "logprob_chunk_size": 256, "gradient_checkpointing": True}
    )
    four = Cluster(gpu=_gpu(4096), num_gpus=4)
    unsharded = estimate(spec, frugal, four, None).peak_bytes
    sharded = estimate(spec, frugal, four, FSDPConfig(**ALL, optim_cpu_offload=True)).peak_bytes
    assert sharded < unsharded
    gpu = _gpu((sharded + unsharded) / 2 / 0.95 / MIB)  # only sharded fits
    p = plan(spec, WL, Cluster(gpu=gpu, num_gpus=4), fixed=ALL)
    assert p.fits and p.fsdp is not None
    assert p.estimate.peak_bytes <= gpu.memory_bytes - p.margin_bytes
    for field in (
        "sharding",
        "optim_cpu_offload",
        "micro_batch_size_per_gpu",
        "gradient_checkpointing",
        "reshard_after_forward",
        "logprob_chunk_size",
        "wrap_every_n_blocks",
        "prefetch_units",
        "backward_prefetch_units",
        "shard_group_size",
        "fits",
    ):
        assert p.reasons()[field], field
    # Choices are the estimate's: tight, it keeps resharding, and not resharding would not fit.
    assert p.fsdp.reshard_after_forward
    relaxed = p.fsdp.model_copy(update={"reshard_after_forward": False})
    assert estimate(spec, p.workload, p.cluster, relaxed).peak_bytes > gpu.memory_bytes - p.margin_bytes


def test_optimizer_offload_when_only_the_host_can_hold_adam(spec):
    base = WL.model_copy(
        update={
            "lora_rank": 64,
            "micro_batch_size_per_gpu": 1,
            "logprob_chunk_size": 256,
            "gradient_checkpointing": True,
        }
    )
    cluster = Cluster(gpu=_gpu(4096), num_gpus=2)
    on = estimate(spec, base, cluster, FSDPConfig(**ALL, optim_cpu_offload=False)).peak_bytes
    off = estimate(spec, base, cluster, FSDPConfig(**ALL, optim_cpu_offload=True)).peak_bytes
    assert off < on
    gpu = _gpu((on + off) / 2 / 0.95 / MIB)
    p = plan(spec, base, Cluster(gpu=gpu, num_gpus=2), sharding="fsdp", fixed=ALL)
    assert p.fits and p.fsdp.optim_cpu_offload is True
    assert "on the host it fits" in p.reasons()["optim_cpu_offload"]


def test_user_fixed_fields_are_kept(spec):
    p = plan(
        spec,
        WL.model_copy(update={"micro_batch_size_per_gpu": 2, "gradient_checkpointing": True}),
        Cluster(gpu=_gpu(4096), num_gpus=2),
        fixed={"reshard_after_forward": True, "wrap_every_n_blocks": 1},
        sharding="fsdp",
    )
    assert p.fsdp.reshard_after_forward is True and p.fsdp.wrap_every_n_blocks == 1
    assert p.workload.micro_batch_size_per_gpu == 2 and p.workload.gradient_checkpointing is True
    assert "reshard_after_forward" not in p.reasons()
    with pytest.raises(ValueError):
        plan(spec, WL, Cluster(gpu=_gpu(4096), num_gpus=2), fixed={"cpu_offload": True, "optim_cpu_offload": True})


def test_hsdp_across_nodes_when_a_node_can_hold_the_shards(spec):
    wl = WL.model_copy(update={"prompts_per_step": 4})
    p = plan(spec, wl, Cluster(gpu=_gpu(4096), num_gpus=4, gpus_per_node=2), sharding="fsdp", fixed=ALL)
    assert p.fsdp.shard_group_size == 2
    assert "within a node" in p.reasons()["shard_group_size"]


def test_cpu_offload_only_as_a_last_resort_with_vllm(spec):
    wl = WL.model_copy(
        update={"micro_batch_size_per_gpu": 1, "logprob_chunk_size": 256, "gradient_checkpointing": True}
    )
    cluster = Cluster(gpu=_gpu(4096), num_gpus=2)
    frugal = FSDPConfig(**ALL, optim_cpu_offload=True)
    need = estimate(spec, wl, cluster, frugal).peak_bytes
    offloaded = estimate(spec, wl, cluster, FSDPConfig(**ALL, cpu_offload=True)).peak_bytes
    assert offloaded < need
    gpu = _gpu((need + offloaded) / 2 / 0.95 / MIB)
    without = plan(spec, wl, Cluster(gpu=gpu, num_gpus=2), sharding="fsdp", fixed=ALL)
    assert not without.fits  # no colocated engine: parameter offload is not allowed
    with_vllm = plan(spec, wl, Cluster(gpu=gpu, num_gpus=2), sharding="fsdp", colocated_vllm=True, fixed=ALL)
    assert with_vllm.fits and with_vllm.fsdp.cpu_offload is True
    assert "last resort" in with_vllm.reasons()["cpu_offload"]


def test_nothing_fits_names_the_smallest_change(spec):
    need = estimate(
        spec,
        WL.model_copy(
            update={"micro_batch_size_per_gpu": 1, "logprob_chunk_size": 256, "gradient_checkpointing": True}
        ),
        Cluster(gpu=_gpu(4096), num_gpus=2),
        FSDPConfig(**ALL, optim_cpu_offload=True),
    ).peak_bytes
    p = plan(spec, WL, Cluster(gpu=_gpu(need * 0.8 / MIB), num_gpus=2), fixed=ALL)
    assert not p.fits
    assert "over the" in p.reasons()["fits"]
    assert any(s.startswith("use ") and "GPUs" in s for s in p.suggestions), p.suggestions


def test_single_device_needs_no_sharding(spec):
    p = plan(spec, WL, Cluster(gpu=_gpu(4096), num_gpus=1))
    assert p.fsdp is None and p.reasons()["sharding"] == "one device: no sharding needed"


# -- mixture of experts ---------------------------------------------------------------------------
# Long sequences, so that a micro-batch routes more than 512 MiB of expert rows: every
# candidate chunk (64 to 512 MiB) binds.
MOE = (
    "tiny:qwen3_moe?hidden_size=512&moe_intermediate_size=1024&num_experts=8&num_experts_per_tok=2"
    "&num_layers=2&num_heads=8&num_kv_heads=2&vocab_size=4096&max_position_embeddings=8192"
)
MOE_WL = Workload(
    prompts_per_step=2,
    group_size=8,
    prompt_tokens=4096,
    completion_tokens=4096,
    lora_rank=8,
    micro_batch_size_per_gpu=8,
    gradient_checkpointing=True,
    logprob_chunk_size=256,
    weights_dtype="bfloat16",
    generation="none",
)
# Experts dominate the weights (64 per layer, 1 GiB in bf16): expert parallel decides what fits.
WIDE = (
    "tiny:qwen3_moe?hidden_size=1024&moe_intermediate_size=512&num_experts=64&num_experts_per_tok=2"
    "&num_layers=4&num_heads=8&num_kv_heads=2&vocab_size=4096"
)


@pytest.fixture(scope="module")
def moe_spec():
    return load_model_spec(MOE)


def test_moe_expert_chunk_is_the_largest_that_fits(moe_spec):
    roomy = plan(moe_spec, MOE_WL, Cluster(gpu=_gpu(256 * 1024), num_gpus=2), fixed=ALL)
    assert roomy.fits and roomy.fsdp.routed_expert_chunk_mib == 512
    assert "largest of 64/128/256/512" in roomy.reasons()["routed_expert_chunk_mib"]
    cluster = Cluster(gpu=_gpu(256 * 1024), num_gpus=2)
    peaks = {
        c: estimate(moe_spec, MOE_WL, cluster, roomy.fsdp.model_copy(update={"routed_expert_chunk_mib": c})).peak_bytes
        for c in (64, 128, 256, 512)
    }
    assert peaks[64] < peaks[128] < peaks[256] < peaks[512]  # every chunk binds here
    # Room for the 128 MiB chunk and not the 256 MiB one (the plan keeps a 5% margin).
    gpu = _gpu((peaks[128] + peaks[256]) / 2 / 0.95 / MIB)
    tight = plan(
        moe_spec,
        MOE_WL,
        Cluster(gpu=gpu, num_gpus=2),
        fixed={
            **ALL,
            **{
                k: getattr(roomy.fsdp, k)
                for k in (
                    "reshard_after_forward",
                    "wrap_every_n_blocks",
                    "prefetch_units",
                    "backward_prefetch_units",
                    "optim_cpu_offload",
                    "ep",
                )
            },
        },
    )
    assert tight.fits and tight.fsdp.routed_expert_chunk_mib == 128
    fixed = plan(
        moe_spec, MOE_WL, Cluster(gpu=_gpu(256 * 1024), num_gpus=2), fixed={**ALL, "routed_expert_chunk_mib": 64}
    )
    assert fixed.fsdp.routed_expert_chunk_mib == 64 and "routed_expert_chunk_mib" not in fixed.reasons()


def test_moe_uses_expert_parallel_only_when_the_experts_do_not_fit_without_it():
    spec = load_model_spec(WIDE)
    wl = MOE_WL.model_copy(update={"prompt_tokens": 64, "completion_tokens": 64, "micro_batch_size_per_gpu": 1})
    four = Cluster(gpu=_gpu(256 * 1024), num_gpus=4)
    assert plan(spec, wl, four, sharding="fsdp", fixed=ALL).fsdp.ep == 1  # room: no all-to-all
    frugal = FSDPConfig(**ALL, routed_expert_chunk_mib=64, optim_cpu_offload=False)
    need = {ep: estimate(spec, wl, four, frugal.model_copy(update={"ep": ep})).peak_bytes for ep in (1, 2, 4)}
    assert need[1] > need[2] > need[4]
    gpu = _gpu((need[1] + need[2]) / 2 / 0.95 / MIB)
    p = plan(spec, wl, Cluster(gpu=gpu, num_gpus=4), sharding="fsdp", fixed=ALL)
    assert p.fits and p.fsdp.ep == 2
    assert "experts split over 2 GPUs" in p.reasons()["ep"]


def test_the_frugal_settings_combine_expert_parallel_with_adam_on_the_host_before_nothing_fits():
    """Where neither expert parallelism nor Adam on the host fits alone but the two together do,
    the plan fits (it used to try the host only with ep=1, and said nothing fits)."""
    spec = load_model_spec(WIDE)
    wl = MOE_WL.model_copy(
        update={"prompt_tokens": 64, "completion_tokens": 64, "micro_batch_size_per_gpu": 1, "logprob_chunk_size": 256}
    )
    two = Cluster(gpu=_gpu(256 * 1024), num_gpus=2)
    frugal = FSDPConfig(**ALL, routed_expert_chunk_mib=64, optim_cpu_offload=False)
    need = {
        (ep, host): estimate(spec, wl, two, frugal.model_copy(update={"ep": ep, "optim_cpu_offload": host})).peak_bytes
        for ep in (1, 2)
        for host in (False, True)
    }
    together, alone = need[(2, True)], min(need[(2, False)], need[(1, True)])
    assert together < alone
    gpu = _gpu((together + alone) / 2 / 0.95 / MIB)  # only the two together fit
    p = plan(spec, wl, Cluster(gpu=gpu, num_gpus=2), sharding="fsdp", fixed={**ALL, "routed_expert_chunk_mib": 64})
    assert p.fits and (p.fsdp.ep, p.fsdp.optim_cpu_offload) == (2, True)
    assert p.estimate.peak_bytes <= gpu.memory_bytes - p.margin_bytes
    assert "experts split over 2 GPUs" in p.reasons()["ep"]


def test_a_colocated_engine_that_breaks_the_fit_gets_a_lower_fraction_suggested():
    from planner import catalog
    from planner.hardware import GPUS

    spec7b = catalog.load_spec("Qwen/Qwen2.5-7B")
    h100 = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    workload = Workload(prompts_per_step=1, lora_rank=64, generation="vllm", vllm_gpu_memory_utilization=0.8)
    p = plan(spec7b, workload, h100, sharding="none")  # one GPU left to choose offloads with FSDP2
    assert not p.fits and p.estimate.peak_phase == "rollout"
    lowered = [s for s in p.suggestions if s.startswith("lower vllm_gpu_memory_utilization to ")]
    assert lowered, p.suggestions
    fraction = float(lowered[0].rsplit(" ", 1)[1])
    assert 0.1 <= fraction < 0.8
    assert plan(
        spec7b, workload.model_copy(update={"vllm_gpu_memory_utilization": fraction}), h100, sharding="none"
    ).fits
    assert not plan(
        spec7b, workload.model_copy(update={"vllm_gpu_memory_utilization": fraction + 0.05}), h100, sharding="none"
    ).fits
    assert any(s.startswith("set offload_weights_during_rollout=True") for s in p.suggestions)
    # QLoRA with a colocated engine is suggested, and it fits.
    assert any("QLoRA" in s for s in p.suggestions), p.suggestions
    assert plan(spec7b, workload.model_copy(update={"load_in_4bit": True}), h100, sharding="none").fits


def test_fsdpconfig_fields_given_on_one_gpu_are_kept_not_dropped(spec):
    p = plan(spec, WL, Cluster(gpu=_gpu(4096), num_gpus=1), fixed={"reshard_after_forward": False})
    assert p.fsdp is not None and p.fsdp.reshard_after_forward is False
    assert p.reasons()["sharding"] == "FSDPConfig fields were given (reshard_after_forward)"


def test_qlora_is_sharded_when_the_4bit_base_does_not_fit_one_gpu():
    from planner import catalog
    from planner.hardware import GPUS

    spec70 = catalog.load_spec("meta-llama/Llama-3.1-70B")
    workload = Workload(prompts_per_step=8, load_in_4bit=True, generation="none")
    one = plan(spec70, workload, Cluster(gpu=GPUS["A100-40GB"], num_gpus=1))
    assert not one.fits and one.fsdp is None  # ~37 GiB of NF4 weights alone on a 40 GB GPU
    eight = plan(spec70, workload, Cluster(gpu=GPUS["A100-40GB"], num_gpus=8))
    assert eight.fsdp is not None and eight.reasons()["sharding"].startswith("unsharded it needs")
    assert eight.fits
    weights = eight.estimate.phases["step"].components["weights"]
    assert weights < one.estimate.phases["step"].components["weights"] / 4


def test_generation_gathers_each_unit_once_when_all_units_fit_beside_the_kv_cache(spec):
    from planner.emit import manifest_dict

    wl = WL.model_copy(update={"generation": "hf"})
    roomy = plan(spec, wl, Cluster(gpu=_gpu(4096), num_gpus=2), fixed={"reshard_after_forward": True})
    assert roomy.workload.gather_weights_for_rollout is True
    assert roomy.reasons()["gather_weights_for_rollout"].startswith("every unit gathered at once fits")
    assert manifest_dict(roomy)["algorithm"]["gather_weights_for_rollout"] is True
    per_unit = plan(
        spec,
        wl.model_copy(update={"gather_weights_for_rollout": False}),
        Cluster(gpu=_gpu(4096), num_gpus=2),
        fixed={"reshard_after_forward": True},
    )
    assert "gather_weights_for_rollout" not in per_unit.reasons()  # the user's choice is kept
    assert per_unit.workload.gather_weights_for_rollout is False
    assert manifest_dict(per_unit)["algorithm"]["gather_weights_for_rollout"] is False  # kept: the trainer would decide
    # reshard_after_forward=False keeps units gathered between forwards anyway; gathering once is
    # still decided, since it is what lets generate run LoRA merged and without per-token sync.
    kept = plan(spec, wl, Cluster(gpu=_gpu(4096), num_gpus=2), fixed={"reshard_after_forward": False})
    assert kept.fsdp.reshard_after_forward is False
    assert kept.workload.gather_weights_for_rollout is True
    assert kept.reasons()["gather_weights_for_rollout"].startswith("every unit gathered at once fits")


# -- the colocated vLLM engine's settings --------------------------------------------------------
def _vllm_plan(util=None, seqs=None, gpu="H100-80GB", model="Qwen/Qwen2.5-7B", sharding="auto"):
    from planner.hardware import gpu_by_name

    spec = load_model_spec(model)
    workload = Workload(generation="vllm", lora_rank=64, vllm_gpu_memory_utilization=util, vllm_max_num_seqs=seqs)
    cluster = Cluster(gpu=gpu_by_name(gpu), num_gpus=1)
    return spec, cluster, plan(spec, workload, cluster, sharding=sharding)


def test_the_plan_picks_the_largest_vllm_fraction_that_fits():
    spec, cluster, result = _vllm_plan()
    assert result.fits
    chosen = result.workload.vllm_gpu_memory_utilization
    assert result.reasons()["vllm_gpu_memory_utilization"].startswith("the largest fraction")
    # the next 0.05 step would push the rollout (engine awake) over the budget
    higher = result.workload.model_copy(update={"vllm_gpu_memory_utilization": round(chosen + 0.05, 2)})
    over = estimate(spec, higher, cluster, result.fsdp).peak_bytes
    assert over > cluster.gpu.memory_bytes - result.margin_bytes >= result.estimate.peak_bytes
    # max_num_seqs: the rank's completions, all in flight at once
    assert result.workload.vllm_max_num_seqs == min(256, result.workload.completions_per_step)
    from planner.emit import manifest_dict

    vllm = manifest_dict(result)["algorithm"]["vllm"]  # what the trainer is given
    assert vllm["gpu_memory_utilization"] == chosen and vllm["max_num_seqs"] == result.workload.vllm_max_num_seqs


def test_a_vllm_fraction_the_user_gives_is_kept_and_too_much_gets_the_lower_fraction_fix():
    _, _, kept = _vllm_plan(util=0.5, seqs=32)
    assert kept.fits and kept.workload.vllm_gpu_memory_utilization == 0.5 and kept.workload.vllm_max_num_seqs == 32
    assert "vllm_gpu_memory_utilization" not in kept.reasons() and "vllm_max_num_seqs" not in kept.reasons()
    _, _, over = _vllm_plan(util=0.8, sharding="none")
    assert not over.fits
    assert any(s.startswith("lower vllm_gpu_memory_utilization to 0.") for s in over.suggestions)
    # left to choose, the plan keeps the engine's fraction and parks the trainer's weights on the host
    _, _, offloaded = _vllm_plan(util=0.8)
    assert offloaded.fits and offloaded.fsdp is not None and offloaded.fsdp.cpu_offload


def test_the_fraction_never_starves_the_engine_of_its_own_weights():
    from planner.memory import vllm_floor

    spec, cluster, result = _vllm_plan(gpu="L4")  # 24 GB: a 7B engine's weights alone take 15 GB
    floor = vllm_floor(spec, result.workload, cluster, result.fsdp) / cluster.gpu.memory_bytes
    assert floor > 0.6
    assert result.workload.vllm_gpu_memory_utilization >= floor


@pytest.mark.parametrize(
    "device, expected",
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-80GB"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA L4", "L4"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA RTX A6000", None),
        ("NVIDIA L40S", None),
        ("NVIDIA A100-SXM4", None),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_a_device_name_finds_its_catalog_gpu_and_no_other(device, expected):
    from planner.hardware import gpu_for_device

    found = gpu_for_device(device)
    assert (found.name if found else None) == expected


def test_cispo_and_gspo_plan_without_a_reference_pass_and_emit_their_own_manifest(spec):
    from agilerl.manifest import load_manifest
    from planner.emit import manifest_dict, python_snippet

    cluster = Cluster(gpu=_gpu(4096), num_gpus=2)
    for algorithm, name in (("cispo", "CISPO"), ("gspo", "GSPO")):
        wl = Workload(algorithm=algorithm, micro_batch_size_per_gpu=4)
        assert wl.beta == 0.0  # the papers' recipe: no KL term
        same = Workload(micro_batch_size_per_gpu=4, beta=0.0)
        assert estimate(spec, wl, cluster, None).phases == estimate(spec, same, cluster, None).phases
        assert (
            estimate(spec, wl, cluster, None).phases
            != estimate(spec, same.model_copy(update={"beta": 0.04}), cluster, None).phases
        )  # the reference pass costs
        p = plan(spec, wl, cluster)
        manifest = manifest_dict(p)
        assert manifest["algorithm"]["name"] == name and manifest["algorithm"]["beta"] == 0.0
        manifest["algorithm"]["model_name"] = TINY
        assert load_manifest(manifest).algorithm.name == name
        assert f"agent = {name}(" in python_snippet(p)
    assert Workload(algorithm="cispo", beta=0.1).beta == 0.1  # a given beta is kept
    assert Workload(algorithm="reinforce").beta == 0.04


def _cuda(mib: float) -> GPU:
    """A GPU whose host is not its memory (on a CPU run a checkpoint's host copies are)."""
    return GPU(name=f"test-cuda-{mib}MiB", memory_bytes=int(mib * MIB), kind="cuda", cuda_context_bytes=0)


def test_full_finetuning_defers_the_gradient_sync_only_where_it_fits(spec):
    wl = WL.model_copy(
        update={
            "full_finetune": True,
            "micro_batch_size_per_gpu": 2,
            "logprob_chunk_size": 256,
            "gradient_checkpointing": True,
        }
    )
    roomy = plan(spec, wl, Cluster(gpu=_cuda(4096), num_gpus=2), sharding="fsdp", fixed=ALL)
    assert roomy.fits and roomy.fsdp.defer_grad_sync is True
    frugal = FSDPConfig(**ALL)
    held = estimate(spec, wl, Cluster(gpu=_cuda(4096), num_gpus=2), frugal).peak_bytes
    each = estimate(
        spec, wl, Cluster(gpu=_cuda(4096), num_gpus=2), frugal.model_copy(update={"defer_grad_sync": False})
    ).peak_bytes
    assert each < held  # every unsharded fp32 gradient held between micro-batches
    tight = plan(spec, wl, Cluster(gpu=_cuda((held + each) / 2 / 0.95 / MIB), num_gpus=2), sharding="fsdp", fixed=ALL)
    assert tight.fits and tight.fsdp.defer_grad_sync is False
    assert "each micro-batch reduce-scatters" in tight.reasons()["defer_grad_sync"]


def test_parameter_offload_is_a_last_resort_where_generate_does_not_run(spec):
    # SFT and DPO have no rollout: cpu_offload may go as the last resort without a vLLM engine.
    wl = Workload(
        algorithm="sft",
        prompts_per_step=16,
        prompt_tokens=16,
        completion_tokens=16,
        full_finetune=True,
        weights_dtype="float32",
        micro_batch_size_per_gpu=1,
        logprob_chunk_size=256,
        gradient_checkpointing=True,
    )
    cluster = Cluster(gpu=_cuda(4096), num_gpus=2)
    need = estimate(spec, wl, cluster, FSDPConfig(**ALL, optim_cpu_offload=True, defer_grad_sync=False)).peak_bytes
    offloaded = estimate(spec, wl, cluster, FSDPConfig(**ALL, cpu_offload=True, defer_grad_sync=False)).peak_bytes
    assert offloaded < need
    p = plan(spec, wl, Cluster(gpu=_cuda((need + offloaded) / 2 / 0.95 / MIB), num_gpus=2), sharding="fsdp", fixed=ALL)
    assert p.fits and p.fsdp.cpu_offload is True
    grpo = plan(
        spec,
        wl.model_copy(update={"algorithm": "grpo", "group_size": 8, "generation": "hf"}),
        Cluster(gpu=_cuda((need + offloaded) / 2 / 0.95 / MIB), num_gpus=2),
        sharding="fsdp",
        fixed=ALL,
    )
    assert not grpo.fsdp.cpu_offload  # Hugging Face generate runs on the trainer's weights


def test_dpo_micro_batches_hold_whole_pairs(spec):
    wl = Workload(algorithm="dpo", prompts_per_step=4, prompt_tokens=16, completion_tokens=16)
    p = plan(spec, wl, Cluster(gpu=_gpu(4096), num_gpus=2))
    assert p.workload.micro_batch_size_per_gpu % 2 == 0
    with pytest.raises(ValueError, match="must be even"):
        plan(spec, wl.model_copy(update={"micro_batch_size_per_gpu": 1}), Cluster(gpu=_gpu(4096), num_gpus=2))
    # 4 pairs (8 sequences) over 8 GPUs: one sequence each would split every pair, which the trainer
    # refuses (each rank takes whole examples); before, plan() had no micro-batch to choose and crashed.
    with pytest.raises(ValueError, match="prompts_per_step = 4 preference pairs do not split over 8 ranks"):
        plan(spec, wl, Cluster(gpu=_gpu(4096), num_gpus=8))
    plan(spec, wl, Cluster(gpu=_gpu(4096), num_gpus=4))  # one pair per rank


def test_a_rollout_that_does_not_fit_gets_fewer_prompts_and_a_vllm_engine_suggested():
    from planner import catalog
    from planner.hardware import GPUS

    spec7b = catalog.load_spec("Qwen/Qwen2.5-7B")
    two = Cluster(gpu=GPUS["H100-80GB"], num_gpus=2)
    workload = Workload(prompts_per_step=64, group_size=8, completion_tokens=8192)  # generate's KV cache
    p = plan(spec7b, workload, two)
    assert not p.fits and p.estimate.peak_phase == "rollout"
    fewer = [s for s in p.suggestions if s.startswith("use prompts_per_step=")]
    assert fewer, p.suggestions
    prompts = int(fewer[0].split("=")[1].split()[0])
    assert 1 <= prompts < 64 and prompts * 8 % 2 == 0
    assert plan(spec7b, workload.model_copy(update={"prompts_per_step": prompts}), two).fits
    # the largest that fits: the next count a run can take does not (the manifest gives every GPU
    # whole prompts: a multiple of the 2 GPUs)
    assert not plan(spec7b, workload.model_copy(update={"prompts_per_step": prompts + 2}), two).fits
    assert "generate with a colocated vLLM engine (generation='vllm')" in p.suggestions
    assert plan(spec7b, workload.model_copy(update={"generation": "vllm"}), two).fits
    # however far over: the same largest count (a list of every smaller count ran out of memory)
    far = plan(spec7b, workload.model_copy(update={"prompts_per_step": 10**20}), two)
    assert f"use prompts_per_step={prompts} (fewer completions per rank)" in far.suggestions
    # a micro batch the user fixed takes only counts whose completions per GPU it divides (8
    # prompts of 2 for 16): between them the plan is refused, which a bisection must not meet
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    fixed = Workload(prompts_per_step=120, group_size=2, completion_tokens=4096, micro_batch_size_per_gpu=16)
    cut = [s for s in plan(spec7b, fixed, one).suggestions if s.startswith("use prompts_per_step=")]
    assert len(cut) == 1 and cut[0].endswith(" (fewer completions per rank)"), cut
    count = int(cut[0].split("=")[1].split()[0])
    assert count < 120 and count % 8 == 0  # 8 prompts of 2 fill the micro-batch of 16
    assert plan(spec7b, fixed.model_copy(update={"prompts_per_step": count}), one).fits
    assert not plan(spec7b, fixed.model_copy(update={"prompts_per_step": count + 8}), one).fits


def test_a_group_too_large_for_even_one_prompt_per_gpu_gets_a_smaller_group_suggested():
    """A group of 10**11 completions: no prompt count, GPU count or engine fits it, and the plan
    said "nothing nearby fits: a smaller model". The largest group that fits is suggested: a
    multiple of what splits over the GPUs and a fixed micro batch, at least 2 for GRPO."""
    from planner import catalog
    from planner.hardware import GPUS

    spec7b = catalog.load_spec("Qwen/Qwen2.5-7B")
    eight = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8)
    workload = Workload(prompts_per_step=8, group_size=10**11, completion_tokens=1024)
    p = plan(spec7b, workload, eight)
    cut = [s for s in p.suggestions if s.startswith("use group_size=")]
    assert len(cut) == 1 and cut[0].endswith(" (fewer completions per prompt)"), p.suggestions
    group = int(cut[0].split("=")[1].split()[0])
    assert 2 <= group < 10**11
    assert plan(spec7b, workload.model_copy(update={"group_size": group}), eight).fits
    assert not plan(spec7b, workload.model_copy(update={"group_size": group + 1}), eight).fits
    # one prompt per GPU in micro batches of 3 that the user fixed: a group must be a multiple of 3
    # (between them the plan is refused, which the bisection must not meet)
    fixed = workload.model_copy(update={"micro_batch_size_per_gpu": 3, "group_size": 3 * 10**10})
    step_cut = [s for s in plan(spec7b, fixed, eight).suggestions if s.startswith("use group_size=")]
    assert len(step_cut) == 1, step_cut
    fitted = int(step_cut[0].split("=")[1].split()[0])
    assert fitted % 3 == 0
    assert plan(spec7b, fixed.model_copy(update={"group_size": fitted}), eight).fits
    assert not plan(spec7b, fixed.model_copy(update={"group_size": fitted + 3}), eight).fits
    # DPO's two sequences per example are not a group to cut
    dpo = Workload(algorithm="dpo", prompts_per_step=8, prompt_tokens=4096, completion_tokens=4096)
    assert not any(
        s.startswith("use group_size=") for s in plan(spec7b, dpo, Cluster(gpu=_gpu(4096), num_gpus=8)).suggestions
    )


@pytest.mark.timeout(60)
def test_a_micro_batch_or_length_suggested_is_the_largest_that_fits_not_the_most_frugal():
    """A micro batch of 64 and checkpointing off on one H100: the micro batch suggested is the
    largest of 64's divisors that fits (it was the most frugal, 1, where 16 fits), and the
    completion length the longest that fits to an eighth of a power of two (it was the first
    halving that fit, 64 tokens, where 88 fits)."""
    from planner import catalog
    from planner.hardware import GPUS

    spec7b = catalog.load_spec("Qwen/Qwen2.5-7B")
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    workload = Workload(prompts_per_step=64, micro_batch_size_per_gpu=64, gradient_checkpointing=False)
    p = plan(spec7b, workload, one)
    assert not p.fits
    (micro_line,) = [s for s in p.suggestions if s.startswith("use micro_batch_size_per_gpu=")]
    micro = int(micro_line.split("=")[1])
    assert 1 < micro < 64 and 64 % micro == 0, p.suggestions
    assert plan(spec7b, workload.model_copy(update={"micro_batch_size_per_gpu": micro}), one).fits
    assert not plan(spec7b, workload.model_copy(update={"micro_batch_size_per_gpu": 2 * micro}), one).fits
    # a micro batch of 2**33 (the completions of 8 prompts of 2**30 each on one GPU): the micro
    # batches tried are its divisors, found to its square root; listed one by one up to it, they
    # hung the plan (the test's timeout)
    huge = Workload(prompts_per_step=8, group_size=2**30, micro_batch_size_per_gpu=2**33)
    assert not plan(spec7b, huge, one).fits
    (length_line,) = [s for s in p.suggestions if s.startswith("shorten completions to ")]
    length = int(length_line.split("completion_tokens=")[1].rstrip(")"))
    eighth = 2 ** (length.bit_length() - 1) // 8
    halving = next(
        n for n in (128, 64, 32, 16) if plan(spec7b, workload.model_copy(update={"completion_tokens": n}), one).fits
    )
    assert halving < length < 2 * halving, (halving, p.suggestions)  # longer than the first halving that fits
    assert plan(spec7b, workload.model_copy(update={"completion_tokens": length}), one).fits
    assert not plan(spec7b, workload.model_copy(update={"completion_tokens": length + eighth}), one).fits


def test_a_micro_batch_suggested_may_be_any_size_that_divides_the_completions_per_gpu():
    """48 completions on one H100 in micro batches of 16 (checkpointing off, 640 tokens): 12
    fits, and divides the 48 though not the 16 given (the sizes tried were 16's divisors: 8)."""
    from planner import catalog
    from planner.hardware import GPUS

    spec7b = catalog.load_spec("Qwen/Qwen2.5-7B")
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    workload = Workload(
        prompts_per_step=6,
        group_size=8,
        micro_batch_size_per_gpu=16,
        gradient_checkpointing=False,
        completion_tokens=640,
    )
    p = plan(spec7b, workload, one)
    assert not p.fits
    assert "use micro_batch_size_per_gpu=12" in p.suggestions, p.suggestions
    assert plan(spec7b, workload.model_copy(update={"micro_batch_size_per_gpu": 12}), one).fits


@pytest.mark.parametrize(
    "gpus, per_node, full, prompts, tp, fewest",
    [
        (1, None, False, 8, 1, 3),  # not a doubling: 2 GPUs do not fit, 4 was said where 3 fit
        (8, 8, True, 8, 1, 16),  # beyond a node, whole nodes only (9 to 15 GPUs are not two nodes of 8)
        (4, 4, True, 8, 1, 12),  # three nodes of 4, between the doublings 8 and 16
        (6, 8, True, 6, 1, 16),  # 12 is not whole nodes of 8: 16 is the next doubling that is
        (2, 6, True, 12, 1, 12),  # nodes of 6: the doublings past one node are whole nodes (no 8, 16, ...)
        (10, None, True, 20, 2, 12),  # tp=2 refuses odd counts: the bisection steps over them
    ],
)
def test_the_gpus_suggested_are_the_fewest_that_fit_not_the_next_doubling(gpus, per_node, full, prompts, tp, fewest):
    """Llama-3.1-70B on H100s: "use N GPUs" names the fewest a cluster of those nodes can have
    that fit, each count planned as given here, with the whole prompts per GPU the line names."""
    import re

    from planner import catalog
    from planner.hardware import GPUS

    spec70 = catalog.load_spec("meta-llama/Llama-3.1-70B")
    workload = Workload(full_finetune=full, prompts_per_step=prompts)
    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=gpus, gpus_per_node=per_node)
    fixed = {"tp": tp} if tp > 1 else {}
    p = plan(spec70, workload, cluster, fixed=fixed)
    assert not p.fits
    (line,) = [s for s in p.suggestions if s.startswith("use ") and " GPUs" in s]
    m = re.fullmatch(r"use (\d+) GPUs(?: \((\d+) nodes of (\d+)\))?(?: with prompts_per_step=(\d+))?", line)
    assert m, line
    count = int(m[1])
    assert count == fewest, p.suggestions

    def planned(n: int):
        per = min(per_node, n) if per_node else None
        whole = -(-prompts // n) * n  # whole prompts on every GPU
        return plan(
            spec70,
            workload.model_copy(update={"prompts_per_step": whole}),
            cluster.model_copy(update={"num_gpus": n, "gpus_per_node": per}),
            fixed=fixed,
        )

    assert planned(count).fits
    assert int(m[4] or prompts) == -(-prompts // count) * count
    # the next count down that such a cluster can have and tp divides does not fit
    smaller = next(
        n for n in range(count - 1, 0, -1) if n % tp == 0 and (not per_node or n <= per_node or n % per_node == 0)
    )
    assert not planned(smaller).fits, smaller


@pytest.mark.parametrize(
    "model, full, gpu, host_gib, per_node, fewest, refused",
    [
        # 2 GPUs do not hold the LoRA run, 3 do, and 4 or 8 on the node are over its host (each
        # rank's process takes its share): the doublings alone (2, 4, 8, ...) never fit
        ("meta-llama/Llama-3.1-70B", False, "H100-80GB", 16, None, 3, (4, 8)),
        ("meta-llama/Llama-3.1-70B", False, "H100-80GB", 16, 8, 3, (4, 8)),
        # 3 and 4 GPUs hold the full fine-tune with Adam on the host, which the host does not
        # take; 5 hold it with Adam on the GPUs
        ("meta-llama/Llama-3.1-8B", True, "A100-40GB", 128, 8, 5, (3, 4)),
    ],
)
def test_the_gpus_suggested_with_the_host_judged_are_the_fewest_its_nodes_hold(
    model, full, gpu, host_gib, per_node, fewest, refused
):
    """With the host memory given, "use N GPUs" names the fewest count whose GPUs and nodes'
    hosts both hold the run, though counts whose GPUs hold it are refused by the host below and
    above it; each count planned as given here."""
    from planner import catalog
    from planner.hardware import GIB, GPUS

    spec = catalog.load_spec(model)
    workload = Workload(full_finetune=full)
    cluster = Cluster(gpu=GPUS[gpu], num_gpus=1, gpus_per_node=per_node, host_memory_per_node_bytes=host_gib * GIB)

    def planned(n: int, host: bool = True):
        whole = -(-workload.prompts_per_step // n) * n  # whole prompts on every GPU
        update = {"num_gpus": n, "gpus_per_node": min(per_node, n) if per_node else None}
        if not host:
            update["host_memory_per_node_bytes"] = None
        return plan(spec, workload.model_copy(update={"prompts_per_step": whole}), cluster.model_copy(update=update))

    p = plan(spec, workload, cluster)
    assert not p.fits
    said = [s for s in p.suggestions if s.startswith("use ") and " GPUs" in s]
    whole = -(-workload.prompts_per_step // fewest) * fewest
    assert said == [f"use {fewest} GPUs with prompts_per_step={whole}"], p.suggestions
    assert planned(fewest).fits and not planned(fewest - 1).fits
    for count in refused:  # their GPUs hold it, their node's host does not
        assert planned(count, host=False).fits and not planned(count).fits, count


def test_a_calibration_with_no_process_term_still_names_the_gpus_with_the_host_judged():
    """A calibration file may fit a host process of 0 bytes (the coefficient's floor): the ranks a
    host holds are then not bounded by their processes, and the count is still named."""
    from planner import catalog
    from planner.hardware import GIB, GPUS
    from planner.memory import Coefficients

    spec70 = catalog.load_spec("meta-llama/Llama-3.1-70B")
    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1, host_memory_per_node_bytes=16 * GIB)
    p = plan(spec70, Workload(full_finetune=False), cluster, coefficients=Coefficients(host_process_bytes=0))
    assert not p.fits
    assert any(s.startswith("use ") and " GPUs" in s for s in p.suggestions), p.suggestions


@pytest.mark.parametrize(
    "model, fewer, over",
    [
        ("meta-llama/Llama-3.1-70B", 2, 4),  # a multiple of the GPUs (4) is over: each tp group takes 1
        ("Qwen/Qwen2.5-32B", 6, 8),  # 6 prompts split over the 2 groups, not over the 4 GPUs
    ],
)
def test_fewer_prompts_under_a_fixed_tp_split_over_its_groups_not_the_gpus(model, fewer, over):
    """16k-token completions on 4 H100s with tp=2: the prompts suggested are the most that fit
    among the counts whose manifest loads (whole prompts per tensor-parallel group), each
    planned as given here."""
    from planner import catalog
    from planner.hardware import GPUS
    from planner.request import PlanRequest

    spec = catalog.load_spec(model)
    workload = Workload(completion_tokens=16384, prompts_per_step=8)
    four = Cluster(gpu=GPUS["H100-80GB"], num_gpus=4)
    tp = {"tp": 2}
    p = plan(spec, workload, four, fixed=tp, sharding="fsdp")
    assert not p.fits
    assert f"use prompts_per_step={fewer} (fewer completions per rank)" in p.suggestions, p.suggestions
    fewer_workload = workload.model_copy(update={"prompts_per_step": fewer})
    assert plan(spec, fewer_workload, four, fixed=tp, sharding="fsdp").fits
    assert PlanRequest.build(four, fewer_workload, tp, sharding="fsdp").manifest_problem() is None
    over_workload = workload.model_copy(update={"prompts_per_step": over})
    assert not plan(spec, over_workload, four, fixed=tp, sharding="fsdp").fits


def test_fewer_prompts_are_not_suggested_when_one_prompt_per_rank_does_not_fit():
    from planner import catalog
    from planner.hardware import GPUS

    spec70 = catalog.load_spec("meta-llama/Llama-3.1-70B")
    one = Cluster(gpu=GPUS["L4"], num_gpus=1)
    p = plan(spec70, Workload(prompts_per_step=4, generation="none"), one)
    assert not p.fits
    assert not any(s.startswith("use prompts_per_step=") for s in p.suggestions), p.suggestions


def _applied(suggestion: str, workload: Workload, cluster: Cluster, sharding: str):
    """The run a "what would fit" line describes, as a user would give it."""
    import re

    wl, cl = {}, {}
    if m := re.fullmatch(r"use (\d+) GPUs(?: \(\d+ nodes of \d+\))?(?: with prompts_per_step=(\d+))?", suggestion):
        cl["num_gpus"] = int(m[1])
        if m[2]:
            wl["prompts_per_step"] = int(m[2])
    elif m := re.fullmatch(r"use (micro_batch_size_per_gpu|prompts_per_step|group_size)=(\d+).*", suggestion):
        wl[m[1]] = int(m[2])
    elif m := re.fullmatch(r"lower vllm_gpu_memory_utilization to ([\d.]+)", suggestion):
        wl["vllm_gpu_memory_utilization"] = float(m[1])
    elif m := re.fullmatch(r"lower vllm_kv_cache_memory_bytes to [\d.]+ GiB \((\d+)\)", suggestion):
        wl["vllm_kv_cache_memory_bytes"] = int(m[1])
    elif m := re.fullmatch(r"use a smaller LoRA rank \(lora_rank=(\d+)\)", suggestion):
        wl["lora_rank"] = int(m[1])
    elif m := re.fullmatch(r"shorten (?:completions|prompts) to \d+ tokens \((\w+_tokens)=(\d+)\)", suggestion):
        wl[m[1]] = int(m[2])
    elif suggestion.startswith("train LoRA adapters"):
        wl["full_finetune"] = False
    elif suggestion.startswith("use QLoRA"):
        wl["load_in_4bit"] = True
    elif suggestion.startswith("set offload_weights_during_rollout=True"):
        wl["offload_weights_during_rollout"] = True
    elif suggestion.startswith("generate with a colocated vLLM engine"):
        wl["generation"] = "vllm"
    elif m := re.fullmatch(
        r"generate with Hugging Face generate .*\(generation='hf'(?:, without ([\w, ]+))?\)", suggestion
    ):
        wl["generation"] = "hf"  # and the engine settings the line says to drop, back to their defaults
        for name in m[1].split(", ") if m[1] else ():
            wl[name] = Workload.model_fields[name].default
    elif m := re.fullmatch(r"generate on the trainer GPUs with .+ \(generation='(\w+)'\)", suggestion):
        wl["generation"] = m[1]
    elif suggestion.startswith("shard with FSDP2"):
        sharding = "fsdp"
    elif m := re.fullmatch(r"give each node at least (\d+) GiB of host memory \(--host-memory \1\)", suggestion):
        cl["host_memory_per_node_bytes"] = int(m[1]) * 2**30
    else:
        raise AssertionError(f"a suggestion no user could apply: {suggestion!r}")
    return workload.model_copy(update=wl), cluster.model_copy(update=cl), sharding


@pytest.mark.parametrize(
    "model, gpu, gpus, sharding, workload",
    [
        ("Qwen/Qwen2.5-7B", "H100-80GB", 2, "auto", dict(prompts_per_step=64, completion_tokens=8192)),
        ("meta-llama/Llama-3.1-70B", "H100-80GB", 8, "auto", dict(prompts_per_step=8, full_finetune=True)),
        (
            "meta-llama/Llama-3.1-70B",
            "L4",
            4,
            "auto",
            dict(prompts_per_step=16, completion_tokens=1024, load_in_4bit=True),
        ),
        (
            "meta-llama/Llama-3.1-8B",
            "H100-80GB",
            1,
            "auto",
            dict(algorithm="dpo", micro_batch_size_per_gpu=16, prompt_tokens=8192, completion_tokens=8192),
        ),
        (
            "Qwen/Qwen2.5-14B",
            "A100-40GB",
            2,
            "auto",
            dict(generation="vllm", vllm_gpu_memory_utilization=0.9, prompt_tokens=512),
        ),
        (
            "meta-llama/Llama-3.1-8B",
            "A100-40GB",
            2,
            "none",
            dict(prompts_per_step=8, full_finetune=True, generation="none"),
        ),
        # only without the engine (whose fraction of each GPU the trainer cannot share)
        ("meta-llama/Llama-3.1-70B", "H100-80GB", 16, "auto", dict(generation="vllm")),
        # a value the user fixed is what breaks the fit: the suggestion lowers it
        ("Qwen/Qwen2.5-0.5B", "H100-80GB", 1, "auto", dict(generation="vllm", vllm_kv_cache_memory_bytes=90 * 10**9)),
        ("Qwen/Qwen2.5-7B", "H100-80GB", 1, "auto", dict(lora_rank=3584, generation="none")),
        # the trainers fit; an engine rank of their own cannot hold the whole model
        ("meta-llama/Llama-3.1-70B", "H100-80GB", 8, "auto", dict(prompts_per_step=16, generation="none")),
    ],
)
def test_every_suggestion_when_applied_gives_a_plan_that_fits(model, gpu, gpus, sharding, workload):
    """What would fit is judged as the plan judges: each line, applied as the command line would
    take it (the same request checks, its defaults), plans a run that fits."""
    from planner import catalog
    from planner.choose import plan_request
    from planner.hardware import GPUS
    from planner.request import PlanRequest

    spec = catalog.load_spec(model)
    cluster = Cluster(gpu=GPUS[gpu], num_gpus=gpus)
    wl = Workload(**workload)
    p = plan_request(spec, PlanRequest.build(cluster, wl, sharding=sharding))
    assert not p.fits and p.suggestions and not p.suggestions[0].startswith("nothing nearby"), p.suggestions
    _every_suggestion_fits(spec, wl, cluster, p.suggestions, sharding)


@pytest.mark.parametrize(
    "model, gpus, per_node, workload, fixed, hsdp_reason",
    [
        # the plan chooses ep itself: HSDP is then not tried (they do not combine)
        (
            "mistralai/Mixtral-8x7B-v0.1",
            16,
            8,
            dict(prompts_per_step=64, prompt_tokens=512, completion_tokens=128),
            {},
            "ep=2",
        ),
        ("Qwen/Qwen3-30B-A3B", 16, 8, dict(prompts_per_step=16), {"ep": 2}, "ep=2"),
        ("meta-llama/Llama-3.1-8B", 32, 8, dict(prompts_per_step=32), {"tp": 2}, "tp=2"),
        ("meta-llama/Llama-3.1-8B", 16, 4, dict(prompts_per_step=32), {"tp": 4}, "tp=4"),
    ],
)
def test_multi_node_plans_never_try_hsdp_beside_expert_or_tensor_parallel(
    model, gpus, per_node, workload, fixed, hsdp_reason
):
    from planner import catalog
    from planner.hardware import GPUS

    gpu = GPUS["L4"] if model.startswith("mistralai") else GPUS["H100-80GB"]
    p = plan(
        catalog.load_spec(model),
        Workload(**workload),
        Cluster(gpu=gpu, num_gpus=gpus, gpus_per_node=per_node),
        fixed=fixed,
    )
    assert p.fsdp is not None and p.fsdp.shard_group_size is None
    assert p.reasons()["shard_group_size"] == f"HSDP does not combine with {hsdp_reason} yet: sharding across all GPUs"
    p.fsdp.check_world(gpus)  # a layout the runtime takes


def test_expert_parallel_is_not_tried_beside_a_fixed_tensor_parallel_degree():
    from planner import catalog
    from planner.hardware import GPUS

    spec = catalog.load_spec("Qwen/Qwen3-30B-A3B")
    p = plan(spec, Workload(prompts_per_step=64), Cluster(gpu=GPUS["L4"], num_gpus=8), fixed={"tp": 2})
    assert p.fsdp is not None and p.fsdp.ep == 1 and p.fsdp.tp == 2


def test_one_gpu_offloads_with_fsdp2_where_unsharded_does_not_fit():
    from planner import catalog
    from planner.hardware import GPUS

    spec8 = catalog.load_spec("meta-llama/Llama-3.1-8B")
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    workload = Workload(algorithm="sft", full_finetune=True)
    assert (
        estimate(spec8, workload.model_copy(update={"micro_batch_size_per_gpu": 1}), one, None).peak_bytes > 80 * 2**30
    )
    p = plan(spec8, workload, one)
    assert p.fits and p.fsdp is not None and (p.fsdp.optim_cpu_offload or p.fsdp.cpu_offload)
    assert "FSDP2 on one GPU, keeping the optimizer" in p.reasons()["sharding"]


def test_a_colocated_engine_whose_floor_is_above_the_planners_largest_fraction_gets_the_least_it_starts_with():
    from planner import catalog
    from planner.hardware import GPUS, with_memory

    spec8 = catalog.load_spec("meta-llama/Llama-3.1-8B")
    gpu = with_memory(GPUS["H100-80GB"], 17.25, "--gpu-memory")
    workload = Workload(generation="vllm", offload_weights_during_rollout=True, prompt_tokens=64, completion_tokens=64)
    p = plan(spec8, workload, Cluster(gpu=gpu, num_gpus=1), margin_fraction=0.01)
    chosen = p.workload.vllm_gpu_memory_utilization
    assert chosen is not None and chosen > 0.9
    # the engine starts with what was chosen, and not with a hundredth less
    assert check_inputs(spec8, p.workload, p.cluster) is None
    with pytest.raises(ValueError, match="give at least"):
        check_inputs(
            spec8, p.workload.model_copy(update={"vllm_gpu_memory_utilization": round(chosen - 0.01, 2)}), p.cluster
        )


def test_host_offload_is_no_last_resort_beside_offload_weights_during_rollout():
    """The trainer refuses FSDP2's cpu_offload with offload_weights_during_rollout (the weights
    would already be on the host): full fine-tuning Qwen2.5-32B on 2 H100s fits only by parking
    the parameters there, so with the flag it does not fit, rather than plan a run that stops."""
    from planner import catalog
    from planner.hardware import GPUS

    spec = catalog.load_spec("Qwen/Qwen2.5-32B")
    two = Cluster(gpu=GPUS["H100-80GB"], num_gpus=2)
    workload = Workload(generation="vllm", full_finetune=True)
    parked = plan(spec, workload, two)
    assert parked.fits and parked.fsdp is not None and parked.fsdp.cpu_offload
    flagged = plan(spec, workload.model_copy(update={"offload_weights_during_rollout": True}), two)
    assert flagged.fsdp is not None and not flagged.fsdp.cpu_offload and not flagged.fits


def test_a_margin_the_user_raised_is_what_would_fit_when_the_default_fits():
    """--margin 0.9 leaves 10% of an H100 for Qwen2.5-7B: nothing else changed, "what would fit"
    said only other changes; keeping the default margin is one, and it plans a run that fits."""
    from planner import catalog
    from planner.choose import plan_request
    from planner.hardware import GPUS, MARGIN_FRACTION
    from planner.request import PlanRequest

    spec = catalog.load_spec("Qwen/Qwen2.5-7B")
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    wl = Workload(generation="none")
    wide = plan_request(spec, PlanRequest.build(one, wl, margin_fraction=0.9))
    line = f"keep the default safety margin (margin_fraction={MARGIN_FRACTION}, --margin {MARGIN_FRACTION})"
    assert not wide.fits and line in wide.suggestions, wide.suggestions
    assert plan_request(spec, PlanRequest.build(one, wl, margin_fraction=MARGIN_FRACTION), suggest=False).fits
    # a margin at its default is never the thing to change
    long = Workload(prompts_per_step=64, group_size=8, completion_tokens=8192)
    over = plan_request(spec, PlanRequest.build(one, long))
    assert not over.fits and over.suggestions and not any("safety margin" in s for s in over.suggestions)


def test_a_colocated_engine_keeps_no_more_sequences_in_flight_than_its_token_budget_schedules():
    """vLLM refuses max_num_batched_tokens < max_num_seqs at start-up: a budget the user gives
    bounds the sequences the plan puts in flight."""
    from planner import catalog
    from planner.hardware import GPUS

    spec = catalog.load_spec("Qwen/Qwen2.5-0.5B")
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    p = plan(spec, Workload(generation="vllm", vllm_max_num_batched_tokens=16), one)
    assert p.workload.vllm_max_num_seqs == 16 < p.workload.completions_per_rank(1)
    assert "as many as vllm_max_num_batched_tokens=16 schedules" in p.reasons()["vllm_max_num_seqs"]
    from agilerl.utils.algo_utils import VLLMConfig

    VLLMConfig(**p.workload.vllm_settings())  # the manifest's engine starts
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is less than max_num_seqs=256"):
        VLLMConfig(max_num_batched_tokens=16)


def test_an_engine_rank_that_cannot_hold_the_model_makes_the_plan_not_fit():
    """generation='none' puts the rollout on engine ranks of their own, one per node, each with
    the whole model: a 70B in bf16 (about 131 GiB) fits no 80 GB GPU, however well the trainers
    shard. The plan says so (the trainers' own estimate fits), and its fix moves the rollout onto
    the trainer GPUs."""
    from planner.hardware import GPUS

    spec = load_model_spec("meta-llama/Llama-3.1-70B")
    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8)
    wl = Workload(prompts_per_step=16, generation="none")
    p = plan_with_engines(spec, wl, cluster)
    assert p.estimate.peak_bytes <= cluster.gpu.memory_bytes - p.margin_bytes  # the trainers fit
    assert not p.fits and p.engine_rank is not None and p.engine_rank_over
    assert p.engine_rank.components["weights"] == spec.total_params * 2 > cluster.gpu.memory_bytes
    reason = p.reasons()["fits"]
    assert reason.startswith("the trainers fit, but an engine rank of its own") and "128 completions" in reason
    assert "generate on the trainer GPUs with Hugging Face generate (generation='hf')" in p.suggestions
    # its limits: the trainers' GPUs (within) and the engine rank's (over), one rule for every output
    assert [(limit.what, limit.over) for limit in p.limits()] == [("gpu", False), ("engine_rank", True)]
    (over,) = p.over()
    assert over.need_bytes > spec.total_params * 2  # the whole model in bf16, and generate's cache
    assert abs(over.limit_bytes - 0.95 * cluster.gpu.memory_bytes) < 2  # the GPU less the 5% margin
    assert f"needs {over.need_bytes / 2**30:.2f} GiB on its GPU, over the 75.24 GiB available" in reason
    # the trainer ranks alone (engines the caller sizes elsewhere, as fsdp_config='auto' plans them)
    alone = plan(spec, wl, cluster)
    assert alone.fits and alone.engine_rank is None
    assert (alone.fsdp, alone.workload) == (p.fsdp, p.workload)  # nothing chosen for the trainers moves


def test_an_engine_rank_that_fits_is_reported_and_the_offline_objectives_have_none():
    """A 7B engine rank holds its 14 GiB of weights and generate's cache of its node's completions
    (two nodes: half the step's each): it fits, and the plan reports it; SFT has no rollout."""
    from planner.hardware import GPUS

    spec = load_model_spec("Qwen/Qwen2.5-7B")
    one_node = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8)
    two_nodes = Cluster(gpu=GPUS["H100-80GB"], num_gpus=16, gpus_per_node=8)
    wl = Workload(prompts_per_step=16, generation="none")
    one, two = plan_with_engines(spec, wl, one_node), plan_with_engines(spec, wl, two_nodes)
    assert one.fits and two.fits and one.engine_rank is not None and two.engine_rank is not None
    assert not one.engine_rank_over
    assert one.engine_rank.components["weights"] == two.engine_rank.components["weights"] == spec.total_params * 2
    assert two.engine_rank.components["kv_cache"] * 2 == one.engine_rank.components["kv_cache"]
    sft = plan_with_engines(spec, Workload(algorithm="sft", prompts_per_step=16, group_size=1), one_node)
    assert sft.engine_rank is None


@pytest.mark.parametrize(
    "targets, largest, usable",
    [
        # Qwen2.5-7B's config: hidden 3584, MLP 18944, 4 K/V heads of 128
        ("all-linear", 18944, 3584),
        (("k_proj", "v_proj"), 3584, 512),
    ],
)
def test_a_lora_rank_past_every_adapted_dimension_is_refused_in_one_line(targets, largest, usable):
    """A rank-r adapter of a d_in x d_out weight has rank at most min(d_in, d_out). A rank past
    every dimension of the adapted weights (a typo, 1e23) is refused, naming the most that helps,
    where it planned astronomically; up to the largest dimension it is the user's choice."""
    spec = load_model_spec("Qwen/Qwen2.5-7B", lora_targets=targets)
    cluster = Cluster(gpu=_gpu(80 * 1024), num_gpus=8)
    fine = Workload(lora_rank=largest, lora_targets=targets)
    check_inputs(spec, fine, cluster)
    for rank in (largest + 1, 10**23):
        with pytest.raises(ValueError, match=rf"lora_rank={rank} is more than .* give lora_rank <= {usable}$"):
            check_inputs(spec, fine.model_copy(update={"lora_rank": rank}), cluster)
    check_inputs(spec, Workload(lora_rank=10**23, full_finetune=True), cluster)  # no adapters: the rank is unused


def test_a_narrow_target_at_a_usual_rank_is_the_users_choice():
    """Mixtral's router maps 4096 to 8 experts: an adapter on it at the default rank 16 has rank
    8 at most, but PEFT builds it and it is no typo."""
    from planner.hardware import GPUS

    spec = load_model_spec("mistralai/Mixtral-8x7B-v0.1", lora_targets=("gate",))
    check_inputs(spec, Workload(lora_targets=("gate",)), Cluster(gpu=GPUS["H100-80GB"], num_gpus=8))


def test_the_host_memory_given_is_judged_and_what_would_fit_names_the_host_a_node_needs():
    """Llama-3.1-70B fully fine-tuned on two nodes of 8 H100s keeps Adam on the host, and rank 0
    gathers the whole saved checkpoint there: 16 bytes a parameter spread over a node's 8 ranks,
    and 12 more on rank 0's node. Not given, the host is reported, not judged; given, the plan
    fits only if the busiest node's host holds it, and its fix names the host that would."""
    import re

    from planner.hardware import GIB, GPUS

    spec = load_model_spec("meta-llama/Llama-3.1-70B")
    wl = Workload(full_finetune=True, prompts_per_step=16)
    nodes = Cluster(gpu=GPUS["H100-80GB"], num_gpus=16, gpus_per_node=8)
    unjudged = plan_with_engines(spec, wl, nodes)
    assert unjudged.fits and unjudged.host_limit_bytes is None and not unjudged.host_over
    assert unjudged.fsdp is not None and unjudged.fsdp.optim_cpu_offload
    # Adam's fp32 master, moments and gradient (16 B) of 8 ranks' shards, and rank 0's checkpoint
    assert unjudged.host_per_node_bytes > (16 * spec.total_params // 2 + 12 * spec.total_params) * 0.9
    roomy = plan_with_engines(spec, wl, nodes.model_copy(update={"host_memory_per_node_bytes": 2048 * GIB}))
    assert roomy.fits and (roomy.fsdp, roomy.workload) == (unjudged.fsdp, unjudged.workload)
    assert roomy.host_limit_bytes is not None and abs(roomy.host_limit_bytes - 0.95 * 2048 * GIB) < 2  # 5% kept back
    assert "of host memory on a node" in roomy.reasons()["fits"]
    tight = plan_with_engines(spec, wl, nodes.model_copy(update={"host_memory_per_node_bytes": 1024 * GIB}))
    assert not tight.fits and tight.host_over
    over = "of host memory on a node in phase save (rank 0 gathers the checkpoint), over the 972.80 GiB available"
    assert over in tight.reasons()["fits"]
    (need,) = [int(m[1]) for s in tight.suggestions if (m := re.fullmatch(r"give each node at least (\d+) GiB .*", s))]
    assert need * GIB * 0.95 >= unjudged.host_per_node_bytes > (need - 1) * GIB * 0.95
    fixed = plan_with_engines(spec, wl, nodes.model_copy(update={"host_memory_per_node_bytes": need * GIB}))
    assert fixed.fits and not fixed.host_over
    _every_suggestion_fits(spec, wl, tight.cluster, tight.suggestions)


def _every_suggestion_fits(spec, workload, cluster, suggestions, sharding="auto"):
    """Each suggestion, applied as the command line would take it, plans a run that fits."""
    from planner.choose import plan_request
    from planner.request import PlanRequest

    for suggestion in suggestions:
        changed, cl, how = _applied(suggestion, workload, cluster, sharding)
        fixed = plan_request(spec, PlanRequest.build(cl, changed, sharding=how), suggest=False)
        assert fixed.fits, (suggestion, fixed.reasons()["fits"])


def test_data_parallel_is_taken_only_where_the_host_holds_every_ranks_whole_model():
    """Data parallel loads the whole model on every rank, through its host: eight ranks of
    Qwen2.5-1.5B need more host than a 30 GiB node has, so the plan shards (each rank then loads
    its shard) and says the host is why; with the host not given, data parallel as before."""
    from planner.hardware import GIB, GPUS

    spec = load_model_spec("Qwen/Qwen2.5-1.5B")
    eight = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8)
    free = plan_with_engines(spec, Workload(), eight)
    assert free.fits and free.fsdp is None and free.host_per_node_bytes > 0.95 * 30 * GIB
    small = plan_with_engines(spec, Workload(), eight.model_copy(update={"host_memory_per_node_bytes": 30 * GIB}))
    assert small.fits and small.fsdp is not None and not small.host_over
    assert small.reasons()["sharding"].startswith("unsharded it needs ")
    # each rank's whole copy is on the host as it loads
    assert "GiB of host memory on a node in phase load, over the 28.50 GiB available" in small.reasons()["sharding"]
    # a host that holds no layout: the least whole GiB that does is named (FSDP2's, not data
    # parallel's: more host only adds choices)
    import re

    tiny = plan_with_engines(spec, Workload(), eight.model_copy(update={"host_memory_per_node_bytes": 15 * GIB}))
    assert not tiny.fits and tiny.host_over
    (need,) = [int(m[1]) for s in tiny.suggestions if (m := re.fullmatch(r"give each node at least (\d+) GiB .*", s))]
    assert need * GIB < 0.95 * free.host_per_node_bytes  # less than data parallel's
    for gib, fits in ((need, True), (need - 1, False)):
        again = plan_with_engines(spec, Workload(), eight.model_copy(update={"host_memory_per_node_bytes": gib * GIB}))
        assert again.fits == fits, gib


def test_a_one_gpu_plan_that_offloads_to_a_host_too_small_does_not_fit():
    """Llama-3.1-8B fully fine-tuned on one H100 fits only with FSDP2's offload to the host; on a
    node with too little host memory for what it parks there nothing fits, the plan says that the
    host is what is over, and each of its fixes fits."""
    from planner.hardware import GIB, GPUS

    spec8 = load_model_spec("meta-llama/Llama-3.1-8B")
    wl = Workload(algorithm="sft", full_finetune=True)
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1)
    free = plan_with_engines(spec8, wl, one)
    assert free.fits and free.fsdp is not None and (free.fsdp.optim_cpu_offload or free.fsdp.cpu_offload)
    small = plan_with_engines(spec8, wl, one.model_copy(update={"host_memory_per_node_bytes": 64 * GIB}))
    assert not small.fits and small.host_over
    # the plan reports the offloaded run, whose GPU fits: only its host is named as over
    assert small.fsdp is not None and small.estimate.peak_bytes <= one.gpu.memory_bytes - small.margin_bytes
    reason = small.reasons()["fits"]
    assert "of host memory on a node in phase save (rank 0 gathers the checkpoint), over the 60.80 GiB" in reason
    assert "per GPU" not in reason
    assert small.reasons()["sharding"].endswith(
        "FSDP2 keeping the optimizer (or the parameters) on the host comes nearer to fitting"
    )
    assert any(s.startswith("give each node at least") for s in small.suggestions), small.suggestions
    _every_suggestion_fits(spec8, wl, small.cluster, small.suggestions)


def test_one_gpu_shards_for_a_host_that_cannot_hold_the_whole_model_and_says_why():
    """On one GPU FSDP2 also loads the checkpoint a tensor at a time, where unsharded
    from_pretrained builds the whole model on the host: Qwen2.5-7B-Instruct (14.19 GiB of bf16
    weights) with a 12 GiB host fits only sharded, Adam still on the GPU, and the reason says that
    the load is why, not an offload the plan did not choose."""
    from planner.hardware import GIB, GPUS

    spec = load_model_spec("Qwen/Qwen2.5-7B-Instruct")
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=1, host_memory_per_node_bytes=12 * GIB)
    p = plan_with_engines(spec, Workload(), one)
    assert p.fits and p.fsdp is not None and not p.fsdp.optim_cpu_offload and not p.fsdp.cpu_offload
    assert p.host_per_node_bytes < spec.total_params * 2  # less than one copy of the weights
    reason = p.reasons()["sharding"]
    assert "of host memory on a node in phase load, over the 11.40 GiB available" in reason
    assert reason.endswith("FSDP2 on one GPU, loading the weights a tensor at a time through the host")


def test_a_linear_rope_scaling_stretches_the_positions_a_plan_may_use(tmp_path):
    """A config with 512 positions and a linear rope scaling of factor 2 takes 1024 tokens, as
    transformers computes them and vLLM reads them: 900 plan, 1100 are refused naming the factor
    (the refusal used to advise rope scaling that the check then ignored; it advises none now:
    a model may have one already, as Llama 3.1's and Gemma 3's do)."""
    import json

    from tests._configs import TINY_LLAMA

    config = {**TINY_LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}  # 512 positions
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_model_spec(str(tmp_path))
    one = Cluster(gpu=_gpu(4096), num_gpus=1)
    assert plan(spec, Workload(prompt_tokens=600, completion_tokens=300), one).fits
    assert plan(spec, Workload(generation="vllm", vllm_max_model_len=1024), one).workload.vllm_max_model_len == 1024
    with pytest.raises(ValueError) as err:
        plan(spec, Workload(prompt_tokens=800, completion_tokens=300), one)
    assert "1100 is longer than the 1024 positions of " in str(err.value)
    assert "(max_position_embeddings=512 x its rope scaling's factor 2)" in str(err.value)
    assert "needs rope scaling" not in str(err.value)
    with pytest.raises(ValueError, match="vllm_max_model_len=1025 is longer than the 1024 positions"):
        plan(spec, Workload(generation="vllm", vllm_max_model_len=1025), one)
