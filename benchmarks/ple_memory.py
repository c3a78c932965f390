"""Per-layer-embedding models: the planner's estimate against probes of Gemma-3n-style runs.

    python -m benchmarks.ple_memory [--device cpu] [--rerun]

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

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from planner.probe import ProbeRequest

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
    return peak_request(c, device, MODELS[c["model"]], attn_implementation="sdpa")


def main() -> None:
    peak_benchmark_main(__doc__, "ple", "Per-layer-embedding models", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
