"""The trainer's device peaks on a GPU, replayed on CPU through the CUDA caching allocator.

    python -m benchmarks.allocator_replay [--record benchmarks/results/gpu_nvidia-h200.json] [--limit K] [--segments]
    python -m benchmarks.allocator_replay --config Qwen/Qwen2.5-0.5B:1:2048:6144 [--gpu H200]

For each configuration a GPU run recorded (benchmarks/gpu_probe.py), it builds the same
trainer on CPU (bf16 base, fp32 adapters, random weights from the catalog's config), records
every storage its first two learn steps make and free (planner.probe.allocator.TraceRecorder,
each phase marked), and replays them through the caching allocator's rules
(planner.memory.CachingAllocator) after the weights and adapters placed a tensor at
a time, with cuBLAS' two workspaces (planner.memory._overheads.cublas_workspace_bytes)
taken where a GPU takes them: each thread's at its first matmul, the forward's in step 1's
first pass, autograd's in its first backward. It
prints per phase of the second step the replayed reserved and allocated peaks beside the
GPU's ``max_memory_reserved`` and ``max_memory_allocated``: whether the trace of what the
code keeps, under the allocator's rules, explains what the GPU reserved beyond its tensors.
What kernels allocate inside themselves (none of it through PyTorch's dispatcher) is not in
the trace, on either device. ``--segments`` also prints, per phase, where the reserved bytes
beyond the allocated ones sit at the allocated peak: the free bytes of the segments each phase
of the first step made (planner.probe.allocator.free_by_origin), what the estimate's slack
terms are judged against.

``--config MODEL:MICRO:PROMPT:COMPLETION`` replays a configuration no GPU has measured and
prints the replay beside the estimate instead (allocated against the estimate's tensors,
reserved plus the CUDA context against the whole estimate, on ``--gpu``): a CPU check of what
the estimate counts beyond the tensors where no GPU run reaches, long context first. A
kernel's own workspaces differ between the CPU's and the GPU's kernels (attention's above all),
so it bounds the allocator's share, not the whole GPU peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
MIB = 2**20


def trace_config(entry: dict, gpu) -> list[tuple[str, object, int]]:
    """The trainer's weights placed, then its first two learn steps, as allocation events."""
    import torch

    from benchmarks.gpu_probe import config_of, request, write_config
    from planner import catalog
    from planner.memory._overheads import CUBLASLT_WORKSPACE
    from planner.probe._worker import _algorithm_and_arguments, _synthetic_batches
    from planner.probe.allocator import TraceRecorder

    c = config_of(entry)
    with tempfile.TemporaryDirectory() as tmp:
        req = request(write_config(c.model, Path(tmp) / catalog.slug(c.model)), c).model_copy(update={"device": "cpu"})
        body = json.loads(req.model_dump_json())
        algorithm, kwargs = _algorithm_and_arguments(body, req.workload, None)
        agent = algorithm(req.model, **kwargs)
    gen = torch.Generator().manual_seed(1234)
    experiences = _synthetic_batches(agent, req.workload, gen)
    tensors = [*agent.model.parameters(), *agent.model.buffers()]
    events: list[tuple[str, object, int]] = [
        ("alloc", ("w", i), t.untyped_storage().nbytes()) for i, t in enumerate(tensors)
    ]
    recorder = TraceRecorder(  # the forward's and autograd's cuBLAS handles' workspaces, at their first matmul
        exclude={t.untyped_storage().data_ptr() for t in tensors},
        workspaces=(gpu.cublas_workspace_bytes, CUBLASLT_WORKSPACE),
    )

    step = [0]

    @contextlib.contextmanager
    def observe(name: str):
        recorder.mark(f"{step[0]}:{name}")
        yield
        recorder.mark(f"{step[0]}:after-{name}")

    agent.phase_observer = observe
    with recorder:
        for step[0] in (1, 2):
            agent.learn(experiences())
    return events + recorder.events


def print_segments(label: str, events: list[tuple[str, object, int]]) -> None:
    """Per phase of the second step: where reserved-beyond-allocated sits at the allocated peak,
    by the phase of the first step (or the weights' placing, "start") that made each segment."""
    from planner.probe.allocator import free_by_origin

    spans = free_by_origin(events)
    for name, span in spans.items():
        if not name.startswith("2:") or "after" in name:
            continue
        free = sorted(((n, origin) for origin, n in span["free"].items() if n >= MIB), reverse=True)
        print(
            f"{label:<52} {name[2:]:>9} allocated {span['allocated'] / GIB:.3f}, reserved then"
            f" {span['reserved_then'] / GIB:.3f}, at the end {span['reserved'] / GIB:.3f} GiB; free (MiB):"
            + "".join(f" {origin} {n / MIB:.1f}," for n, origin in free).rstrip(","),
            flush=True,
        )
    last = list(spans.values())[-1]
    made = sorted(((n, origin) for origin, n in last["made"].items()), reverse=True)
    print(
        f"{label:<52} {'segments':>9} made by the end (MiB):"
        + "".join(f" {origin} {n / MIB:.0f}," for n, origin in made).rstrip(","),
        flush=True,
    )


def replay_against_estimate(specs: list[str], gpu, segments: bool = False) -> None:
    """Replay each ``MODEL:MICRO:PROMPT:COMPLETION`` and print it beside the estimate."""
    from benchmarks.gpu_probe import PHASES, Config, estimate_of, label_of, tensor_bytes
    from planner.probe.allocator import replay

    print(
        f"GPU {gpu.name} (cuBLAS workspace {gpu.cublas_workspace_bytes / MIB:.0f} MiB, context"
        f" {gpu.cuda_context_bytes / MIB:.0f} MiB); traces recorded on CPU"
    )
    print(
        f"{'configuration':<52} {'phase':>9} {'replayed allocated':>19} {'tensors':>8} {'error':>7}  (GiB; per"
        " window the replayed reserved peak plus the CUDA context against the whole estimate)"
    )
    for spec in specs:
        model, micro, prompt, completion = spec.rsplit(":", 3)
        c = Config(model, int(micro), int(prompt), int(completion))
        start = time.monotonic()
        events = trace_config({"config": c._asdict()}, gpu)
        spans = replay(events)
        est = estimate_of(c, gpu)
        window = (0, 0)
        for ph in PHASES:
            got = spans.get(f"2:{ph}")
            if got is None or ph not in est.phases:
                continue
            tensors = tensor_bytes(est.phases[ph])
            print(
                f"{label_of(c):<52} {ph:>9} {got['allocated'] / GIB:>19.3f} {tensors / GIB:>8.3f}"
                f" {100 * (tensors - got['allocated']) / got['allocated']:>+6.1f}%",
                flush=True,
            )
            window = (max(window[0], got["reserved"] + gpu.cuda_context_bytes), max(window[1], est.phases[ph].total))
        print(
            f"{label_of(c):<52}   training window: replayed {window[0] / GIB:.3f} GiB (reserved + context),"
            f" estimate {window[1] / GIB:.3f} GiB, {100 * (window[1] - window[0]) / window[0]:+.1f}%"
            f" ({time.monotonic() - start:.0f} s)",
            flush=True,
        )
        if segments:
            print_segments(label_of(c), events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_nvidia-h200.json")
    parser.add_argument("--limit", type=int, default=None, help="only the first K configurations")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="MODEL:MICRO:PROMPT:COMPLETION",
        help="replay this configuration (no GPU measurement) against the estimate instead; repeatable",
    )
    parser.add_argument(
        "--segments",
        action="store_true",
        help="also print where each phase's reserved-beyond-allocated sits, by the phase that made each segment",
    )
    parser.add_argument(
        "--gpu", default="H200", help="the catalog GPU whose cuBLAS workspace and context --config uses"
    )
    args = parser.parse_args()
    from benchmarks.gpu_probe import config_of, label_of
    from planner.hardware import GPU, GPUS
    from planner.probe.allocator import replay

    if args.config:
        replay_against_estimate(args.config, GPUS[args.gpu], args.segments)
        return
    record = json.loads(args.record.read_text())
    gpu = GPU.model_validate(record["gpu"])
    print(f"record: {args.record.relative_to(ROOT) if args.record.is_relative_to(ROOT) else args.record}")
    print(
        f"{'configuration':<52} {'phase':>9} {'GPU reserved':>13} {'replayed':>9} {'GPU allocated':>14} {'replayed':>9}"
        "  (GiB)"
    )
    for entry in record["configs"][: args.limit]:
        if not entry.get("phases"):
            continue
        c = config_of(entry)
        start = time.monotonic()
        events = trace_config(entry, gpu)
        spans = replay(events)
        for ph, measured in entry["phases"].items():
            got = spans.get(f"2:{ph}")
            if got is None:
                continue
            print(
                f"{label_of(c):<52} {ph:>9} {measured['cuda_max_reserved'] / GIB:>13.3f} {got['reserved'] / GIB:>9.3f}"
                f" {measured['cuda_max_allocated'] / GIB:>14.3f} {got['allocated'] / GIB:>9.3f}",
                flush=True,
            )
        if args.segments:
            print_segments(label_of(c), events)
        print(f"  ({time.monotonic() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
