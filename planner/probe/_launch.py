"""Probe: measure a short real run of the trainer (the planner's ground truth, the tuner's trial).

``run_probe`` launches ``torchrun --nproc_per_node=N`` on :mod:`planner.probe._worker`,
which builds the real GRPO trainer and runs real learn() steps on synthetic
rollouts of exactly the requested shapes. The parent never imports torch; it
enforces the timeout, kills the whole process group on expiry or failure (no
orphaned ranks), and returns a :class:`Measurement`.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agilerl.distributed import FSDPConfig
from agilerl.utils.lifetime import die_with_parent

from ..names import COMPONENTS, PHASES
from ..workload import Workload

__all__ = ["ProbeRequest", "Measurement", "RankMeasurement", "run_probe", "PHASES", "COMPONENTS"]


Device = Literal["cpu", "cuda"]


def default_device() -> Device:
    """Where probes run unless told: ``cuda`` when this machine has a GPU torch can use."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class ProbeRequest(BaseModel):
    """What to measure."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(description="Model directory, hub id, or built-in tiny model ('tiny:qwen2?...').")]
    workload: Workload = Workload()
    fsdp: Annotated[FSDPConfig | None, Field(description="Sharding settings; None trains unsharded.")] = None
    nproc: Annotated[
        int, Field(ge=1, description="Ranks to launch (GPUs, or CPU processes), on all nodes together.")
    ] = 1
    nnodes: Annotated[
        int,
        Field(
            ge=1,
            description="Nodes the ranks span (nproc / nnodes each). Without rdzv_endpoint every node "
            "is a torchrun agent on this host, joined by c10d rendezvous.",
        ),
    ] = 1
    rdzv_endpoint: Annotated[
        str | None,
        Field(
            description="HOST:PORT of the c10d rendezvous of a real multi-node probe: run the probe "
            "on every node with the same endpoint; each node reports its own ranks."
        ),
    ] = None
    device: Annotated[Device, Field(description="Where the ranks compute.")] = "cpu"
    generate: Annotated[
        bool,
        Field(
            description="Also measure one real rollout: Hugging Face generate, or the "
            "colocated vLLM engine with workload.generation='vllm'."
        ),
    ] = False
    save: Annotated[bool, Field(description="Also measure a checkpoint save.")] = False
    components: Annotated[
        bool | None,
        Field(
            description="Split each phase's peak into components (weights, activations, logits...) with a "
            "tensor tracker. None: on CPU, which has no allocator peaks to read; not on CUDA, whose "
            "allocator's peaks are exact, where the tracker's per-operation work dominates a step (a "
            "Qwen2.5-0.5B probe on an H200: 101 s with it, 61 s without)."
        ),
    ] = None
    memory_budget_bytes: Annotated[
        int | None, Field(ge=1, description="Per-rank device budget; over it the run is reported as not fitting.")
    ] = None
    timeout_s: Annotated[float, Field(gt=0, description="Wall-clock limit; the whole launch is killed after it.")] = 600
    timed_steps: Annotated[int, Field(ge=1, description="Untracked learn steps timed after the measured one.")] = 3
    seed: int = 0
    collective_timeout_s: Annotated[int, Field(ge=10, description="torch.distributed timeout inside the ranks.")] = 120

    @model_validator(mode="after")
    def _nodes(self) -> ProbeRequest:
        if self.nproc % self.nnodes:
            raise ValueError(f"nproc={self.nproc} ranks do not split evenly over nnodes={self.nnodes} nodes")
        if self.rdzv_endpoint is not None and self.nnodes == 1:
            raise ValueError("rdzv_endpoint is for a probe across nodes: give nnodes > 1")
        return self

    @property
    def nproc_per_node(self) -> int:
        return self.nproc // self.nnodes


class RankMeasurement(BaseModel):
    rank: int
    node: int = 0  # torchrun's GROUP_RANK
    phases: dict[str, dict[str, int]] = {}
    step_seconds: list[float] = []
    param_bytes: dict[str, int] = {}
    load_seconds: float | None = None
    stages: dict[str, float] = {}  # seconds per stage of the rank: setup, load, warmup, measured, timed
    error: str | None = None
    oom: bool = False
    oom_phase: str | None = None
    # Row-wise MoE experts: routed rows computed per token block, the largest and the mean.
    moe_rows: dict[str, float] = {}
    # A colocated vLLM engine's own report (generation="vllm" with generate): KV cache blocks,
    # tokens per block, bytes of its KV tensors.
    engine: dict[str, int] = {}


class Measurement(BaseModel):
    """What a probe measured (per rank, per phase, by component), or why it failed."""

    request: ProbeRequest
    ok: bool
    failure: str | None = None
    oom: bool = False
    oom_phase: str | None = None
    over_budget_phases: dict[str, int] = {}
    ranks: list[RankMeasurement] = []
    micro_batch_size_per_gpu: int | None = None
    logprob_chunk_size: int | None = None
    wall_seconds: float = 0.0
    work_dir: str | None = None  # request, per-rank results and the worker log

    @property
    def fits(self) -> bool:
        return self.ok and not self.oom and not self.over_budget_phases

    def phase_total(self, phase: str, *, key: str = "total") -> int:
        """The largest per-rank peak of ``phase`` (device bytes)."""
        return max((r.phases.get(phase, {}).get(key, 0) for r in self.ranks), default=0)

    @property
    def moe_load_imbalance(self) -> float | None:
        """Rows of the busiest rank's largest token block over the mean rows per block on a rank
        (row-wise MoE experts; 1.0 is perfectly balanced routing). None without such experts."""
        rows = [r.moe_rows for r in self.ranks if r.moe_rows]
        if not rows:
            return None
        mean = sum(r["mean_block"] for r in rows) / len(rows)
        return max(r["max_block"] for r in rows) / mean if mean else None

    def device_peak(self, record: dict[str, int]) -> int:
        return record.get("cuda_max_allocated", record.get("total", 0))

    @property
    def peak_bytes(self) -> int:
        return max((self.device_peak(rec) for r in self.ranks for rec in r.phases.values()), default=0)

    @property
    def peak_phase(self) -> str | None:
        best, name = -1, None
        for r in self.ranks:
            for phase, rec in r.phases.items():
                if self.device_peak(rec) > best:
                    best, name = self.device_peak(rec), phase
        return name

    @property
    def host_peak_bytes(self) -> int:
        return max((rec.get("host_peak", 0) for r in self.ranks for rec in r.phases.values()), default=0)

    @property
    def host_per_node_bytes(self) -> int:
        """The largest node's host memory: the sum of its ranks' host peaks."""
        nodes: dict[int, int] = {}
        for r in self.ranks:
            nodes[r.node] = nodes.get(r.node, 0) + max(
                (rec.get("host_peak", 0) for rec in r.phases.values()), default=0
            )
        return max(nodes.values(), default=0)

    @property
    def step_seconds(self) -> list[float]:
        # A step ends when the slowest rank ends.
        per_step = zip(*(r.step_seconds for r in self.ranks)) if self.ranks else []
        return [max(s) for s in per_step]

    @property
    def step_seconds_median(self) -> float | None:
        s = self.step_seconds
        return statistics.median(s) if s else None

    @property
    def step_seconds_spread(self) -> float | None:
        s = self.step_seconds
        return (max(s) - min(s)) if s else None

    @property
    def tokens_per_second(self) -> float | None:
        med = self.step_seconds_median
        w = self.request.workload
        return (w.completions_per_step * w.sequence_tokens / med) if med else None

    def summary(self) -> dict:
        return {
            "ok": self.ok,
            "fits": self.fits,
            "failure": self.failure,
            "oom": self.oom,
            "oom_phase": self.oom_phase,
            "over_budget_phases": self.over_budget_phases,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "host_peak_bytes": self.host_peak_bytes,
            "host_per_node_bytes": self.host_per_node_bytes,
            "step_seconds_median": self.step_seconds_median,
            "step_seconds_spread": self.step_seconds_spread,
            "tokens_per_second": self.tokens_per_second,
        }

    def table(self) -> str:
        return _format_table(self)


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.2f}"


def _format_table(m: Measurement) -> str:
    req = m.request
    lines = [
        f"probe {req.model} on {req.nproc} x {req.device}"
        + (f", fsdp {req.fsdp.model_dump(exclude_defaults=True) or 'defaults'}" if req.fsdp else ", unsharded")
    ]
    if not m.ok:
        lines.append(f"FAILED: {m.failure}")
        if m.oom:
            lines.append(f"out of memory in phase {m.oom_phase}")
        return "\n".join(lines)
    components = [
        c
        for c in COMPONENTS + ("host_optimizer_state",)
        if any(rec.get(c, 0) for r in m.ranks for rec in r.phases.values())
    ]
    rows = [
        (
            r.rank,
            phase,
            [*(_mib(rec.get(c, 0)) for c in components), _mib(m.device_peak(rec)), _mib(rec.get("host_peak", 0))],
        )
        for r in m.ranks
        for phase in PHASES
        if (rec := r.phases.get(phase)) is not None
    ]
    names = [*components, "total MiB", "host MiB"]
    # each column as wide as its whole name and its widest figure, and a space before it
    widths = [max(10, len(name), *(len(cells[i]) for _, _, cells in rows)) + 1 for i, name in enumerate(names)]
    lines.append(f"{'rank':>4} {'phase':<10}" + "".join(f"{c:>{w}}" for c, w in zip(names, widths)))
    for rank, phase, cells in rows:
        lines.append(f"{rank:>4} {phase:<10}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append(
        f"peak {_mib(m.peak_bytes)} MiB per rank (phase {m.peak_phase}); host peak {_mib(m.host_peak_bytes)} MiB"
        f" per rank, {_mib(m.host_per_node_bytes)} MiB per node"
    )
    imbalance = m.moe_load_imbalance
    if imbalance is not None:
        busiest = max(r.moe_rows["max_block"] for r in m.ranks if r.moe_rows)
        lines.append(
            f"MoE routed rows per token block: busiest {busiest:,.0f}, {imbalance:.2f}x the mean (1.00 is balanced)"
        )
    if m.step_seconds:
        lines.append(
            f"step {m.step_seconds_median:.3f} s median (spread {m.step_seconds_spread:.3f} s over "
            f"{len(m.step_seconds)} steps); {m.tokens_per_second:,.0f} tokens/s"
        )
    if req.memory_budget_bytes:
        verdict = "fits" if m.fits else f"does NOT fit (over in {sorted(m.over_budget_phases)})"
        lines.append(f"budget {_mib(req.memory_budget_bytes)} MiB per rank: {verdict}")
    return "\n".join(lines)


def _commands(request: ProbeRequest, request_path: Path, out_dir: Path) -> list[list[str]]:
    """One launcher per node this host runs: the ranks themselves, one torchrun, or (emulated nodes) one
    torchrun agent per node joined by c10d rendezvous on localhost."""
    worker = ["-m", "planner.probe._worker", str(request_path), str(out_dir)]
    if request.nproc == 1 and request.fsdp is None:
        return [[sys.executable, *worker]]
    run = [sys.executable, "-m", "torch.distributed.run"]
    if request.nnodes == 1:
        return [[*run, "--standalone", f"--nproc_per_node={request.nproc}", *worker]]
    nodes = [f"--nnodes={request.nnodes}", f"--nproc_per_node={request.nproc_per_node}", "--rdzv-backend=c10d"]
    if request.rdzv_endpoint is not None:  # a real node of a multi-node probe
        return [[*run, *nodes, f"--rdzv-endpoint={request.rdzv_endpoint}", "--rdzv-id=agilerl-probe", *worker]]
    endpoint = f"127.0.0.1:{_free_port()}"
    rdzv_id = f"agilerl-probe-{os.getpid()}-{time.monotonic_ns()}"
    return [
        [
            *run,
            *nodes,
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--node-rank={i}",
            "--local-addr=127.0.0.1",
            *worker,
        ]
        for i in range(request.nnodes)
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); None once gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; torchrun puts its ranks in new sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: it exists and is not a zombie (dead, waiting to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _kill_group(proc: subprocess.Popen, *, wait_s: float = 10.0) -> None:
    """Kill the launch and everything it started: its process group and every descendant, and
    wait (up to ``wait_s``) until they have exited: a rank SIGKILLed with gigabytes mapped takes
    a moment to go, and a tuner stopped by Ctrl-C must not leave one behind it."""
    victims = _descendants(proc.pid) if Path("/proc").is_dir() else []
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in victims) and time.monotonic() < deadline:
        time.sleep(0.02)


def run_probe(
    request: ProbeRequest,
    *,
    progress: Callable[[str], None] | None = None,
    failure_grace_s: float = 10.0,
    env: dict[str, str] | None = None,
) -> Measurement:
    """Launch the probe and wait for it; never raises for a failed, killed or out-of-memory run."""
    say = progress or (lambda _msg: None)
    work = Path(tempfile.mkdtemp(prefix="agilerl-probe-"))
    request_path = work / "request.json"
    request_path.write_text(request.model_dump_json())
    out_dir = work / "out"
    out_dir.mkdir()
    run_env = dict(os.environ)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    run_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    run_env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + run_env.get("PYTHONPATH", "")
    run_env.update(env or {})
    log_path = work / "worker.log"
    start = time.monotonic()
    say(f"launching {request.nproc} rank(s) on {request.device}")
    with log_path.open("wb") as log:
        parent = os.getpid()
        procs = [
            subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=run_env,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(parent),
            )  # kill -9 of us takes them too
            for cmd in _commands(request, request_path, out_dir)
        ]
        failure: str | None = None
        failed_at: float | None = None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now - start > request.timeout_s:
                    failure = f"timed out after {request.timeout_s:.0f}s"
                    break
                if failed_at is None and (
                    any(_failed(p) for p in out_dir.glob("rank*.json")) or any(p.poll() not in (None, 0) for p in procs)
                ):
                    failed_at = now
                    say("a rank failed; stopping the others")
                if failed_at is not None and now - failed_at > failure_grace_s:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                _kill_group(p)  # nothing of the launch outlives the probe
                p.wait()
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    wall = time.monotonic() - start
    tail = log_path.read_text(errors="replace")[-3000:]
    ranks = []
    for path in sorted(out_dir.glob("rank*.json")):
        data = json.loads(path.read_text())
        ranks.append(
            RankMeasurement(
                rank=data["rank"],
                node=data.get("node", 0),
                phases=data.get("phases", {}),
                step_seconds=data.get("step_seconds", []),
                param_bytes=data.get("param_bytes", {}),
                load_seconds=data.get("load_seconds"),
                stages=data.get("stages", {}),
                error=data.get("error"),
                oom=data.get("oom", False),
                oom_phase=data.get("oom_phase"),
                moe_rows=data.get("moe_rows", {}),
                engine=data.get("engine", {}),
            )
        )
        mb, chunk = data.get("micro_batch_size_per_gpu"), data.get("logprob_chunk_size")
    ranks.sort(key=lambda r: r.rank)
    oom = any(r.oom for r in ranks)
    oom_phase = next((r.oom_phase for r in ranks if r.oom), None)
    expected = request.nproc_per_node if request.rdzv_endpoint is not None else request.nproc
    complete = len(ranks) == expected and all(r.error is None for r in ranks)
    if failure is None and not complete:
        errors = [f"rank {r.rank}: {r.error.strip().splitlines()[-1]}" for r in ranks if r.error]
        failure = "; ".join(errors) if errors else f"worker exited with {returncode} without a result"
        failure += f"\n--- worker output (tail) ---\n{tail}"
    elif failure is not None:
        failure += f"\n--- worker output (tail) ---\n{tail}"
    over: dict[str, int] = {}
    for r in ranks:
        for phase, rec in r.phases.items():
            value = rec.get("cuda_max_allocated", rec.get("total", 0))
            if request.memory_budget_bytes and value > request.memory_budget_bytes:
                over[phase] = max(over.get(phase, 0), value)
    say("done" if failure is None else "failed")
    return Measurement(
        request=request,
        ok=failure is None,
        failure=failure,
        oom=oom,
        oom_phase=oom_phase,
        over_budget_phases=over,
        ranks=ranks,
        micro_batch_size_per_gpu=mb if ranks else None,
        logprob_chunk_size=chunk if ranks else None,
        wall_seconds=wall,
        work_dir=str(work),
    )


def _failed(path: Path) -> bool:
    try:
        return not json.loads(path.read_text()).get("ok", True)
    except (OSError, json.JSONDecodeError):
        return False
