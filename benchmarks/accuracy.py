"""Estimate vs measurement: the planner's per-rank peak against real probes of the trainer.

    python -m benchmarks.accuracy [--device cpu] [--limit K] [--rerun] [--fit]

Runs the probe over a fixed, seeded set of configurations of small models
(two architectures; world sizes 1, 2 and 4; reshard on/off; wrap 1/2;
checkpointing on/off; micro-batch 1/2/4; sequences of 64 to 512 tokens; LoRA
rank 8 and 64; optimizer offload on/off), caches each measurement in
``benchmarks/results/accuracy_<device>.json``, and prints estimated vs
measured peak per rank, in total and per component.

Configurations alternate between a fit half and a held-out half. ``--fit``
fits the kernel-dependent coefficients (planner.memory.Coefficients) on the
fit half only, writes them to ``planner/coefficients_<device>.json``, and the
report's headline numbers are on the held-out half.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from agilerl.distributed import FSDPConfig
from benchmarks._probe_cache import (
    cache_key,
    calibration_samples,
    coefficients_path,
    estimate_request,
    measure_cached,
    saved_coefficients,
)
from planner.calibration import Sample, fit_coefficients
from planner.memory import Coefficients
from planner.probe import COMPONENTS, ProbeRequest
from planner.workload import Workload

ROOT = Path(__file__).resolve().parent.parent

ARCHS = {
    "qwen2": "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096",
    "llama": "tiny:llama?hidden_size=192&intermediate_size=384&num_layers=3&num_heads=6&num_kv_heads=2&vocab_size=6144",
}
PHASES = ("rollout", "reference", "learn", "step")


def configurations(count: int = 36, seed: int = 0) -> list[dict]:
    """A seeded sample of the grid that covers every value of every knob."""
    rng = random.Random(seed)
    grid = dict(
        arch=list(ARCHS),
        world=[1, 2, 4],
        reshard=[True, False],
        wrap=[1, 2],
        gc=[True, False],
        micro=[1, 2, 4],
        seq=[64, 128, 256, 512],
        rank=[8, 64],
        offload=[False, True],
        generate=[False, True],
    )
    configs = []
    for i in range(count):
        c = {k: v[i % len(v)] if i < 2 * max(len(x) for x in grid.values()) else rng.choice(v) for k, v in grid.items()}
        # Decorrelate the knobs: shuffle each knob's cycle position by the seeded rng.
        c = {k: rng.choice(v) if rng.random() < 0.5 else c[k] for k, v in grid.items()}
        if c["world"] == 1:
            c["offload"] = False  # unsharded: the offload knob belongs to FSDPConfig
        c["id"] = i
        c["half"] = "fit" if i % 2 == 0 else "held-out"
        configs.append(c)
    return configs


def request_for(c: dict, device: str) -> ProbeRequest:
    # Tracked generation is slow on CPU: generated configurations complete 64 tokens.
    completion = min(64, c["seq"] // 2) if c["generate"] else c["seq"] // 2
    workload = Workload(
        padded_batches=False,  # the probes' synthetic rows have one length
        share_prompt_prefix=False,  # random rows that share nothing
        prompts_per_step=2,
        group_size=8,
        prompt_tokens=c["seq"] - completion,
        completion_tokens=completion,
        micro_batch_size_per_gpu=c["micro"],
        logprob_chunk_size=256,
        gradient_checkpointing=c["gc"],
        lora_rank=c["rank"],
        lora_alpha=2 * c["rank"],
        lora_dropout=0.0,  # the trainer's default (benchmarks/lora_dropout_memory.py probes dropout)
        weights_dtype="bfloat16",
        attn_implementation="sdpa",
        generation="hf" if c["generate"] else "none",
    )
    fsdp = None
    if c["world"] > 1:
        fsdp = FSDPConfig(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            param_persistence_threshold=0,
            reshard_after_forward=c["reshard"],
            wrap_every_n_blocks=c["wrap"],
            optim_cpu_offload=c["offload"],
        )
    return ProbeRequest(
        model=ARCHS[c["arch"]],
        workload=workload,
        fsdp=fsdp,
        nproc=c["world"],
        device=device,
        generate=c["generate"],
        timed_steps=1,
        timeout_s=600,
    )


def estimate_for(c: dict, device: str, coefficients: Coefficients):
    return estimate_request(request_for(c, device), coefficients)


def errors(configs, results, device, coefficients) -> list[dict]:
    rows = []
    for c in configs:
        key = cache_key(request_for(c, device))
        if key not in results:
            continue
        measured = results[key]
        est = estimate_for(c, device, coefficients)
        phases = {ph: rec for ph, rec in measured["phases"].items() if ph in est.phases}
        m_peak = max(rec["total"] for rec in phases.values())
        e_peak = max(est.phases[ph].total for ph in phases)
        rows.append(
            {
                "config": c,
                "measured": m_peak,
                "estimated": e_peak,
                "error": (e_peak - m_peak) / m_peak,
                "phases": {ph: (est.phases[ph].total, rec["total"]) for ph, rec in phases.items()},
                "components": {
                    ph: (
                        {n: est.phases[ph].components.get(n, 0) for n in COMPONENTS},
                        {n: rec.get(n, 0) for n in COMPONENTS},
                    )
                    for ph, rec in phases.items()
                },
            }
        )
    return rows


def samples_for(configs, results, device) -> list[Sample]:
    return calibration_samples(configs, lambda c: request_for(c, device), results)


def fit(configs, results, device) -> Coefficients:
    """Fit the kernel-dependent coefficients on the fit half only (planner.calibration)."""
    train = [c for c in configs if c["half"] == "fit"]
    return fit_coefficients(samples_for(train, results, device))


def report(rows: list[dict], title: str) -> None:
    if not rows:
        print(f"{title}: no measurements")
        return
    abs_err = [abs(r["error"]) for r in rows]
    print(
        f"\n{title}: {len(rows)} configurations; peak per rank, mean |error| {100 * statistics.fmean(abs_err):.2f}%, "
        f"max |error| {100 * max(abs_err):.2f}%"
    )
    print(
        f"{'id':>3} {'arch':>6} {'W':>2} {'resh':>5} {'wrap':>4} {'gc':>5} {'mb':>3} {'seq':>4} {'r':>3} {'offl':>5}"
        f" {'gen':>5} {'measured MiB':>13} {'estimate MiB':>13} {'error':>7}"
    )
    for r in rows:
        c = r["config"]
        print(
            f"{c['id']:>3} {c['arch']:>6} {c['world']:>2} {c['reshard']!s:>5} {c['wrap']:>4} {c['gc']!s:>5}"
            f" {c['micro']:>3} {c['seq']:>4} {c['rank']:>3} {c['offload']!s:>5} {c['generate']!s:>5}"
            f" {r['measured'] / 2**20:>13.2f} {r['estimated'] / 2**20:>13.2f} {100 * r['error']:>+6.2f}%"
        )


def phase_report(rows: list[dict]) -> None:
    """Each phase's own error, the peak or not: a plan prints every phase, and a phase that is
    not a configuration's peak can be another workload's."""
    print("\nper phase, every configuration (its peak or not): mean / worst |error|, and the worst's id")
    for half in ("fit", "held-out"):
        for phase in PHASES:
            errs = [
                ((est - meas) / meas, r["config"]["id"])
                for r in rows
                if r["config"]["half"] == half and phase in r["phases"]
                for est, meas in [r["phases"][phase]]
            ]
            if errs:
                worst = max(errs, key=lambda e: abs(e[0]))
                print(
                    f"  {half:<9} {phase:<10} {len(errs):>3} configurations  "
                    f"{100 * statistics.fmean(abs(e) for e, _ in errs):5.2f}% / {100 * worst[0]:+6.2f}% (id {worst[1]})"
                )


def component_report(rows: list[dict]) -> None:
    print("\nper component, learn phase (sum over configurations; error of the sum):")
    for name in COMPONENTS:
        est = sum(r["components"].get("learn", ({}, {}))[0].get(name, 0) for r in rows)
        meas = sum(r["components"].get("learn", ({}, {}))[1].get(name, 0) for r in rows)
        if est or meas:
            err = (est - meas) / meas * 100 if meas else float("inf")
            print(f"  {name:<20} measured {meas / 2**20:>10.2f} MiB  estimate {est / 2**20:>10.2f} MiB  {err:+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--limit", type=int, default=None, help="only the first K configurations")
    parser.add_argument("--rerun", action="store_true", help="ignore cached measurements")
    parser.add_argument("--fit", action="store_true", help="fit coefficients on the fit half and save them")
    args = parser.parse_args()
    configs = configurations()[: args.limit]
    cache = ROOT / "benchmarks" / "results" / f"accuracy_{args.device}.json"
    results = measure_cached(
        configs, lambda c: request_for(c, args.device), cache=cache, rerun=args.rerun, phases=PHASES
    )
    if args.fit:
        coefficients = fit(configs, results, args.device)
        coeff_path = coefficients_path(args.device)
        coeff_path.write_text(coefficients.model_dump_json(indent=1))
        print(f"fitted on the fit half -> {coeff_path.relative_to(ROOT)}: {coefficients.model_dump()}")
    else:
        coefficients = saved_coefficients(args.device)
    rows = errors(configs, results, args.device, coefficients)
    report([r for r in rows if r["config"]["half"] == "fit"], "fit half")
    held = [r for r in rows if r["config"]["half"] == "held-out"]
    report(held, "HELD-OUT half")
    phase_report(rows)
    component_report(held)


if __name__ == "__main__":
    main()
