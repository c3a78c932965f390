"""The study: create or resume it, seed the planner's pick, and drive probe trials with ask/tell.

A trial is a subprocess launch, so the loop uses ask/tell rather than
``study.optimize``: it decides itself when to stop (``max_launches`` probes in
the study, across restarts and workers; a wall-clock limit; the whole space
seen; the sampler only proposing repeats; queued trials always run first),
keeps each trial's heartbeat, and on Ctrl-C or SIGTERM marks the running trial
FAIL after the probe has killed its launch. Queued trials are the planner's
pick (first) and second runs of the fastest candidates (last), which guard the
pick against one lucky, noisy run.
"""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from agilerl.utils.lifetime import identity, is_gone

from ._objective import CONSTRAINT_KEY, Objective
from ._storage import heartbeat

__all__ = [
    "create_study",
    "FINGERPRINT_KEY",
    "OWNER_KEY",
    "check_fingerprint",
    "fail_orphaned_trials",
    "launch_claim",
    "enqueue_planner_pick",
    "enqueue_confirmations",
    "run_trials",
    "launched_trials",
    "finished",
    "measured_by_key",
    "StopReason",
]

StopReason = str


#: A trial's user attribute naming the tuner process that runs it (agilerl.utils.lifetime.identity).
OWNER_KEY = "owner"

#: The study's user attribute that records what its measurements belong to.
FINGERPRINT_KEY = "fingerprint"


def _differences(recorded: Any, wanted: Any, where: str = "") -> list[str]:
    if isinstance(recorded, dict) or isinstance(wanted, dict):
        if recorded is None or wanted is None:  # a part one side does not record: each of its fields differs
            recorded, wanted = recorded or {}, wanted or {}
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        out: list[str] = []
        for key in sorted(set(recorded) | set(wanted)):
            out += _differences(recorded.get(key), wanted.get(key), f"{where}.{key}" if where else key)
        return out
    return [] if recorded == wanted else [f"{where} ({recorded!r} in the study, {wanted!r} now)"]


def check_fingerprint(study: Any, fingerprint: dict[str, Any]) -> None:
    """Record what the study measures (model spec, workload, cluster, fixed fields), or refuse
    to resume it for anything else: raise ValueError naming the differences.

    Measurements of one model's configs say nothing about another's: a study
    resumed for the wrong run would emit the other run's measured peak and
    throughput as this run's tuned plan.
    """
    wanted = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
    recorded = study.user_attrs.get(FINGERPRINT_KEY)
    if recorded is None:
        if study.get_trials(deepcopy=False):
            raise ValueError(
                f"study {study.study_name!r} has trials but no record of the run they measured "
                "(made by an older version): give a new --study-name"
            )
        study.set_user_attr(FINGERPRINT_KEY, wanted)
        return
    diff = _differences(recorded, wanted)
    if diff:
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        raise ValueError(
            f"study {study.study_name!r} was built for another run, so its measurements do not "
            f"apply here: {shown}. Give a new --study-name, or leave it out for one derived from "
            "the run"
        )


def fail_orphaned_trials(study: Any, storage: Any) -> list[int]:
    """Mark FAIL, now, every RUNNING trial whose tuner on this host is dead; their numbers.

    Trials of tuners elsewhere are left to the heartbeat's grace period.
    """
    import optuna

    failed = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if is_gone(t.user_attrs.get(OWNER_KEY)):
            try:
                storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
            except RuntimeError:  # finished meanwhile (another worker got there first)
                continue
            failed.append(t.number)
    return failed


def launch_claim(study: Any, storage: Any, *, max_launches: int, poll_s: float = 1.0) -> Callable[[Any, str], bool]:
    """``claim(trial, key)`` for :class:`~planner.tune._objective.Objective` with workers sharing a study.

    A trial measuring ``key`` goes ahead only when no lower-numbered RUNNING
    trial has the same key: it waits for that one (whose result it then reuses)
    instead of launching the same candidate twice. Waiting only on lower numbers
    cannot deadlock. A trial of a dead worker stops blocking at once (its owner
    is checked on every poll) or after the heartbeat grace (another host's).
    The claim is False when the launches finished or in flight on lower-numbered
    trials already reach ``max_launches``.
    """
    import optuna

    running = (optuna.trial.TrialState.RUNNING,)

    def claim(trial: Any, key: str) -> bool:
        while True:
            ahead = [
                t
                for t in study.get_trials(deepcopy=False, states=running)
                if t.number < trial.number and t.user_attrs.get("key") == key
            ]
            if not ahead:
                break
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
            fail_orphaned_trials(study, storage)
            time.sleep(poll_s)
        trials = study.get_trials(deepcopy=False)
        launched = sum(
            1
            for t in trials
            if t.user_attrs.get("launched")
            and (
                t.state == optuna.trial.TrialState.COMPLETE
                or (t.state == optuna.trial.TrialState.RUNNING and t.number < trial.number)
            )
        )
        return launched < max_launches

    return claim


def create_study(*, storage: Any, study_name: str, seed: int | None, n_startup_trials: int) -> Any:
    """Load or create the study (maximise tokens/s) with a constrained TPE sampler."""
    import optuna

    kwargs: dict[str, Any] = {}
    if not hasattr(optuna.trial.Trial, "set_constraint"):  # Optuna < 5 reads constraints through a function
        kwargs["constraints_func"] = lambda t: (t.user_attrs.get(CONSTRAINT_KEY, 1.0),)
    if tuple(int(x) for x in optuna.__version__.split(".")[:2] if x.isdigit()) < (4, 9):
        kwargs["warn_independent_sampling"] = False  # deprecated (a FutureWarning per study) from 4.9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # group=True: the FSDP knobs exist only for sharded candidates (a conditional space), which
        # multivariate TPE models per group instead of falling back to independent sampling.
        sampler = optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=n_startup_trials, multivariate=True, group=True, constant_liar=True, **kwargs
        )
    study = optuna.create_study(
        storage=storage, study_name=study_name, direction="maximize", sampler=sampler, load_if_exists=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    fail_orphaned_trials(study, storage)
    return study


def finished(study: Any) -> list[Any]:
    import optuna

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def launched_trials(study: Any) -> list[Any]:
    return [t for t in finished(study) if t.user_attrs.get("launched")]


def enqueue_planner_pick(study: Any, params: dict[str, Any] | None) -> bool:
    """Enqueue the planner's pick first, unless it was measured, is queued or is running already."""
    import optuna

    if params is None:
        return False
    active = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)
    for t in study.get_trials(deepcopy=False, states=active):
        if t.user_attrs.get("source") == "planner":
            return False
    study.enqueue_trial(params, user_attrs={"source": "planner"})
    return True


def measured_by_key(trials: list[Any]) -> dict[str, list[Any]]:
    """Launched, finished trials that measured a step time, grouped by candidate (first run first)."""
    out: dict[str, list[Any]] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if (
            t.state.name == "COMPLETE"
            and t.user_attrs.get("launched")
            and t.user_attrs.get("status") in ("fits", "over_budget")
        ):
            out.setdefault(t.user_attrs["key"], []).append(t)
    return out


def median_tokens(runs: list[Any]) -> float:
    return statistics.median(t.user_attrs.get("tokens_per_second") or 0.0 for t in runs)


def enqueue_confirmations(study: Any, count: int) -> int:
    """Queue a second measurement of the ``count`` fastest fitting candidates measured once.

    The best of a few noisy runs is biased upwards (a lucky run wins); the pick is made on the
    median of each candidate's runs. Returns how many were queued (none twice, across restarts).
    """
    import optuna

    if count <= 0:
        return 0
    states = (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)
    confirmed = {
        t.user_attrs.get("key") or t.user_attrs.get("confirm_key")
        for t in study.get_trials(deepcopy=False, states=states)
        if "confirm_of" in t.user_attrs
    }
    groups = measured_by_key(finished(study))
    fitting = [k for k, runs in groups.items() if all(t.user_attrs["status"] == "fits" for t in runs)]
    fitting.sort(key=lambda k: -median_tokens(groups[k]))
    queued = 0
    for key in fitting[:count]:
        if key in confirmed or len(groups[key]) > 1:
            continue
        first = groups[key][0]
        study.enqueue_trial(
            first.params, user_attrs={"confirm_of": first.number, "confirm_key": key}, skip_if_exists=False
        )
        queued += 1
    return queued


def earlier_result(study: Any) -> Callable[[str], dict[str, Any] | None]:
    """``previous(key)`` for the objective: the first finished, non-repeat trial of a candidate."""

    def previous(key: str) -> dict[str, Any] | None:
        for t in finished(study):
            if t.user_attrs.get("key") == key and t.user_attrs.get("status") not in (None, "repeat"):
                return {**t.user_attrs, "number": t.number, "value": t.value}
        return None

    return previous


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so a killed tuner still kills its probe and fails its trial."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_trials(
    study: Any,
    objective: Objective,
    *,
    storage: Any,
    max_launches: int,
    space_size: int,
    admissible: set[str] | None = None,
    timeout_s: float | None = None,
    patience: int = 12,
    on_trial: Callable[[Any], None] | None = None,
    only_queued: bool = False,
    unseen: Callable[[set[str]], dict[str, Any] | None] | None = None,
) -> StopReason:
    """Ask, evaluate, tell until a stop condition; returns why it stopped.

    ``admissible``: keys of every candidate the estimate lets through, when the space was small
    enough to enumerate; the study stops once each has a result. ``only_queued``: run the
    queued trials (the confirmations) and stop, proposing none. ``unseen(seen keys)``: the params
    of a candidate the estimate admits that no trial has seen, or None; after ``patience``
    repeats in a row the study goes on with it (queued) rather than stop while the sampler
    circles candidates it has seen, and stops once there is none. Raises KeyboardInterrupt after
    marking the interrupted trial FAIL.
    """
    import optuna

    start = time.monotonic()
    repeats = 0
    with _sigterm_as_interrupt():
        while True:
            done = finished(study)
            if sum(1 for t in done if t.user_attrs.get("launched")) >= max_launches:
                return f"{max_launches} trials launched"
            if timeout_s is not None and time.monotonic() - start >= timeout_s:
                return f"the {timeout_s:g} s time limit"
            seen = {t.user_attrs.get("key") for t in done}
            queued = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
            if only_queued and not queued:
                return "the queued confirmations were measured"
            if not queued and len(seen) >= space_size:
                return f"all {space_size} candidates seen"
            if not queued and admissible is not None and admissible <= seen:
                return f"every candidate the estimate admits ({len(admissible)}) was measured"
            if not queued and repeats >= patience:
                params = unseen(seen) if unseen is not None else None
                if params is None:
                    return f"the sampler proposed only repeats {patience} times in a row"
                study.enqueue_trial(params, user_attrs={"source": "unseen"})
                repeats = 0
                continue
            with warnings.catch_warnings():
                # Heartbeats are recorded here, beside the probe, not by Study.optimize (which would
                # also fail stale trials: done here, with the trials of dead tuners on this host).
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed")
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
                fail_orphaned_trials(study, storage)
                trial = study.ask()
            trial.set_user_attr(OWNER_KEY, identity())  # a rerun fails it at once if this tuner dies
            try:
                with heartbeat(storage, trial._trial_id):
                    value = objective(trial)
            except optuna.TrialPruned:  # not launched: the launch budget went to other workers
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            except KeyboardInterrupt:
                trial.set_user_attr("status", "interrupted")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            except Exception as err:  # a bug on our side (probes never raise): keep the study consistent
                trial.set_user_attr("status", "error")
                trial.set_user_attr("why", f"{type(err).__name__}: {err}")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            frozen = study.tell(trial, value)
            repeats = repeats + 1 if frozen.user_attrs.get("status") == "repeat" else 0
            if on_trial is not None:
                on_trial(frozen)
