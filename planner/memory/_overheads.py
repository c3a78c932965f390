"""GPU-only terms: the CUDA context, the caching allocator's fragmentation and NCCL's
communicator buffers, and the host memory of the trainer process."""

from __future__ import annotations

from ._context import Context

#: Components the caching allocator hands out and takes back within a step, where its
#: blocks fragment; the weights, adapters and optimizer state are allocated once (and
#: vLLM's memory is its own pool), so they pack without slack.
CHURNING = ("activations", "logits", "gradients", "kv_cache", "weights_gathered", "comm_buffers")


def gpu_overheads(ctx: Context, components: dict[str, int]) -> dict[str, int]:
    """On a GPU: the device's CUDA context, allocator_slack_fraction x the churning
    components, and nccl_bytes with more than one GPU. None on a CPU run."""
    if not ctx.on_gpu:
        return {}
    k = ctx.coefficients
    churning = sum(v for name, v in components.items() if name in CHURNING)
    return {
        "cuda_context": ctx.cluster.gpu.cuda_context_bytes,
        "allocator_slack": int(churning * k.allocator_slack_fraction),
        **({"comm_buffers": k.nccl_bytes} if ctx.num_gpus > 1 else {}),
    }


def host_process_bytes(ctx: Context) -> int:
    """Host memory of a trainer process before the model (host_process_bytes)."""
    return ctx.coefficients.host_process_bytes
