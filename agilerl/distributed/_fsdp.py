"""apply_fsdp2: shard a Hugging Face causal LM with FSDP2 as an FSDPConfig says.

Unit layout, in forward order (the order prefetching follows):

    [embeddings] -> [per-layer embeddings] -> [blocks 0..n-1, ``wrap_every_n_blocks`` per unit]
    -> [untied lm_head] -> root

Per-layer embeddings (PLE, Gemma-3n's ``embed_tokens_per_layer``: a
vocabulary x (layers x per-layer width) table, often larger than the main
embeddings) are a unit of their own, gathered only while they are looked up,
rather than part of the root, which stays gathered for the whole forward.

Tied embeddings stay in the root unit together with the lm_head that shares
their weight (a parameter can belong to one FSDP unit only). The root unit owns
everything else: final norm, rotary buffers, PEFT wrappers. ``reshard_after_forward``
applies to every unit but the root, which stays gathered from its forward to its
backward (FSDP2's default for a root).

Parameters with fewer than ``param_persistence_threshold`` elements are passed
to ``fully_shard`` as ``ignored_params`` and stay replicated plain tensors
(docs/runtime.md). FSDP then neither syncs their gradients nor casts them
for mixed precision, so this module adds both: a post-backward callback
averages their gradients wherever FSDP would reduce-scatter (honouring
``set_requires_gradient_sync``), and each FSDP unit's forward computes with
``param_dtype`` casts of the replicated parameters inside it, as FSDP does for
its own (see :class:`_ReplicatedCast`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from ._blocks import block_kind, find_transformer_blocks, unwrap_checkpointed
from ._config import FSDPConfig
from ._moe import (
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    MoELayout,
    apply_expert_parallel,
    build_expert_mesh,
    checkpoint_moe_block,
    expert_modules,
    find_moe_layers,
    fully_shard_experts,
    install_router_forwards,
    is_moe_block,
    model_experts_problem,
)
from ._plan import fsdp_units
from ._runtime import (
    all_reduce_grads,
    device_mesh,
    get_world_size,
    rank_group,
    require_process_group,
)
from ._tp import apply_tensor_parallel

__all__ = [
    "apply_fsdp2",
    "apply_activation_checkpointing",
    "find_transformer_blocks",
    "block_kind",
    "torch_dtype",
    "FSDPLayout",
    "fsdp_layout",
    "expert_parallel",
    "set_gradient_sync",
    "rebind_replicated_params",
    "register_forward_method",
]

_CKPT_PREFIX = "_checkpoint_wrapped_module."


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an FSDPConfig dtype name."""
    return getattr(torch, name)


#: Attribute names of per-layer embedding tables (PLE) that shard as their own unit.
PER_LAYER_EMBEDDINGS = ("embed_tokens_per_layer",)


def find_per_layer_embeddings(model: nn.Module) -> list[nn.Module]:
    """The model's per-layer embedding tables (Gemma-3n's ``embed_tokens_per_layer``), outermost first."""
    found, seen = [], set()
    for _, module in model.named_modules():
        for attr in PER_LAYER_EMBEDDINGS:
            table = getattr(module, attr, None)
            if isinstance(table, nn.Module) and id(table) not in seen:
                seen.add(id(table))
                found.append(table)
    return found


def _embeddings_and_head(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, bool]:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    # PEFT may wrap the head (modules_to_save); its weight is still the tie test.
    tied = (
        embed is not None
        and head is not None
        and getattr(head, "weight", None) is not None
        and head.weight is getattr(embed, "weight", None)
    )
    return embed, head, tied


def apply_activation_checkpointing(model: nn.Module, config: FSDPConfig) -> list[int]:
    """Wrap the blocks ``config`` selects with non-reentrant ``checkpoint_wrapper``.

    Blocks whose kind is in ``checkpoint_skip_layer_types`` are left out; of the
    rest, one in every ``checkpoint_every_n_blocks`` (the first, then every n-th)
    is wrapped. Returns the wrapped block indices. Idempotent.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    container, blocks = find_transformer_blocks(model)
    kinds = [block_kind(b) for b in blocks]
    unknown = set(config.checkpoint_skip_layer_types) - set(kinds)
    if unknown:
        raise ValueError(
            f"checkpoint_skip_layer_types names block kinds this model does not have: "
            f"{sorted(unknown)}; its blocks are of kinds {sorted(set(kinds))}"
        )
    eligible = [i for i, k in enumerate(kinds) if k not in config.checkpoint_skip_layer_types]
    chosen = eligible[:: config.checkpoint_every_n_blocks]
    for i in chosen:
        if isinstance(container[i], CheckpointWrapper):
            continue
        if is_moe_block(container[i]):  # the recompute reuses the forward's routing
            container[i] = checkpoint_moe_block(container[i])
        else:
            container[i] = checkpoint_wrapper(container[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if any(is_moe_block(blocks[i]) for i in chosen):
        install_router_forwards(model)  # out-of-place top-k renormalisation, replayable
    if chosen and not getattr(model, "_agilerl_cache_off_in_training", False):
        model.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
        setattr(model, "_agilerl_cache_off_in_training", True)  # noqa: B010 (an nn.Module attribute)
    return chosen


def _no_cache_while_training(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A checkpointed block's recompute would append its keys and values to the forward's
    cache a second time: a forward with grad that leaves ``use_cache`` unset runs without one,
    as Hugging Face's own gradient checkpointing does. An explicit ``use_cache`` is kept."""
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is None:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


@dataclass
class FSDPLayout:
    """What apply_fsdp2 built: read by the trainer, the probe and the tests."""

    config: FSDPConfig
    units: list[FSDPModule] = field(default_factory=list)  # forward order, root excluded
    unit_names: list[str] = field(default_factory=list)
    root: FSDPModule | None = None
    replicated_params: list[nn.Parameter] = field(default_factory=list)
    replicated_names: list[str] = field(default_factory=list)
    checkpointed_blocks: list[int] = field(default_factory=list)
    mesh: DeviceMesh | None = None
    expert_units: list[FSDPModule] = field(default_factory=list)  # experts on expert_mesh
    expert_mesh: DeviceMesh | None = None  # (expert_shard, ep) under ep > 1
    moe: MoELayout | None = None  # what apply_expert_parallel did (None: experts untouched)
    num_replicated_grad_syncs: int = 0  # explicit all-reduces of replicated grads so far
    root_cast: Any = None  # the root unit's replicated-parameter casts (see register_forward_method)
    dp_group: Any = None  # with tp > 1: the data-parallel group replicated gradients are averaged over
    grad_sync_handles: list[Any] = field(default_factory=list)  # the replicated gradients' hooks


def fsdp_layout(model: nn.Module) -> FSDPLayout | None:
    """The layout apply_fsdp2 recorded on ``model`` (None if it was not sharded)."""
    return getattr(model, "_agilerl_fsdp_layout", None)


def expert_parallel(model: nn.Module):
    """(MoE layout, EP process group) when ``model``'s experts are split by expert parallelism,
    else (None, None): what the state dicts, the optimizer's clipping and the trainer read."""
    layout = fsdp_layout(model)
    if layout is None or layout.moe is None or layout.moe.ep == 1 or layout.expert_mesh is None:
        return None, None
    return layout.moe, layout.expert_mesh["ep"].get_group()


def _grad_sync_enabled(layout: FSDPLayout) -> bool:
    # FSDP2 keeps set_requires_gradient_sync's state on each unit's param group.
    for module in [*layout.units, layout.root]:
        if module is None:
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            return bool(group.reduce_grads)
    return True


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off for the next backward passes.

    FSDP2 units skip their reduce-scatter (holding unsharded gradients) and the
    replicated parameters skip their all-reduce. No-op for an unsharded model.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled, recurse=True)


def rebind_replicated_params(model: nn.Module) -> None:
    """Re-resolve the replicated parameters by name and re-install their hooks.

    ``to_empty`` (materialising a meta model) replaces parameters FSDP does not
    manage with new objects; hooks registered on the old ones would be lost
    and replicated gradients would silently stop being averaged.
    """
    layout = fsdp_layout(model)
    if layout is None or not layout.replicated_names:
        return
    by_name = dict(model.named_parameters(remove_duplicate=False))
    layout.replicated_params = [by_name[n] for n in layout.replicated_names]
    _install_replicated_grad_sync(layout)


def _rank_group_pg():
    scope = rank_group()
    return scope.group if scope is not None else None


def _install_replicated_grad_sync(layout: FSDPLayout) -> None:
    for handle in layout.grad_sync_handles:
        handle.remove()
    layout.grad_sync_handles = []
    trainable = [p for p in layout.replicated_params if p.requires_grad]
    # Replicated across tensor-parallel ranks, a parameter already has the same gradient on
    # every rank of a TP group: average over the data-parallel ranks only.
    group = layout.dp_group if layout.dp_group is not None else _rank_group_pg()
    if not trainable or dist.get_world_size(group) == 1:
        return
    queued = {"flag": False}

    def _average() -> None:
        queued["flag"] = False
        if _grad_sync_enabled(layout):
            all_reduce_grads(trainable, group=group)
            layout.num_replicated_grad_syncs += 1

    def _hook(_param: torch.Tensor) -> None:
        if not queued["flag"]:
            queued["flag"] = True
            torch.autograd.Variable._execution_engine.queue_callback(_average)

    for p in trainable:
        layout.grad_sync_handles.append(p.register_post_accumulate_grad_hook(_hook))


class _ReplicatedCast:
    """Compute with ``param_dtype`` copies of the replicated parameters of one FSDP unit.

    FSDP casts the parameters it manages for a whole unit at the unit's
    pre-forward, so code inside the unit reads them in the compute dtype (PEFT,
    for one, casts its input to ``lora_A.weight.dtype`` before calling
    ``lora_A``). The replicated parameters are swapped at the same boundary:
    each is replaced, on every module that registers it, by a differentiable
    cast of itself (gradients still accumulate on the fp32 leaf) and put back
    after the unit's forward.
    """

    def __init__(self, owners: list[list[tuple[nn.Module, str]]], dtype: torch.dtype) -> None:
        # Places only, never parameter objects: materialising a meta model (to_empty)
        # replaces the replicated parameters, so the live one is looked up each time.
        self.owners = owners
        self.dtype = dtype
        self.depth = 0
        self.swapped: list[tuple[list[tuple[nn.Module, str]], nn.Parameter]] = []

    def enter(self, *_args: Any) -> None:
        self.depth += 1
        if self.depth > 1:  # re-entrant (a unit called inside itself)
            return
        self.swapped = []
        for places in self.owners:
            module, name = places[0]
            param = module._parameters.get(name)
            if param is None:
                continue
            cast = param.to(self.dtype)
            for owner, owner_name in places:
                owner._parameters.pop(owner_name, None)
                owner.__dict__[owner_name] = cast
            self.swapped.append((places, param))

    def exit(self, *_args: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth:
            return
        for places, param in self.swapped:
            for module, name in places:
                module.__dict__.pop(name, None)
                module._parameters[name] = param
        self.swapped = []

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(lambda mod, args: self.enter(), prepend=True)
        module.register_forward_hook(lambda mod, args, out: self.exit(), always_call=True)


def _install_replicated_casts(
    model: nn.Module, layout: FSDPLayout, ignored: set, dtype: torch.dtype, containers_in_order: list[nn.Module]
) -> None:
    """Group the replicated parameters needing a cast by the unit they sit in, hook each unit.

    ``containers_in_order``: every transformer block (unwrapped: checkpoint
    recompute calls the inner block, so its hooks fire in backward too; a block
    whose parameters are all replicated is no FSDP unit at all), the embeddings
    and the head; anything else belongs to the root.
    """
    names = {id(m): n for n, m in model.named_modules()}
    unit_modules = [unwrap_checkpointed(m) for m in containers_in_order]
    prefixes = sorted(((names[id(m)], m) for m in unit_modules), key=lambda x: -len(x[0]))
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None and p in ignored and p.is_floating_point() and p.dtype != dtype:
                places.setdefault(id(p), []).append((module, pname))

    def container_of(module: nn.Module) -> nn.Module:
        owner_name = names[id(module)]
        return next((m for prefix, m in prefixes if owner_name == prefix or owner_name.startswith(prefix + ".")), model)

    groups: dict[int, list[list[tuple[nn.Module, str]]]] = {}
    containers: dict[int, nn.Module] = {}
    for owner_list in places.values():
        found = {id(c): c for c in (container_of(module) for module, _ in owner_list)}
        # a parameter several containers share (a tied embedding and head) is cast for the root's
        # whole forward: cast around the first alone, the head would read it uncast after it
        container = next(iter(found.values())) if len(found) == 1 else model
        groups.setdefault(id(container), []).append(owner_list)
        containers[id(container)] = container
    casts = []
    for cid, owners in groups.items():
        cast = _ReplicatedCast(owners, dtype)
        cast.install(containers[cid])
        casts.append((containers[cid], cast))
    layout.root_cast = next((c for m, c in casts if m is model), None)


def register_forward_method(model: nn.Module, method_name: str) -> None:
    """Run ``model.<method_name>`` (e.g. ``generate``) with FSDP's root hooks, like ``forward``.

    FSDP2's ``register_fsdp_forward_method`` plus the root unit's casts of
    replicated parameters, which a method other than ``forward`` would skip.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, method_name)
    layout = fsdp_layout(model)
    cast = getattr(layout, "root_cast", None) if layout is not None else None
    if cast is None:
        return
    method = getattr(model, method_name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cast.enter()
        try:
            return method(*args, **kwargs)
        finally:
            cast.exit()

    setattr(model, method_name, wrapped)


def _mesh_for(config: FSDPConfig, mesh: DeviceMesh | None, device_type: str) -> DeviceMesh:
    if mesh is not None:
        if config.tp > 1 and (mesh.mesh_dim_names != ("dp", "tp") or mesh.size(1) != config.tp):
            raise ValueError(f"with tp={config.tp} the mesh must have dims ('dp', 'tp') with tp innermost")
        return mesh
    shape, names = config.dims(get_world_size()).fsdp_mesh()
    return device_mesh(device_type, shape, names)


def _apply_moe(
    model: nn.Module, config: FSDPConfig, expert_mesh: DeviceMesh | None, device_type: str
) -> tuple[MoELayout | None, DeviceMesh | None]:
    """Expert parallel (ep > 1), or chunked local experts (a chunk size set); else nothing.

    Returns the MoE layout and the mesh for the experts' FSDP units (None: they
    shard inside their block on the dense mesh, as before).
    """
    has_moe = bool(find_moe_layers(model))
    if has_moe and (config.ep > 1 or config.routed_expert_chunk_mib is not None):
        problem = model_experts_problem(model)
        if problem is not None:
            raise ValueError(problem)
    if config.ep == 1:
        if expert_mesh is not None and has_moe and expert_mesh.size() != get_world_size():
            raise ValueError("with ep=1, expert_mesh must span every rank")
        moe = None
        if has_moe and config.routed_expert_chunk_mib is not None:
            moe = apply_expert_parallel(
                model,
                None,
                ep_token_blocks=config.ep_token_blocks,
                routed_expert_chunk_mib=config.routed_expert_chunk_mib,
            )
        return moe, expert_mesh if has_moe else None
    if not has_moe:
        raise ValueError(
            f"FSDPConfig.ep={config.ep} needs packed MoE experts; {type(model).__name__} has none. Use ep=1."
        )
    if expert_mesh is None:
        expert_mesh = build_expert_mesh(ep=config.ep, device_type=device_type)
    names = tuple(expert_mesh.mesh_dim_names or ())
    if names != (EXPERT_SHARD_AXIS, EP_AXIS) or expert_mesh[EP_AXIS].size() != config.ep:
        raise ValueError(
            f"expert_mesh must be build_expert_mesh(ep={config.ep}): dims "
            f"({EXPERT_SHARD_AXIS!r}, {EP_AXIS!r}) with an ep axis of {config.ep}"
        )
    moe = apply_expert_parallel(
        model,
        expert_mesh[EP_AXIS],
        ep_token_blocks=config.ep_token_blocks,
        routed_expert_chunk_mib=config.routed_expert_chunk_mib,
    )
    return moe, expert_mesh


def apply_fsdp2(
    model: nn.Module,
    config: FSDPConfig | None = None,
    mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2: blocks, embeddings, untied lm_head, root, prefetch.

    Parameters become DTensors in place, so any optimizer must be (re)built
    after this call. ``model`` may live on CPU or the meta device (then fill it
    with :func:`materialize_fsdp2_from_cpu_state`). ``mesh`` overrides the mesh
    built from ``config.shard_group_size``; ``expert_mesh`` is used for packed
    expert modules (none exist in dense models).
    """
    require_process_group("apply_fsdp2")
    config = config if config is not None else FSDPConfig()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = _mesh_for(config, mesh, device_type)
    moe, expert_mesh = _apply_moe(model, config, expert_mesh, device_type)

    shard_mesh = mesh
    if config.tp > 1:
        # TP first (DTensors over "tp"); FSDP then shards those over "dp" (2-D, as torchtitan).
        apply_tensor_parallel(model, mesh["tp"])
        shard_mesh = mesh["dp"]
    layout = FSDPLayout(config=config, mesh=mesh, moe=moe)
    if expert_mesh is not None:
        layout.expert_mesh = expert_mesh
        expert_mesh = expert_mesh[EXPERT_SHARD_AXIS] if expert_mesh.ndim == 2 else expert_mesh
    layout.dp_group = shard_mesh.get_group() if config.tp > 1 else None
    if gradient_checkpointing:
        layout.checkpointed_blocks = apply_activation_checkpointing(model, config)

    param_dtype = torch_dtype(config.param_dtype)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch_dtype(config.reduce_dtype))
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if config.cpu_offload else OffloadPolicy()
    )

    seen: set[int] = set()
    if expert_mesh is not None:
        # Expert parameters always shard on the expert mesh: under ep > 1 they differ per
        # EP rank, so the world-wide all-reduce of replicated gradients would mix experts.
        seen = {id(p) for m in expert_modules(model) for p in m.parameters()}
    replicated: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if id(p) not in seen and p.numel() < config.param_persistence_threshold:
            seen.add(id(p))
            replicated.append(p)
            layout.replicated_names.append(name)
    ignored = set(replicated)
    layout.replicated_params = replicated
    kwargs: dict[str, Any] = dict(
        mesh=shard_mesh,
        reshard_after_forward=config.reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload,
        ignored_params=ignored or None,
    )

    def _has_shardable(modules: list[nn.Module]) -> bool:
        return any(p not in ignored for m in modules for p in m.parameters())

    if expert_mesh is not None:  # nested units first: the blocks then skip their parameters
        expert_kwargs = {k: v for k, v in kwargs.items() if k not in ("mesh", "ignored_params")}
        layout.expert_units = fully_shard_experts(
            model, expert_mesh=expert_mesh, gradient_divide_factor=get_world_size(), **expert_kwargs
        )

    _, blocks = find_transformer_blocks(model)
    embed, head, tied = _embeddings_and_head(model)
    named = {id(m): n for n, m in model.named_modules()}

    tables = find_per_layer_embeddings(model)
    parts = fsdp_units(
        len(blocks),
        config.wrap_every_n_blocks,
        separate_embedding=embed is not None and not tied,
        per_layer_embeddings=len(tables),
        separate_head=head is not None and not tied,
    )
    by_kind = {
        "embed": lambda _: [embed],
        "per_layer_embed": lambda p: [tables[p.start]],
        "blocks": lambda p: blocks[p.start : p.stop],
        "head": lambda _: [head],
    }
    for part in parts:
        group = by_kind[part.kind](part)
        if not _has_shardable(group):
            continue
        if len(group) > 1:
            fully_shard(group, **kwargs)  # one unit of several modules, led by the first
        else:
            fully_shard(group[0], **kwargs)
        layout.units.append(cast(FSDPModule, group[0]))  # fully_shard made it an FSDPModule
        layout.unit_names.append(named.get(id(group[0]), part.name))
    # The root keeps its parameters gathered from its forward to its backward (FSDP2's own default
    # for a root): the backward needs them at once, and a tied lm_head reads them in between. Resharded
    # there, the trainer's head would gather a second copy of the embedding table.
    layout.root = fully_shard(model, **{**kwargs, "reshard_after_forward": False})

    units = layout.units
    for i, unit in enumerate(units):
        forward = units[i + 1 : i + 1 + config.prefetch_units]
        backward = list(reversed(units[max(0, i - config.backward_prefetch_units) : i]))
        if forward:
            unit.set_modules_to_forward_prefetch(forward)
        if backward:
            unit.set_modules_to_backward_prefetch(backward)

    if replicated:
        mesh_device = mesh.device_type
        for p in replicated:
            if not isinstance(p, DTensor) and not p.is_meta and p.device.type != mesh_device:
                p.data = p.data.to(
                    torch.device(mesh_device, torch.cuda.current_device()) if mesh_device == "cuda" else mesh_device
                )
        containers = list(blocks) + [m for m in (embed, head) if m is not None]
        _install_replicated_casts(model, layout, ignored, param_dtype, containers)
        _install_replicated_grad_sync(layout)

    setattr(model, "_agilerl_fsdp_layout", layout)  # noqa: B010 (nn.Module's typing has no such attribute)
    return model
