"""Real tiny decoder layers with PEFT's LoRA on every linear, measured the way planner.memory
counts them: saved-tensor hooks (what autograd keeps, by region) and a live-tensor tracker (the
most alive at once beyond a layer's input), with the adapters in bf16 (FSDP2's param_dtype
casts them) or in fp32 (PEFT's own, unsharded)."""

from __future__ import annotations

import collections
import functools

import torch
from torch.utils._pytree import tree_flatten, tree_map

from agilerl.distributed import FSDPConfig
from planner.probe.tracking import LiveBytes

from .conftest import PLE, make_context

H, BATCH, LENGTH, RANK = 64, 2, 128, 8
TOKENS = BATCH * LENGTH
# Three sliding layers (head_dim 16) and a global one twice as wide; per-layer inputs; eager attention.
GEMMA4 = "tiny:gemma4?hidden_size=64&intermediate_size=256&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=512"


def _model(
    adapter_dtype: torch.dtype,
    name: str = PLE,
    attn: str = "sdpa",
    chunk_mib: float | None = None,
    targets: str | tuple[str, ...] = "all-linear",
):
    """The tiny model with LoRA on ``targets``; with ``chunk_mib`` its experts are agilerl.distributed's
    row-wise ones (one rank, chunks of that size) and every router sends each expert the same rows."""
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_model

    arch, query = name.split(":", 1)[1].split("?", 1)
    kwargs = {k: int(v) for k, v in (kv.split("=") for kv in query.split("&"))}
    model = tiny_model(arch, **kwargs).to(torch.bfloat16)
    model.config._attn_implementation = attn
    model = get_peft_model(
        model,
        LoraConfig(
            r=RANK,
            lora_alpha=16,
            target_modules=targets if isinstance(targets, str) else list(targets),
            lora_dropout=0.0,
        ),
    )
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter_dtype)
    if chunk_mib is not None:
        from agilerl.distributed._moe import apply_expert_parallel

        for router in apply_expert_parallel(model, None, routed_expert_chunk_mib=chunk_mib).routers:
            router.forward = functools.partial(_balanced_routing, router, router.forward)
    base = model.get_base_model().model
    return getattr(base, "language_model", base), model


def _balanced_routing(router, route, hidden):
    """The router's own forward, with its choice replaced: token t goes to experts t, t + 1, ...
    (mod E), so every expert gets the same rows (a random tiny router does not, and the row-wise
    count takes them as balanced)."""
    logits, weights, chosen = route(hidden)
    offsets = torch.arange(chosen.shape[1], device=chosen.device)
    balanced = (torch.arange(chosen.shape[0], device=chosen.device).unsqueeze(1) + offsets) % logits.shape[-1]
    return logits, weights, balanced.to(chosen.dtype)


def _saved_by_region(adapter_dtype: torch.dtype, name: str = PLE, attn: str = "sdpa", **options) -> dict[str, int]:
    """Bytes autograd keeps from one forward, by where each storage is first saved: before the
    first layer, in each layer, after the last (``options``: :func:`_model`'s)."""
    decoder, model = _model(adapter_dtype, name, attn, **options)
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


def _layer_moments(
    adapter_dtype: torch.dtype, name: str = PLE, attn: str = "sdpa", index: int = 1, length: int = LENGTH, **options
):
    """(forward peak, backward peak) of layer ``index`` run alone over BATCH x ``length`` tokens,
    beyond its input and the gradient given to its output (``options``: :func:`_model`'s)."""
    decoder, model = _model(adapter_dtype, name, attn, **options)
    layer = decoder.layers[index]
    args, kwargs = _captured_inputs(decoder, index, length)
    args[0].requires_grad_(True)
    if "shared_kv_states" in kwargs:  # the layer stores its K and V there: a fresh one, as in the model's forward
        kwargs["shared_kv_states"] = {}
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


def _context(
    adapter_dtype: torch.dtype,
    name: str = PLE,
    attn: str = "sdpa",
    *,
    chunk_mib: float | None = None,
    targets: str | tuple[str, ...] = "all-linear",
    length: int = LENGTH,
):
    """The planner's context of :func:`_model`'s layers, micro-batches of BATCH x ``length``."""
    from planner.models import load_model_spec

    spec = load_model_spec(name, lora_targets=targets)
    rows = dict(prompt_tokens=length // 2, completion_tokens=length - length // 2, logprob_chunk_size=length)
    if adapter_dtype == torch.bfloat16:  # FSDP2's mixed precision casts the adapters to bf16
        fsdp = FSDPConfig(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            param_persistence_threshold=0,
            routed_expert_chunk_mib=chunk_mib,
        )
        return make_context(
            spec, gradient_checkpointing=False, fsdp=fsdp, attn_implementation=attn, lora_targets=targets, **rows
        )
    return make_context(
        spec, gpus=1, gradient_checkpointing=False, attn_implementation=attn, lora_targets=targets, **rows
    )


def _captured_inputs(decoder, index: int, length: int = LENGTH):
    """Layer ``index``'s arguments in a no-grad forward of the whole model over BATCH x ``length``
    tokens, detached copies."""
    layer, captured = decoder.layers[index], {}

    def grab(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        decoder(input_ids=torch.randint(3, 512, (BATCH, length)), use_cache=False)
    handle.remove()
    return tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, (list(captured["args"]), captured["kwargs"])
    )


def _nograd_moment(
    adapter_dtype: torch.dtype, name: str = PLE, attn: str = "sdpa", index: int = 1, length: int = LENGTH, **options
) -> int:
    """The most layer ``index`` holds beyond its input in a forward without grad over BATCH x
    ``length`` tokens (``options``: :func:`_model`'s)."""
    decoder, model = _model(adapter_dtype, name, attn, **options)
    args, kwargs = _captured_inputs(decoder, index, length)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    skip |= {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    live = LiveBytes(skip)
    with torch.no_grad(), live:
        decoder.layers[index](*args, **kwargs)
    return live.peak
