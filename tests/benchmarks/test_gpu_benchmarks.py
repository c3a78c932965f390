"""The GPU benchmarks that cannot run here: they build their inputs offline and estimate them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_public_rows_are_rebuilt_and_estimated():
    from benchmarks import gpu_public

    rows = gpu_public.load_rows()
    assert len(rows) == 168 and {r.phase for r in rows} == {"training", "generation"}
    half = gpu_public.halves(rows)
    assert set(half.values()) == {"fit", "held-out"}
    # repeats of one configuration stay in one half
    assert all(half[r.config] == half[rows[0].config] for r in rows if r.config == rows[0].config)
    coefficients = gpu_public.Coefficients.from_json(gpu_public.CUDA_COEFFICIENTS.read_text())
    for row in (rows[0], rows[1]):  # a training and a generation row of Qwen2.5-0.5B
        estimate, components = gpu_public.estimated(row, coefficients)
        assert abs(estimate - row.measured) / row.measured < 0.1
        assert ("vllm" in components) and (("weights" in components) == (row.phase == "training"))


def _gpu_probe(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_the_gpu_probe_plans_its_configurations_offline():
    out = _gpu_probe("--dry-run")
    assert "Qwen2.5-0.5B" in out.stdout and "learn" in out.stdout and "torch " in out.stdout
    # every configuration is estimated, the QLoRA twin and OLMoE with LoRA on its attention among them
    lines = out.stdout.splitlines()
    assert any(" nf4 " in line and "learn" in line for line in lines)
    assert any(line.startswith("OLMoE") and " attn " in line and "learn" in line for line in lines)
    assert "counted" in lines[-1] and lines[-1].startswith("OLMoE")


def test_a_committed_gpu_run_is_judged_again_offline(tmp_path):
    import json

    record = ROOT / "benchmarks" / "results" / "gpu_nvidia-h200.json"
    out = _gpu_probe("--replay", str(record), "--out-dir", str(tmp_path))
    table = (tmp_path / "gpu_nvidia-h200.txt").read_text()
    assert table == out.stdout
    # the measured device peaks come from the record: reserved plus the measured context
    data = json.loads(record.read_text())
    first = data["configs"][0]
    peak = max(p["cuda_max_reserved"] for p in first["phases"].values()) + data["gpu"]["cuda_context_bytes"]
    assert f"training window: measured {peak / 2**30:.2f} GiB" in table
    assert table.count("training window: measured") == len(data["configs"])
