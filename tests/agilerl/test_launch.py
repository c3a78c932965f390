"""``agilerl-train``: the launch checked before any rank starts, a rank's error said once in one line.

Under plain torchrun a rank's bad-input error came as every rank's copy of the line, pieces of
them interleaved, then torchrun's own ``ChildFailedError`` traceback, and exit status 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from agilerl.launch import _SAID_HERE, _failure_lines, main
from agilerl.train import ERROR_SOURCE, LAUNCHER_ENV, refuse
from tests._procs import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny:qwen2?hidden_size=32&intermediate_size=64&num_layers=2"


def _manifest(tmp_path: Path, fsdp=False, **training) -> Path:
    manifest = {
        "algorithm": {
            "name": "GRPO",
            "model_name": MODEL,
            "group_size": 2,
            "max_output_tokens": 2,
            "dtype": "float32",
            "gradient_checkpointing": False,
            "fsdp": fsdp,
        },
        "training": {"rollout_batch_size": 2, "max_steps": 2, **training},
        "lora": {"r": 4, "alpha": 8},
    }
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture(autouse=True)
def _no_torchrun_variables(monkeypatch):
    """The launch options are read from PET_* variables where a cluster sets them: none here,
    unless a test sets them."""
    for name in [name for name in os.environ if name.startswith("PET_")]:
        monkeypatch.delenv(name)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("agilerl-train: error: "), err
    return lines[0]


def test_a_launch_the_manifest_cannot_take_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Three ranks cannot split rollout_batch_size=2: said by the launcher, one line, exit 2;
    no rank started (torchrun would have set the launcher's variable for them)."""
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    started = time.monotonic()
    assert main(["--nproc-per-node=3", str(_manifest(tmp_path)), "--device", "cpu"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "rollout_batch_size (2) must be a multiple of the 3 trainer rank(s)" in line
    # the launches it takes, nearest the one given: one or two trainer ranks (2 divides over them)
    assert "launch 2 ranks in all (nodes x --nproc-per-node), or change rollout_batch_size" in line, line
    assert LAUNCHER_ENV not in os.environ
    assert time.monotonic() - started < 30


def test_nproc_per_node_gpu_is_one_rank_per_gpu(tmp_path, capsys, monkeypatch):
    """As torchrun's: the count of this node's GPUs (three here: the launch check then refuses
    rollout_batch_size=2 for 3 ranks, before starting any), and none is an error."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert main(["--nproc-per-node=gpu", str(_manifest(tmp_path)), "--device", "cpu"]) == 2
    assert "multiple of the 3 trainer rank(s)" in _one_error_line(capsys.readouterr().err)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as stop:
        main(["--nproc-per-node=gpu", str(_manifest(tmp_path))])
    assert stop.value.code == 2
    assert "--nproc-per-node=gpu: this node has no CUDA GPU" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nnodes=2", "m.yaml"], "--nnodes=2 needs --rdzv-endpoint"),
        (["--rdzv-endpoint=host:29500", "m.yaml"], "--rdzv-endpoint is for --nnodes > 1"),
        (["--nproc-per-node=0", "m.yaml"], "--nproc-per-node"),
        (["--nproc-per-node=2", str(REPO / "no" / "such.yaml")], "such.yaml"),
        (["--nnodes=2", "--rdzv-endpoint=host:abc", "m.yaml"], "must be HOST:PORT with a port in 1-65535"),
        (["--nnodes=2", "--rdzv-endpoint=host:0", "m.yaml"], "must be HOST:PORT with a port in 1-65535"),
        (["--max-restarts=-1", "m.yaml"], "--max-restarts"),
        (["--nproc-per-node=cpu", "m.yaml"], "--nproc-per-node"),
        (["--nnodes=1:4", "m.yaml"], "must be one number of nodes, got the range '1:4'"),
        (["--nnodes=2", "--master-addr=host", "m.yaml"], "a static rendezvous (--master-addr) needs --node-rank"),
        (["--nnodes=2", "--master-addr=host", "--node-rank=2", "m.yaml"], "--node-rank=2 must be below --nnodes=2"),
        (["--nnodes=2", "--master-addr=h", "--rdzv-endpoint=h:1", "m.yaml"], "give --rdzv-endpoint (c10d"),
        (
            ["--nnodes=2", "--rdzv-endpoint=h:1", "--node-rank=1", "m.yaml"],
            "--node-rank is for a static rendezvous (--master-addr); this one is c10d, at --rdzv-endpoint=h:1",
        ),
        (["--nnodes=2", "--rdzv-endpoint=h:1", "--master-port=5", "m.yaml"], "--master-port is for a static"),
        (["--nnodes=2", "--rdzv-backend=static", "--rdzv-endpoint=h:1", "m.yaml"], "--rdzv-endpoint is for a c10d"),
        (["--master-port=5", "m.yaml"], "--master-port is for --nnodes > 1"),
        (["--nnodes=2", "--rdzv-backend=c10d", "--master-addr=h", "m.yaml"], "c10d needs --rdzv-endpoint"),
        (["--nnodes=2", "--master-addr=host:29500", "--node-rank=0", "m.yaml"], "a host name or address (no port)"),
        (["--master-addr=host", "m.yaml"], "--master-addr is for --nnodes > 1"),
        (["--node-rank=1", "m.yaml"], "--node-rank=1 is for --nnodes > 1"),
        (["--master-port=65536", "m.yaml"], "must be a port in 1-65535"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        status = main(argv)
        raise SystemExit(status)
    assert stop.value.code == 2
    assert says in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("environment", "argv", "chosen"),
    [
        # an address given decides over the environment's backend
        (
            {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "ep:1"},
            ["--master-addr=h", "--node-rank=1"],
            "static h:29500",
        ),
        (
            {"PET_RDZV_BACKEND": "static", "PET_MASTER_ADDR": "m", "PET_NODE_RANK": "1"},
            ["--rdzv-endpoint=h:5"],
            "c10d h:5",
        ),
        # torchrun's static form: node 0's HOST:PORT as the endpoint
        ({"PET_RDZV_BACKEND": "static", "PET_RDZV_ENDPOINT": "ep:7", "PET_NODE_RANK": "1"}, [], "static ep:7"),
        ({"PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "6", "PET_NODE_RANK": "1"}, [], "static m:6"),
    ],
)
def test_the_rendezvous_is_the_one_whose_address_is_given(environment, argv, chosen, monkeypatch):
    from agilerl.launch import _launch_options, _parser

    for name, value in {"PET_NNODES": "2", **environment}.items():
        monkeypatch.setenv(name, value)
    parser = _parser()
    args = parser.parse_args([*argv, "m.yaml"])
    _launch_options(parser, args)
    where = args.rdzv_endpoint if args.rdzv_backend == "c10d" else f"{args.master_addr}:{args.master_port}"
    assert f"{args.rdzv_backend} {where}" == chosen


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"PET_NNODES": "1:4"}, "PET_NNODES='1:4' (in the environment, read as --nnodes): must be one number"),
        ({"PET_NNODES": "2"}, "PET_NNODES=2 needs --rdzv-endpoint"),
        ({"PET_NNODES": "2", "PET_MASTER_ADDR": "h"}, "a static rendezvous (PET_MASTER_ADDR) needs --node-rank"),
        (
            {"PET_NNODES": "2", "PET_MASTER_ADDR": "h", "PET_NODE_RANK": "2"},
            "PET_NODE_RANK=2 must be below PET_NNODES=2",
        ),
        ({"PET_MASTER_PORT": "x"}, "PET_MASTER_PORT='x' (in the environment, read as --master-port): must be a port"),
        ({"PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE='0' (in the environment, read as --nproc-per-node)"),
        ({"PET_NNODES": "2", "PET_RDZV_BACKEND": "etcd"}, "PET_RDZV_BACKEND='etcd' (in the environment, read as"),
    ],
)
def test_options_from_pet_variables_are_checked_as_the_options_and_named_as_the_variables(
    environment, says, monkeypatch, capsys
):
    """torchrun reads each option it is not given from PET_<NAME> (Kubeflow's PyTorchJob sets them);
    so does agilerl-train, and an error names the variable, not an option the user never typed."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        main(["m.yaml"])
    assert stop.value.code == 2
    assert says in _one_error_line(capsys.readouterr().err)


def test_an_option_given_wins_over_its_pet_variable_and_one_node_ignores_addresses_from_the_environment(
    tmp_path, capsys, monkeypatch
):
    """A one-pod job sets PET_NNODES=1, PET_NODE_RANK=0 and PET_MASTER_ADDR: that is one node, which
    trains in this process; --nproc-per-node=3 given wins over PET_NPROC_PER_NODE=1 (the launch
    check then refuses 3 ranks for rollout_batch_size=2, before starting any)."""
    for name, value in {
        "PET_NNODES": "1",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "pod-0",
        "PET_NPROC_PER_NODE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert main([str(_manifest(tmp_path)), "--device", "cpu"]) == 0
    assert "built 1 GRPO agent(s) on 1 rank(s)" in capsys.readouterr().out
    assert main(["--nproc-per-node=3", str(_manifest(tmp_path)), "--device", "cpu"]) == 2
    assert "multiple of the 3 trainer rank(s)" in _one_error_line(capsys.readouterr().err)


def test_a_rank_error_goes_to_its_torchrun_error_file_and_to_the_terminal_unless_a_launcher_says_it(
    tmp_path, capsys, monkeypatch
):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    assert refuse("python -m agilerl.train", "a  field\nis wrong") == 2
    assert capsys.readouterr().err == "python -m agilerl.train: error: a field is wrong\n"  # one line, whole
    assert json.loads(error_file.read_text())["message"] == "a field is wrong"  # torchrun's report shows it
    monkeypatch.setenv(LAUNCHER_ENV, "agilerl-train")
    assert refuse("python -m agilerl.train", "another") == 2
    assert capsys.readouterr().err == ""  # the launcher says it, once
    assert json.loads(error_file.read_text())["message"] == "another"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no" / "dir" / "error.json"))
    refuse("python -m agilerl.train", "unwritable error file")  # then the terminal, launcher or not
    assert capsys.readouterr().err == "python -m agilerl.train: error: unwritable error file\n"


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None = None):
    """torchrun's own record of a failed rank, read from an error file as its agent reads it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error-{rank}.json"
    error_file.unlink(missing_ok=True)  # none for a rank that wrote nothing
    if message is not None:
        error_file.write_text(json.dumps({"message": message, "timestamp": 100 + rank, "source": ERROR_SOURCE}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_a_restart_says_the_bad_input_an_earlier_attempt_stopped_on_but_tries_the_engine_again(
    tmp_path, capsys, monkeypatch
):
    """With --max-restarts the launcher gives its ranks a folder: a rank's bad-input line is left
    there, and a rank of a restart (TORCHELASTIC_RESTART_COUNT > 0) stops on it before loading
    anything: its own line, or this node's other rank's. An engine that failed to start (again=True)
    is not left: the restart may start it."""
    from agilerl.train import REFUSALS_ENV, _refused_before
    from agilerl.train import main as train_main

    monkeypatch.setenv(REFUSALS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert refuse("prog", "algorithm.vllm: the engine did not start", again=True) == 2
    assert not list(tmp_path.iterdir())
    assert refuse("prog", "training.checkpoint_dir:   holds another\nrun's checkpoints") == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _refused_before() is None  # the first attempt looks for nothing
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _refused_before() == "training.checkpoint_dir: holds another run's checkpoints"
    monkeypatch.setenv("RANK", "0")  # said nothing itself: stops on rank 1's line
    capsys.readouterr()
    assert train_main([str(tmp_path / "never-read.yaml")], prog="prog") == 2
    assert capsys.readouterr().err == "prog: error: training.checkpoint_dir: holds another run's checkpoints\n"


def test_a_value_error_once_a_step_has_trained_is_not_left_for_the_restarts(tmp_path, capsys, monkeypatch):
    """A ValueError at step 2 (a peer lost mid-step, say) is not bad input a restart would meet
    again: it is said, and the restarts resume from the checkpoint instead of stopping on it."""
    import agilerl.train as train_module
    from agilerl.train import REFUSALS_ENV
    from agilerl.train import main as train_main

    refusals = tmp_path / "refusals"
    refusals.mkdir()
    monkeypatch.setenv(REFUSALS_ENV, str(refusals))
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    step, steps = train_module._step, []

    def second_step_fails(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            raise ValueError("shape mismatch in a weight sync")
        return step(*args, **kwargs)

    monkeypatch.setattr(train_module, "_step", second_step_fails)
    assert train_main([str(_manifest(tmp_path, max_steps=3)), "--device", "cpu"]) == 2
    assert "shape mismatch in a weight sync" in capsys.readouterr().err
    assert not list(refusals.iterdir())


def test_the_failures_come_to_each_distinct_line_once(tmp_path):
    same = {r: _failure(tmp_path, r, 2, "training.checkpoint_dir: x holds another run's checkpoints") for r in (0, 1)}
    assert _failure_lines(same) == (["training.checkpoint_dir: x holds another run's checkpoints"], 2)

    differ = {0: _failure(tmp_path, 0, 2, "a"), 1: _failure(tmp_path, 1, 2, "b"), 2: _failure(tmp_path, 2, 2, "a")}
    assert _failure_lines(differ) == (["rank 0: a", "rank 1: b"], 2)

    # rank 1 said why; torchrun then stopped rank 0 (SIGTERM): only rank 1's line
    stopped = {0: _failure(tmp_path, 0, -signal.SIGTERM), 1: _failure(tmp_path, 1, 2, "b")}
    assert _failure_lines(stopped) == (["b"], 2)

    crashed = {0: _failure(tmp_path, 0, -signal.SIGTERM), 1: _failure(tmp_path, 1, 1)}
    assert _failure_lines(crashed) == (["rank 1 exited with status 1 (its output is above)"], 1)

    # the out-of-memory killer took rank 3; rank 0 then failed on the broken connection
    killed = {0: _failure(tmp_path, 0, 1), 3: _failure(tmp_path, 3, -signal.SIGKILL)}
    lines, status = _failure_lines(killed)
    assert status == 1 and lines[0].startswith("rank 3 was killed by SIGKILL (the kernel's out-of-memory killer")

    assert _failure_lines({1: _failure(tmp_path, 1, 130)}) == (["rank 1 was interrupted"], 1)


def _launch(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop(LAUNCHER_ENV, None)
    cmd = [sys.executable, "-m", "agilerl.launch", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_both_ranks_refusing_another_runs_checkpoint_are_said_once_without_a_traceback(tmp_path):
    """What the launch check cannot see: the ranks find a DPO run's checkpoint under the GRPO run's
    checkpoint_dir once their agents are built, and both stop on it; it is said once. Restarted
    (--max-restarts=2), they stop on it again at once, without building their agents again (before,
    each restart built them, a model load each on a large model, to find the same checkpoint)."""
    folder = tmp_path / "ckpt"
    (folder / "agent0").mkdir(parents=True)
    torch.save({"algo": "DPO", "steps": 3}, folder / "agent0" / "attributes.pt")
    manifest = _manifest(tmp_path, checkpoint_dir=str(folder))
    done = _launch(["--nproc-per-node=2", "--max-restarts=2", str(manifest), "--device", "cpu"], timeout=150)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    line = _one_error_line(done.stderr)
    assert "holds another run's checkpoints" in line and "is a DPO checkpoint, not GRPO" in line
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stdout.count("built 1 GRPO agent(s) on 2 rank(s)") == 1  # once: the restarts did not build


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_ranks_with_one_line_and_status_130(tmp_path):
    """SIGINT to the launcher (torchrun passes it to the ranks): no rank's KeyboardInterrupt
    traceback, no rank left running."""
    from tests._procs import with_env

    manifest = _manifest(tmp_path, max_steps=100_000, log_every=1)
    mark = f"ctrl-c-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop(LAUNCHER_ENV, None)
    env["AGILERL_TEST_MARK"] = mark
    cmd = [sys.executable, "-m", "agilerl.launch", "--nproc-per-node=2", str(manifest), "--device", "cpu"]
    run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        while not any("step    2" in line for line in out):  # training, on both ranks
            line = run.stdout.readline()
            assert line, "".join(out) + run.stderr.read()
            out.append(line)
        run.send_signal(signal.SIGINT)
        rest, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert "Traceback" not in "".join(out) + rest + err
    assert err.splitlines()[-1] == "agilerl-train: stopped by SIGINT"
    assert not with_env("AGILERL_TEST_MARK", mark)  # torchrun waited for its ranks


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_fsdp2_on_one_rank_is_what_the_one_device_refusal_says_to_run(tmp_path, capfd, monkeypatch):
    """`python -m agilerl.train` refuses an FSDP2 manifest (no process group) and says to run
    `agilerl-train --nproc-per-node=1`: that launches one torchrun rank, which trains. Run in this
    process, the launcher leaves its environment, loggers and signal handlers as they were."""
    import logging

    from agilerl.train import main as train_main

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    manifest = _manifest(tmp_path, fsdp=True)
    assert train_main([str(manifest), "--device", "cpu"]) == 2
    advice = capfd.readouterr().err.split("run `")[1].split(" ...`")[0]
    assert advice == "agilerl-train --nproc-per-node=1"
    environ, handler = dict(os.environ), signal.getsignal(signal.SIGINT)
    import torch.distributed.run  # noqa: F401 - its import sets its loggers' levels

    levels = [logging.getLogger(name).level for name in _SAID_HERE]
    assert main([*advice.split()[1:], str(manifest), "--device", "cpu"]) == 0
    out = capfd.readouterr().out
    assert "built 1 GRPO agent(s) on 1 rank(s)" in out and "agent 0 step    2" in out
    # what the launcher sets for its ranks is gone (loading the model may add caches' variables)
    assert LAUNCHER_ENV not in os.environ and not [k for k in os.environ if k.startswith("TORCHELASTIC_")]
    assert {k: v for k, v in os.environ.items() if k in environ} == environ
    assert signal.getsignal(signal.SIGINT) is handler
    assert levels == [logging.getLogger(name).level for name in _SAID_HERE]


def test_one_rank_trains_in_this_process(tmp_path, capsys):
    assert main([str(_manifest(tmp_path)), "--device", "cpu"]) == 0
    assert "built 1 GRPO agent(s) on 1 rank(s)" in capsys.readouterr().out


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_two_nodes_meet_at_the_rendezvous_endpoint_and_train_as_one_run(tmp_path):
    """The line `agilerl-plan --output` writes for two nodes (its endpoint filled in), run twice on
    this host (one rank each): the two launchers meet there and their ranks train data parallel."""
    port = free_port()
    manifest = _manifest(tmp_path)
    from planner.emit import launch_command
    from planner.hardware import Cluster, gpu_by_name

    line = launch_command(Cluster(gpu=gpu_by_name("H100-80GB"), num_gpus=2, gpus_per_node=1))  # a manifest's "# run:"
    program, *launch = (
        line.replace("<first node>:29500", f"localhost:{port}").replace("<this file>", str(manifest)).split()
    )
    assert program == "agilerl-train"
    argv = [*launch, "--device", "cpu"]
    out = _nodes_train_as_one_run([(argv, {}), (argv, {})])
    assert out.count("built 1 GRPO agent(s) on 2 rank(s)") == 1  # the main rank's, on one of the nodes
    assert "agent 0 step    2" in out


def _nodes_train_as_one_run(nodes: list[tuple[list[str], dict[str, str]]]) -> str:
    """Start ``agilerl-train`` once per (arguments, environment), as the nodes of one job on this
    host; check each exits 0; return their outputs, one after the other."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop(LAUNCHER_ENV, None)
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "agilerl.launch", *argv],
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for argv, extra in nodes
    ]
    try:
        done = [node.communicate(timeout=150) for node in started]
    finally:
        for node in started:
            node.kill()
    assert [node.returncode for node in started] == [0] * len(nodes), [err.decode()[-2000:] for _, err in done]
    return "".join(out.decode() for out, _ in done)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_two_pods_of_a_pytorchjob_train_as_one_run_from_its_pet_variables_alone(tmp_path):
    """Kubeflow's PyTorchJob runs the same command in each pod and sets PET_NNODES, PET_NODE_RANK,
    PET_NPROC_PER_NODE, PET_MASTER_ADDR and PET_MASTER_PORT (a static rendezvous). Before,
    `agilerl-train MANIFEST` read none of them, so each pod trained a run of its own."""
    port = free_port()
    argv = [str(_manifest(tmp_path)), "--device", "cpu"]
    job = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    # read by torchrun's own parser where not given it: each node would train alone (--standalone)
    job["PET_STANDALONE"] = "1"
    # node 1 first: it waits for node 0's store
    out = _nodes_train_as_one_run([(argv, {**job, "PET_NODE_RANK": "1"}), (argv, {**job, "PET_NODE_RANK": "0"})])
    assert out.startswith(f"agilerl-train: waiting up to 900 s for the 2 nodes to meet at 127.0.0.1:{port} as node 1")
    assert out.count("built 1 GRPO agent(s) on 2 rank(s)") == 1  # the main rank's: one run of two ranks
    assert "agent 0 step    2" in out


@pytest.mark.timeout(120)
def test_a_static_rendezvous_whose_peers_never_come_ends_in_one_line(tmp_path):
    """Node 0 waits --rdzv-timeout for the others to connect (exit 2); a node whose node 0 never
    comes fails to connect (exit 1). torchrun ends both in a traceback, the second after c10d's C++
    log of each failed try, C++ stack included."""
    argv = ["--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--rdzv-timeout=3"]
    manifest = str(_manifest(tmp_path))
    done = _launch([*argv, "--node-rank=0", manifest, "--device", "cpu"], timeout=100)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "not all 2 nodes joined within 3 s" in _one_error_line(done.stderr)
    done = _launch([*argv, "--node-rank=1", manifest, "--device", "cpu"], timeout=100)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "the rendezvous failed (the endpoint cannot be reached" in _one_error_line(done.stderr)


@pytest.mark.timeout(120)
def test_a_node_whose_peers_never_come_stops_after_the_rendezvous_timeout_in_one_line(tmp_path):
    """torchrun's c10d join timeout is 10 minutes and ends in a RendezvousTimeoutError traceback."""
    port = free_port()
    argv = ["--nnodes=2", f"--rdzv-endpoint=localhost:{port}", "--rdzv-timeout=3", str(_manifest(tmp_path))]
    done = _launch([*argv, "--device", "cpu"], timeout=100)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout.startswith(f"agilerl-train: waiting up to 3 s for the 2 nodes to meet at localhost:{port}")
    assert "not all 2 nodes joined within 3 s" in _one_error_line(done.stderr)
