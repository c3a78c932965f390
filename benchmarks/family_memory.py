"""Newer families: the planner's estimate against probes of SmolLM3, OLMo 2, Gemma 4 and gpt-oss runs.

    python -m benchmarks.family_memory [--device cpu] [--rerun]

Real probes of the GRPO trainer (bf16 base, fp32 LoRA adapters, FSDP2) on tiny random
models of the four architectures the catalog added without a tiny model before:

- SmolLM3: rotary embeddings skipped on every second layer here (every fourth in
  SmolLM3-3B), which changes no tensor the estimate counts;
- OLMo 2: q/k RMSNorms over the whole projection width and norms after attention and
  MLP instead of before;
- Gemma 4: per-layer embeddings (their own FSDP unit) and a global layer twice as
  wide as the sliding ones;
- gpt-oss: attention sinks, biased and transposed packed experts run by Hugging Face's
  own expert loop (the row-wise experts do not take that layout), alternating sliding
  and full attention layers.

A tiny Qwen2 of the same sizes is the control. Against ``planner.memory.estimate`` with the
shipped coefficients; nothing is fitted here. Measurements are cached in ``benchmarks/results/families_<device>.json``.
"""

from __future__ import annotations

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from planner.probe import ProbeRequest

MODELS = {
    # the control: an architecture the accuracy benchmark already covers, at the same sizes
    "qwen2": "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096",
    "smollm3": "tiny:smollm3?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=4096",
    "olmo2": "tiny:olmo2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=4&vocab_size=4096",
    "gemma4": "tiny:gemma4?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=4096",
    "gpt_oss": "tiny:gpt_oss?hidden_size=128&intermediate_size=256&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=4096&num_local_experts=8&num_experts_per_tok=2",
}
PHASES = ("reference", "learn", "step")
CONFIGS = [
    dict(model="qwen2", world=2, gc=True, micro=2, prompt=64, completion=64),
    dict(model="qwen2", world=2, gc=False, micro=2, prompt=64, completion=64),
    dict(model="smollm3", world=2, gc=True, micro=2, prompt=64, completion=64),
    dict(model="smollm3", world=2, gc=False, micro=2, prompt=64, completion=64),
    dict(model="olmo2", world=2, gc=True, micro=2, prompt=64, completion=64),
    dict(model="olmo2", world=2, gc=False, micro=4, prompt=96, completion=32),
    dict(model="gemma4", world=2, gc=True, micro=2, prompt=64, completion=64),
    dict(model="gemma4", world=2, gc=False, micro=2, prompt=64, completion=64),
    dict(model="gpt_oss", world=2, gc=True, micro=2, prompt=64, completion=64),
    dict(model="gpt_oss", world=2, gc=False, micro=2, prompt=64, completion=64),
]


def request_for(c: dict, device: str) -> ProbeRequest:
    return peak_request(c, device, MODELS[c["model"]], attn_implementation="eager")


def main() -> None:
    peak_benchmark_main(__doc__, "families", "Newer families", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
