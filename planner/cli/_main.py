"""``agilerl-plan``: memory plans, probes and tuning for GRPO with FSDP2.

agilerl-plan MODEL --gpus N [--gpu H100-80GB] [workload flags] [--format table|json|yaml|python]
agilerl-plan MODEL --gpus N --tune [--trials K] [--storage URL]   (short real trials, Optuna)
agilerl-plan MODEL --tui                                          (interactive explorer)
agilerl-plan probe MODEL --gpus N [workload and FSDPConfig flags] [--format json]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

from agilerl.distributed import FSDPConfig
from agilerl.utils.cli import (
    ArgumentParser,
    host_port,
    margin_fraction,
    positive_float,
    positive_int,
    quiet_bitsandbytes,
    show_logs,
)

from ..output import check_output, write_output
from ..workload import Workload
from ._fields import add_fields, collect_fields, flag_name

__all__ = ["main"]


def _probe_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="agilerl-plan probe",
        description="Measure a short real run of the GRPO trainer: per-rank, per-phase peak memory by component, "
        "host memory, step time. Launches torchrun itself.",
        epilog="exit status: 0 fits (within --budget-gib, where given), 3 does not fit (out of memory, or over "
        "--budget-gib), 1 the run failed (a rank crashed or timed out), 2 bad input, 130 interrupted",
    )
    parser.add_argument("model", help="model directory, config.json, hub id, or 'tiny:<arch>?...'")
    parser.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        help="ranks to launch (GPUs, or CPU processes with --device cpu) [default: 1]",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--no-fsdp", action="store_true", help="train unsharded (single device or data parallel)")
    parser.add_argument("--generate", action="store_true", help="also measure one real generation (rollout phase)")
    parser.add_argument("--save", action="store_true", help="also measure a checkpoint save")
    parser.add_argument(
        "--budget-gib", type=positive_float, default=None, help="per-rank device budget; report whether it fits"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=600, help="seconds before the whole launch is killed [default: 600]"
    )
    parser.add_argument(
        "--timed-steps", type=positive_int, default=3, help="untracked learn steps to time [default: 3]"
    )
    parser.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        help="nodes the --gpus ranks span; without --rdzv-endpoint each node is a torchrun agent on "
        "this host (c10d rendezvous), so node boundaries (HSDP, host memory per node) are real [default: 1]",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="a probe across real nodes: run the same command on every node with this endpoint "
        "(node 0's address); each node reports its own ranks",
    )
    parser.add_argument(
        "--allow-download",
        action="store_true",
        help="let the trainer fetch a hub model that is not in the local Hugging Face cache",
    )
    parser.add_argument("--format", choices=["table", "json"], default="table")
    add_fields(parser, Workload, group_title="workload")
    add_fields(parser, FSDPConfig, group_title="FSDPConfig (ignored with --no-fsdp)")
    return parser


def probe_main(argv: list[str]) -> int:
    from pydantic import ValidationError

    from agilerl.utils.sources import check_model_source

    from .. import catalog
    from ..hardware import memory_bytes
    from ..models import ModelNotFound
    from ..probe import Device, ProbeRequest, default_device, probe_model, random_weights, run_probe

    parser = _probe_parser()
    args = parser.parse_args(argv)
    try:
        if args.gpus % args.nnodes:
            raise ValueError(f"--gpus {args.gpus} ranks do not split evenly over --nnodes {args.nnodes}")
        if args.rdzv_endpoint is not None and (args.nnodes == 1 or ":" not in args.rdzv_endpoint):
            raise ValueError("--rdzv-endpoint HOST:PORT is for a probe across nodes: give --nnodes > 1 too")
        if args.rdzv_endpoint is not None and not host_port(args.rdzv_endpoint):
            raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: give HOST:PORT, a port from 1 to 65535")
        if not args.model.strip():
            raise ValueError(
                "MODEL is empty: give a catalog name or hub id, a model directory, a config.json or a tiny: name"
            )
        if problem := _lora_flags_problem(parser, args):
            raise ValueError(problem)
        workload = Workload(**collect_fields(args, Workload))
        if args.generate and workload.generation == "none":
            raise ValueError("--generate times the rollout: it needs --generation hf or vllm, not none")
        workload.completions_per_rank(args.gpus)
        fixed = collect_fields(args, FSDPConfig)
        if args.no_fsdp and fixed:
            raise ValueError(
                f"--no-fsdp trains unsharded, so the FSDPConfig flags given "
                f"({', '.join(flag_name(k) for k in sorted(fixed))}) would be ignored; drop one or the other"
            )
        fsdp = None if args.no_fsdp else FSDPConfig(**fixed)
        if fsdp is not None:
            fsdp.check_world(args.gpus)
        device: Device = args.device or default_device()
        here = args.gpus if args.rdzv_endpoint is None else args.gpus // args.nnodes
        if device == "cuda" and _cuda_count() < here:
            raise ValueError(f"--device cuda needs {here} GPU(s) on this machine, which has {_cuda_count()}")
        # without --allow-download a model whose weights are not local is built from its config
        # (the catalog's, or a cached config.json) with random weights, as the tuner's trials are;
        # with it, a catalog alias is fetched under its hub id
        model = (catalog.resolve(args.model) or args.model) if args.allow_download else probe_model(args.model)
        check_model_source(model, allow_download=args.allow_download, for_training=False)
        budget = None if args.budget_gib is None else memory_bytes(args.budget_gib, "--budget-gib", least=1)
        _check_probe_inputs(args, workload, fixed, budget)
        if workload.generation == "vllm" and args.generate:
            from agilerl.utils.engine import EngineError, check_vllm_installed

            try:
                check_vllm_installed()
            except EngineError as err:
                raise ValueError(f"--generation vllm --generate: {err}") from None
        request = ProbeRequest(
            model=model,
            workload=workload,
            fsdp=fsdp,
            nproc=args.gpus,
            device=device,
            generate=args.generate,
            save=args.save,
            timeout_s=args.timeout,
            timed_steps=args.timed_steps,
            memory_budget_bytes=budget,
            nnodes=args.nnodes,
            rdzv_endpoint=args.rdzv_endpoint,
        )
    except (ValidationError, ValueError, ModelNotFound) as err:
        print(f"agilerl-plan probe: error: {_clean(err)}", file=sys.stderr)
        return 2
    progress = (lambda msg: print(f"[probe] {msg}", file=sys.stderr)) if args.format == "table" else None
    if progress is not None and random_weights(model):
        progress(
            f"{args.model}: no weights in the local Hugging Face cache, so random weights from its config "
            "(memory and speed do not depend on their values; --allow-download fetches the real ones)"
        )
    measurement = run_probe(request, progress=progress)
    if args.format == "json":
        print(json.dumps({"summary": measurement.summary(), **measurement.model_dump(mode="json")}, indent=2))
    else:
        print(measurement.table())
    if not measurement.ok:
        return 1
    return 0 if measurement.fits else 3


def _check_probe_inputs(args: argparse.Namespace, workload: Workload, fixed: dict, budget: int | None) -> None:
    """Raise ValueError for a probe the planner would refuse to plan (the same rules: an expert
    layout on a dense model, offloads the trainer refuses, ...), before any rank launches. Rules
    on memory (a vLLM fraction too small for its engine) are judged against ``--budget-gib``,
    and without one not at all: the probe is there to measure it."""
    from ..choose import check_inputs
    from ..hardware import CPU_DEVICE, Cluster
    from ..models import load_model_spec
    from ..request import PlanRequest

    if other := workload.other_trainer_fields():
        raise ValueError(f"{', '.join(other)} describe(s) another trainer; a probe runs this project's: leave it out")
    device = CPU_DEVICE.model_copy(update={"memory_bytes": budget if budget is not None else 2**50})
    cluster = Cluster(gpu=device, num_gpus=args.gpus, gpus_per_node=args.gpus // args.nnodes)
    sharding = "none" if args.no_fsdp else "fsdp"
    PlanRequest.build(cluster, workload, fixed, sharding=sharding)  # RequestError, a ValueError
    spec = load_model_spec(args.model, lora_targets=workload.lora_targets, allow_download=args.allow_download)
    check_inputs(spec, workload, cluster, fixed, sharding)


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover
        return 0


def _plan_parser() -> argparse.ArgumentParser:
    from ..hardware import GPUS, MARGIN_FRACTION
    from ..request import MARGIN_HELP, SHARDING_HELP, SHARDINGS

    parser = ArgumentParser(
        prog="agilerl-plan",
        description="Will GRPO + LoRA on this model fit, how much memory each GPU needs (per phase and "
        "component), and which FSDPConfig to use and why. Offline for catalog models. "
        "Subcommand: `agilerl-plan probe ...` measures a real run.",
        epilog="exit status: 0 fits, 3 does not fit, 2 bad input; --tune: 0 a measured config fits, 3 none did, "
        "130 interrupted (rerun to resume)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("model", help="catalog name or hub id, model directory, config.json, or 'tiny:<arch>?...'")
    parser.add_argument("--gpus", type=positive_int, default=1, help="trainer GPUs in total [default: 1]")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, default=None, help="GPUs per node (default: all on one node)"
    )
    parser.add_argument("--gpu", default="H100-80GB", help=f"GPU kind: {', '.join(GPUS)} [default: H100-80GB]")
    parser.add_argument(
        "--gpu-memory",
        type=positive_float,
        default=None,
        metavar="GIB",
        help="GPU memory in GiB (overrides the catalog figure of --gpu)",
    )
    parser.add_argument(
        "--host-memory",
        type=positive_float,
        default=None,
        metavar="GIB",
        help="host memory (RAM) per node in GiB: the plan then fits only if every node's host holds its ranks' "
        "(offloaded optimizer state, a gathered checkpoint, engine ranks) [default: reported, not judged]",
    )
    parser.add_argument("--sharding", choices=SHARDINGS, default="auto", help=SHARDING_HELP)
    parser.add_argument(
        "--margin", type=margin_fraction, default=MARGIN_FRACTION, help=f"{MARGIN_HELP} [default: {MARGIN_FRACTION}]"
    )
    parser.add_argument("--format", choices=["table", "json", "yaml", "python"], default="table")
    parser.add_argument("--output", metavar="MANIFEST", help="write the manifest YAML for `agilerl.train` here")
    parser.add_argument("--allow-download", action="store_true", help="fetch the config from the hub if not local")
    parser.add_argument("--tui", action="store_true", help="explore the plan interactively (needs the [tui] extra)")
    add_fields(parser, Workload, group_title="workload")
    add_fields(parser, FSDPConfig, group_title="FSDPConfig fields to fix (the planner chooses the rest)")
    from ..tune import add_tune_arguments

    add_tune_arguments(parser)
    return parser


def plan_main(argv: list[str]) -> int:
    from pydantic import ValidationError

    from .. import emit
    from ..choose import check_inputs, plan_request
    from ..hardware import MAX_GPUS, Cluster, gpu_by_name, memory_bytes, with_memory
    from ..models import ModelNotFound, load_model_spec
    from ..request import PlanRequest

    parser = _plan_parser()
    args = parser.parse_args(argv)
    try:
        gpu = gpu_by_name(args.gpu)
        if args.gpu_memory is not None:
            gpu = with_memory(gpu, args.gpu_memory, "--gpu-memory")
        if args.gpus > MAX_GPUS:
            raise ValueError(f"--gpus {args.gpus} is more than the {MAX_GPUS} GPUs planned for")
        host = None if args.host_memory is None else memory_bytes(args.host_memory, "--host-memory")
        cluster = Cluster(
            gpu=gpu, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node, host_memory_per_node_bytes=host
        )
        if not args.model.strip():
            raise ValueError(
                "MODEL is empty: give a catalog name or hub id, a model directory, a config.json or a tiny: name"
            )
        check_output(args.output, args.model, storage=_study_url(args))
        if problem := _lora_flags_problem(parser, args):
            raise ValueError(problem)
        if not args.tune and (extra := _flags_given(parser, args, keep=_not_tune_only(parser, args))):
            verb = "applies" if len(extra) == 1 else "apply"
            raise ValueError(f"{', '.join(extra)} only {verb} with --tune: add --tune, or leave them out")
        if args.tui:
            if extra := _flags_given(parser, args, keep=_TUI_FLAGS):
                raise ValueError(
                    "--tui opens the explorer with MODEL, --gpus, --gpus-per-node, --gpu, --gpu-memory and "
                    "--host-memory; "
                    f"set {', '.join(extra)} in the explorer (or plan without --tui)"
                )
            try:
                from tui.app import run_with
            except ImportError as err:
                raise ValueError(
                    f"--tui needs the explorer's extra: pip install 'agilerl-fsdp-planner[tui]' ({err})"
                ) from None
            run_with(args)
            return 0
        request = PlanRequest.build(
            cluster,
            Workload(**collect_fields(args, Workload)),
            collect_fields(args, FSDPConfig),
            sharding=args.sharding,
            margin_fraction=args.margin,
        )
        if problem := request.manifest_problem():
            raise ValueError(problem)
        if args.tune:
            from ..tune import check_tune_arguments

            check_tune_arguments(args)
            if other := request.workload.other_trainer_fields():
                raise ValueError(
                    f"--tune: {', '.join(other)} describe(s) another trainer; the trials run this "
                    "project's: leave it out"
                )
    except (KeyError, ValidationError, ValueError) as err:
        return _bad_input(err)
    try:
        spec = load_model_spec(
            args.model, lora_targets=request.workload.lora_targets, allow_download=args.allow_download
        )
        if args.tune:  # refused before the study opens (plan_request checks the same itself)
            check_inputs(spec, request.workload, request.cluster, dict(request.fixed), request.sharding)
        else:
            result = plan_request(spec, request)
    except (ModelNotFound, ValueError) as err:
        return _bad_input(err)
    if args.tune:
        from ..tune import tune_main

        return tune_main(args, spec=spec, model=args.model, request=request)
    if args.format == "json":
        print(json.dumps(emit.plan_json(result), indent=2))
    elif args.format == "yaml":
        print(emit.manifest_yaml(result), end="")
    elif args.format == "python":
        print(emit.python_snippet(result))
    else:
        print(emit.table(result))
    if args.output:
        try:
            write_output(args.output, emit.manifest_yaml(result))
        except OSError as err:
            print(f"agilerl-plan: error: --output {args.output}: {err.strerror or err}", file=sys.stderr)
            return 2
        if args.format == "table":
            print(f"\nmanifest written to {args.output}")
    return 0 if result.fits else 3


#: What ``--tui`` takes from the command line; every other knob is set in the explorer.
_TUI_FLAGS = ("model", "gpus", "gpus_per_node", "gpu", "gpu_memory", "host_memory", "tui", "allow_download")


def _flags_given(parser: argparse.ArgumentParser, args: argparse.Namespace, *, keep: tuple[str, ...]) -> list[str]:
    """The flags ``args`` sets away from their defaults, other than those of ``keep``'s dests."""
    return [
        action.option_strings[0] if action.option_strings else action.dest
        for action in parser._actions
        if action.dest not in keep
        and hasattr(args, action.dest)
        and getattr(args, action.dest) != parser.get_default(action.dest)
    ]


def _version() -> str:
    """The installed package's version ("unknown" from a source tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agilerl-fsdp-planner")
    except PackageNotFoundError:
        return "unknown"


def _not_tune_only(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    """The dests of ``args`` other than the flags that only ``--tune`` reads."""
    from ..tune import TUNE_GROUP_TITLE

    tune_only = {
        action.dest
        for group in parser._action_groups
        if group.title == TUNE_GROUP_TITLE
        for action in group._group_actions
        if action.dest != "tune"
    }
    return tuple(d for d in vars(args) if d not in tune_only)


def _study_url(args: argparse.Namespace) -> str | None:
    """The tuner's study URL under ``--tune`` (None otherwise, or in memory); ValueError for a bad ``--storage``."""
    if not getattr(args, "tune", False):
        return None
    from ..tune import storage_url

    return storage_url(args.storage)


def _lora_flags_problem(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """LoRA flags beside --full-finetune, which trains no adapters (they would be ignored)."""
    if not getattr(args, "Workload.full_finetune", None):
        return None
    lora = tuple(d for d in vars(args) if d.startswith("Workload.lora_"))
    given = _flags_given(parser, args, keep=tuple(d for d in vars(args) if d not in lora))
    if not given:
        return None
    return f"--full-finetune trains every parameter and no LoRA adapters: drop {', '.join(given)}"


def _bad_input(err: Exception) -> int:
    """Bad input: one line on stderr, exit status 2."""
    print(f"agilerl-plan: error: {_clean(err)}", file=sys.stderr)
    return 2


def _field_error(error: Any) -> str:
    """One pydantic error: its field and message; a rule over several fields names them itself."""
    message = error["msg"].removeprefix("Value error, ")
    field = ".".join(str(part) for part in error["loc"])
    return f"{field}: {message}" if field else message


def _clean(err: Exception) -> str:
    """One line: a ValidationError's field errors joined, a KeyError without its quotes."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        text = "; ".join(_field_error(e) for e in err.errors())
    elif isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    else:
        text = str(err)
    return " ".join(text.split())


#: A reader that went away (``agilerl-plan ... | head -1``): the status a tool killed by SIGPIPE has.
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_bitsandbytes()  # a plan runs no 4-bit kernel (a probe, in processes of its own, still warns)
    try:
        with show_logs("stderr", "planner", "agilerl"):  # stdout carries the plan, the manifest or the JSON
            if argv and argv[0] == "probe":
                return probe_main(argv[1:])
            return plan_main(argv)
    except KeyboardInterrupt:
        # Ctrl-C: a probe's launch is killed on the way out (run_probe); --tune says its own line
        print("agilerl-plan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # what the reader took is all it wanted: no traceback
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except OSError as err:
        if err.errno not in _WRITE_ERRNOS:
            raise
        # the output could not be written (stdout on a full disk, say): one line, exit 2
        where = f" ({err.filename})" if err.filename else " (standard output)"
        print(f"agilerl-plan: error: cannot write the output{where}: {err.strerror or err}", file=sys.stderr)
        _stdout_to_devnull()
        return 2


#: What writing a plan's output fails with: a full disk, a quota, a file too large, an I/O error.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
