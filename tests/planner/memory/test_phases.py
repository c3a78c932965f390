"""planner.memory._phases: a phase is the larger of its moments, with the GPU terms on top."""

from __future__ import annotations

from planner.hardware import GPUS
from planner.memory import Coefficients
from planner.memory._overheads import cublas_workspace_bytes, weight_segment_bytes
from planner.memory._phases import larger, load_phase, make_phase, reference_phase, shared_terms
from planner.memory._units import build_layout

from .conftest import make_context


def test_larger_takes_the_bigger_moment_first_on_a_tie():
    a, b = {"x": 3, "y": 1}, {"x": 1, "z": 3}
    assert larger(a, b) is a and larger(b, a) is b
    assert larger(a, {"x": 5}) == {"x": 5}


def test_a_phase_drops_empty_components_and_adds_the_gpu_terms(dense_spec):
    gpu = GPUS["A100-80GB"]
    ctx = make_context(dense_spec, gpu=gpu, gpus=1)
    layout = build_layout(ctx)
    terms = shared_terms(ctx, layout)
    phase = make_phase(ctx, terms, {"weights": 1000.9, "logits": 0, "activations": 2000, "allocator_slack": 5})
    slack = int(2000 * Coefficients().allocator_slack_fraction)
    segments = weight_segment_bytes(ctx, layout)  # the weights are on the device (test_overheads.py)
    assert segments > 0
    assert phase.components == {
        "weights": 1000,
        "activations": 2000,
        "allocator_slack": 5 + slack + segments,
        "cuda_context": gpu.cuda_context_bytes,
        "cublas_workspace": cublas_workspace_bytes(ctx),
    }
    assert phase.host == {"host_process": Coefficients().host_process_bytes}
    assert "cublas_workspace" not in load_phase(ctx, terms).components  # before the first matmul
    parked = make_phase(ctx, terms, {"weights": 0, "activations": 2000})  # the weights on the host
    assert parked.components["allocator_slack"] == slack


def test_no_reference_phase_without_kl_or_a_second_epoch(dense_spec):
    ctx = make_context(dense_spec, beta=0.0, update_epochs=1)
    assert reference_phase(ctx, shared_terms(ctx, build_layout(ctx))) is None
    ctx = make_context(dense_spec, beta=0.0, update_epochs=2)
    assert reference_phase(ctx, shared_terms(ctx, build_layout(ctx))) is not None


def test_the_step_counts_the_runtimes_gradient_buckets():
    # planner.memory cannot import the runtime (torch): its copy of the bucket size must be the runtime's
    from agilerl.distributed._runtime import ALL_REDUCE_BUCKET_BYTES as runtime
    from planner.memory._phases import ALL_REDUCE_BUCKET_BYTES as planner

    assert planner == runtime
