"""Full (unsharded) state dicts in and out of FSDP2-sharded models.

One on-disk layout for every run: state-dict keys are those of the unsharded
model (no FSDP or checkpoint-wrapper prefixes) and tensors are full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._fsdp import expert_parallel, rebind_replicated_params
from ._moe import expert_slice, gather_expert_tensor
from ._optim import MasterWeightAdamW

__all__ = [
    "set_full_model_state_dict",
    "materialize_fsdp2_from_cpu_state",
    "full_model_state_dict",
    "full_tensors",
    "reinit_non_persistent_buffers",
    "full_optimizer_state_dict",
    "load_full_optimizer_state_dict",
]

_CKPT_PREFIX = "_checkpoint_wrapped_module."


def _clean(name: str) -> str:
    return name.replace(_CKPT_PREFIX, "")


def _named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under their state-dict keys (tied ones once)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[_clean(name)] = p
    for module_name, module in model.named_modules():
        for buf_name, buf in module._buffers.items():
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            key = _clean(f"{module_name}.{buf_name}" if module_name else buf_name)
            out.setdefault(key, buf)
    return out


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict key -> the key under which the same tensor is first registered."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = _clean(name)
        if id(p) in first:
            alias[key] = first[id(p)]
        else:
            first[id(p)] = key
    return alias


def _tied_places(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Each place that registers a parameter registered before it (a tied head's weight), with
    that first place: (module, name, first module, first name)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((module, name, *first[id(p)]))
            else:
                first[id(p)] = (module, name)
    return out


@torch.no_grad()
def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"shape mismatch: state dict has {tuple(source.shape)}, model has {tuple(target.shape)}")
    if isinstance(target, DTensor):
        local = target.to_local()
        src = source.to(device=local.device, dtype=target.dtype)
        # Every rank holds the full tensor, so slice locally: no communication.
        shard = distribute_tensor(src, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(shard.to_local())
    else:
        target.copy_(source.to(device=target.device, dtype=target.dtype))


def _local_experts(moe, name: str, full: torch.Tensor) -> torch.Tensor:
    """This EP rank's experts of a full (all-experts) tensor; other tensors unchanged."""
    shard = moe.expert_shard(name) if moe is not None else None
    if shard is None:
        return full
    local = shard.num_experts // moe.ep
    return expert_slice(full, shard=shard, first=moe.ep_rank * local, num_local=local)


def _all_experts(moe, group, name: str, local: torch.Tensor) -> torch.Tensor:
    """Every expert of this rank's (FSDP-gathered) expert tensor, gathered over the EP group."""
    shard = moe.expert_shard(name) if moe is not None else None
    if shard is None:
        return local
    return gather_expert_tensor(local, shard=shard, group=group)


def set_full_model_state_dict(
    model: nn.Module, full_state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Write a full (unsharded) state dict into a sharded or unsharded model.

    Each rank copies its own slice of every full tensor. ``full_state_dict`` may
    be any mapping, including a lazy one reading tensors on access, so host
    memory holds one tensor at a time. With ``strict``, missing and unexpected
    keys are an error listing them.
    """
    targets = _named_state(model)
    aliases = _tied_aliases(model)
    if strict:
        missing = sorted(k for k in targets if k not in full_state_dict)
        expected = set(targets) | set(aliases)
        unexpected = sorted(k for k in full_state_dict.keys() if k not in expected)
        if missing or unexpected:
            raise KeyError(
                f"state dict does not match the model: missing {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                f"{' ...' if len(unexpected) > 10 else ''}"
            )
    moe, _ = expert_parallel(model)
    for key, target in targets.items():
        if key in full_state_dict:
            try:
                _copy_into(target, _local_experts(moe, key, full_state_dict[key]))
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None


@torch.no_grad()
def reinit_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute non-persistent buffers (rotary ``inv_freq``, embedding scales).

    They are not in any state dict, so after ``to_empty`` they hold garbage
    (docs/runtime.md). Hugging Face models know how to initialise them in
    ``_init_weights``; that is called only for the modules owning such buffers,
    with every parameter flagged as initialised so that no weight is touched.
    Returns the names of the buffers recomputed.
    """
    # Each module is initialised by its innermost Hugging Face model (itself included): some
    # _init_weights read attributes of the model class they belong to (Gemma-3n's text model
    # reads its own hidden_size), which an outer wrapper does not have.
    owners = {name: m for name, m in model.named_modules() if hasattr(m, "_init_weights") and hasattr(m, "config")}

    def owner_of(module_name: str):
        parts = module_name.split(".") if module_name else []
        for cut in range(len(parts), -1, -1):
            owner = owners.get(".".join(parts[:cut]))
            if owner is not None:
                return owner
        return None

    done: list[str] = []
    # Hugging Face's own flag, set on parameters and buffers (not part of torch's typing).
    params: list[Any] = list(model.parameters())
    flags = [getattr(p, "_is_hf_initialized", None) for p in params]
    for p in params:
        p._is_hf_initialized = True
    try:
        for module_name, module in model.named_modules():
            names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
            if not names:
                continue
            init_owner = owner_of(module_name)
            if init_owner is None:
                raise RuntimeError(
                    f"cannot re-initialise non-persistent buffers {names} of {module_name!r}: "
                    "the model has no Hugging Face _init_weights"
                )
            rope_init_fn = getattr(module, "rope_init_fn", None)
            if callable(rope_init_fn) and "inv_freq" in names:
                # transformers 4.x rotary modules keep their init function.
                inv_freq, _ = rope_init_fn(module.config, module.inv_freq.device)
                module.inv_freq.copy_(inv_freq)
                if "original_inv_freq" in names:
                    module.original_inv_freq.copy_(inv_freq)
            else:
                for n in names:
                    setattr(module._buffers[n], "_is_hf_initialized", False)  # noqa: B010
                init_owner._init_weights(module)
            done.extend(_clean(f"{module_name}.{n}" if module_name else n) for n in names)
    finally:
        for p, flag in zip(params, flags):
            if flag is None:
                try:
                    del p._is_hf_initialized
                except AttributeError:
                    pass
            else:
                p._is_hf_initialized = flag
    return done


def materialize_fsdp2_from_cpu_state(
    model: nn.Module,
    cpu_state_dict: Mapping[str, torch.Tensor],
    device: str | torch.device,
    *,
    strict: bool = True,
) -> nn.Module:
    """Fill a model sharded on the meta device with this rank's slices of a full CPU state dict.

    Allocates only local shards on ``device`` (``to_empty``), recomputes the
    non-persistent buffers, then copies each rank's slice of every tensor.
    """
    tied = _tied_places(model)
    model.to_empty(device=device)
    for module, name, source, source_name in tied:  # to_empty gives each place a parameter of its own
        module._parameters[name] = source._parameters[source_name]
    rebind_replicated_params(model)
    reinit_non_persistent_buffers(model)
    set_full_model_state_dict(model, cpu_state_dict, strict=strict)
    return model


@torch.no_grad()
def full_tensors(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], *, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Full CPU copies of some of ``model``'s (possibly sharded) tensors, by state-dict key.

    One gather at a time (collective: every rank calls it): FSDP shards with
    ``full_tensor()``, expert slices over the EP group. ``keep=False`` joins the
    gathers but keeps nothing.
    """
    moe, ep_group = expert_parallel(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        full = _all_experts(moe, ep_group, key, full.detach())
        if keep:
            out[key] = full.cpu().clone()
    return out


@torch.no_grad()
def full_model_state_dict(model: nn.Module, *, to_cpu: bool = True, keep: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict: every DTensor all-gathered (collective: all ranks call it).

    ``keep=False`` still joins every gather but drops the tensors (for ranks
    that do not write the checkpoint), so only one rank pays the host memory.
    """
    out: dict[str, torch.Tensor] = {}
    moe, ep_group = expert_parallel(model)
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        value = _all_experts(moe, ep_group, key, value)
        if keep:
            out[_clean(key)] = value.detach().cpu() if to_cpu else value.detach()
    return out


def _param_states(model: nn.Module, optimizer: torch.optim.Optimizer):
    """(fqn, param, state dict) for every optimized parameter.

    For a ``MasterWeightAdamW`` (``CPUOffloadAdamW`` included) the state belongs to the
    fp32 master of the local shard: plain tensors, even where the parameter is a DTensor.
    """
    names = {id(p): _clean(n) for n, p in model.named_parameters()}
    if isinstance(optimizer, MasterWeightAdamW):
        for p, master in optimizer.masters:
            yield names[id(p)], p, optimizer.inner.state.setdefault(master, {})
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield names[id(p)], p, optimizer.state.setdefault(p, {})


@torch.no_grad()
def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, keep: bool = True) -> dict:
    """Optimizer state keyed by parameter name with full (gathered) tensors on CPU.

    The same layout whether the optimizer ran on one device, on DTensor shards
    (fused AdamW under FSDP2) or on fp32 masters of local shards (``MasterWeightAdamW``,
    ``CPUOffloadAdamW``). A master that holds more than its parameter (an fp32 master of a
    bf16 weight) is saved too, under ``"master_weight"``. Collective under FSDP2: every rank
    calls it.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    moe, ep_group = expert_parallel(model)
    masters = {}
    if isinstance(optimizer, MasterWeightAdamW):
        masters = {id(p): m for p, m in optimizer.masters if p.dtype != torch.float32}
    for fqn, p, state in _param_states(model, optimizer):
        entry = {}
        if id(p) in masters:
            state = {**state, "master_weight": masters[id(p)]}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                entry[key] = value
                continue
            if isinstance(value, DTensor):
                value = value.full_tensor()
            elif isinstance(p, DTensor) and value.dim() > 0:  # a host copy of this rank's shard
                local = value.to(p.to_local().device)
                value = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                value = value.full_tensor()
            if value.dim() > 0:
                value = _all_experts(moe, ep_group, fqn, value)
            entry[key] = value.detach().cpu()
        if keep and entry:
            out[fqn] = entry
    return out


@torch.no_grad()
def load_full_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    *,
    master_weights: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Inverse of :func:`full_optimizer_state_dict`: each rank keeps its slices.

    Full fine-tuning moves between layouts: a saved ``master_weight`` sets an fp32 parameter where
    there is no master optimizer, and ``master_weights`` (the checkpoint's full weights) seed a
    master optimizer's fp32 masters where they were saved in fp32 and nothing else says more."""
    masters = optimizer if isinstance(optimizer, MasterWeightAdamW) else None
    with_masters = masters is not None
    inner = masters.inner if masters is not None else optimizer
    steps_on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
    moe, _ = expert_parallel(model)
    master_of = {id(p): m for p, m in masters.masters} if masters is not None else {}
    if masters is not None:
        # the weights just loaded; a saved fp32 master overrides below, and so do fp32 weights given
        # (a checkpoint written with fp32 parameters, FSDP2's shards, loaded beside bf16 ones)
        masters.refresh_from_params()
        names = {id(p): _clean(n) for n, p in model.named_parameters()}
        for p, master in masters.masters:
            full = (master_weights or {}).get(names[id(p)])
            if full is not None and full.dtype == torch.float32 and p.dtype != torch.float32:
                local = _local_experts(moe, names[id(p)], full)
                if isinstance(p, DTensor):
                    local = distribute_tensor(
                        local.to(p.to_local().device), p.device_mesh, p.placements, src_data_rank=None
                    ).to_local()
                master.copy_(local)
    for fqn, p, target in _param_states(model, optimizer):
        if fqn not in state:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        # where this optimizer keeps the parameter's state: beside its master, or beside it
        home = master_of[id(p)].device if with_masters else local.device
        for key, value in state[fqn].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                value = _local_experts(moe, fqn, value)
            if key == "master_weight" and not with_masters:
                # saved beside a bf16 weight by MasterWeightAdamW; here the parameter is its own master
                # (FSDP2's fp32 shards): it takes the fp32 value, and no optimizer state is made of it
                if local.dtype == torch.float32:
                    _copy_into(p, value)
                continue
            if not isinstance(value, torch.Tensor):
                target[key] = value
                continue
            if value.dim() == 0:  # the step counter, where this optimizer keeps it
                target[key] = value.to(device=home if steps_on_device else "cpu", dtype=torch.float32)
                continue
            if isinstance(p, DTensor):
                shard = distribute_tensor(value.to(local.device), p.device_mesh, p.placements, src_data_rank=None)
                value = shard.to_local() if with_masters else shard
            if key == "master_weight" and with_masters:
                master_of[id(p)].copy_(value)
            else:
                target[key] = value.to(home) if with_masters or not isinstance(value, DTensor) else value
