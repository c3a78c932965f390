"""Process-group helpers: initialisation, ranks, collectives on objects and metrics.

Every helper is a no-op (or the identity) on a single device, so the same
training script runs unchanged with or without torchrun.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "init_distributed",
    "is_distributed",
    "get_rank",
    "get_local_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "broadcast_object_list",
    "gather_tensor",
    "gather_objects",
    "allreduce_minmax_int",
    "aggregate_metrics_across_gpus",
    "aggregate_metrics_dict",
    "sync_grads",
    "all_reduce_grads",
    "resolve_device",
    "require_process_group",
    "use_rank_group",
    "group_of_ranks",
    "rank_group",
    "RankGroup",
    "device_mesh",
]

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launched() -> bool:
    """Whether a launcher set every variable a process group needs. A partial set that names
    more than one process (``WORLD_SIZE`` > 1 without ``MASTER_ADDR``, say) is an error: run on
    as one device, each process would train on its share of the data alone."""
    present = [v for v in _LAUNCHER_VARS if v in os.environ]
    if len(present) == len(_LAUNCHER_VARS):
        return True
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.strip().isdigit():
        raise RuntimeError(f"WORLD_SIZE={world!r} is not a number of processes: launch with torchrun, which sets it")
    if present and int(world) > 1:
        missing = ", ".join(v for v in _LAUNCHER_VARS if v not in os.environ)
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {missing} "
            f"{'is' if ', ' not in missing else 'are'} not: launch with torchrun "
            "(for example `torchrun --nproc_per_node=2 train.py`), which sets them all, "
            "or unset WORLD_SIZE to run on one device."
        )
    return False


def init_distributed(timeout_seconds: int = 1800) -> bool:
    """Initialise torch.distributed from launcher env vars.

    gloo without CUDA; with CUDA a mixed ``cpu:gloo,cuda:nccl`` group so that
    CPU tensors (object collectives, offloaded state) and CUDA tensors both have
    a backend. No-op returning False without launcher env; an existing group is
    reused.

    Under torchrun the group's keys go under a prefix of the attempt
    (``TORCHELASTIC_RESTART_COUNT``): the ranks of a restart (``--max-restarts``)
    meet in the store the agent kept, and gloo read a rank's address from the
    failed attempt's keys before the new rank wrote its own (a refused connection).
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if not dist.is_available() or not _launched():
        return False
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if torch.cuda.is_available():
        torch.cuda.set_device(get_local_rank())
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        world = int(os.environ["WORLD_SIZE"])
        agent_store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(f"agilerl/attempt_{restart}", agent_store)
        dist.init_process_group(
            backend=backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return True


def is_distributed() -> bool:
    """Whether torch.distributed is available and initialised."""
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class RankGroup:
    """The ranks one agent trains on (a population member's): their global ranks and their group."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup


#: The rank group the helpers act on (None: every rank of the world).
_SCOPE: RankGroup | None = None
#: Process groups made by this module, by their global ranks (a group of ranks is made once).
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def group_of_ranks(ranks: Sequence[int], timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """The process group of ``ranks`` (this rank among them), made once: only its ranks take part
    (local synchronisation, named by its ranks), so each population member makes its own.
    ``timeout``: its collectives' (default: torch's)."""
    key = tuple(sorted(int(r) for r in ranks))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True, timeout=timeout)
    return _GROUPS[key]


def use_rank_group(ranks: Sequence[int] | None) -> RankGroup | None:
    """Make the helpers of this module act on ``ranks`` (global ranks, this one among them): rank,
    world size, main process, barrier, the collectives, the device meshes FSDP2 shards over. A
    population member trains on ranks of its own this way (agilerl.train). Every rank of ``ranks``
    calls it with the same ranks; the others need not. None goes back to the whole world."""
    global _SCOPE
    if ranks is None:
        _SCOPE = None
        return None
    require_process_group("use_rank_group")
    me = dist.get_rank()
    key = tuple(sorted(int(r) for r in ranks))
    if me not in key:
        raise ValueError(f"rank {me} is not among the ranks {list(key)} it was asked to train on")
    if len(key) == dist.get_world_size():
        _SCOPE = None  # every rank: the default group
        return None
    _SCOPE = RankGroup(ranks=key, group=group_of_ranks(key))
    return _SCOPE


def rank_group() -> RankGroup | None:
    """The rank group the helpers act on (:func:`use_rank_group`), None for the whole world."""
    return _SCOPE


def _group() -> dist.ProcessGroup | None:
    return _SCOPE.group if _SCOPE is not None else None


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh of ``shape`` over the ranks the helpers act on: the world's
    (``init_device_mesh``), or a rank group's, made from its own process groups (one per mesh
    dim through this rank, made dim by dim on every rank of the group)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if _SCOPE is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    ranks = torch.tensor(_SCOPE.ranks).reshape(shape)
    if len(shape) == 1:
        return DeviceMesh.from_group(_SCOPE.group, device_type, mesh_dim_names=names)
    where = tuple(int(i) for i in (ranks == dist.get_rank()).nonzero()[0])
    groups = []
    for dim in range(len(shape)):
        along = ranks[tuple(slice(None) if d == dim else where[d] for d in range(len(shape)))]
        groups.append(group_of_ranks(along.tolist()))
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def get_rank() -> int:
    """Global rank (launcher RANK, or 0 on a single device); within a rank group
    (:func:`use_rank_group`), the rank in that group."""
    if is_distributed():
        return dist.get_rank(_group())
    return int(os.environ.get("RANK", 0))


def get_local_rank() -> int:
    """Rank within the node, used for device selection."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_size() -> int:
    """Number of processes (launcher WORLD_SIZE, or 1 on a single device); within a rank group,
    its size."""
    if is_distributed():
        return dist.get_world_size(_group())
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    """Whether this is rank 0 (always True on a single device)."""
    return get_rank() == 0


def require_process_group(what: str) -> None:
    """Raise a clear error when ``what`` needs torch.distributed and none is running."""
    if not is_distributed():
        raise RuntimeError(
            f"{what} needs a torch.distributed process group, and none is initialised. "
            "Launch with torchrun (for example `torchrun --nproc_per_node=2 train.py`) and "
            "call agilerl.distributed.init_distributed() first. Constructing an FSDPConfig "
            "needs no process group; applying one does."
        )


def _collective_device() -> torch.device:
    """Device whose tensors the default group's backend can reduce."""
    backend = str(dist.get_backend())
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def barrier() -> None:
    """Synchronise all processes (of the rank group); no-op on a single device."""
    if is_distributed():
        dist.barrier(group=_group())


def broadcast_object_list(objects: list, src: int = 0) -> list:
    """Broadcast picklable objects from ``src`` (a rank of the rank group); mutates ``objects`` in place."""
    if is_distributed() and get_world_size() > 1:
        group = _group()
        origin = dist.get_global_rank(group, src) if group is not None else src
        dist.broadcast_object_list(objects, src=origin, group=group, device=_collective_device())
    return objects


def _as_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(np.asarray(value))


def gather_tensor(tensor: torch.Tensor | np.ndarray | float) -> torch.Tensor:
    """Gather a tensor from every rank (identity on a single device).

    0-d inputs are stacked into a 1-d tensor of world-size values; inputs with
    one or more dims are concatenated along dim 0 in rank order. Ranks may hold
    different dim-0 sizes (they are padded for the collective and trimmed).
    """
    local = _as_tensor(tensor)
    if not is_distributed() or get_world_size() == 1:
        return local
    world, group = get_world_size(), _group()
    device = _collective_device()
    original_device = local.device
    if local.dim() == 0:
        out = [torch.empty((), dtype=local.dtype, device=device) for _ in range(world)]
        dist.all_gather(out, local.detach().to(device), group=group)
        return torch.stack(out).to(original_device)
    sizes = torch.tensor([local.shape[0]], dtype=torch.long, device=device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    counts = [int(s.item()) for s in all_sizes]
    longest = max(counts)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[: local.shape[0]] = local.detach().to(device)
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:n] for o, n in zip(out, counts)]).to(original_device)


def gather_objects(objects: list) -> list:
    """Flatten object lists gathered from every rank, in rank order."""
    if not is_distributed() or get_world_size() == 1:
        return list(objects)
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, list(objects), group=_group())
    return [o for rank_objects in out for o in rank_objects]


def allreduce_minmax_int(value: int) -> tuple[int, int]:
    """Return (min, max) of ``value`` across ranks in one all-reduce."""
    if not is_distributed() or get_world_size() == 1:
        return int(value), int(value)
    t = torch.tensor([-int(value), int(value)], dtype=torch.long, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group())
    return int(-t[0].item()), int(t[1].item())


def _local_mean(value) -> float:
    t = _as_tensor(value).detach()
    if t.numel() == 0:
        return math.nan
    return float(t.double().mean().item())


def aggregate_metrics_across_gpus(metric_tensor: torch.Tensor | np.ndarray | float) -> float:
    """Mean across ranks of each rank's local mean (local mean on one device)."""
    local = _local_mean(metric_tensor)
    if not is_distributed() or get_world_size() == 1:
        return local
    t = torch.tensor([local], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_group())
    return float(t.item()) / get_world_size()


def aggregate_metrics_dict(
    metrics: dict[str, torch.Tensor | np.ndarray | float],
    excluded: Collection[str] = (),
    maximized: Collection[str] = (),
) -> dict[str, float]:
    """Reduce every metric across ranks in one all-reduce.

    Each rank writes its local means and "counts this metric" flags into its own
    row of a ``[world, 2 * K]`` zero matrix; one SUM all-reduce then holds every
    rank's row, from which means (over ranks that count the metric) and maxima
    (over all ranks) are taken locally. A metric every rank excludes is NaN.
    """
    unknown = (set(excluded) | set(maximized)) - set(metrics)
    if unknown:
        raise KeyError(f"excluded/maximized name metrics not in the dict: {sorted(unknown)}")
    names = list(metrics)
    local = [_local_mean(metrics[k]) for k in names]
    if not is_distributed() or get_world_size() == 1:
        return dict(zip(names, local))
    world, rank = get_world_size(), get_rank()
    k = len(names)
    table = torch.zeros((world, 2 * k), dtype=torch.float64, device=_collective_device())
    for i, name in enumerate(names):
        counted = name in maximized or name not in excluded
        if counted:
            table[rank, i] = local[i]
            table[rank, k + i] = 1.0
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=_group())
    values, counts = table[:, :k].cpu(), table[:, k:].cpu()
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        if name in maximized:
            out[name] = float(values[:, i].max().item())
            continue
        n = float(counts[:, i].sum().item())
        out[name] = float(values[:, i].sum().item()) / n if n > 0 else math.nan
    return out


#: The most bytes one coalesced all-reduce flattens (as DDP's buckets): LoRA adapters fit in one,
#: a fully fine-tuned model's gradients go in many, never in one copy of them all.
ALL_REDUCE_BUCKET_BYTES = 64 * 2**20


def _size_buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _coalesced_mean_(grads: list[torch.Tensor], group=None) -> None:
    """Average tensors across ``group``'s ranks in place: one all-reduce per (device, dtype) and
    bucket of at most :data:`ALL_REDUCE_BUCKET_BYTES` (a larger tensor alone, reduced in place
    where it can be)."""
    group = group if group is not None else _group()
    world = dist.get_world_size(group)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.device, g.dtype), []).append(g)
    comm_device = _collective_device()
    for (device, _), same in buckets.items():
        for tensors in _size_buckets(same, ALL_REDUCE_BUCKET_BYTES):
            alone = len(tensors) == 1 and tensors[0].is_contiguous() and device.type == comm_device.type
            flat = tensors[0] if alone else torch.cat([t.reshape(-1) for t in tensors]).to(comm_device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # SUM then divide: AVG is not on gloo
            flat.div_(world)
            if alone:
                continue
            flat = flat.to(device)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def _local(t: torch.Tensor) -> torch.Tensor:
    # A replicated-placement DTensor grad is averaged through its local tensor.
    return t.to_local() if hasattr(t, "to_local") else t


def sync_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Average gradients across data-parallel ranks, coalesced: one all-reduce per device,
    dtype and 64 MiB bucket.

    Parameters without a ``.grad`` are skipped; use :func:`all_reduce_grads` when
    ranks may differ in which parameters received a gradient.
    """
    if not is_distributed() or get_world_size() == 1:
        return
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        _coalesced_mean_(grads)


def all_reduce_grads(params: Sequence[torch.nn.Parameter], group=None) -> None:
    """Average gradients like :func:`sync_grads`; a parameter without a ``.grad``
    takes part with zeros (and receives the average), so every rank joins the
    same collective. ``group`` limits it to those ranks (default: the rank group the
    helpers act on, :func:`use_rank_group`, else every rank)."""
    group = group if group is not None else _group()
    if not is_distributed() or dist.get_world_size(group) == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(_local(p.grad))
    if grads:
        _coalesced_mean_(grads, group)


def resolve_device(requested: str | torch.device | None = None) -> str:
    """Pick the training device.

    Distributed runs are pinned to ``cuda:<local_rank>``, or CPU without CUDA;
    otherwise the requested device (or the best available) is used.
    """
    if is_distributed() or _launched():
        if torch.cuda.is_available() and (requested is None or "cpu" not in str(requested)):
            return f"cuda:{get_local_rank()}"
        return "cpu"
    if requested is not None:
        return str(requested)
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"
