"""tui._knobs and tui._request: the knob table (descriptions as help), parsing, validation."""

from __future__ import annotations

import pytest

from agilerl.distributed import FSDPConfig
from planner.hardware import GPUS
from planner.names import COMPONENTS
from planner.workload import Workload
from tui._colors import COMPONENT_COLORS
from tui._knobs import AUTO, KnobErrors, initial_values, knob_table
from tui._request import build_request
from tui.screens import matching_models
from tui.widgets._knob_row import _stepped

pytestmark = pytest.mark.timeout(60)

KNOBS = {k.key: k for k in knob_table()}


def _request(**changes):
    values = initial_values(num_gpus=8)
    values.update({k.replace("__", "."): v for k, v in changes.items()})
    return build_request(values)


def _errors(**changes) -> dict[str, str]:
    with pytest.raises(KnobErrors) as info:
        _request(**changes)
    return info.value.errors


def test_every_fsdp_field_is_a_knob_that_starts_on_auto():
    values = initial_values()
    for name, field in FSDPConfig.model_fields.items():
        knob = KNOBS[f"fsdp.{name}"]
        assert knob.auto and knob.help == field.description
        assert values[knob.key] in ("", AUTO)


def test_workload_knobs_take_their_help_from_the_field_descriptions():
    for name, field in Workload.model_fields.items():
        assert KNOBS[f"workload.{name}"].help == field.description


def test_the_brief_knobs_are_there():
    for key in (
        "cluster.num_gpus",
        "cluster.gpus_per_node",
        "cluster.gpu",
        "cluster.gpu_memory_gib",
        "cluster.host_memory_gib",
        "workload.prompts_per_step",
        "workload.group_size",
        "workload.prompt_tokens",
        "workload.completion_tokens",
        "workload.micro_batch_size_per_gpu",
        "workload.lora_rank",
        "workload.load_in_4bit",
        "workload.generation",
        "workload.vllm_gpu_memory_utilization",
        "workload.gradient_checkpointing",
    ):
        assert key in KNOBS
    assert KNOBS["cluster.gpu"].choices == tuple(GPUS)


def test_defaults_ask_for_the_default_workload_and_fix_nothing():
    request = _request()
    assert request.workload == Workload()
    assert request.fixed == {} and request.sharding == "auto"
    assert request.cluster.num_gpus == 8 and request.cluster.gpu.name == "H100-80GB"


def test_overrides_parse_to_the_fields_types():
    request = _request(
        fsdp__reshard_after_forward="false",
        fsdp__wrap_every_n_blocks="2",
        fsdp__shard_group_size="none",
        fsdp__param_dtype="float32",
        fsdp__checkpoint_skip_layer_types="moe, full_attention",
        workload__generation="vllm",
        workload__vllm_sleep_level="2",
        workload__gradient_checkpointing="true",
        workload__micro_batch_size_per_gpu="4",
        cluster__gpu_memory_gib="40",
    )
    assert request.fixed == {
        "reshard_after_forward": False,
        "wrap_every_n_blocks": 2,
        "shard_group_size": None,
        "param_dtype": "float32",
        "checkpoint_skip_layer_types": ("moe", "full_attention"),
    }
    assert request.workload.vllm_sleep_level == 2
    assert request.workload.gradient_checkpointing is True
    assert request.workload.micro_batch_size_per_gpu == 4
    assert request.cluster.gpu.memory_bytes == 40 * 2**30 and request.cluster.gpu.name == "H100-80GB"


def test_a_gpu_given_other_memory_keeps_the_users_calibration(tmp_path, monkeypatch):
    """The explorer resizes a GPU as ``agilerl-plan --gpu-memory`` does: same kind, so a
    calibration saved for the kind is the one the plan uses."""
    from planner.calibration import save_calibration
    from planner.memory import Coefficients
    from planner.models import load_model_spec
    from tui._request import compute

    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path))
    request = _request(cluster__gpu_memory_gib="40")
    spec = load_model_spec("Qwen/Qwen2.5-0.5B")
    assert "shipped CUDA" in compute(spec, request).coefficients_source  # the control
    save_calibration(GPUS["H100-80GB"], Coefficients())
    assert "your calibration for H100-80GB" in compute(spec, request).coefficients_source


def test_invalid_knobs_are_reported_by_key():
    assert "at least 2" in _errors(workload__group_size="1")["workload.group_size"]
    assert "not a whole number" in _errors(cluster__num_gpus="eight")["cluster.num_gpus"]
    assert _errors(cluster__num_gpus="")["cluster.num_gpus"] == "required"
    assert "not a multiple" in _errors(cluster__num_gpus="12", cluster__gpus_per_node="8")["cluster.gpus_per_node"]
    assert (
        "do not split over 16 ranks"
        in _errors(cluster__num_gpus="16", workload__prompts_per_step="1")["workload.prompts_per_step"]
    )
    assert (
        "does not divide the 8" in _errors(workload__micro_batch_size_per_gpu="3")["workload.micro_batch_size_per_gpu"]
    )
    assert (
        "needs generation='vllm'"
        in _errors(workload__offload_weights_during_rollout=True)["workload.offload_weights_during_rollout"]
    )  # a combination's error sits under the knob it names first
    assert "cannot both be set" in _errors(fsdp__cpu_offload="true", fsdp__optim_cpu_offload="true")[""]
    assert "must be more than 0" in _errors(cluster__gpu_memory_gib="0")["cluster.gpu_memory_gib"]
    several = _errors(workload__group_size="1", fsdp__tp="x")
    assert set(several) == {"workload.group_size", "fsdp.tp"}


def test_a_combinations_error_shows_beside_a_failing_field():
    """pydantic checks the Workload's combinations only once every field is valid; the explorer
    checks the valid fields' combinations anyway, so both problems show at once."""
    both = _errors(workload__prompt_tokens="0", workload__group_size="1")
    assert "greater than or equal to 1" in both["workload.prompt_tokens"]
    assert "group of at least 2" in both["workload.group_size"]
    # a combination that names the failing field is not checked against its default
    named = _errors(workload__prompt_tokens="0", workload__vllm_max_model_len="16", workload__generation="vllm")
    assert set(named) == {"workload.prompt_tokens"}


@pytest.mark.parametrize(
    ("current", "direction", "integer", "expected"),
    [
        (8, 1, True, "16"),
        (8, -1, True, "4"),
        (1, -1, True, ""),
        (None, 1, True, "1"),
        (0.3, 1, False, "0.35"),
        (0.05, -1, False, "0.05"),
        (80.0, -1, False, "40"),
    ],
)
def test_up_and_down_double_and_halve(current, direction, integer, expected):
    assert _stepped(current, direction, integer=integer, can_be_auto=True) == expected


def test_a_required_count_does_not_step_below_one():
    assert _stepped(1, -1, integer=True, can_be_auto=False) == "1"


def test_every_component_has_its_own_colour():
    assert set(COMPONENT_COLORS) == set(COMPONENTS)
    assert len(set(COMPONENT_COLORS.values())) == len(COMPONENTS)


def test_model_search_matches_words_then_falls_back_to_close_names():
    assert matching_models("qwen2.5 72") == (
        ["Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-Math-72B", "Qwen/Qwen2.5-Math-72B-Instruct"],
        True,
    )
    assert matching_models("qwen2.5-72b-instruct") == (["Qwen/Qwen2.5-72B-Instruct"], True)
    found, matched = matching_models("lama-3.1-70")
    assert matched and "meta-llama/Llama-3.1-70B" in found
    found, matched = matching_models("Qwen2.5-7C")
    assert not matched and "Qwen/Qwen2.5-7B" in found
