"""Tensors as FSDP sees them on one rank, and the FSDP units agilerl.distributed wraps.

FSDP2 gives rank i rows ``[i*ceil(d/S), (i+1)*ceil(d/S))`` of every sharded tensor, so rank 0
holds the largest shards. Units run in the order agilerl.distributed.fsdp_units gives (the
runtime's own): the embeddings (unless tied), the per-layer embeddings, the blocks
(``wrap_every_n_blocks`` layers each), the lm_head; the root holds the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agilerl.distributed import fsdp_units

from ..spec import is_per_layer_embedding
from ._context import Context
from ._parallel import COLWISE, ROWWISE, is_packed_expert, tp_dim


@dataclass(frozen=True, slots=True)
class Tensor:
    """One rank's piece before FSDP: ``rows`` x ``rest`` elements (``numel``)."""

    rows: int
    rest: int
    numel: int
    sharded: bool
    group: int | None = None  # ranks its FSDP shard spans, when not the dense mesh's (experts under EP)
    four_bit: bool = False  # QLoRA: a linear's packed NF4 weight, numel bytes (two values per byte)

    def local(self, shards: int) -> int:
        """Elements rank 0 holds: ceil(rows / shards) rows when sharded, all of them otherwise."""
        if not self.sharded:
            return self.numel
        return math.ceil(self.rows / (self.group or shards)) * self.rest


def make_tensor(
    shape: tuple[int, ...],
    threshold: float,
    *,
    tp: int = 1,
    tp_dim: int | None = None,
    ep: int = 1,
    ep_dim: int | None = None,
    group: int | None = None,
    four_bit: bool = False,
) -> Tensor:
    """A tensor as FSDP sees it on one rank: split by tensor parallelism along ``tp_dim``, or
    by expert parallelism along ``ep_dim`` (then FSDP-sharded over ``group`` ranks), first.

    The persistence threshold applies to the global size (a TP DTensor's numel); expert
    parameters always shard (agilerl.distributed keeps them on the expert mesh).
    """
    numel = 1
    for d in shape:
        numel *= d
    local = list(shape) or [1]
    if tp > 1 and tp_dim is not None:
        local[tp_dim] = -(-local[tp_dim] // tp)
    if ep_dim is not None:
        local[ep_dim] //= ep
    rest = 1
    for d in local[1:]:
        rest *= d
    if four_bit:  # bitsandbytes packs [out, in] into [out x in / 2, 1] uint8, which FSDP2 shards by rows
        packed = local[0] * rest // 2
        return Tensor(rows=packed, rest=1, numel=packed, sharded=numel // 2 >= threshold, four_bit=True)
    return Tensor(
        rows=local[0], rest=rest, numel=local[0] * rest, sharded=ep_dim is not None or numel >= threshold, group=group
    )


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    base: tuple[Tensor, ...] = ()
    lora: tuple[Tensor, ...] = ()

    def full_sharded_numel(self) -> tuple[int, int]:
        """Elements of the unit's sharded (base, LoRA) tensors, unsharded."""
        return (sum(t.numel for t in self.base if t.sharded), sum(t.numel for t in self.lora if t.sharded))


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """One layer's tensors (equal for every layer of a block type)."""

    base: tuple[Tensor, ...]  # in the spec's order, packed experts included
    lora: tuple[Tensor, ...]  # A then B of each adapter, once per adapter copy
    expert_base: tuple[Tensor, ...]  # the packed routed experts
    expert_lora: tuple[Tensor, ...]  # their adapters
    expert_down: int  # elements of the down_proj stack on one EP rank


@dataclass(frozen=True, slots=True)
class Layout:
    """Every tensor of the model on rank 0, grouped in FSDP units."""

    units: tuple[Unit, ...]  # in forward order, the root apart
    root: Unit
    embed: Tensor
    head: Tensor | None
    nested: dict[str, tuple[Unit, ...]]  # block unit name -> its expert units (ep > 1)
    base_tensors: tuple[Tensor, ...]
    lora_tensors: tuple[Tensor, ...]
    block_units: tuple[Unit, ...]
    layer_units: tuple[int, ...]  # per layer: the index in ``units`` of the block unit holding it
    expert_stack: tuple[int, ...]  # per layer: elements of its routed experts on one EP rank
    expert_down: tuple[int, ...]  # per layer: elements of its down_proj stack on one EP rank
    expert_adapters: tuple[int, ...]  # per layer: elements of its experts' adapters on one EP rank
    expert_adapter_factor: tuple[int, ...]  # per layer: elements of the largest of those factors
    # sums over its tensors, by what they depend on (planner.memory._static): made once per layout
    sums: dict = field(default_factory=dict, compare=False, repr=False)


def layer_tensors(ctx: Context, index: int) -> LayerTensors:
    """One layer's tensors on rank 0, as agilerl.distributed splits them before FSDP shards
    them (built once per block type)."""
    threshold, tp, ep, r = ctx.persistence_threshold, ctx.tp, ctx.ep, ctx.lora_rank
    packed, group = ctx.packed[index], ctx.expert_group
    base: list[Tensor] = []
    lora: list[Tensor] = []
    expert_base: list[Tensor] = []
    expert_lora: list[Tensor] = []
    expert_down = 0
    block = ctx.spec.block(index)
    four_bit = ctx.workload.load_in_4bit
    for name, shape in block.tensors:
        if packed and is_packed_expert(name, shape):  # [E, ., .]: split by ep, FSDP over world / ep
            t = make_tensor(shape, threshold, ep=ep, ep_dim=0, group=group)
            expert_base.append(t)
            if name.endswith("down_proj"):
                expert_down += t.numel
        else:
            # A MoE block splits its attention only (agilerl.distributed._tp).
            split = not packed or name.startswith("self_attn.")
            # QLoRA's NF4 weights: the plain linears transformers' bitsandbytes loader replaces.
            nf4 = four_bit and name in block.four_bit
            t = make_tensor(shape, threshold, tp=tp, tp_dim=tp_dim(name) if split else None, four_bit=nf4)
        base.append(t)
    for name, (a_rows, a_cols, b_rows, b_cols) in zip(ctx.lora_names[index], ctx.lora_shapes[index]):
        if packed and is_packed_expert(name):  # A (r E, in) by its rows, B (out, r E) by its columns
            pair = (
                make_tensor((r * a_rows, a_cols), threshold, ep=ep, ep_dim=0, group=group),
                make_tensor((b_rows, r * b_cols), threshold, ep=ep, ep_dim=1, group=group),
            )
            expert_lora.extend(pair * ctx.num_adapters)
        else:
            # colwise base: B split on its output; rowwise: A on its input
            module = name.rsplit(".", 1)[-1]
            lora_tp = tp if not packed or name.startswith("self_attn.") else 1
            pair = (
                make_tensor((r * a_rows, a_cols), threshold, tp=lora_tp, tp_dim=1 if module in ROWWISE else None),
                make_tensor((b_rows, r * b_cols), threshold, tp=lora_tp, tp_dim=0 if module in COLWISE else None),
            )
        lora.extend(pair * ctx.num_adapters)
    return LayerTensors(tuple(base), tuple(lora), tuple(expert_base), tuple(expert_lora), expert_down)


def _outside_blocks(ctx: Context) -> tuple[Unit, Tensor, Tensor | None, tuple[Tensor, ...]]:
    """The root unit, the embedding and lm_head tensors, and the per-layer embedding tables
    that are units of their own (under FSDP; otherwise they stay in the root)."""
    spec, threshold, r = ctx.spec, ctx.persistence_threshold, ctx.lora_rank
    embed = make_tensor(spec.embed_shape, threshold)
    head = make_tensor(spec.lm_head_shape, threshold) if spec.lm_head_shape else None
    four_bit = ctx.workload.load_in_4bit
    root_base = [
        make_tensor(s, threshold, four_bit=four_bit and name in spec.root_four_bit)
        for name, s in spec.root_tensors
        if not is_per_layer_embedding(name)
    ]
    root_lora: list[Tensor] = []
    outside = () if ctx.full_finetune else spec.lora_outside_blocks.get(ctx.lora_key, ())
    for _, a_rows, a_cols, b_rows, b_cols in outside:
        for _ in range(ctx.num_adapters):  # adapted linears outside the blocks (Gemma-3n's AltUp projections)
            root_lora.append(make_tensor((r * a_rows, a_cols), threshold))
            root_lora.append(make_tensor((b_rows, r * b_cols), threshold))
    if spec.tie_word_embeddings:
        root_base.append(embed)
    ple = tuple(make_tensor(s, threshold) for name, s in spec.root_tensors if is_per_layer_embedding(name))
    if not ctx.sharded:
        root_base.extend(ple)
        ple = ()
    return Unit("root", base=tuple(root_base), lora=tuple(root_lora)), embed, head, ple


#: Layouts by what they depend on (:func:`_layout_key`): a plan asks tens of estimates that differ
#: only in batch, chunk or checkpointing, and an 80-layer layout is hundreds of tensor records.
_LAYOUTS: dict[tuple, tuple[object, Layout]] = {}


def _layout_key(ctx: Context) -> tuple:
    fsdp = ctx.fsdp
    return (
        id(ctx.spec),
        ctx.ep,
        ctx.tp,
        ctx.lora_rank,
        ctx.lora_key,
        ctx.num_adapters,
        ctx.persistence_threshold,
        ctx.full_finetune,
        ctx.expert_group,
        ctx.sharded,
        ctx.workload.load_in_4bit,
        fsdp.wrap_every_n_blocks if fsdp else 1,
    )


def build_layout(ctx: Context) -> Layout:
    """The FSDP units of the model in forward order (made once per spec and sharding, then reused).

    Under FSDP with ep > 1 each layer's packed experts are a unit nested in its block's
    (also counted there); with ep=1 agilerl.distributed shards the experts inside their
    block's unit.
    """
    key = _layout_key(ctx)
    cached = _LAYOUTS.get(key)
    if cached is not None and cached[0] is ctx.spec:
        return cached[1]
    layout = _build_layout(ctx)
    if len(_LAYOUTS) >= 256:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (ctx.spec, layout)  # the spec kept alive with it, so its id is not reused meanwhile
    return layout


def _build_layout(ctx: Context) -> Layout:
    spec = ctx.spec
    root, embed, head, ple = _outside_blocks(ctx)
    by_type = {i: layer_tensors(ctx, i) for i in ctx.distinct_layers}
    layers = [by_type[i] for i in ctx.representative]
    parts = fsdp_units(
        spec.num_layers,
        ctx.fsdp.wrap_every_n_blocks if ctx.fsdp else 1,
        separate_embedding=not spec.tie_word_embeddings,
        per_layer_embeddings=len(ple),
        separate_head=head is not None,
    )
    units: list[Unit] = []
    nested: dict[str, tuple[Unit, ...]] = {}
    layer_units = [0] * spec.num_layers
    for part in parts:
        if part.kind != "blocks":
            tensor = {"embed": embed, "head": head}.get(part.kind) or ple[part.start]
            units.append(Unit(part.name, base=(tensor,)))
            continue
        members = range(part.start, part.stop)
        for i in members:
            layer_units[i] = len(units)
        unit = Unit(
            part.name,
            base=tuple(t for i in members for t in layers[i].base),
            lora=tuple(t for i in members for t in layers[i].lora),
        )
        units.append(unit)
        nested[unit.name] = (
            tuple(
                Unit(f"blocks.{i}.experts", layers[i].expert_base, layers[i].expert_lora)
                for i in members
                if ctx.packed[i]
            )
            if ctx.ep > 1
            else ()
        )
    all_units = [*units, root]
    return Layout(
        units=tuple(units),
        root=root,
        embed=embed,
        head=head,
        nested=nested,
        base_tensors=tuple(t for u in all_units for t in u.base),
        lora_tensors=tuple(t for u in all_units for t in u.lora),
        block_units=tuple(u for u in units if u.name.startswith("blocks.")),
        layer_units=tuple(layer_units),
        expert_stack=tuple(sum(t.numel for t in layer.expert_base) for layer in layers),
        expert_down=tuple(layer.expert_down for layer in layers),
        expert_adapters=tuple(sum(t.numel for t in layer.expert_lora) for layer in layers),
        expert_adapter_factor=tuple(max((t.numel for t in layer.expert_lora), default=0) for layer in layers),
    )
