"""The entry points: estimate() and the trainer's choice of the expert chunk size."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig

from ..hardware import MARGIN_FRACTION, Cluster
from ..spec import ModelSpec
from ..workload import Workload
from ._coefficients import Coefficients
from ._context import build_context
from ._parallel import row_wise_experts
from ._phases import assemble
from ._result import Estimate

#: What FSDPConfig.routed_expert_chunk_mib=None picks from, as documented: the largest that fits.
EXPERT_CHUNKS_MIB = (64, 128, 256, 512)


def estimate(
    spec: ModelSpec,
    workload: Workload,
    cluster: Cluster,
    fsdp: FSDPConfig | None,
    *,
    coefficients: Coefficients | None = None,
) -> Estimate:
    """Per-rank memory of a training run (any ``Workload.algorithm``) by phase and component
    (see the package docstring)."""
    k = coefficients or Coefficients()
    if fsdp is not None and fsdp.routed_expert_chunk_mib is None and spec.is_moe and row_wise_experts(spec):
        # agilerl's GRPO resolves None before sharding (FSDPConfig's documented choice).
        chunk, _ = resolve_expert_chunk(spec, workload, cluster, fsdp, coefficients=k)
        est = estimate(
            spec, workload, cluster, fsdp.model_copy(update={"routed_expert_chunk_mib": chunk}), coefficients=k
        )
        note = f"routed_expert_chunk_mib=None: the trainer picks {chunk} MiB (the largest of 64/128/256/512 that fits)"
        return est.model_copy(update={"notes": (*est.notes, note)})
    return assemble(build_context(spec, workload, cluster, fsdp, coefficients=k))


def resolve_expert_chunk(
    spec: ModelSpec, workload: Workload, cluster: Cluster, fsdp: FSDPConfig, *, coefficients: Coefficients | None = None
) -> tuple[int, dict[int, int]]:
    """routed_expert_chunk_mib=None as the trainer resolves it: the largest of EXPERT_CHUNKS_MIB
    whose estimated peak leaves MARGIN_FRACTION of the GPU free, else the smallest.

    Returns the chunk and the estimated peak at every candidate.
    """
    limit = cluster.gpu.memory_bytes * (1 - MARGIN_FRACTION)
    peaks = {
        chunk: estimate(
            spec,
            workload,
            cluster,
            fsdp.model_copy(update={"routed_expert_chunk_mib": chunk}),
            coefficients=coefficients,
        ).peak_bytes
        for chunk in EXPERT_CHUNKS_MIB
    }
    fitting = [chunk for chunk, peak in peaks.items() if peak <= limit]
    return (fitting[-1] if fitting else EXPERT_CHUNKS_MIB[0]), peaks


def vllm_floor(spec: ModelSpec, workload: Workload, cluster: Cluster, fsdp: FSDPConfig | None) -> int:
    """Bytes a colocated vLLM engine's budget must hold to start (0 without one):
    :func:`._generation.vllm_floor_bytes`."""
    from ._generation import vllm_floor_bytes

    return vllm_floor_bytes(build_context(spec, workload, cluster, fsdp, coefficients=Coefficients()))


def vllm_budget_problem(spec: ModelSpec, workload: Workload, cluster: Cluster, fsdp: FSDPConfig | None) -> str | None:
    """Why the engine budget the workload gives cannot start a colocated vLLM engine, or None
    (also when the workload leaves the budget to the planner, before the context resolves it to
    a default): :func:`._generation.vllm_budget_problem`."""
    from ._generation import vllm_budget_problem as problem

    if workload.vllm_gpu_memory_utilization is None and workload.vllm_kv_cache_memory_bytes is None:
        return None

    return problem(build_context(spec, workload, cluster, fsdp, coefficients=Coefficients()))
