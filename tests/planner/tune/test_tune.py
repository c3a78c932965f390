"""The tuner: its objective (FixedTrial, fake probes), storage, pruning by estimate, calibration,
output, and a few real tiny probes (resume after a kill, a crashed rank)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import optuna
import pytest

from agilerl.distributed import FSDPConfig
from planner.choose import plan
from planner.hardware import CPU_DEVICE, Cluster
from planner.memory import Coefficients, estimate
from planner.models import load_model_spec
from planner.probe import Measurement, ProbeRequest, RankMeasurement
from planner.request import PlanRequest
from planner.tune import (
    Objective,
    add_tune_arguments,
    grid,
    open_storage,
    probe_model,
    search_space,
    tune,
    tune_main,
)
from planner.workload import Workload
from tests._procs import interruptible

MODEL = "tiny:qwen2?hidden_size=64&intermediate_size=128&num_layers=2"
SMALL = Workload(
    prompts_per_step=2,
    group_size=2,
    prompt_tokens=8,
    completion_tokens=8,
    lora_rank=4,
    lora_alpha=8,
    weights_dtype="float32",
    attn_implementation="eager",
    generation="none",
)
SHARD_ALL = {"param_dtype": "float32", "param_persistence_threshold": 0}
KIB = 2**10
MIB = 2**20


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(MODEL)


def cpu_cluster(budget_bytes: int, num_gpus: int = 2, gpus_per_node: int | None = None) -> Cluster:
    return Cluster(
        gpu=CPU_DEVICE.model_copy(update={"memory_bytes": budget_bytes}), num_gpus=num_gpus, gpus_per_node=gpus_per_node
    )


class FakeProbe:
    """Measures what the estimate says times ``scale``; step time falls with the micro-batch."""

    def __init__(self, spec, cluster, *, scale=1.0, failure=None, oom=False):
        self.spec, self.cluster, self.scale, self.failure, self.oom = spec, cluster, scale, failure, oom
        self.requests: list[ProbeRequest] = []

    def __call__(self, request: ProbeRequest) -> Measurement:
        self.requests.append(request)
        if self.failure or self.oom:
            ranks = [
                RankMeasurement(
                    rank=0,
                    error="torch.OutOfMemoryError" if self.oom else "boom",
                    oom=self.oom,
                    oom_phase="learn" if self.oom else None,
                )
            ]
            return Measurement(
                request=request,
                ok=False,
                failure=self.failure or "rank 0: out of memory",
                oom=self.oom,
                oom_phase="learn" if self.oom else None,
                ranks=ranks,
            )
        est = estimate(self.spec, request.workload, self.cluster, request.fsdp)
        w = request.workload
        step = 0.1 / w.micro_batch_size_per_gpu + (0.05 if w.gradient_checkpointing else 0.0)
        phases = {
            ph: {"total": int(p.total * self.scale)}
            for ph, p in est.phases.items()
            if ph in ("load", "reference", "learn", "step")
        }
        ranks = [RankMeasurement(rank=r, phases=phases, step_seconds=[step, step, step]) for r in range(2)]
        return Measurement(request=request, ok=True, ranks=ranks)


def _small_run(spec, cluster) -> dict:
    """tune()'s arguments for SMALL on ``cluster``: in memory, seed 0, no calibration."""
    return dict(
        spec=spec,
        model=MODEL,
        request=PlanRequest(cluster, SMALL),
        coefficients=None,
        storage="memory",
        seed=0,
        calibration=False,
    )


def objective_for(spec, cluster, probe, *, fixed=None, sharding="auto", workload=SMALL, margin=0.05):
    space = search_space(spec, workload, cluster, fixed=dict(fixed or {}), sharding=sharding)
    request = ProbeRequest(
        model=MODEL,
        workload=workload,
        nproc=cluster.num_gpus,
        device="cpu",
        memory_budget_bytes=cluster.gpu.memory_bytes,
    )
    return Objective(
        space=space, spec=spec, cluster=cluster, coefficients=None, margin_fraction=margin, request=request, probe=probe
    )


# -- search space ----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_search_space_is_what_the_planner_chooses_less_what_the_user_fixed(spec):
    one_node = search_space(spec, SMALL, cpu_cluster(MIB), fixed={}, sharding="auto")
    assert set(one_node.searched) == {
        "sharding",
        "optim_cpu_offload",
        "reshard_after_forward",
        "wrap_every_n_blocks",
        "prefetch_units",
        "backward_prefetch_units",
        "micro_batch_size_per_gpu",
        "gradient_checkpointing",
    }
    assert one_node.choices["wrap_every_n_blocks"] == (1, 2)  # 2 layers: no 4-block units
    assert one_node.choices["micro_batch_size_per_gpu"] == (1, 2)  # 4 completions over 2 GPUs
    assert one_node.choices["shard_group_size"] == (None,)
    # 16 tokens a row, at most 2 rows a micro-batch: every chunk from 256 up runs all rows at once.
    assert one_node.choices["logprob_chunk_size"] == (256,)

    two_nodes = search_space(
        spec, SMALL.model_copy(update={"prompts_per_step": 4}), cpu_cluster(MIB, 4, 2), fixed={}, sharding="auto"
    )
    assert two_nodes.choices["shard_group_size"] == (None, 2)

    fixed = search_space(
        spec,
        SMALL.model_copy(update={"micro_batch_size_per_gpu": 1}),
        cpu_cluster(MIB),
        fixed={"reshard_after_forward": False, **SHARD_ALL},
        sharding="fsdp",
    )
    assert "reshard_after_forward" not in fixed.searched and "micro_batch_size_per_gpu" not in fixed.searched
    assert "sharding" not in fixed.searched
    candidate = fixed.candidate({"wrap_every_n_blocks": 2})
    assert candidate.fsdp.reshard_after_forward is False and candidate.fsdp.param_persistence_threshold == 0
    assert candidate.fsdp.wrap_every_n_blocks == 2 and candidate.workload.micro_batch_size_per_gpu == 1
    # Unsharded candidates carry no FSDP knobs: the grid does not multiply them.
    points = grid(one_node)
    assert sum(p["sharding"] == "none" for p in points) == 2 * 2
    assert sum(p["sharding"] == "fsdp" for p in points) == 2 * 2 * 2 * 2 * 2 * 2 * 2


@pytest.mark.timeout(60)
def test_qlora_is_searched_sharded_as_the_planner_plans_it(spec):
    """The trainer shards a 4-bit base with FSDP2 and the planner plans it so; the tuner searched
    QLoRA unsharded only, and refused sharding='fsdp'."""
    qlora = SMALL.model_copy(update={"load_in_4bit": True})
    assert search_space(spec, qlora, cpu_cluster(MIB), fixed={}, sharding="auto").choices["sharding"] == (
        "fsdp",
        "none",
    )
    sharded = search_space(spec, qlora, cpu_cluster(MIB), fixed={}, sharding="fsdp")
    assert sharded.choices["cpu_offload"] == (False,)  # the quantisation state stays on the device


@pytest.mark.timeout(60)
def test_full_finetuning_also_searches_parameter_offload_and_the_gradient_sync(spec):
    full = SMALL.model_copy(update={"full_finetune": True})
    space = search_space(spec, full, cpu_cluster(MIB), fixed={}, sharding="fsdp")
    assert space.choices["defer_grad_sync"] == (False, True)
    # GRPO's Hugging Face generate runs on the trainer's weights: no parameter offload
    assert space.choices["cpu_offload"] == (False,)
    sft = Workload.model_validate(
        {
            **full.model_dump(),
            "algorithm": "sft",
            "group_size": None,
            "beta": None,
            "generation": None,
            "update_epochs": 1,
        }
    )
    space = search_space(spec, sft, cpu_cluster(MIB), fixed={}, sharding="fsdp")
    assert space.choices["cpu_offload"] == (False, True) and "cpu_offload" in space.searched
    offloaded = space.candidate({"cpu_offload": True, "optim_cpu_offload": True})
    assert offloaded.fsdp.cpu_offload and not offloaded.fsdp.optim_cpu_offload  # the two are exclusive
    points = grid(space)
    assert not any(p.get("cpu_offload") and "optim_cpu_offload" in p for p in points)
    assert any(p.get("cpu_offload") for p in points) and any(p.get("defer_grad_sync") is False for p in points)
    # a LoRA run keeps both as they are
    lora = search_space(spec, SMALL, cpu_cluster(MIB), fixed={}, sharding="fsdp")
    assert lora.choices["cpu_offload"] == (False,) and lora.choices["defer_grad_sync"] == (True,)


@pytest.mark.timeout(120)
def test_a_vllm_runs_trials_roll_out_through_its_engine(spec):
    """The trials of a colocated-vLLM run start the engine and generate with it, as the run does
    (they generated nothing, so the engine's memory was never measured); with --skip-rollout
    there is no engine, and parameter offload, which the trainer refuses without one, is not
    searched (those trials crashed)."""
    from planner.tune._space import search_space

    vllm = SMALL.model_copy(update={"full_finetune": True, "generation": "vllm"})
    cluster = cpu_cluster(64 * MIB)
    common = dict(spec=spec, model=MODEL, coefficients=None, storage="memory", seed=0, calibration=False, confirm=0)
    with_engine = FakeProbe(spec, cluster)
    tune(**common, request=PlanRequest(cluster, vllm), max_trials=1, probe=with_engine)
    assert [r.generate for r in with_engine.requests] == [True]
    without = FakeProbe(spec, cluster)
    tune(**common, request=PlanRequest(cluster, vllm), max_trials=1, probe=without, generate=False)
    assert [r.generate for r in without.requests] == [False]
    assert search_space(spec, vllm, cluster, fixed={}, sharding="fsdp").choices["cpu_offload"] == (False, True)
    skipped = search_space(spec, vllm, cluster, fixed={}, sharding="fsdp", engine_in_trials=False)
    assert skipped.choices["cpu_offload"] == (False,)
    parked = vllm.model_copy(update={"offload_weights_during_rollout": True})  # the trainer refuses the pair
    assert search_space(spec, parked, cluster, fixed={}, sharding="fsdp").choices["cpu_offload"] == (False,)
    with pytest.raises(ValueError, match="needs the engine in the trials"):
        tune(
            **common,
            request=PlanRequest(cluster, vllm, {"cpu_offload": True}),
            max_trials=1,
            probe=FakeProbe(spec, cluster),
            generate=False,
        )


# -- the objective, with FixedTrial ----------------------------------------------------------------
@pytest.mark.timeout(60)
def test_moe_search_space_adds_expert_parallel_and_the_expert_chunk():
    from planner.tune._space import grid, suggest_candidate

    moe = load_model_spec("tiny:qwen3_moe?hidden_size=64&moe_intermediate_size=256&num_experts=4&num_layers=2")
    wl = SMALL.model_copy(update={"prompts_per_step": 8, "prompt_tokens": 256, "completion_tokens": 256})
    one_node = search_space(moe, wl, cpu_cluster(MIB, 4), fixed={}, sharding="fsdp")
    assert "ep" in one_node.searched
    assert one_node.choices["ep"] == (1, 2, 4)  # divides the 4 GPUs and the 4 experts
    # 4 completions x 512 tokens x 2 experts x 1 KiB bf16 rows = 4 MiB routed: 64 MiB holds them all.
    assert one_node.choices["routed_expert_chunk_mib"] == (64,)
    long = wl.model_copy(update={"prompt_tokens": 8192, "completion_tokens": 8192})  # 128 MiB routed
    assert search_space(moe, long, cpu_cluster(MIB, 4), fixed={}, sharding="fsdp").choices[
        "routed_expert_chunk_mib"
    ] == (64, 128)
    dense = search_space(load_model_spec(MODEL), SMALL, cpu_cluster(MIB), fixed={}, sharding="fsdp")
    assert "ep" not in dense.searched and dense.choices["routed_expert_chunk_mib"] == (None,)
    assert "ep" not in dense.candidate({}).knobs()  # dense tables keep their columns

    two_nodes = search_space(moe, wl, cpu_cluster(MIB, 4, 2), fixed={}, sharding="fsdp")
    assert two_nodes.choices["ep"] == (1, 2)  # all-to-alls stay inside a node
    params = grid(two_nodes)
    assert not any(p.get("ep", 1) > 1 and p.get("shard_group_size") for p in params)  # no EP with HSDP
    assert any(p.get("ep") == 2 for p in params) and any(p.get("shard_group_size") == 2 for p in params)

    class Trial:  # suggests the last value of every knob but tp (which excludes ep)
        def suggest_categorical(self, name, choices):
            return 1 if name == "tp" else choices[-1]

    c = suggest_candidate(Trial(), two_nodes)
    assert c.fsdp.ep == 2 and c.fsdp.shard_group_size is None
    assert c.knobs()["ep"] == 2
    fixed = search_space(moe, wl, cpu_cluster(MIB, 4), fixed={"ep": 2, "routed_expert_chunk_mib": 8}, sharding="fsdp")
    assert "ep" not in fixed.searched and fixed.candidate({}).fsdp.routed_expert_chunk_mib == 8
    assert fixed.choices["tp"] == (1,)  # expert parallel is not combined with tensor parallel


@pytest.mark.timeout(60)
def test_moe_search_space_adds_tensor_parallel_for_the_attention():
    from planner.tune._space import grid, plan_params, suggest_candidate

    # 4 heads, 2 KV heads: tp 1 or 2 of the 4 GPUs; the experts stay whole, so their width does not matter.
    moe = load_model_spec("tiny:qwen3_moe?hidden_size=64&moe_intermediate_size=24&num_experts=4&num_layers=2")
    wl = SMALL.model_copy(update={"prompts_per_step": 8})
    space = search_space(moe, wl, cpu_cluster(MIB, 4), fixed={}, sharding="fsdp")
    assert space.choices["tp"] == (1, 2) and "tp" in space.searched
    params = grid(space)
    assert any(p.get("tp") == 2 for p in params)
    assert not any(p.get("tp") == 2 and ("ep" in p or "shard_group_size" in p) for p in params)

    class Trial:  # suggests the last value of every knob
        def suggest_categorical(self, name, choices):
            return choices[-1]

    c = suggest_candidate(Trial(), space)
    assert c.fsdp.tp == 2 and c.fsdp.ep == 1 and c.knobs()["tp"] == 2
    est = estimate(moe, c.workload, cpu_cluster(MIB, 4), c.fsdp)  # the estimate takes every candidate
    assert est.peak_bytes > 0
    picked = plan(moe, wl, cpu_cluster(2**40, 4), fixed={}, sharding="fsdp")
    assert plan_params(space, picked) is not None and picked.fsdp.tp == 1  # the planner leaves tp at 1
    assert search_space(moe, wl, cpu_cluster(MIB, 4), fixed={"tp": 2}, sharding="fsdp").choices["tp"] == (2,)
    dense = search_space(load_model_spec(MODEL), SMALL, cpu_cluster(MIB), fixed={}, sharding="fsdp")
    assert "tp" not in dense.searched and "tp" not in dense.candidate({}).knobs()


@pytest.mark.timeout(60)
def test_objective_measures_a_candidate_and_reports_tokens_per_second(spec):
    cluster = cpu_cluster(64 * MIB)
    probe = FakeProbe(spec, cluster)
    objective = objective_for(spec, cluster, probe, fixed=SHARD_ALL)
    params = {
        "sharding": "fsdp",
        "optim_cpu_offload": False,
        "reshard_after_forward": False,
        "wrap_every_n_blocks": 2,
        "prefetch_units": 2,
        "backward_prefetch_units": 1,
        "micro_batch_size_per_gpu": 2,
        "gradient_checkpointing": False,
    }
    trial = optuna.trial.FixedTrial(params)
    value = objective(trial)
    [request] = probe.requests
    assert request.fsdp.wrap_every_n_blocks == 2 and request.fsdp.reshard_after_forward is False
    assert request.fsdp.param_persistence_threshold == 0 and request.nproc == 2
    assert request.workload.micro_batch_size_per_gpu == 2 and request.workload.gradient_checkpointing is False
    assert value == pytest.approx(SMALL.completions_per_step * SMALL.sequence_tokens / 0.05)
    assert trial.user_attrs["status"] == "fits" and trial.user_attrs["launched"]
    assert trial.user_attrs["constraint"] < 0 and trial.constraints["memory"] < 0


@pytest.mark.timeout(60)
def test_a_candidate_the_estimate_rejects_is_never_launched(spec):
    params = {"sharding": "none", "micro_batch_size_per_gpu": 2, "gradient_checkpointing": False}
    peak = estimate(
        spec,
        SMALL.model_copy(
            update={"micro_batch_size_per_gpu": 2, "gradient_checkpointing": False, "logprob_chunk_size": 256}
        ),
        cpu_cluster(MIB),
        None,
    ).peak_bytes
    cluster = cpu_cluster(peak - 1)
    probe = FakeProbe(spec, cluster)
    trial = optuna.trial.FixedTrial(params)
    assert objective_for(spec, cluster, probe)(trial) == 0.0
    assert probe.requests == []
    assert trial.user_attrs["status"] == "rejected" and not trial.user_attrs["launched"]
    assert trial.user_attrs["constraint"] > 0 and "not launched" in trial.user_attrs["why"]


@pytest.mark.timeout(60)
def test_a_candidate_whose_nodes_host_the_estimate_rejects_is_never_launched(spec):
    """A trial measures the GPU; the host of the run's nodes is the estimate's alone. Where the
    host memory is given, a candidate whose busiest node's host is over its limit is rejected
    before launch (and the tuner's enumeration does not admit it); with room, it launches."""
    from planner.tune._space import suggest_candidate

    params = {"sharding": "none", "micro_batch_size_per_gpu": 2, "gradient_checkpointing": False}
    roomy_gpu = cpu_cluster(64 * 2**30)
    workload = SMALL.model_copy(
        update={"micro_batch_size_per_gpu": 2, "gradient_checkpointing": False, "logprob_chunk_size": 256}
    )
    node = estimate(spec, workload, roomy_gpu, None).host_per_node_bytes
    assert node > 0
    for host, launched in ((node // 2, False), (2 * node, True)):
        cluster = roomy_gpu.model_copy(update={"host_memory_per_node_bytes": host})
        probe = FakeProbe(spec, cluster)
        trial = optuna.trial.FixedTrial(params)
        objective = objective_for(spec, cluster, probe)
        objective(trial)
        assert bool(probe.requests) == launched == trial.user_attrs["launched"]
        assert objective.admits(suggest_candidate(optuna.trial.FixedTrial(params), objective.space)) == launched
        if not launched:
            assert trial.user_attrs["status"] == "rejected" and trial.user_attrs["constraint"] > 0
            assert (
                "of host memory on a node in phase load, over the" in trial.user_attrs["why"]
            )  # the load: each whole copy
            assert trial.user_attrs["why"].endswith("not launched")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["oom", "crashed", "over_budget"])
def test_an_oom_crash_or_overrun_is_an_infeasible_trial_not_an_error(spec, kind):
    cluster = cpu_cluster(64 * MIB)
    probe = {
        "oom": FakeProbe(spec, cluster, oom=True),
        "crashed": FakeProbe(spec, cluster, failure="rank 1: killed (signal 9)"),
        "over_budget": FakeProbe(spec, cluster, scale=200.0),
    }[kind]
    trial = optuna.trial.FixedTrial({"sharding": "none", "micro_batch_size_per_gpu": 1, "gradient_checkpointing": True})
    value = objective_for(spec, cluster, probe)(trial)
    assert len(probe.requests) == 1 and trial.user_attrs["launched"]
    assert trial.user_attrs["status"] == kind and trial.user_attrs["constraint"] > 0
    if kind == "over_budget":
        assert value > 0 and "over the" in trial.user_attrs["why"]
    else:
        assert value == 0.0 and trial.user_attrs["constraint"] == 1.0
        assert ("learn" if kind == "oom" else "killed") in trial.user_attrs["why"]


# -- storage ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_storage_urls(tmp_path):
    from planner.tune._storage import storage_url

    assert storage_url(str(tmp_path / "t.db")) == f"sqlite:///{tmp_path / 't.db'}"
    assert storage_url(None).startswith("sqlite:///") and storage_url(None).endswith("/agilerl-tune.db")
    assert storage_url("memory") is None and storage_url(":memory:") is None
    assert (
        storage_url("postgresql://tuner:secret@db.internal:5432/studies")
        == "postgresql://tuner:secret@db.internal:5432/studies"
    )
    assert isinstance(open_storage("memory"), optuna.storages.InMemoryStorage)
    rdb = open_storage(str(tmp_path / "t.db"), heartbeat_interval_s=2)
    assert isinstance(rdb, optuna.storages.RDBStorage) and rdb.heartbeat_interval == 2 and rdb.grace_period == 6
    for bad, message in [
        ("postgresql:/tuner@host/db", "looks like a URL"),
        ("://nothing", "not a valid SQLAlchemy URL"),
        (str(tmp_path / "missing" / "t.db"), "does not exist"),
        (str(tmp_path), "is a directory"),
        ("", "is empty"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            storage_url(bad)
        assert str(err.value).startswith("--storage")
    # A URL whose driver is missing is a clear error, with the password hidden.
    with pytest.raises(ValueError) as err:
        open_storage("postgresql+nosuchdriver://tuner:secret@localhost/studies")
    assert "secret" not in str(err.value) and "***" in str(err.value)
    # Another program's SQLite database is refused as it is (Optuna's tables were added first),
    # and the study just made reopens.
    import sqlite3

    # A name with URL characters is that file, not one SQLAlchemy reads into it.
    apps = tmp_path / "apps"
    apps.mkdir()
    for name in ("app.db", "a?b#c%20d.db"):
        other = apps / name
        with contextlib.closing(sqlite3.connect(other)) as db:
            db.execute("CREATE TABLE users (name TEXT)")
            db.commit()
        before = other.read_bytes()
        with pytest.raises(ValueError, match="a SQLite database of something else"):
            open_storage(str(other))
        assert other.read_bytes() == before
    assert sorted(p.name for p in apps.iterdir()) == ["a?b#c%20d.db", "app.db"]  # nothing made beside them
    assert isinstance(open_storage(str(tmp_path / "t.db")), optuna.storages.RDBStorage)


@pytest.mark.timeout(60)
def test_orphans_of_a_dead_tuner_are_killed_and_live_ones_kept():
    from planner.tune._storage import OWNER_ENV, kill_orphans

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    orphan = subprocess.Popen(
        ["sleep", "60"], env={**os.environ, OWNER_ENV: f"{host}:{dead.pid}"}, start_new_session=True
    )
    kept = subprocess.Popen(["sleep", "60"], env={**os.environ, OWNER_ENV: f"{host}:{os.getpid()}"})
    try:
        time.sleep(0.2)
        killed = kill_orphans()
        assert orphan.pid in killed and kept.pid not in killed
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert kept.poll() is None
    finally:
        for p in (orphan, kept):
            if p.poll() is None:
                p.kill()
                p.wait()


# -- the study, with a fake probe ------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_study_seeds_the_planner_pick_prunes_by_estimate_and_keeps_the_constraint(spec):
    # The smallest budget, among the candidates' estimates, at which the planner still has a pick:
    # every candidate estimated above it cannot be launched, and the sampler meets some of them.
    cluster = cpu_cluster(64 * MIB)
    space = search_space(spec, SMALL, cluster, fixed=SHARD_ALL, sharding="auto")
    peaks = sorted(
        {estimate(spec, space.candidate(p).workload, cluster, space.candidate(p).fsdp).peak_bytes for p in grid(space)}
    )
    low, high = 0, len(peaks) - 1
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if plan(spec, SMALL, cpu_cluster(peaks[mid]), fixed=SHARD_ALL).fits else (mid + 1, high)
    above = len(peaks) - 1 - low
    assert above >= len(peaks) // 3, "a third of the candidates should be estimated above the planner's pick"
    cluster = cpu_cluster(peaks[low])
    probe = FakeProbe(spec, cluster)
    result = tune(
        spec=spec,
        model=MODEL,
        request=PlanRequest(cluster, SMALL, SHARD_ALL),
        coefficients=None,
        storage="memory",
        max_trials=6,
        probe=probe,
        seed=3,
        calibration=False,
        confirm=0,
    )
    trials = result.trials
    picked = plan(spec, SMALL, cluster, fixed=SHARD_ALL)
    first = trials[0]
    assert first.user_attrs["source"] == "planner"
    assert first.user_attrs["knobs"]["micro_batch_size_per_gpu"] == picked.workload.micro_batch_size_per_gpu
    assert first.user_attrs["knobs"]["sharding"] == ("fsdp" if picked.fsdp else "none")
    launched = [t for t in trials if t.user_attrs["launched"]]
    rejected = [t for t in trials if t.user_attrs["status"] == "rejected"]
    assert rejected, "the budget should leave some candidates to the estimate"
    assert len(probe.requests) == len(launched) <= 6
    for t in rejected:
        assert t.user_attrs["estimated_peak_bytes"] > cluster.gpu.memory_bytes
        assert t.constraints["memory"] > 0 and t.state == optuna.trial.TrialState.COMPLETE
    launched_keys = {
        json.dumps(
            {
                "fsdp": r.fsdp.model_dump(mode="json") if r.fsdp else None,
                "workload": r.workload.model_dump(mode="json"),
            },
            sort_keys=True,
        )
        for r in probe.requests
    }
    assert launched_keys.isdisjoint({t.user_attrs["key"] for t in rejected})
    assert len(launched_keys) == len(probe.requests)  # nothing measured twice
    best = result.best
    assert best is not None and best.user_attrs["status"] == "fits"
    assert best.user_attrs["tokens_per_second"] == max(
        t.user_attrs["tokens_per_second"] for t in launched if t.user_attrs["status"] == "fits"
    )
    assert (
        result.best_plan.fits
        and result.best_plan.workload.micro_batch_size_per_gpu == best.user_attrs["knobs"]["micro_batch_size_per_gpu"]
    )


@pytest.mark.timeout(120)
def test_a_resumed_study_does_not_rerun_finished_trials_and_fails_stale_ones(spec, tmp_path):
    cluster = cpu_cluster(64 * MIB)
    storage = str(tmp_path / "study.db")
    common = dict(
        spec=spec,
        model=MODEL,
        request=PlanRequest(cluster, SMALL, SHARD_ALL),
        coefficients=None,
        storage=storage,
        study_name="resume",
        seed=0,
        calibration=False,
        heartbeat_interval_s=1,
        confirm=0,
    )
    first = FakeProbe(spec, cluster)
    tune(**common, max_trials=2, probe=first)
    assert len(first.requests) == 2
    # A tuner that died mid-trial: a RUNNING trial whose heartbeat stopped.
    store = open_storage(storage, heartbeat_interval_s=1)
    study = optuna.load_study(study_name="resume", storage=store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Heartbeat ... supposed to be used with Study.optimize"
        dead = study.ask()
    store.record_heartbeat(dead._trial_id)
    time.sleep(4.5)  # past the grace period (3 intervals; SQLite's clock counts whole seconds)
    second = FakeProbe(spec, cluster)
    result = tune(**common, max_trials=4, probe=second)
    assert len(second.requests) == 2  # only the two trials still missing
    seen = {
        json.dumps(
            {
                "fsdp": r.fsdp.model_dump(mode="json") if r.fsdp else None,
                "workload": r.workload.model_dump(mode="json"),
            },
            sort_keys=True,
        )
        for r in first.requests + second.requests
    }
    assert len(seen) == 4
    states = {t.number: t.state for t in result.trials}
    assert states[dead.number] == optuna.trial.TrialState.FAIL
    assert result.num_launched == 4


@pytest.mark.timeout(120)
def test_a_save_no_trial_writes_is_judged_by_its_estimate(spec):
    """Full fine-tuning on one device: the estimate's save phase (the whole state gathered to be
    written) is its peak, which no trial measures. With a 2.4 MiB budget less 10% (2.16 MiB) the
    measured phases fit and the save's estimate does not: not a fit, where the trial was one."""
    cluster = cpu_cluster(int(2.4 * MIB), num_gpus=1)
    workload = SMALL.model_copy(
        update={
            "full_finetune": True,
            "micro_batch_size_per_gpu": 1,
            "logprob_chunk_size": 256,
            "gradient_checkpointing": False,
        }
    )
    est = estimate(spec, workload, cluster, None)
    assert est.peak_phase == "save" and 2.16 * MIB < est.peak_bytes <= 2.4 * MIB
    assert max(p.total for name, p in est.phases.items() if name != "save") < 2.16 * MIB
    result = tune(
        spec=spec,
        model=MODEL,
        request=PlanRequest(cluster, workload, sharding="none", margin_fraction=0.1),
        coefficients=None,
        storage="memory",
        max_trials=1,
        probe=FakeProbe(spec, cluster),
        seed=0,
        calibration=False,
        confirm=0,
    )
    (trial,) = [t for t in result.trials if t.user_attrs.get("launched")]
    assert trial.user_attrs["status"] == "over_budget", trial.user_attrs
    assert trial.user_attrs["why"].startswith("estimated save phase"), trial.user_attrs["why"]
    assert result.best is None


def test_a_derived_study_name_is_another_runs_for_every_difference_the_study_refuses(spec, tmp_path):
    """Without --study-name the name digests all a study is checked against: another
    --timed-steps or another model spec gets a study of its own, where it was refused with the
    advice to leave --study-name out, which it was."""
    cluster = cpu_cluster(64 * MIB)
    common = dict(model=MODEL, coefficients=None, storage=str(tmp_path / "study.db"), seed=0, calibration=False)
    request = PlanRequest(cluster, SMALL, SHARD_ALL)
    names = set()
    for other in (
        {},
        {"timed_steps": 2},
        {"spec": load_model_spec("tiny:qwen2?hidden_size=64&intermediate_size=128&num_layers=3")},
    ):
        kwargs = {"spec": spec, "timed_steps": 1, **other}
        probe = FakeProbe(kwargs["spec"], cluster)
        names.add(tune(**common, **kwargs, request=request, max_trials=1, probe=probe, confirm=0).study_name)
        assert len(probe.requests) == 1
    assert len(names) == 3


def test_a_study_refuses_to_resume_for_another_run(spec, tmp_path, monkeypatch):
    cluster = cpu_cluster(64 * MIB)
    storage = str(tmp_path / "study.db")
    common = dict(
        spec=spec,
        model=MODEL,
        coefficients=None,
        storage=storage,
        study_name="named",
        seed=0,
        calibration=False,
        confirm=0,
    )
    request = PlanRequest(cluster, SMALL, SHARD_ALL)
    first = FakeProbe(spec, cluster)
    tune(**common, request=request, max_trials=1, probe=first)
    other = FakeProbe(spec, cluster)
    longer = PlanRequest(cluster, SMALL.model_copy(update={"prompt_tokens": 16}), SHARD_ALL)
    with pytest.raises(ValueError, match=r"built for another run.*workload\.prompt_tokens \(8 in the study, 16 now\)"):
        tune(**common, request=longer, max_trials=2, probe=other)
    other_spec = load_model_spec("tiny:qwen2?hidden_size=64&intermediate_size=128&num_layers=3")
    with pytest.raises(ValueError, match=r"built for another run.*spec"):
        tune(**{**common, "spec": other_spec}, request=request, max_trials=2, probe=other)
    with pytest.raises(ValueError, match=r"cluster\.gpu\.memory_bytes"):
        tune(**common, request=request.with_cluster(cpu_cluster(32 * MIB)), max_trials=2, probe=other)
    assert other.requests == []  # nothing launched for the wrong run
    tune(**common, request=request, max_trials=2, probe=other)  # the same run resumes
    assert len(other.requests) == 1
    installed = importlib.metadata.version("torch")
    real_version = importlib.metadata.version
    with monkeypatch.context() as patched:  # the same run under another torch: its trials are not this one's
        patched.setattr(importlib.metadata, "version", lambda n: "9.9.9" if n == "torch" else real_version(n))
        named = rf"software\.torch \('{re.escape(installed)}' in the study, '9\.9\.9' now\)"
        with pytest.raises(ValueError, match=named):
            tune(**common, request=request, max_trials=3, probe=other)
    assert len(other.requests) == 1
    with pytest.raises(ValueError, match="--storage is empty"):
        tune(**{**common, "storage": ""}, request=request, max_trials=1, probe=other)


def test_a_study_fingerprinted_before_versions_were_recorded_names_each_version_it_lacks(spec, tmp_path):
    cluster = cpu_cluster(64 * MIB)
    storage = str(tmp_path / "study.db")
    common = dict(spec=spec, model=MODEL, coefficients=None, storage=storage, study_name="old", seed=0)
    request = PlanRequest(cluster, SMALL, SHARD_ALL)
    tune(**common, request=request, max_trials=1, probe=FakeProbe(spec, cluster), calibration=False, confirm=0)
    from planner.tune._study import FINGERPRINT_KEY

    study = optuna.load_study(study_name="old", storage=f"sqlite:///{storage}")
    recorded = dict(study.user_attrs[FINGERPRINT_KEY])
    assert recorded["software"]["torch"] == importlib.metadata.version("torch")
    del recorded["software"]
    study.set_user_attr(FINGERPRINT_KEY, recorded)
    later = FakeProbe(spec, cluster)
    with pytest.raises(ValueError, match=r"software\.peft \(None in the study, '[^']+' now\); software\.torch"):
        tune(**common, request=request, max_trials=2, probe=later, calibration=False, confirm=0)
    assert later.requests == []


def test_a_study_run_from_a_checkout_records_its_commit_and_another_commit_does_not_resume(spec, tmp_path, monkeypatch):
    """An editable install reports the version it was installed with whatever the code; run from
    a git checkout (as the tests are), the study records the commit too, and a study measured at
    another commit is not resumed."""
    import subprocess
    from pathlib import Path

    import planner
    from planner.tune import _run

    root = Path(planner.__file__).resolve().parents[1]
    installed = importlib.metadata.version("agilerl-fsdp-planner")
    expected = installed  # a copy of the sources outside git: no commit to tell
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        expected = f"{installed}+g{head.stdout.strip()[:12]}"
    assert _run.software_versions(SMALL, generate=False)["agilerl-fsdp-planner"] == expected

    cluster = cpu_cluster(64 * MIB)
    common = dict(spec=spec, model=MODEL, coefficients=None, storage=str(tmp_path / "s.db"), study_name="at")
    request = PlanRequest(cluster, SMALL, SHARD_ALL)
    tune(**common, request=request, max_trials=1, probe=FakeProbe(spec, cluster), seed=0, calibration=False, confirm=0)
    monkeypatch.setattr(_run, "checkout_commit", lambda: "0123456789ab")
    later = FakeProbe(spec, cluster)
    with pytest.raises(
        ValueError,
        match=rf"software\.agilerl-fsdp-planner \('[^']+' in the study, '{re.escape(installed)}\+g0123456789ab' now\)",
    ):
        tune(**common, request=request, max_trials=2, probe=later, seed=0, calibration=False, confirm=0)
    assert later.requests == []


@pytest.mark.timeout(120)
def test_the_fastest_candidates_are_measured_twice_and_a_lucky_run_does_not_win(spec):
    cluster = cpu_cluster(64 * MIB, num_gpus=1)  # unsharded only: 3 micro-batches x checkpointing on/off
    calls: dict[tuple, int] = {}

    def probe(request: ProbeRequest) -> Measurement:
        w = request.workload
        knobs = (w.micro_batch_size_per_gpu, w.gradient_checkpointing)
        calls[knobs] = calls.get(knobs, 0) + 1
        if knobs == (4, False):  # lucky once, then slow: median 1/0.04 and 1/0.2 -> 15 steps/s
            step = 0.04 if calls[knobs] == 1 else 0.2
        else:  # (2, False) steady at 20 steps/s; the rest at 10
            step = 0.05 if knobs == (2, False) else 0.1
        ranks = [RankMeasurement(rank=0, phases={"learn": {"total": MIB}}, step_seconds=[step] * 3)]
        return Measurement(request=request, ok=True, ranks=ranks)

    said: list[str] = []
    result = tune(**_small_run(spec, cluster), max_trials=8, probe=probe, confirm=3, progress=said.append)
    # a quarter of the trials at most confirm: taking fewer than asked is said, not silent
    assert "--confirm 3 is more than a quarter of --trials 8: 2 trial(s) confirm" in said, said
    seconds = [t for t in result.trials if "confirm_of" in t.user_attrs]
    assert len(seconds) == 2 and all(t.user_attrs["launched"] for t in seconds)
    by_number = {t.number: t for t in result.trials}
    assert {by_number[t.user_attrs["confirm_of"]].user_attrs["knobs"]["micro_batch_size_per_gpu"] for t in seconds} == {
        4,
        2,
    }
    assert calls[(4, False)] == 2 and calls[(2, False)] == 2
    assert result.best.user_attrs["knobs"]["micro_batch_size_per_gpu"] == 2
    assert len(result.best_runs) == 2 and "median of 2 runs" in result.best_plan.reasons()["fits"]


@pytest.mark.timeout(120)
def test_confirmations_with_nothing_to_confirm_end_the_study(spec):
    """--confirm keeps launches for second runs of fitting candidates; where none fits there is
    nothing to queue and the study ends. The confirmation phase proposed new candidates instead,
    each refused a launch (the budget left room for confirmations only), 243 of them in one replay."""
    cluster = cpu_cluster(64 * MIB, num_gpus=1)

    def probe(request: ProbeRequest) -> Measurement:  # every run over the budget
        ranks = [RankMeasurement(rank=0, phases={"learn": {"total": 128 * MIB}}, step_seconds=[0.1])]
        return Measurement(request=request, ok=True, ranks=ranks)

    result = tune(**_small_run(spec, cluster), max_trials=4, probe=probe, confirm=1)
    assert result.best is None
    assert [t.number for t in result.trials if t.state.name == "PRUNED"] == []
    assert result.stop_reason == "3 trials launched"


# -- calibration -----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_calibration_fits_on_some_trials_judges_on_the_others_and_saves(spec, tmp_path, monkeypatch):
    from planner.calibration import calibration_path, coefficients_for
    from planner.tune._calibrate import calibrate

    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path))
    cluster = cpu_cluster(64 * MIB)
    # What the trials see that the shipped coefficients do not: a large FSDP buffer beside the
    # gathered window (the coefficient the tuner fits).
    truth = Coefficients(all_gather_overlap=3.0)
    fsdp = FSDPConfig(param_persistence_threshold=0)

    class Trial:
        def __init__(self, number, workload):
            est = estimate(spec, workload, cluster, fsdp, coefficients=truth)
            measured = {ph: p.total for ph, p in est.phases.items() if ph in ("load", "reference", "learn", "step")}
            self.number = number
            self.user_attrs = {
                "status": "fits",
                "measured_phases": measured,
                "key": json.dumps({"fsdp": fsdp.model_dump(mode="json"), "workload": workload.model_dump(mode="json")}),
            }

    base = SMALL.model_copy(
        update={"prompt_tokens": 32, "completion_tokens": 32, "logprob_chunk_size": 256, "prompts_per_step": 4}
    )
    trials = [
        Trial(i, base.model_copy(update={"micro_batch_size_per_gpu": mb, "gradient_checkpointing": gc}))
        for i, (mb, gc) in enumerate((m, g) for m in (1, 2, 4) for g in (True, False))
    ]
    report = calibrate(trials, spec=spec, cluster=cluster, coefficients=Coefficients())
    assert (report.num_fit, report.num_held_out, report.in_sample) == (4, 2, False)
    assert report.error_after < report.error_before
    assert report.saved_path == str(calibration_path(cluster.gpu))
    assert coefficients_for(cluster.gpu) != Coefficients()
    assert "held-out" in report.line()

    few = calibrate(trials[:2], spec=spec, cluster=cluster, coefficients=Coefficients(), save=False)
    assert few.in_sample and few.num_held_out == 0 and "none held out" in few.line()


@pytest.mark.timeout(120)
def test_calibration_judges_gpu_trials_by_the_estimate_on_their_gpu(spec):
    """CUDA trials measure device tensors (max_memory_allocated): trials that measured exactly
    the estimate's tensors on an H100 score no error, with Adam's state on the host or not. The
    estimate made as on a CPU device counted the host state as device memory (+75% there)."""
    from planner.hardware import GPUS
    from planner.tune._calibrate import calibrate

    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=2)
    # what max_memory_allocated never holds: the context, the allocator's reserve, NCCL's buffers
    outside = ("cuda_context", "allocator_slack", "nccl_buffers")

    class Trial:
        def __init__(self, number, fsdp):
            est = estimate(spec, SMALL, cluster, fsdp)
            measured = {
                ph: p.total - sum(p.components.get(k, 0) for k in outside)
                for ph, p in est.phases.items()
                if ph in ("load", "reference", "learn", "step")
            }
            self.number = number
            self.user_attrs = {
                "status": "fits",
                "measured_phases": measured,
                "key": json.dumps({"fsdp": fsdp.model_dump(mode="json"), "workload": SMALL.model_dump(mode="json")}),
            }

    fsdps = [
        FSDPConfig(param_persistence_threshold=0, optim_cpu_offload=o, wrap_every_n_blocks=w)
        for o in (False, True)
        for w in (1, 2)
    ]
    report = calibrate(
        [Trial(i, f) for i, f in enumerate(fsdps)], spec=spec, cluster=cluster, coefficients=None, save=False
    )
    assert report.error_before is not None and report.max_error_before < 1e-9, report.line()


# -- the CLI glue ----------------------------------------------------------------------------------
def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="table")
    parser.add_argument("--output", default=None)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--sharding", default="auto")
    add_tune_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.timeout(120)
def test_tune_main_prints_the_trials_and_emits_the_best_config(spec, tmp_path, capsys):
    from agilerl.manifest import load_manifest

    cluster = cpu_cluster(64 * MIB)
    out = tmp_path / "best.yaml"
    common = dict(spec=spec, model=MODEL, request=PlanRequest(cluster, SMALL, SHARD_ALL))
    argv = ["--tune", "--trials", "3", "--storage", "memory", "--device", "cpu", "--seed", "0", "--no-calibration"]
    code = tune_main(_args(argv + ["--output", str(out)]), probe=FakeProbe(spec, cluster), **common)
    captured = capsys.readouterr()
    assert code == 0
    assert "trial 1/3" in captured.err and "best so far" in captured.err
    assert "why infeasible" in captured.out and "FITS" in captured.out and "tuned:" in captured.out
    manifest = load_manifest(out)
    assert manifest.training.training_gpus_per_agent == 2

    code = tune_main(_args(argv + ["--format", "json"]), probe=FakeProbe(spec, cluster), **common)
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["best"]["fits"] and data["num_launched"] == 3
    assert data["trials"][data["best_trial"]]["status"] == "fits"
    assert (
        data["best"]["manifest"]["algorithm"]["micro_batch_size_per_gpu"]
        == data["trials"][data["best_trial"]]["knobs"]["micro_batch_size_per_gpu"]
    )

    code = tune_main(_args(argv + ["--format", "yaml"]), probe=FakeProbe(spec, cluster), **common)
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("# agilerl-plan:") and "why infeasible" in captured.err

    # Everything measured over the budget: exit 3, and no config is emitted.
    code = tune_main(
        _args(argv + ["--output", str(tmp_path / "none.yaml")]), probe=FakeProbe(spec, cluster, scale=500.0), **common
    )
    assert code == 3 and not (tmp_path / "none.yaml").exists()
    assert "no trial measured a config that fits" in capsys.readouterr().out

    code = tune_main(_args(argv + ["--storage", "postgresql:/x"]), probe=FakeProbe(spec, cluster), **common)
    assert code == 2 and "looks like a URL" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_catalog_model_without_weights_is_probed_from_its_config(tmp_path, monkeypatch):
    from planner import catalog

    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path))
    assert probe_model(MODEL) == MODEL
    assert probe_model(str(tmp_path)) == str(tmp_path)
    folder = Path(probe_model("qwen2.5-0.5b"))
    assert folder.is_relative_to(tmp_path)
    assert json.loads((folder / "config.json").read_text()) == catalog.entry("Qwen/Qwen2.5-0.5B").config
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert probe_model("Qwen/Qwen2.5-0.5B") == str(folder)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(folder).num_hidden_layers == 24


# -- real probes -----------------------------------------------------------------------------------
TUNER = textwrap.dedent("""
    import argparse, sys
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.models import load_model_spec
    from planner.request import PlanRequest
    from planner.tune import add_tune_arguments, tune_main
    from planner.workload import Workload

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--budget-mib", type=float, default=64)
    parser.add_argument("--format", default="table")
    parser.add_argument("--output", default=None)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--sharding", default="auto")
    add_tune_arguments(parser)
    args = parser.parse_args()
    workload = Workload(prompts_per_step=2, group_size=2, prompt_tokens=8, completion_tokens=8, lora_rank=4,
                        lora_alpha=8, weights_dtype="float32", attn_implementation="eager", generation="none")
    cluster = Cluster(gpu=CPU_DEVICE.model_copy(update={"memory_bytes": int(args.budget_mib * 2**20)}),
                      num_gpus=args.gpus)
    spec = load_model_spec(args.model)
    fixed = {"param_dtype": "float32", "param_persistence_threshold": 0}
    request = PlanRequest(cluster, workload, fixed, sharding=args.sharding, margin_fraction=args.margin)
    sys.exit(tune_main(args, spec=spec, model=args.model, request=request))
""")


def _owned_by(pid: int) -> list[int]:
    """Live processes a tuner with this pid launched (they carry its owner tag)."""
    from tests._procs import with_env

    return with_env("AGILERL_TUNE_OWNER", f"{socket.gethostname()}:{pid}")


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_tuner_killed_mid_trial_resumes_without_rerunning_or_orphans(tmp_path):
    db = tmp_path / "tune.db"
    cmd = [
        sys.executable,
        "-c",
        TUNER,
        MODEL,
        "--tune",
        "--trials",
        "3",
        "--storage",
        str(db),
        "--study-name",
        "s",
        "--device",
        "cpu",
        "--timed-steps",
        "1",
        "--seed",
        "0",
        "--no-calibration",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    log = tmp_path / "first.log"
    with log.open("w") as out:
        first = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    deadline = time.monotonic() + 240
    try:
        while True:  # until one trial is measured and the next one's probe is running
            assert time.monotonic() < deadline and first.poll() is None, log.read_text()
            time.sleep(0.5)
            if not db.exists():
                continue
            try:
                trials = optuna.load_study(study_name="s", storage=storage).get_trials(deepcopy=False)
            except KeyError:
                continue
            done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("launched")]
            running = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
            if done and running and _owned_by(first.pid):
                break
    finally:
        first.kill()  # SIGKILL: no chance to clean up
        first.wait()
    killed_at = time.monotonic()
    while _owned_by(first.pid) and time.monotonic() - killed_at < 2.0:
        time.sleep(0.05)
    assert not _owned_by(first.pid), "the killed tuner's probe outlived it by more than 2 s"
    [measured_before] = done
    killed_number = running[0].number
    # No wait for the heartbeat's grace (30 s at the default 10 s interval): the rerun sees the
    # trial's owner is dead (pid, start time, boot id) and fails it at once.
    second = subprocess.run(cmd + ["--format", "json"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert not _owned_by(first.pid), "the killed tuner's probe outlived it"
    data = json.loads(second.stdout)
    by_number = {t["number"]: t for t in data["trials"]}
    assert by_number[killed_number]["state"] == "FAIL"
    assert by_number[measured_before.number]["state"] == "COMPLETE"
    assert by_number[measured_before.number]["wall_seconds"] == measured_before.user_attrs["wall_seconds"]
    launched = [t for t in data["trials"] if t["state"] == "COMPLETE" and t["launched"]]
    assert len(launched) == 3 and data["num_launched"] == 3
    assert len({json.dumps(t["knobs"], sort_keys=True) for t in launched}) == 3  # nothing measured twice
    assert data["best"]["fits"]


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_kills_the_probe_and_fails_the_trial(tmp_path, signum):
    db = tmp_path / "tune.db"
    cmd = [
        sys.executable,
        "-c",
        TUNER,
        MODEL,
        "--tune",
        "--trials",
        "2",
        "--storage",
        str(db),
        "--study-name",
        "s",
        "--device",
        "cpu",
        "--seed",
        "0",
        "--no-calibration",
    ]
    # The first probe stalls in learn, so it is still running when the signal arrives.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "AGILERL_PROBE_STALL": "0:learn"}
    tuner = interruptible(cmd, env)
    deadline = time.monotonic() + 120
    while not _owned_by(tuner.pid):  # its first probe is running
        assert time.monotonic() < deadline and tuner.poll() is None
        time.sleep(0.2)
    tuner.send_signal(signum)
    _, err = tuner.communicate(timeout=60)
    assert tuner.returncode == 130, err
    assert "run the same command again to resume" in err
    assert not _owned_by(tuner.pid)
    [trial] = optuna.load_study(study_name="s", storage=f"sqlite:///{db}").get_trials()
    assert trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs["status"] == "interrupted"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_crashed_rank_is_an_infeasible_trial_and_the_study_goes_on(spec, monkeypatch):
    monkeypatch.setenv("AGILERL_PROBE_KILL", "1:learn")
    cluster = cpu_cluster(64 * MIB)
    seen: list[str] = []
    result = tune(
        spec=spec,
        model=MODEL,
        request=PlanRequest(cluster, SMALL, SHARD_ALL, sharding="fsdp"),
        coefficients=None,
        storage="memory",
        max_trials=2,
        seed=0,
        timed_steps=1,
        trial_timeout_s=120,
        calibration=False,
        progress=seen.append,
    )
    launched = [t for t in result.trials if t.user_attrs["launched"]]
    assert len(launched) == 2  # the first crash did not end the study
    for t in launched:
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert t.user_attrs["status"] == "crashed" and t.user_attrs["constraint"] == 1.0
    assert result.best is None and result.best_plan is None
    assert any("crashed" in line for line in seen)


@pytest.fixture(scope="module")
def postgres_url():
    from tests._postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_two_workers_share_a_postgres_study_and_one_killed_leaves_the_other_to_finish(postgres_url, tmp_path):
    cmd = [
        sys.executable,
        "-c",
        TUNER,
        MODEL,
        "--tune",
        "--trials",
        "4",
        "--storage",
        postgres_url,
        "--study-name",
        "shared",
        "--device",
        "cpu",
        "--timed-steps",
        "1",
        "--no-calibration",
        "--format",
        "json",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    a = subprocess.Popen(cmd + ["--seed", "0"], env=env, stdout=subprocess.PIPE, stderr=logs[0].open("w"), text=True)
    b = subprocess.Popen(cmd + ["--seed", "1"], env=env, stdout=subprocess.DEVNULL, stderr=logs[1].open("w"))
    storage = optuna.storages.RDBStorage(postgres_url)
    deadline = time.monotonic() + 240
    try:
        while not _owned_by(b.pid):  # worker b's probe is running
            assert time.monotonic() < deadline and b.poll() is None and a.poll() is None, (
                logs[0].read_text()[-2000:] + logs[1].read_text()[-2000:]
            )
            time.sleep(0.2)
        running_b = [
            t.number
            for t in optuna.load_study(study_name="shared", storage=storage).get_trials(
                deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)
            )
            if t.user_attrs.get("owner", {}).get("pid") == b.pid
        ]
    finally:
        b.kill()
        b.wait()
    killed_at = time.monotonic()
    while _owned_by(b.pid) and time.monotonic() - killed_at < 2.0:
        time.sleep(0.05)
    assert not _owned_by(b.pid), "the killed worker's probe outlived it by more than 2 s"
    out, _ = a.communicate(timeout=300)
    assert a.returncode == 0, logs[0].read_text()[-3000:]
    trials = optuna.load_study(study_name="shared", storage=storage).get_trials(deepcopy=False)
    by_owner = {}
    for t in trials:
        by_owner.setdefault(t.user_attrs.get("owner", {}).get("pid"), []).append(t)
    assert set(by_owner) == {a.pid, b.pid}, "both workers took trials of the one study"
    launched = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("launched")]
    assert len(launched) == 4, [(t.number, t.state.name, t.user_attrs.get("status")) for t in trials]
    assert len({t.user_attrs["key"] for t in launched}) == 4, "a candidate was launched twice"
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING], "a trial was left RUNNING"
    states = {t.number: t.state for t in trials}
    assert running_b and all(states[n] == optuna.trial.TrialState.FAIL for n in running_b)
    assert json.loads(out)["best"]["fits"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_trial_on_two_nodes_runs_as_two_torchrun_agents(spec):
    from planner.probe import run_probe

    cluster = cpu_cluster(256 * MIB, num_gpus=4, gpus_per_node=2)
    seen: list[ProbeRequest] = []

    def probe(request: ProbeRequest) -> Measurement:
        seen.append(request)
        return run_probe(request)

    # Four prompts: the manifest gives each of the 4 GPUs whole prompts.
    workload = SMALL.model_copy(update={"prompts_per_step": 4})
    request = PlanRequest(cluster, workload, {**SHARD_ALL, "shard_group_size": 2})
    result = tune(
        spec=spec,
        model=MODEL,
        request=request,
        coefficients=None,
        storage=None,
        seed=0,
        calibration=False,
        max_trials=1,
        timed_steps=1,
        probe=probe,
    )
    [request] = seen
    assert (request.nproc, request.nnodes, request.fsdp.shard_group_size) == (4, 2, 2)
    [trial] = [t for t in result.trials if t.user_attrs.get("launched")]
    assert trial.user_attrs["status"] in ("fits", "over_budget"), trial.user_attrs.get("why")
    assert trial.user_attrs["tokens_per_second"] > 0


@pytest.mark.timeout(60)
def test_engine_ranks_that_cannot_fit_are_refused_before_any_trial():
    """generation 'none' puts the rollout on engine ranks of their own, each with the whole model:
    a 70B's (131 GiB in bf16) fits no 80 GB GPU, whatever the trials choose for the trainers, so
    the tuner says so before it launches anything."""
    from planner.hardware import GPUS
    from planner.models import load_model_spec

    def never(request):
        raise AssertionError("a trial was launched")

    spec = load_model_spec("meta-llama/Llama-3.1-70B")
    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8)
    over = r"an engine rank of its own \(generation 'none'\) needs 1\d\d\.\d\d GiB on its GPU"
    with pytest.raises(ValueError, match=over):
        tune(
            spec=spec,
            model="meta-llama/Llama-3.1-70B",
            request=PlanRequest(cluster, Workload(prompts_per_step=16, generation="none")),
            coefficients=None,
            storage="memory",
            max_trials=1,
            probe=never,
        )


@pytest.mark.timeout(60)
def test_a_run_whose_nodes_host_nothing_fits_is_refused_before_any_trial(tmp_path):
    """No trial measures a node's host: where the plan finds no combination whose busiest node's
    host holds it (Llama-3.1-70B fully fine-tuned on a node of 8 with 256 GiB: Adam's state
    alone is 16 bytes a parameter), the tuner says so in one line and opens no study."""
    from planner.hardware import GIB, GPUS
    from planner.models import load_model_spec

    def never(request):
        raise AssertionError("a trial was launched")

    spec = load_model_spec("meta-llama/Llama-3.1-70B")
    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8, host_memory_per_node_bytes=256 * GIB)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(ValueError, match=r"no candidate fits the nodes. host: the least needs .* over the 243\.20 GiB"):
        tune(
            spec=spec,
            model="meta-llama/Llama-3.1-70B",
            request=PlanRequest(cluster, Workload(full_finetune=True, prompts_per_step=8)),
            coefficients=None,
            storage=storage,
            max_trials=1,
            probe=never,
        )
    assert not (tmp_path / "study.db").exists()


def _host_bound_run():
    """Llama-3.1-8B fully fine-tuned on 2 GPUs of 68.38 GiB with a 99.7 GiB host: (spec, cluster,
    workload). The plan's pick offloads Adam past the host; candidates with Adam on the GPU fit."""
    from planner.hardware import GIB, GPUS, with_memory

    spec = load_model_spec("meta-llama/Llama-3.1-8B")
    cluster = Cluster(gpu=with_memory(GPUS["H100-80GB"], 68.38), num_gpus=2, host_memory_per_node_bytes=int(99.7 * GIB))
    return spec, cluster, Workload(algorithm="sft", full_finetune=True, group_size=1, prompts_per_step=8)


def _tune_in_memory(spec, cluster, workload, probe, *, max_trials, **kwargs):
    """tune() of that run with an in-memory study, no calibration, and ``probe`` for the trials."""
    return tune(
        spec=spec,
        model="meta-llama/Llama-3.1-8B",
        request=PlanRequest(cluster, workload),
        coefficients=None,
        storage="memory",
        max_trials=max_trials,
        probe=probe,
        calibration=False,
        **kwargs,
    )


class _CirclingSampler(optuna.samplers.BaseSampler):
    """Proposes the same candidate every time (the first choice of every knob): a sampler whose
    model circles what it has seen."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return param_distribution.choices[0]


@pytest.mark.timeout(120)
def test_a_sampler_that_proposes_only_repeats_does_not_end_the_study_while_admitted_candidates_are_left(
    monkeypatch,
):
    """The run of the next test, its sampler proposing one candidate over and over: after 12
    repeats the study stopped, with at most that one launched (and at random, with nothing
    launched: the sampler circled rejected candidates). It now goes on with candidates the
    estimate admits that no trial has seen, each launched once, and stops at the budget."""
    from planner.tune import _run

    spec, cluster, workload = _host_bound_run()
    real = _run.create_study

    def circling(**kwargs):
        study = real(**kwargs)
        study.sampler = _CirclingSampler()
        return study

    monkeypatch.setattr(_run, "create_study", circling)
    probe, said = FakeProbe(spec, cluster), []
    result = _tune_in_memory(spec, cluster, workload, probe, max_trials=3, progress=said.append)
    assert len(probe.requests) == 3, said[-3:]
    keys = {json.dumps(r.fsdp.model_dump() if r.fsdp else None) + r.workload.model_dump_json() for r in probe.requests}
    assert len(keys) == 3  # three candidates, each once
    assert said[-1] == "stopped: 3 trials launched"
    assert len(result.trials) > 3


@pytest.mark.timeout(120)
def test_a_run_whose_plan_offloads_past_the_host_is_tuned_where_a_candidate_fits_it():
    """The plan reports the run nearest to fitting the GPUs, which can be one whose offloaded
    Adam state is what breaks the host (Llama-3.1-8B fully fine-tuned on 2 GPUs of 68.38 GiB with a
    99.7 GiB host): a candidate with Adam on the GPU fits that host, and its estimated peak is
    within the budget, so the tuner measures candidates instead of refusing; every one it launches
    fits the host."""
    from planner.choose import host_judge, plan

    spec, cluster, workload = _host_bound_run()
    picked = plan(spec, workload, cluster)
    assert not picked.fits and picked.host_over  # what the plan reports cannot hold the host
    probe = FakeProbe(spec, cluster)
    result = _tune_in_memory(spec, cluster, workload, probe, max_trials=2)
    judge = host_judge(spec, workload, cluster)
    assert judge is not None and probe.requests
    for request in probe.requests:
        host = judge(estimate(spec, request.workload, cluster, request.fsdp))
        assert host.what == "host" and host.need_bytes <= host.limit_bytes
    assert result.trials
