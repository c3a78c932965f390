"""Gemma-3n's AltUp layer and what its model keeps outside the layers, counted by planner.memory
against a real tiny Gemma-3n with PEFT's LoRA on every linear: saved-tensor hooks (what
autograd keeps) and a live-tensor tracker (the most alive at once), with the adapters in bf16
(FSDP2's param_dtype casts them) and in fp32 (PEFT's own, unsharded)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

from agilerl.distributed import FSDPConfig
from planner.memory._activations import (
    HEAD_ROW_BYTES,
    block_activations,
    boundary_bytes,
    embedding_kept_bytes,
    rotary_bytes,
)
from planner.memory._units import build_layout
from planner.probe.tracking import LiveBytes

from .conftest import PLE, make_context

H, BATCH, LENGTH, RANK = 64, 2, 128, 8
TOKENS = BATCH * LENGTH


def _model(adapter_dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_model

    kwargs = {k: int(v) for k, v in (kv.split("=") for kv in PLE.split("?", 1)[1].split("&"))}
    model = tiny_model("gemma3n", **kwargs).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter_dtype)
    base = model.get_base_model().model
    return getattr(base, "language_model", base), model


def _saved_by_region(adapter_dtype: torch.dtype) -> dict[str, int]:
    """Bytes autograd keeps from one forward, by where each storage is first saved: before the
    first layer, in each layer, after the last."""
    decoder, model = _model(adapter_dtype)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    region = ["embed"]
    saved: dict[int, int] = {}
    by_region: collections.Counter = collections.Counter()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            by_region[region[0]] += saved[key]
        return t

    for i, layer in enumerate(decoder.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: region.__setitem__(0, f"layer{i}"))
    decoder.layers[-1].register_forward_hook(lambda m, a, o: region.__setitem__(0, "head"))
    ids = torch.randint(3, 512, (BATCH, LENGTH))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder(input_ids=ids)
    return dict(by_region)


def _layer_moments(adapter_dtype: torch.dtype) -> tuple[float, float]:
    """(forward peak, backward peak) of layer 1 run alone, beyond its input and the gradient
    given to its output."""
    decoder, model = _model(adapter_dtype)
    layer, captured = decoder.layers[1], {}

    def grab(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        decoder(input_ids=torch.randint(3, 512, (BATCH, LENGTH)))
    handle.remove()
    args, kwargs = tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, (list(captured["args"]), captured["kwargs"])
    )
    args[0].requires_grad_(True)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    skip |= {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    live = LiveBytes(skip)
    with live:
        out = layer(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        forward = live.peak
        grad = torch.randn_like(out)
        live.exclude.add(grad.untyped_storage().data_ptr())
        held = out.untyped_storage().nbytes()  # the output this test holds; the trainer's next block has it
        live.peak = live.total
        out.backward(grad)
        backward = live.peak - held
    return forward, backward


def _context(adapter_dtype: torch.dtype):
    if adapter_dtype == torch.bfloat16:  # FSDP2's mixed precision casts the adapters to bf16
        fsdp = FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32", param_persistence_threshold=0)
        return make_context(_ple(), gradient_checkpointing=False, fsdp=fsdp)
    return make_context(_ple(), gpus=1, gradient_checkpointing=False)


def _ple():
    from planner.models import load_model_spec

    return load_model_spec(PLE)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_the_altup_layer_count_matches_a_real_gemma3n_layer(adapter_dtype):
    ctx = _context(adapter_dtype)
    assert ctx.micro_batch_tokens == TOKENS
    assert ctx.adapter_compute_bytes == (2 if adapter_dtype == torch.bfloat16 else 4)
    counted = block_activations(ctx, build_layout(ctx), 1)
    saved = _saved_by_region(adapter_dtype)
    # a layer's own saved tensors, its input streams included (the layer before made them)
    assert counted.saved == pytest.approx(saved["layer1"], rel=0.03)
    forward, backward = _layer_moments(adapter_dtype)
    assert counted.forward == pytest.approx(forward, rel=0.05)
    # the trainer counts the gradients flowing in beside the block: the output's (given here) and
    # the one its backward builds for its input streams, both stream-wide
    streams = ctx.carried_hidden * ctx.compute_bytes * TOKENS
    assert counted.backward + streams == pytest.approx(backward, rel=0.05)


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_what_gemma3n_keeps_outside_its_layers(adapter_dtype):
    ctx = _context(adapter_dtype)
    saved = _saved_by_region(adapter_dtype)
    embedding = embedding_kept_bytes(ctx)
    # the per-layer inputs are first saved in the layers that read them (a view of them each)
    per_layer_inputs = TOKENS * ctx.spec.per_layer_input_width * ctx.compute_bytes
    assert embedding - per_layer_inputs == pytest.approx(saved["embed"], rel=0.03)
    # the head side, less what the log-prob head (outside this forward) saves and the rotary tables
    head = boundary_bytes(ctx) - embedding - rotary_bytes(ctx) - TOKENS * (H * ctx.compute_bytes + HEAD_ROW_BYTES)
    assert head == pytest.approx(saved["head"], rel=0.03)


def test_casting_adapters_outside_the_layers_costs_their_copies():
    # PEFT's fp32 adapters on a bf16 base: every adapted linear outside the layers saves its own
    # fp32 copy of its input; with the adapters in bf16 they share or view the ones kept anyway
    fp32, bf16 = _context(torch.float32), _context(torch.bfloat16)
    assert boundary_bytes(fp32) > boundary_bytes(bf16)
    assert embedding_kept_bytes(fp32) > embedding_kept_bytes(bf16)
