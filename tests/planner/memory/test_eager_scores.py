"""Eager attention's own moments, counted by planner.memory against real tiny layers at 512 tokens
a row, where its batch x heads x T^2 scores, not the MLP, are the layer's peak: a Llama-style
layer (Qwen2), a soft-capped one (Gemma 2) and one with attention sinks (gpt-oss), with PEFT's
LoRA on every linear, the adapters in bf16 (FSDP2's param_dtype) and in fp32 (PEFT's own).

Until these moments were counted the layers read 12% to 36% low in their forward, 23% to 39% in
their backward and 19% without grad at this length (the scores were counted as what they save,
and without grad without the fp32 copy the softmax makes of a bf16 input)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.memory._activations import _softmax_converts, block_activations, nograd_block_bytes
from planner.memory._units import build_layout

from ._real_layers import BATCH, _context, _layer_moments, _nograd_moment

LENGTH = 512
_SIZES = "hidden_size=64&intermediate_size=256&num_layers=2&num_heads=4&num_kv_heads=2&vocab_size=512"
LAYERS = {
    "qwen2": f"tiny:qwen2?{_SIZES}",
    "gemma2": f"tiny:gemma2?{_SIZES}",  # its scores soft-capped (a tanh saved)
    "gpt_oss": "tiny:gpt_oss?hidden_size=64&intermediate_size=64&num_layers=2&num_heads=4&num_kv_heads=2"
    "&vocab_size=512&num_local_experts=4&num_experts_per_tok=2",  # a sink column, the softmax in bf16
}


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", list(LAYERS))
def test_eager_attention_moments_match_a_real_layer_at_512_tokens(arch, adapter_dtype):
    name = LAYERS[arch]
    ctx = _context(adapter_dtype, name, "eager", length=LENGTH)
    assert ctx.micro_batch_tokens == BATCH * LENGTH and ctx.scores_materialised
    layout = build_layout(ctx)
    counted = block_activations(ctx, layout, 1)
    forward, backward = _layer_moments(adapter_dtype, name, "eager", 1, length=LENGTH)
    assert counted.forward == pytest.approx(forward, rel=0.02)
    flowing_beyond_given = ctx.hidden_size * ctx.compute_bytes * BATCH * LENGTH  # the residual's gradient
    assert counted.backward + flowing_beyond_given == pytest.approx(backward, rel=0.02)
    nograd = nograd_block_bytes(ctx, layout, BATCH, LENGTH, 1)
    assert nograd == pytest.approx(_nograd_moment(adapter_dtype, name, "eager", 1, length=LENGTH), rel=0.02)


def test_the_softmax_copies_a_bf16_input_to_fp32_first():
    """What the counts rest on, measured: ``softmax(x, dtype=float32)`` on a bf16 input holds an
    fp32 copy of it beside its output (ATen converts before the kernel; only a float16 input on
    CUDA has a fused half-to-float kernel), so 2 + 4 + 4 bytes a score at once."""
    from planner.probe.tracking import LiveBytes

    x = torch.randn(4, 256, 256, dtype=torch.bfloat16)
    live = LiveBytes({x.untyped_storage().data_ptr()})
    with torch.no_grad(), live:
        torch.nn.functional.softmax(x, dim=-1, dtype=torch.float32)
    assert live.peak == 2 * x.numel() * 4
    ctx = _context(torch.bfloat16, LAYERS["qwen2"], "eager", length=LENGTH)
    assert _softmax_converts(ctx)


@pytest.mark.parametrize(
    ("arch", "padded"),
    [("qwen2", False), ("gemma2", False), ("qwen2", True)],  # Gemma 2: a full and a sliding mask
)
def test_the_masks_eager_layers_read_are_counted(arch, padded):
    """The masks the layers of a real eager forward are handed, each storage once, against
    ``attention_mask_bytes``: Hugging Face's float mask per mask kind, built padded or not (they
    were not counted: 4-11% of these models' reference peaks at 512-1,024 tokens), or for a
    left-padded batch the trainer's one additive mask (agilerl.utils.logprobs.shared_attention_mask)."""
    from agilerl.utils.logprobs import shared_attention_mask
    from agilerl.utils.tiny import tiny_model
    from planner.memory._activations import attention_mask_bytes

    length = 256
    kwargs = dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512)
    model = tiny_model(arch, dtype=torch.bfloat16, **kwargs)
    ids = torch.randint(3, 512, (BATCH, length))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :16] = 0  # a left-padded prompt
    seen: dict[int, int] = {}

    def record(module, args, kw):
        m = kw.get("attention_mask")
        if isinstance(m, torch.Tensor):
            seen[m.untyped_storage().data_ptr()] = m.untyped_storage().nbytes()

    for layer in model.model.layers:
        layer.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=ids, attention_mask=shared_attention_mask(model.config, mask, torch.bfloat16))
    ctx = _context(torch.bfloat16, LAYERS[arch], "eager", length=length)
    ctx = dataclasses.replace(ctx, workload=ctx.workload.model_copy(update={"padded_batches": padded}))
    assert len(seen) == (2 if arch == "gemma2" and not padded else 1)
    assert attention_mask_bytes(ctx, BATCH, length, forward="reference") == sum(seen.values())
