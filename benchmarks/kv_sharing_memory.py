"""K/V sharing across layers: the planner's estimate against probes of Gemma-3n and Gemma 4 runs.

    python -m benchmarks.kv_sharing_memory [--device cpu] [--rerun]

Gemma-3n E2B / E4B and Gemma 4's small models end with layers that read the K and V of the last
earlier layer of their attention type (``num_kv_shared_layers``) instead of making their own.
Real probes of the GRPO trainer (bf16 base, fp32 LoRA adapters; Hugging Face generate for the
rollout) on 6-layer tiny models, sliding and full attention interleaved, each with its last 2
layers sharing and without (the control):

- the readers have no K/V projections and no cache entry of their own;
- the two storing layers' K and V live from their forward to the end of the forward, and under
  activation checkpointing to the end of the backward, where the readers' gradients for them
  accumulate (``planner.memory._activations.shared_kv_moments``);
- Gemma 4's generate runs the readers over the last prompt position only (here with its
  double-wide MLPs), and its global layers (a q twice the hidden width) peak in their head norm.

Against ``planner.memory.estimate`` with the shipped coefficients; nothing is fitted here.
Measurements are cached in ``benchmarks/results/kv_sharing_<device>.json``.
"""

from __future__ import annotations

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from planner.probe import ProbeRequest

_SIZES = "hidden_size=128&intermediate_size=256&num_layers=6&num_heads=4&num_kv_heads=2&vocab_size=4096"
MODELS = {
    "gemma3n": f"tiny:gemma3n?{_SIZES}&num_kv_shared_layers=0",
    "gemma3n-shared": f"tiny:gemma3n?{_SIZES}&num_kv_shared_layers=2",
    "gemma4": f"tiny:gemma4?{_SIZES}&num_kv_shared_layers=0&use_double_wide_mlp=true",
    "gemma4-shared": f"tiny:gemma4?{_SIZES}&num_kv_shared_layers=2&use_double_wide_mlp=true",
}
PHASES = ("rollout", "reference", "learn", "step")
_ROW = dict(micro=2, prompt=120, completion=8, generation="hf")
CONFIGS = [
    dict(model=m, world=world, gc=gc, unsharded=world == 1, **_ROW)
    for m in MODELS
    for world, gc in ((1, True), (2, True), (2, False))
]


def request_for(c: dict, device: str) -> ProbeRequest:
    return peak_request(c, device, MODELS[c["model"]], attn_implementation="sdpa")


def main() -> None:
    peak_benchmark_main(__doc__, "kv_sharing", "K/V sharing", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
