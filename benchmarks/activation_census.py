"""What one block keeps, counted on the real code, against planner.memory._tape.

    python -m benchmarks.activation_census

Builds one decoder layer of each architecture with PEFT's LoRA (tiny random weights),
runs it forward with grad and without, and measures with saved-tensor hooks what
autograd keeps for backward and with a live-tensor tracker (a TorchDispatchMode that
follows every storage with a finalizer) the most alive at once. Prints per token: the
saved bytes, the forward's peak, the no-grad forward's peak, measured and counted.
"""

from __future__ import annotations

import itertools

import torch

from planner.probe.tracking import LiveBytes

H, WIDTH, RANK, BATCH, LENGTH = 128, 384, 8, 2, 128
ARCHS = ("qwen2", "llama", "mistral", "qwen3", "gemma2", "gemma3")


def _layer(arch: str, dtype: torch.dtype, targets):
    import transformers
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_config

    config = tiny_config(arch, hidden_size=H, intermediate_size=WIDTH, num_layers=1, num_heads=4, num_kv_heads=2)
    config._attn_implementation = "eager" if arch == "gemma2" else "sdpa"  # Gemma 2 soft-caps its scores
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets, lora_dropout=0.0))
    decoder = model.get_base_model().model
    return decoder, decoder.layers[0]


def measure(arch: str, dtype: torch.dtype, targets) -> tuple[float, float, float]:
    """(saved, forward peak, no-grad peak) per token, beyond the block's input."""
    decoder, layer = _layer(arch, dtype, targets)
    x = torch.randn(BATCH, LENGTH, H, dtype=dtype, requires_grad=True)
    positions = torch.arange(LENGTH).unsqueeze(0).expand(BATCH, -1)
    try:
        rope = decoder.rotary_emb(x, positions)
    except TypeError:  # Gemma 3: one table per layer type
        rope = decoder.rotary_emb(x, positions, layer_type=decoder.config.layer_types[0])
    kwargs = {"position_embeddings": rope, "attention_mask": None}
    skip = {p.untyped_storage().data_ptr() for p in decoder.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (rope or ())}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip:
            saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    live = LiveBytes(skip)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
        layer(x, **kwargs)
    with torch.no_grad():
        nograd = LiveBytes(skip)
        with nograd:
            layer(x, **kwargs)
    tokens = BATCH * LENGTH
    return sum(saved.values()) / tokens, live.peak / tokens, nograd.peak / tokens


def counted(arch: str, dtype: torch.dtype, targets):
    from planner.memory._tape import block_tape
    from planner.models import load_model_spec
    from planner.spec import ModelSpec

    spec = load_model_spec(
        f"tiny:{arch}?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2",
        lora_targets=targets,
    )
    block = spec.block(0)
    adapted = frozenset(e[0] for e in block.lora[ModelSpec._target_key(targets)])
    p = 2 if dtype == torch.bfloat16 else 4
    return block_tape(block, hidden=H, adapted=adapted, rank=RANK, compute_bytes=p), p


def counted_q_dim(arch: str) -> int:
    from planner.models import load_model_spec

    spec = load_model_spec(
        f"tiny:{arch}?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2"
    )
    return spec.block(0).attention.q_dim


def main() -> None:
    torch.manual_seed(0)
    print(f"one block, {BATCH} x {LENGTH} tokens, hidden {H}, MLP {WIDTH}, LoRA r={RANK}; bytes per token")
    print(f"{'arch':<8} {'dtype':<9} {'LoRA':<10} {'saved':>15} {'forward peak':>15} {'no-grad peak':>15}")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    worst = 0.0
    for arch, dtype, targets in itertools.product(ARCHS, (torch.bfloat16, torch.float32), ("all-linear", attention)):
        try:
            saved, forward, nograd = measure(arch, dtype, targets if isinstance(targets, str) else list(targets))
        except Exception as err:  # an architecture this transformers does not build
            print(f"{arch:<8} skipped: {type(err).__name__}: {err}"[:120])
            continue
        tape, p = counted(arch, dtype, targets)
        fwd = tape.grad_peak - (4 * H if p == 4 else 0)  # in fp32 the input norm saves the input itself
        # eager attention's scores (planner.memory._activations.attention_scores_bytes), per token
        scores = 4 * LENGTH if arch == "gemma2" else 0  # heads x T
        cast = p if p != 4 else 0
        q_dim = counted_q_dim(arch)
        saved_s, nograd_s = scores * (p + 4 + cast), scores * (p + 4 + cast) + (2 * q_dim * p if scores else 0)
        cells = []
        for m, c in (
            (saved, tape.saved + saved_s),
            (forward, fwd + saved_s),
            (nograd, max(tape.nograd_peak, tape.attention_live + nograd_s)),
        ):
            err = (c - m) / m
            worst = max(worst, abs(err))
            cells.append(f"{m:>6.0f} {100 * err:>+6.1f}%")
        lora = "all" if targets == "all-linear" else "attention"
        print(f"{arch:<8} {str(dtype)[6:]:<9} {lora:<10} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15}")
    print(f"\nmeasured bytes per token and the count's error; worst |error| {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
