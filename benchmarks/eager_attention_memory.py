"""Eager attention at longer sequences: the planner's estimate against probes of the trainer.

    python -m benchmarks.eager_attention_memory [--device cpu] [--rerun]

Eager attention materialises batch x heads x T^2 scores, so past a few hundred tokens its own
moments, not the MLP's, are a block's peak: the softmax's input, the fp32 copy
``softmax(x, dtype=float32)`` makes of a bf16 input, and its output, at once in every forward;
in backward the softmax's saved output beside the gradient of it and of its input, all fp32
(``planner.memory._activations.attention_scores_bytes``). Real probes of the GRPO trainer (bf16
base, fp32 LoRA adapters) on tiny Llama-style (Qwen2), soft-capped (Gemma 2) and sink (gpt-oss)
models with eager attention, at 512 and 1,024 tokens a row, one device and 2 ranks under FSDP2,
activation checkpointing on and off.

Against ``planner.memory.estimate`` with the shipped coefficients; nothing is fitted here.
Measurements are cached in ``benchmarks/results/eager_attention_<device>.json``.
"""

from __future__ import annotations

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from planner.probe import ProbeRequest

_SIZES = "hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096"
MODELS = {
    "qwen2": f"tiny:qwen2?{_SIZES}",
    "gemma2": f"tiny:gemma2?{_SIZES}",
    "gpt_oss": "tiny:gpt_oss?hidden_size=128&intermediate_size=256&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=4096&num_local_experts=8&num_experts_per_tok=2",
}
PHASES = ("reference", "learn", "step")
CONFIGS = [
    dict(model=m, world=world, gc=gc, unsharded=world == 1, micro=2, prompt=prompt, completion=256)
    for m in MODELS
    for prompt in (256, 768)
    for world, gc in ((1, True), (2, True), (2, False))
]


def request_for(c: dict, device: str) -> ProbeRequest:
    return peak_request(c, device, MODELS[c["model"]], attn_implementation="eager")


def main() -> None:
    peak_benchmark_main(__doc__, "eager_attention", "Eager attention", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
