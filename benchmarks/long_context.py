"""Long context: the estimate against probes of 4k to 32k tokens per micro-batch.

    python -m benchmarks.long_context [--rerun]

A tiny but wide Qwen2 (hidden 256, MLP 1024, 2 layers) in bf16 with fp32 LoRA
adapters on one CPU device, SDPA, checkpointing on and off, micro-batches of
1-8 sequences of 4,096 tokens and 2 of 8,192. Each configuration is probed once
(cached in ``benchmarks/results/long_context_cpu.json``) and the per-phase peaks are
compared with the estimate, with the per-token growth of the learn peak: what grows
with context is what the estimate must count.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks._probe_cache import cache_key, estimate_request, measure_cached, saved_coefficients
from planner.probe import ProbeRequest
from planner.workload import Workload

ROOT = Path(__file__).resolve().parent.parent

MODEL = (
    "tiny:qwen2?hidden_size=256&intermediate_size=1024&num_layers=2&num_heads=4&num_kv_heads=2"
    "&vocab_size=4096&max_position_embeddings=8192"
)
PHASES = ("reference", "learn", "step")
#: (sequences per micro-batch, tokens per sequence), smallest first.
SHAPES = ((1, 4096), (2, 4096), (4, 4096), (2, 8192), (8, 4096))


def configurations() -> list[dict]:
    return [dict(micro=m, seq=t, gc=gc) for m, t in SHAPES for gc in (True, False)]


def request_for(c: dict) -> ProbeRequest:
    workload = Workload(
        padded_batches=False,  # the probes' synthetic rows have one length
        share_prompt_prefix=False,  # random rows that share nothing
        prompts_per_step=1,
        group_size=max(2, c["micro"]),
        prompt_tokens=c["seq"] // 4,
        completion_tokens=c["seq"] - c["seq"] // 4,
        micro_batch_size_per_gpu=c["micro"],
        logprob_chunk_size=1024,
        gradient_checkpointing=c["gc"],
        lora_rank=16,
        lora_alpha=32,
        lora_dropout=0.0,
        weights_dtype="bfloat16",
        attn_implementation="sdpa",
        generation="none",
    )
    return ProbeRequest(model=MODEL, workload=workload, nproc=1, timed_steps=1, timeout_s=3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rerun", action="store_true", help="ignore cached measurements")
    args = parser.parse_args()
    configs = configurations()
    cache = ROOT / "benchmarks" / "results" / "long_context_cpu.json"
    results = measure_cached(configs, request_for, cache=cache, rerun=args.rerun, phases=PHASES)
    coefficients = saved_coefficients("cpu")
    print(f"model {MODEL}, bf16 base, fp32 LoRA r=16, SDPA, one CPU device")
    print(
        f"{'tokens':>7} {'mb x len':>10} {'ckpt':>5} {'phase':>9} "
        f"{'measured MiB':>13} {'estimate MiB':>13} {'error':>7}"
    )
    errors = []
    learn: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
    for c in configs:
        req = request_for(c)
        rec = results.get(cache_key(req))
        if rec is None:
            continue
        est = estimate_request(req, coefficients)
        tokens = c["micro"] * c["seq"]
        for ph in PHASES:
            if ph not in rec["phases"]:
                continue
            m, e = rec["phases"][ph]["total"], est.phases[ph].total
            errors.append((e - m) / m)
            print(
                f"{tokens:>7} {c['micro']:>3} x {c['seq']:<5} {'on' if c['gc'] else 'off':>5} {ph:>9}"
                f" {m / 2**20:>13.2f} {e / 2**20:>13.2f} {100 * (e - m) / m:>+6.2f}%"
            )
        learn[c["gc"]].append((tokens, rec["phases"]["learn"]["total"], est.phases["learn"].total))
    if errors:
        print(
            f"\nall phases: mean |error| {100 * statistics.fmean(abs(e) for e in errors):.2f}%, "
            f"max {100 * max(abs(e) for e in errors):.2f}%"
        )
    for gc, points in learn.items():
        if len(points) >= 2:
            (t0, m0, e0), (t1, m1, e1) = min(points), max(points)
            print(
                f"learn peak growth, checkpointing {'on' if gc else 'off'}: measured {(m1 - m0) / (t1 - t0):.0f} "
                f"bytes per token, estimate {(e1 - e0) / (t1 - t0):.0f}"
            )


if __name__ == "__main__":
    main()
