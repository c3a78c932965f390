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


def counted(arch: str, dtype: torch.dtype, targets) -> tuple[float, float, float]:
    """(saved, forward peak, no-grad peak) per token as planner.memory counts the block: its tape
    (planner.memory._tape) and, for eager attention, its scores
    (planner.memory._activations.attention_scores_bytes), over the same BATCH x LENGTH tokens."""
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import Coefficients
    from planner.memory._activations import block_activations, nograd_block_bytes
    from planner.memory._context import build_context
    from planner.memory._units import build_layout
    from planner.models import load_model_spec
    from planner.workload import Workload

    targets = targets if isinstance(targets, str) else tuple(targets)
    spec = load_model_spec(
        f"tiny:{arch}?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2",
        lora_targets=targets,
    )
    workload = Workload(
        prompts_per_step=1,
        group_size=BATCH,
        prompt_tokens=LENGTH // 2,
        completion_tokens=LENGTH // 2,
        micro_batch_size_per_gpu=BATCH,
        lora_rank=RANK,
        lora_dropout=0.0,
        lora_targets=targets,
        gradient_checkpointing=False,
        weights_dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        attn_implementation="eager" if arch == "gemma2" else "sdpa",
        padded_batches=False,
        share_prompt_prefix=False,
    )
    ctx = build_context(spec, workload, Cluster(gpu=CPU_DEVICE, num_gpus=1), None, coefficients=Coefficients())
    layout = build_layout(ctx)
    block = block_activations(ctx, layout, 0)
    tokens = BATCH * LENGTH
    nograd = nograd_block_bytes(ctx, layout, BATCH, LENGTH, 0)
    # in fp32 the input norm saves the block's input itself, which the census's input excludes
    forward = block.forward / tokens - (4 * H if ctx.compute_bytes == 4 else 0)
    return block.saved / tokens, forward, nograd / tokens


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
        counts = counted(arch, dtype, targets)
        cells = []
        for m, c in zip((saved, forward, nograd), counts):
            err = (c - m) / m
            worst = max(worst, abs(err))
            cells.append(f"{m:>6.0f} {100 * err:>+6.1f}%")
        lora = "all" if targets == "all-linear" else "attention"
        print(f"{arch:<8} {str(dtype)[6:]:<9} {lora:<10} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15}")
    print(f"\nmeasured bytes per token and the count's error; worst |error| {100 * worst:.1f}%")


if __name__ == "__main__":
    main()
