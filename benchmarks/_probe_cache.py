"""Shared by the accuracy benchmarks: run each probe once, cache its per-phase peaks.

The cache maps a probe request (its JSON) to the worst rank's record of every
phase, the per-rank peak and the base weights per rank, so reports re-run in
seconds and ``--rerun`` measures again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from planner.calibration import Sample
from planner.hardware import CPU_DEVICE, Cluster
from planner.memory import Coefficients, Estimate, estimate
from planner.models import load_model_spec
from planner.probe import ProbeRequest, run_probe

ROOT = Path(__file__).resolve().parent.parent


def coefficients_path(device: str) -> Path:
    """Where the planner keeps the fitted coefficients for ``device``."""
    return ROOT / "planner" / f"coefficients_{device}.json"


def saved_coefficients(device: str) -> Coefficients:
    """The planner's fitted coefficients for ``device`` (its defaults before any fit)."""
    path = coefficients_path(device)
    return Coefficients.from_json(path.read_text()) if path.exists() else Coefficients()


def estimate_request(req: ProbeRequest, coefficients: Coefficients) -> Estimate:
    """The planner's estimate of what ``req`` runs (its model, workload, FSDP config and ranks)."""
    spec = load_model_spec(req.model, lora_targets=req.workload.lora_targets)
    return estimate(
        spec, req.workload, Cluster(gpu=CPU_DEVICE, num_gpus=req.nproc), req.fsdp, coefficients=coefficients
    )


def cache_key(req: ProbeRequest) -> str:
    """A probe request as its cache key: the fields that differ from their defaults, so a
    field added later with a default does not orphan the measurements.

    ``workload.padded_batches`` and ``workload.share_prompt_prefix`` are the exceptions: every
    measurement from before the probe had them is of fixed-length rows that share nothing, so a
    key names such a field only when it is True."""
    data = json.loads(req.model_dump_json(exclude_defaults=True))
    workload = data.setdefault("workload", {})
    for field, older in LATER_MODES.items():
        workload.pop(field, None)
        if getattr(req.workload, field) != older:
            workload[field] = getattr(req.workload, field)
    return json.dumps(data, separators=(",", ":"))


#: Workload fields added after measurements were cached, with the value every older measurement
#: ran with (see cache_key): fixed-length rows sharing nothing, and no LoRA dropout (the probe
#: ran without it before the Workload had the field).
LATER_MODES = {"padded_batches": False, "share_prompt_prefix": False, "lora_dropout": 0.0}


def load_cache(cache: Path) -> dict[str, dict]:
    """The cached measurements by :func:`cache_key` (older files keyed by the full request
    are re-keyed; the first measurement of a request wins)."""
    if not cache.exists():
        return {}
    out: dict[str, dict] = {}
    for key, record in json.loads(cache.read_text()).items():
        data = json.loads(key)
        for field, older in LATER_MODES.items():
            data.setdefault("workload", {}).setdefault(field, older)  # see cache_key
        out.setdefault(cache_key(ProbeRequest.model_validate(data)), record)
    return out


def measure_cached(
    configs: Sequence[dict[str, Any]],
    request_for: Callable[[dict[str, Any]], ProbeRequest],
    *,
    cache: Path,
    rerun: bool,
    phases: Sequence[str],
) -> dict[str, dict]:
    """Probe every configuration missing from ``cache``; returns the whole cache."""
    results = load_cache(cache) if not rerun else {}
    for i, c in enumerate(configs):
        req = request_for(c)
        key = cache_key(req)
        if key in results:
            continue
        shown = {k: v for k, v in c.items() if k not in ("id", "half")}
        print(f"probe {i + 1}/{len(configs)}: {json.dumps(shown)}", flush=True)
        m = run_probe(req)
        if not m.ok:
            print(f"  FAILED: {(m.failure or '').strip().splitlines()[-1:]}")
            continue
        results[key] = {
            "phases": {
                ph: max((r.phases.get(ph, {}) for r in m.ranks), key=lambda rec: rec.get("total", 0))
                for ph in phases
                if any(ph in r.phases for r in m.ranks)
            },
            "peak": m.peak_bytes,
            "weights": max(r.param_bytes.get("weights", 0) for r in m.ranks),
        }
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(results, indent=1))
    return results


def calibration_samples(
    configs: Sequence[dict[str, Any]], request_for: Callable[[dict[str, Any]], ProbeRequest], results: dict[str, dict]
) -> list[Sample]:
    """The cached measurements of ``configs`` as planner.calibration samples (CPU clusters)."""
    out = []
    for c in configs:
        req = request_for(c)
        rec = results.get(cache_key(req))
        if rec is None:
            continue
        spec = load_model_spec(req.model, lora_targets=req.workload.lora_targets)
        measured = {ph: r["total"] for ph, r in rec["phases"].items()}
        out.append(Sample(spec, req.workload, Cluster(gpu=CPU_DEVICE, num_gpus=req.nproc), req.fsdp, measured))
    return out


def print_peak_table(
    title: str,
    configs: Sequence[dict[str, Any]],
    request_for: Callable[[dict[str, Any]], ProbeRequest],
    results: dict[str, dict],
    coefficients: Coefficients,
    phases: Sequence[str],
) -> None:
    """Measured vs estimated per-rank peak of each phase, one row per configuration (keys
    ``model``, ``world``, ``gc``, ``micro``, ``prompt``, ``completion``), and the mean and
    worst error over every phase but ``step``."""
    mib = 2**20
    print(f"\n{title}: measured vs estimated per-rank peak, MiB")
    print(
        f"{'model':8} {'gpus':>4} {'ckpt':>4} {'mb':>3} {'seq':>4} {'weights m/e':>13} "
        + " ".join(f"{ph + ' m/e':>17} {'err':>6}" for ph in phases)
    )
    errors = []
    for c in configs:
        req = request_for(c)
        rec = results.get(cache_key(req))
        if rec is None:
            continue
        est = estimate_request(req, coefficients)
        weights_e = est.phases["learn"].components.get("weights", 0)
        # a padded-batch probe, a probe whose groups share their prompt
        name = c["model"] + ("/pad" if c.get("padded") else "") + ("/sh" if c.get("shared") else "")
        # unsharded, an fp32 base, LoRA dropout
        name += ("/u" if c.get("unsharded") else "") + ("/f32" if c.get("dtype") == "float32" else "")
        name += f"/d{c['dropout']:g}" if c.get("dropout") else ""
        row = (
            f"{name:8} {c['world']:>4} {'on' if c['gc'] else 'off':>4} {c['micro']:>3} "
            f"{c['prompt'] + c['completion']:>4} {rec['weights'] / mib:6.2f}/{weights_e / mib:<6.2f}"
        )
        for ph in phases:
            measured, guess = rec["phases"][ph]["total"], est.phases[ph].total
            err = (guess - measured) / measured
            if ph != "step":
                errors.append(abs(err))
            row += f" {measured / mib:8.2f}/{guess / mib:<8.2f} {err:+6.1%}"
        print(row)
    if errors:
        named = " + ".join(ph for ph in phases if ph != "step")
        print(
            f"\n{named}: mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} "
            f"over {len(errors)} phase peaks"
        )


def peak_benchmark_main(
    doc: str,
    name: str,
    title: str,
    configs: Sequence[dict[str, Any]],
    request_for: Callable[[dict[str, Any], str], ProbeRequest],
    phases: Sequence[str],
) -> None:
    """The command line of a per-rank peak benchmark: ``--device``, ``--rerun``; measures (cached
    in ``benchmarks/results/<name>_<device>.json``) and prints :func:`print_peak_table`."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rerun", action="store_true", help="ignore cached measurements")
    args = parser.parse_args()
    cache = ROOT / "benchmarks" / "results" / f"{name}_{args.device}.json"
    results = measure_cached(
        configs, lambda c: request_for(c, args.device), cache=cache, rerun=args.rerun, phases=phases
    )
    print_peak_table(
        f"{title} ({args.device})",
        configs,
        lambda c: request_for(c, args.device),
        results,
        saved_coefficients(args.device),
        phases,
    )


def peak_request(c: dict[str, Any], device: str, model: str, *, attn_implementation: str) -> ProbeRequest:
    """The probe of a per-rank peak benchmark row: GRPO + LoRA r=8 under FSDP2 (bf16 base, fp32
    reduce, everything sharded), 2 prompts x 4 completions, no generation. Optional keys:
    ``padded``, ``shared``, ``dropout`` (LoRA's, default 0), ``dtype`` (the base's, default
    bfloat16), ``unsharded`` (no FSDP2: fp32 adapters beside the base), ``generation``
    ("hf": the rollout phase too, by Hugging Face generate)."""
    from agilerl.distributed import FSDPConfig
    from planner.workload import Workload

    workload = Workload(
        padded_batches=c.get("padded", False),  # True: the probe's padded rows, else rows of one length
        share_prompt_prefix=c.get("shared", False),  # True: a group's rows share their prompt, run once
        prompts_per_step=2,
        group_size=4,
        prompt_tokens=c["prompt"],
        completion_tokens=c["completion"],
        micro_batch_size_per_gpu=c["micro"],
        logprob_chunk_size=256,
        gradient_checkpointing=c["gc"],
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=c.get("dropout", 0.0),
        weights_dtype=c.get("dtype", "bfloat16"),
        attn_implementation=attn_implementation,
        generation=c.get("generation", "none"),
    )
    fsdp = (
        None
        if c.get("unsharded")
        else FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32", param_persistence_threshold=0)
    )
    return ProbeRequest(
        model=model,
        workload=workload,
        fsdp=fsdp,
        nproc=c["world"],
        device=device,
        timed_steps=1,
        timeout_s=600,
        generate=workload.generation != "none",
    )
