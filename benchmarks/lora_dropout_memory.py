"""LoRA dropout: the planner's estimate against probes of the trainer with LoRA dropout 0.05 and 0.1.

    python -m benchmarks.lora_dropout_memory [--device cpu] [--rerun]

With dropout 0.05 (the trainer's and the manifest's default is 0) 5% of each adapted linear's
input is dropped in the learn forward. PEFT runs ``lora_B(lora_A(dropout(x)))``: lora_A saves
the dropped copy, and dropout saves what its backward reads, per element of the input: on a GPU a one-byte mask
(``native_dropout``), on a CPU the scaled noise tensor ``torch.dropout`` multiplies by, in the
adapters' dtype. Each adapted linear makes its own, so q, k and v no longer share one saved
input when the base and the adapters have one dtype. The no-grad passes run in eval mode,
without it. Every other accuracy benchmark probes without dropout; here each dropout row has
a twin without it where that shows the difference. Nothing is fitted: the term is counted
(planner.memory._tape, tests/planner/memory/test_tape.py).

Rows: one device unsharded (``/u``: fp32 adapters on a bf16 base, or an fp32 base ``/f32``),
and two ranks under FSDP2 (bf16 adapters, its param_dtype). Measurements are cached in
``benchmarks/results/lora_dropout_<device>.json``.
"""

from __future__ import annotations

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from planner.probe import ProbeRequest

MODELS = {
    "q128": "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096",
    "l128": "tiny:llama?hidden_size=128&intermediate_size=384&num_layers=4&num_heads=4&num_kv_heads=4&vocab_size=4096",
}
PHASES = ("reference", "learn", "step")
ONE = dict(world=1, micro=4, prompt=256, completion=256, unsharded=True)
TWO = dict(world=2, micro=2, prompt=128, completion=128)
CONFIGS = [
    dict(model="q128", gc=False, dropout=0.0, **ONE),
    dict(model="q128", gc=False, dropout=0.05, **ONE),
    dict(model="q128", gc=True, dropout=0.05, **ONE),
    dict(model="q128", gc=False, dropout=0.05, dtype="float32", **ONE),
    dict(model="q128", gc=True, dropout=0.05, dtype="float32", **ONE),
    dict(model="q128", gc=False, dropout=0.0, **TWO),
    dict(model="q128", gc=False, dropout=0.05, **TWO),
    dict(model="q128", gc=True, dropout=0.05, **TWO),
    dict(model="l128", gc=False, dropout=0.1, **TWO),
]


def request_for(c: dict, device: str) -> ProbeRequest:
    return peak_request(c, device, MODELS[c["model"]], attn_implementation="sdpa")


def main() -> None:
    peak_benchmark_main(__doc__, "lora_dropout", "LoRA dropout", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
