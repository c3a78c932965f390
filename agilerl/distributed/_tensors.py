"""Temporary dense views of FSDP2 DTensor parameters."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["materialize_dtensors", "gather_params", "full_shape_views", "owners_of"]


@overload
def materialize_dtensors(  # type: ignore[overload-overlap]  # two tensors: a pair to unpack
    t0: torch.Tensor, t1: torch.Tensor | None, /
) -> AbstractContextManager[tuple[torch.Tensor, torch.Tensor | None]]: ...


@overload
def materialize_dtensors(*tensors: torch.Tensor | None) -> AbstractContextManager[list[torch.Tensor | None]]: ...


@contextmanager
def materialize_dtensors(*tensors):
    """All-gather DTensor shards to dense locals without swapping module params.

    The gather is differentiable: its backward reduce-scatters the dense gradient, averaged
    over the mesh as FSDP2 averages its gradients (each rank's dense gradient comes from its
    own data), so the dense tensors can feed a loss that trains them. With exactly two
    arguments a tuple is yielded, else a list parallel to ``tensors``. All ranks must enter
    and exit together.
    """
    dense = [_gather_dense(t) if isinstance(t, DTensor) else t for t in tensors]
    try:
        yield tuple(dense) if len(tensors) == 2 else dense
    finally:
        del dense


def _gather_dense(t: DTensor) -> torch.Tensor:
    if not t.requires_grad:
        return t.full_tensor()
    from torch.distributed.tensor.placement_types import Partial

    # Without grad_placements DTensor takes the dense gradient as replicated (the same on every
    # rank) and keeps each rank's slice of its own: averaged, it is FSDP2's gradient.
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)


def owners_of(root: nn.Module, params: Sequence[torch.Tensor | None]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Map ``id(param)`` to every (module, attribute name) that registers it."""
    wanted = {id(p) for p in params if p is not None}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in wanted:
                owners.setdefault(id(p), []).append((module, name))
    return owners


def _install(owners: list[tuple[nn.Module, str]], value: torch.Tensor) -> None:
    for module, name in owners:
        module._parameters[name] = value  # type: ignore[assignment]  # a dense stand-in, restored on exit


@contextmanager
def gather_params(
    root: nn.Module, params: Sequence[torch.Tensor | None]
) -> Generator[list[torch.Tensor | None], None, None]:
    """Materialize full (unsharded) views of ``params`` for the duration of the context.

    Each DTensor is all-gathered with ``full_tensor()`` and installed on its
    owning module(s) so in-module reads (``state_dict``, PEFT ``save_pretrained``)
    see dense weights; the original shards are restored on exit, so writes to
    the dense copies are discarded. All ranks must enter and exit together.
    """
    owners = owners_of(root, params)
    swapped: list[tuple[list[tuple[nn.Module, str]], torch.Tensor]] = []
    yielded: list[torch.Tensor | None] = []
    done: dict[int, torch.Tensor] = {}
    try:
        for p in params:
            if p is None or not isinstance(p, DTensor):
                yielded.append(p)
                continue
            if id(p) in done:
                yielded.append(done[id(p)])
                continue
            with torch.no_grad():
                full = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
            if id(p) in owners:
                _install(owners[id(p)], full)
                swapped.append((owners[id(p)], p))
            done[id(p)] = full
            yielded.append(full)
        yield yielded
    finally:
        for owner_list, original in swapped:
            _install(owner_list, original)


@contextmanager
def full_shape_views(root: nn.Module, params: Sequence[torch.Tensor | None]) -> Generator[None, None, None]:
    """Expose global-shape, zero-storage views on DTensor params for shape-only reads.

    Each sharded param is replaced on its owning module by a scalar expanded to
    the DTensor's global shape (no all-gather, no memory). Values must not be
    read inside the block. On exit the DTensor is restored where the installed
    view is still the live parameter. Plain tensors pass through untouched;
    duplicate references are processed once.
    """
    owners = owners_of(root, params)
    installed: list[tuple[nn.Module, str, nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        for p in params:
            if p is None or not isinstance(p, DTensor) or id(p) in seen:
                continue
            seen.add(id(p))
            local = p.to_local()
            view = torch.zeros((), dtype=p.dtype, device=local.device).expand(p.shape)
            param_view = nn.Parameter(view, requires_grad=False)
            for module, name in owners.get(id(p), []):
                module._parameters[name] = param_view
                installed.append((module, name, param_view, p))
        yield
    finally:
        for module, name, param_view, original in installed:
            if module._parameters.get(name) is param_view:
                module._parameters[name] = original  # type: ignore[assignment]  # the DTensor parameter it was
