"""The tuning run: create or resume the study, seed the planner's pick, run the trials,
calibrate, and turn the best measured trial into a :class:`~planner.choose.Plan`."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..choose import Decision, Limit, Plan, engine_rank_problem, host_judge, plan
from ..hardware import Cluster, fmt_bytes
from ..memory import Coefficients, estimate
from ..probe import Device, Measurement, ProbeRequest, probe_model
from ..request import PlanRequest
from ..spec import ModelSpec
from ..workload import Workload
from ._calibrate import CalibrationReport, calibrate
from ._objective import Objective
from ._report import progress_line
from ._space import Candidate, Space, grid, plan_params, search_space
from ._storage import (
    DEFAULT_STORAGE,
    OWNER_ENV,
    default_study_name,
    kill_orphans,
    open_storage,
    owner_tag,
    redact,
    storage_url,
)
from ._study import (
    check_fingerprint,
    create_study,
    earlier_result,
    enqueue_confirmations,
    enqueue_planner_pick,
    finished,
    launch_claim,
    launched_trials,
    measured_by_key,
    median_tokens,
    run_trials,
)

__all__ = ["TuneResult", "tune", "tuned_plan", "probe_model", "MAX_ENUMERATED"]

#: Spaces up to this many candidates are estimated whole, so the study can stop once it has
#: measured every candidate the estimate admits (a few ms per estimate).
MAX_ENUMERATED = 2000


@dataclass(frozen=True)
class TuneResult:
    study_name: str
    storage: str
    cluster: Cluster  # what the trials ran on (a CPU "device" with the budget for CPU probes)
    trials: list[Any]  # every trial of the study (optuna FrozenTrial)
    best: Any | None  # the first trial of the fitting candidate with the most tokens/s (median of its runs)
    best_runs: list[Any]  # every measured trial of that candidate
    best_plan: Plan | None
    planner_trial: Any | None  # the planner's own pick, measured
    calibration: CalibrationReport | None
    stop_reason: str

    @property
    def best_tokens_per_second(self) -> float | None:
        return median_tokens(self.best_runs) if self.best_runs else None

    @property
    def num_launched(self) -> int:
        """Trials whose probe ran to a result (what ``--trials`` counts)."""
        return _num_launched(self.trials)


def _num_launched(trials: list[Any]) -> int:
    return sum(1 for t in trials if t.state.name == "COMPLETE" and t.user_attrs.get("launched"))


def _best(trials: list[Any]) -> list[Any] | None:
    """The runs of the fastest candidate (median tokens/s over its runs) whose every run fits."""
    groups = measured_by_key(trials)
    fitting = [runs for runs in groups.values() if all(t.user_attrs["status"] == "fits" for t in runs)]
    return max(fitting, key=lambda runs: (median_tokens(runs), -runs[0].number), default=None)


def _candidate(trial: Any) -> Candidate:
    from agilerl.distributed import FSDPConfig

    key = json.loads(trial.user_attrs["key"])
    return Candidate(
        fsdp=FSDPConfig.model_validate(key["fsdp"]) if key["fsdp"] is not None else None,
        workload=Workload.model_validate(key["workload"]),
    )


def tuned_plan(
    runs: list[Any],
    *,
    spec: ModelSpec,
    cluster: Cluster,
    coefficients: Coefficients | None,
    margin_fraction: float,
    num_launched: int,
    planner_runs: list[Any] | None = None,
) -> Plan:
    """A :class:`Plan` for a measured candidate (its trials, ``runs``), so the planner's emitters
    (table, JSON, manifest) work unchanged.

    Its estimate is the planner's; ``fits`` and the reasons are the measurement's.
    """
    trial = runs[0]
    c = _candidate(trial)
    fixed = c.fsdp.model_dump() if c.fsdp is not None else {}
    base = plan(
        spec,
        c.workload,
        cluster,
        fixed=fixed,
        sharding="fsdp" if c.fsdp else "none",
        coefficients=coefficients,
        margin_fraction=margin_fraction,
    )
    a = trial.user_attrs
    tokens = median_tokens(runs)
    numbers = ", ".join(f"#{t.number}" for t in runs)
    why = f"the most tokens/s of {num_launched} measured trials (trial {numbers})"
    decisions = [Decision(field=k, value=v, reason=f"tuned: {why}") for k, v in c.knobs().items()]
    if planner_runs and all(t.user_attrs["status"] == "fits" for t in planner_runs):
        ref = median_tokens(planner_runs)
        gain = tokens / ref - 1 if ref else 0.0
        decisions.append(
            Decision(
                field="tuner",
                value=f"{gain:+.1%}",
                reason=(f"the planner's own pick (trial #{planner_runs[0].number}) measured {ref:,.0f} tokens/s"),
            )
        )
    peak = max(runs, key=lambda t: t.user_attrs["peak_bytes"]).user_attrs
    many = f" (median of {len(runs)} runs)" if len(runs) > 1 else ""
    decisions.append(
        Decision(
            field="fits",
            value=True,
            reason=(
                f"measured peak {fmt_bytes(peak['peak_bytes'])} per rank in phase {peak['peak_phase']}, within the "
                f"{fmt_bytes(a['limit_bytes'])} limit ({fmt_bytes(a['budget_bytes'])} less the {margin_fraction:.0%} "
                f"margin); {tokens:,.0f} tokens/s{many}"
            ),
        )
    )
    # (an engine rank of its own that cannot fit was refused before any trial: tune(); a candidate
    # whose node's host is over is never launched, but a study resumed from before the host was
    # judged may hold one)
    if host := [limit for limit in base.over() if limit.what == "host"]:
        over = host[0].words()
        decisions[-1] = Decision(field="fits", value=False, reason=f"{decisions[-1].reason}; but the estimate's {over}")
    return base.model_copy(update={"fits": not base.host_over, "decisions": tuple(decisions), "suggestions": ()})


def tune(
    *,
    spec: ModelSpec,
    model: str,
    request: PlanRequest,
    coefficients: Coefficients | None,
    device: Device = "cpu",
    max_trials: int = 20,
    timeout_s: float | None = None,
    storage: str | None = DEFAULT_STORAGE,
    study_name: str | None = None,
    trial_timeout_s: float = 600.0,
    timed_steps: int = 3,
    generate: bool | None = None,
    seed: int | None = None,
    heartbeat_interval_s: int = 10,
    calibration: bool = True,
    confirm: int = 0,
    probe: Callable[[ProbeRequest], Measurement] | None = None,
    progress: Callable[[str], None] | None = None,
) -> TuneResult:
    """Run (or resume) the study of ``request`` (its cluster's ``gpu.memory_bytes`` is the per-rank
    budget, its margin what a trial must leave free).

    The last ``confirm`` of the ``max_trials`` launches (at most a quarter of them) measure
    the fastest candidates a second time, and the pick is by each candidate's median. Off by
    default: in benchmarks/tune_efficiency.py replays, second runs paid off only where the
    run-to-run spread was large; with a small budget and a quiet machine exploring wins.
    ``probe`` replaces planner.probe.run_probe (tests, replays); ``storage`` is as
    ``--storage`` (None: in memory). Raises ValueError for bad input and
    KeyboardInterrupt after recording the interrupted trial as FAIL.
    """
    say = progress or (lambda _msg: None)
    workload, cluster, sharding = request.workload, request.cluster, request.sharding
    fixed, margin_fraction = dict(request.fixed), request.margin_fraction
    if max_trials < 1:
        raise ValueError(f"--trials must be at least 1, got {max_trials}")
    generate = _trials_generate(workload, fixed, generate)
    _check_engine_ranks(spec, request, coefficients)
    picked = plan(
        spec,
        workload,
        cluster,
        fixed=fixed,
        sharding=sharding,
        coefficients=coefficients,
        margin_fraction=margin_fraction,
        suggest=False,
    )
    space = search_space(spec, workload, cluster, fixed=fixed, sharding=sharding, engine_in_trials=generate)
    points = grid(space)
    _check_host(spec, request, space, points, coefficients)
    killed = kill_orphans()
    if killed:
        say(f"killed {len(killed)} process(es) left behind by a tuner that died: {killed}")
    store, study, name = _open_study(
        spec,
        model,
        request,
        device=device,
        generate=generate,
        storage=storage,
        study_name=study_name,
        seed=seed,
        max_trials=max_trials,
        timed_steps=timed_steps,
        heartbeat_interval_s=heartbeat_interval_s,
        say=say,
    )

    if enqueue_planner_pick(study, plan_params(space, picked) if picked.fits else None):
        say("the planner's pick is the first trial")
    # A cluster of several nodes is emulated on this host: one torchrun agent per node, c10d rendezvous.
    probe_request = ProbeRequest(
        model=probe_model(model),
        workload=workload,
        nproc=cluster.num_gpus,
        nnodes=cluster.num_nodes,
        device=device,
        generate=generate,
        memory_budget_bytes=cluster.gpu.memory_bytes,
        timeout_s=trial_timeout_s,
        timed_steps=timed_steps,
    )
    if probe is None:
        from ..probe import run_probe

        env = {OWNER_ENV: owner_tag()}
        probe = lambda req: run_probe(req, env=env)  # noqa: E731
    run = probe

    def launch(req: ProbeRequest) -> Measurement:
        knobs = " ".join(f"{k}={v}" for k, v in Candidate(fsdp=req.fsdp, workload=req.workload).knobs().items())
        say(
            f"trial {_num_launched(finished(study)) + 1}/{max_trials}: launching {req.nproc} rank(s) on "
            f"{req.device}: {knobs}"
        )
        return run(req)

    objective = Objective(
        space=space,
        spec=spec,
        cluster=cluster,
        coefficients=coefficients,
        margin_fraction=margin_fraction,
        request=probe_request,
        probe=launch,
        previous=earlier_result(study),
        claim=launch_claim(study, store, max_launches=max_trials - max(0, min(confirm, max_trials // 4))),
    )

    admissible = None
    if len(points) <= MAX_ENUMERATED:
        admissible = {c.key for c in map(space.candidate, points) if objective.admits(c)}
    if confirm > max_trials // 4:  # the rest of the trials explore: say so rather than take fewer silently
        say(f"--confirm {confirm} is more than a quarter of --trials {max_trials}: {max_trials // 4} trial(s) confirm")
    confirm = max(0, min(confirm, max_trials // 4))
    start = time.monotonic()
    common = dict(
        storage=store,
        space_size=len(points),
        admissible=admissible,
        on_trial=_progress_of(study, max_trials, say),
        unseen=unseen_admitted(space, points, objective, seed, admissible=admissible),
    )
    reason = run_trials(study, objective, max_launches=max_trials - confirm, timeout_s=timeout_s, **common)
    left = None if timeout_s is None else timeout_s - (time.monotonic() - start)
    if confirm and (left is None or left > 0):
        queued = enqueue_confirmations(study, confirm)
        if queued:
            say(f"measuring the {queued} fastest fitting candidate(s) once more (the pick is by median)")
            # only those: a new candidate would find the launch budget spent (it leaves room for these)
            reason = run_trials(study, objective, max_launches=max_trials, timeout_s=left, only_queued=True, **common)
    say(f"stopped: {reason}")
    return _result(
        study,
        name,
        storage,
        spec=spec,
        request=request,
        coefficients=coefficients,
        calibration=calibration,
        reason=reason,
    )


def _progress_of(study: Any, max_trials: int, say: Callable[[str], None]) -> Callable[[Any], None]:
    """What says each finished trial: its line, the launches so far and the best candidate."""

    def on_trial(frozen: Any) -> None:
        done = finished(study)
        best = _best(done)
        say(
            progress_line(
                frozen,
                launched=_num_launched(done),
                max_launches=max_trials,
                best=(best[0], median_tokens(best), len(best)) if best else None,
            )
        )

    return on_trial


def _check_engine_ranks(spec: ModelSpec, request: PlanRequest, coefficients: Coefficients | None) -> None:
    """ValueError where the run's engine ranks of their own (generation 'none' with a rollout)
    cannot fit their GPUs: the trials run the trainers, and nothing they choose changes that."""
    problem = engine_rank_problem(
        spec, request.workload, request.cluster, coefficients=coefficients, margin_fraction=request.margin_fraction
    )
    if problem is not None:
        raise ValueError(
            f"{problem}; whatever the trials choose for the trainers: generate on the trainer GPUs "
            "(--generation hf or vllm), or plan without --tune to see what would fit"
        )


def _check_host(
    spec: ModelSpec, request: PlanRequest, space: Space, points: list[Any], coefficients: Coefficients | None
) -> None:
    """ValueError where no candidate of the search space fits the nodes' host memory (where it is
    given): no trial measures a node's host, so no trial could show one that fits. A node's host
    depends on a candidate's FSDPConfig alone (the workload knobs the tuner varies, micro-batch,
    checkpointing, log-prob chunk, move no host term), so each distinct FSDPConfig is judged once,
    with the first of its candidates; it stops at the first that fits."""
    judge = host_judge(
        spec, request.workload, request.cluster, coefficients=coefficients, margin_fraction=request.margin_fraction
    )
    if judge is None or not points:
        return
    seen: set[str] = set()
    least: Limit | None = None
    for candidate in map(space.candidate, points):
        key = candidate.fsdp.model_dump_json() if candidate.fsdp is not None else ""
        if key in seen:
            continue
        seen.add(key)
        est = estimate(spec, candidate.workload, request.cluster, candidate.fsdp, coefficients=coefficients)
        host = judge(est)
        if not host.over:
            return
        least = host if least is None or host.need_bytes < least.need_bytes else least
    assert least is not None
    raise ValueError(
        f"no candidate fits the nodes' host: the least needs {least.words()}, and no trial measures "
        "a node's host: plan without --tune to see what would fit"
    )


def _trials_generate(workload: Workload, fixed: dict[str, Any], generate: bool | None) -> bool:
    """Whether the trials roll out, as the run does (Hugging Face generate, or a real vLLM
    engine), unless ``generate`` says; ValueError for a fixed parameter offload the trainer
    refuses without the engine."""
    generate = workload.generation in ("hf", "vllm") if generate is None else generate
    if workload.generation == "vllm" and not generate and fixed.get("cpu_offload"):
        raise ValueError(
            "cpu_offload=True with --generation vllm needs the engine in the trials (the trainer refuses "
            "parameter offload without one): drop --skip-rollout"
        )
    return generate


def _open_study(
    spec: ModelSpec,
    model: str,
    request: PlanRequest,
    *,
    device: Device,
    generate: bool,
    storage: str | None,
    study_name: str | None,
    seed: int | None,
    max_trials: int,
    timed_steps: int,
    heartbeat_interval_s: int,
    say: Callable[[str], None],
) -> tuple[Any, Any, str]:
    """Create or resume the study for this run (refusing one built for another run); say what it holds."""
    workload, cluster = request.workload, request.cluster
    store = open_storage("memory" if storage is None else storage, heartbeat_interval_s=heartbeat_interval_s)
    parts = {
        "model": model,
        "cluster": cluster.model_dump(mode="json"),
        "workload": workload.model_dump(mode="json"),
        "fixed": dict(request.fixed),
        "sharding": request.sharding,
        "device": device,
        "margin": request.margin_fraction,
        "generate": generate,
    }
    if study_name is not None and not study_name.strip():
        raise ValueError("--study-name is empty: give a name, or leave it out for one derived from the run")
    spec_digest = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]
    software = software_versions(workload, generate=generate)
    fingerprint = {**parts, "spec": spec_digest, "timed_steps": timed_steps, "software": software}
    # a derived name digests all the fingerprint holds: a run it would refuse gets a study of its own
    name = study_name or default_study_name(model, fingerprint)
    study = create_study(storage=store, study_name=name, seed=seed, n_startup_trials=max(1, min(10, max_trials // 3)))
    check_fingerprint(study, fingerprint)
    stale = [
        t.number
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("status") is None and t.state.name == "FAIL"
    ]
    say(
        f"study {name!r} in {_where(storage)}: {len(launched_trials(study))} trial(s) measured before"
        + (f"; trial(s) {stale} lost their tuner mid-run and are FAIL" if stale else "")
    )
    return store, study, name


def unseen_admitted(
    space: Space,
    points: list[dict[str, Any]],
    objective: Objective,
    seed: int | None,
    *,
    admissible: set[str] | None = None,
) -> Callable[[set[str]], dict[str, Any] | None]:
    """``unseen(seen keys)``: the params of a grid point the estimate admits whose candidate no
    trial has seen, drawn at random (by ``seed``) with each point judged once, or None when
    none is left. Where the sampler proposes only candidates it has seen (its model can circle
    rejected ones: a study stopped with nothing launched while admissible candidates were left),
    the study goes on with these. ``admissible``: the keys the estimate admits, where the space
    was enumerated (those points are not estimated again)."""
    order = list(range(len(points)))
    random.Random(seed).shuffle(order)
    remaining = iter(order)

    def unseen(seen: set[str]) -> dict[str, Any] | None:
        for i in remaining:
            candidate = space.candidate(points[i])
            admitted = candidate.key in admissible if admissible is not None else objective.admits(candidate)
            if candidate.key not in seen and admitted:
                return points[i]
        return None

    return unseen


def software_versions(workload: Workload, *, generate: bool) -> dict[str, str | None]:
    """The installed versions of what a probe's peak depends on: the trainer, torch (its
    allocator and FSDP2), transformers and PEFT (what the model keeps for backward), and
    bitsandbytes or vLLM where the run uses them. Part of a study's fingerprint, so that
    trials measured under another torch or trainer are not taken for this one's (a derived
    study name changes with them; a named study refuses to resume, naming the versions)."""
    names = ["agilerl-fsdp-planner", "torch", "transformers", "peft"]
    if workload.load_in_4bit:
        names.append("bitsandbytes")
    if generate and workload.generation == "vllm":
        names.append("vllm")
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None  # the probe says what is missing when it launches
    if versions["agilerl-fsdp-planner"] is not None and (commit := checkout_commit()):
        # an editable install keeps the version it was installed with, whatever the code does since
        versions["agilerl-fsdp-planner"] += f"+g{commit}"
    return versions


def checkout_commit() -> str | None:
    """The git commit (12 hex digits) of the checkout this package runs from, where it runs from
    one (an editable install); None from an installed wheel, or where git cannot say. Edits not
    committed are not told apart."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit[:12] if out.returncode == 0 and len(commit) >= 12 else None


def _where(storage: str | None) -> str:
    """The study's storage as it may be printed (a password redacted)."""
    url = storage_url("memory" if storage is None else storage)
    return "memory" if url is None else redact(url)


def _result(
    study: Any,
    name: str,
    storage: str | None,
    *,
    spec: ModelSpec,
    request: PlanRequest,
    coefficients: Coefficients | None,
    calibration: bool,
    reason: str,
) -> TuneResult:
    """The finished study: the best measured config as a plan, the planner's own trial, the calibration."""
    cluster = request.cluster
    trials = study.get_trials(deepcopy=False)
    best = _best(trials)
    planner_trial = next((t for t in finished(study) if t.user_attrs.get("source") == "planner"), None)
    planner_runs = measured_by_key(trials).get(planner_trial.user_attrs.get("key")) if planner_trial else None
    report = None
    if calibration:
        report = calibrate(launched_trials(study), spec=spec, cluster=cluster, coefficients=coefficients)
    best_plan = None
    if best is not None:
        best_plan = tuned_plan(
            best,
            spec=spec,
            cluster=cluster,
            coefficients=coefficients,
            margin_fraction=request.margin_fraction,
            num_launched=_num_launched(trials),
            planner_runs=planner_runs,
        )
    return TuneResult(
        study_name=name,
        storage=_where(storage),
        cluster=cluster,
        trials=trials,
        best=best[0] if best else None,
        best_runs=best or [],
        best_plan=best_plan,
        planner_trial=planner_trial,
        calibration=report,
        stop_reason=reason,
    )
