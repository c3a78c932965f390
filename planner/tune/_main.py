"""``agilerl-plan ... --tune``: run the study the command line asks for, print its trials and emit the
best measured config like a plan (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ..hardware import CPU_DEVICE
from ..probe import Device, Measurement, ProbeRequest, default_device
from ..request import PlanRequest
from ..spec import ModelSpec
from ._report import trial_json, trials_table
from ._run import TuneResult, tune

__all__ = ["tune_main"]


def tune_main(
    args: argparse.Namespace,
    *,
    spec: ModelSpec,
    model: str,
    request: PlanRequest,
    probe: Callable[[ProbeRequest], Measurement] | None = None,
) -> int:
    """Run ``--tune``; print per ``--format``, write ``--output``. Exit 0: a fitting config was
    measured; 3: none was; 2: bad input; 130: interrupted (rerun the command to resume). The
    estimate uses the coefficients of the GPU the trials run on (``coefficients_for``)."""
    from ..calibration import coefficients_for

    try:
        import optuna
    except ImportError:
        print("agilerl-plan: error: --tune needs Optuna: pip install 'agilerl-fsdp-planner[tune]'", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own progress lines say what happens
    device: Device = getattr(args, "device", None) or default_device()
    if device == "cpu":
        # CPU probes: a CPU "device" (no GPU-only terms) whose memory is the per-rank budget.
        cluster = request.cluster
        cpu = CPU_DEVICE.model_copy(update={"memory_bytes": cluster.gpu.memory_bytes})
        request = request.with_cluster(cluster.model_copy(update={"gpu": cpu}))
    else:
        import torch

        have = torch.cuda.device_count()
        if have < request.cluster.num_gpus:
            print(
                f"agilerl-plan: error: --gpus {request.cluster.num_gpus} but this machine has {have} GPU(s): "
                "every trial runs on this machine",
                file=sys.stderr,
            )
            return 2
    if request.workload.generation == "vllm" and not args.skip_rollout and probe is None:
        from agilerl.utils.engine import EngineError, check_vllm_installed

        try:  # the trials roll out through a real engine, as the run does
            check_vllm_installed()
        except EngineError as err:
            print(f"agilerl-plan: error: --generation vllm: {err} (or --skip-rollout)", file=sys.stderr)
            return 2
    fmt = getattr(args, "format", "table")

    def say(msg: str) -> None:
        print(f"[tune] {msg}", file=sys.stderr, flush=True)

    try:
        result = tune(
            spec=spec,
            model=model,
            request=request,
            coefficients=coefficients_for(request.cluster.gpu),
            device=device,
            max_trials=args.trials,
            timeout_s=args.timeout,
            storage=args.storage,
            study_name=args.study_name,
            trial_timeout_s=args.trial_timeout,
            timed_steps=args.timed_steps,
            generate=False if args.skip_rollout else None,
            seed=args.seed,
            heartbeat_interval_s=args.heartbeat_interval,
            calibration=not args.no_calibration,
            confirm=args.confirm,
            probe=probe,
            progress=say,
        )
    except KeyboardInterrupt:
        say(
            "interrupted: the running trial is marked FAIL and its processes are gone; "
            "run the same command again to resume"
        )
        return 130
    except ValueError as err:
        print(f"agilerl-plan: error: {err}", file=sys.stderr)
        return 2
    if not _emit(result, fmt=fmt, output=getattr(args, "output", None)):
        return 2
    return 0 if result.best_plan is not None else 3


def _emit(result: TuneResult, *, fmt: str, output: str | None) -> bool:
    """Print the result and write ``--output``; False (said in one line) when the manifest could
    not be written: the study is kept in its storage, and rerunning the command writes it."""
    from .. import emit
    from ..output import write_output

    best_number = result.best.number if result.best is not None else None
    table = trials_table(result.trials, best_numbers=tuple(t.number for t in result.best_runs))
    summary = (
        f"study {result.study_name!r} ({result.storage}): {result.num_launched} trial(s) launched, "
        f"{len(result.trials)} in all; stopped: {result.stop_reason}"
    )
    written = True
    if output and result.best_plan is not None:
        try:
            write_output(output, emit.manifest_yaml(result.best_plan))
        except (OSError, ValueError) as err:
            written = False
            reason = getattr(err, "strerror", None) or err
            print(
                f"agilerl-plan: error: --output {output}: {reason} (the study is kept in {result.storage}: "
                "run the command again to write it)",
                file=sys.stderr,
            )
    if fmt == "json":
        print(
            json.dumps(
                {
                    "study_name": result.study_name,
                    "storage": result.storage,
                    "stop_reason": result.stop_reason,
                    "num_launched": result.num_launched,
                    "trials": [trial_json(t) for t in result.trials],
                    "best_trial": best_number,
                    "best_trials": [t.number for t in result.best_runs],
                    "best_tokens_per_second": result.best_tokens_per_second,
                    "best": emit.plan_json(result.best_plan) if result.best_plan is not None else None,
                    "calibration": result.calibration.model_dump() if result.calibration else None,
                },
                indent=2,
                default=str,
            )
        )
        return written
    if fmt in ("yaml", "python"):
        # stdout carries only the artefact; the account of the trials goes to stderr.
        print(f"{summary}\n{table}", file=sys.stderr)
        if result.calibration:
            print(result.calibration.line(), file=sys.stderr)
        if result.best_plan is None:
            print("no trial measured a config that fits", file=sys.stderr)
        elif fmt == "yaml":
            print(emit.manifest_yaml(result.best_plan), end="")
        else:
            print(emit.python_snippet(result.best_plan))
        return written
    print(summary)
    print(table)
    if result.calibration:
        print(result.calibration.line())
    print()
    if result.best_plan is None:
        print("no trial measured a config that fits the budget less the margin: see 'why infeasible' above")
    else:
        print(emit.table(result.best_plan))
        if output and written:
            print(f"\nmanifest written to {output}")
    return written
