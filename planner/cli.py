"""``agilerl-plan``: memory plans, probes and tuning for GRPO with FSDP2.

    agilerl-plan probe MODEL --gpus N [workload and FSDPConfig flags] [--format json]
"""

from __future__ import annotations

import argparse
import json
import sys

from agilerl.distributed import FSDPConfig

from ._cli_fields import add_fields, collect_fields
from .workload import Workload

__all__ = ["main"]

GIB = 2**30


def _probe_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agilerl-plan probe",
        description="Measure a short real run of the GRPO trainer: per-rank, per-phase peak memory by component, "
                    "host memory, step time. Launches torchrun itself.",
    )
    parser.add_argument("model", help="model directory, config.json, hub id, or 'tiny:<arch>?...'")
    parser.add_argument("--gpus", type=int, default=1, help="ranks to launch (GPUs, or CPU processes with --device cpu)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--no-fsdp", action="store_true", help="train unsharded (single device or data parallel)")
    parser.add_argument("--generate", action="store_true", help="also measure one real generation (rollout phase)")
    parser.add_argument("--save", action="store_true", help="also measure a checkpoint save")
    parser.add_argument("--budget-gib", type=float, default=None, help="per-rank device budget; report whether it fits")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the whole launch is killed")
    parser.add_argument("--timed-steps", type=int, default=3, help="untracked learn steps to time")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    add_fields(parser, Workload, group_title="workload")
    add_fields(parser, FSDPConfig, group_title="FSDPConfig (ignored with --no-fsdp)")
    return parser


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def probe_main(argv: list[str]) -> int:
    from pydantic import ValidationError

    from .probe import ProbeRequest, run_probe

    parser = _probe_parser()
    args = parser.parse_args(argv)
    try:
        workload = Workload(**collect_fields(args, Workload))
        fsdp = None if args.no_fsdp else FSDPConfig(**collect_fields(args, FSDPConfig))
        request = ProbeRequest(
            model=args.model, workload=workload, fsdp=fsdp, nproc=args.gpus, device=args.device or _default_device(),
            generate=args.generate, save=args.save, timeout_s=args.timeout, timed_steps=args.timed_steps,
            memory_budget_bytes=int(args.budget_gib * GIB) if args.budget_gib else None,
        )
    except ValidationError as err:
        parser.error(str(err))
    progress = (lambda msg: print(f"[probe] {msg}", file=sys.stderr)) if args.format == "table" else None
    measurement = run_probe(request, progress=progress)
    if args.format == "json":
        print(json.dumps({"summary": measurement.summary(), **measurement.model_dump(mode="json")}, indent=2))
    else:
        print(measurement.table())
    if not measurement.ok:
        return 1
    return 0 if measurement.fits else 3


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "probe":
        return probe_main(argv[1:])
    print("usage: agilerl-plan probe MODEL --gpus N ...  (see agilerl-plan probe --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
