"""The ``--tune`` flags of ``agilerl-plan`` and their checks: kept apart from :mod:`planner.tune`
so that building the command line's parser imports nothing of the tuner (its objective, the
probe, the study runner)."""

from __future__ import annotations

import argparse

from agilerl.utils.cli import non_negative_int, positive_float, positive_int

from ._storage import DEFAULT_STORAGE


def _seed(text: str) -> int:
    """A sampler seed as NumPy takes it (Optuna seeds NumPy): 0 to 2**32 - 1."""
    value = non_negative_int(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"must be below 2**32, got {text!r}")
    return value


__all__ = ["TUNE_GROUP_TITLE", "add_tune_arguments", "check_tune_arguments"]


#: The parser group of the ``--tune`` flags: every flag in it but ``--tune`` only the tuner reads.
TUNE_GROUP_TITLE = "tuning with real trials (--tune; needs the 'tune' extra: optuna)"


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--tune`` flags of ``agilerl-plan``."""
    g = parser.add_argument_group(TUNE_GROUP_TITLE)
    g.add_argument(
        "--tune",
        action="store_true",
        help="refine the plan with short real runs (Optuna trials) and emit the best measured config",
    )
    g.add_argument(
        "--trials",
        type=positive_int,
        default=20,
        metavar="K",
        help="probes to launch in the study, counted across restarts and workers [default: 20]",
    )
    g.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="stop starting trials after S seconds of this session [default: no limit]",
    )
    g.add_argument(
        "--storage",
        default=DEFAULT_STORAGE,
        metavar="URL",
        help="study storage: a SQLite file path, 'memory', or a SQLAlchemy URL "
        "(postgresql://... lets workers on several nodes tune one study) "
        f"[default: ./{DEFAULT_STORAGE}]",
    )
    g.add_argument(
        "--study-name",
        default=None,
        metavar="NAME",
        help="study to create or resume [default: derived from model, cluster and workload]",
    )
    g.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where trials run [default: cuda when available]; on cpu, --gpu-memory is the per-rank budget",
    )
    g.add_argument(
        "--trial-timeout",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="seconds before one trial's launch is killed and recorded as crashed [default: 600]",
    )
    g.add_argument(
        "--timed-steps",
        type=positive_int,
        default=3,
        metavar="N",
        help="timed learn steps per trial (tokens/s is their median) [default: 3]",
    )
    g.add_argument(
        "--skip-rollout",
        action="store_true",
        help="do not measure a real generation in each trial (faster; the rollout phase is then only estimated)",
    )
    g.add_argument(
        "--confirm",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="spend the last N of the trials (at most a quarter) measuring the fastest candidates a "
        "second time; the pick is by median, so one lucky run does not win (worth it when "
        "run-to-run noise is large next to the differences between configs) [default: 0]",
    )
    g.add_argument("--seed", type=_seed, default=None, help="sampler seed, 0 to 2**32 - 1 [default: random]")
    g.add_argument(
        "--no-calibration", action="store_true", help="do not fit and save the estimate's coefficients from the trials"
    )
    g.add_argument(
        "--heartbeat-interval",
        type=positive_int,
        default=10,
        metavar="S",
        help="seconds between a running trial's heartbeats; a trial silent for 3 intervals is "
        "marked FAIL by the next tuner [default: 10]",
    )


def check_tune_arguments(args: argparse.Namespace) -> None:
    """Refuse bad ``--tune`` flags before any model is read (ValueError naming the flag)."""
    from ._storage import storage_url

    storage_url(args.storage)
    if args.study_name is not None and not args.study_name.strip():
        raise ValueError("--study-name is empty: give a name, or leave it out for one derived from the run")
