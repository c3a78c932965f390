"""planner.memory._overheads: GPU-only terms."""

from __future__ import annotations

from planner.hardware import GPUS
from planner.memory import Coefficients
from planner.memory._overheads import gpu_overheads

from .conftest import make_context


def test_gpu_terms_only_on_gpus(dense_spec):
    k = Coefficients()
    gpu = GPUS["A100-80GB"]
    components = {"weights": 5 * 10**9, "activations": 10**9, "vllm": 10**9}
    assert gpu_overheads(make_context(dense_spec), components) == {}
    # slack only on what the allocator hands out and takes back within a step
    mib = 2**20
    assert gpu_overheads(make_context(dense_spec, gpu=gpu), components) == {
        "cuda_context": gpu.cuda_context_bytes,
        # two threads' cuBLAS workspaces (8 MiB + 128 KiB off Hopper) and cuBLASLt's (1 MiB each)
        "cublas_workspace": 2 * (8 * mib + 128 * 1024 + mib),
        "allocator_slack": int(10**9 * k.allocator_slack_fraction),
        "nccl_buffers": k.nccl_bytes,
    }
    single = gpu_overheads(make_context(dense_spec, gpu=gpu, gpus=1), components)
    assert "nccl_buffers" not in single  # no NCCL on one GPU
    # Hopper's default workspace is 32 MiB; none before the first matmul (loading the weights)
    hopper = gpu_overheads(make_context(dense_spec, gpu=GPUS["H200"], gpus=1), components)
    assert hopper["cublas_workspace"] == 2 * (32 * mib + mib)
    loading = gpu_overheads(make_context(dense_spec, gpu=gpu, gpus=1), components, matmul_threads=0)
    assert "cublas_workspace" not in loading
    generate_only = gpu_overheads(make_context(dense_spec, gpu=gpu, gpus=1), components, matmul_threads=1)
    assert generate_only["cublas_workspace"] == 8 * mib + 128 * 1024 + mib


def test_segments_follow_the_caching_allocators_rules():
    from planner.memory._overheads import segment_bytes

    mib = 2**20
    # above 10 MiB a request takes a segment of its own, rounded up to 2 MiB: the 1 MiB left
    # is not over 1 MiB, so it is not split off for anyone else (Qwen2.5-3B's 43 MiB MLP weights)
    assert segment_bytes([2048 * 11008 * 2] * 3) == 3 * 44 * mib
    # 1-10 MiB requests share 20 MiB segments: two 8 MiB projections fit one, a third opens another
    assert segment_bytes([8 * mib] * 2) == 20 * mib
    assert segment_bytes([8 * mib] * 3) == 40 * mib
    # the 4 MiB left in a segment serves a later request that fits it
    assert segment_bytes([8 * mib, 8 * mib, 3 * mib]) == 20 * mib
    # up to 1 MiB requests pack into 2 MiB segments, rounded to 512 bytes
    assert segment_bytes([mib, mib, 1]) == 4 * mib
    assert segment_bytes([100] * 4096) == 2 * mib
    assert segment_bytes([]) == 0


def test_blocks_not_split_are_handed_out_whole():
    from planner.memory._overheads import allocator_blocks

    mib = 2**20
    mlp = 2048 * 11008 * 2  # 43 MiB: its 44 MiB segment's last 1 MiB stays in its block
    assert allocator_blocks([mlp]) == (44 * mib, 44 * mib)
    # an 8 MiB projection is split off a 20 MiB segment; the next one too; the 4 MiB left stays free
    assert allocator_blocks([8 * mib, 8 * mib]) == (20 * mib, 16 * mib)
    # a 19.5 MiB request (above 10 MiB) rounds to 20 MiB; 0.5 MiB is not over 1 MiB: handed out whole
    assert allocator_blocks([19 * mib + mib // 2]) == (20 * mib, 20 * mib)
    # small requests round to 512 bytes and split their 2 MiB segment
    assert allocator_blocks([100, 600]) == (2 * mib, 512 + 1024)


def test_the_weights_segments_count_on_gpus_while_the_weights_are_on_the_device(dense_spec):
    from planner.memory._overheads import weight_segment_bytes
    from planner.memory._units import build_layout

    gpu = GPUS["A100-80GB"]
    cpu_ctx = make_context(dense_spec, gpus=1)
    assert weight_segment_bytes(cpu_ctx, build_layout(cpu_ctx)) == 0
    ctx = make_context(dense_spec, gpu=gpu, gpus=1)
    layout = build_layout(ctx)
    segments = weight_segment_bytes(ctx, layout)
    weights = sum(t.numel * ctx.stored_bytes for t in layout.base_tensors)
    assert 0 < segments < weights  # what the segments hold beyond the weights, not the weights again
    components = {"weights": weights, "activations": 10**9}
    slack = int(10**9 * Coefficients().allocator_slack_fraction)
    assert gpu_overheads(ctx, components, layout)["allocator_slack"] == slack + segments
    parked = {"weights": 0, "activations": 10**9}  # rollout with the weights on the host
    assert gpu_overheads(ctx, parked, layout)["allocator_slack"] == slack


def test_the_learn_phase_reserves_a_second_fp32_tile_after_a_no_grad_pass(dense_spec):
    from planner.memory._logits import chunk_rows
    from planner.memory._overheads import learn_tile_segment_bytes
    from planner.memory._phases import learn_phase, shared_terms
    from planner.memory._units import build_layout

    gpu = GPUS["H200"]
    ctx = make_context(dense_spec, gpu=gpu, gpus=1)  # GRPO with a KL term: the reference pass runs first
    tile = chunk_rows(ctx) * ctx.vocab_size * 4
    assert tile > 0 and learn_tile_segment_bytes(ctx) == tile
    # no no-grad pass before learn (no KL term, one epoch): nothing carved, nothing re-reserved
    assert learn_tile_segment_bytes(make_context(dense_spec, gpu=gpu, gpus=1, beta=0.0, update_epochs=1)) == 0
    assert learn_tile_segment_bytes(make_context(dense_spec, gpus=1)) == 0  # no allocator on a CPU run
    with_pass = learn_phase(ctx, shared_terms(ctx, build_layout(ctx))).components["allocator_slack"]
    plain = make_context(dense_spec, gpu=gpu, gpus=1, beta=0.0, update_epochs=1)
    without = learn_phase(plain, shared_terms(plain, build_layout(plain))).components["allocator_slack"]
    assert with_pass - without >= tile  # on top of the slack on what churns


def test_autograds_workspaces_take_no_segment_after_a_no_grad_pass():
    """The backward thread's cuBLAS workspaces (32 MiB + cuBLASLt's 1 MiB on an H200) are allocated
    at the first backward matmul, after the reference pass left its 1,024 x 151,936 fp32 logits
    tile's segment (594 MiB) cached: they are served from it, so the allocator's slack is that
    much less. Without a no-grad pass they take a segment of their own, as the forward's do."""
    from planner.models import load_model_spec

    spec = load_model_spec("Qwen/Qwen2.5-0.5B")
    k = Coefficients()
    mib = 2**20
    components = {"activations": 10**9}
    churn = int(10**9 * k.allocator_slack_fraction)
    h200 = GPUS["H200"]
    kl = make_context(spec, gpu=h200, gpus=1, beta=0.04, logprob_chunk_size=1024)
    plain = make_context(spec, gpu=h200, gpus=1, beta=0.0, update_epochs=1, logprob_chunk_size=1024)
    with_pass, without = gpu_overheads(kl, components), gpu_overheads(plain, components)
    assert with_pass["cublas_workspace"] == without["cublas_workspace"] == 2 * 33 * mib  # allocated either way
    assert with_pass["allocator_slack"] == churn - 33 * mib
    assert without["allocator_slack"] == churn
    # a second update epoch's old-policy pass leaves the same tiles cached
    epochs = make_context(spec, gpu=h200, gpus=1, beta=0.0, update_epochs=2, logprob_chunk_size=1024)
    assert gpu_overheads(epochs, components)["allocator_slack"] == churn - 33 * mib
    # before the first matmul (loading) there is no workspace to place
    assert gpu_overheads(kl, components, matmul_threads=0)["allocator_slack"] == churn
    # nor with no autograd thread (generate alone): its workspaces are not there to be served
    assert gpu_overheads(kl, components, matmul_threads=1)["allocator_slack"] == churn
    assert gpu_overheads(make_context(spec, beta=0.04), components) == {}  # a CPU run
