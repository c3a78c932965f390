"""Padded batches: one additive attention mask per forward, shared by every layer.

Hugging Face hands SDPA a boolean mask, which SDPA turns into a float mask in every layer and
saves for backward (one B x T x T copy per layer). ``shared_attention_mask`` gives the layers one
float mask instead; outputs at real positions and gradients must not change.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from agilerl.utils.logprobs import position_ids_from_mask, shared_attention_mask
from agilerl.utils.tiny import tiny_config

B, T, LAYERS = 3, 24, 3


def _model(impl: str, dtype=torch.float32, **overrides):
    config = tiny_config(
        "qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_layers=LAYERS,
        num_heads=2,
        num_kv_heads=1,
        initializer_range=0.2,
        **overrides,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).to(dtype)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 40, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :9] = 0  # a left-padded prompt
    mask[1, :3] = 0
    mask[1, -5:] = 0  # and a completion padded after its end
    return ids, mask


def _run(model, ids, mask, shared: bool):
    """Logits, parameter gradients and the distinct B x 1 x T x T tensors autograd saved."""
    model.zero_grad()
    saved = set()

    def pack(t):
        if t.dim() == 4 and t.shape[1] == 1 and t.shape[-2:] == (T, T):
            saved.add(t.untyped_storage().data_ptr())
        return t

    attn = shared_attention_mask(model.config, mask, next(model.parameters()).dtype) if shared else mask
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(
            input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(mask), use_cache=False
        ).logits
    (logits.float() * mask[..., None]).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), grads, len(saved)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_outputs_and_gradients_are_unchanged(impl, dtype):
    model = _model(impl, dtype)
    ids, mask = _batch()
    hf_logits, hf_grads, _ = _run(model, ids, mask, shared=False)
    logits, grads, _ = _run(model, ids, mask, shared=True)
    real = mask.bool()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits[real], hf_logits[real], **tol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_sdpa_saves_one_mask_per_forward_instead_of_one_per_layer():
    model = _model("sdpa", torch.bfloat16)
    ids, mask = _batch()
    _, _, per_layer = _run(model, ids, mask, shared=False)
    _, _, shared = _run(model, ids, mask, shared=True)
    assert per_layer == LAYERS  # the control: Hugging Face's boolean mask, a float copy saved per layer
    assert shared == 1


def test_the_mask_is_causal_and_masks_padded_keys():
    model = _model("sdpa")
    ids, mask = _batch()
    additive = shared_attention_mask(model.config, mask, torch.float32)
    assert additive.shape == (B, 1, T, T) and additive.dtype == torch.float32
    allowed = additive[:, 0] == 0
    for b in range(B):
        for i in range(T):
            for j in range(T):
                assert bool(allowed[b, i, j]) == (j <= i and bool(mask[b, j])), (b, i, j)
    assert torch.isfinite(additive).all()  # a pad query with no key stays finite


def test_no_padding_no_mask_and_kernels_without_4d_masks_keep_the_2d_one():
    model = _model("sdpa")
    ids, mask = _batch()
    full = torch.ones_like(mask)
    assert shared_attention_mask(model.config, full, torch.float32) is full  # Hugging Face skips the mask
    model.config._attn_implementation = "flash_attention_2"
    assert shared_attention_mask(model.config, mask, torch.float32) is mask


@pytest.mark.parametrize("window,kept", [(T, False), (T - 1, True)])
def test_a_sliding_window_shorter_than_the_batch_keeps_its_own_mask(window, kept):
    model = _model("sdpa", use_sliding_window=True, sliding_window=window, max_window_layers=0)
    ids, mask = _batch()
    assert "sliding_attention" in model.config.layer_types
    out = shared_attention_mask(model.config, mask, torch.float32)
    assert (out is mask) == kept


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_rows_padded_only_at_their_ends_need_no_mask(impl):
    model = _model(impl)
    ids, _ = _batch()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, -7:] = 0  # completions that stopped early
    mask[2, -1:] = 0
    out = shared_attention_mask(model.config, mask, torch.float32)
    assert out.shape == mask.shape and bool(out.all())  # Hugging Face then builds no mask (SDPA: causal)
    hf_logits, hf_grads, _ = _run(model, ids, mask, shared=False)
    logits, grads, saved = _run(model, ids, mask, shared=True)
    real = mask.bool()
    torch.testing.assert_close(logits[real], hf_logits[real], atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name], atol=1e-5, rtol=1e-5)
    assert saved == 0
