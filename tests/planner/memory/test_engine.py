"""planner.memory._engine: a rollout engine on a rank of its own, measured on the real engine."""

from __future__ import annotations

import pytest

from planner.hardware import CPU_DEVICE, GPUS, Cluster
from planner.workload import Workload

#: A tiny bf16 model whose generate holds a cache and logits of the size of its weights.
SIZES = dict(hidden_size=256, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=8, vocab_size=512)
PROMPT, COMPLETION = 8, 120


def _spec(kv_heads: int = SIZES["num_kv_heads"]):
    from planner.models import load_model_spec

    sizes = {**SIZES, "num_kv_heads": kv_heads}
    return load_model_spec("tiny:qwen2?" + "&".join(f"{k}={v}" for k, v in sizes.items()))


def _workload(prompts: int, group: int, **extra) -> Workload:
    return Workload(
        prompts_per_step=prompts, group_size=group, prompt_tokens=PROMPT, completion_tokens=COMPLETION,
        generation="none", weights_dtype="bfloat16", **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kv_heads, attention, padded",
    [
        (8, "sdpa", False),
        # grouped-query attention: a masked SDPA decode step packs the query's heads onto the K/V
        # heads (transformers >= 5.23; before, it repeated K and V), eager attention repeats them
        (2, "sdpa", True),
        (2, "eager", False),
    ],
)
def test_an_engine_ranks_memory_is_measured_on_the_real_engine(tmp_path, kv_heads, attention, padded):
    """Measured, not pinned: agilerl's own HFGenerateEngine, loaded from a saved model in bf16,
    generating one engine's share of a step with a live-tensor tracker, against the estimate of
    that engine rank on a CPU (its weights, the KV cache, sampling's logits and what a decode step
    repeats; no GPU overheads). One node of two trainer GPUs launches one engine for all 4 x 2
    completions; two nodes of two launch two, each generating half of 4 x 4: 8 rows both times.
    Padded rows are left-padded by 0-2 tokens, as the engine pads prompts of different lengths."""
    import torch

    from agilerl.utils.remote_engine import HFGenerateEngine
    from agilerl.utils.tiny import save_tiny_model
    from planner.memory import engine_completions, engine_rank_estimate
    from planner.probe.tracking import LiveBytes

    sizes = {**SIZES, "num_kv_heads": kv_heads}
    save_tiny_model(tmp_path / "model", "qwen2", **sizes)
    engine = HFGenerateEngine(str(tmp_path / "model"), dtype="bfloat16", attn_implementation=attention)
    state = engine.model.state_dict().values()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state}
    rows = 8
    torch.manual_seed(0)
    prompts = [
        torch.randint(3, SIZES["vocab_size"], (PROMPT - (i % 3 if padded else 0),)).tolist() for i in range(rows)
    ]
    live = LiveBytes(set(storages))
    with live:
        out = engine.generate(prompts, max_tokens=COMPLETION, temperature=1.0, seed=0)
    assert len(out) == rows and all(len(o) == COMPLETION for o in out)  # no stop token: every step ran
    measured = sum(storages.values()) + live.peak

    spec = _spec(kv_heads)
    extra = dict(attn_implementation=attention, padded_batches=padded)
    for workload, cluster in (
        (_workload(4, 2, **extra), Cluster(gpu=CPU_DEVICE, num_gpus=2)),
        (_workload(4, 4, **extra), Cluster(gpu=CPU_DEVICE, num_gpus=4, gpus_per_node=2)),
    ):
        assert engine_completions(workload, cluster) == rows
        est = engine_rank_estimate(spec, workload, cluster)
        assert est is not None
        assert est.components["weights"] == sum(storages.values())  # the whole model, in bf16
        assert abs(est.total - measured) <= 0.02 * measured, (est.components, measured)


def test_only_a_rollout_off_the_trainer_gpus_gets_engine_ranks():
    """Engine ranks come with generation 'none' for an objective with a rollout, one per node;
    a rollout on the trainers (hf, vllm) and the offline objectives launch none."""
    from planner.memory import engine_rank_count, engine_rank_estimate

    spec, two_nodes = _spec(), Cluster(gpu=CPU_DEVICE, num_gpus=4, gpus_per_node=2)
    assert engine_rank_count(_workload(4, 2), two_nodes) == 2
    assert engine_rank_count(_workload(4, 2, algorithm="ppo"), two_nodes) == 2
    for workload in (_workload(4, 2).model_copy(update={"generation": "hf"}), _workload(4, 1, algorithm="sft")):
        assert engine_rank_count(workload, two_nodes) == 0
        assert engine_rank_estimate(spec, workload, two_nodes) is None


def test_an_engine_rank_holds_the_whole_model_and_one_threads_workspaces():
    """The engine rank's weights are the model's own, unsharded, in the weights' dtype (counted
    here from the real model's tensors), QLoRA's trainers' too: they send dequantised merged
    weights. Its host builds the whole model before moving it. On a GPU one thread runs its
    matmuls (generate, no backward): half the cuBLAS workspaces a trainer's rollout holds, and
    nothing of the trainers' objective (a reference pass, more epochs) changes it."""
    import torch

    from agilerl.utils.tiny import tiny_model
    from planner.memory import engine_rank_estimate, estimate

    model = tiny_model("qwen2", **SIZES).to(torch.bfloat16)
    whole = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}.values()
    )
    spec, gpu = _spec(), GPUS["H100-80GB"]
    cluster = Cluster(gpu=gpu, num_gpus=8)
    plain = engine_rank_estimate(spec, _workload(8, 2), cluster)
    qlora = engine_rank_estimate(spec, _workload(8, 2, load_in_4bit=True), cluster)
    assert plain is not None and qlora is not None
    assert plain.components["weights"] == qlora.components["weights"] == whole
    assert plain.host["host_checkpoint"] == whole
    assert "lora" not in plain.components and "optimizer_state" not in plain.components
    assert plain.components["cuda_context"] == gpu.cuda_context_bytes
    assert "nccl_buffers" not in plain.components  # its GPU takes no NCCL collective
    trainer = estimate(spec, _workload(8, 2).model_copy(update={"generation": "hf"}), cluster, None)
    assert plain.components["cublas_workspace"] * 2 == trainer.phases["rollout"].components["cublas_workspace"]
    for other in (_workload(8, 2, beta=0.0), _workload(8, 2, update_epochs=2), _workload(8, 2, algorithm="ppo")):
        assert engine_rank_estimate(spec, other, cluster) == plain
    # more completions per engine, more cache
    more = engine_rank_estimate(spec, _workload(16, 2), cluster)
    assert more is not None and more.components["kv_cache"] > plain.components["kv_cache"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_takes_the_trainers_attention_and_dtype(tmp_path, dtype):
    """The engine loads the model in the manifest's dtype and attention (agilerl.train passes
    them): the estimate counts its generate in them."""
    from agilerl.utils.remote_engine import HFGenerateEngine
    from agilerl.utils.tiny import save_tiny_model

    save_tiny_model(tmp_path / "model", "qwen2", **SIZES)
    engine = HFGenerateEngine(str(tmp_path / "model"), dtype=dtype, attn_implementation="eager")
    assert engine.model.config._attn_implementation == "eager"
    assert {p.dtype for p in engine.model.parameters()} == {getattr(__import__("torch"), dtype)}


@pytest.mark.parametrize("gpus, per_node", [(8, None), (16, 8), (24, 8), (6, 2), (3, 1)])
def test_each_nodes_ranks_are_those_the_launch_gives_it(gpus, per_node):
    """node_ranks follows the launch: every node starts the manifest's ``--nproc-per-node`` ranks
    (planner.emit.launch_command), torchrun numbers them node by node, and the trainer's own
    RankLayout says which are engine ranks. On several nodes the trainers spill one rank a node
    past their GPUs, and the engine ranks fill the last node(s)."""
    from agilerl.manifest import RankLayout
    from planner.emit import launch_command
    from planner.memory import node_ranks

    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=gpus, gpus_per_node=per_node)
    for engines in (0, cluster.num_nodes):
        nproc = int(launch_command(cluster, engines).split("--nproc-per-node=")[1].split()[0])
        layout = RankLayout(members=1, trainers=gpus, engines=engines)
        expected = [
            (
                sum(not layout.of(r)[1] for r in range(node * nproc, (node + 1) * nproc)),
                sum(layout.of(r)[1] for r in range(node * nproc, (node + 1) * nproc)),
            )
            for node in range(cluster.num_nodes)
        ]
        assert node_ranks(cluster, engines) == expected
    if per_node == 8 and gpus == 24:  # spelled out once: 9 + 9 + 6 trainers, the 3 engines last
        assert node_ranks(cluster, 3) == [(9, 0), (9, 0), (6, 3)]


def test_a_nodes_host_holds_its_trainer_ranks_and_the_engine_ranks_on_it():
    """The busiest node's host: without engine ranks the trainers' per-node figure; on one node
    the engine rank's model load beside the trainers'; on three nodes of two GPUs the last node
    holds no trainer, only the three engine ranks, each loading the whole model."""
    from planner.memory import engine_rank_estimate, estimate, node_host_bytes

    spec = _spec()
    wl = _workload(12, 2)
    one = Cluster(gpu=GPUS["H100-80GB"], num_gpus=2)
    three = Cluster(gpu=GPUS["H100-80GB"], num_gpus=6, gpus_per_node=2)
    est_one, est_three = estimate(spec, wl, one, None), estimate(spec, wl, three, None)
    engine_one = engine_rank_estimate(spec, wl, one)
    engine_three = engine_rank_estimate(spec, wl, three)
    assert engine_one is not None and engine_three is not None
    assert node_host_bytes(est_one, wl, one, None) == est_one.host_per_node_bytes
    assert node_host_bytes(est_one, wl, one, engine_one) == est_one.host_per_node_bytes + engine_one.host_total
    # nodes of 3 ranks: 3 trainers (rank 0 among them), 3 trainers, then the 3 engine ranks
    assert node_host_bytes(est_three, wl, three, engine_three) == max(
        est_three.node_host_bytes(3), 3 * engine_three.host_total
    )
