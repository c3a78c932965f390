"""Optimizers for sharded actors, and gradient clipping over mixed DTensor/Tensor grads.

``FSDPConfig.optim_cpu_offload`` (docs/runtime.md):

- ``False``: fused AdamW on the device, states beside the parameter shards.
- ``True``: :class:`CPUOffloadAdamW`. Adam moments (and an fp32 copy of each
  local shard) live on the host and the step runs there with the default AdamW
  kernel; parameters and gradients stay on the device. Each step copies the
  local gradient shards to the host and the updated shards back.
- ``None``: "the memory estimate decides". Without the planner it resolves to
  the device (:func:`resolve_optim_cpu_offload`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ._config import FSDPConfig
from ._fsdp import expert_parallel
from ._moe import expert_modules

__all__ = [
    "CPUOffloadAdamW",
    "MasterWeightAdamW",
    "build_optimizer",
    "clip_grad_norm_",
    "resolve_optim_cpu_offload",
]


def resolve_optim_cpu_offload(config: FSDPConfig | None) -> bool:
    """``optim_cpu_offload`` with None resolved to the device (False)."""
    if config is None or config.optim_cpu_offload is None:
        return False
    return bool(config.optim_cpu_offload)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW that steps fp32 master copies of the parameters and writes the result back.

    ``param_groups`` hold the model's parameters (so LR schedulers and gradient clipping
    work as usual); an inner ``torch.optim.AdamW`` steps an fp32 master of each local
    shard on ``master_device``, and the step copies the updated masters back into the
    parameters (cast to their dtype).

    - On the host (:class:`CPUOffloadAdamW`, ``optim_cpu_offload=True``): moments and
      masters live in host memory and the step runs there with the default AdamW kernel.
    - On the device (full fine-tuning of a bf16 model on one device or data parallel): the
      model computes in bf16 and this keeps what mixed precision needs beside it, as
      Megatron-LM does: an fp32 master weight, an fp32 gradient accumulated from every
      backward (``accumulate_grads``: each bf16 gradient is added to it as soon as autograd
      has made it, then freed) and the two fp32 moments, 16 bytes per parameter beside the
      2-byte weight.

    With ``accumulate_grads`` the gradients to average, clip and step are the masters'
    (:meth:`grad_tensors`); otherwise the parameters' own.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        master_device: str | torch.device = "cpu",
        accumulate_grads: bool = False,
        fused: bool | None = None,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_device = torch.device(master_device)
        on_host = self.master_device.type == "cpu"
        pin = on_host and torch.cuda.is_available()
        self.masters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its fp32 master)
        inner_groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                master = _local(p).detach().to(self.master_device, torch.float32, copy=True)
                if pin:
                    master = master.pin_memory()
                self.masters.append((p, master))
                masters.append(master)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        # fused: one kernel and no temporaries; None: torch's default (foreach, whose temporaries
        # are a copy of the moments: the host has room for them, CPUOffloadAdamW's choice)
        self.inner = torch.optim.AdamW(inner_groups, fused=fused)
        self.accumulate_grads = accumulate_grads
        self._hooks = []
        if accumulate_grads:
            for p, master in self.masters:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulator(master)))

    @staticmethod
    def _accumulator(master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:  # a post-accumulate hook always has one
                return
            grad = _local(p.grad)
            if master.grad is None:
                master.grad = grad.to(torch.float32, copy=True)
            else:
                master.grad.add_(grad)
            p.grad = None

        return hook

    def grad_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` hold this step's gradients: the fp32 masters when they
        accumulate them, else the parameters."""
        if self.accumulate_grads:
            return [master for _, master in self.masters]
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner[key] = group[key]
        if not self.accumulate_grads:
            for p, master in self.masters:
                if p.grad is None:
                    master.grad = None
                    continue
                if master.grad is None:
                    master.grad = torch.empty_like(master)
                master.grad.copy_(_local(p.grad), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.inner.step()
        for p, master in self.masters:
            if master.grad is not None:
                _local(p).copy_(master, non_blocking=True)
        return loss

    @torch.no_grad()
    def refresh_from_params(self) -> None:
        """Re-copy the masters from the parameters (after loading weights)."""
        for p, master in self.masters:
            master.copy_(_local(p))

    def master_tensors(self) -> list[torch.Tensor]:
        """Everything this optimizer keeps: the fp32 masters, their gradients and AdamW's moments."""
        out = []
        for _, master in self.masters:
            out.append(master)
            if master.grad is not None:
                out.append(master.grad)
            out.extend(v for v in self.inner.state.get(master, {}).values() if isinstance(v, torch.Tensor))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for _, master in self.masters:
            if set_to_none:
                master.grad = None
            elif master.grad is not None:
                master.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


class CPUOffloadAdamW(MasterWeightAdamW):
    """AdamW whose state and step live on the host; parameters stay on the device
    (``FSDPConfig.optim_cpu_offload=True``). Host memory per trainable element: 4 B master +
    4 B gradient + 8 B moments."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_device="cpu")

    def host_tensors(self) -> list[torch.Tensor]:
        """Everything this optimizer keeps on the host (:meth:`master_tensors`)."""
        return self.master_tensors()


def _expert_grad_ids(model: nn.Module | None) -> tuple[set[int], Any]:
    """Ids of the parameters split by expert parallelism, and the EP group (none without EP)."""
    if model is None:
        return set(), None
    moe, group = expert_parallel(model)
    if moe is None:
        return set(), None
    return {id(p) for m in expert_modules(model) for p in m.parameters()}, group


def build_optimizer(
    params: Iterable[nn.Parameter],
    *,
    fsdp_config: FSDPConfig | None,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> torch.optim.Optimizer:
    """AdamW placed as ``fsdp_config.optim_cpu_offload`` says (None -> device).

    Trainable weights in a low-precision dtype (full fine-tuning of a bf16 model without
    FSDP2) get :class:`MasterWeightAdamW` on their device: fp32 masters, gradients and
    moments. fp32 weights (LoRA adapters, FSDP2's fp32 shards) step with fused AdamW.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters to optimize")
    if resolve_optim_cpu_offload(fsdp_config):
        return CPUOffloadAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    device_type = _local(params[0]).device.type
    if any(p.dtype != torch.float32 for p in params) and not any(isinstance(p, DTensor) for p in params):
        # Low-precision trainable weights (full fine-tuning of a bf16 model, unsharded): fp32
        # masters, gradients and moments beside them. Under FSDP2 the shards are fp32 already.
        return MasterWeightAdamW(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            master_device=_local(params[0]).device,
            accumulate_grads=True,
            fused=device_type in ("cuda", "cpu", "xpu") or None,
        )
    fused = device_type in ("cuda", "cpu", "mps", "xpu")
    # Fused kernels cannot mix DTensor shards and replicated plain tensors in
    # one call, and a param group is one call: keep them in separate groups.
    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (sharded, plain) if g]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *, model: nn.Module | None = None
) -> torch.Tensor:
    """Clip gradients by their global norm; works on a mix of DTensor and plain grads.

    ``torch.nn.utils.clip_grad_norm_`` cannot stack the norms of sharded
    (DTensor) and replicated (plain) gradients. Here each group (DTensors per
    mesh, plain tensors) is normed on its own, DTensor norms are resolved with
    ``full_tensor()`` (replicas are not double counted), and the groups are
    combined. Under expert parallelism each rank's expert gradients cover only
    its experts: pass ``model`` so their part of the norm is summed over the EP
    group. Returns the total norm before clipping as a plain tensor.
    """
    parameters = list(parameters)
    expert_ids, ep_group = _expert_grad_ids(model)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault((id(p) in expert_ids, key), []).append(g)
    norms = []
    for (is_expert, _), members in groups.items():
        n = torch.nn.utils.get_total_norm(members, norm_type=norm_type)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        n = n.float()
        if is_expert and ep_group is not None:
            import torch.distributed as dist

            if math.isinf(norm_type):
                dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ep_group)
            else:
                n = n.pow(norm_type)
                dist.all_reduce(n, op=dist.ReduceOp.SUM, group=ep_group)
                n = n.pow(1.0 / norm_type)
        norms.append(n.cpu())
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        total = stacked.max()
    else:
        total = stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        by_type: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_type.setdefault(
                (type(g), g.device if not isinstance(g, DTensor) else id(g.device_mesh), g.dtype), []
            ).append(g)
        for members in by_type.values():
            torch._foreach_mul_(members, coef)
    return total
