"""Weights FSDP2 holds gathered (unsharded, in the compute dtype) at once: the window of
running and prefetched units, in forward and in backward.

Units run in order (embeddings, blocks with their nested expert units, lm_head; reversed
in backward), so the gathered set is a sliding window over that order.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Literal

from ._context import Context
from ._units import Layout, Unit

#: A forward's moments: its units running, copying out, or either.
Moment = Literal["both", "running", "copying"]

#: (bytes, index of the enclosing entry or None, bytes a prefetch of it holds)
OrderEntry = tuple[int, int | None, int]


@dataclass(frozen=True, slots=True)
class Gathered:
    unit_bytes: tuple[int, ...]  # each unit of Layout.units gathered, in forward order
    root_bytes: int
    root_ahead: int  # the root's all-gather output, held into the first unit's copy-out (0 on one rank)
    all_bytes: int  # every unit and the root at once
    order: tuple[OrderEntry, ...]  # forward gathering order, nested expert units apart
    largest_bytes: int  # the largest entry of ``order``
    buffer_bytes: int  # the allowance beside the backward's window
    # per entry of ``order``: the cast copy of its local shard its all-gather makes (none: no casts)
    cast: tuple[int, ...] = ()
    # in_flight's and forward_unit_windows' answers: an estimate asks a few, a plan tens of estimates
    windows: dict = field(default_factory=dict, compare=False, repr=False)


def unit_gathered_bytes(ctx: Context, unit: Unit) -> int:
    """Full bytes of a unit's sharded tensors in the compute dtype, packed NF4 weights in bytes (0 unsharded)."""
    if not ctx.sharded:
        return 0
    # Packed NF4 weights gather as their uint8 bytes (FSDP2's mixed precision casts floats only).
    packed = sum(t.numel for t in unit.base if t.sharded and t.four_bit)
    base, lora = unit.full_sharded_numel()
    return int((base - packed + lora) * ctx.compute_bytes) + packed


def gather_order(ctx: Context, layout: Layout, unit_bytes: tuple[int, ...]) -> tuple[OrderEntry, ...]:
    """The order FSDP2 gathers in: a block's own parameters, then each of its layers'
    nested expert units.

    Entries are (bytes, index of the enclosing entry or None, bytes a prefetch of it
    holds). Prefetching a unit holds its all-gather output until it runs; on a one-rank
    shard group FSDP2 all-gathers nothing and makes the unsharded parameters when the
    unit runs, so a prefetch there holds nothing.
    """
    order: list[OrderEntry] = []
    for own, inner in _own_and_nested(layout, unit_bytes, lambda x: unit_gathered_bytes(ctx, x)):
        outer = len(order)
        order.append((own, None, own if ctx.shard_group > 1 else 0))
        order.extend((b, outer, b if (ctx.expert_group or ctx.shard_group) > 1 else 0) for b in inner)
    return tuple(order)


def _own_and_nested(layout: Layout, unit_values, measure) -> list[tuple[int, list[int]]]:
    """Per unit of ``layout.units`` (``unit_values``: a measure of each, nested units included):
    its own share and each nested expert unit's (``measure`` of it), in gathering order."""
    out = []
    for u, value in zip(layout.units, unit_values):
        inner = [measure(x) for x in layout.nested.get(u.name, ())]
        out.append((value - sum(inner), inner))
    return out


def casts_shards(ctx: Context) -> tuple[bool, bool]:
    """Whether FSDP2 casts the (base, adapter) shards to ``param_dtype`` as it all-gathers them:
    a full fine-tune's fp32 shards, a base stored in another dtype, fp32 adapters; packed NF4
    weights never (mixed precision casts floats only)."""
    fsdp = ctx.fsdp
    if fsdp is None:
        return False, False
    base = "float32" if ctx.full_finetune else ctx.workload.weights_dtype
    return base != fsdp.param_dtype, fsdp.param_dtype != "float32"


def unit_cast_bytes(ctx: Context, unit: Unit, casts: tuple[bool, bool]) -> int:
    """The copy of a unit's local shards in the compute dtype its all-gather makes before copying
    them in (FSDP2's foreach_all_gather: the shards a cast needs, gathered into one flat tensor,
    freed once copied into the all-gather output); 0 on a one-rank shard group, which gathers
    nothing."""
    base, lora = casts
    tensors = [t for t in unit.base if base and not t.four_bit] + [t for t in unit.lora if lora]
    return sum(t.local(ctx.shard_group) for t in tensors if t.sharded) * ctx.compute_bytes


def gather_buffer_bytes(ctx: Context, layout: Layout, unit_bytes: tuple[int, ...], root_bytes: int) -> int:
    """all_gather_overlap x the largest of the embeddings, PLE, head and root units.

    Beside the window of gathered units (the current ones, and the prefetched ones whose
    all-gather output is in flight) the peak holds more FSDP buffers than the window
    counts, if any: this allowance. Fitted on the fp32 dense probes it stood at 0.87 while
    the activations were fitted too; with the activations counted, the fit on the bf16
    dense probes puts it at 0 (shipped). It does not scale with the blocks: MoE probes
    (a tensor-level tracker on 2 and 4 gloo ranks) show no expert- or block-sized buffer
    at the experts' backward, and a dense two-block unit's probe none beyond the
    prefetched embeddings.
    """
    edges = [size for u, size in zip(layout.units, unit_bytes) if not u.name.startswith("blocks.")]
    return int(ctx.coefficients.all_gather_overlap * max(edges + [root_bytes]))


def build_gathered(ctx: Context, layout: Layout, *, casts: bool = True) -> Gathered:
    """The layout's gathered sizes under ``ctx``: made once per layout and what they depend on
    (kept in ``layout.sums``, as the static sums are). ``casts=False``: a model whose shards are
    stored in the compute dtype (a full fine-tune's frozen reference copy), none cast."""
    key = (
        "gathered",
        ctx.sharded,
        ctx.compute_bytes,
        ctx.shard_group > 1,
        (ctx.expert_group or ctx.shard_group) > 1,
        ctx.coefficients.all_gather_overlap,
        casts_shards(ctx) if casts else (False, False),
    )
    found = layout.sums.get(key)
    if found is None:
        found = layout.sums[key] = _build_gathered(ctx, layout, casts)
    return found


def _build_gathered(ctx: Context, layout: Layout, casts: bool) -> Gathered:
    unit_bytes = tuple(unit_gathered_bytes(ctx, u) for u in layout.units)
    root_bytes = unit_gathered_bytes(ctx, layout.root)
    order = gather_order(ctx, layout, unit_bytes)
    return Gathered(
        unit_bytes=unit_bytes,
        root_bytes=root_bytes,
        root_ahead=root_bytes if ctx.shard_group > 1 else 0,
        all_bytes=sum(unit_bytes) + root_bytes,
        order=order,
        largest_bytes=max((b for b, _, _ in order), default=0),
        buffer_bytes=gather_buffer_bytes(ctx, layout, unit_bytes, root_bytes),
        cast=gather_casts(ctx, layout, order) if casts else (),
    )


def gather_casts(ctx: Context, layout: Layout, order: tuple[OrderEntry, ...]) -> tuple[int, ...]:
    """Per entry of the gathering order (:func:`gather_order`), the cast copy its all-gather
    makes (:func:`unit_cast_bytes`; 0 where a prefetch holds nothing: no all-gather)."""
    casts = casts_shards(ctx)
    if not any(casts):
        return ()

    def measure(unit: Unit) -> int:
        return unit_cast_bytes(ctx, unit, casts)

    out = [c for own, inner in _own_and_nested(layout, map(measure, layout.units), measure) for c in (own, *inner)]
    return tuple(c if ahead else 0 for c, (_, _, ahead) in zip(out, order))


def reversed_with_parents(order: tuple[OrderEntry, ...]) -> list[OrderEntry]:
    """Backward order of (bytes, parent index, prefetched bytes) entries: reversed, parents
    re-indexed.

    In backward a block's own unit is gathered first (its pre-backward), then
    its nested units, so each parent moves ahead of its children."""
    groups: list[list[OrderEntry]] = []
    for size, parent, ahead in order:
        if parent is None:
            groups.append([(size, None, ahead)])
        else:
            groups[-1].append((size, parent, ahead))
    out: list[OrderEntry] = []
    for group in reversed(groups):
        head = len(out)
        out.append(group[0])
        out.extend((size, head, ahead) for size, _, ahead in reversed(group[1:]))
    return out


def in_flight(
    ctx: Context, gathered: Gathered, prefetch: int, *, forward: bool, first: bool = True, moment: Moment = "both"
) -> int:
    """The most gathered at once: a unit, its enclosing block, the next ``prefetch``
    units in order, the root and the buffer allowance.

    In forward FSDP2 defers freeing a unit's all-gather output until the next unit's
    copy-out (to overlap the two), so a running unit is held twice; in backward it is
    freed at the copy-out. ``first``: the forward gathers the root too (the first after a
    backward or a generate), and the first unit's copy-out holds the root's all-gather
    output; ``first=False``: generate's steps after its first, which find the root gathered.
    Generate is one forward of the root to FSDP2 (agilerl.distributed.register_forward_method),
    so the root drops the last all-gather output only when generate returns: a step's first
    unit copies out beside the step before's last unit's (an untied head's, or the last
    block's; measured: three head-sized buffers at a 2-rank rollout's peak, the first unit
    twice and the head). ``moment``: a
    forward's units running ("running"), copying out ("copying"), or either ("both"). With
    reshard_after_forward=False every unit stays gathered from its forward to its backward,
    and after a no-grad forward until the next backward (FSDP2 reshards in post-backward only).
    """
    if ctx.fsdp is None:
        return 0
    if not ctx.fsdp.reshard_after_forward:
        return gathered.all_bytes + gathered.buffer_bytes
    key = (prefetch, forward, first, moment)
    found = gathered.windows.get(key)
    if found is None:
        held = _held(gathered, prefetch, forward, root_ahead=gathered.root_ahead if first else _last_ahead(gathered))
        found = max(
            (
                max(running, copying) if moment == "both" else running if moment == "running" else copying
                for _, running, copying in held
            ),
            default=0,
        )
        found += gathered.root_bytes + (0 if forward else gathered.buffer_bytes)
        gathered.windows[key] = found
    return found


def _last_ahead(gathered: Gathered) -> int:
    """The last outer unit's all-gather output (0 on one rank)."""
    return next((ahead for _, parent, ahead in reversed(gathered.order) if parent is None), 0)


def _held(
    gathered: Gathered, prefetch: int, forward: bool, root_ahead: int = 0, *, keep: bool = False
) -> list[tuple[int, int, int]]:
    """For each entry of the gathering order (reversed in backward): the position of its outer
    unit among the outer units, what is gathered while it runs and what at its copy-out (0
    but for an outer unit in forward), the root apart.

    While a unit runs it is held twice in forward (once in backward), with its enclosing
    block and the next ``prefetch`` units in flight. An outer unit's copy-out in forward holds
    it twice beside the unit before's all-gather output, which FSDP2 drops only as the
    copy-out's call returns (``root_ahead`` before the first unit: the root's, which is
    gathered first), and the units the one before prefetched; or, after it, the unit's prefetches
    as it issues them, each beside the cast copy of its local shards (``Gathered.cast``: a full
    fine-tune's fp32 shards; measured on 2 gloo ranks, a two-block unit's rollout read 2.3% low
    without it). A unit copies out and prefetches before its forward has made anything, so both
    are its copy-out moment. In backward a prefetch's cast is freed before the unit's backward
    makes its gradients, which are larger: not counted there. ``keep``: a forward under
    reshard_after_forward=False that gathers its units (the first after a backward): every
    unit that has run stays gathered beside."""
    direction = gathered.order if forward else reversed_with_parents(gathered.order)
    # agilerl.distributed prefetches the next outer units (blocks, embeddings, head);
    # a nested expert unit is gathered when its own forward or backward starts.
    outer = [j for j, (_, parent, _) in enumerate(direction) if parent is None]
    out = []
    before, earlier = root_ahead, 0
    for j, (size, parent, ahead) in enumerate(direction):
        enclosing = earlier if keep else direction[parent][0] if parent is not None else 0
        own = size + enclosing + (ahead if forward else 0)
        earlier += size
        position = bisect.bisect_right(outer, j)
        coming = [direction[i][2] for i in outer[position : position + prefetch]]
        copying = 0
        if forward and parent is None:
            copying = own + before + (sum(coming[: prefetch - 1]) if position > 1 else 0)
            before = ahead
            # Then it prefetches: each all-gather it issues (all of them from the first unit, else
            # the last, the others in flight already) casts its local shards beside its output.
            casts = [gathered.cast[i] if gathered.cast else 0 for i in outer[position : position + prefetch]]
            fresh = range(len(coming)) if position == 1 else range(prefetch - 1, len(coming))
            copying = max([copying] + [own + sum(coming[: i + 1]) + casts[i] for i in fresh])
        out.append((position - 1, own + sum(coming), copying))
    return out


def forward_unit_windows(
    ctx: Context, layout: Layout, gathered: Gathered, *, regathers: bool = False
) -> tuple[tuple[int, int], ...]:
    """Per unit of ``layout.units``, what a forward that gathers the root (a learn forward: the
    backward before resharded it) holds gathered, the root included, while the unit runs and at
    its copy-out (:func:`_held`). With reshard_after_forward=False every unit's both are
    everything, once a forward has gathered them (a learn forward after the step's no-grad
    passes); ``regathers``: this forward is the one gathering them (generate's prefill: the
    step before's backward resharded them), and the units that have run stay beside. Empty
    unsharded."""
    if ctx.fsdp is None:
        return ()
    keep = not ctx.fsdp.reshard_after_forward
    if keep and not regathers:
        return ((gathered.all_bytes, gathered.all_bytes),) * len(layout.units)
    key = ("units", ctx.fsdp.prefetch_units, keep)
    found = gathered.windows.get(key)
    if found is None:
        running, copying = [0] * len(layout.units), [0] * len(layout.units)
        for k, run, copy in _held(gathered, ctx.fsdp.prefetch_units, True, gathered.root_ahead, keep=keep):
            running[k], copying[k] = max(running[k], run), max(copying[k], copy)
        root = gathered.root_bytes
        found = gathered.windows[key] = tuple((r + root, c + root) for r, c in zip(running, copying))
    return found


def forward_layer_windows(
    ctx: Context, layout: Layout, gathered: Gathered, *, regathers: bool = False
) -> tuple[tuple[int, int], ...]:
    """Per layer, the forward's window while the layer runs and, for the first layer of its unit,
    at the unit's copy-out (else 0), from :func:`forward_unit_windows` (``regathers``: as
    there): the last block's unit prefetches the untied lm_head, not another block. Empty
    unsharded."""
    windows = forward_unit_windows(ctx, layout, gathered, regathers=regathers)
    if not windows or ctx.fsdp is None:
        return ()
    units = layout.layer_units
    return tuple((windows[k][0], windows[k][1] if j == 0 or units[j - 1] != k else 0) for j, k in enumerate(units))


def forward_head_window(
    ctx: Context, layout: Layout, gathered: Gathered, *, regathers: bool = False
) -> tuple[int, int]:
    """What a forward holds gathered while an untied lm_head's unit runs and at its copy-out
    ((0, 0) without one, or unsharded; ``regathers``: as :func:`forward_unit_windows`)."""
    windows = forward_unit_windows(ctx, layout, gathered, regathers=regathers)
    return next((w for u, w in zip(layout.units, windows) if u.name == "lm_head"), (0, 0))


def forward_windows(
    ctx: Context, layout: Layout, gathered: Gathered, *, regathers: bool, also_gathered: bool = False
) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
    """:func:`forward_layer_windows` and :func:`forward_head_window` of a forward that
    ``regathers`` or not; with ``also_gathered``, the larger of that and a forward finding every
    unit gathered (the later micro-batches of a pass after a first that regathered)."""
    layers = forward_layer_windows(ctx, layout, gathered, regathers=regathers)
    head = forward_head_window(ctx, layout, gathered, regathers=regathers)
    if regathers and also_gathered:
        others = forward_layer_windows(ctx, layout, gathered)
        layers = tuple((max(a, c), max(b, d)) for (a, b), (c, d) in zip(layers, others))
        gathered_head = forward_head_window(ctx, layout, gathered)
        head = (max(head[0], gathered_head[0]), max(head[1], gathered_head[1]))
    return layers, head


def backward_gathered_bytes(ctx: Context, gathered: Gathered) -> int:
    """The backward's window with ``backward_prefetch_units`` prefetched."""
    return in_flight(ctx, gathered, ctx.fsdp.backward_prefetch_units if ctx.fsdp else 0, forward=False)


def backward_layer_windows(ctx: Context, layout: Layout, gathered: Gathered) -> tuple[int, ...]:
    """Per layer, the backward's window while that layer runs backward or recomputes (empty
    unsharded): :func:`backward_gathered_bytes` at every layer, but under
    reshard_after_forward=False the units not yet through their backward. The forward left every
    unit gathered, so the backward gathers none, and FSDP2 reshards each unit in its
    post-backward: layer j's unit holds the root, itself and the units before it in forward order,
    with the buffer allowance (measured on 2 gloo ranks: counted with every unit, a learn phase
    peaking at a block's backward read 8.6% high)."""
    if ctx.fsdp is None:
        return ()
    if ctx.fsdp.reshard_after_forward:
        return (backward_gathered_bytes(ctx, gathered),) * ctx.spec.num_layers
    before = _units_before(gathered)
    return tuple(gathered.root_bytes + before[k + 1] + gathered.buffer_bytes for k in layout.layer_units)


def _units_before(gathered: Gathered) -> tuple[int, ...]:
    """Entry k: the bytes of the units before unit k in forward order (one entry more than units)."""
    return (0, *itertools.accumulate(gathered.unit_bytes))


@dataclass(frozen=True, slots=True)
class PostBackwardWindows:
    """What stays gathered while the backward's units reduce-scatter, and at its end."""

    head: int  # a trained untied lm_head unit's post-backward (its gradients reduce-scattered)
    block: int  # a block unit's post-backward as it starts, the widest
    block_reducing: tuple[int, ...]  # each block unit's as it reduce-scatters, its own copy resharded
    end: int  # the backward's end, every gradient made (the embeddings' as it is made)


def post_backward_windows(ctx: Context, layout: Layout, gathered: Gathered) -> PostBackwardWindows:
    """The windows of a unit's post-backward and of the backward's end:
    :func:`backward_gathered_bytes`, but under reshard_after_forward=False FSDP2 reshards a unit
    in its post-backward before it reduce-scatters (FSDPParamGroup.post_backward), and the units
    after it in forward order have already done so. The head's reduce-scatter holds the root and
    the units before the head; a block unit's, the root and the units before its own (the last
    block's the widest), with the buffer allowance; the backward's end, the root and the units
    before the first block (an embeddings unit), and the first block's too without trained
    embeddings: a unit's post-backward hook fires once a gradient reaches its input (measured on
    2 gloo ranks: a full fine-tune peaking at its untied head's reduce-scatter, counted with every
    unit gathered, read 4.6% high). Resharded after forward, a block unit's post-backward starts
    under the backward's window and reshards its own copy before it reduce-scatters, when the
    units its pre-backward prefetched (the ``backward_prefetch_units`` before it in forward order)
    hold their all-gather outputs beside the root (traced on 2 gloo ranks: two-block units of a
    full fine-tune, counted under the backward's window, learn read 7.4% high). The head's unit
    reduce-scatters nothing there (planner.memory._static.trainer_gathers_head): no window."""
    if ctx.fsdp is None:
        return PostBackwardWindows(0, 0, (), 0)
    first, count = layout.layer_units[0], len(layout.block_units)  # block units are consecutive
    if ctx.fsdp.reshard_after_forward:
        window = backward_gathered_bytes(ctx, gathered)
        outer = [ahead for _, parent, ahead in gathered.order if parent is None]  # per unit of layout.units
        prefetch = ctx.fsdp.backward_prefetch_units
        reducing = tuple(
            gathered.root_bytes + gathered.buffer_bytes + sum(outer[max(0, k - prefetch) : k])
            for k in range(first, first + count)
        )
        # the backward's end: every block unit resharded, beside the root the units the first block's
        # pre-backward prefetched (untied: the embeddings'), as at its reduce-scatter (traced on 2 gloo
        # ranks: a tied full fine-tune's root alone)
        return PostBackwardWindows(0, window, reducing, reducing[0])
    through = _units_before(gathered)
    last = layout.layer_units[-1]
    # Without trained embeddings the first block's input needs no gradient, so no hook reshards its
    # unit: the root's final callback does, after the backward.
    end = first if ctx.full_finetune else first + 1
    root = gathered.root_bytes
    block = root + through[last] + gathered.buffer_bytes
    return PostBackwardWindows(
        head=root + through[last + 1],
        block=block,
        # each block unit's own resharded, the ones after it resharded in their post-backwards
        block_reducing=tuple(root + through[k] + gathered.buffer_bytes for k in range(first, first + count)),
        end=root + through[end] + gathered.buffer_bytes,
    )


def nograd_gathered_bytes(ctx: Context, gathered: Gathered, *, first: bool = True, moment: Moment = "both") -> int:
    """A no-grad forward's window (generation, the reference pass) with ``prefetch_units``
    prefetched. ``first`` and ``moment``: as :func:`in_flight` (generate's steps after the
    first find the root gathered; a unit copies out before its forward has made anything).

    With reshard_after_forward=False: everything, and in generate's steps after the first also
    the last unit's all-gather output from the first: generate is one root forward
    (:func:`in_flight`), and no later step gathers, so no copy-out drops it until generate
    returns (measured: every unit and a second head at a 4-rank rollout's peak)."""
    if ctx.fsdp is None:
        return 0
    if not ctx.fsdp.reshard_after_forward:
        return gathered.all_bytes + (0 if first else _last_ahead(gathered))
    return in_flight(ctx, gathered, ctx.fsdp.prefetch_units, forward=True, first=first, moment=moment)


def after_forward_bytes(ctx: Context, gathered: Gathered) -> int:
    """Gathered after a forward: the root stays gathered; with reshard_after_forward=False every unit."""
    if ctx.fsdp is None:
        return 0
    if not ctx.fsdp.reshard_after_forward:
        return gathered.all_bytes
    return gathered.root_bytes


def model_head_backward_bytes(ctx: Context, gathered: Gathered) -> int:
    """Gathered while the model's own one-position head runs backward (it is in the graph): what
    the forward left (:func:`after_forward_bytes`), and under reshard_after_forward the last
    unit's all-gather output. Its logits are the root's output, and their gradient's hook fires
    the root's pre-backward as that head's backward starts (after the chunked head's, whose
    nodes autograd made later and runs first): its implicit prefetch all-gathers the unit that
    ran forward last (the last block). Traced on 2 gloo ranks: a tied full fine-tune peaking
    there read 2.2% low without it (one block)."""
    found = after_forward_bytes(ctx, gathered)
    if ctx.fsdp is not None and ctx.fsdp.reshard_after_forward:
        found += _last_ahead(gathered)
    return found


def between_steps_bytes(ctx: Context, gathered: Gathered) -> int:
    """Gathered between generate's forwards, while it samples: what a forward leaves
    (:func:`after_forward_bytes`) and the last unit's all-gather output, which FSDP2 drops only
    at the next forward's first copy-out (:func:`in_flight`)."""
    if ctx.fsdp is None:
        return 0
    return after_forward_bytes(ctx, gathered) + _last_ahead(gathered)
