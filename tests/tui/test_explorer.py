"""The explorer driven by Pilot.

Knobs replan, bad input is marked and keeps the last plan, the manifest saves and validates,
dialogs open, slow work never blocks the keyboard. Catalog models only (no torch).
"""

from __future__ import annotations

import threading

import pytest
import yaml
from textual.widgets import Input, Label, OptionList, TextArea

from agilerl.distributed import FSDPConfig
from agilerl.manifest import load_manifest
from planner import emit
from planner.models import load_model_spec
from tui import _request
from tui.app import ExplorerApp
from tui.screens import ExportScreen, HelpScreen, ModelPicker, SavePrompt
from tui.screens import _explorer as explorer_module
from tui.screens._explorer import ExplorerScreen
from tui.widgets import ComponentTable, DecisionView, KnobPanel, KnobRow, PhaseBars, Verdict

from ._helpers import BIG_MODEL, MODEL, SMALL, WIDE, control, pilot_test, set_knob, settle

pytestmark = pytest.mark.timeout(60)


def _row(screen, key: str) -> KnobRow:
    return next(r for r in screen.query(KnobRow) if r.knob.key == key)


async def _bad_value(pilot, key: str, value: str):
    """Type ``value`` into the knob ``key`` once the first plan is in: (the screen, the knob's row,
    the plan before)."""
    good = (await settle(pilot)).plan
    screen = await set_knob(pilot, key, value)
    return screen, _row(screen, key), good


def _verdict(screen) -> str:
    return str(screen.query_one(Verdict).render())


@pytest.mark.parametrize("size", [WIDE, SMALL])
@pilot_test
async def test_starts_with_the_plan_of_the_given_cluster(size):
    app = ExplorerApp(MODEL, gpus=8, gpus_per_node=8, gpu="h100")
    async with app.run_test(size=size) as pilot:
        screen = await settle(pilot)
        plan = screen.plan
        assert plan is not None and plan.fits
        assert plan.model == MODEL and plan.cluster.num_gpus == 8 and plan.cluster.gpu.name == "H100-80GB"
        assert "FITS" in _verdict(screen)
        assert screen.query_one(PhaseBars).estimate is plan.estimate
        assert screen.has_class("-narrow") == (size == SMALL)
        assert app.focused is control(pilot, "cluster.num_gpus")


@pytest.mark.parametrize("size", [WIDE, SMALL])
@pilot_test
async def test_up_doubles_the_gpus_and_the_plan_follows(size):
    app = ExplorerApp(BIG_MODEL, gpus=8)
    async with app.run_test(size=size) as pilot:
        screen = await settle(pilot)
        before = screen.plan
        assert before.fsdp is not None  # 70B does not fit unsharded
        control(pilot, "cluster.num_gpus").focus()
        await pilot.press("up")
        screen = await settle(pilot)
        after = screen.plan
        assert control(pilot, "cluster.num_gpus").value == "16"
        assert after.cluster.num_gpus == 16
        assert (
            after.estimate.phases["step"].components["weights"] < before.estimate.phases["step"].components["weights"]
        )
        assert screen.last_recompute_seconds is not None


@pilot_test
async def test_up_and_down_on_an_infinite_or_nan_count_leave_it_as_typed():
    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        field = control(pilot, "cluster.num_gpus")
        for typed in ("inf", "nan", "1e400"):
            field.value = typed
            field.focus()
            await pilot.press("up", "down")
            assert field.value == typed  # nothing to step from; the field's own error says why
        field.value = "2"
        await pilot.press("up")
        assert field.value == "4"


@pilot_test
async def test_the_fsdp_tab_shows_every_workload_field_the_planner_decided():
    app = ExplorerApp(MODEL, gpus=3)
    async with app.run_test(size=WIDE) as pilot:
        screen = await set_knob(pilot, "workload.generation", "vllm")
        shown = str(screen.query_one(DecisionView).render())
        plan = screen.plan
        assert plan.workload.prompts_per_step == 9  # the default 8, raised to whole prompts on 3 GPUs
        for field in ("prompts_per_step", "vllm_gpu_memory_utilization", "vllm_max_num_seqs"):
            assert f"{field} = {getattr(plan.workload, field)}  planner" in shown, field
            assert plan.reasons()[field] in shown


@pilot_test
async def test_typing_a_value_replans():
    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        field = control(pilot, "workload.completion_tokens")
        field.focus()
        await pilot.pause()
        await pilot.press(*"1024")  # focus selects the value: typing replaces it
        screen = await settle(pilot)
        assert field.value == "1024"
        assert screen.plan.workload.completion_tokens == 1024


@pilot_test
async def test_an_fsdp_override_is_kept_and_marked_as_yours():
    app = ExplorerApp(BIG_MODEL, gpus=16)  # fits with room: the planner relaxes every knob
    async with app.run_test(size=WIDE) as pilot:
        screen = await settle(pilot)
        assert "wrap_every_n_blocks" in screen.plan.reasons()  # the planner's pick, with its reason
        mine = 1 if screen.plan.fsdp.wrap_every_n_blocks != 1 else 2
        screen = await set_knob(pilot, "fsdp.wrap_every_n_blocks", str(mine))
        assert screen.plan.fsdp.wrap_every_n_blocks == mine
        assert screen.request.fixed == {"wrap_every_n_blocks": mine}
        assert "wrap_every_n_blocks" not in screen.plan.reasons()
        assert f"wrap_every_n_blocks = {mine}  you" in str(screen.query_one(DecisionView).render())
        screen = await set_knob(pilot, "fsdp.reshard_after_forward", "false")
        assert screen.plan.fsdp.reshard_after_forward is False
        screen = await set_knob(pilot, "fsdp.reshard_after_forward", "auto")
        assert screen.plan.fsdp.reshard_after_forward is True and "reshard_after_forward" not in screen.request.fixed


@pytest.mark.parametrize("size", [WIDE, SMALL])
@pilot_test
async def test_a_bad_group_size_is_marked_in_place_and_keeps_the_last_plan(size):
    app = ExplorerApp(MODEL, gpus=1)
    async with app.run_test(size=size) as pilot:
        screen, row, good = await _bad_value(pilot, "workload.group_size", "1")
        assert row.has_class("-invalid")
        assert "at least 2" in str(row.query_one(".knob-error", Label).render())
        assert screen.plan is good
        assert "showing the last good plan" in _verdict(screen)
        screen = await set_knob(pilot, "workload.group_size", "4")
        assert not row.has_class("-invalid") and screen.errors == {}
        assert screen.plan.workload.group_size == 4


@pilot_test
async def test_a_lora_rank_past_every_adapted_dimension_is_marked_on_its_knob():
    """A model-level refusal that opens with its field (``lora_rank=... is more than``) is marked
    on that knob, not as a combination; the last good plan stays."""
    app = ExplorerApp(MODEL, gpus=1)
    async with app.run_test(size=WIDE) as pilot:
        screen, row, good = await _bad_value(pilot, "workload.lora_rank", "100000000000000000000000")
        assert row.has_class("-invalid") and "give lora_rank <= " in screen.errors["workload.lora_rank"]
        assert screen.plan is good and "" not in screen.errors


@pilot_test
async def test_gpus_not_a_multiple_of_the_gpus_per_node_is_an_inline_error():
    app = ExplorerApp(MODEL, gpus=16, gpus_per_node=8)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        good = screen.plan
        screen = await set_knob(pilot, "cluster.num_gpus", "12")
        assert "not a multiple" in screen.errors["cluster.gpus_per_node"]
        assert screen.plan is good
        screen = await set_knob(pilot, "cluster.num_gpus", "32")
        assert screen.errors == {} and screen.plan.cluster.num_nodes == 4


@pilot_test
async def test_reset_puts_the_focused_knob_back():
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        screen = await set_knob(pilot, "workload.group_size", "1")
        control(pilot, "workload.group_size").focus()
        await pilot.press("ctrl+r")
        screen = await settle(pilot)
        assert control(pilot, "workload.group_size").value == "8" and screen.errors == {}


@pilot_test
async def test_qlora_and_colocated_vllm_change_the_plan():
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        bf16_weights = screen.plan.estimate.phases["step"].components["weights"]
        control(pilot, "workload.load_in_4bit").focus()
        await pilot.press("space")
        screen = await settle(pilot)
        assert screen.plan.workload.load_in_4bit
        assert (
            screen.plan.estimate.phases["step"].components["weights"] < bf16_weights / 2
        )  # NF4 blocks, bf16 embeddings
        await pilot.press("space")
        await set_knob(pilot, "workload.generation", "vllm")
        screen = await set_knob(pilot, "workload.vllm_gpu_memory_utilization", "0.5")
        assert screen.plan.workload.generation == "vllm"
        at_half = screen.plan.estimate.phases["rollout"].components["vllm"]
        screen = await set_knob(pilot, "workload.vllm_gpu_memory_utilization", "0.3")
        at_three_tenths = screen.plan.estimate.phases["rollout"].components["vllm"]
        # the engine takes its fraction of the GPU (less its profiled activations, which do not change)
        memory = screen.plan.cluster.gpu.memory_bytes
        assert abs((at_half - at_three_tenths) - 0.2 * memory) <= 2


@pytest.mark.parametrize("size", [WIDE, SMALL])
@pilot_test
async def test_save_writes_a_manifest_that_validates_and_matches_the_plan(size, tmp_path):
    app = ExplorerApp(BIG_MODEL, gpus=8, gpus_per_node=4)
    target = tmp_path / "run.yaml"
    async with app.run_test(size=size) as pilot:
        screen = await settle(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        prompt = app.screen
        assert isinstance(prompt, SavePrompt)
        path = prompt.query_one(Input)
        assert path.value == "manifest.yaml"
        path.value = str(target)
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is screen
        plan = screen.plan
    manifest = load_manifest(target)
    assert yaml.safe_load(target.read_text()) == emit.manifest_dict(plan)
    assert manifest.algorithm.model_name == BIG_MODEL
    assert manifest.training.training_gpus_per_agent == 8
    assert manifest.algorithm.micro_batch_size_per_gpu == plan.workload.micro_batch_size_per_gpu
    assert manifest.algorithm.fsdp_config() == plan.fsdp


@pilot_test
async def test_a_plan_whose_manifest_would_not_validate_is_flagged_and_not_saved(tmp_path):
    app = ExplorerApp(BIG_MODEL, gpus=16, gpus_per_node=8)
    target = tmp_path / "run.yaml"
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        # 12 prompts given (not the default, which is raised to a multiple of the GPUs) do not
        # split over 16 trainer GPUs: the plan is drawn, its manifest would not load
        screen = await set_knob(pilot, "workload.prompts_per_step", "12")
        assert screen.plan.fits and "rollout_batch_size (12)" in screen.manifest_problem
        assert "manifest would not validate" in _verdict(screen)
        assert screen.save_manifest(str(target)) is None
        screen = await set_knob(pilot, "workload.prompts_per_step", "16")
        assert screen.manifest_problem is None
        assert screen.save_manifest(str(target)) == target
    assert load_manifest(target).training.rollout_batch_size == 16


@pilot_test
async def test_a_save_to_a_folder_says_so_in_the_explorers_words(tmp_path):
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        assert screen.save_manifest(str(tmp_path)) is None
        await pilot.pause()
        said = [n.message for n in app._notifications]
        assert f"not saved: the path {str(tmp_path)!r} is a directory" in said[-1]
        assert "--output" not in said[-1]


@pilot_test
async def test_escape_cancels_the_save(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.explorer
    assert not (tmp_path / "manifest.yaml").exists()


@pilot_test
async def test_the_snippet_screen_shows_the_plan_as_python_and_yaml():
    app = ExplorerApp(BIG_MODEL, gpus=8)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen)
        assert app.screen.query_one("#python-text", TextArea).text == emit.python_snippet(screen.plan)
        assert app.screen.query_one("#manifest-text", TextArea).text == emit.manifest_yaml(screen.plan)
        assert "FSDPConfig(" in emit.python_snippet(screen.plan)
        await pilot.press("c")
        assert app.clipboard == emit.python_snippet(screen.plan)
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen


@pilot_test
async def test_f1_opens_the_help_and_escape_closes_it():
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        keys = dict(app.screen.bindings)
        assert {"^s", "^o", "^p", "F1"} <= {k.replace("ctrl+", "^") for k in keys}
        listed = [k for k, _ in app.screen.bindings]
        assert len(listed) == len(set(listed)), listed  # each key once
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.explorer


@pilot_test
async def test_the_model_picker_searches_the_catalog():
    app = ExplorerApp(MODEL, gpus=8)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, ModelPicker)
        await pilot.press(*"qwen2.5 14b-instruct")
        await pilot.pause()
        options = app.screen.query_one(OptionList)
        assert options.option_count == 2  # Qwen2.5-14B-Instruct and Qwen2.5-Coder-14B-Instruct, in catalog order
        await pilot.press("enter")
        screen = await settle(pilot)
        assert screen.plan.model == "Qwen/Qwen2.5-14B-Instruct" and screen.sub_title == "Qwen/Qwen2.5-14B-Instruct"


@pilot_test
async def test_input_errors_come_before_the_last_plans_fixes_in_the_capped_verdict():
    app = ExplorerApp(BIG_MODEL, gpus=2)  # does not fit: several fixes
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        assert not screen.plan.fits and len(screen.plan.suggestions) >= 2
        await set_knob(pilot, "workload.lora_rank", "x")
        screen = await set_knob(pilot, "workload.temperature", "0")
        lines = _verdict(screen).splitlines()
        errors = [
            i for i, line in enumerate(lines) if line.startswith("⚠ lora_rank") or line.startswith("⚠ temperature")
        ]
        fixes = [i for i, line in enumerate(lines) if line.lstrip().startswith("fix:")]
        assert len(errors) == 2 and fixes and max(errors) < min(fixes), lines
        assert max(errors) < 8  # within the verdict's capped height


@pilot_test
async def test_an_unknown_model_is_an_error_and_the_plan_stays():
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        good = screen.plan
        await pilot.press("ctrl+o")
        await pilot.pause()
        app.screen.query_one(Input).value = "no-such-org/no-such-model"
        await pilot.pause()
        await pilot.press("enter")
        screen = await settle(pilot)
        assert "unknown model" in screen.model_error and "unknown model" in _verdict(screen)
        assert screen.plan is good and screen.model_name == MODEL
        screen = await set_knob(pilot, "workload.group_size", "4")  # the plan goes on with the last model
        assert screen.plan.model == MODEL and screen.plan.workload.group_size == 4


async def _pick(pilot, typed: str | None) -> ExplorerScreen:
    """Ctrl+O, type ``typed`` (None: nothing), Enter; the explorer once it has settled."""
    await pilot.press("ctrl+o")
    await pilot.pause()
    if typed is not None:
        pilot.app.screen.query_one(Input).value = typed
        await pilot.pause()
    await pilot.press("enter")
    return await settle(pilot)


@pilot_test
async def test_a_failed_pick_is_said_once_and_goes_once_the_plan_moves_on(tmp_path):
    app = ExplorerApp(MODEL)
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        missing = str(tmp_path / "nope")
        screen = await _pick(pilot, missing)
        assert screen.model_error.count(missing) == 1, screen.model_error  # the path, once
        screen = await set_knob(pilot, "workload.group_size", "4")
        assert screen.model_error is None and "nope" not in _verdict(screen)


@pilot_test
async def test_enter_with_nothing_typed_keeps_a_model_from_outside_the_catalog():
    tiny = "tiny:qwen2?num_layers=2"
    app = ExplorerApp(tiny)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        screen = await _pick(pilot, None)
        assert screen.model_name == tiny and screen.plan.model == tiny


@pilot_test
async def test_a_new_models_plan_blocked_by_a_knob_is_not_saved_as_the_last_models(tmp_path):
    moe = "Qwen/Qwen3-30B-A3B"
    app = ExplorerApp(moe, gpus=8)
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        screen = await set_knob(pilot, "fsdp.ep", "4")
        assert screen.plan.model == moe and screen.plan.fsdp.ep == 4
        screen = await _pick(pilot, MODEL)  # a dense model: ep=4 has no experts to split
        assert screen.model_name == MODEL and screen.errors and screen.plan.model == moe
        assert f"the plan shown is {moe}'s" in _verdict(screen)
        assert screen.save_manifest(str(tmp_path / "x.yaml")) is None and not (tmp_path / "x.yaml").exists()
        await pilot.pause()
        assert any(f"not saved: the plan shown is {moe}'s" in n.message for n in app._notifications)
        screen = await set_knob(pilot, "fsdp.ep", "")
        assert screen.plan.model == MODEL and screen.save_manifest(str(tmp_path / "x.yaml")) is not None


@pilot_test
async def test_a_model_that_takes_time_to_build_shows_a_loading_indicator(monkeypatch):
    release = threading.Event()

    def slow_load(name, **kwargs):
        release.wait(20)
        return load_model_spec(BIG_MODEL, **kwargs)

    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        monkeypatch.setattr(explorer_module, "load_model_spec", slow_load)
        await pilot.press("ctrl+o")
        await pilot.pause()
        app.screen.query_one(Input).value = "tiny:qwen2?num_layers=2"
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        screen = app.explorer
        assert screen.busy and screen.query_one("#memory-row").loading  # covered by a LoadingIndicator
        assert "loading tiny:qwen2?num_layers=2" in _verdict(screen)
        release.set()
        screen = await settle(pilot)
        assert not screen.query_one("#memory-row").loading
        assert screen.model_name == "tiny:qwen2?num_layers=2"


@pilot_test
async def test_a_slow_plan_does_not_block_typing_and_stale_plans_are_dropped(monkeypatch):
    release = threading.Event()
    computed = []
    real_compute = _request.compute

    def slow_compute(spec, request):
        release.wait(20)
        computed.append(request.workload.prompt_tokens)
        return real_compute(spec, request)

    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        monkeypatch.setattr(_request, "compute", slow_compute)
        field = control(pilot, "workload.prompt_tokens")
        field.focus()
        await pilot.press("up")  # 512: its plan blocks until released
        await pilot.pause()
        assert screen.busy
        await pilot.press("up", "up")  # typing still works while that plan runs
        await pilot.pause()
        assert field.value == "2048" and screen.busy
        assert screen.plan.workload.prompt_tokens == 256
        release.set()
        screen = await settle(pilot)
        assert screen.plan.workload.prompt_tokens == 2048
        assert computed == [512, 2048]  # 1024 never ran: the newest request replaced it


@pilot_test
async def test_the_bars_select_a_phase_for_the_component_table():
    app = ExplorerApp(MODEL)
    async with app.run_test(size=WIDE) as pilot:
        screen = await settle(pilot)
        bars = screen.query_one(PhaseBars)
        assert bars.selected == screen.plan.estimate.peak_phase
        await pilot.press("f2")
        assert app.focused is bars
        phases = bars.phases()
        await pilot.press("down")
        await pilot.pause()
        expected = phases[(phases.index(screen.plan.estimate.peak_phase) + 1) % len(phases)]
        assert bars.selected == expected
        assert screen.query_one(ComponentTable).phase == expected
        await pilot.press("f3")
        assert screen.query_one("#tabs").active == "decisions"


@pilot_test
async def test_does_not_fit_is_plain_and_lists_the_planners_fixes():
    app = ExplorerApp("Qwen/Qwen2.5-14B", gpu="L4")
    async with app.run_test(size=WIDE) as pilot:
        screen = await settle(pilot)
        assert not screen.plan.fits and screen.plan.suggestions
        text = _verdict(screen)
        assert "DOES NOT FIT" in text
        for fix in screen.plan.suggestions:
            assert f"fix: {fix}" in text
        assert screen.query_one(Verdict).has_class("-over")


@pilot_test
async def test_an_engine_rank_of_its_own_is_in_the_verdict_and_can_be_what_does_not_fit():
    """generation 'none' puts the rollout on engine ranks of their own: the verdict gives an
    engine rank's peak, and where the trainers fit but it does not, names it as what is over."""
    app = ExplorerApp(BIG_MODEL, gpus=8)
    async with app.run_test(size=WIDE) as pilot:
        screen = await set_knob(pilot, "workload.generation", "none")
        plan = screen.plan
        assert not plan.fits and plan.engine_rank_over
        assert plan.estimate.peak_bytes < plan.cluster.gpu.memory_bytes - plan.margin_bytes  # the trainers fit
        text = _verdict(screen)
        assert f"peak {plan.engine_rank.total / 2**30:.2f} GiB in an engine rank of its own > " in text
        assert "fix: generate on the trainer GPUs with Hugging Face generate (generation='hf')" in text
        screen = await set_knob(pilot, "cluster.gpu_memory_gib", "16")  # now the trainers are over too: both said
        plan = screen.plan
        assert plan.estimate.peak_bytes > plan.cluster.gpu.memory_bytes - plan.margin_bytes
        trainers = f"{plan.estimate.peak_bytes / 2**30:.2f} GiB in {plan.estimate.peak_phase}"
        assert f"peak {trainers} and {plan.engine_rank.total / 2**30:.2f} GiB in an engine rank" in _verdict(screen)
        screen = await set_knob(pilot, "workload.generation", "hf")
        assert screen.plan.engine_rank is None and "engine rank" not in _verdict(screen)


@pilot_test
async def test_the_host_memory_knob_judges_a_nodes_host_and_says_when_it_is_over():
    """Empty, the host is not judged; a figure makes the plan fit only if a node's host holds its
    ranks' (Llama-3.1-70B on 8 GPUs: each rank loads its share of the checkpoint on its host),
    the verdict names the host when it is what is over, and a figure no host has is marked."""
    app = ExplorerApp(BIG_MODEL, gpus=8)
    async with app.run_test(size=WIDE) as pilot:
        screen = await settle(pilot)
        assert screen.plan.fits and screen.plan.host_limit_bytes is None and "host" not in _verdict(screen)
        assert control(pilot, "cluster.host_memory_gib").placeholder == "not judged"  # not "auto": nothing is chosen
        need = screen.plan.host_per_node_bytes
        screen = await set_knob(pilot, "cluster.host_memory_gib", f"{2 * need / 2**30:.0f}")
        plan = screen.plan
        assert plan.fits and plan.host_limit_bytes is not None
        assert f"; host {need / 2**30:.2f} of {plan.host_limit_bytes / 2**30:.2f} GiB a node" in _verdict(screen)
        screen = await set_knob(pilot, "cluster.host_memory_gib", f"{need / 2**30 / 2:.0f}")
        plan = screen.plan
        assert not plan.fits and plan.host_over
        text = _verdict(screen)
        assert plan.host_peak_phase == "load"  # every rank's share of the checkpoint as it loads
        assert f" host {need / 2**30:.2f} GiB a node in load > {plan.host_limit_bytes / 2**30:.2f} usable" in text
        assert "peak " not in text.split("\n")[0]  # the GPUs fit: only the host is named
        assert any(fix.startswith("give each node at least") for fix in plan.suggestions)
        screen = await set_knob(pilot, "cluster.host_memory_gib", "0")
        assert "cluster.host_memory_gib" in screen.errors
        screen = await set_knob(pilot, "cluster.host_memory_gib", "")
        assert not screen.errors and screen.plan.fits and screen.plan.host_limit_bytes is None


@pilot_test
async def test_a_narrow_footer_still_shows_quit_and_help():
    """The footer keeps its first bindings when the terminal is narrow: quit and help come first,
    so a 60-column terminal still shows how to leave (the tab keys, cut there, have their tabs)."""
    from textual.widgets._footer import FooterKey

    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=(60, 20)) as pilot:
        await settle(pilot)
        shown = {k.key: k.region for k in app.screen.query(FooterKey)}
        for key in ("ctrl+q", "f1"):
            assert key in shown and shown[key].right <= 60, (key, shown.get(key))


def _screen_text(app) -> str:
    """The characters on screen, row by row (from the app's SVG screenshot)."""
    import html
    import re

    rows: dict[float, list[tuple[float, str]]] = {}
    for m in re.finditer(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>', app.export_screenshot()):
        rows.setdefault(float(m[2]), []).append((float(m[1]), html.unescape(m[3])))
    return "\n".join("".join(t for _, t in sorted(r)).replace("\xa0", " ") for _, r in sorted(rows.items()))


@pytest.mark.parametrize("width", [70, 80, 90, 100, 110, 120])
@pilot_test
async def test_the_bars_legend_shows_the_gpus_memory_at_every_width(width):
    """The legend under the bars gives the scale: the GPU's memory. It came last ("of 79.2"), and
    panels between 70 and 110 columns cut it; it now comes first, with its unit."""
    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=(width, 30)) as pilot:
        await settle(pilot)
        (legend,) = [row for row in _screen_text(app).splitlines() if "· free" in row]
        assert "79.2 GiB" in legend, legend


@pilot_test
async def test_choices_work_from_the_keyboard_and_the_hint_shows_the_fields_description():
    app = ExplorerApp(BIG_MODEL, gpus=8)
    async with app.run_test(size=SMALL) as pilot:
        screen = await settle(pilot)
        select = control(pilot, "fsdp.optim_cpu_offload")
        select.focus()
        await pilot.pause()
        hint = str(screen.query_one("#hint").render())
        assert FSDPConfig.model_fields["optim_cpu_offload"].description[:40] in hint.replace("\n", " ")
        await pilot.press("enter", "down", "enter")  # auto -> true
        screen = await settle(pilot)
        assert select.value == "true"
        assert screen.request.fixed == {"optim_cpu_offload": True}
        assert screen.plan.fsdp.optim_cpu_offload is True
        assert screen.plan.estimate.phases["step"].components.get("optimizer_state", 0) == 0


@pilot_test
async def test_question_mark_opens_the_help_outside_text_fields():
    app = ExplorerApp(MODEL)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("f2")  # focus the bars: no text field takes the key
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)


@pilot_test
async def test_an_fsdp_override_asks_for_fsdp_even_where_data_parallel_fits():
    app = ExplorerApp(MODEL, gpus=8)  # 7B fits on each GPU: data parallel, no FSDPConfig
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        assert app.screen.plan.fsdp is None
        screen = await set_knob(pilot, "fsdp.wrap_every_n_blocks", "2")
        assert screen.request.fixed == {"wrap_every_n_blocks": 2}
        assert screen.plan.fsdp is not None and screen.plan.fsdp.wrap_every_n_blocks == 2
        assert "FSDPConfig fields were given" in screen.plan.reasons()["sharding"]
        assert screen.warnings() == []


@pilot_test
async def test_an_algorithm_is_planned_with_its_own_defaults_as_the_command_line_plans_it(tmp_path):
    """ppo plans one completion per prompt over 4 epochs with beta 0.05, sft no rollout, as
    `agilerl-plan --algorithm ppo|sft` does: the knobs move to them (they kept GRPO's, so ppo
    was planned as another run and sft was refused)."""
    from planner.cli import main as plan_main

    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=WIDE) as pilot:
        for algorithm in ("ppo", "sft"):
            screen = await set_knob(pilot, "workload.algorithm", algorithm)
            assert not screen.errors, screen.errors
            path = tmp_path / f"{algorithm}-tui.yaml"
            assert screen.save_manifest(str(path)) == path
            assert (
                plan_main([MODEL, "--gpus", "2", "--algorithm", algorithm, "--output", str(tmp_path / "cli.yaml")]) == 0
            )
            tui_manifest = yaml.safe_load(path.read_text())
            cli_manifest = yaml.safe_load((tmp_path / "cli.yaml").read_text())
            assert tui_manifest == cli_manifest, algorithm
        assert _row(screen, "workload.generation").value == "none"


@pilot_test
async def test_a_gpu_memory_that_is_no_devices_is_marked_and_a_bad_save_path_loses_nothing(tmp_path):
    import json

    from tests.test_bad_input import LLAMA as config  # a tiny Llama's config.json

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    app = ExplorerApp(str(model_dir), gpus=1)
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        for text in ("inf", "nan", "1e30"):  # the app raised out of its event loop on each
            screen = await set_knob(pilot, "cluster.gpu_memory_gib", text)
            assert "cluster.gpu_memory_gib" in screen.errors, (text, screen.errors)
        screen = await set_knob(pilot, "cluster.gpu_memory_gib", "")
        assert not screen.errors and screen.plan is not None
        # the model's own config.json, and a home directory that does not exist: refused in place
        assert screen.save_manifest(str(model_dir / "config.json")) is None
        assert json.loads((model_dir / "config.json").read_text()) == config
        assert screen.save_manifest("~no-such-user-here/plan.yaml") is None
        assert app.is_running


@pilot_test
async def test_the_default_prompts_are_raised_to_a_multiple_of_the_gpus_as_the_command_line_does():
    app = ExplorerApp(MODEL, gpus=3)
    async with app.run_test(size=WIDE) as pilot:
        screen = await settle(pilot)
        assert not screen.errors, screen.errors
        assert screen.plan.workload.prompts_per_step == 9 and screen.manifest_problem is None
        assert any(d.field == "prompts_per_step" for d in screen.plan.decisions)
        # the knob still shows the 8 it holds; the note under it gives the 9 planned, and why
        row = _row(screen, "workload.prompts_per_step")
        assert row.value == "8" and row.has_class("-noted")
        note = str(row.query_one(".knob-note").render())
        assert note.startswith("planned 9: the default 8 raised to a multiple of the 3 GPUs"), note
        assert [key for key, r in screen.query_one(KnobPanel).rows().items() if r.has_class("-noted")] == [
            "workload.prompts_per_step"
        ]  # nothing else was moved: the knobs left at auto say nothing
        # 12 prompts typed are planned as they are: no note
        screen = await set_knob(pilot, "workload.prompts_per_step", "12")
        assert screen.plan.workload.prompts_per_step == 12 and not row.has_class("-noted")


@pilot_test
async def test_lora_knobs_beside_full_fine_tuning_are_marked_not_ignored():
    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=WIDE) as pilot:
        await settle(pilot)
        control(pilot, "workload.full_finetune").value = True  # a checkbox
        screen = await set_knob(pilot, "workload.lora_rank", "256")
        assert "full_finetune trains no LoRA adapters" in screen.errors.get("workload.lora_rank", ""), screen.errors


@pilot_test
async def test_the_snippet_of_the_last_good_plan_says_so_while_inputs_have_errors():
    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=WIDE) as pilot:
        screen = await set_knob(pilot, "workload.group_size", "0")
        assert screen.errors and screen.plan is not None
        screen.action_export()
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen)
        assert any("the snippet is the last good plan's" in n.message for n in app._notifications)


@pilot_test
async def test_lora_targets_plan_as_the_command_line_plans_them_and_a_misspelt_one_is_marked():
    """The LoRA-targets knob reads what --lora-targets reads: the plan of q_proj,v_proj is the
    command line's (the spec is rebuilt with them once), and a module the model lacks is marked
    on the knob while the last plan stays."""
    from planner.choose import plan_request

    app = ExplorerApp(MODEL, gpus=2)
    async with app.run_test(size=WIDE) as pilot:
        screen = await settle(pilot)
        every = screen.plan.estimate.phases["step"].components["lora"]
        screen = await set_knob(pilot, "workload.lora_targets", "q_proj, v_proj")
        assert not screen.errors, screen.errors
        request = screen.request
        assert request.workload.lora_targets == ("q_proj", "v_proj")
        spec = load_model_spec(MODEL, lora_targets=("q_proj", "v_proj"))
        assert screen.plan.estimate.peak_bytes == plan_request(spec, request).estimate.peak_bytes
        assert screen.plan.estimate.phases["step"].components["lora"] < every / 4  # 2 of 7 linears, narrow ones
        kept = screen.plan
        screen = await set_knob(pilot, "workload.lora_targets", "q_prj")
        assert "q_prj" in screen.errors.get("workload.lora_targets", ""), screen.errors
        assert screen.plan is kept


@pilot_test
async def test_a_roomy_terminal_shows_every_knob_label_whole():
    """Knob labels are their fields' names (micro_batch_size_per_gpu, up to 30 characters): cut
    with an ellipsis below 150 columns, whole from there; the hint line names the focused one."""
    from textual.widgets import Label

    from tui._knobs import knob_table

    longest = max(len(k.label) for k in knob_table())
    app = ExplorerApp(MODEL, gpus=8)
    async with app.run_test(size=(160, 50)) as pilot:
        screen = await settle(pilot)
        assert screen.has_class("-roomy")
        labels = list(screen.query(".knob-label").results(Label))
        assert len(labels) == len(knob_table())
        for label in labels:
            text = str(label.render())
            assert "…" not in text and len(text.strip()) <= label.content_region.width, text
        assert max(len(str(label.render()).strip()) for label in labels) == longest
    async with ExplorerApp(MODEL, gpus=8).run_test(size=WIDE) as pilot:  # 120 columns: the longest are cut
        screen = await settle(pilot)
        assert not screen.has_class("-roomy")
        widths = {label.content_region.width for label in screen.query(".knob-label").results(Label)}
        assert max(widths) < longest
