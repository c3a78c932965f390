"""The estimate against public GPU peaks: upstream AgileRL's GRPO + LoRA with a colocated
vLLM engine on one A100-40GB (benchmarks/data/agilerl_profiling_rig_a100.csv, its source
in benchmarks/data/README.md).

    python -m benchmarks.gpu_public [--fit] [--rows]

Each row is rebuilt as a Workload and a one-GPU Cluster (no FSDP) and estimated over
the window it measured:

- training: the largest of the reference, learn and step phases, engine asleep;
- generation: the rollout phase, engine awake, the trainer's base weights on the host
  (``offload_weights_during_rollout``).

Training rows are compared with their raw peak (``measured_raw_gib``), not the figure
the rig re-based onto its sweep's median sleeping-engine floor: the floor is not noise
from earlier processes but grows with the engine's batched tokens (OLMoE: 1.36 GiB at
2,048 tokens to 5.51 GiB at 65,536, the same in both runs of each configuration), which
is fused MoE's workspace a sleeping engine keeps (planner.memory._generation).
Generation rows are never re-based.

The rows are NVML device peaks: PyTorch's reserved memory, the CUDA context and what
vLLM holds outside the caching allocator, which is what the estimate's GPU terms add
to the counted tensors. The measured trainer is upstream's, not this project's. Where
the two differ in a way that moves memory, the benchmark says so and models the
upstream side explicitly (``UPSTREAM`` below), and the report shows the estimate with
and without those adjustments:

- the measured update is the agent's first, and upstream steps the optimizer after
  every micro-batch: AdamW allocates its moments in the first micro-batch's step, so the
  rollout, the reference pass and the first micro-batch hold none, later micro-batches
  all of them;
- upstream steps with torch's foreach AdamW, whose step allocates one fp32 copy of the
  moments (``exp_avg_sq.sqrt()``); this trainer's fused AdamW allocates none;
- upstream runs its forwards under bf16 autocast when it has no Accelerator (its
  ``_amp_ctx``), so each adapted linear saves a bf16 copy of its input where this
  trainer's saves an fp32 one (``Workload.autocast_forward``);
- upstream scores the actor's and the reference's no-grad log-probs in one pass over the
  rows stacked twice, but in forwards of a micro-batch's rows (its ``_fused_model_pass``),
  so each forward is as wide as this trainer's reference forward: nothing to adjust;
- upstream's engine profiles ``min(seqs x len, max(len, seqs x 8192))`` batched tokens
  (its ``resolve_max_num_batched_tokens``); the row sets it explicitly.

``--fit`` fits the GPU-only coefficients (allocator slack, the sleeping engine's
residue, what an awake engine holds beyond its budget) on the fit half of the rows,
writes planner/coefficients_cuda.json, and the report's headline is the other half.
Every other term is counted, not fitted.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from planner.hardware import GPUS, Cluster
from planner.memory import Coefficients, Estimate, estimate
from planner.models import load_model_spec
from planner.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data" / "agilerl_profiling_rig_a100.csv"
CUDA_COEFFICIENTS = ROOT / "planner" / "coefficients_cuda.json"
GIB = 2**30
#: Coefficients fitted here: the GPU-only terms a CPU probe cannot see.
FITTED = ("allocator_slack_fraction", "vllm_sleep_residual_bytes", "vllm_outside_budget_bytes")
#: The catalog holds the base checkpoints; an instruct checkpoint of these has the same
#: architecture and shapes (same config fields but the chat template), so its base's spec is used.
SPEC_OF = {
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B",
    "Qwen/Qwen2.5-3B-Instruct": "Qwen/Qwen2.5-3B",
    "allenai/OLMoE-1B-7B-0924-Instruct": "allenai/OLMoE-1B-7B-0924",
}
UPSTREAM = (
    "first update, a step per micro-batch: no AdamW moments before the first step; foreach AdamW: "
    "one fp32 moment-sized temporary in the step; forwards under bf16 autocast: LoRA saves bf16 copies of its inputs"
)


@dataclass(frozen=True)
class Row:
    """One public measurement, rebuilt."""

    row_id: str
    model: str
    phase: str  # training or generation
    measured: int
    rebased: int  # the rig's figure re-based onto its sweep's median floor (training)
    rig_estimate: int
    config: tuple  # identical runs share it (and a half)
    workload: Workload
    cluster: Cluster
    lora_targets: str | tuple[str, ...]


def _targets(value: str) -> str | tuple[str, ...]:
    return value if value == "all-linear" else tuple(sorted(value.split("+")))


def load_rows() -> list[Row]:
    rows = []
    for r in csv.DictReader(DATA.open()):
        seqs, length = int(r["vllm_max_num_seqs"]), int(r["seq_len"])
        targets = _targets(r["lora_targets"])
        workload = Workload(
            padded_batches=False,  # the rig: one prompt, completions pinned to one length
            share_prompt_prefix=False,  # upstream AgileRL runs every row whole
            prompts_per_step=int(r["n_prompts"]),
            group_size=int(r["group_size"]),
            prompt_tokens=int(r["prompt_tokens"]),
            completion_tokens=int(r["completion_tokens"]),
            micro_batch_size_per_gpu=int(r["micro_batch_effective"]),
            logprob_chunk_size=int(r["logprob_chunk_rows"]),
            gradient_checkpointing=r["gradient_checkpointing"] == "True",
            lora_rank=int(r["lora_rank"]),
            lora_alpha=int(r["lora_alpha"]),
            # the rig's LoraConfig names r, alpha and the targets: PEFT's default dropout, 0
            lora_dropout=0.0,
            lora_targets=targets,
            use_separate_reference_adapter=r["use_separate_reference_adapter"] == "True",
            beta=float(r["beta"]),
            update_epochs=int(r["update_epochs"]),
            weights_dtype=r["weights_dtype"],
            generation="vllm",
            vllm_gpu_memory_utilization=float(r["vllm_gpu_memory_utilization"]),
            vllm_sleep_level=int(r["vllm_sleep_level"]),
            vllm_max_num_seqs=seqs,
            vllm_max_model_len=length,
            vllm_max_num_batched_tokens=min(seqs * length, max(length, seqs * 8192)),
            offload_weights_during_rollout=r["trainer_offload_during_rollout"] == "True",
            attn_implementation=r["attn_implementation"],
            logprob_rows="all",  # upstream AgileRL's fused head scores every position
            autocast_forward=True,  # upstream's forwards run under bf16 autocast without an Accelerator
        )
        gpu = GPUS["A100-40GB"].model_copy(update={"memory_bytes": int(float(r["gpu_memory_gib"]) * GIB)})
        config = (r["model"], r["seq_len"], r["group_size"], r["micro_batch"], r["lora_rank"])
        rows.append(
            Row(
                row_id=r["row_id"],
                model=r["model"],
                phase=r["phase_measured"],
                measured=int(
                    float(r["measured_raw_gib" if r["phase_measured"] == "training" else "measured_gib"]) * GIB
                ),
                rebased=int(float(r["measured_gib"]) * GIB),
                rig_estimate=int(float(r["source_estimate_gib"]) * GIB),
                config=config,
                workload=workload,
                cluster=Cluster(gpu=gpu, num_gpus=1),
                lora_targets=targets,
            )
        )
    return rows


def halves(rows: list[Row]) -> dict[str, str]:
    """Configuration -> "fit" or "held-out", alternating over each model's distinct
    configurations in file order (repeats of one configuration stay in one half)."""
    out: dict[tuple, str] = {}
    seen: dict[str, int] = {}
    for r in rows:
        if r.config not in out:
            i = seen.get(r.model, 0)
            seen[r.model] = i + 1
            out[r.config] = "fit" if i % 2 == 0 else "held-out"
    return out


_SPECS: dict[tuple, object] = {}


def spec_of(row: Row):
    key = (row.model, row.lora_targets)
    if key not in _SPECS:
        _SPECS[key] = load_model_spec(SPEC_OF.get(row.model, row.model), lora_targets=row.lora_targets)
    return _SPECS[key]


def window(row: Row, est: Estimate, *, upstream: bool) -> tuple[int, dict[str, int]]:
    """The estimated peak of the window the row measured and its components (GiB-level
    components of the phase that peaks), with upstream's differences when ``upstream``."""
    names = ("reference", "learn", "step") if row.phase == "training" else ("rollout",)
    best, best_components = -1, {}
    for name in names:
        components = dict(est.phases[name].components)
        if upstream:
            moments = components.get("optimizer_state", 0)
            w = row.workload
            single = w.completions_per_step // w.micro_batch_size_per_gpu == 1
            if name == "step":
                components["optimizer_state"] = moments + moments // 2  # foreach: an fp32 sqrt of exp_avg_sq
            elif single or name == "reference" or row.phase == "generation":
                components.pop("optimizer_state", None)  # AdamW allocates its moments in the first step
        total = sum(components.values())
        if total > best:
            best, best_components = total, components
    return best, best_components


def estimated(row: Row, coefficients: Coefficients, *, upstream: bool = True) -> tuple[int, dict[str, int]]:
    workload = row.workload if upstream else row.workload.model_copy(update={"autocast_forward": False})
    est = estimate(spec_of(row), workload, row.cluster, None, coefficients=coefficients)
    return window(row, est, upstream=upstream)


def errors(rows: list[Row], coefficients: Coefficients, *, upstream: bool = True) -> list[float]:
    return [(estimated(r, coefficients, upstream=upstream)[0] - r.measured) / r.measured for r in rows]


def fit(rows: list[Row], start: Coefficients) -> Coefficients:
    """Least squares on relative errors of the fit half, over FITTED only (scipy-free:
    Levenberg-Marquardt from planner.calibration on relative residuals)."""
    import numpy as np

    base = start.model_dump()
    x = np.array([float(base[n]) for n in FITTED])
    scale = np.array([1.0, GIB, GIB])

    def residuals(v):
        values = {n: (int(round(val * s)) if s != 1.0 else float(val)) for n, val, s in zip(FITTED, v, scale)}
        return np.array(errors(rows, Coefficients(**{**base, **values})))

    v = x / scale
    r = residuals(v)
    cost, damping = float(r @ r), 1e-2
    for _ in range(30):
        jac = np.zeros((len(r), len(v)))
        for j in range(len(v)):
            step = 1e-3
            vp = v.copy()
            vp[j] += step
            jac[:, j] = (residuals(vp) - r) / step
        jtj, grad = jac.T @ jac, jac.T @ r
        improved = False
        for _ in range(8):
            delta = np.linalg.solve(jtj + damping * (np.diag(np.diag(jtj)) + 1e-9 * np.eye(len(v))), -grad)
            cand = np.clip(v + delta, 0.0, 8.0)
            rc = residuals(cand)
            if float(rc @ rc) < cost:
                v, r, cost, damping, improved = cand, rc, float(rc @ rc), max(1e-6, damping / 3), True
                break
            damping *= 5
        if not improved:
            break
    values = {n: (int(round(val * s)) if s != 1.0 else round(float(val), 4)) for n, val, s in zip(FITTED, v, scale)}
    return Coefficients(**{**base, **values})


def _stats(errs: list[float]) -> str:
    if not errs:
        return "no rows"
    return f"{100 * statistics.fmean(abs(e) for e in errs):5.2f}% mean, {100 * max(abs(e) for e in errs):5.2f}% worst"


def report(rows: list[Row], half: dict, coefficients: Coefficients, *, show_rows: bool) -> None:
    print(f"{len(rows)} public rows: {DATA.relative_to(ROOT)}")
    print(f"upstream differences modelled: {UPSTREAM}")
    print("coefficients:", {n: coefficients.model_dump()[n] for n in FITTED})
    records = []
    for r in rows:
        est, components = estimated(r, coefficients)
        raw, _ = estimated(r, coefficients, upstream=False)
        records.append((r, est, raw, components))
    if show_rows:
        print(
            f"\n{'model':<14} {'phase':<10} {'half':<8} {'seq':>5} {'g':>3} {'mb':>3} {'r':>3} {'util':>5}"
            f" {'measured':>9} {'estimate':>9} {'error':>7} {'raw err':>7} {'rig err':>7}  components (GiB)"
        )
        for r, est, raw, components in records:
            w = r.workload
            top = ", ".join(
                f"{k}={v / GIB:.2f}" for k, v in sorted(components.items(), key=lambda kv: -kv[1]) if v > 0.005 * GIB
            )
            print(
                f"{r.model.split('/')[-1][:14]:<14} {r.phase:<10} {half[r.config]:<8} {w.sequence_tokens:>5}"
                f" {w.group_size:>3} {w.micro_batch_size_per_gpu:>3} {w.lora_rank:>3}"
                f" {w.vllm_gpu_memory_utilization:>5.2f} {r.measured / GIB:>9.3f} {est / GIB:>9.3f}"
                f" {100 * (est - r.measured) / r.measured:>+6.1f}% {100 * (raw - r.measured) / r.measured:>+6.1f}%"
                f" {100 * (r.rig_estimate - r.measured) / r.measured:>+6.1f}%  {top}"
            )
    print(f"\n{'':<40} {'this estimate':>30} {'without upstream adj.':>30} {'the rig estimator':>30}")
    groups: dict[str, list] = {}
    for rec in records:
        r = rec[0]
        for key in (
            f"{r.phase} / {half[r.config]}",
            f"{r.phase} / {r.model.split('/')[-1]}",
            f"all / {half[r.config]}",
        ):
            groups.setdefault(key, []).append(rec)
    rebased = [(e - r.rebased) / r.rebased for r, e, _, _ in records if r.phase == "training"]
    print(f"(training rows against the rig's re-based figure instead: {_stats(rebased)})")
    for key in sorted(groups):
        recs = groups[key]
        ours = [(e - r.measured) / r.measured for r, e, _, _ in recs]
        raw = [(w - r.measured) / r.measured for r, _, w, _ in recs]
        rig = [(r.rig_estimate - r.measured) / r.measured for r, _, _, _ in recs]
        print(f"{key:<40} {_stats(ours):>30} {_stats(raw):>30} {_stats(rig):>30}   ({len(recs)} rows)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--fit", action="store_true", help="fit the GPU-only coefficients on the fit half and save them"
    )
    parser.add_argument("--rows", action="store_true", help="print every row")
    args = parser.parse_args()
    rows = load_rows()
    half = halves(rows)
    coefficients = (
        Coefficients.from_json(CUDA_COEFFICIENTS.read_text()) if CUDA_COEFFICIENTS.exists() else Coefficients()
    )
    if args.fit:
        # The kernel terms a GPU row cannot see (FSDP's buffers, the experts') come from the CPU
        # probes; only the GPU-only ones are fitted here.
        cpu = Coefficients.from_json((ROOT / "planner" / "coefficients_cpu.json").read_text())
        start = cpu.model_copy(update={n: getattr(coefficients, n) for n in FITTED})
        coefficients = fit([r for r in rows if half[r.config] == "fit"], start)
        CUDA_COEFFICIENTS.write_text(json.dumps(coefficients.model_dump(), indent=1) + "\n")
        print(f"fitted on the fit half -> {CUDA_COEFFICIENTS.relative_to(ROOT)}")
    report(rows, half, coefficients, show_rows=args.rows)


if __name__ == "__main__":
    main()
