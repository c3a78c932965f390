"""Padded batches: the planner's estimate against probes whose rows differ in length.

    python -m benchmarks.padded_memory [--device cpu] [--rerun]

Real GRPO rollouts have prompts of different lengths (left-padded) and
completions that end early (right-padded). The probe's padded mode draws
prompts of 1/2 to all of the prompt tokens and completions of 1 to all of the
completion tokens per row (the first row whole), so the trainer's forward
holds an attention mask. The trainer builds one additive micro-batch x T x T
mask shared by every layer (agilerl.utils.logprobs.shared_attention_mask);
Hugging Face's own boolean mask would become a float copy per layer under
SDPA. Each padded row has a fixed-length twin, so the table shows what
padding adds, measured and estimated; nothing is fitted.

Measurements are cached in ``benchmarks/results/padded_<device>.json``.
"""

from __future__ import annotations

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from planner.probe import ProbeRequest

MODELS = {
    "q128-L4": "tiny:qwen2?hidden_size=128&intermediate_size=256&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=1024",
}
PHASES = ("reference", "learn", "step")
CONFIGS = [
    dict(model="q128-L4", world=2, gc=gc, micro=4, prompt=256, completion=256, padded=padded)
    for gc in (False, True)
    for padded in (False, True)
]


def request_for(c: dict, device: str) -> ProbeRequest:
    return peak_request(c, device, MODELS[c["model"]], attn_implementation="sdpa")


def main() -> None:
    peak_benchmark_main(__doc__, "padded", "Padded batches", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
