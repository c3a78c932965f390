"""GPU-only terms: the CUDA context, the caching allocator's fragmentation and NCCL's
communicator buffers, and the host memory of the trainer process."""

from __future__ import annotations

from ._context import Context


def gpu_overheads(ctx: Context, allocated: int) -> dict[str, int]:
    """On a GPU: the device's CUDA context, allocator_slack_fraction x ``allocated``, and
    nccl_bytes with more than one GPU. None on a CPU run."""
    if not ctx.on_gpu:
        return {}
    k = ctx.coefficients
    return {
        "cuda_context": ctx.cluster.gpu.cuda_context_bytes,
        "allocator_slack": int(allocated * k.allocator_slack_fraction),
        **({"comm_buffers": k.nccl_bytes} if ctx.num_gpus > 1 else {}),
    }


def host_process_bytes(ctx: Context) -> int:
    """Host memory of a trainer process before the model (host_process_bytes)."""
    return ctx.coefficients.host_process_bytes
