"""MoE memory: the expert chunk's slope, and the planner's estimate against probes of MoE runs.

    python -m benchmarks.moe_memory [--device cpu] [--rerun] [--fit]

Two tables, from real probes of the GRPO trainer on tiny random MoE models
(packed experts, LoRA on every linear and on the expert stacks):

1. **Chunk slope**: learn-phase peak per rank against ``routed_expert_chunk_mib``
   (1 to 8 MiB, small enough to bind on these models: a micro-batch routes
   ~16 MiB of expert rows), with and without expert parallelism. The slope of
   the measured peak (MiB of peak per MiB of chunk) is fitted by least squares
   and printed beside the planner's slope over the same chunks.
2. **Accuracy**: a fixed grid over world size (1, 2, 4), ep (1, 2, 4), the
   chunk (None, 1, 4 MiB; None is resolved by the trainer and the estimate
   alike, to 512 MiB here; one GPU runs unsharded, i.e. the Hugging Face
   experts on PEFT's merged stacks), checkpointing, micro-batch and sequence length, on
   two architectures. Configurations alternate between a fit half and a
   held-out half; ``--fit`` fits only the MoE coefficients
   (``planner.memory.Coefficients.moe_*``) on the fit half and merges them
   into ``planner/coefficients_<device>.json``; headline numbers are on the
   held-out half.

Measurements are cached in ``benchmarks/results/moe_<device>.json``.
"""

from __future__ import annotations

import argparse
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
from planner.probe import ProbeRequest
from planner.workload import Workload

ROOT = Path(__file__).resolve().parent.parent

ARCHS = {
    "qwen3_moe": "tiny:qwen3_moe?hidden_size=128&moe_intermediate_size=512&num_experts=8&num_experts_per_tok=2"
    "&num_layers=2&num_heads=4&num_kv_heads=2&vocab_size=1024",
    "mixtral": "tiny:mixtral?hidden_size=96&intermediate_size=384&num_local_experts=4&num_experts_per_tok=2"
    "&num_layers=3&num_heads=4&num_kv_heads=2&vocab_size=768",
}
PHASES = ("reference", "learn", "step")
MOE_COEFFICIENTS = ("moe_rows_saved", "moe_chunk", "moe_dispatch", "moe_stack_grad")
SLOPE_CHUNKS = (1, 2, 4, 8)


def slope_configs() -> list[dict]:
    return [
        dict(kind="slope", arch="qwen3_moe", world=2, ep=ep, chunk=c, gc=True, micro=4, seq=512)
        for ep in (1, 2)
        for c in SLOPE_CHUNKS
    ]


def grid_configs() -> list[dict]:
    rows = [
        # arch, world, ep, chunk, gc, micro, seq
        ("qwen3_moe", 1, 1, None, True, 4, 512),
        ("qwen3_moe", 1, 1, None, False, 2, 256),
        ("qwen3_moe", 2, 1, None, True, 4, 512),
        ("qwen3_moe", 2, 1, None, False, 4, 256),
        ("qwen3_moe", 2, 1, 1, True, 4, 512),
        ("qwen3_moe", 2, 1, 4, False, 2, 512),
        ("qwen3_moe", 2, 2, None, True, 4, 512),
        ("qwen3_moe", 2, 2, 1, False, 4, 256),
        ("qwen3_moe", 2, 2, 4, True, 2, 512),
        ("qwen3_moe", 4, 2, 1, True, 4, 512),
        ("qwen3_moe", 4, 4, 1, True, 2, 512),
        ("qwen3_moe", 4, 4, None, False, 4, 256),
        ("qwen3_moe", 4, 1, 4, True, 4, 256),
        ("qwen3_moe", 4, 2, None, True, 2, 512),
        ("mixtral", 1, 1, None, True, 4, 512),
        ("mixtral", 2, 1, None, True, 4, 256),
        ("mixtral", 2, 1, 1, True, 4, 512),
        ("mixtral", 2, 2, 1, True, 2, 512),
        ("mixtral", 2, 2, None, False, 4, 256),
        ("mixtral", 4, 4, 1, False, 4, 512),
        ("mixtral", 4, 2, 4, True, 4, 512),
        ("mixtral", 4, 1, None, True, 2, 256),
    ]
    out = []
    for i, (arch, world, ep, chunk, gc, micro, seq) in enumerate(rows):
        out.append(
            dict(
                kind="grid",
                id=i,
                half="fit" if i % 2 == 0 else "held-out",
                arch=arch,
                world=world,
                ep=ep,
                chunk=chunk,
                gc=gc,
                micro=micro,
                seq=seq,
            )
        )
    return out


def request_for(c: dict, device: str) -> ProbeRequest:
    workload = Workload(
        padded_batches=False,  # the probes' synthetic rows have one length
        share_prompt_prefix=False,  # random rows that share nothing
        prompts_per_step=4,
        group_size=4,
        prompt_tokens=c["seq"] // 2,
        completion_tokens=c["seq"] // 2,
        micro_batch_size_per_gpu=c["micro"],
        logprob_chunk_size=256,
        gradient_checkpointing=c["gc"],
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.0,
        weights_dtype="bfloat16",
        attn_implementation="sdpa",
        generation="none",
    )
    fsdp = None
    if c["world"] > 1:
        fsdp = FSDPConfig(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            param_persistence_threshold=0,
            ep=c["ep"],
            routed_expert_chunk_mib=c["chunk"],
        )
    return ProbeRequest(
        model=ARCHS[c["arch"]],
        workload=workload,
        fsdp=fsdp,
        nproc=c["world"],
        device=device,
        timed_steps=1,
        timeout_s=600,
    )


def estimated(c: dict, device: str, coefficients: Coefficients):
    return estimate_request(request_for(c, device), coefficients)


def peaks(c: dict, results: dict, device: str, coefficients: Coefficients) -> tuple[int, int] | None:
    """(measured, estimated) per-rank peak over the phases both have."""
    key = cache_key(request_for(c, device))
    if key not in results:
        return None
    phases = results[key]["phases"]
    est = estimated(c, device, coefficients)
    common = [ph for ph in phases if ph in est.phases]
    return max(phases[ph]["total"] for ph in common), max(est.phases[ph].total for ph in common)


def _least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def slope_report(results: dict, device: str, coefficients: Coefficients) -> None:
    print("\nlearn peak per rank vs routed_expert_chunk_mib (qwen3_moe tiny, 2 ranks, checkpointing):")
    print(f"{'ep':>3} {'chunk MiB':>9} {'measured MiB':>13} {'estimate MiB':>13}")
    for ep in (1, 2):
        xs, measured, est = [], [], []
        for c in slope_configs():
            if c["ep"] != ep:
                continue
            got = peaks(c, results, device, coefficients)
            if got is None:
                continue
            xs.append(c["chunk"])
            measured.append(got[0] / 2**20)
            est.append(got[1] / 2**20)
            print(f"{ep:>3} {c['chunk']:>9} {measured[-1]:>13.2f} {est[-1]:>13.2f}")
        if len(xs) >= 2:
            print(
                f"    slope: measured {_least_squares_slope(xs, measured):.2f} MiB per MiB of chunk, "
                f"planner {_least_squares_slope(xs, est):.2f}"
            )


def grid_report(configs: list[dict], results: dict, device: str, coefficients: Coefficients) -> None:
    for half in ("fit", "held-out"):
        rows = []
        for c in configs:
            if c["half"] != half:
                continue
            got = peaks(c, results, device, coefficients)
            if got is not None:
                rows.append((c, *got))
        if not rows:
            print(f"\n{half} half: no measurements")
            continue
        errs = [abs(e - m) / m for _, m, e in rows]
        print(
            f"\n{half.upper() if half == 'held-out' else half} half: {len(rows)} configurations; peak per rank, "
            f"mean |error| {100 * statistics.fmean(errs):.2f}%, max |error| {100 * max(errs):.2f}%"
        )
        print(
            f"{'id':>3} {'arch':>9} {'W':>2} {'ep':>3} {'chunk':>5} {'gc':>5} {'mb':>3} {'seq':>4}"
            f" {'measured MiB':>13} {'estimate MiB':>13} {'error':>7}"
        )
        for c, m, e in rows:
            print(
                f"{c['id']:>3} {c['arch']:>9} {c['world']:>2} {c['ep']:>3} {c['chunk']!s:>5} {c['gc']!s:>5}"
                f" {c['micro']:>3} {c['seq']:>4} {m / 2**20:>13.2f} {e / 2**20:>13.2f} {100 * (e - m) / m:>+6.2f}%"
            )


def samples(configs, results, device) -> list[Sample]:
    return calibration_samples(configs, lambda c: request_for(c, device), results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rerun", action="store_true", help="ignore cached measurements")
    parser.add_argument("--fit", action="store_true", help="fit the MoE coefficients on the fit half and save them")
    args = parser.parse_args()
    grid = grid_configs()
    cache = ROOT / "benchmarks" / "results" / f"moe_{args.device}.json"
    results = measure_cached(
        slope_configs() + grid, lambda c: request_for(c, args.device), cache=cache, rerun=args.rerun, phases=PHASES
    )
    coeff_path = coefficients_path(args.device)
    coefficients = saved_coefficients(args.device)
    if args.fit:
        train = samples([c for c in grid if c["half"] == "fit"] + slope_configs(), results, args.device)
        coefficients = fit_coefficients(train, start=coefficients, names=MOE_COEFFICIENTS)
        coeff_path.write_text(coefficients.model_dump_json(indent=1))
        fitted = {n: getattr(coefficients, n) for n in MOE_COEFFICIENTS}
        print(f"fitted on the fit half and the slope sweep -> {coeff_path.relative_to(ROOT)}: {fitted}")
    slope_report(results, args.device, coefficients)
    grid_report(grid, results, args.device, coefficients)


if __name__ == "__main__":
    main()
