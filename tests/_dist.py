"""Run many multi-rank test cases in one torchrun launch.

A 2-rank launch that imports torch, transformers and peft costs seconds on a
2-core machine; the cases themselves cost milliseconds. So a test module
declares its cases with ``@cases.case`` and ``cases.pytest_test()`` turns them
into one parametrized pytest test per case, all served by a single launch:

    cases = DistCases(__name__, nproc=2)

    @cases.case
    def shards_embedding(ctx):
        assert ...

    test_dist = cases.pytest_test()

Each rank runs every case in order and appends a JSON line per case to its
results file, so a hang or crash loses only the cases not yet run. The launch
runs in its own process group with a hard timeout and is killed whole on
expiry; ranks use a 60 s collective timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


class Calls:
    """How many times the functions :func:`count_calls` wraps were called (``n``, read at any time)."""

    n: int = 0


@contextmanager
def count_calls(owner: object, *names: str) -> Iterator[Calls]:
    """Count the calls of ``owner.<name>`` (e.g. ``torch.distributed.all_reduce``) for each name
    it has, while the block runs; the originals are put back however it ends."""
    calls = Calls()
    originals = {name: getattr(owner, name) for name in names if hasattr(owner, name)}
    assert originals, f"{owner!r} has none of {names}"

    def counting(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls.n += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(owner, name, counting(fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(owner, name, fn)


@dataclass
class CaseContext:
    rank: int
    world_size: int
    shared_dir: Path  # the same directory on every rank


@dataclass
class CaseResult:
    ok: bool
    detail: str


class DistCases:
    def __init__(self, module: str, *, nproc: int = 2, launch_timeout_s: float = 300.0) -> None:
        self.module = module
        self.nproc = nproc
        self.launch_timeout_s = launch_timeout_s
        self.cases: dict[str, Callable[[CaseContext], None]] = {}
        self._results: dict[str, CaseResult] | None = None

    def case(self, fn: Callable[[CaseContext], None]) -> Callable[[CaseContext], None]:
        if fn.__name__.startswith("test"):
            raise ValueError("case names must not start with 'test' (pytest would collect them)")
        self.cases[fn.__name__] = fn
        return fn

    # -- parent side ------------------------------------------------------------
    def results(self) -> dict[str, CaseResult]:
        if self._results is None:
            self._results = _launch(self.module, list(self.cases), self.nproc, self.launch_timeout_s)
        return self._results

    def pytest_test(self) -> Callable[..., None]:
        names = list(self.cases)

        @pytest.mark.multiproc
        @pytest.mark.timeout(self.launch_timeout_s + 60)
        @pytest.mark.parametrize("case_name", names)
        def test_dist(case_name: str) -> None:
            result = self.results()[case_name]
            if not result.ok:
                pytest.fail(result.detail, pytrace=False)

        return test_dist


def _launch(module: str, names: list[str], nproc: int, timeout_s: float) -> dict[str, CaseResult]:
    out_dir = Path(tempfile.mkdtemp(prefix="agilerl-dist-"))
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "tests._dist_worker",
        module,
        ",".join(names),
        str(out_dir),
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        failure = None if proc.returncode == 0 else f"launch exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        failure = f"launch timed out after {timeout_s:.0f}s"
    tail = output.decode(errors="replace")[-4000:]
    per_rank: dict[str, list[tuple[int, bool, str]]] = {n: [] for n in names}
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_rank[rec["case"]].append((rank, rec["ok"], rec["detail"]))
    results: dict[str, CaseResult] = {}
    for name in names:
        records = per_rank[name]
        if len(records) < nproc:
            results[name] = CaseResult(
                False,
                f"case did not finish on every rank ({failure or 'unknown failure'}, "
                f"{time.monotonic() - start:.0f}s); launch output tail:\n{tail}",
            )
            continue
        bad = [f"rank {r}: {d}" for r, ok, d in records if not ok]
        results[name] = CaseResult(not bad, "\n".join(bad))
    return results
