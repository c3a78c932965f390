"""GPU-only terms: the CUDA context, cuBLAS' workspaces, the caching allocator's fragmentation
and NCCL's communicator buffers, and the host memory of the trainer process."""

from __future__ import annotations

from collections.abc import Iterable

from ._allocator import MIB, CachingAllocator
from ._context import Context
from ._logits import chunk_rows
from ._static import stored_tensor_bytes
from ._units import Layout

#: Components the caching allocator hands out and takes back within a step, where its
#: blocks fragment (a fitted fraction of them); the weights, adapters and optimizer state are
#: allocated once, and what their segments hold beyond them is counted
#: (:func:`weight_segment_bytes`); vLLM's memory is its own pool.
CHURNING = ("activations", "logits", "gradients", "kv_cache", "weights_gathered", "comm_buffers")


def allocator_blocks(requests: Iterable[int]) -> tuple[int, int]:
    """(segments reserved, bytes of the blocks handed out) by the CUDA caching allocator for
    ``requests`` made in that order and kept (never freed), under its rules
    (:class:`~planner.memory._allocator.CachingAllocator`). ``torch.cuda.memory_reserved()``
    and ``memory_allocated()`` read these two (the latter counts blocks, not requests: a 43 MiB
    weight in a 44 MiB segment it cannot split is 44 MiB allocated)."""
    allocator = CachingAllocator()
    for request in requests:
        allocator.malloc(request)
    return allocator.reserved, allocator.allocated


def segment_bytes(requests: Iterable[int]) -> int:
    """Bytes of the segments the CUDA caching allocator reserves for ``requests`` made in that
    order and kept (:func:`allocator_blocks`)."""
    return allocator_blocks(requests)[0]


def weight_segment_bytes(ctx: Context, layout: Layout) -> int:
    """What the caching allocator's segments hold beyond the base weights on a GPU: each
    stored tensor (rank 0's shard under FSDP2, which allocates each parameter's shard on its
    own) is its own request, in the model's order (:func:`segment_bytes`). A 43 MiB MLP
    weight of Qwen2.5-3B takes a 44 MiB segment it cannot share, two 8 MiB projections a
    20 MiB one whose last 4 MiB the next layer's cannot use: 0.25 GiB over Qwen2.5-3B's
    5.75 GiB, 0.05 GiB over Qwen2.5-0.5B's 0.92. On the public A100 rows the trainer's side of
    each training peak (the peak less the sleeping engine's floor the rig measured) was short
    by 0.16-0.26 GiB a model before this was counted (benchmarks/gpu_public.py). With
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` segments grow in place and this is
    about 0; the estimate assumes the default. 0 on a CPU run."""
    if not ctx.on_gpu:
        return 0
    key = ("segments", ctx.stored_bytes, ctx.fsdp is None, ctx.shard_group)
    if key not in layout.sums:
        requests = stored_tensor_bytes(ctx, layout)
        layout.sums[key] = max(0, segment_bytes(requests) - sum(requests))
    return layout.sums[key]


#: cuBLASLt's own workspace per handle, PyTorch's default (CUBLASLT_WORKSPACE_SIZE unset: 1024 KiB)
CUBLASLT_WORKSPACE = MIB
#: cuBLAS handles a training step uses: one per thread (PyTorch's handle pool is per thread), the
#: forward's on the Python thread and the backward's on autograd's thread for the device
CUBLAS_THREADS = 2


def cublas_workspace_bytes(ctx: Context, threads: int = CUBLAS_THREADS) -> int:
    """PyTorch's cuBLAS and cuBLASLt workspaces: each (handle, stream) gets its own from the
    caching allocator at its first matmul and keeps it for the process's life, so from the
    first step on every phase holds those of the forward's thread and autograd's backward
    thread: ``threads`` (CUBLAS_THREADS; 1 where only generate runs) x (the GPU's
    cublas_workspace_bytes + CUBLASLT_WORKSPACE). On an
    H200 that is 66 MiB, and it is what one Qwen2.5-0.5B and one Qwen2.5-1.5B probe's step
    phase held beyond the counted tensors and the weights' blocks (66 + 7.9 MiB counted,
    74.3 measured; 66 + 0.9 counted, 67.5 measured: benchmarks/results/gpu_nvidia-h200.txt).
    0 on a CPU run."""
    if not ctx.on_gpu:
        return 0
    return threads * thread_workspace_bytes(ctx)


def thread_workspace_bytes(ctx: Context) -> int:
    """One thread's handle's workspaces: cuBLAS' (the GPU's) and cuBLASLt's."""
    return ctx.cluster.gpu.cublas_workspace_bytes + CUBLASLT_WORKSPACE


def gpu_overheads(
    ctx: Context, components: dict[str, int], layout: Layout | None = None, *, matmul_threads: int = CUBLAS_THREADS
) -> dict[str, int]:
    """On a GPU: the device's CUDA context, the cuBLAS workspaces of the ``matmul_threads``
    threads that have run a matmul (:func:`cublas_workspace_bytes`; 0 before the first step, as
    in loading; 1 where only generate runs, as on an engine rank of its own),
    the allocator's slack (allocator_slack_fraction x the churning components, and what the
    base weights' segments hold beyond them while the weights are on the device:
    :func:`weight_segment_bytes`), and nccl_bytes with more than one GPU. None on a CPU run."""
    if not ctx.on_gpu:
        return {}
    k = ctx.coefficients
    churning = sum(v for name, v in components.items() if name in CHURNING)
    resident = components.get("weights", 0) or components.get("weights_replicated", 0)
    segments = weight_segment_bytes(ctx, layout) if resident and layout is not None else 0
    slack = int(churning * k.allocator_slack_fraction) + segments
    if matmul_threads > 1:  # autograd's thread has run a matmul
        slack = max(0, slack - cached_workspace_bytes(ctx))
    return {
        "cuda_context": ctx.cluster.gpu.cuda_context_bytes,
        **({"cublas_workspace": cublas_workspace_bytes(ctx, matmul_threads)} if matmul_threads else {}),
        "allocator_slack": slack,
        **({"nccl_buffers": k.nccl_bytes} if ctx.num_gpus > 1 else {}),
    }


def host_process_bytes(ctx: Context) -> int:
    """Host memory of a trainer process before the model (host_process_bytes)."""
    return ctx.coefficients.host_process_bytes


def no_grad_pass_first(ctx: Context) -> bool:
    """Whether a no-grad pass (the reference's, or the sampling policy's) runs before the learn
    pass in a step, leaving its logits tiles' segments cached for the learn pass to take."""
    return ctx.workload.has_reference or ctx.workload.has_old_policy_pass


def cached_workspace_bytes(ctx: Context) -> int:
    """Autograd's thread's cuBLAS workspaces, where they take no segment of their own: that
    thread's handle takes them at the first backward matmul of the first step, and after a
    no-grad pass (:func:`no_grad_pass_first`) the caching allocator serves them from the
    blocks that pass's logits tiles left cached (the fp32 tile's segment, chunk rows x V x 4,
    holds them). They are allocated (in cublas_workspace) but reserve nothing more, so the
    allocator's slack is that much less. The replay of the trainer's trace with each thread's
    workspaces taken at its first matmul (planner.probe.allocator, benchmarks/allocator_replay.py)
    reproduces the H200's reserved peaks of Qwen2.5-0.5B and 1.5B to 1 MiB in all six phases;
    with both taken up front it read 32-34 MiB over and 180-182 MiB under. 0 on a CPU run."""
    if not ctx.on_gpu or not no_grad_pass_first(ctx):
        return 0
    per_thread = thread_workspace_bytes(ctx)
    return per_thread if chunk_rows(ctx) * ctx.vocab_size * 4 >= per_thread else 0


def learn_tile_segment_bytes(ctx: Context) -> int:
    """A second segment for the learn phase's fp32 logits tile, on a GPU, when a no-grad pass
    ran before it in the step (:func:`no_grad_pass_first`).

    That pass leaves its logits tiles' segments cached (each tile above 10 MiB has a segment
    of its own: one in the compute dtype, one fp32). The learn forward's saved activations
    then take the smallest cached blocks that fit, and once the small ones are used they
    carve the compute-dtype tile's segment; that tile then splits the fp32 one, and the fp32
    tile gets a new segment of its size, which the allocator keeps: chunk rows x V x 4. The
    allocator's replay of the trainer's first two steps (planner.probe.allocator over a trace
    recorded on CPU, benchmarks/allocator_replay.py) shows exactly that one new 594 MiB
    segment in the learn phase of Qwen2.5-0.5B and of 1.5B, and reproduces the H200's
    allocated peaks of both to 1 MiB. 0 on a CPU run."""
    if not ctx.on_gpu or not no_grad_pass_first(ctx):
        return 0
    return chunk_rows(ctx) * ctx.vocab_size * 4
