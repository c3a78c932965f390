"""The probe: real launches of the trainer on 2 gloo ranks, measured and judged."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from agilerl.distributed import FSDPConfig
from planner.probe import ProbeRequest, run_probe
from planner.workload import Workload

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

MODEL = "tiny:qwen2?hidden_size=64&intermediate_size=128&num_layers=2"
SMALL = Workload(
    prompts_per_step=2,
    group_size=2,
    prompt_tokens=8,
    completion_tokens=8,
    micro_batch_size_per_gpu=1,
    logprob_chunk_size=16,
    gradient_checkpointing=True,
    lora_rank=4,
    lora_alpha=8,
    weights_dtype="float32",
    attn_implementation="eager",
)
SHARD_ALL = dict(param_dtype="float32", param_persistence_threshold=0)


def _expected_local_bytes(world: int) -> dict[int, dict[str, int]]:
    """Each rank's parameter bytes, from FSDP2's dim-0 chunking rule, computed independently."""
    import math

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agilerl.utils.sources import parse_tiny
    from agilerl.utils.tiny import char_tokenizer, tiny_config

    arch, kw = parse_tiny(MODEL)
    kw.setdefault("vocab_size", len(char_tokenizer()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw))
        model = get_peft_model(
            model,
            LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
            adapter_name="actor",
        )
    out = {}
    num_lora = sum(1 for n, _ in model.named_parameters() if ".lora_" in n)
    for rank in range(world):
        weights = lora = 0
        for name, p in model.named_parameters():
            rows = p.shape[0]
            per = math.ceil(rows / world)
            local_rows = max(0, min(per, rows - rank * per))
            nbytes = local_rows * (p.numel() // rows) * 4
            if ".lora_" in name:
                lora += nbytes
            else:
                weights += nbytes
        weights += sum(b.numel() * 4 for b in model.buffers())
        out[rank] = {"weights": weights, "lora": lora, "num_lora": num_lora}
    return out


def test_two_rank_probe_measures_exact_parameter_bytes_and_judges_the_budget():
    m = run_probe(ProbeRequest(model=MODEL, workload=SMALL, fsdp=FSDPConfig(**SHARD_ALL), nproc=2, timed_steps=2))
    assert m.ok, m.failure
    assert m.moe_load_imbalance is None  # a dense model routes nothing
    expected = _expected_local_bytes(2)
    assert [r.rank for r in m.ranks] == [0, 1]
    for r in m.ranks:
        assert r.param_bytes["weights"] == expected[r.rank]["weights"]
        assert r.param_bytes["lora"] == expected[r.rank]["lora"]
        for phase in ("reference", "learn", "step"):
            rec = r.phases[phase]
            # The tracker's own count of sharded parameters agrees with the exact count.
            assert rec["tracker_params"] == rec["weights"] + rec["lora"], phase
            assert rec["total"] >= rec["weights"] + rec["lora"]
        # Fused AdamW: two fp32 moments per local element, and a 4-byte step tensor per parameter.
        assert r.phases["step"]["optimizer_state"] == 2 * expected[r.rank]["lora"] + 4 * expected[r.rank]["num_lora"]
        assert len(r.step_seconds) == 2 and all(s > 0 for s in r.step_seconds)
        # Where the rank's seconds went: each stage once, in order, within the launch's wall clock.
        assert list(r.stages) == ["setup", "load", "warmup", "measured", "timed"]
        assert all(v > 0 for v in r.stages.values()) and sum(r.stages.values()) < m.wall_seconds
        assert r.stages["timed"] >= sum(r.step_seconds) and r.stages["load"] >= r.load_seconds
    assert m.tokens_per_second > 0 and m.step_seconds_spread >= 0
    assert m.fits and m.peak_phase in {"reference", "learn", "step", "load"}
    table = m.table()
    assert "weights" in table and "tokens/s" in table

    # A budget below the measured peak is reported as not fitting.
    budget = m.peak_bytes // 2
    tight = run_probe(
        ProbeRequest(
            model=MODEL,
            workload=SMALL,
            fsdp=FSDPConfig(**SHARD_ALL),
            nproc=2,
            timed_steps=1,
            memory_budget_bytes=budget,
        )
    )
    assert tight.ok and not tight.fits
    assert tight.over_budget_phases and all(v > budget for v in tight.over_budget_phases.values())
    assert "does NOT fit" in tight.table()


def test_reshard_off_measures_a_higher_peak_on_a_parameter_dominated_workload():
    wide = "tiny:qwen2?hidden_size=256&intermediate_size=1024&num_layers=4&num_heads=4"
    workload = SMALL.model_copy(update={"prompt_tokens": 4, "completion_tokens": 4})
    peaks = {}
    for reshard in (True, False):
        m = run_probe(
            ProbeRequest(
                model=wide,
                workload=workload,
                timed_steps=1,
                nproc=2,
                fsdp=FSDPConfig(**SHARD_ALL, reshard_after_forward=reshard),
            )
        )
        assert m.ok, m.failure
        peaks[reshard] = (m.phase_total("learn"), m.phase_total("learn", key="weights_gathered"))
    assert peaks[False][1] > 1.5 * peaks[True][1], peaks
    assert peaks[False][0] > 1.2 * peaks[True][0], peaks


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_forward_with_grad_peaks_under_the_forward_window_and_the_estimate_counts_it(checkpointed):
    # Parameters dominate and 8-token rows keep almost nothing: the learn peak is a block's forward,
    # where FSDP2 holds the running unit twice (its all-gather output until the next copy-out) and
    # the prefetched next one: three units, where the backward holds two. Checkpointed or not: the
    # forward of a block that is not checkpointed was counted under the backward's window (the
    # learn estimate of a 2-rank tiny Qwen2 at 64 tokens read 11% low).
    from benchmarks._probe_cache import estimate_request, saved_coefficients

    wide = "tiny:qwen2?hidden_size=256&intermediate_size=1024&num_layers=4&num_heads=4"
    workload = SMALL.model_copy(
        update={
            "prompt_tokens": 4,
            "completion_tokens": 4,
            "weights_dtype": "bfloat16",
            "gradient_checkpointing": checkpointed,
        }
    )
    request = ProbeRequest(
        model=wide,
        workload=workload,
        timed_steps=1,
        nproc=2,
        fsdp=FSDPConfig(param_dtype="bfloat16", param_persistence_threshold=0),
    )
    m = run_probe(request)
    assert m.ok, m.failure
    gathered = m.phase_total("learn", key="weights_gathered")
    unit = _block_bytes(wide, lora_rank=workload.lora_rank)
    assert 3 * unit <= gathered < 3.1 * unit, gathered / unit
    learn = estimate_request(request, saved_coefficients("cpu")).phases["learn"]
    assert learn.total == pytest.approx(m.phase_total("learn"), rel=0.03)
    assert learn.components["weights_gathered"] == pytest.approx(gathered, rel=0.03)


GEMMA_SHARED = "hidden_size=128&intermediate_size=256&num_layers=6&num_heads=4&num_kv_heads=2&num_kv_shared_layers=2"


@pytest.mark.parametrize(
    "model",
    [
        f"tiny:gemma3n?{GEMMA_SHARED}",
        f"tiny:gemma3n?{GEMMA_SHARED.replace('layers=2', 'layers=0')}",
        f"tiny:gemma4?{GEMMA_SHARED}&use_double_wide_mlp=true",
    ],
)
def test_gemma_models_sharing_k_and_v_are_counted_in_every_pass(model):
    """Gemma-3n's and Gemma 4's forwards hold, beside the layer running, their streams and
    per-layer inputs and one rotary table per attention type; their last layers read the K and V
    two earlier layers keep for them (num_kv_shared_layers=2) and add no cache entry of their
    own; Gemma 4's generate runs those layers (here with double-wide MLPs) over the last prompt
    position only, and its global layers' q (twice the hidden width) peaks in its head norm.
    Before these were counted, Gemma-3n's reference pass read 4.2% low and its rollout 4.5% high;
    Gemma 4's could not train (its reference pass failed), and its estimate read 14% high. The
    same Gemma-3n without sharing is the control (its reference pass read 3.6% low before its
    streams and per-layer inputs beside the layers were counted, and its rollout 3% high, with or
    without sharing, before its layers' no-grad moments were counted one by one and generate's
    prefill stopped counting logits its blocks do not hold)."""
    from benchmarks._probe_cache import estimate_request, saved_coefficients

    workload = SMALL.model_copy(
        update={
            "prompts_per_step": 1,
            "padded_batches": False,
            "share_prompt_prefix": False,
            "lora_dropout": 0.0,
            "prompt_tokens": 128,
            "completion_tokens": 4,
            "micro_batch_size_per_gpu": 2,
            "logprob_chunk_size": 256,
            "lora_rank": 8,
            "lora_alpha": 16,
            "weights_dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "gradient_checkpointing": True,
            "generation": "hf",
        }
    )
    request = ProbeRequest(model=model, workload=workload, timed_steps=1, nproc=1, generate=True)
    m = run_probe(request)
    assert m.ok, m.failure
    phases = estimate_request(request, saved_coefficients("cpu")).phases
    assert phases["reference"].total == pytest.approx(m.phase_total("reference"), rel=0.02)
    assert phases["learn"].total == pytest.approx(m.phase_total("learn"), rel=0.02)
    assert phases["rollout"].total == pytest.approx(m.phase_total("rollout"), rel=0.01)


def test_a_no_grad_forward_pairs_each_layers_window_with_that_layers_own_activations():
    """Gemma 4 on 2 ranks, global and sliding layers interleaved (K/V sharing's control row of
    benchmarks/kv_sharing_memory.py): the prefill's widest block is a middle global layer, whose
    window is not the widest (the last unit's), and while it runs the prompt's cache holds the
    layers that have run only. Paired with the widest window and the whole cache, the rollout
    read 6.3% high."""
    from benchmarks.kv_sharing_memory import CONFIGS, request_for

    row = next(c for c in CONFIGS if c["model"] == "gemma4" and c["world"] == 2 and c["gc"])
    _probe_within(request_for(row, "cpu"), ("rollout", "reference"))


def test_a_generate_steps_first_copy_out_holds_the_step_befores_head():
    """An untied Qwen2 on 2 ranks whose embeddings and head (1 MiB each) outweigh a block (0.5
    MiB), 64 tokens a row (row 31 of benchmarks/accuracy.py). Generate is one forward of the root
    to FSDP2, so the head's all-gather output from a decode step is dropped only at the next
    step's first copy-out: three head-sized buffers at the rollout's peak. Counted without it,
    the rollout read 5.0% low."""
    import benchmarks.accuracy as accuracy
    from benchmarks._probe_cache import estimate_request, saved_coefficients

    row = next(c for c in accuracy.configurations() if c["id"] == 31)
    request = accuracy.request_for(row, "cpu")
    m = run_probe(request)
    assert m.ok, m.failure
    rollout = estimate_request(request, saved_coefficients("cpu")).phases["rollout"]
    assert rollout.total == pytest.approx(m.phase_total("rollout"), rel=0.02)
    assert rollout.components["weights_gathered"] == pytest.approx(
        m.phase_total("rollout", key="weights_gathered"), rel=0.02
    )


#: A tiny Qwen2 body (its vocabulary and head given by each test), and the probe settings of a
#: bf16 run of fixed-length rows that share nothing, without LoRA dropout.
QWEN2_BODY = "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2"
BF16_ROWS = {
    "padded_batches": False,
    "share_prompt_prefix": False,
    "lora_dropout": 0.0,
    "lora_rank": 8,
    "lora_alpha": 16,
    "weights_dtype": "bfloat16",
    "attn_implementation": "sdpa",
}


def _probe_within(request: ProbeRequest, phases: tuple[str, ...], rel: float = 0.02):
    """Run ``request``'s probe and check each phase's estimate against it; the measurement and
    the estimated phases, for more checks."""
    m = run_probe(request)
    assert m.ok, m.failure
    return m, _probe_within_measured(m, request, phases, rel=rel)


def _probe_within_measured(m, request: ProbeRequest, phases: tuple[str, ...], rel: float = 0.02):
    """Check each phase's estimate of ``request`` against the probe ``m``; the estimated phases."""
    from benchmarks._probe_cache import estimate_request, saved_coefficients

    estimated = estimate_request(request, saved_coefficients("cpu")).phases
    for phase in phases:
        assert estimated[phase].total == pytest.approx(m.phase_total(phase), rel=rel), phase
    return estimated


def _untied_without_resharding(**workload) -> ProbeRequest:
    """An untied Qwen2 on 2 ranks whose head (1 MiB) is twice a block, two completions a rank of
    32 + 32 tokens, under reshard_after_forward=False."""
    update = {
        "prompts_per_step": 1,
        "group_size": 4,
        "prompt_tokens": 32,
        "completion_tokens": 32,
        **BF16_ROWS,
        **workload,
    }
    return ProbeRequest(
        model=f"{QWEN2_BODY}&vocab_size=4096",
        workload=SMALL.model_copy(update=update),
        fsdp=FSDPConfig(param_dtype="bfloat16", reshard_after_forward=False, param_persistence_threshold=0),
        nproc=2,
        timed_steps=1,
        generate=update["generation"] != "none",
    )


def _assert_peaks_at_the_heads_copy_out(request: ProbeRequest, phases: tuple[str, ...]) -> None:
    m, estimated = _probe_within(request, phases)
    for phase in phases:
        estimate = estimated[phase]
        # every unit, the head twice and the last block's all-gather output: beyond what the
        # tracker files as gathered, the head's copy being made (1 MiB, under activations there)
        head = 4096 * 128 * 2
        assert estimate.components["weights_gathered"] > m.phase_total(phase, key="weights_gathered") + head // 2


def test_a_prefill_regathering_without_resharding_peaks_at_the_heads_copy_out():
    """Under reshard_after_forward=False, generate's prefill regathers every unit the step
    before's backward resharded and keeps each one that has run. The untied head copies out
    last: the root, every block, the head twice and the last block's all-gather output, with the
    prompt's whole cache. Counted at the head running (its all-gather output dropped), the
    rollout read 4.4% low."""
    _assert_peaks_at_the_heads_copy_out(_untied_without_resharding(generation="hf", beta=0.0), ("rollout",))


def test_passes_regather_without_resharding_after_a_backward():
    """FSDP2 reshards every unit after its backward, so without a rollout the reference pass
    gathers them again, and so does the last of two learn micro-batches: both peak at the
    head's copy-out. Counted as every unit gathered, the reference pass read 14.1% low and
    learn 12.0% low."""
    request = _untied_without_resharding(generation="none", beta=0.04, micro_batch_size_per_gpu=1)
    _assert_peaks_at_the_heads_copy_out(request, ("reference", "learn"))


def test_the_backward_releases_each_unit_once_through_without_resharding():
    """One learn micro-batch after the reference pass finds every unit gathered, and FSDP2
    reshards each in its post-backward: the head (1 MiB) is gone before the blocks run backward.
    Counted with every unit gathered through the backward, learn read 8.6% high."""
    _probe_within(_untied_without_resharding(generation="none", beta=0.04, micro_batch_size_per_gpu=2), ("learn",))


def test_a_full_fine_tune_without_resharding_holds_the_actors_units_through_the_reference_copys_pass():
    """Generate leaves the actor's units gathered while the frozen reference copy runs its pass;
    the actor runs no forward there, so the probe must register them itself (it read 20.6% below
    the estimate without them). Learn peaks at the trained untied head's reduce-scatter: the unit
    reshards first (counted gathered, learn read 9.5% high), and the chunked head's workspace is
    freed by then (counted in one moment with it, 4.8% high)."""
    _probe_within(
        _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True), ("reference", "learn"), rel=0.01
    )


def test_a_full_fine_tune_in_one_micro_batch_reduces_its_head_and_its_embeddings():
    """One micro-batch: the head's compute-dtype gradient stays through its unit's reduce-scatter,
    and the embeddings reduce-scatter last, beside every other unit's new shard but not their own
    (counted with their own, and the head's workspace with its reduce-scatter, learn read 6.2%
    high)."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True, micro_batch_size_per_gpu=2)
    _probe_within(request, ("learn",), rel=0.01)


def test_the_fsdp_and_the_generic_tracker_see_the_same_memory():
    """A full fine-tune probed with one block a unit (FSDPMemTracker) and with two (the generic
    tracker) peaks in learn at the untied head's reduce-scatter, where the same tensors are alive
    under either layout (generate left every unit gathered). FSDPMemTracker's own post-backward
    wrapper kept the last parameter's unsharded gradient alive through the reduce-scatter, which
    FSDP2 frees there: the head's whole gradient (1 MiB), 3.4% of learn."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True)
    one = run_probe(request)
    two = run_probe(request.model_copy(update={"fsdp": request.fsdp.model_copy(update={"wrap_every_n_blocks": 2})}))
    assert one.ok and two.ok, (one.failure, two.failure)
    assert one.phase_total("learn") == pytest.approx(two.phase_total("learn"), rel=0.002)


def test_a_grouped_layout_counts_the_reference_copys_shards_once():
    """Two blocks a unit take the generic tracker, which registers the parameters of every module
    that runs: the frozen reference copy's local shards too, which reference_weights counts
    already. Counted twice, the reference pass read 7.6% above the estimate."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True)
    _probe_within(
        request.model_copy(update={"fsdp": request.fsdp.model_copy(update={"wrap_every_n_blocks": 2})}), ("reference",)
    )


def test_a_full_fine_tunes_prefetch_holds_the_cast_of_its_fp32_shards():
    """FSDP2 casts a unit's local fp32 shards to bf16 before all-gathering them, and the copy lives
    beside the output it is copied into: here half a two-block unit, as a block prefetches the
    next unit (the rollout's peak). Not counted, the rollout read 2.3% low; the frozen reference
    copy keeps bf16 shards and casts nothing, so counting it there read 1.7% high. Its learn
    phase peaks at the chunked head's workspace: the trainer's own copy of the head reduces the
    head's gradient, and FSDP2's head unit none (it reduced a zero gradient of it before, held
    whole in fp32 through the deferred-sync step: learn measured 13.8% higher). A block unit
    reduce-scatters with its own copy resharded and its gradient freed (counted gathered and
    alive, learn read 10.5% high)."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True)
    fsdp = request.fsdp.model_copy(update={"wrap_every_n_blocks": 2, "reshard_after_forward": True})
    _probe_within(request.model_copy(update={"fsdp": fsdp}), ("rollout", "reference", "learn"), rel=0.01)


def test_a_tied_full_fine_tunes_reference_copy_runs_beside_a_resharded_actor():
    """A tied head (the root holds the embeddings) fully fine-tuned, resharded after forward: GRPO
    reshards the actor's root after Hugging Face generate, so the frozen copy's reference pass
    runs beside none of the actor's units (counted beside its root, it read 7.8% high). Learn
    peaks as the model's own one-position head runs backward, after the chunked head's: its
    logits' hook fires the root's pre-backward, which prefetches the last block, and the head's
    two gradients meet in the embedding table's input buffer (three V x H bf16 copies). Counted
    without the prefetched block and the held gradient, learn read 2.2-2.4% low. The probe reads
    20.44 MiB in every run (5 of 5) since it settles gloo's late frees; a CI run before read 20.49."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True)
    request = request.model_copy(
        update={
            "model": f"{QWEN2_BODY}&vocab_size=4096&tie_word_embeddings=true",
            "fsdp": request.fsdp.model_copy(update={"reshard_after_forward": True}),
        }
    )
    _probe_within(request, ("rollout", "reference", "learn"), rel=0.01)


def test_generate_leaves_the_root_resharded_whatever_its_setting():
    """Under reshard_after_forward=False Hugging Face generate leaves every block unit gathered, but
    not the root: FSDP2's wrapper of generate runs the root's post-forward once the nested forwards
    have left its group idle, and so reshards it. A tied full fine-tune's frozen copy runs its
    reference pass beside the actor's blocks only (counted beside the root too, the embedding
    table, it read 6.3% high)."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True)
    request = request.model_copy(update={"model": f"{QWEN2_BODY}&vocab_size=4096&tie_word_embeddings=true"})
    _probe_within(request, ("reference", "learn"), rel=0.01)


def test_the_embeddings_reduce_scatter_last_resharded_with_their_gradient_freed():
    """One micro-batch of a tied full fine-tune kept gathered after forward. FSDP2 reshards the
    embeddings' unit (here the root) before their reduce-scatter, the last, and frees their
    gradient once copied into the input, as for a block unit; every block unit has resharded in
    its own post-backward, so each reduce-scatters beside the units before it only. Counted with
    the root gathered and the gradient alive, learn read 12.1% high, and with every block gathered
    at each block's reduce-scatter 2.8% high.

    The first block unit's reduce-scatter input stays as the embeddings' gradient is made, but not
    gloo's copy of it, which lives inside the call: counted with the copy, learn read 5.5% high
    (17.90 MiB against 16.96). Before the probe settled gloo's late frees, about half the runs read
    17.84, the copy still alive."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True, micro_batch_size_per_gpu=2)
    request = request.model_copy(update={"model": f"{QWEN2_BODY}&vocab_size=4096&tie_word_embeddings=true"})
    _probe_within(request, ("learn",), rel=0.01)


def test_a_tied_full_fine_tune_holds_its_heads_gradient_through_the_blocks_backward():
    """A wider MLP (the blocks outweigh the 1 MiB tied head): learn peaks in a block's backward,
    beside the tied head's summed gradient (1 MiB, held in the embedding table's input buffer until
    the embeddings add theirs) and down_proj's weight gradient the block has made (0.5 MiB, in its
    unit's unsharded copy until the post-backward). Counted without either, it read 3.0% low. The
    probe reads 49.62 MiB in every run since gloo's late frees and scratch copies are settled
    (planner.probe.gloo); before, four runs in eight read up to 3.6% higher."""
    request = _untied_without_resharding(generation="hf", beta=0.04, full_finetune=True)
    body = QWEN2_BODY.replace("intermediate_size=512", "intermediate_size=2048")
    request = request.model_copy(
        update={
            "model": f"{body}&vocab_size=4096&tie_word_embeddings=true",
            "fsdp": request.fsdp.model_copy(update={"reshard_after_forward": True}),
        }
    )
    _probe_within(request, ("learn",), rel=0.02)


def test_tied_embeddings_gathered_by_the_root_are_held_twice_at_the_first_blocks_copy_out():
    """The root (here the tied embedding table, 4 MiB beside 0.5 MiB blocks) is gathered first;
    FSDP2 keeps its all-gather output until the first block's copy-out returns, so the root is
    held twice there, and the block twice. It is the peak of every phase of a 2-rank step here.
    Counted once, the reference pass read 20.8% low, the learn phase 19.7% and the rollout 7.7%;
    paired with the rollout's decode (whose steps find the root gathered) 14.8% high."""
    from benchmarks._probe_cache import estimate_request, saved_coefficients

    workload = SMALL.model_copy(
        update={
            "prompts_per_step": 2,
            "group_size": 2,
            "prompt_tokens": 16,
            "completion_tokens": 16,
            **BF16_ROWS,
            "generation": "hf",
        }
    )
    request = ProbeRequest(
        model=f"{QWEN2_BODY}&vocab_size=16384&tie_word_embeddings=true",
        workload=workload,
        fsdp=FSDPConfig(param_dtype="bfloat16", param_persistence_threshold=0),
        nproc=2,
        timed_steps=1,
        generate=True,
    )
    m = run_probe(request)
    assert m.ok, m.failure
    phases = estimate_request(request, saved_coefficients("cpu")).phases
    for phase in ("rollout", "reference", "learn"):
        assert phases[phase].total == pytest.approx(m.phase_total(phase), rel=0.02), phase


def _block_bytes(name: str, *, lora_rank: int) -> int:
    """One block's parameters with LoRA on every linear, in bf16: what FSDP2 gathers for it."""
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_model

    arch, query = name.split(":", 1)[1].split("?", 1)
    model = tiny_model(arch, **{k: int(v) for k, v in (kv.split("=") for kv in query.split("&"))})
    model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear"))
    return 2 * sum(p.numel() for p in model.get_base_model().model.layers[0].parameters())


def _leftover(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_a_killed_rank_is_reported_without_hanging_or_orphans():
    start = time.monotonic()
    m = run_probe(
        ProbeRequest(model=MODEL, workload=SMALL, fsdp=FSDPConfig(**SHARD_ALL), nproc=2, collective_timeout_s=30),
        env={"AGILERL_PROBE_KILL": "1:learn"},
        failure_grace_s=5,
    )
    assert not m.ok and m.failure
    assert time.monotonic() - start < 120
    assert not _leftover(m.work_dir)


def test_a_probe_past_its_timeout_is_killed_whole():
    start = time.monotonic()
    m = run_probe(ProbeRequest(model=MODEL, workload=SMALL, fsdp=FSDPConfig(**SHARD_ALL), nproc=2, timeout_s=3))
    assert not m.ok and "timed out after 3s" in m.failure
    assert time.monotonic() - start < 30
    assert not _leftover(m.work_dir)


def test_cli_probe_json_and_exit_codes(capsys):
    import json

    from planner.cli import main

    args = [
        "probe",
        MODEL,
        "--gpus",
        "1",
        "--device",
        "cpu",
        "--no-fsdp",
        "--format",
        "json",
        "--timed-steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--prompt-tokens",
        "8",
        "--completion-tokens",
        "8",
        "--weights-dtype",
        "float32",
        "--lora-rank",
        "4",
        "--gradient-checkpointing",
        "false",
    ]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["fits"] and data["ranks"][0]["phases"]["learn"]["lora"] > 0
    assert main(args + ["--budget-gib", "0.0000001"]) == 3
    with pytest.raises(SystemExit):
        main(["probe", MODEL, "--weights-dtype", "int3"])


def test_cli_probe_of_a_catalog_model_without_local_weights_builds_it_from_its_config(tmp_path, monkeypatch, capsys):
    """Offline, as the planner is: no cached weights means the catalog config with random weights,
    said on stderr; --allow-download hands the hub id to the trainer as given."""
    import json

    from planner import catalog, probe
    from planner.cli import main

    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    launched = []

    def fake_run_probe(request, progress=None):  # the launch itself is tested above
        launched.append(request)
        raise SystemExit(0)

    monkeypatch.setattr(probe, "run_probe", fake_run_probe)
    args = ["probe", "smollm2-135m", "--device", "cpu", "--no-fsdp"]
    with pytest.raises(SystemExit):
        main(args)
    folder = launched[-1].model
    assert json.loads((Path(folder) / "config.json").read_text()) == catalog.entry("HuggingFaceTB/SmolLM2-135M").config
    assert "no weights in the local Hugging Face cache, so random weights from its config" in capsys.readouterr().err
    # --allow-download asks the hub for the real weights under the alias's hub id (here offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([*args, "--allow-download"]) == 2
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M" in capsys.readouterr().err
    # a hub id the catalog does not know, not cached: one clear line, nothing launched
    assert main(["probe", "no-such-org/no-such-model", "--device", "cpu", "--no-fsdp"]) == 2
    assert "no-such-org/no-such-model" in capsys.readouterr().err and len(launched) == 1


def test_grouped_units_deferred_micro_batches_and_generation_are_measured():
    # wrap_every_n_blocks=2 makes FSDP2 group hooks (tracked with the generic tracker);
    # micro-batches of 1 accumulate deferred gradients across tracked phases.
    workload = SMALL.model_copy(update={"generation": "hf"})
    m = run_probe(
        ProbeRequest(
            model=MODEL,
            workload=workload,
            nproc=2,
            generate=True,
            timed_steps=1,
            fsdp=FSDPConfig(**SHARD_ALL, wrap_every_n_blocks=2),
        )
    )
    assert m.ok, m.failure
    for r in m.ranks:
        assert {"rollout", "reference", "learn", "step"} <= set(r.phases)
        assert r.phases["learn"]["weights_gathered"] > 0
        assert r.phases["rollout"]["total"] > r.phases["step"]["total"]


def test_expert_parallel_probe_reports_routed_rows_and_load_imbalance():
    """ep=2 on 2 ranks: every token's k rows are computed on some rank, so the ranks' mean rows
    per token block sum to world x micro-batch x sequence x k; the busiest block is at least
    the mean (1.0 is balanced routing)."""
    model = (
        "tiny:qwen3_moe?hidden_size=32&moe_intermediate_size=32&num_experts=4&num_experts_per_tok=2"
        "&num_layers=2&num_heads=4&num_kv_heads=2"
    )
    # rows that share no prompt: one forward per micro-batch (a shared prefix would split it in two)
    workload = SMALL.model_copy(
        update={"micro_batch_size_per_gpu": 2, "gradient_checkpointing": False, "share_prompt_prefix": False}
    )
    fsdp = FSDPConfig(**SHARD_ALL, ep=2, routed_expert_chunk_mib=1)
    m = run_probe(ProbeRequest(model=model, workload=workload, fsdp=fsdp, nproc=2, timed_steps=1))
    assert m.ok, m.failure
    tokens = 2 * workload.micro_batch_size_per_gpu * (workload.prompt_tokens + workload.completion_tokens)
    assert sum(r.moe_rows["mean_block"] for r in m.ranks) == pytest.approx(tokens * 2)
    assert all(r.moe_rows["max_block"] >= r.moe_rows["mean_block"] for r in m.ranks)
    assert m.moe_load_imbalance >= 1.0


def test_an_overlapped_expert_parallel_dispatch_stays_within_the_estimate():
    """ep=2 in two token blocks: the second block's dispatch runs while the first block's experts
    compute, its sent and received rows held beside them. With balanced routing those two row
    buffers are what the first block saves for its backward (its dispatched rows and the
    combine's), so with grad the last block's moment is about the forward's peak, and without
    grad the estimate counts every routed row at once. The probe's reference and learn peaks are
    within 3% of the estimate (both read as before the overlap: 1.39 and 1.97 MB, estimated 1.37
    and 2.01)."""
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory import estimate
    from planner.models import load_model_spec

    model = (
        "tiny:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=128&num_layers=2"
        "&num_heads=4&num_kv_heads=2&vocab_size=512&num_experts=8&num_experts_per_tok=2"
    )
    workload = SMALL.model_copy(
        update={
            "micro_batch_size_per_gpu": 2,
            "gradient_checkpointing": False,
            "share_prompt_prefix": False,
            "weights_dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "prompt_tokens": 32,
            "completion_tokens": 32,
        }
    )
    fsdp = FSDPConfig(
        param_dtype="bfloat16",
        reduce_dtype="float32",
        param_persistence_threshold=0,
        ep=2,
        ep_token_blocks=2,
        routed_expert_chunk_mib=1,
    )
    m = run_probe(ProbeRequest(model=model, workload=workload, fsdp=fsdp, nproc=2, timed_steps=1))
    assert m.ok, m.failure
    spec = load_model_spec(model, lora_targets=workload.lora_targets)
    est = estimate(spec, workload, Cluster(gpu=CPU_DEVICE, num_gpus=2), fsdp)
    for phase in ("reference", "learn"):
        measured = max(r.phases[phase]["total"] for r in m.ranks)
        assert measured <= est.phases[phase].total * 1.03, (phase, measured, est.phases[phase].total)


@pytest.mark.parametrize("wrap", [1, 2])
def test_gradients_earlier_micro_batches_left_unsharded_are_counted(wrap):
    """With defer_grad_sync FSDP2 keeps each micro-batch's unsharded gradients (upcast to
    reduce_dtype on a bf16 run) until the last one reduces them. They are made before the last
    micro-batch's tracker starts, so the probe must register them itself."""
    bf16 = SMALL.model_copy(update={"weights_dtype": "bfloat16", "attn_implementation": "sdpa"})
    fsdp = FSDPConfig(param_persistence_threshold=0, wrap_every_n_blocks=wrap)  # bf16 params, fp32 reduce
    m = run_probe(ProbeRequest(model=MODEL, workload=bf16, fsdp=fsdp, nproc=2, timed_steps=1))
    assert m.ok, m.failure
    # every LoRA parameter's full (unsharded) gradient in fp32, from the model's own shapes
    full_lora_fp32 = _expected_local_bytes(1)[0]["lora"]
    learn = max(r.phases["learn"]["gradients"] for r in m.ranks)
    assert learn >= full_lora_fp32  # 2 completions a rank, micro-batch 1: the second holds the first's


def _marked(mark: str) -> list[int]:
    from tests._procs import with_env

    return with_env("AGILERL_TEST_MARK", mark)


@pytest.mark.timeout(180)
def test_kill_9_of_the_probe_command_leaves_no_process_within_2_s():
    """SIGKILL gives the CLI no chance to clean up: the kernel's parent-death signal must (torchrun, then ranks)."""
    import os
    import sys
    import uuid
    from pathlib import Path

    mark = uuid.uuid4().hex
    env = {
        **os.environ,
        "AGILERL_TEST_MARK": mark,
        "AGILERL_PROBE_STALL": "0:learn",
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
    }
    cmd = [
        sys.executable,
        "-m",
        "planner.cli",
        "probe",
        MODEL,
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--timed-steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--prompt-tokens",
        "8",
        "--completion-tokens",
        "8",
        "--weights-dtype",
        "float32",
        "--lora-rank",
        "4",
        "--param-dtype",
        "float32",
    ]
    cli = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 150
        while len(_marked(mark)) < 4:  # the CLI, torchrun and both ranks are up
            assert time.monotonic() < deadline and cli.poll() is None, "the probe never started its ranks"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        cli.kill()
        cli.wait()
    killed_at = time.monotonic()
    while _marked(mark) and time.monotonic() - killed_at < 2.0:
        time.sleep(0.05)
    left = _marked(mark)
    for pid in left:  # do not leave them to the rest of the suite
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not left, f"processes outlived kill -9 of agilerl-plan probe by 2 s: {left}"


@pytest.mark.timeout(300)
def test_two_nodes_of_two_ranks_shard_within_a_node_and_report_host_memory_per_node():
    """Two torchrun agents on this host (c10d rendezvous, --nnodes=2): HSDP with shard_group_size = ranks
    per node shards each weight over the 2 ranks of a node and replicates it across the nodes."""
    fsdp = FSDPConfig(**SHARD_ALL, shard_group_size=2)
    m = run_probe(ProbeRequest(model=MODEL, workload=SMALL, fsdp=fsdp, nproc=4, nnodes=2, timed_steps=1))
    assert m.ok, m.failure
    assert [(r.rank, r.node) for r in m.ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    expected = _expected_local_bytes(2)  # a shard group is one node's 2 ranks
    for r in m.ranks:
        assert r.param_bytes["weights"] == expected[r.rank % 2]["weights"]
        assert r.param_bytes["lora"] == expected[r.rank % 2]["lora"]
    host = {
        node: sum(max(rec.get("host_peak", 0) for rec in r.phases.values()) for r in m.ranks if r.node == node)
        for node in (0, 1)
    }
    assert all(v > 0 for v in host.values())
    assert m.host_per_node_bytes == max(host.values()) > m.host_peak_bytes
    with pytest.raises(ValueError, match="do not split evenly"):
        ProbeRequest(model=MODEL, nproc=3, nnodes=2)


@pytest.mark.timeout(60)
def test_killing_a_launch_waits_until_its_descendants_are_gone():
    # A launcher whose child runs in a new session (as torchrun's ranks do) and holds memory, so
    # that a SIGKILL takes a moment to complete: when the kill returns, no descendant still runs.
    import sys

    from planner.probe._launch import _alive, _descendants, _kill_group

    child = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'b = bytearray(400 * 2**20); import time; time.sleep(60)'], "
        "start_new_session=True); time.sleep(60)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(_descendants(launcher.pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    victims = _descendants(launcher.pid)
    assert victims, "the launcher started no child"
    time.sleep(1)  # the child has its memory
    _kill_group(launcher)
    launcher.wait()
    assert not [pid for pid in victims if _alive(pid)]


def test_a_record_without_components_needs_cudas_allocator():
    import torch

    from planner.probe.tracking import PhaseRecorder

    model = torch.nn.Linear(4, 4)
    # on CUDA a phase's record may come from the allocator's peaks alone (components=False, the
    # default there); a CPU has no such peaks, so only the tracker can measure a phase
    with pytest.raises(ValueError, match="CUDA"):
        PhaseRecorder(model, None, torch.device("cpu"), components=False)
    recorder = PhaseRecorder(model, None, torch.device("cpu"))
    with recorder("learn"):
        model(torch.ones(8, 4)).sum().backward()
    assert recorder.peaks["learn"]["total"] > 0 and "cuda_max_reserved" not in recorder.peaks["learn"]
    assert ProbeRequest(model="tiny:qwen2").components is None  # chosen by the device in the rank


@pytest.mark.timeout(30)
def test_the_probe_table_names_every_component_whole_above_its_own_column():
    """The table's columns are as wide as their names (``optimizer_state`` was cut to
    ``optimizer_stat``, ``host_optimizer_state`` to ``host_optimize``), and each figure ends where
    its name ends."""
    from planner.probe import Measurement, RankMeasurement

    record = {"weights": 3 * 2**20, "optimizer_state": 5 * 2**20, "host_optimizer_state": 7 * 2**20, "total": 8 * 2**20}
    m = Measurement(
        request=ProbeRequest(model=MODEL, workload=SMALL, nproc=1),
        ok=True,
        ranks=[RankMeasurement(rank=0, phases={"step": record})],
    )
    header, row = m.table().splitlines()[1:3]
    for name, mib in (("weights", "3.00"), ("optimizer_state", "5.00"), ("host_optimizer_state", "7.00")):
        end = header.index(f" {name}") + 1 + len(name)
        assert row[end - len(mib) : end] == mib, (name, header, row)
    # figures wider than a name (a TiB in MiB): the column widens, and a space still parts them
    huge = {"weights": 2**40, "optimizer_state": 3 * 2**40, "total": 4 * 2**40}
    wide = m.model_copy(update={"ranks": [RankMeasurement(rank=0, phases={"learn": huge, "step": record})]})
    header, row = wide.table().splitlines()[1:3]
    assert row.split()[2:5] == ["1,048,576.00", "3,145,728.00", "0.00"], row
    for name, mib in (("weights", "1,048,576.00"), ("optimizer_state", "3,145,728.00")):
        end = header.index(f" {name}") + 1 + len(name)
        assert row[end - len(mib) : end] == mib, (name, header, row)


@pytest.mark.timeout(150)
def test_ctrl_c_stops_a_probe_in_one_line_with_status_130_and_leaves_nothing_running():
    """Ctrl-C during a probe: its launch is killed, the command says so in one line (it printed
    a KeyboardInterrupt traceback) and exits 130, as an interrupted tuner does."""
    import os
    import signal
    import sys

    import psutil

    from tests._procs import interruptible

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "AGILERL_PROBE_STALL": "0:learn"}
    cmd = [sys.executable, "-m", "planner.cli", "probe", MODEL, "--gpus", "1", "--device", "cpu"]
    cli = interruptible(cmd, env)
    deadline = time.monotonic() + 120
    launched: list[psutil.Process] = []
    while not any("planner.probe._worker" in " ".join(p.cmdline()) for p in launched):  # a rank is running
        assert time.monotonic() < deadline and cli.poll() is None
        time.sleep(0.2)
        try:
            launched = psutil.Process(cli.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            launched = []
    cli.send_signal(signal.SIGINT)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "agilerl-plan: interrupted", err
    _, alive = psutil.wait_procs(launched, timeout=10)
    assert not alive, alive
