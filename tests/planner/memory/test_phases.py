"""planner.memory._phases: a phase is the larger of its moments, with the GPU terms on top."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.hardware import GPUS
from planner.memory import Coefficients
from planner.memory._overheads import cublas_workspace_bytes, weight_segment_bytes
from planner.memory._phases import larger, load_phase, make_phase, reference_phase, shared_terms
from planner.memory._units import build_layout
from planner.models import load_model_spec

from .conftest import DENSE, make_context


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


def test_which_forwards_gather_the_units_again_without_resharding(dense_spec):
    # FSDP2 reshards every unit after its backward; under reshard_after_forward=False a forward
    # after one gathers them again (regathering), one after a no-grad forward finds them gathered
    from agilerl.distributed import FSDPConfig
    from planner.memory._phases import regathering

    def case(**update):
        one = {"micro_batch_size_per_gpu": 8}  # a rank's 8 completions in one micro-batch
        ctx = make_context(dense_spec, fsdp=FSDPConfig(reshard_after_forward=False), **{**one, **update})
        return regathering(ctx)

    # generate leaves the actor gathered: the reference pass finds it so, and so does the only
    # learn micro-batch, after the reference pass or after generate alone
    assert case(generation="hf", beta=0.04) == (False, False)
    assert case(generation="hf", beta=0.0) == (False, False)
    # a later learn micro-batch follows a backward
    assert case(generation="hf", beta=0.04, micro_batch_size_per_gpu=2) == (False, True)
    assert case(generation="hf", beta=0.0, update_epochs=2) == (False, True)
    # no rollout on the actor (vLLM, or none): the first forward of the step gathers again
    assert case(generation="vllm", beta=0.04) == (True, False)
    assert case(generation="vllm", beta=0.0) == (True, True)
    assert case(generation="none", beta=0.0) == (True, True)
    # gathered once for generate and the no-grad passes: both reshard at their end
    assert case(generation="hf", beta=0.04, gather_weights_for_rollout=True) == (True, True)
    # a full fine-tune's reference is a model of its own, resharded after its pass; the actor is
    # still as generate left it
    assert case(generation="hf", beta=0.04, full_finetune=True, lora_rank=None) == (True, False)


def test_a_block_units_post_backward_starts_beside_the_input_the_unit_before_kept():
    from planner.memory._gathered import PostBackwardWindows
    from planner.memory._phases import block_post_backward
    from planner.memory._static import GradientTerms

    # two block units after a trained head (its change 10); each makes 50 bytes of gradient, then
    # reduce-scatters 100 through an output of 5. The last block starts beside nothing held (the
    # head's input, 0 here); the first starts beside the last's 200. Each starts under the window
    # 7; the last reduce-scatters under 4 (its prefetch), the first under 3, later, beside more.
    windows = PostBackwardWindows(head=0, block=7, block_reducing=(3, 4), end=0)
    grads = GradientTerms(
        prior=0, head=10, per_unit=(1, 2), unit_reducing=((5, 100), (5, 100)), unit_entering=((50, 200), (50, 0))
    )
    assert block_post_backward(grads, windows) == ((7, 10 + 2 + 50, 200), (3, 10 + 2 + 5, 100))
    # a wider window picks the last block's reduce-scatter
    wide = PostBackwardWindows(head=0, block=7, block_reducing=(3, 10), end=0)
    assert block_post_backward(grads, wide)[1] == (10, 10 + 5, 100)


def test_the_embeddings_reduce_scatter_resharded_with_their_gradient_freed(dense_spec):
    from planner.memory._phases import _embed_reduce_moment
    from planner.memory._static import GradientTerms

    class _Terms:
        class gathered:
            root_bytes = 3

    # held once every other unit reduce-scattered: 40, of which 16 the tied head's summed gradient,
    # by now the embeddings' own, freed once copied into the reduce-scatter input (64); under
    # deferred sync their accumulated gradient (in the 40) is freed too (embed_reducing, -8)
    tied = make_context(load_model_spec(DENSE + "&tie_word_embeddings=true"), fsdp=FSDPConfig(), full_finetune=True)
    _Terms.layout = build_layout(tied)
    grads = GradientTerms(prior=0, tied_head=16, embed_reducing=-8, embed_buffer=64)
    (moment,) = _embed_reduce_moment(_Terms, grads, 40, 1)
    # tied: the embeddings are the root's, which reshards before its reduce-scatter
    assert moment == {"weights_gathered": 0, "gradients": 40 - 16 - 8, "activations": 1, "comm_buffers": 64}
    # untied: a unit of their own, the root (the final norm) still gathered beside
    _Terms.layout = build_layout(make_context(dense_spec, fsdp=FSDPConfig(), full_finetune=True))
    (moment,) = _embed_reduce_moment(_Terms, GradientTerms(prior=0, embed_buffer=64), 40, 1)
    assert moment["weights_gathered"] == 3 and moment["gradients"] == 40
