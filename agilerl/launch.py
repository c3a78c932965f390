"""``agilerl-train``: train from a manifest on one device or on many ranks.

    agilerl-train manifest.yaml [--device cpu|cuda] [--max-steps N]         # one device
    agilerl-train --nproc-per-node=8 manifest.yaml                           # 8 ranks on this host
    agilerl-train --nproc-per-node=8 --nnodes=2 --rdzv-endpoint=HOST:29500 manifest.yaml
                                                                             # on each of 2 nodes
    agilerl-train --nproc-per-node=8 --nnodes=2 --master-addr=HOST --node-rank=R manifest.yaml
                                                                             # the same, static rendezvous

On one rank it is ``python -m agilerl.train`` (torchrun where the manifest shards with FSDP2 on
one rank, which needs a process group, or ``--max-restarts`` is given). On several it is torchrun
on ``agilerl.train``, run in this process (``--standalone`` on one node), with these
differences, seen only when something is wrong:

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

Each launch option not given is read from torchrun's ``PET_<NAME>`` variable (``PET_NNODES``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ...), as torchrun reads it: where a cluster sets them
(Kubeflow's PyTorchJob does), ``agilerl-train MANIFEST`` runs as ``torchrun -m agilerl.train
MANIFEST`` would. A static rendezvous (``--master-addr``, ``--master-port``, ``--node-rank``,
or torchrun's ``--rdzv-backend=static`` with node 0's ``HOST:PORT`` as the endpoint) is taken
as well as c10d; an address given on the command line decides the rendezvous over
``PET_RDZV_BACKEND``. What differs from torchrun:

- the nodes must be a fixed number: ``--nnodes=1:4`` (elastic training) is refused, as the
  plan and the batch split are made for one world size;
- ``--nproc-per-node=auto`` is one rank per CUDA GPU, or one rank without a GPU (torchrun
  starts one per CPU core there); ``cpu`` and ``xpu`` are refused;
- a given option the rendezvous would not use (``--master-port`` with c10d) is refused,
  where torchrun ignores it;
- torchrun's other ``PET_*`` variables (log directories, redirects, ``PET_STANDALONE``) are
  not read.

torchrun itself stays usable (``torchrun --nproc_per_node=N -m agilerl.train manifest.yaml``)
for its options this command does not take (log directories, redirects).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

from agilerl.utils.cli import ArgumentParser, host_port, non_negative_int, port_number, positive_int

__all__ = ["main"]

PROG = "agilerl-train"


def _endpoint(text: str) -> str:
    """``HOST:PORT`` (or ``HOST``, torchrun's port 29400), checked here rather than deep in torchrun."""
    if host_port(text if ":" in text else f"{text}:29400") is None:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a port in 1-65535, got {text!r}")
    return text


def _port(text: str) -> int:
    if (number := port_number(text)) is None:
        raise argparse.ArgumentTypeError(f"must be a port in 1-65535, got {text!r}")
    return number


def _host(text: str) -> str:
    """A host name or address; one colon is a ``HOST:PORT`` (an IPv6 address has several)."""
    if not text or any(c.isspace() for c in text) or text.count(":") == 1:
        raise argparse.ArgumentTypeError(f"must be a host name or address (no port), got {text!r}")
    return text


def _ranks_per_node(text: str) -> int | str:
    """A positive count; ``gpu``: one rank per GPU of this node; ``auto`` (torchrun's, and Kubeflow's
    default): one per GPU, or one on a node without a GPU. Counted once parsing is done."""
    return text if text in ("gpu", "auto") else positive_int(text)


def _node_count(text: str) -> int:
    """A positive count; torchrun's elastic ``MIN:MAX`` only where the two are equal."""
    low, colon, high = text.partition(":")
    if colon and low != high:
        raise argparse.ArgumentTypeError(
            f"must be one number of nodes, got the range {text!r}: the plan and the batch split are made for "
            "one world size, so agilerl-train does not train elastically"
        )
    return positive_int(low)


def _backend(text: str) -> str:
    if text not in ("c10d", "static"):
        raise argparse.ArgumentTypeError(f"must be c10d or static, got {text!r}")
    return text


#: The launch options: torchrun's of the same names, each read, as torchrun reads it, from the
#: ``PET_<NAME>`` variable when not given (Kubeflow's PyTorchJob sets these), then defaulted.
#: name -> (how its text is read, its default).
_OPTIONS: dict[str, tuple[Any, Any]] = {
    "nproc_per_node": (_ranks_per_node, 1),
    "nnodes": (_node_count, 1),
    "node_rank": (non_negative_int, None),
    "master_addr": (_host, None),
    "master_port": (_port, 29500),
    "rdzv_backend": (_backend, None),
    "rdzv_endpoint": (_endpoint, None),
    "rdzv_id": (str, "agilerl-train"),
    "max_restarts": (non_negative_int, 0),
}


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from agilerl.train import add_run_arguments

    add_run_arguments(parser)
    launch = parser.add_argument_group(
        "launch (torchrun's options of the same names; one not given is read from its PET_<NAME> variable, "
        "as torchrun reads it)"
    )

    def option(name: str, metavar: str | None, help: str) -> None:
        flag = "--" + name.replace("_", "-")
        flags = [flag, f"--{name}"] if "_" in name else [flag]
        launch.add_argument(*flags, type=_OPTIONS[name][0], metavar=metavar, help=help)

    option(
        "nproc_per_node",
        "N|gpu|auto",
        "ranks on this node; gpu: one per GPU it has; auto: one per GPU, or 1 without a GPU (default 1)",
    )
    option("nnodes", "N", "nodes, each running this command (default 1)")
    option(
        "rdzv_endpoint",
        "HOST:PORT",
        "with --nnodes > 1 (c10d rendezvous): where the nodes meet, the same on every node (a host of one of them)",
    )
    option(
        "rdzv_id",
        "ID",
        "with --nnodes > 1: the job's name at the endpoint, the same on every node (default agilerl-train)",
    )
    option(
        "master_addr",
        "HOST",
        "with --nnodes > 1, instead of --rdzv-endpoint (static rendezvous): the host of node 0, the same on every node",
    )
    option("master_port", "PORT", "with --master-addr: the port node 0 listens on (default 29500)")
    option("node_rank", "R", "with --master-addr: this node's index, 0 to --nnodes - 1 (0 on --master-addr)")
    option(
        "rdzv_backend",
        "c10d|static",
        "c10d (--rdzv-endpoint) or static (--master-addr); by default the one whose address is given",
    )
    launch.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        type=positive_int,
        default=900,
        metavar="SECONDS",
        help="with --nnodes > 1: how long a node waits for the others (default 900)",
    )
    option(
        "max_restarts",
        "N",
        "restarts of every rank after one fails (default 0); a restarted run resumes "
        "from its newest checkpoint (training.checkpoint_dir). Bad input a rank stopped on is said "
        "again at once by the restarts, not looked for again",
    )
    return parser


def _launch_options(parser: ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Fill in each launch option not given from its ``PET_<NAME>`` variable, else its default, and
    check them together. Returns name -> what gave it (``--nnodes``, or ``PET_NNODES`` from the
    environment), for the messages. ``args.rdzv_backend`` comes out ``None`` (one node: torchrun's
    ``--standalone``), ``c10d`` or ``static``; ``args.nproc_per_node`` a number."""
    named: dict[str, str] = {}
    for name, (read, default) in _OPTIONS.items():
        variable, flag = f"PET_{name.upper()}", "--" + name.replace("_", "-")
        if getattr(args, name) is not None:
            named[name] = flag
        elif os.environ.get(variable):
            try:
                setattr(args, name, read(os.environ[variable]))
            except (argparse.ArgumentTypeError, ValueError) as err:
                parser.error(f"{variable}={os.environ[variable]!r} (in the environment, read as {flag}): {err}")
            named[name] = variable
        else:
            setattr(args, name, default)
    given = {name for name, by in named.items() if by.startswith("--")}
    if args.nnodes == 1:  # torchrun's --standalone: addresses from the environment are not for it
        for name in ("rdzv_endpoint", "rdzv_backend", "master_addr", "master_port"):
            if name in given:
                parser.error(f"{named[name]} is for --nnodes > 1 (one node finds a free port itself)")
        if "node_rank" in given and args.node_rank:
            parser.error(f"--node-rank={args.node_rank} is for --nnodes > 1 (one node is node 0)")
        args.rdzv_backend = None
    else:
        _rendezvous(parser, args, named, given)
    return named


def _rendezvous(parser: ArgumentParser, args: argparse.Namespace, named: dict[str, str], given: set[str]) -> None:
    """Set ``args.rdzv_backend`` for several nodes, and check what it needs. An address given on the
    command line decides it over ``PET_RDZV_BACKEND``; a given option it would not use is refused."""
    if "rdzv_backend" not in given:
        if {"rdzv_endpoint", "master_addr"} <= given:
            parser.error("give --rdzv-endpoint (c10d rendezvous) or --master-addr with --node-rank (static), not both")
        if "rdzv_endpoint" in given:
            args.rdzv_backend = "c10d"
        elif "master_addr" in given:
            args.rdzv_backend = "static"
        elif args.rdzv_backend is None:  # the environment's addresses, and no PET_RDZV_BACKEND
            args.rdzv_backend = "c10d" if args.rdzv_endpoint else "static" if args.master_addr else None
        if args.rdzv_backend is None:
            parser.error(
                f"{named['nnodes']}={args.nnodes} needs --rdzv-endpoint=HOST:PORT, the same on every node (or, for a "
                "static rendezvous, --master-addr=HOST and this node's --node-rank)"
            )
    if args.rdzv_backend == "c10d":
        if not args.rdzv_endpoint:
            parser.error(f"{named['rdzv_backend']}=c10d needs --rdzv-endpoint=HOST:PORT, the same on every node")
        for name in ("master_addr", "master_port", "node_rank"):
            if name in given:
                parser.error(
                    f"{named[name]} is for a static rendezvous (--master-addr); this one is c10d, at "
                    f"{named['rdzv_endpoint']}={args.rdzv_endpoint}"
                )
        return
    if "rdzv_endpoint" in given:
        parser.error("--rdzv-endpoint is for a c10d rendezvous; a static one meets at --master-addr and --master-port")
    if not args.master_addr and args.rdzv_endpoint:  # torchrun's static form: node 0's HOST:PORT as the endpoint
        args.master_addr, args.master_port = host_port(args.rdzv_endpoint) or (args.rdzv_endpoint, args.master_port)
    if not args.master_addr:
        parser.error(f"{named['rdzv_backend']}=static needs --master-addr=HOST, node 0's host")
    if args.node_rank is None:
        parser.error(
            f"a static rendezvous ({named.get('master_addr') or named['rdzv_endpoint']}) needs --node-rank=R, this "
            f"node's index from 0 (0 on {args.master_addr})"
        )
    if args.node_rank >= args.nnodes:
        parser.error(f"{named['node_rank']}={args.node_rank} must be below {named['nnodes']}={args.nnodes}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run_argv = [args.manifest]
    if args.device is not None:
        run_argv += ["--device", args.device]
    if args.max_steps is not None:
        run_argv += ["--max-steps", str(args.max_steps)]
    named = _launch_options(parser, args)
    if args.rdzv_backend is not None:
        _import_torch_without_cpp_logs()
    if args.nproc_per_node in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count()
        if not gpus and args.nproc_per_node == "gpu":
            parser.error(f"{named['nproc_per_node']}=gpu: this node has no CUDA GPU; give a number of ranks")
        args.nproc_per_node = gpus or 1
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
        return _launch(args, named, run_argv)
    except ValueError as err:  # ManifestError included
        return refuse(PROG, str(err))
    except KeyboardInterrupt:  # before the ranks start (a slow check, the wait for the other nodes)
        sys.stderr.write(f"{PROG}: stopped by SIGINT\n")
        return 130


def _import_torch_without_cpp_logs() -> None:
    """Several nodes: c10d's C++ side logs each failed try to reach the rendezvous, with a C++
    stack, before the launcher's one line says what failed. Its log level is read once, when
    torch loads, so this process (not its ranks) loads torch at level FATAL, unless the user set
    ``TORCH_CPP_LOG_LEVEL``."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


#: torchrun's loggers whose lines the launcher says in its own words: a failed rank ("failed
#: (exitcode: 2) local_rank: ..."), a stop ("Received SIGINT death signal, shutting down workers").
_SAID_HERE = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def _launch(args: argparse.Namespace, named: dict[str, str], run_argv: list[str]) -> int:
    """torchrun on ``agilerl.train`` in this process; a rank's failure said in one line. The
    environment and torchrun's loggers are restored after (torchrun sets ``OMP_NUM_THREADS``)."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import get_args_parser, run

    from agilerl.train import LAUNCHER_ENV, REFUSALS_ENV

    # every option torchrun would otherwise read from a PET_ variable is given: node rank 0 where
    # it is not used (torchrun warns about a PET_NODE_RANK its rendezvous ignores)
    if args.rdzv_backend is None:
        rendezvous, where, same = ["--standalone", "--node-rank=0"], "", ""
    elif args.rdzv_backend == "c10d":
        where, same = f"{named['rdzv_endpoint']}={args.rdzv_endpoint}", "--rdzv-endpoint and --rdzv-id"
        rendezvous = [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
            "--node-rank=0",
            # join: the wait for every node; read: a node's wait for the endpoint's store (60 s)
            f"--rdzv-conf=join_timeout={args.rdzv_timeout},read_timeout={args.rdzv_timeout}",
        ]
    else:  # static: node 0 holds the store at master_addr:master_port, the others connect to it
        where, same = (
            f"{named['master_addr']}={args.master_addr} (port {args.master_port})"
            if "master_addr" in named
            else f"{named['rdzv_endpoint']}={args.rdzv_endpoint}",
            "--master-addr and --master-port, and its own --node-rank",
        )
        rendezvous = [
            "--rdzv-backend=static",
            f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}",
            f"--node-rank={args.node_rank}",
            f"--rdzv-id={args.rdzv_id}",
            f"--rdzv-conf=timeout={args.rdzv_timeout}",
        ]
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
    refusals = tempfile.mkdtemp(prefix="agilerl-train-") if args.max_restarts else None
    if refusals:  # a rank's bad-input line, said again at once by the ranks of a restart
        os.environ[REFUSALS_ENV] = refusals
    for name in _SAID_HERE:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.nnodes > 1:
        at = (
            args.rdzv_endpoint
            if args.rdzv_backend == "c10d"
            else f"{args.master_addr}:{args.master_port} as node {args.node_rank}"
        )
        print(
            f"{PROG}: waiting up to {args.rdzv_timeout} s for the {args.nnodes} nodes to meet at {at}",
            flush=True,
        )
    for name in [name for name in os.environ if name.startswith("PET_")]:
        del os.environ[name]  # read above; torchrun's parser would take the ones not given it (PET_STANDALONE)
    try:
        run(get_args_parser().parse_args(torchrun))
    except (RendezvousTimeoutError, DistStoreError) as err:
        if isinstance(err, DistStoreError) and "waiting for clients" not in str(err):  # not node 0's wait
            return _rendezvous_failed(err, where)
        sys.stderr.write(
            f"{PROG}: error: {where}: not all {args.nnodes} nodes joined within {args.rdzv_timeout} s: start "
            f"agilerl-train on every node with the same --nnodes, {same}\n"
        )
        return 2
    except (RendezvousError, DistNetworkError) as err:  # an endpoint that cannot be reached, a node lost mid-run
        return _rendezvous_failed(err, where)
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
        if refusals:
            shutil.rmtree(refusals, ignore_errors=True)
    return 0


def _rendezvous_failed(err: Exception, where: str) -> int:
    why = " ".join(str(err.__cause__ or err).split()) or type(err).__name__
    sys.stderr.write(
        f"{PROG}: error: {where}: the rendezvous failed (the endpoint cannot be reached, or another node "
        f"stopped): {why}\n"
    )
    return 1


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
