"""Mixture-of-experts support: routers, checkpoint routing replay, expert parallel.

Hugging Face MoE models (transformers 5: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V2/V3) keep each layer's routed experts *packed*: one module holding
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (expert e computes
``down[e] @ act(gate) * up`` with ``gate, up = (gate_up[e] @ x).chunk(2)``), a
top-k router ``mlp.gate`` returning ``(logits, weights [T, k], indices [T, k])``,
and the block calling ``experts(hidden [T, H], indices, weights)``. PEFT's
"all-linear" LoRA wraps each packed parameter in a ``ParamWrapper`` with
``lora_A`` (r*E, in) and ``lora_B`` (out, r*E): expert e uses rows
``A[e*r:(e+1)*r]`` and columns ``B[:, j*E + e]`` (j < r), i.e. B's expert
index is the *fastest* one.

This module provides, in order of the sections below:

1. discovery: :func:`find_moe_layers` (block, outermost experts module, router);
2. routers: :data:`ROUTER_FORWARDS` re-implements each known router with an
   out-of-place top-k renormalisation and the option to *replay* indices;
3. checkpointing: :func:`checkpoint_moe_block` records each router's top-k
   indices in the forward and replays them in the recompute, so both passes
   dispatch identically and the top-k runs once per forward;
4. expert compute: the local experts run on rows grouped by expert, in row
   chunks of at most ``routed_expert_chunk_mib`` MiB (each chunk checkpointed,
   so only one chunk's activations are alive at a time), with expert LoRA
   applied per row (``x W^T + s (x A_e^T) B_e^T``) rather than folded into a
   copy of the whole expert stack as PEFT does;
5. expert parallel: :func:`apply_expert_parallel` keeps E/ep experts per rank
   and moves (token, expert) rows with two all-to-alls per token block;
6. FSDP side: the expert mesh, which parameters are expert parameters, and
   :func:`fully_shard_experts`.

Gradient scaling under expert parallel: a rank's local experts receive the
gradient of the summed losses of its whole EP group, so FSDP must divide
expert gradients by the number of data-parallel batch shards (the world
size), not by the expert mesh size (world / ep); :func:`fully_shard_experts`
sets that divide factor.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.checkpoint import checkpoint

from ..typing import HFModule
from ._plan import (
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    ParallelDims,
    expert_chunk_rows,
    expert_parallel_problem,
    expert_row_bytes,
)
from ._runtime import device_mesh, get_world_size

__all__ = [
    "EP_AXIS",
    "EXPERT_SHARD_AXIS",
    "ROUTER_FORWARDS",
    "MoELayer",
    "MoELayout",
    "ExpertShard",
    "ExpertParallelStats",
    "RouterStats",
    "find_moe_layers",
    "is_moe_block",
    "install_router_forwards",
    "routing_replay_contexts",
    "moe_checkpoint",
    "checkpoint_moe_block",
    "expert_chunk_rows",
    "experts_problem",
    "model_experts_problem",
    "apply_expert_parallel",
    "moe_layout",
    "check_expert_parallel",
    "build_expert_mesh",
    "expert_modules",
    "expert_parameter_names",
    "fully_shard_experts",
    "expert_slice",
    "gather_expert_tensor",
]

_WRAPPED = ("base_layer", "_checkpoint_wrapped_module")
_CKPT_PREFIX = "_checkpoint_wrapped_module."


# -- 1. discovery ---------------------------------------------------------------------------


def _base(module: nn.Module) -> nn.Module:
    """The module under PEFT wrappers (``base_layer`` chains) and checkpoint wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if inner is None:
            inner = getattr(module, "base_layer", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _is_packed_experts(module: nn.Module) -> bool:
    params = module._parameters
    return all((p := params.get(name)) is not None and p.dim() == 3 for name in ("gate_up_proj", "down_proj"))


@dataclass(frozen=True)
class MoELayer:
    """One routed MoE layer: the block, its outermost experts module and its router."""

    name: str  # qualified name of the block, e.g. "model.layers.3.mlp"
    block: nn.Module
    experts: HFModule  # outermost (PEFT ParamWrappers included): the unit to shard and patch
    router: HFModule | None  # innermost router module (under any PEFT wrapper)

    @property
    def base_experts(self) -> HFModule:
        return _base(self.experts)


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every block holding packed routed experts, in module order.

    The experts are the outermost module whose base has 3-D ``gate_up_proj``
    and ``down_proj`` parameters; the router is the block's child whose base
    class is listed in :data:`ROUTER_FORWARDS`. Dense MLPs (DeepSeek's first
    layers, its shared experts) are not packed and are not listed.
    """
    layers = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _WRAPPED or not _is_packed_experts(_base(module)):
            continue  # only the outermost wrapper of a packed experts module
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        block = model.get_submodule(parent_name)
        routers = (_base(c) for c in block.children())
        router = next((r for r in routers if _qualname(type(r)) in ROUTER_FORWARDS), None)
        layers.append(MoELayer(name=parent_name, block=block, experts=module, router=router))
    return layers


def is_moe_block(block: nn.Module) -> bool:
    """Whether a transformer block holds packed routed experts."""
    return any(_is_packed_experts(m) for m in block.modules())


# -- 2. routers -----------------------------------------------------------------------------

_Routed = tuple[Tensor, Tensor, Tensor]  # logits [T, E], weights [T, k], indices [T, k]
#: A router forward: (router, hidden, indices or None) -> (logits, weights, indices).
#: Given indices, it skips the top-k selection and recomputes only the weights.
RouteFn = Callable[[HFModule, Tensor, "Tensor | None"], _Routed]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _softmax_topk(
    router: HFModule, hidden: Tensor, indices: Tensor | None, *, renormalize: bool, cast_back: bool
) -> _Routed:
    """Qwen2/Qwen3-MoE, OLMoE, Mixtral: softmax, top-k, optional renormalisation.

    Weights are gathered from the probabilities at the chosen indices (the
    same values and gradient as ``topk``'s values) and renormalised out of
    place: transformers divides in place (``router_top_value /= ...``), which
    selective activation checkpointing rejects when it caches the top-k output
    ("Tensor cached during selective activation checkpoint has been mutated").
    """
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    if indices is None:
        with torch.no_grad():
            indices = torch.topk(probs, router.top_k, dim=-1).indices
    weights = probs.gather(1, indices)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype) if cast_back else weights, indices


def _deepseek_v2(router: HFModule, hidden: Tensor, indices: Tensor | None) -> _Routed:
    """DeepSeek-V2: fp32 softmax, greedy or group-limited greedy top-k, scaled weights."""
    hidden = hidden.view(-1, router.hidden_dim)
    logits = F.linear(hidden.float(), router.weight.float())
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if indices is None:
        with torch.no_grad():
            choice = scores
            if router.topk_method == "group_limited_greedy":
                groups = scores.view(-1, router.num_group, router.num_experts // router.num_group)
                best = groups.max(dim=-1).values
                group_idx = torch.topk(best, k=router.topk_group, dim=-1, sorted=False)[1]
                keep = torch.zeros_like(best).scatter(1, group_idx, 1).bool().unsqueeze(-1)
                choice = groups.masked_fill(~keep, 0.0).reshape(-1, router.num_experts)
            elif router.topk_method != "greedy":
                raise ValueError(f"unknown DeepSeek-V2 topk_method {router.topk_method!r}")
            indices = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    return logits, scores.gather(1, indices) * router.routed_scaling_factor, indices


def _deepseek_v3(router: HFModule, hidden: Tensor, indices: Tensor | None) -> _Routed:
    """DeepSeek-V3: sigmoid scores, bias-corrected group-limited choice, renormalised, scaled."""
    hidden = hidden.view(-1, router.hidden_dim)
    logits = F.linear(hidden.float(), router.weight.float())
    scores = logits.sigmoid()
    if indices is None:
        with torch.no_grad():
            choice = scores + router.e_score_correction_bias
            groups = choice.view(-1, router.num_group, router.num_experts // router.num_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter(1, group_idx, 1).bool().unsqueeze(-1)
            choice = groups.masked_fill(~keep, float("-inf")).reshape(-1, router.num_experts)
            indices = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, indices


def _softmax_topk_norm_flag(router: HFModule, hidden: Tensor, indices: Tensor | None) -> _Routed:
    return _softmax_topk(router, hidden, indices, renormalize=router.norm_topk_prob, cast_back=True)


_TM = "transformers.models"
#: Router class (qualified name, so no model module is imported to build it) -> its forward.
ROUTER_FORWARDS: dict[str, RouteFn] = {
    f"{_TM}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter": _softmax_topk_norm_flag,
    f"{_TM}.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter": _softmax_topk_norm_flag,
    f"{_TM}.olmoe.modeling_olmoe.OlmoeTopKRouter": _softmax_topk_norm_flag,
    f"{_TM}.mixtral.modeling_mixtral.MixtralTopKRouter": functools.partial(
        _softmax_topk, renormalize=True, cast_back=False
    ),
    f"{_TM}.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter": _deepseek_v2,
    f"{_TM}.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter": _deepseek_v3,
}


@dataclass
class RouterStats:
    """How often a router chose its top-k (selections) or reused recorded ones (replays)."""

    selections: int = 0
    replays: int = 0


class _RoutingTape:
    """The top-k indices of one checkpointed forward, replayed by its recompute."""

    def __init__(self) -> None:
        self.records: list[tuple[int, Tensor]] = []
        self.cursor = 0
        self.replaying = False

    def next(self, router: HFModule) -> Tensor:
        if self.cursor >= len(self.records) or self.records[self.cursor][0] != id(router):
            raise RuntimeError(
                "MoE routing replay is out of step: the recompute called the routers in a "
                "different order or number than the forward did"
            )
        self.cursor += 1
        return self.records[self.cursor - 1][1]


_ACTIVE = threading.local()  # recompute runs in the thread that unpacks (the backward thread)


@contextmanager
def _tape_active(tape: _RoutingTape, *, replay: bool) -> Iterator[None]:
    previous = getattr(_ACTIVE, "tape", None)
    tape.replaying, tape.cursor = replay, 0
    _ACTIVE.tape = tape
    try:
        yield
    finally:
        _ACTIVE.tape = previous


def routing_replay_contexts() -> tuple[Any, Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: record top-k indices, then replay them."""
    tape = _RoutingTape()
    return _tape_active(tape, replay=False), _tape_active(tape, replay=True)


def _routed_forward(router: HFModule, route: RouteFn, hidden_states: Tensor) -> _Routed:
    tape: _RoutingTape | None = getattr(_ACTIVE, "tape", None)
    stats: RouterStats = router._agilerl_router_stats
    if tape is not None and tape.replaying:
        stats.replays += 1
        return route(router, hidden_states, tape.next(router))
    logits, weights, indices = route(router, hidden_states, None)
    stats.selections += 1
    if tape is not None:
        tape.records.append((id(router), indices.detach()))
    return logits, weights, indices


def install_router_forwards(model: nn.Module) -> list[nn.Module]:
    """Give every router listed in :data:`ROUTER_FORWARDS` its out-of-place, replayable forward.

    Returns the routers patched (idempotent). Each carries a :class:`RouterStats`
    as ``_agilerl_router_stats``. A PEFT LoRA on the router still applies: its
    wrapper parametrises ``router.weight``, which the new forward reads.
    """
    routers = []
    for layer in find_moe_layers(model):
        router = layer.router
        if router is None:
            continue
        if not hasattr(router, "_agilerl_router_stats"):
            router._agilerl_router_stats = RouterStats()
            route = ROUTER_FORWARDS[_qualname(type(router))]
            router.forward = functools.partial(_routed_forward, router, route)
        routers.append(router)
    return routers


# -- 3. checkpointing -----------------------------------------------------------------------


def moe_checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint that replays the forward's routing in the recompute.

    Early stop is off: under expert parallel the recompute issues all-to-alls,
    and every rank must run all of them even if it has no more tensors to
    recompute.
    """
    return checkpoint(fn, *args, use_reentrant=False, context_fn=routing_replay_contexts, early_stop=False, **kwargs)


def checkpoint_moe_block(block: nn.Module) -> nn.Module:
    """Wrap a block holding experts with :func:`moe_checkpoint` (a ``CheckpointWrapper``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=moe_checkpoint)


# -- 4. expert compute ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Lora:
    a: Tensor  # (E_local, r, in)
    b: Tensor  # (E_local, out, r)
    scaling: float


@dataclass(frozen=True)
class _ExpertWeights:
    gate_up: Tensor  # (E_local, 2I, H)
    down: Tensor  # (E_local, H, I)
    loras: dict[str, tuple[_Lora, ...]]
    apply_gate: Callable[[Tensor], Tensor]


def _is_param_wrapper(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("parameter_name", "lora_A", "lora_B", "base_layer"))


def _expert_weights(experts: HFModule) -> _ExpertWeights:
    """The packed weights and the active LoRA factors, read past PEFT's ParamWrappers.

    The wrappers' own forward would fold ``W + s B A`` into a copy of the whole
    expert stack (and its gradient); reading the factors lets the experts apply
    LoRA per row instead. Disabled or merged adapters contribute nothing.
    """
    loras: dict[str, list[_Lora]] = {"gate_up_proj": [], "down_proj": []}
    module = experts
    while _is_param_wrapper(module):
        if not module.disable_adapters and not module.merged:
            for name in module.active_adapters:
                if name not in module.lora_A:
                    continue
                num = module.num_experts
                a = module.lora_A[name].weight
                b = module.lora_B[name].weight
                loras[module.parameter_name].append(
                    _Lora(
                        a=a.reshape(num, -1, a.shape[-1]),
                        b=b.reshape(b.shape[0], -1, num).permute(2, 0, 1),
                        scaling=module.scaling[name],
                    )
                )
        module = module.base_layer
    return _ExpertWeights(
        gate_up=module.gate_up_proj,
        down=module.down_proj,
        loras={k: tuple(v) for k, v in loras.items()},
        apply_gate=module._apply_gate,
    )


def experts_problem(experts: HFModule) -> str | None:
    """Why the row-wise experts (expert parallel, ``routed_expert_chunk_mib``) cannot run a
    packed experts module (PEFT wrappers included), or None when they can.

    The supported layout is ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] with no
    biases (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V2/V3). gpt-oss keeps its experts
    transposed and with biases: it trains with Hugging Face's own expert loop, experts
    whole on each rank's FSDP shard, with ``ep=1`` and ``routed_expert_chunk_mib`` unset.
    """
    base = _base(experts)
    flags = dict(has_gate=True, has_bias=False, is_transposed=False, has_post_expert_norm=False)
    odd = {k: getattr(base, k) for k, v in flags.items() if getattr(base, k, v) != v}
    if odd:
        return (
            f"{type(base).__name__}: packed experts with {odd} are not supported by expert parallel or "
            "routed_expert_chunk_mib (supported: gate_up_proj [E, 2I, H] and down_proj [E, H, I], no "
            "biases); use ep=1 and leave routed_expert_chunk_mib unset"
        )
    module = experts
    while _is_param_wrapper(module):
        if module.parameter_name not in ("gate_up_proj", "down_proj"):
            return f"LoRA on experts parameter {module.parameter_name!r} is not supported"
        has_bias = any(b.bias is not None for b in module.lora_B.values())
        if has_bias or not module._did_swap_in_out_features:
            return "expert LoRA with lora_bias or a transposed layout is not supported"
        module = module.base_layer
    return None


def model_experts_problem(model: nn.Module) -> str | None:
    """:func:`experts_problem` of the first MoE layer that has one (None: all can run row-wise)."""
    for layer in find_moe_layers(model):
        problem = experts_problem(layer.experts)
        if problem is not None:
            return problem
    return None


def _check_supported(experts: nn.Module) -> None:
    problem = experts_problem(experts)
    if problem is not None:
        raise NotImplementedError(problem)


def _expert_linear(x: Tensor, weight: Tensor, loras: tuple[_Lora, ...], e: int) -> Tensor:
    y = F.linear(x, weight[e])
    for lora in loras:
        a, b = lora.a[e].to(weight.dtype), lora.b[e].to(weight.dtype)
        y = y + lora.scaling * F.linear(F.linear(x, a), b)
    return y


def _experts_on_segments(x: Tensor, *, weights: _ExpertWeights, segments: tuple[tuple[int, int, int], ...]) -> Tensor:
    """Expert e's MLP on rows ``x[lo:hi]`` for each (e, lo, hi); rows are grouped by expert.

    The segments tile ``x`` in order, so it is split (one concatenation of the
    gradients in backward) rather than sliced (a zero-padded full-size gradient
    per segment, summed)."""
    outs = []
    for (e, _, _), rows in zip(segments, x.split([hi - lo for _, lo, hi in segments])):
        h = _expert_linear(rows, weights.gate_up, weights.loras["gate_up_proj"], e)
        h = weights.apply_gate(h)
        outs.append(_expert_linear(h, weights.down, weights.loras["down_proj"], e))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _run_local_experts(
    rows: Tensor, counts: list[int], weights: _ExpertWeights, chunk_rows: int | None, stats: ExpertParallelStats
) -> Tensor:
    """The local experts on ``rows`` (grouped by expert, ``counts`` rows each), chunk by chunk.

    With a chunk size each chunk is checkpointed, so its activations (the
    widest being [rows, 2I]) are freed after its forward and rebuilt in its
    backward: only one chunk's activations are alive at a time. A chunk with
    no rows still runs expert 0 on zero rows, so every expert weight is in the
    graph on every rank (FSDP reduce-scatters the same gradients everywhere).
    """
    total = rows.shape[0]
    step = chunk_rows or max(total, 1)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    # Without grad each chunk's output goes straight into one buffer (no list, no cat copy).
    nograd = not torch.is_grad_enabled()
    out: Tensor | None = None
    outs = []
    # Chunks are split views of ``rows``, not slices: split's backward concatenates the
    # chunks' gradients once, where each slice's backward would pad its gradient to the
    # full rows and add it to an accumulator (three full-size copies at once, and
    # O(chunks x rows) zero-filling).
    pieces = rows.split(step) if total else (rows,)
    for lo, piece in zip(range(0, max(total, 1), step), pieces):
        hi = min(lo + step, total)
        segments = tuple(
            (e, max(lo, s) - lo, min(hi, s + c) - lo)
            for e, (s, c) in enumerate(zip(starts, counts))
            if c and s < hi and s + c > lo
        ) or ((0, 0, 0),)
        fn = functools.partial(_experts_on_segments, weights=weights, segments=segments)
        if nograd:
            y = fn(piece)
            if out is None:
                out = y if hi - lo == total else y.new_empty((total, *y.shape[1:]))
            if out is not y:
                out[lo:hi] = y
            del y
        elif chunk_rows is not None:
            outs.append(checkpoint(fn, piece, use_reentrant=False))
        else:
            outs.append(fn(piece))
        stats.num_expert_chunks += 1
    if out is not None:
        return out
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class _WeightedCombine(torch.autograd.Function):
    """``sum_k w[t, k] * rows[t, k]`` in fp32, saving only the inputs (not an fp32 copy)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, weights: Tensor) -> Tensor:  # [T, k, H], [T, k]
        ctx.save_for_backward(rows, weights)
        return torch.bmm(weights.float().unsqueeze(1), rows.float()).squeeze(1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        rows, weights = ctx.saved_tensors
        grad_rows = (weights.float().unsqueeze(-1) * grad.float().unsqueeze(1)).to(rows.dtype)
        grad_weights = torch.bmm(rows.float(), grad.float().unsqueeze(-1)).squeeze(-1)
        return grad_rows, grad_weights.to(weights.dtype)


# -- 5. expert parallel ---------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` along dim 0; its backward is the reverse all-to-all.

    ``started``: a list to start it in the background instead (``async_op``) and append its
    handle to: its output is then filled while the caller computes, and must not be read before
    the handle's ``wait()``. The backward blocks either way."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, started: list | None = None
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=group, async_op=started is not None
        )
        if started is not None:
            started.append(work)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None, None


@dataclass
class ExpertParallelStats:
    """Counters of one MoE layer's experts: read by tests and memory probes."""

    num_calls: int = 0
    num_token_blocks: int = 0
    num_expert_chunks: int = 0
    num_rows_received: int = 0  # (token, expert) rows computed here, summed over blocks
    max_rows_received: int = 0  # largest block: rows of the all-to-all receive buffer
    max_blocks_in_flight: int = 0  # token blocks dispatched and not yet combined: 2 where the next overlaps


@dataclass
class _ExpertState:
    num_experts: int  # global E
    first_expert: int
    num_local_experts: int
    ep: int
    group: Any  # the EP process group (None when ep == 1)
    token_blocks: int
    chunk_mib: float | None
    stats: ExpertParallelStats = field(default_factory=ExpertParallelStats)


def _inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


@dataclass
class _Dispatched:
    """One token block's (token, expert) rows, sent to the ranks that own their experts: ``rows``
    arrive by source rank, then expert (on this rank alone, by expert), once ``started`` is done."""

    order: Tensor  # the block's rows sorted by expert, as indices into its (token, k) pairs
    num_tokens: int
    rows: Tensor | None
    local_counts: list[int]  # rows of each local expert
    recv_counts: Tensor | None  # [source rank, local expert] (expert parallel only)
    splits: tuple[list[int], list[int]]  # (sent to, received from) each rank
    started: list  # the dispatch all-to-all's handle while it runs in the background

    def arrived(self) -> Tensor:
        """The rows, once here; the block keeps no reference to them after."""
        for work in self.started:
            work.wait()
        self.started.clear()
        rows, self.rows = self.rows, None
        assert rows is not None, "a dispatched block's rows are taken once"
        return rows


@dataclass
class _Counts:
    """One token block's rows per expert, as the dispatch needs them: per global expert (``sent``),
    and under expert parallel per source rank and local expert (``received``, on the device; the
    splits as lists, read off one host copy for the whole layer)."""

    sent: list[int]
    received: Tensor | None = None  # [source rank, local expert]
    local: list[int] = field(default_factory=list)  # rows each local expert computes
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)


def _exchange_counts(state: _ExpertState, indices: list[Tensor]) -> list[_Counts]:
    """Every token block's :class:`_Counts`: under expert parallel one all-to-all tells each rank
    how many rows of each block it receives for each of its experts, for the whole layer at once
    (so no block's exchange waits behind an earlier block's dispatch), and one host copy gives
    every split."""
    counts = torch.stack([torch.bincount(idx.reshape(-1), minlength=state.num_experts) for idx in indices])
    if state.ep == 1:
        return [_Counts(sent, local=sent) for sent in counts.tolist()]
    blocks, ep = len(indices), state.ep
    send = counts.view(blocks, ep, state.num_local_experts).transpose(0, 1).contiguous()  # by owning rank
    received = torch.empty_like(send)  # [source rank, block, local expert]
    dist.all_to_all_single(received, send, group=state.group)
    sent_host, received_host = counts.tolist(), received.cpu()
    per_rank = state.num_local_experts
    return [
        _Counts(
            sent_host[b],
            received[:, b],
            local=received_host[:, b].sum(0).tolist(),
            send_splits=[sum(sent_host[b][r * per_rank : (r + 1) * per_rank]) for r in range(ep)],
            recv_splits=received_host[:, b].sum(1).tolist(),
        )
        for b in range(blocks)
    ]


def _dispatch(state: _ExpertState, x: Tensor, indices: Tensor, counts: _Counts, *, background: bool) -> _Dispatched:
    """Send one token block's rows to the ranks owning their experts; with ``background`` the
    all-to-all runs while the caller computes."""
    num_tokens, k = indices.shape
    order = torch.argsort(indices.reshape(-1), stable=True)  # rows grouped by expert, hence by owning rank
    # Indexing and the all-to-all save only indices and splits: the row buffer sent is dropped
    # as soon as it is sent (the collective keeps it until it is done).
    send = x[order // k]
    if counts.received is None:
        return _Dispatched(order, num_tokens, send, counts.local, None, ([], []), [])
    started: list = []
    rows = _AllToAll.apply(send, counts.recv_splits, counts.send_splits, state.group, started if background else None)
    return _Dispatched(
        order, num_tokens, rows, counts.local, counts.received, (counts.send_splits, counts.recv_splits), started
    )


def _combine_block(
    state: _ExpertState,
    weights: _ExpertWeights,
    block: _Dispatched,
    routing: Tensor,
    chunk_rows: int | None,
    combine_rows: int | None,
) -> Tensor:
    """Run the experts on a dispatched token block's rows, send the outputs back, combine them:
    [T, H] fp32. Each row buffer is dropped as soon as the next one exists (``del``): without grad
    a block holds at most two row copies besides one chunk's intermediates; with grad the experts'
    input rows stay saved for backward (by the chunks' checkpoints or the linears)."""
    rows = block.arrived()
    if block.recv_counts is None:
        out = _run_local_experts(rows, block.local_counts, weights, chunk_rows, state.stats)
        del rows
    else:
        # Rows arrive by source rank, then expert; the experts want them by expert.
        expert_of_row = torch.arange(state.num_local_experts, device=rows.device).repeat(state.ep)
        regroup = torch.argsort(expert_of_row.repeat_interleave(block.recv_counts.flatten()), stable=True)
        grouped = rows[regroup]
        del rows
        out = _run_local_experts(grouped, block.local_counts, weights, chunk_rows, state.stats)
        del grouped
        back = out[_inverse(regroup)]
        del out
        send_splits, recv_splits = block.splits
        out = _AllToAll.apply(back, send_splits, recv_splits, state.group)
        del back
    received = sum(block.local_counts)
    state.stats.num_rows_received += received
    state.stats.max_rows_received = max(state.stats.max_rows_received, received)
    k = routing.shape[-1]
    pairs = out[_inverse(block.order)].view(block.num_tokens, k, out.shape[-1])
    del out
    step = combine_rows or max(block.num_tokens, 1)
    parts = [_WeightedCombine.apply(p, w) for p, w in zip(pairs.split(step), routing.split(step))]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _experts_forward(
    experts: nn.Module, state: _ExpertState, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """Drop-in ``experts(hidden [T, H], top_k_index, top_k_weights)`` with EP, blocks and chunks.

    Under expert parallel with several token blocks, the next block's dispatch all-to-all runs in
    the background while this block's experts compute (its rows and the rows it sends are held
    beside this block's meanwhile); the backward's all-to-alls block."""
    weights = _expert_weights(experts)
    hidden_dim = hidden_states.shape[-1]
    row_bytes = expert_row_bytes(
        expert_width=weights.gate_up.shape[1] // 2, hidden_size=hidden_dim, element_size=hidden_states.element_size()
    )
    chunk_rows = expert_chunk_rows(chunk_mib=state.chunk_mib, row_bytes=row_bytes)
    combine_row_bytes = top_k_index.shape[-1] * hidden_dim * 4  # one token's k fp32 rows
    combine_rows = expert_chunk_rows(chunk_mib=state.chunk_mib, row_bytes=combine_row_bytes)
    state.stats.num_calls += 1
    inputs = (hidden_states, top_k_index, top_k_weights)
    blocks = list(zip(*(torch.tensor_split(t, state.token_blocks) for t in inputs)))
    counts = _exchange_counts(state, [idx for _, idx, _ in blocks])
    overlap = state.ep > 1 and len(blocks) > 1
    outs = []
    ahead = _dispatch(state, blocks[0][0], blocks[0][1], counts[0], background=True) if overlap else None
    for i, (x, idx, w) in enumerate(blocks):  # every rank runs every block, empty or not: collectives must match
        if ahead is not None:
            current = ahead
            more = i + 1 < len(blocks)
            nxt = blocks[i + 1] if more else None
            ahead = _dispatch(state, nxt[0], nxt[1], counts[i + 1], background=True) if nxt is not None else None
        else:
            current = _dispatch(state, x, idx, counts[i], background=False)
        in_flight = 1 + (ahead is not None)
        state.stats.max_blocks_in_flight = max(state.stats.max_blocks_in_flight, in_flight)
        outs.append(_combine_block(state, weights, current, w, chunk_rows, combine_rows))
        del current
        state.stats.num_token_blocks += 1
    return (torch.cat(outs) if len(outs) > 1 else outs[0]).to(hidden_states.dtype)


def _slice_experts(experts: HFModule, first: int, num_local: int) -> None:
    """Keep experts [first, first + num_local) of the packed weights and their LoRA factors."""

    def _replace(owner: nn.Module, name: str, value: Tensor) -> None:
        old = owner._parameters[name]
        owner._parameters[name] = nn.Parameter(value.clone(), requires_grad=old is None or old.requires_grad)

    module = experts
    while _is_param_wrapper(module):
        num = module.num_experts
        for adapters, kind in ((module.lora_A, "dim0"), (module.lora_B, "lora_b")):
            for linear in adapters.values():
                shard = ExpertShard(kind=kind, num_experts=num)
                local = expert_slice(linear.weight.detach(), shard=shard, first=first, num_local=num_local)
                _replace(linear, "weight", local)
        for linear in module.lora_A.values():
            linear.out_features = linear.weight.shape[0]
        for linear in module.lora_B.values():
            linear.in_features = linear.weight.shape[1]
        module.num_experts = num_local
        module = module.base_layer
    for name in ("gate_up_proj", "down_proj"):
        _replace(module, name, getattr(module, name).detach()[first : first + num_local])
    module.num_experts = num_local


@dataclass(frozen=True)
class ExpertShard:
    """How an expert parameter is split across the EP group.

    ``dim0``: experts along dim 0 (packed weights; LoRA A, rows e*r..e*r+r-1).
    ``lora_b``: LoRA B's columns, expert index fastest (column j*E + e).
    """

    kind: str
    num_experts: int  # global E


@dataclass
class MoELayout:
    """What :func:`apply_expert_parallel` did: read by the trainer, state dicts and tests."""

    ep: int
    ep_rank: int
    token_blocks: int
    chunk_mib: float | None
    layers: list[MoELayer] = field(default_factory=list)
    routers: list[nn.Module] = field(default_factory=list)
    # parameter name (without checkpoint-wrapper segments) -> how it is split
    expert_shards: dict[str, ExpertShard] = field(default_factory=dict)

    def stats(self) -> list[ExpertParallelStats]:
        return [layer.experts._agilerl_expert_state.stats for layer in self.layers]

    def expert_shard(self, name: str) -> ExpertShard | None:
        """How parameter ``name`` is split over the EP group (None: not an expert parameter)."""
        return self.expert_shards.get(name.replace(_CKPT_PREFIX, ""))


def moe_layout(model: nn.Module) -> MoELayout | None:
    """The layout :func:`apply_expert_parallel` recorded on ``model`` (None if not applied)."""
    return getattr(model, "_agilerl_moe_layout", None)


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh | None,
    *,
    ep_token_blocks: int = 1,
    routed_expert_chunk_mib: float | None = None,
) -> MoELayout:
    """Split each MoE layer's experts over ``ep_mesh`` and route tokens with all-to-all.

    Rank i of the EP group keeps the contiguous experts [i*E/ep, (i+1)*E/ep) of
    every packed tensor and of its LoRA factors. The experts' forward then
    dispatches each (token, expert) row to its owner, runs the local experts in
    chunks of ``routed_expert_chunk_mib`` MiB (fractions allowed; None: one
    chunk) and returns the outputs for the token owner to weight and sum in
    fp32, in ``ep_token_blocks`` blocks. ``ep_mesh`` None (or of size 1) keeps
    every expert local and only changes how they compute. Routers get
    :data:`ROUTER_FORWARDS`. Call before sharding: parameters are replaced.
    """
    if ep_token_blocks < 1:
        raise ValueError(f"ep_token_blocks must be >= 1, got {ep_token_blocks}")
    ep = 1 if ep_mesh is None else ep_mesh.size()
    ep_rank = 0 if ep_mesh is None else ep_mesh.get_local_rank()
    group = None if ep_mesh is None or ep == 1 else ep_mesh.get_group()
    layers = find_moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no packed MoE experts to split")
    layout = MoELayout(
        ep=ep, ep_rank=ep_rank, token_blocks=ep_token_blocks, chunk_mib=routed_expert_chunk_mib, layers=layers
    )
    module_names = {id(m): n for n, m in model.named_modules()}
    for layer in layers:
        experts = layer.experts
        if hasattr(experts, "_agilerl_expert_state"):
            raise ValueError(f"apply_expert_parallel was already applied to {layer.name}")
        if any(type(p).__name__ == "DTensor" for p in experts.parameters()):
            raise ValueError("apply_expert_parallel must run before fully_shard (experts are already sharded)")
        _check_supported(experts)
        num_experts = layer.base_experts.num_experts
        if num_experts % ep:
            raise ValueError(f"ep={ep} must divide the {num_experts} experts of {layer.name}")
        num_local = num_experts // ep
        if ep > 1:
            _slice_experts(experts, ep_rank * num_local, num_local)
        state = _ExpertState(
            num_experts=num_experts,
            first_expert=ep_rank * num_local,
            num_local_experts=num_local,
            ep=ep,
            group=group,
            token_blocks=ep_token_blocks,
            chunk_mib=routed_expert_chunk_mib,
        )
        experts._agilerl_expert_state = state
        experts.forward = functools.partial(_experts_forward, experts, state)
        prefix = module_names[id(experts)].replace(_CKPT_PREFIX, "")
        for name, _ in experts.named_parameters():
            kind = "lora_b" if ".lora_B." in f".{name}" else "dim0"
            shard = ExpertShard(kind=kind, num_experts=num_experts)
            layout.expert_shards[f"{prefix}.{name}"] = shard
    layout.routers = install_router_forwards(model)
    setattr(model, "_agilerl_moe_layout", layout)  # noqa: B010 (nn.Module's typing has no such attribute)
    return layout


# -- 6. FSDP side ---------------------------------------------------------------------------


def check_expert_parallel(*, world_size: int, ep: int, num_experts: int | None = None) -> None:
    """Validate an EP degree: it must divide the world size and every layer's expert count."""
    problem = expert_parallel_problem(world_size, ep, () if num_experts is None else (num_experts,))
    if problem:
        raise ValueError(problem)


def build_expert_mesh(*, ep: int, device_type: str = "cpu") -> DeviceMesh:
    """A (world / ep, ep) mesh named (``expert_shard``, ``ep``).

    EP groups are consecutive ranks (so all-to-alls stay inside a node when
    ep <= GPUs per node); ``mesh["ep"]`` is the group to split experts over,
    ``mesh["expert_shard"]`` the FSDP mesh for the local experts.
    """
    shape, names = ParallelDims(get_world_size(), ep=ep).expert_mesh()
    return device_mesh(device_type, shape, names)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost experts modules: the units to fully_shard on the expert mesh."""
    return [layer.experts for layer in find_moe_layers(model)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters under the experts modules (packed weights and their LoRA).

    Everything else (attention, routers, shared experts, embeddings) is dense
    and shards on the full data-parallel mesh.
    """
    ids = {id(p) for m in expert_modules(model) for p in m.parameters()}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def fully_shard_experts(
    model: nn.Module, *, expert_mesh: DeviceMesh, gradient_divide_factor: float, **fully_shard_kwargs: Any
) -> list[FSDPModule]:
    """``fully_shard`` each experts module on ``expert_mesh``; call before sharding the blocks.

    ``gradient_divide_factor`` must be the number of data-parallel batch
    shards (the world size without TP): a rank's experts already hold the sum
    over its EP group, and the reduce-scatter sums over the expert mesh.
    """
    units = expert_modules(model)
    # A custom factor reduces with PREMUL_SUM, which only NCCL has; elsewhere (gloo)
    # FSDP must sum and scale separately. Not on a 1-rank mesh: torch 2.13 then
    # divides twice (its no-collective branch and the post-divide both apply it).
    group = expert_mesh.get_group()
    sum_only = dist.get_backend(group) != "nccl" and dist.get_world_size(group) > 1
    out: list[FSDPModule] = []
    for unit in units:
        sharded = fully_shard(unit, mesh=expert_mesh, **fully_shard_kwargs)
        out.append(sharded)
        sharded.set_gradient_divide_factor(float(gradient_divide_factor))
        if sum_only:
            sharded.set_force_sum_reduction_for_comms(True)
    return out


def expert_slice(full: Tensor, *, shard: ExpertShard, first: int, num_local: int) -> Tensor:
    """Experts [first, first + num_local) of a full expert parameter (a view where possible)."""
    if shard.kind == "dim0":
        rows = full.shape[0] // shard.num_experts
        return full[first * rows : (first + num_local) * rows]
    if shard.kind == "lora_b":
        out = full.shape[0]
        columns = full.reshape(out, -1, shard.num_experts)  # (out, r, E)
        return columns[:, :, first : first + num_local].reshape(out, -1)
    raise ValueError(f"unknown expert shard kind {shard.kind!r}; allowed: 'dim0', 'lora_b'")


def gather_expert_tensor(local: Tensor, *, shard: ExpertShard, group: Any) -> Tensor:
    """All-gather one expert parameter (or gradient) over the EP group into its full form."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if shard.kind == "dim0":
        return torch.cat(parts)
    out = local.shape[0]
    columns = [p.reshape(out, -1, shard.num_experts // size) for p in parts]  # (out, r, E_local)
    return torch.cat(columns, dim=2).reshape(out, -1)
