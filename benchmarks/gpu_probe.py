"""This project's trainer measured on one CUDA GPU, against the estimate.

    python -m benchmarks.gpu_probe [--limit K] [--budget-s 480] [--out-dir DIR] [--dry-run]
    python -m benchmarks.gpu_probe --replay benchmarks/results/gpu_nvidia-h200.json

For Qwen2.5-0.5B/1.5B/3B/7B and OLMoE-1B-7B, built from the catalog's configs with
random weights (nothing is downloaded: a directory with only a config.json is probed
with random weights), it runs the probe (planner.probe: real learn() steps of GRPO +
LoRA in bf16 with fp32 adapters, one rank) over a fixed list of configurations, most
telling first (one per model, then long context, then the variants), and stops starting
new ones once ``--budget-s`` seconds are spent, or when the first two both fail (a broken
machine rather than a configuration: their worker output is printed whole). One QLoRA
configuration (bitsandbytes NF4 on CUDA) runs beside its LoRA twin, where bitsandbytes
imports: what the estimate counts for the 4-bit base (its dequantised copies and
workspaces) has only been measured on CPU. OLMoE runs with LoRA on its attention only,
as the public rows do (benchmarks/gpu_public.py), so its experts run the kernels
transformers picks on a GPU. It first prints what the
machine has (python, torch, CUDA, transformers, peft, the GPU), then per
configuration and phase the measured device peak, ``max_memory_reserved`` plus the
CUDA context (measured once here: device memory in use beyond PyTorch's reservation
after CUDA initialises), beside the estimate with the shipped CUDA coefficients. Then
per model what the caching allocator's segments hold beyond its bf16 weights once they
are placed a tensor at a time, measured in a fresh process beside the probes, against the
count (planner.memory._overheads.weight_segment_bytes). The table is rewritten after every
row to ``<out-dir>/gpu_<kind>.txt`` (default ``benchmarks/results``), so a run stopped
part-way keeps what it measured, and beside it ``gpu_<kind>.json`` holds per phase the
measured allocated and reserved peaks and the estimate's components.

``--dry-run`` prints the configurations and their estimates without a GPU. ``--replay``
judges a run's record (what the GPU measured) again with the estimate as the code counts
it now, so a committed GPU run keeps judging the estimator after it changes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
PHASES = ("rollout", "reference", "learn", "step")

OLMOE_ATTENTION = ("k_proj", "o_proj", "q_proj", "v_proj")


class Config(NamedTuple):
    model: str
    micro: int
    prompt: int
    completion: int
    gc: bool = True
    rank: int = 16
    generate: bool = False
    targets: str | tuple[str, ...] = "all-linear"
    four_bit: bool = False
    dropout: float = 0.0  # LoRA's: above 0 its masks (one byte an element on a GPU) are planned


CONFIGS = (
    Config("Qwen/Qwen2.5-0.5B", 4, 256, 768),
    Config("Qwen/Qwen2.5-1.5B", 4, 512, 1536),
    Config("Qwen/Qwen2.5-3B", 4, 512, 1536),
    Config("Qwen/Qwen2.5-7B", 2, 512, 1536),
    Config("Qwen/Qwen2.5-1.5B", 1, 4096, 12288),
    Config("Qwen/Qwen2.5-0.5B", 1, 8192, 24576),
    Config("Qwen/Qwen2.5-0.5B", 4, 128, 384, gc=False, rank=64),
    Config("Qwen/Qwen2.5-3B", 4, 512, 1536, four_bit=True),
    Config("allenai/OLMoE-1B-7B-0924", 4, 256, 768, targets=OLMOE_ATTENTION),
    Config("Qwen/Qwen2.5-0.5B", 8, 1024, 3072),
    Config("Qwen/Qwen2.5-3B", 2, 256, 256, gc=False, dropout=0.05),
    Config("Qwen/Qwen2.5-0.5B", 8, 128, 128, generate=True),
    Config("Qwen/Qwen2.5-1.5B", 8, 1024, 3072, rank=64),
)


def bitsandbytes_on_cuda() -> str | None:
    """None where bitsandbytes runs NF4 on this CUDA device, else why not (one line)."""
    try:
        import bitsandbytes as bnb
        import torch

        weight = torch.randn(64, 64, dtype=torch.bfloat16, device="cuda")
        packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4")
        bnb.functional.dequantize_4bit(packed, state)
        torch.cuda.synchronize()
    except Exception as err:  # an import error, or a build without this GPU's kernels
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return None


def machine() -> list[str]:
    lines = [f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs"]
    try:
        import torch

        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available={torch.cuda.is_available()}")
    except ImportError as err:
        lines.append(f"torch not importable: {err}")
    versions = []
    for name in ("transformers", "peft", "pydantic", "bitsandbytes"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    lines.append(", ".join(versions))
    return lines


def cuda_context_bytes() -> int:
    """Device memory a fresh CUDA process holds beyond PyTorch's reservation, measured in a
    subprocess (the context, cuBLAS' handles): what NVML sees and torch does not. Run before
    this process or any other touches the device: the device-wide free memory is read."""
    code = (
        "import torch; torch.zeros(1, device='cuda'); torch.ones(256, 256, device='cuda') @ "
        "torch.ones(256, 256, device='cuda'); torch.cuda.synchronize(); free, total = torch.cuda.mem_get_info(); "
        "print(total - free - torch.cuda.memory_reserved())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


_SEGMENTS = """
import sys
import torch
import transformers

config = transformers.AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
placed = [torch.empty_like(p, device="cuda") for p in model.parameters()]  # each tied weight once
torch.cuda.synchronize()
stats = torch.cuda.memory_stats()
print(stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"], stats["requested_bytes.all.current"])
"""


def start_weight_segments(model_dir: str) -> subprocess.Popen:
    """A fresh CUDA process placing the model's bf16 weights on the device a tensor at a time in
    the model's order (from the meta device, as loading them or moving them back from the host
    allocates them); it prints what the caching allocator's segments hold beyond the weights
    (planner.memory._overheads) and the weights. Its own allocator's figures, so it runs beside
    the probes (each process has its own)."""
    return subprocess.Popen(
        [sys.executable, "-c", _SEGMENTS, model_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def weight_segments_measured(proc: subprocess.Popen) -> tuple[int, int, int] | str:
    """(reserved, allocated, requested) bytes from :func:`start_weight_segments`, or why not:
    allocated counts the blocks handed out, requested the tensors' own bytes."""
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "timed out"
    if proc.returncode != 0:
        return f"failed: {(err.strip().splitlines() or ['?'])[-1]}"
    reserved, allocated, requested = (int(v) for v in out.strip().splitlines()[-1].split())
    return reserved, allocated, requested


def request(model_dir: str, c: Config):
    from planner.probe import ProbeRequest
    from planner.workload import Workload

    workload = Workload(
        padded_batches=False,
        prompts_per_step=1,
        group_size=max(2, c.micro),
        prompt_tokens=c.prompt,
        completion_tokens=c.completion,
        micro_batch_size_per_gpu=c.micro,
        logprob_chunk_size=1024,
        gradient_checkpointing=c.gc,
        lora_rank=c.rank,
        lora_alpha=2 * c.rank,
        lora_dropout=c.dropout,
        lora_targets=c.targets,
        load_in_4bit=c.four_bit,
        weights_dtype="bfloat16",
        attn_implementation="sdpa",
        generation="hf" if c.generate else "none",
    )
    return ProbeRequest(
        model=model_dir, workload=workload, nproc=1, device="cuda", generate=c.generate, timed_steps=2, timeout_s=300
    )


def write_config(name: str, target: Path) -> str:
    """The catalog model's config.json alone in ``target``: the probe builds random weights."""
    from transformers import AutoConfig

    from planner import catalog

    if not (target / "config.json").exists():
        config = dict(catalog.entry(name).config)
        AutoConfig.for_model(config.pop("model_type"), **config).save_pretrained(target)
    return str(target)


def config_of(entry: dict) -> Config:
    """A record entry's configuration (JSON keeps the LoRA targets as a list)."""
    return Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry["config"].items()})


def label_of(c: Config) -> str:
    return (
        f"{c.model.split('/')[-1]:<18} {'nf4' if c.four_bit else 'bf16':>4}"
        f" {'all' if c.targets == 'all-linear' else 'attn':>4} {c.micro:>3} {c.prompt + c.completion:>6}"
        f" {'on' if c.gc else 'off':>3} {c.rank:>3} {c.dropout:>4g}"
    )


def estimate_of(c: Config, gpu):
    from planner.calibration import coefficients_for
    from planner.hardware import Cluster
    from planner.memory import estimate
    from planner.models import load_model_spec

    spec = load_model_spec(c.model, lora_targets=c.targets)
    workload = request("-", c).workload
    return estimate(spec, workload, Cluster(gpu=gpu, num_gpus=1), None, coefficients=coefficients_for(gpu))


def tensor_bytes(phase) -> int:
    """A phase estimate's tensors: what the caching allocator hands out (its GPU-only terms aside)."""
    from planner.names import NOT_TENSORS  # outside what the caching allocator hands out

    return sum(v for k, v in phase.components.items() if k not in NOT_TENSORS)


def report(record: dict, *, dry_run: bool = False) -> list[str]:
    """The table of a run's ``record`` (what the GPU measured) judged by the estimate as the
    code counts it now: per configuration and phase the tensors (max_memory_allocated against
    the estimate less its GPU-only terms), per configuration the training window's device peak
    (max_memory_reserved plus the CUDA context against the whole estimate), then per model the
    weights' segments against :func:`planner.memory._overheads.allocator_blocks`."""
    from planner import catalog
    from planner.calibration import coefficients_for
    from planner.hardware import GPU, Cluster
    from planner.memory._context import build_context
    from planner.memory._overheads import allocator_blocks, weight_segment_bytes
    from planner.memory._static import stored_tensor_bytes
    from planner.memory._units import build_layout
    from planner.workload import Workload

    gpu = GPU.model_validate(record["gpu"])
    rows = [
        f"{'model':<18} {'base':>4} {'lora':>4} {'mb':>3} {'tokens':>6} {'gc':>3} {'r':>3} {'drop':>4} {'phase':>9}"
        f" {'allocated':>10} {'estimate':>10} {'error':>8}  (GiB; per phase the tensors: max_memory_allocated"
        " against the estimate less its GPU-only terms; per window the device peak: max_memory_reserved plus"
        " the CUDA context against the whole estimate)"
    ]
    errors = []
    for entry in record["configs"]:
        c = config_of(entry)
        label, est = label_of(c), estimate_of(c, gpu)
        if entry.get("not_run"):
            rows.append(f"{label} {entry['not_run']}")
            continue
        if dry_run:
            rows += [
                f"{label} {ph:>9} {'-':>10} {est.phases[ph].total / GIB:>10.2f}" for ph in PHASES if ph in est.phases
            ]
            continue
        window = (0, 0)  # the public rows' training window: (measured, estimate)
        for ph in PHASES:
            rec = entry["phases"].get(ph)
            if rec is None or ph not in est.phases:
                continue
            tensors = tensor_bytes(est.phases[ph])
            allocated = rec["cuda_max_allocated"]
            error = 100 * (tensors - allocated) / allocated
            rows.append(f"{label} {ph:>9} {allocated / GIB:>10.2f} {tensors / GIB:>10.2f} {error:>+7.1f}%")
            if ph != "rollout":  # a rollout's reserved memory is what the warm-up's learn left cached
                reserved = rec["cuda_max_reserved"] + gpu.cuda_context_bytes
                window = (max(window[0], reserved), max(window[1], est.phases[ph].total))
        if window[0]:
            errors.append((window[1] - window[0]) / window[0])
            rows.append(
                f"{label}   training window: measured {window[0] / GIB:.2f} GiB (reserved + context), estimate"
                f" {window[1] / GIB:.2f} GiB, {100 * errors[-1]:+.1f}%"
            )
    if record.get("stopped"):
        rows.append(record["stopped"])
    rows.append(
        "\nthe weights' segments once the bf16 weights are placed (MiB): reserved beyond the blocks handed"
        " out (memory_reserved - memory_allocated) and beyond the tensors (- requested bytes), counted"
        " (planner.memory._overheads.allocator_blocks; weight_segment_bytes is the second) and measured"
    )
    for name in dict.fromkeys([*(e["config"]["model"] for e in record["configs"]), *record.get("segments", {})]):
        cluster = Cluster(gpu=gpu, num_gpus=1)
        ctx = build_context(catalog.load_spec(name), Workload(), cluster, None, coefficients=coefficients_for(gpu))
        layout = build_layout(ctx)
        reserved, handed = allocator_blocks(stored_tensor_bytes(ctx, layout))
        counted = weight_segment_bytes(ctx, layout)
        line = f"{name.split('/')[-1]:<18} counted {(reserved - handed) / 2**20:>7.1f} / {counted / 2**20:>7.1f}"
        seg = record.get("segments", {}).get(name)
        if isinstance(seg, str):
            line += f", measurement {seg}"
        elif seg is not None:
            r, a, q = seg
            line += f", measured {(r - a) / 2**20:>7.1f} / " + (
                f"{(r - q) / 2**20:>7.1f}" if q is not None else "    n/a"
            )
            line += f" beside {a / GIB:.2f} GiB of weights"
        rows.append(line)
    if errors:
        rows.append(
            f"\ntraining windows: mean |error| {100 * statistics.fmean(abs(e) for e in errors):.2f}%, "
            f"max {100 * max(abs(e) for e in errors):.2f}% over {len(errors)} configurations"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=len(CONFIGS), help="only the first K configurations")
    parser.add_argument("--budget-s", type=float, default=480, help="start no configuration after this many seconds")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where the table goes")
    parser.add_argument("--dry-run", action="store_true", help="print the configurations and estimates only")
    parser.add_argument(
        "--replay",
        type=Path,
        help="judge a run's gpu_<kind>.json again with the estimate as it counts now (no GPU); the table goes to"
        " --out-dir",
    )
    args = parser.parse_args()
    if args.replay:
        record = json.loads(args.replay.read_text())
        text = "\n".join(record["machine"] + [""] + report(record)) + "\n"
        (args.out_dir / args.replay.with_suffix(".txt").name).write_text(text)
        print(text, end="")
        return
    start = time.monotonic()
    from planner import catalog
    from planner.hardware import GPU, GPUS, gpu_for_device

    lines = machine()
    for line in lines:
        print(line, flush=True)
    configs = CONFIGS[: args.limit]
    models = list(dict.fromkeys(c.model for c in configs))
    tmp = Path(tempfile.mkdtemp(prefix="gpu-probe-"))
    segments: dict[str, subprocess.Popen] = {}
    if args.dry_run:
        gpu, kind = GPUS["H200"], "dry-run"
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("error: no CUDA GPU visible (use --dry-run to print the configurations)")
        context = cuda_context_bytes()  # first: it reads the whole device's free memory
        props = torch.cuda.get_device_properties(0)
        known = gpu_for_device(props.name)
        gpu = (known or GPU(name=props.name, memory_bytes=props.total_memory, source="measured here")).model_copy(
            update={"memory_bytes": props.total_memory, "cuda_context_bytes": context}
        )
        kind = "".join(ch if ch.isalnum() else "-" for ch in props.name.lower()).strip("-")
        catalog_name = known.name if known else "not in the catalog"
        lines.append(f"GPU {props.name} ({catalog_name}), {props.total_memory / GIB:.2f} GiB")
        lines.append(f"CUDA context measured: {context / 2**20:.0f} MiB")
        for line in lines[-2:]:
            print(line, flush=True)
        segments = {name: start_weight_segments(write_config(name, tmp / catalog.slug(name))) for name in models}
    record: dict = {"machine": lines, "gpu": gpu.model_dump(), "configs": [], "segments": {}}
    out = args.out_dir / f"gpu_{kind}.txt"

    def save() -> None:
        """The record and its table, rewritten after every configuration: a stopped run keeps both."""
        if args.dry_run:
            return
        args.out_dir.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        out.write_text("\n".join(lines + [""] + report(record)) + "\n")

    no_four_bit = None if args.dry_run else bitsandbytes_on_cuda()
    threads = str(max(1, min(8, (os.cpu_count() or 1) // 2)))  # host threads build the random weights faster
    failures = 0
    for i, c in enumerate(configs):
        if time.monotonic() - start > args.budget_s:
            record["stopped"] = f"stopped: {args.budget_s:.0f} s spent, {len(configs) - i} configuration(s) not run"
            break
        if i == 2 and failures == 2:
            record["stopped"] = "stopped: the first two configurations failed (their worker output is above)"
            break
        entry: dict = {"config": c._asdict(), "phases": {}}
        record["configs"].append(entry)
        if c.four_bit and no_four_bit:
            entry["not_run"] = f"not run: bitsandbytes cannot run NF4 here ({no_four_bit})"
            continue
        if args.dry_run:
            continue
        from planner.probe import run_probe

        t0 = time.monotonic()
        m = run_probe(
            request(write_config(c.model, tmp / catalog.slug(c.model)), c), env={"AGILERL_PROBE_THREADS": threads}
        )
        entry.update(
            seconds=round(time.monotonic() - t0, 1),
            stages={k: round(v, 1) for k, v in m.ranks[0].stages.items()} if m.ranks else {},
        )
        if not m.ok:
            failures += 1
            print(f"--- {label_of(c)}: worker failure ---\n{m.failure}\n---", flush=True)
            entry["not_run"] = f"FAILED: {((m.failure or '').strip().splitlines() or ['?'])[0]}"
        else:
            entry["step_seconds"] = m.step_seconds
            for ph in PHASES:
                rec = max((r.phases.get(ph, {}) for r in m.ranks), key=lambda r: r.get("cuda_max_reserved", 0))
                if "cuda_max_reserved" in rec:
                    entry["phases"][ph] = {k: rec[k] for k in ("cuda_max_allocated", "cuda_max_reserved")}
        spent = ", ".join(f"{k} {v:g}" for k, v in entry["stages"].items())
        print(f"{label_of(c)}: {entry.get('not_run') or 'measured'} ({entry['seconds']} s: {spent})", flush=True)
        save()
    for name in models:
        if name in segments:
            seg = weight_segments_measured(segments[name])
            record["segments"][name] = seg if isinstance(seg, str) else list(seg)
    save()
    shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(report(record, dry_run=args.dry_run)))
    if not args.dry_run:
        print(f"written to {out} ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
