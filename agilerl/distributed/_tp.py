"""Tensor parallelism (Megatron-style) for decoder blocks, composed with FSDP2.

Ranks form a 2-D mesh ``("dp", "tp")`` with ``tp`` innermost, so the ranks of one
TP group are consecutive and ``rank // tp`` is the data-parallel rank. Inside a
block, attention q/k/v and MLP gate/up are split by output columns (each rank
holds ``heads / tp`` heads and ``intermediate / tp`` MLP columns) and o/down by
input rows, so each half of a block ends in one all-reduce over the TP group
(torch's ``ColwiseParallel`` / ``RowwiseParallel``). Everything between blocks
(embeddings, norms, lm_head) stays whole on every TP rank and sees identical
inputs; FSDP2 then shards all of it over ``"dp"`` (TP first, then
``fully_shard(..., mesh=mesh["dp"])``, the 2-D layout torchtitan uses).

Why the Hugging Face code runs unchanged on local heads (checked in
transformers 5): attention reshapes projections with ``(*shape, -1, head_dim)``
and back with ``reshape(*shape, -1)``, so it infers the local head count;
``num_key_value_groups = heads / kv_heads`` is the same locally (each rank holds
whole GQA groups when ``kv_heads % tp == 0``); Gemma's attention softcapping acts
on per-head scores and its final-logit softcapping on the whole lm_head output.

In a MoE block only the attention is split: the router, the packed experts and
any shared experts stay whole and run alike on every TP rank (their inputs are
identical after ``o_proj``'s all-reduce), so their gradients are identical on
every TP rank too. Expert parallelism (``ep > 1``) is not combined with TP.

Per-head norms (Qwen3 and Gemma 3 ``q_norm`` / ``k_norm``) see only local heads,
so their weight gradient on one rank is a partial sum over its heads. They
become replicated DTensors fed their input declared as ``Shard(0)``: the norm
is pointwise over every dim but the last, so any non-last dim gives the same
values, and autograd returns the weight gradient as ``Partial`` (sum over the
TP group). FSDP2 reduces such gradients itself for the parameters it shards;
for the others (no FSDP, or kept replicated under ``param_persistence_threshold``)
a post-accumulate hook does the all-reduce.

LoRA (PEFT ``Linear``: ``base_layer`` + ``lora_B[a](lora_A[a](dropout(x))) * s``)
for every adapter ``a``:

* colwise base (x whole, output split by columns): ``lora_B`` colwise (each rank
  its output rows of B), ``lora_A`` whole. ``h = A x`` is the same on every
  rank. In backward ``dL/dh = sum over ranks of B_r^T g_r`` is a partial sum;
  ``lora_B``'s colwise input hook all-reduces it (r values per token), so
  ``dL/dA = dL/dh x^T`` is the full gradient on every rank, and so is the
  LoRA path's ``dL/dx``.
* rowwise base (x split by columns, output all-reduced): ``lora_A`` rowwise
  (each rank its input columns of A; ``h = sum over ranks of A_r x_r``, one
  all-reduce of r values per token), ``lora_B`` whole. ``y_lora = B h`` and its
  gradient are identical on every rank, so ``dL/dB`` is already full and
  ``dL/dA_r = dL/dh x_r^T`` is the local slice of the full gradient.

Whole (non-DTensor) parameters therefore carry identical gradients on every TP
rank: averaging them over the data-parallel group (or the whole world) is
right. Sharded ones differ per TP rank and must only ever be averaged over the
data-parallel group. LoRA dropout on a colwise layer must draw the same mask on
every TP rank (their ``x`` is the same), so a TP group must share its RNG state
(:func:`sync_tp_rng`); on a rowwise layer the same state gives the same mask
pattern on each rank's slice, still an exact per-element dropout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ..typing import HFModule
from ._blocks import find_transformer_blocks
from ._moe import is_moe_block
from ._plan import BLOCK_PLAN, HEAD_NORMS, ParallelDims, tp_split_problem
from ._runtime import device_mesh, get_world_size, require_process_group

__all__ = [
    "tp_mesh_layout",
    "check_tp_divides",
    "build_dp_tp_mesh",
    "apply_tensor_parallel",
    "TPLayout",
    "tp_layout",
    "ParallelRanks",
    "parallel_ranks",
    "sync_tp_rng",
]


def tp_mesh_layout(world_size: int, tp: int) -> tuple[int, int]:
    """``(dp, tp)`` for ``world_size`` ranks: ``dp = world_size // tp`` data-parallel groups."""
    dims = ParallelDims(world_size, tp=tp)
    return dims.dp, dims.tp


def check_tp_divides(config: Any, tp: int, *, dense_mlp: bool = True, sinks: bool = False) -> None:
    """Raise unless ``tp`` ranks can each hold whole heads, whole GQA groups and MLP columns
    (``dense_mlp=False``: no dense MLP is split, as in a model whose every block is MoE;
    ``sinks``: its attention has sinks, which are not split)."""
    num_heads = config.num_attention_heads
    problem = tp_split_problem(
        tp,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        intermediate_size=config.intermediate_size if dense_mlp else None,
        sinks=sinks,
    )
    if problem:
        raise ValueError(problem)


def build_dp_tp_mesh(tp: int, device_type: str | None = None) -> DeviceMesh:
    """A 2-D mesh ``("dp", "tp")`` over all ranks, TP innermost: rank = dp_rank * tp + tp_rank."""
    require_process_group("build_dp_tp_mesh")
    dp, tp = tp_mesh_layout(get_world_size(), tp)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return device_mesh(device_type, (dp, tp), ("dp", "tp"))


@dataclass
class TPLayout:
    """What apply_tensor_parallel split: read by apply_fsdp2, the trainer and the tests."""

    mesh: DeviceMesh
    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)
    num_lora_layers: int = 0


def tp_layout(model: nn.Module) -> TPLayout | None:
    """The layout apply_tensor_parallel recorded on ``model`` (None if it was not split)."""
    return getattr(model, "_agilerl_tp_layout", None)


def _text_config(model: nn.Module) -> Any:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            return config.get_text_config()
    raise ValueError(f"{type(model).__name__} has no Hugging Face config with head counts")


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _is_lora(module: nn.Module) -> bool:
    adapters = getattr(module, "lora_A", None)
    return hasattr(module, "base_layer") and isinstance(adapters, nn.ModuleDict)


def _check_linear(module: HFModule | None, name: str) -> None:
    if module is None:
        raise ValueError(
            f"{name} is missing: tensor parallelism supports dense blocks with separate {sorted(BLOCK_PLAN)}"
        )
    if _is_lora(module):
        if getattr(module, "lora_variant", None) or getattr(module, "lora_magnitude_vector", None):
            raise NotImplementedError(f"{name}: LoRA variants (DoRA, ...) do not support tp > 1")
        module = module.base_layer
    if type(module) is not nn.Linear:
        raise TypeError(
            f"{name} is a {type(module).__name__}; tensor parallelism splits plain nn.Linear "
            "layers (optionally wrapped by PEFT LoRA), not quantised or custom ones"
        )


def _style(kind: str) -> ParallelStyle:
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def _split_linear(module: HFModule, mesh: DeviceMesh, kind: str) -> bool:
    """Split one linear (or PEFT LoRA linear) ``kind``-wise; True if it carried LoRA."""
    if not _is_lora(module):
        parallelize_module(module, mesh, _style(kind))
        return False
    parallelize_module(module.base_layer, mesh, _style(kind))
    # colwise: B split like the base's output, A whole; rowwise: A split like its input, B whole.
    for adapter in (module.lora_B if kind == "colwise" else module.lora_A).values():
        parallelize_module(adapter, mesh, _style(kind))
    return True


def _replicate_params(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    # Equal on every rank already: wrap without communication (works on meta too).
    # torch's SequenceParallel does the same but drops requires_grad.
    for name, p in list(module.named_parameters(recurse=False)):
        local = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))


def _local_heads_in(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    # Declared Shard(0): for a norm over the last dim any other dim is exact.
    return (DTensor.from_local(inputs[0], mesh, [Shard(0)], run_check=False), *inputs[1:])


def _local_out(_module: nn.Module, output: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


def _reduce_partial_grad(param: torch.Tensor) -> None:
    # The weight gradient of a replicated norm over local heads is Partial (see module doc).
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def _split_head_norm(norm: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate a per-head norm's weight as a DTensor over the TP group (see module doc).

    The hook makes its gradient whole as soon as it is accumulated, so code that
    reads the local gradient (clipping, the replicated-gradient average of
    parameters FSDP ignores) sees the full sum. FSDP's own units reduce Partial
    gradients themselves; there the hook is never reached (FSDP swaps the
    parameter). A weight frozen now (under LoRA) gets no hook.
    """
    # torch types the input and output functions as returning None; they return the new input/output.
    distribute_module(norm, mesh, _replicate_params, _local_heads_in, _local_out)  # type: ignore[arg-type]
    for p in norm.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_reduce_partial_grad)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> TPLayout:
    """Split every decoder block's attention and MLP linears over ``tp_mesh`` (the 1-D TP axis).

    q/k/v, gate and up are colwise, o and down rowwise (biases follow their
    weights); per-head q/k norms become replicated DTensors; embeddings, block
    norms and lm_head stay whole for FSDP to shard. PEFT LoRA layers are split
    as the module docstring says, for every adapter present, so add all
    adapters first. Call before ``fully_shard``; parameters become DTensors in
    place, so build optimizers afterwards. Every rank must hold the same weights
    (same seed or checkpoint, as FSDP2 already assumes): split weights are
    scattered from the group's first rank, whole ones are used as they are.
    Everything is validated before anything is split. Returns the layout, also
    recorded on ``model``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be the 1-D 'tp' axis, got a {tp_mesh.ndim}-D mesh")
    if tp_layout(model) is not None:
        raise ValueError("apply_tensor_parallel was already applied to this model")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("apply_tensor_parallel must run before fully_shard (TP first, then FSDP)")
    _, blocks = find_transformer_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    plan = []
    sinks = False
    for block in blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        prefix = names.get(id(block), type(inner).__name__)
        # A MoE block splits its attention only: its router and experts (and any shared
        # experts) stay whole, computed alike on every TP rank from identical inputs.
        moe = is_moe_block(inner)
        sinks = sinks or any(n.split(".")[-1] == "sinks" for n, _ in inner.named_parameters())
        paths = [p for p in BLOCK_PLAN if not (moe and p.startswith("mlp."))]
        for path in paths:
            _check_linear(_get(inner, path), f"{prefix}.{path}")
        plan.append((prefix, inner, paths))
    check_tp_divides(
        _text_config(model),
        tp_mesh.size(),
        dense_mlp=any(p.startswith("mlp.") for _, _, paths in plan for p in paths),
        sinks=sinks,
    )

    layout = TPLayout(mesh=tp_mesh)
    for prefix, inner, paths in plan:
        for path in paths:
            kind = BLOCK_PLAN[path]
            layout.num_lora_layers += _split_linear(inner.get_submodule(path), tp_mesh, kind)
            (layout.colwise if kind == "colwise" else layout.rowwise).append(f"{prefix}.{path}")
        for path in HEAD_NORMS:
            norm = _get(inner, path)
            if norm is not None:
                _split_head_norm(norm, tp_mesh)
                layout.head_norms.append(f"{prefix}.{path}")
    setattr(model, "_agilerl_tp_layout", layout)  # noqa: B010 (nn.Module's typing has no such attribute)
    return layout


@dataclass(frozen=True)
class ParallelRanks:
    """Where this rank sits on the ``("dp", "tp")`` mesh, and the process group of each axis."""

    dp_rank: int
    num_dp_ranks: int
    tp_rank: int
    tp: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup


def parallel_ranks(mesh: DeviceMesh) -> ParallelRanks:
    """This rank's coordinates on a mesh from :func:`build_dp_tp_mesh`.

    Ranks with the same ``dp_rank`` form a TP group and must get the same rows:
    ``rows[dp_rank * n:(dp_rank + 1) * n]`` for ``n = total // num_dp_ranks``.
    """
    names = mesh.mesh_dim_names or ()
    return ParallelRanks(
        dp_rank=mesh.get_local_rank("dp"),
        num_dp_ranks=mesh.size(names.index("dp")),
        tp_rank=mesh.get_local_rank("tp"),
        tp=mesh.size(names.index("tp")),
        dp_group=mesh.get_group("dp"),
        tp_group=mesh.get_group("tp"),
    )


def sync_tp_rng(tp_mesh: DeviceMesh) -> None:
    """Give every rank of the TP group the RNG state (CPU and CUDA) of its first rank.

    TP ranks compute identical logits (the lm_head input is the all-reduced
    hidden state, the same bits on every rank), so with identical RNG state
    they sample identical tokens and draw identical LoRA dropout masks. One
    small broadcast: call it before generation and before training steps.
    """
    group = tp_mesh.get_group()
    states: list[Any] = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    on_cuda = tp_mesh.device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
    src = dist.get_global_rank(group, 0)
    dist.broadcast_object_list(states, src=src, group=group, device=device)
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])
