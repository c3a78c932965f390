"""planner.request: one validated plan request, and the command line and the explorer agreeing on it."""

from __future__ import annotations

import json

import pytest

from planner import emit
from planner.choose import check_inputs, plan, plan_request
from planner.hardware import GPUS, Cluster, gpu_by_name
from planner.models import load_model_spec
from planner.request import PlanRequest, RequestError
from planner.workload import Workload

pytestmark = pytest.mark.timeout(60)

H100 = gpu_by_name("H100-80GB")


def _problems(**kwargs) -> dict[str, str]:
    with pytest.raises(RequestError) as info:
        PlanRequest(**kwargs)
    return info.value.problems


@pytest.mark.parametrize(
    "given, kind",
    [
        ("h100", "H100-80GB"),
        ("a100-80", "A100-80GB"),
        ("A100 40GB", "A100-40GB"),
        ("4090", "RTX-4090"),
        ("mi300", "MI300X"),
        ("a10", "A10G"),  # the A10 and the A10G have the same 24 GB
    ],
)
def test_a_gpu_is_found_by_a_short_name_that_only_it_answers_to(given, kind):
    assert gpu_by_name(given).name == kind


@pytest.mark.parametrize("given, kinds", [("A100", "A100-40GB or A100-80GB"), ("80gb", "A100-80GB or H100-80GB")])
def test_a_gpu_name_several_kinds_share_is_refused_naming_them(given, kinds):
    """An A100 comes with 40 or 80 GB: taking either for it would plan another GPU's memory."""
    with pytest.raises(KeyError, match=f"could be {kinds}: give one of them"):
        gpu_by_name(given)


@pytest.mark.parametrize("given", ["H20", "h2", "rtx", "l", "3"])
def test_a_name_that_cuts_a_model_number_or_has_none_is_no_gpu_of_the_catalog(given):
    """An H20 is another GPU (96 GB), not a short H200 (141 GB); a name without a model number
    names no GPU."""
    with pytest.raises(KeyError, match=f"unknown GPU '{given}'"):
        gpu_by_name(given)


def test_each_bad_field_is_named_by_its_key():
    eight = Cluster(gpu=H100, num_gpus=8)
    assert "tp=3 must divide" in _problems(cluster=eight, workload=Workload(), fixed={"tp": 3})["fsdp.tp"]
    assert (
        "cannot both be set"
        in _problems(cluster=eight, workload=Workload(), fixed={"cpu_offload": True, "optim_cpu_offload": True})["fsdp"]
    )
    assert (
        "would be ignored"
        in _problems(cluster=eight, workload=Workload(), fixed={"tp": 2}, sharding="none")["plan.sharding"]
    )
    assert (
        "'auto', 'fsdp' or 'none'" in _problems(cluster=eight, workload=Workload(), sharding="zero3")["plan.sharding"]
    )
    for margin in (1.0, -0.1, float("nan")):
        assert "[0, 1)" in _problems(cluster=eight, workload=Workload(), margin_fraction=margin)["plan.margin_fraction"]
    assert (
        "do not split over 16 ranks"
        in _problems(
            cluster=Cluster(gpu=H100, num_gpus=16),
            workload=Workload(prompts_per_step=1, group_size=2),
        )["workload.prompts_per_step"]
    )
    assert (
        "does not divide the 8"
        in _problems(
            cluster=eight,
            workload=Workload(micro_batch_size_per_gpu=3),
        )["workload.micro_batch_size_per_gpu"]
    )
    # Several problems at once: every one is reported, each under its own key.
    several = _problems(
        cluster=eight,
        workload=Workload(micro_batch_size_per_gpu=3, load_in_4bit=True),
        fixed={"cpu_offload": True},
        margin_fraction=2.0,
    )
    assert set(several) >= {"plan.margin_fraction", "fsdp.cpu_offload", "workload.micro_batch_size_per_gpu"}


def test_an_engine_field_away_from_its_default_needs_the_engine():
    eight = Cluster(gpu=H100, num_gpus=8)
    problem = _problems(cluster=eight, workload=Workload(vllm_max_num_seqs=8))["workload.vllm_max_num_seqs"]
    assert "generation='vllm'" in problem and "'hf'" in problem
    # At its default it changes nothing, so a form carrying every field does not trip it.
    PlanRequest(cluster=eight, workload=Workload(vllm_sleep_level=Workload.model_fields["vllm_sleep_level"].default))
    PlanRequest(cluster=eight, workload=Workload(generation="vllm", vllm_max_num_seqs=8))


def test_build_raises_a_default_batch_to_whole_prompts_per_gpu_and_says_so():
    three = Cluster(gpu=H100, num_gpus=3)
    request = PlanRequest.build(three, Workload())
    default = Workload.model_fields["prompts_per_step"].default
    assert request.workload.prompts_per_step % 3 == 0 and default < request.workload.prompts_per_step < default + 3
    [decision] = request.decisions
    assert decision.field == "prompts_per_step" and decision.value == request.workload.prompts_per_step
    assert request.manifest_problem() is None
    # A batch the user gave is never changed: whether it can be written as a manifest is asked apart.
    given = PlanRequest.build(three, Workload(prompts_per_step=4, group_size=3))
    assert given.workload.prompts_per_step == 4 and given.decisions == ()
    assert "must be a multiple of the 3 GPUs" in given.manifest_problem()
    # under a tp the user fixed, each tensor-parallel group takes whole prompts (as the manifest's
    # launch splits them): 2 prompts on 4 GPUs in groups of 2, not 3
    four = Cluster(gpu=H100, num_gpus=4)
    assert PlanRequest.build(four, Workload(prompts_per_step=2), {"tp": 2}, sharding="fsdp").manifest_problem() is None
    odd = PlanRequest.build(four, Workload(prompts_per_step=3), {"tp": 2}, sharding="fsdp").manifest_problem()
    assert "must be a multiple of the 2 data-parallel ranks of the 4 GPUs (tp=2)" in odd, odd


def test_a_request_is_read_only_and_revalidated_on_other_gpus():
    request = PlanRequest(cluster=Cluster(gpu=H100, num_gpus=8), workload=Workload(), fixed={"tp": 2})
    with pytest.raises(TypeError):
        request.fixed["tp"] = 4  # type: ignore[index]
    with pytest.raises(RequestError, match="tp=2 must divide the 3 ranks"):
        request.with_cluster(Cluster(gpu=H100, num_gpus=3))


def test_check_inputs_raises_the_requests_own_problems():
    spec = load_model_spec("Qwen/Qwen2.5-0.5B")
    with pytest.raises(RequestError) as info:
        check_inputs(spec, Workload(micro_batch_size_per_gpu=3), Cluster(gpu=H100, num_gpus=8))
    assert set(info.value.problems) == {"workload.micro_batch_size_per_gpu"}


def test_plan_request_is_plan_with_the_requests_margin_and_decisions():
    spec = load_model_spec("Qwen/Qwen2.5-0.5B")
    request = PlanRequest.build(
        Cluster(gpu=GPUS["A100-40GB"], num_gpus=3),
        Workload(),
        {"reshard_after_forward": True},
        sharding="fsdp",
        margin_fraction=0.2,
    )
    result = plan_request(spec, request)
    assert result.margin_bytes == int(GPUS["A100-40GB"].memory_bytes * 0.2) == request.margin_bytes
    assert result.fsdp is not None and result.fsdp.reshard_after_forward is True
    assert result.decisions[-1] == request.decisions[0]
    control = plan(
        spec,
        request.workload,
        request.cluster,
        fixed={"reshard_after_forward": True},
        sharding="fsdp",
        coefficients=None,
        margin_fraction=0.2,
    )
    assert control.margin_bytes == result.margin_bytes


def test_the_command_line_and_the_explorer_make_the_same_request(capsys, tmp_path, monkeypatch):
    """The same run typed as flags and set as knobs plans to the same JSON (a resized GPU keeps its
    name, so its calibration applies in both)."""
    from planner.cli import main
    from tui._knobs import initial_values
    from tui._request import build_request, compute

    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path))
    model = "Qwen/Qwen2.5-1.5B"
    code = main(
        [
            model,
            "--gpus",
            "4",
            "--gpu",
            "H100-80GB",
            "--gpu-memory",
            "40",
            "--margin",
            "0.1",
            "--prompts-per-step",
            "8",
            "--generation",
            "vllm",
            "--vllm-max-num-seqs",
            "16",
            "--tp",
            "2",
            "--format",
            "json",
        ]
    )
    assert code in (0, 3)
    from_flags = json.loads(capsys.readouterr().out)
    values = initial_values(num_gpus=4, gpu="H100-80GB", gpu_memory_gib=40)
    values.update(
        {
            "plan.margin_fraction": "0.1",
            "workload.prompts_per_step": "8",
            "workload.generation": "vllm",
            "workload.vllm_max_num_seqs": "16",
            "fsdp.tp": "2",
        }
    )
    request = build_request(values)
    from_knobs = emit.plan_json(compute(load_model_spec(model), request))
    assert from_knobs == from_flags
    assert from_flags["cluster"]["gpu"]["name"] == "H100-80GB" and from_flags["margin_bytes"] == int(40 * 2**30 * 0.1)
