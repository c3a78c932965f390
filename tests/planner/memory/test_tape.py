"""planner.memory._tape against a real block: PEFT's LoRA on Hugging Face's Qwen2 and Llama
layers, in bf16 with fp32 adapters and in fp32, counted with saved-tensor hooks (what
autograd keeps) and a live-tensor tracker (the most alive at once)."""

from __future__ import annotations

import pytest
import torch

from planner.memory._tape import block_tape
from planner.models import load_model_spec
from planner.probe.tracking import LiveBytes

H, WIDTH, RANK, TOKENS = 64, 160, 4, 2 * 96


def _peft_block(arch: str, dtype: torch.dtype, targets, attn: str = "sdpa", dropout: float = 0.0):
    import transformers
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_config

    config = tiny_config(arch, hidden_size=H, intermediate_size=WIDTH, num_layers=1, num_heads=4, num_kv_heads=2)
    config._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=8, target_modules=targets, lora_dropout=dropout))
    return model.get_base_model().model, config


def _measure(arch, dtype, targets, attn: str = "sdpa"):
    """(saved bytes, forward-with-grad peak, no-grad peak) of one block, per token, beyond its input."""
    decoder, _ = _peft_block(arch, dtype, targets, attn)
    return _measure_layer(decoder, dtype)


def _measure_layer(decoder, dtype):
    """:func:`_measure` of the first block of a decoder: with grad in train mode (dropout on, as
    the learn forward runs it), without grad in eval mode (as the no-grad passes run)."""
    layer, rotary = decoder.layers[0], decoder.rotary_emb
    x = torch.randn(2, TOKENS // 2, H, dtype=dtype, requires_grad=True)
    positions = torch.arange(TOKENS // 2).unsqueeze(0).expand(2, -1)
    cos_sin = rotary(x, positions)
    # The block's input counts when a block saves it (an fp32 norm saves its input itself).
    params = {p.untyped_storage().data_ptr() for p in decoder.parameters()}
    params |= {t.untyped_storage().data_ptr() for t in cos_sin}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    live = LiveBytes(params)
    layer.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
        out = layer(x, position_embeddings=cos_sin, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
    grad_peak = live.peak
    del out
    layer.eval()
    with torch.no_grad():
        nograd = LiveBytes(params)
        with nograd:
            layer(x, position_embeddings=cos_sin, attention_mask=None)
    return sum(saved.values()) / TOKENS, grad_peak / TOKENS, nograd.peak / TOKENS


def _tape(arch: str, dtype: torch.dtype, targets, **options):
    """The tape of the first block of the tiny model _peft_block builds, and the compute dtype's bytes."""
    from planner.spec import ModelSpec

    spec = load_model_spec(
        f"tiny:{arch}?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2",
        lora_targets=targets,
    )
    block = spec.block(0)
    adapted = frozenset(e[0] for e in block.lora[ModelSpec.target_key(targets)])
    p = 2 if dtype == torch.bfloat16 else 4
    return block_tape(block, hidden=H, adapted=adapted, rank=RANK, compute_bytes=p, **options), p


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "k_proj", "v_proj", "o_proj")])
def test_the_tape_counts_what_a_real_block_keeps(arch, dtype, targets):
    tape, p = _tape(arch, dtype, targets)
    saved, grad_peak, nograd_peak = _measure(arch, dtype, targets if isinstance(targets, str) else list(targets))
    assert tape.saved == pytest.approx(saved, rel=0.01)
    # The moments: the forward's peak includes what it saves so far (in fp32 the input norm
    # saves the block's input itself, which the tracker, started after it, does not see).
    assert tape.grad_peak - (4 * H if p == 4 else 0) == pytest.approx(grad_peak, rel=0.03)
    assert tape.nograd_peak == pytest.approx(nograd_peak, rel=0.03)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "k_proj", "v_proj", "o_proj")])
def test_lora_dropout_keeps_a_dropped_copy_and_its_noise_per_adapted_linear(dtype, targets):
    """LoRA dropout (0.05): on CPU torch.dropout multiplies by a noise tensor it saves, in the
    adapters' fp32, beside the dropped copy lora_A saves; each adapted linear makes its own (q, k
    and v no longer share one saved input in fp32). The no-grad passes run in eval mode, without it."""
    tape, p = _tape("qwen2", dtype, targets, dropout_bytes=4)
    without, _ = _tape("qwen2", dtype, targets)
    decoder, _ = _peft_block("qwen2", dtype, targets if isinstance(targets, str) else list(targets), dropout=0.05)
    saved, grad_peak, nograd_peak = _measure_layer(decoder, dtype)
    assert saved > without.saved * 1.2  # what the tape without dropout would miss
    assert tape.saved == pytest.approx(saved, rel=0.01)
    assert tape.grad_peak - (4 * H if p == 4 else 0) == pytest.approx(grad_peak, rel=0.03)
    assert tape.nograd_peak == without.nograd_peak == pytest.approx(nograd_peak, rel=0.03)


def test_on_a_gpu_dropout_keeps_one_byte_an_element():
    """CUDA runs dropout as native_dropout (the fused kernel torch.dropout takes on a GPU), whose
    backward reads only its boolean mask: planner.memory._activations.lora_dropout_bytes' 1 on a
    GPU. The op runs on CPU too, so what it saves is read here."""
    x = torch.randn(100, H, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.native_dropout(x, 0.05, True)
    assert [(t.dtype, t.untyped_storage().nbytes()) for t in saved] == [(torch.bool, x.numel())]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adapter_dtype", ["fp32", "compute"])
def test_eager_attention_saves_q_and_k_and_v_repeated_and_a_copy_of_its_output(dtype, adapter_dtype):
    # Hugging Face's eager attention repeats grouped K and V to every query head before its two
    # matmuls, which save them (and q), and transposes its output into a new tensor, which o's
    # lora_A then saves when PEFT does not cast it; its scores are counted apart (the fp32
    # softmax and its cast, planner.memory._activations.attention_scores_bytes).
    spec = load_model_spec(
        f"tiny:qwen2?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2"
    )
    block = spec.block(0)
    adapted = frozenset(e[0] for e in block.lora["all-linear"])
    p = 2 if dtype == torch.bfloat16 else 4
    a = 4 if adapter_dtype == "fp32" else p
    tape = block_tape(block, hidden=H, adapted=adapted, rank=RANK, compute_bytes=p, adapter_bytes=a, eager=True)
    decoder, _ = _peft_block("qwen2", dtype, "all-linear", "eager")
    if adapter_dtype == "compute":  # as FSDP2's param_dtype leaves them
        for name, param in decoder.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(dtype)
    saved, _, _ = _measure_layer(decoder, dtype)
    length = TOKENS // 2
    scores = block.attention.num_heads * length * (4 + (p if p != 4 else 0))  # per token
    assert tape.saved + scores == pytest.approx(saved, rel=0.01)


def test_adapters_on_a_bf16_base_cost_an_fp32_input_copy_each():
    spec = load_model_spec(
        f"tiny:qwen2?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2"
    )
    block = spec.block(0)
    adapted = frozenset(e[0] for e in block.lora["all-linear"])
    bf16 = block_tape(block, hidden=H, adapted=adapted, rank=RANK, compute_bytes=2)
    frozen = block_tape(block, hidden=H, adapted=frozenset(), rank=RANK, compute_bytes=2)
    q = block.attention.q_dim
    # q, k, v, gate and up each cast the hidden input, o the attention output, down the product
    # (4 bytes per element), and each lora_A output (rank, fp32) is saved for lora_B
    assert bf16.saved - frozen.saved == 4 * (5 * H + q + WIDTH) + 7 * 4 * RANK


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "k_proj", "v_proj", "o_proj")])
def test_under_autocast_the_adapters_save_bf16_copies_of_their_inputs(targets):
    # A trainer running its forward under torch.autocast (upstream AgileRL's GRPO on one GPU):
    # lora_A casts PEFT's fp32 input copy back to bf16 and saves that, and its output is bf16.
    spec = load_model_spec(
        f"tiny:qwen2?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2",
        lora_targets=targets,
    )
    from planner.spec import ModelSpec

    block = spec.block(0)
    adapted = frozenset(e[0] for e in block.lora[ModelSpec.target_key(targets)])
    tape = block_tape(block, hidden=H, adapted=adapted, rank=RANK, compute_bytes=2, autocast=True)
    plain = block_tape(block, hidden=H, adapted=adapted, rank=RANK, compute_bytes=2)
    decoder, _ = _peft_block("qwen2", torch.bfloat16, targets if isinstance(targets, str) else list(targets))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, grad_peak, nograd_peak = _measure_layer(decoder, torch.bfloat16)
    # autocast also saves bf16 copies of the adapter weights: per layer, not per token (off the tape)
    weights = sum(p.numel() for name, p in decoder.named_parameters() if "lora_" in name) * 2 / TOKENS
    assert tape.saved + weights == pytest.approx(saved, rel=0.01)
    assert tape.grad_peak + weights == pytest.approx(grad_peak, rel=0.03)
    assert tape.nograd_peak == pytest.approx(nograd_peak, rel=0.06)
    assert plain.saved > 1.2 * tape.saved  # the fp32 copies the count without autocast keeps


def _full_block(arch: str, dtype: torch.dtype):
    """A real block with every weight trained (full fine-tuning: no PEFT)."""
    import transformers

    from agilerl.utils.tiny import tiny_config

    config = tiny_config(arch, hidden_size=H, intermediate_size=WIDTH, num_layers=1, num_heads=4, num_kv_heads=2)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    return model.model, config


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen3: the trained q and k head norms
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_full_finetuning_tape_counts_what_a_real_block_keeps(arch, dtype):
    # Every linear saves its input for its weight's gradient, every norm weight its other factor;
    # nothing is cast and no adapter runs.
    decoder, _ = _full_block(arch, dtype)
    assert all(p.requires_grad for p in decoder.layers[0].parameters())
    saved, grad_peak, _ = _measure_layer(decoder, dtype)
    spec = load_model_spec(
        f"tiny:{arch}?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2"
    )
    p = 2 if dtype == torch.bfloat16 else 4
    tape = block_tape(spec.block(0), hidden=H, adapted=frozenset(), rank=RANK, compute_bytes=p, full=True)
    assert tape.saved == pytest.approx(saved, rel=0.01)
    assert tape.grad_peak - (4 * H if p == 4 else 0) == pytest.approx(grad_peak, rel=0.03)
    # Control: the same block counted as LoRA-frozen keeps less (no linear saves its input).
    frozen = block_tape(spec.block(0), hidden=H, adapted=frozenset(), rank=RANK, compute_bytes=p)
    assert frozen.saved < tape.saved


def test_a_full_fine_tunes_backward_makes_the_mlp_output_weights_gradient():
    # down_proj's weight gradient, as a real block's backward leaves it on the weight: made by the
    # product's moment (within the backward's peak), and none when the linears are frozen (LoRA)
    decoder, _ = _full_block("qwen2", torch.bfloat16)
    layer = decoder.layers[0]
    x = torch.randn(1, 8, H, dtype=torch.bfloat16, requires_grad=True)
    cos_sin = decoder.rotary_emb(x, torch.arange(8).unsqueeze(0))
    layer(x, position_embeddings=cos_sin, attention_mask=None)[0].sum().backward()
    grad = layer.mlp.down_proj.weight.grad
    spec = load_model_spec(
        f"tiny:qwen2?hidden_size={H}&intermediate_size={WIDTH}&num_layers=1&num_heads=4&num_kv_heads=2"
    )
    tape = block_tape(spec.block(0), hidden=H, adapted=frozenset(), rank=RANK, compute_bytes=2, full=True)
    assert tape.backward_weight_grad == grad.numel() * grad.element_size()
    assert tape.backward_product <= tape.backward_peak
    frozen = block_tape(spec.block(0), hidden=H, adapted=frozenset(), rank=RANK, compute_bytes=2)
    assert frozen.backward_weight_grad == 0
