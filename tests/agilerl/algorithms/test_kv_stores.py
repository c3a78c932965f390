"""Gemma 4 and Gemma-3n store the K and V of a layer of each attention type for sharing, even
when no layer reuses them, and again in a checkpointed recompute when layers do; the trainer
turns both off (agilerl.algorithms.core.loading), which changes no number and frees what a
checkpointed recompute would otherwise keep to the end of the backward."""

from __future__ import annotations

import pytest
import torch

from agilerl.algorithms.core.loading import _skip_unread_kv_stores
from agilerl.utils.tiny import tiny_model
from planner.probe.tracking import LiveBytes

from ._common import make_agent

GEMMA4 = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=256)


def _stores(model) -> list[bool]:
    return [m.store_full_length_kv for m in model.modules() if hasattr(m, "store_full_length_kv")]


def _checkpointed_peft(model):
    from peft import LoraConfig, get_peft_model

    from agilerl.distributed import FSDPConfig, apply_activation_checkpointing

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    apply_activation_checkpointing(model, FSDPConfig())
    return model


def _learn_peak(model, ids) -> tuple[int, torch.Tensor]:
    """The most alive in a checkpointed forward and backward, and the logits."""
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    live = LiveBytes(params)
    with live:
        logits = model(input_ids=ids, use_cache=False).logits
        logits.float().square().mean().backward()
    return live.peak, logits.detach()


def test_a_model_without_reusing_layers_stores_nothing_and_computes_the_same():
    stored = _checkpointed_peft(tiny_model("gemma4", seed=0, **GEMMA4))
    skipped = _checkpointed_peft(tiny_model("gemma4", seed=0, **GEMMA4))
    assert any(_stores(stored))  # the last sliding and the last global layer store theirs
    _skip_unread_kv_stores(skipped)
    assert _stores(skipped) and not any(_stores(skipped))
    ids = torch.randint(3, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    peak_stored, logits_stored = _learn_peak(stored, ids)
    peak_skipped, logits_skipped = _learn_peak(skipped, ids)
    torch.testing.assert_close(logits_skipped, logits_stored, rtol=0, atol=0)
    # the stored layers' recomputed K and V (and their fp32 norm inputs) no longer wait for the
    # backward's end
    assert peak_skipped < peak_stored


def test_layers_that_reuse_k_and_v_keep_the_store():
    # the last two layers reuse the K and V of the first two, one of each attention type
    types = ["sliding_attention", "full_attention"] * 2
    model = tiny_model("gemma4", seed=0, num_kv_shared_layers=2, layer_types=types, per_layer_config={}, **GEMMA4)
    before = _stores(model)
    assert any(before)
    _skip_unread_kv_stores(model)
    assert _stores(model) == before


def test_where_layers_reuse_k_and_v_a_recompute_does_not_store_them_again():
    """A checkpointed store layer's recompute in backward wrote its recomputed K and V into the
    forward's store, which every checkpointed layer's saved arguments hold, so they and the graph
    behind them stayed to the backward's end; the layers reading them had run their backward
    already. Skipped, the logits and every gradient are the same, bit for bit, and the peak lower;
    a forward (the reference pass, generate) stores again."""
    types = ["sliding_attention", "full_attention"] * 2

    def build():
        model = tiny_model("gemma4", seed=0, num_kv_shared_layers=2, layer_types=types, per_layer_config={}, **GEMMA4)
        return _checkpointed_peft(model)

    stored, skipped = build(), build()
    _skip_unread_kv_stores(skipped)
    ids = torch.randint(3, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    peak_stored, logits_stored = _learn_peak(stored, ids)
    peak_skipped, logits_skipped = _learn_peak(skipped, ids)
    torch.testing.assert_close(logits_skipped, logits_stored, rtol=0, atol=0)
    grads = [(a.grad, b.grad) for a, b in zip(stored.parameters(), skipped.parameters()) if a.grad is not None]
    assert len(grads) > 0
    for a, b in grads:
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert peak_skipped < peak_stored
    assert not any(_stores(skipped))  # as the recompute left them
    with torch.no_grad():
        skipped(input_ids=ids, use_cache=False)
    assert _stores(skipped) == _stores(stored) and any(_stores(skipped))


@pytest.mark.parametrize("arch", ["gemma4", "gemma3n"])
def test_the_trainer_builds_gemma_models_without_unread_stores(arch):
    name = "tiny:" + arch + "?" + "&".join(f"{k}={v}" for k, v in GEMMA4.items())
    agent = make_agent(model_name=name, gradient_checkpointing=True)
    assert _stores(agent.model) and not any(_stores(agent.model))
