"""``agilerl-train``: train from a manifest on one device or on many ranks.

    agilerl-train manifest.yaml [--device cpu|cuda] [--max-steps N]         # one device
    agilerl-train --nproc-per-node=8 manifest.yaml                           # 8 ranks on this host
    agilerl-train --nproc-per-node=8 --nnodes=2 --rdzv-endpoint=HOST:29500 manifest.yaml
                                                                             # on each of 2 nodes

On one rank it is ``python -m agilerl.train`` (torchrun where the manifest shards with FSDP2 on
one rank, which needs a process group, or ``--max-restarts`` is given). On several it is torchrun (run in this process,
c10d rendezvous: ``--standalone`` on one node) on ``agilerl.train``, with these differences, seen
only when something is wrong:

- the launch is checked before any rank starts (the manifest, the ranks it needs for the ranks
  given, the model, the checkpoint directory: :func:`agilerl.train.check_launch`), so bad input
  costs no rank start-up and is said once;
- a rank that stops on bad input writes its one line to its torchrun error file, not the
  terminal, and the launcher says each distinct line once (``rank R:`` in front where the ranks
  differ) and exits 2, where torchrun prints every rank's line and a traceback of its own and
  exits 1. A rank that crashes prints its own traceback, and the launcher names it and exits 1;
- nodes that do not all join within ``--rdzv-timeout`` seconds (exit 2), or a rendezvous that
  fails (an endpoint that cannot be reached, a node lost mid-run; exit 1), end in one line of
  the launcher's, not a rendezvous traceback.

torchrun itself stays usable (``torchrun --nproc_per_node=N -m agilerl.train manifest.yaml``)
for its options this command does not take (a static rendezvous, log directories), and where a
cluster sets torchrun's ``PET_*`` variables: this command reads its arguments only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from agilerl.utils.cli import ArgumentParser, non_negative_int, positive_int

__all__ = ["main"]

PROG = "agilerl-train"


def _endpoint(text: str) -> str:
    """``HOST:PORT`` (or ``HOST``, torchrun's port 29400), checked here rather than deep in torchrun."""
    host, _, port = text.rpartition(":") if ":" in text else (text, ":", "29400")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a port in 1-65535, got {text!r}")
    return text


def _ranks_per_node(text: str) -> int | str:
    """A positive count, or ``gpu``: one rank per GPU of this node (counted once parsing is done)."""
    return "gpu" if text == "gpu" else positive_int(text)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from agilerl.train import add_run_arguments

    add_run_arguments(parser)
    launch = parser.add_argument_group("launch (torchrun's options of the same names)")
    launch.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_ranks_per_node,
        default=1,
        metavar="N|gpu",
        help="ranks on this node, or gpu: one per GPU it has (default 1)",
    )
    launch.add_argument("--nnodes", type=positive_int, default=1, help="nodes, each running this command (default 1)")
    launch.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        type=_endpoint,
        metavar="HOST:PORT",
        help="with --nnodes > 1: where the nodes meet, the same on every node (a host of one of them)",
    )
    launch.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        default="agilerl-train",
        metavar="ID",
        help="with --nnodes > 1: the job's name at the endpoint, the same on every node (default agilerl-train)",
    )
    launch.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        type=positive_int,
        default=900,
        metavar="SECONDS",
        help="with --nnodes > 1: how long a node waits for the others (default 900)",
    )
    launch.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=non_negative_int,
        default=0,
        help="restarts of every rank after one fails (default 0); a restarted run resumes from its "
        "newest checkpoint (training.checkpoint_dir)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run_argv = [args.manifest]
    if args.device is not None:
        run_argv += ["--device", args.device]
    if args.max_steps is not None:
        run_argv += ["--max-steps", str(args.max_steps)]
    if args.nnodes > 1 and not args.rdzv_endpoint:
        parser.error(f"--nnodes={args.nnodes} needs --rdzv-endpoint=HOST:PORT, the same on every node")
    if args.nnodes == 1 and args.rdzv_endpoint:
        parser.error("--rdzv-endpoint is for --nnodes > 1 (one node finds a free port itself)")
    if args.nproc_per_node == "gpu":
        import torch

        args.nproc_per_node = torch.cuda.device_count()
        if not args.nproc_per_node:
            parser.error("--nproc-per-node=gpu: this node has no CUDA GPU; give a number of ranks")
    world = args.nproc_per_node * args.nnodes
    from agilerl.manifest import load_manifest
    from agilerl.train import check_launch, refuse
    from agilerl.train import main as train_main

    try:
        manifest = load_manifest(args.manifest)
        fsdp = manifest.algorithm.fsdp_config()
        if world == 1 and not args.max_restarts and fsdp in (None, "auto"):  # no process group, no restarts
            return train_main(run_argv, prog=PROG)
        check_launch(manifest, device=args.device, world=world)
        return _launch(args, run_argv)
    except ValueError as err:  # ManifestError included
        return refuse(PROG, str(err))
    except KeyboardInterrupt:  # before the ranks start (a slow check, the wait for the other nodes)
        sys.stderr.write(f"{PROG}: stopped by SIGINT\n")
        return 130


#: torchrun's loggers whose lines the launcher says in its own words: a failed rank ("failed
#: (exitcode: 2) local_rank: ..."), a stop ("Received SIGINT death signal, shutting down workers").
_SAID_HERE = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def _launch(args: argparse.Namespace, run_argv: list[str]) -> int:
    """torchrun on ``agilerl.train`` in this process; a rank's failure said in one line. The
    environment and torchrun's loggers are restored after (torchrun sets ``OMP_NUM_THREADS``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    from agilerl.train import LAUNCHER_ENV

    rendezvous = (
        ["--standalone"]
        if args.nnodes == 1
        else [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
            # join: the wait for every node; read: a node's wait for the endpoint's store (60 s)
            f"--rdzv-conf=join_timeout={args.rdzv_timeout},read_timeout={args.rdzv_timeout}",
        ]
    )
    torchrun = [
        f"--nproc-per-node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={args.max_restarts}",
        *rendezvous,
        "-m",
        "agilerl.train",
        *run_argv,
    ]
    environ = dict(os.environ)
    loggers = {name: logging.getLogger(name).level for name in _SAID_HERE}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    os.environ[LAUNCHER_ENV] = PROG  # the ranks inherit it: their errors come here
    for name in _SAID_HERE:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.nnodes > 1:
        print(
            f"{PROG}: waiting up to {args.rdzv_timeout} s for the {args.nnodes} nodes to meet at {args.rdzv_endpoint}",
            flush=True,
        )
    try:
        run(get_args_parser().parse_args(torchrun))
    except RendezvousTimeoutError:
        sys.stderr.write(
            f"{PROG}: error: --rdzv-endpoint={args.rdzv_endpoint}: not all {args.nnodes} nodes joined within "
            f"{args.rdzv_timeout} s: start agilerl-train on every node with the same --nnodes, --rdzv-endpoint "
            "and --rdzv-id\n"
        )
        return 2
    except RendezvousError as err:  # an endpoint that cannot be reached, or a node lost mid-run
        why = " ".join(str(err.__cause__ or err).split()) or type(err).__name__
        sys.stderr.write(
            f"{PROG}: error: --rdzv-endpoint={args.rdzv_endpoint}: the rendezvous failed (the endpoint cannot be "
            f"reached, or another node stopped): {why}\n"
        )
        return 1
    except ChildFailedError as err:
        lines, status = _failure_lines(err.failures)
        for line in lines:
            sys.stderr.write(f"{PROG}: error: {line}\n")
        return status
    except SignalException as err:  # the ranks were stopped with this launcher
        sys.stderr.write(f"{PROG}: stopped by {signal.Signals(err.sigval).name}\n")
        return 128 + int(err.sigval)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for name, level in loggers.items():
            logging.getLogger(name).setLevel(level)
        for signum, handler in handlers.items():  # torchrun's raise SignalException
            signal.signal(signum, handler)
    return 0


def _failure_lines(failures: dict[int, Any]) -> tuple[list[str], int]:
    """What ``failures`` (global rank -> torchrun's ``ProcessFailure``) come to, in lines, and the
    exit status: each distinct one-line error the ranks wrote (``rank R:`` in front where they
    differ), status 2. Without one: a rank killed by a signal other than the SIGTERM torchrun
    stops the others with (SIGKILL: the out-of-memory killer; its peers then fail on the broken
    connection), else the rank that failed first (by torchrun's timestamps), status 1."""
    from agilerl.train import ERROR_SOURCE

    said: dict[str, list[int]] = {}
    for rank in sorted(failures):
        data = failures[rank].error_file_data
        if isinstance(data, dict) and data.get("source") == ERROR_SOURCE:  # written by agilerl.train.refuse
            said.setdefault(str(data["message"]), []).append(rank)
    if len(said) == 1:
        return [next(iter(said))], 2
    if said:
        return [f"rank {ranks[0]}: {message}" for message, ranks in said.items()], 2
    killed = [r for r in sorted(failures) if failures[r].exitcode < 0 and failures[r].exitcode != -signal.SIGTERM]
    if killed:
        name = failures[killed[0]].signal_name()
        hint = " (the kernel's out-of-memory killer sends it)" if name == "SIGKILL" else ""
        return [f"rank {killed[0]} was killed by {name}{hint}"], 1
    failed = [r for r in sorted(failures) if failures[r].exitcode != -signal.SIGTERM] or sorted(failures)
    rank = min(failed, key=lambda r: failures[r].timestamp)
    code = failures[rank].exitcode
    if code == 130:
        return [f"rank {rank} was interrupted"], 1
    if code < 0:
        return [f"rank {rank} was stopped by {failures[rank].signal_name()}"], 1
    return [f"rank {rank} exited with status {code} (its output is above)"], 1


if __name__ == "__main__":
    raise SystemExit(main())
