"""Per-layer-embedding models: the planner's estimate against probes of Gemma-3n-style runs.

    python benchmarks/ple_memory.py [--device cpu] [--rerun]

Real probes of the GRPO trainer on tiny random Gemma-3n text models (per-layer
embedding tables sharded as their own FSDP unit, AltUp's four hidden streams,
Laurel, LoRA on every linear including the AltUp and PLE projections outside
the blocks), against ``planner.memory.estimate`` with the shipped coefficients.
The AltUp activation terms were counted from the tensors Gemma-3n's forward
saves (a saved-tensors hook on the 128-wide model), not fitted to these
probes; no coefficient is fitted here.

Measurements are cached in ``benchmarks/results/ple_<device>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _probe_cache import measure_cached, print_peak_table, saved_coefficients  # noqa: E402

from agilerl.distributed import FSDPConfig  # noqa: E402
from planner.probe import ProbeRequest  # noqa: E402
from planner.workload import Workload  # noqa: E402

MODELS = {
    "h128-L4": "tiny:gemma3n?hidden_size=128&intermediate_size=256&num_layers=4&num_heads=4&num_kv_heads=2"
               "&vocab_size=2048",
    "h96-L6": "tiny:gemma3n?hidden_size=96&intermediate_size=384&num_layers=6&num_heads=4&num_kv_heads=2"
              "&vocab_size=1024",
}
PHASES = ("reference", "learn", "step")
CONFIGS = [
    dict(model="h128-L4", world=2, gc=True, micro=2, prompt=64, completion=64),
    dict(model="h96-L6", world=2, gc=True, micro=4, prompt=96, completion=32),
    dict(model="h128-L4", world=2, gc=False, micro=2, prompt=48, completion=48),
    dict(model="h96-L6", world=4, gc=True, micro=2, prompt=64, completion=64),
]


def request_for(c: dict, device: str) -> ProbeRequest:
    workload = Workload(
        prompts_per_step=2, group_size=4, prompt_tokens=c["prompt"], completion_tokens=c["completion"],
        micro_batch_size_per_gpu=c["micro"], logprob_chunk_size=256, gradient_checkpointing=c["gc"],
        lora_rank=8, lora_alpha=16, weights_dtype="bfloat16", attn_implementation="sdpa", generation="none",
    )
    fsdp = FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32", param_persistence_threshold=0)
    return ProbeRequest(model=MODELS[c["model"]], workload=workload, fsdp=fsdp, nproc=c["world"], device=device,
                        timed_steps=1, timeout_s=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rerun", action="store_true", help="ignore cached measurements")
    args = parser.parse_args()
    cache = ROOT / "benchmarks" / "results" / f"ple_{args.device}.json"
    results = measure_cached(CONFIGS, lambda c: request_for(c, args.device), cache=cache, rerun=args.rerun,
                             phases=PHASES)
    print_peak_table(f"Per-layer-embedding models ({args.device})", CONFIGS, lambda c: request_for(c, args.device), results,
                     saved_coefficients(args.device), PHASES)

if __name__ == "__main__":
    main()
