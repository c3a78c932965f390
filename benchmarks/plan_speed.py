"""How fast is planning? Estimate latency, and the command line cold and warm.

    python -m benchmarks.plan_speed

- ``estimate``: one call of planner.memory.estimate, median of 200, per catalog model;
- ``plan``: one call of planner.choose.plan (tens of estimates);
- a TUI change on Llama-3.1-70B, 16 GPUs: what the explorer's worker does after one knob moves
  (validate the knobs, plan, validate the manifest), for a knob that keeps the model's layout
  (the micro-batch) and one that makes a new one (the LoRA rank);
- the CLI cold for a catalog model (a fresh interpreter: the shipped spec, no torch);
- the CLI for a config.json identical to a catalog entry's (it uses the shipped spec), and for one
  that is not (Qwen2.5-7B's with 30 layers): cold (empty spec cache: builds the spec on the meta
  device, importing torch and transformers; PEFT only for targets beyond plain linears) and warm
  (cached spec, no torch).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _timed_cli(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "planner.cli", *args], env=env, capture_output=True, check=False)
    return time.perf_counter() - start


def _tui_change() -> None:
    from planner import catalog
    from planner.memory import _units
    from tui import _request
    from tui._knobs import initial_values
    from tui.screens._explorer import _plan_job

    spec = catalog.load_spec("meta-llama/Llama-3.1-70B")
    values = initial_values(num_gpus=16, gpus_per_node=8)
    for knob, choices in (
        ("workload.micro_batch_size_per_gpu", ("1", "2", "4")),
        ("workload.lora_rank", ("8", "16", "32", "64")),
    ):
        times = []
        for i in range(24):
            values = {**values, knob: choices[i % len(choices)]}
            if knob == "workload.lora_rank":
                _units._LAYOUTS.clear()  # as if this rank were new to the session
            t = time.perf_counter()
            _plan_job(spec, _request.build_request(values))
            times.append(time.perf_counter() - t)
        print(
            f"TUI change of {knob.split('.', 1)[1]}, Llama-3.1-70B on 16 GPUs: "
            f"{statistics.median(times) * 1000:.1f} ms median, {max(times) * 1000:.1f} ms worst of 24"
        )


def main() -> None:
    from agilerl.distributed import FSDPConfig
    from planner import catalog
    from planner.choose import plan
    from planner.hardware import GPUS, Cluster
    from planner.memory import estimate
    from planner.workload import Workload

    cluster = Cluster(gpu=GPUS["H100-80GB"], num_gpus=8)
    workload = Workload(micro_batch_size_per_gpu=1, logprob_chunk_size=1024, gradient_checkpointing=True)
    print(f"{'model':<34} {'estimate ms':>12} {'plan ms':>9}")
    for name in ("Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-72B", "Qwen/Qwen3-235B-A22B"):
        spec = catalog.load_spec(name)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            estimate(spec, workload, cluster, FSDPConfig())
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        plan(spec, Workload(), cluster)
        plan_ms = (time.perf_counter() - t) * 1000
        print(f"{name:<34} {statistics.median(times) * 1000:>12.2f} {plan_ms:>9.1f}")

    _tui_change()

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cold = [_timed_cli(["meta-llama/Llama-3.1-70B", "--gpus", "8"], env) for _ in range(3)]
    print(f"CLI, catalog Llama-3.1-70B on 8 GPUs: {min(cold):.2f} s (best of 3, cold interpreter)")
    config = catalog.entry("Qwen/Qwen2.5-7B").config
    for label, cfg in (
        ("Qwen2.5-7B's, a catalog entry", config),
        ("Qwen2.5-7B's with 30 layers, not one", {**config, "num_hidden_layers": 30}),
    ):
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as cache:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            env_cfg = dict(env, AGILERL_CACHE=cache)
            first = _timed_cli([tmp, "--gpus", "8"], env_cfg)
            warm = min(_timed_cli([tmp, "--gpus", "8"], env_cfg) for _ in range(3))
        print(f"CLI, a config.json ({label}): {first:.2f} s cold (empty spec cache), {warm:.2f} s warm")


if __name__ == "__main__":
    main()
