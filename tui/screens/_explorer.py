"""The explorer: knobs on the left; verdict, memory bars and the chosen FSDPConfig on the right.

State lives here: the current model's spec, the knob values, the last good plan. Every knob
change validates at once (errors show in place) and asks for a new plan; plans run in a
thread worker, one at a time, and a plan that finishes after the knobs moved on is dropped
for the newest request, so a slow plan never blocks typing and never shows stale numbers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Static, TabbedContent, TabPane
from textual.worker import Worker, WorkerState

from planner import emit
from planner.choose import Plan
from planner.models import load_model_spec
from planner.output import check_output, write_output
from planner.request import PlanRequest
from planner.spec import ModelSpec

from .. import _request
from .._knobs import AUTO, KnobErrors, algorithm_values
from ..widgets import ComponentTable, DecisionView, KnobPanel, KnobRow, PhaseBars, Verdict
from ._dialogs import ExportScreen, SavePrompt
from ._model_picker import ModelPicker

__all__ = ["ExplorerScreen"]

#: Below this width the component table goes under the bars instead of beside them.
NARROW_COLUMNS = 110
#: From this width the knob panel is wide enough for every knob's full label (its field's name).
ROOMY_COLUMNS = 150
#: A plan taking longer than this shows "planning ..." until it is done.
SLOW_PLAN_SECONDS = 0.25
GENERAL_HINT = "Tab: next knob   Up/Down: double/halve a number   F1: help"


def _plan_job(
    spec: ModelSpec, request: PlanRequest, model: str, allow_download: bool
) -> tuple[Plan, str | None, ModelSpec]:
    """The worker's job: the plan, why its manifest would not validate (None when it does), and
    the spec it was planned on: LoRA targets the spec does not cover yet rebuild it with them,
    as ``--lora-targets`` does (a misspelt module is an error of that knob)."""
    targets = request.workload.lora_targets
    if not request.workload.full_finetune and not spec.has_lora_targets(targets):
        try:
            spec = load_model_spec(model, lora_targets=targets, allow_download=allow_download)
        except (ValueError, KeyError) as err:
            raise KnobErrors({"workload.lora_targets": str(err).strip("'\"")}) from None
    result = _request.compute(spec, request)
    return result, _request.manifest_problem(result), spec


class ExplorerScreen(Screen):
    """Move the knobs, watch one GPU's memory per phase and the chosen FSDPConfig."""

    AUTO_FOCUS = "#knob-cluster--num_gpus"
    BINDINGS = [
        # the app's own two first: a narrow footer keeps its first bindings (quit and help at 60 columns)
        Binding("ctrl+q", "app.quit", "Quit", tooltip="Leave the explorer"),
        Binding("f1", "app.help", "Help", key_display="F1", tooltip="This help (also ? outside a text field)"),
        Binding(
            "ctrl+o",
            "pick_model",
            "Model",
            tooltip="Pick a model: catalog search, a path, or a tiny: name",
        ),
        Binding("ctrl+s", "save", "Save", tooltip="Save the plan's manifest YAML (asks for the path)"),
        Binding(
            "ctrl+p",
            "export",
            "Snippet",
            tooltip="The plan as a copy-ready Python snippet and manifest",
        ),
        Binding(
            "ctrl+r",
            "reset_knob",
            "Reset",
            tooltip="Put the focused knob back to its starting value",
        ),
        Binding(
            "f2",
            "show_tab('memory')",
            "Memory",
            key_display="F2",
            tooltip="Memory bars; Up/Down pick a phase",
        ),
        Binding(
            "f3",
            "show_tab('decisions')",
            "FSDP",
            key_display="F3",
            tooltip="The chosen FSDPConfig, who set each field, and why",
        ),
    ]

    def __init__(self, model: str, values: Mapping[str, str | bool], *, allow_download: bool = False) -> None:
        """``values``: each knob's starting value (:func:`tui._knobs.initial_values`);
        ``allow_download``: a model's config may come from the hub (``--allow-download``)."""
        super().__init__()
        self.model_name = model
        self.allow_download = allow_download
        self.initial = dict(values)
        self.values = dict(values)
        self.spec: ModelSpec | None = None
        self.plan: Plan | None = None
        self.plan_model: str | None = None  # the model self.plan is of (the last good plan may be another's)
        self.request: PlanRequest | None = None  # the request self.plan answers
        self.errors: dict[str, str] = {}  # invalid knobs by key ("" for the whole request)
        self.model_error: str | None = None  # why the last model asked for did not load
        self.manifest_problem: str | None = None  # why self.plan's manifest would not validate
        self.loading_model: str | None = None
        self.last_recompute_seconds: float | None = None  # knob change to plan on screen
        self._plan_wanted: tuple[ModelSpec, PlanRequest, float] | None = None
        self._plan_running: tuple[ModelSpec, PlanRequest, float] | None = None

    # -- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield KnobPanel(self.model_name, self.initial, id="knobs")
                yield Static(GENERAL_HINT, id="hint")
            with Vertical(id="right"):
                yield Verdict(id="verdict")
                with TabbedContent(id="tabs", initial="memory"):
                    with TabPane("Memory", id="memory"):
                        with VerticalScroll(id="memory-scroll"):
                            with Horizontal(id="memory-row"):
                                yield PhaseBars(id="bars")
                                yield ComponentTable(id="components")
                    with TabPane("FSDPConfig", id="decisions"):
                        with VerticalScroll(id="decisions-scroll"):
                            yield DecisionView(id="decision-view")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.model_name
        self._load_model(self.model_name)

    def on_resize(self) -> None:
        self.set_class(self.size.width < NARROW_COLUMNS, "-narrow")
        self.set_class(self.size.width >= ROOMY_COLUMNS, "-roomy")

    # -- model -----------------------------------------------------------------------------------
    def _load_model(self, name: str) -> None:
        """Build the spec in a worker: instant for catalog models, seconds for torch-built ones."""
        self.loading_model, self.model_error = name, None
        self.query_one("#memory-row").loading = True
        self._show_verdict()
        self.run_worker(
            lambda: load_model_spec(name, allow_download=self.allow_download),
            thread=True,
            exclusive=True,
            group="spec",
            name=name,
            exit_on_error=False,
        )

    def _model_loaded(self, name: str, spec: ModelSpec) -> None:
        self.spec, self.model_name, self.loading_model = spec, name, None
        self.query_one("#memory-row").loading = False
        self.query_one(KnobPanel).set_model(name)
        self.sub_title = name
        self._request_plan()

    def _model_failed(self, name: str, error: BaseException) -> None:
        self.loading_model = None
        self.query_one("#memory-row").loading = False
        message = str(error).strip("'\"")
        self.model_error = message if message.startswith(name) else f"{name}: {message}"
        self._show_verdict()
        self.notify(message, title="model not loaded", severity="error", timeout=8)

    # -- planning --------------------------------------------------------------------------------
    @on(KnobRow.Changed)
    def _knob_changed(self, event: KnobRow.Changed) -> None:
        if self.values.get(event.key) == event.value:
            return
        self.values[event.key] = event.value
        if event.key == "workload.algorithm":
            self._take_algorithm_defaults(str(event.value))
        self._request_plan()

    def _take_algorithm_defaults(self, algorithm: str) -> None:
        """Set the knobs the algorithm has its own defaults for (ppo's group of 1 and 4 epochs,
        sft's no rollout, ...), as the command line plans ``--algorithm``; say which moved."""
        rows = self.query_one(KnobPanel).rows()
        moved = []
        for key, text in algorithm_values(algorithm).items():
            if self.values.get(key) != text:
                self.values[key] = text
                rows[key].set_value(text)
                moved.append(f"{key.split('.', 1)[1]}={text}")
        if moved:
            self.notify(f"{algorithm}'s defaults: {', '.join(moved)}", timeout=4)

    def _request_plan(self) -> None:
        try:
            request = _request.build_request(self.values)
        except KnobErrors as err:
            self._set_errors(err.errors)
            return
        self._set_errors({})
        if self.spec is None:
            return
        self._plan_wanted = (self.spec, request, time.perf_counter())
        if self._plan_running is None:
            self._start_plan()

    def _start_plan(self) -> None:
        assert self._plan_wanted is not None
        self._plan_running = self._plan_wanted
        spec, request, _ = self._plan_running
        model, allow_download = self.model_name, self.allow_download
        # Say "planning" only when it takes a while: a fast plan then redraws once, not twice.
        self.set_timer(SLOW_PLAN_SECONDS, self._show_verdict)
        self.run_worker(
            lambda: _plan_job(spec, request, model, allow_download),
            thread=True,
            exclusive=True,
            group="plan",
            exit_on_error=False,
        )

    def _plan_done(self, result: tuple[Plan, str | None, ModelSpec] | None, error: BaseException | None) -> None:
        done, self._plan_running = self._plan_running, None
        if done is not self._plan_wanted:  # the knobs moved on while it ran
            self._start_plan()
            return
        if isinstance(error, KnobErrors):
            self._set_errors(error.errors)
            self._show_verdict()
        elif error is not None:
            self._set_errors({"": f"{type(error).__name__}: {error}"})
            self._show_verdict()
        elif result is not None and done is not None:
            self.plan, self.manifest_problem, spec = result
            self.request, self.plan_model = done[1], self.model_name
            self.model_error = None  # planned on: the failed pick's line has been seen
            if spec is not done[0] and self.spec is done[0]:  # keep the targets it now covers
                self.spec = spec
            self._show_plan()
            started = done[2]
            self.call_after_refresh(self._record_recompute, started)

    def _record_recompute(self, started: float) -> None:
        self.last_recompute_seconds = time.perf_counter() - started

    @property
    def busy(self) -> bool:
        """A plan or a model load is under way."""
        return self._plan_running is not None or self.loading_model is not None

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker, state = event.worker, event.state
        if state not in (WorkerState.SUCCESS, WorkerState.ERROR):
            return
        error = worker.error if state == WorkerState.ERROR else None
        if worker.group == "plan":
            self._plan_done(worker.result if error is None else None, error)
        elif worker.group == "spec":
            if error is None:
                self._model_loaded(worker.name, worker.result)
            else:
                self._model_failed(worker.name, error)

    # -- drawing ---------------------------------------------------------------------------------
    def _set_errors(self, errors: Mapping[str, str]) -> None:
        if dict(errors) == self.errors:
            return
        self.errors = dict(errors)
        self.query_one(KnobPanel).show_errors(self.errors)
        self._show_verdict()

    def _show_verdict(self) -> None:
        status = ""
        if self.loading_model is not None:
            status = f"loading {self.loading_model} ..."
        elif self._plan_running is not None:
            status = "planning ..."
        errors = {"model": self.model_error, **self.errors} if self.model_error else self.errors
        self.query_one(Verdict).show(self.plan, errors=errors, status=status, warnings=self.warnings())

    def warnings(self) -> list[str]:
        """What is off about the current plan itself (not about the inputs)."""
        out = []
        if self.plan is not None and self.plan_model != self.model_name:
            out.append(
                f"the plan shown is {self.plan_model}'s: {self.model_name} has none until the inputs marked are fixed"
            )
        if self.plan is not None and self.plan.fsdp is None and self.request and self.request.fixed:
            out.append(
                f"FSDPConfig overrides ({', '.join(self.request.fixed)}) are unused: the plan does "
                "not shard; set sharding to fsdp to apply them"
            )
        if self.manifest_problem:
            out.append(f"its manifest would not validate: {self.manifest_problem}")
        return out

    def _show_plan(self) -> None:
        plan, request = self.plan, self.request
        assert plan is not None and request is not None
        est = plan.estimate
        bars = self.query_one(PhaseBars)
        bars.show(est, limit_bytes=plan.gpu_limit_bytes)
        self.query_one(ComponentTable).show(est, bars.selected or est.peak_phase)
        self.query_one(DecisionView).show(
            plan, fixed=request.fixed, workload_set=request.workload.model_dump(exclude_unset=True)
        )
        self.query_one(KnobPanel).show_notes(self._planned_notes())
        self._show_verdict()

    def _planned_notes(self) -> dict[str, str]:
        """A note under each workload knob whose value shown the plan moved (the default prompts
        raised to whole ones per GPU): the planned value and why, in short (the FSDP tab has the
        whole reason)."""
        plan = self.plan
        assert plan is not None
        reasons = plan.reasons()
        notes = {}
        for key, shown in self.query_one(KnobPanel).values().items():
            group, _, field = key.partition(".")
            if group != "workload" or field not in reasons or shown in ("", AUTO):
                continue
            planned = getattr(plan.workload, field)
            if str(planned) != str(shown):  # the reason's first clause: the rest is in the FSDP tab
                notes[key] = f"planned {planned}: {re.split(r'[,;:] ', reasons[field])[0]}"
        return notes

    @on(PhaseBars.Selected)
    def _phase_selected(self, event: PhaseBars.Selected) -> None:
        if self.plan is not None and event.phase in self.plan.estimate.phases:
            self.query_one(ComponentTable).show(self.plan.estimate, event.phase)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        """Show the focused knob's description (the model field's) under the knobs."""
        row = next((a for a in event.widget.ancestors_with_self if isinstance(a, KnobRow)), None)
        hint = self.query_one("#hint", Static)
        if row is None:
            tooltip = event.widget.tooltip
            hint.update(Text(tooltip if isinstance(tooltip, str) else GENERAL_HINT))
            return
        knob = row.knob
        extra = " Empty or 'auto': the planner chooses." if knob.auto and knob.kind != "choice" else ""
        hint.update(Text.assemble((knob.field, "bold"), f": {knob.help}{extra}"))

    # -- actions ---------------------------------------------------------------------------------
    @on(Button.Pressed, "#model-button")
    def action_pick_model(self) -> None:
        def chosen(name: str | None) -> None:
            if name:
                self._load_model(name)

        self.app.push_screen(ModelPicker(self.model_name), chosen)

    def action_save(self) -> None:
        if self.plan is None:
            self.notify("no plan to save yet", severity="warning")
            return
        self.app.push_screen(SavePrompt(), self.save_manifest)

    def save_manifest(self, path: str | None) -> Path | None:
        """Write the plan's manifest YAML to ``path``; the path, or None if cancelled or failed."""
        if not path or self.plan is None:
            return None
        if self.plan_model != self.model_name:
            self.notify(
                f"not saved: the plan shown is {self.plan_model}'s, not {self.model_name}'s: fix the inputs marked",
                severity="error",
                timeout=8,
            )
            return None
        if self.manifest_problem:
            self.notify(
                f"not saved: the manifest would not validate: {self.manifest_problem}",
                severity="error",
                timeout=8,
            )
            return None
        try:  # the command line's --output rules: not a folder, not the model's own config.json, ...
            check_output(path, self.model_name, what="the path")
            write_output(path, emit.manifest_yaml(self.plan))
        except (ValueError, OSError) as err:
            self.notify(f"not saved: {getattr(err, 'strerror', None) or err}", severity="error", timeout=8)
            return None
        target = Path(path).expanduser()
        stale = " (inputs have errors: this is the last good plan)" if self.errors else ""
        verdict = "" if self.plan.fits else " (it DOES NOT FIT)"
        self.notify(
            f"manifest written to {target}{verdict}{stale}",
            severity="warning" if stale or verdict else "information",
        )
        return target

    def action_export(self) -> None:
        if self.plan is None:
            self.notify("no plan yet", severity="warning")
            return
        if self.plan_model != self.model_name:
            self.notify(
                f"no snippet: the plan shown is {self.plan_model}'s, not {self.model_name}'s: fix the inputs marked",
                severity="error",
                timeout=8,
            )
            return
        if self.errors:  # as saving says it: the knobs on screen are not this plan's
            self.notify("inputs have errors: the snippet is the last good plan's", severity="warning", timeout=6)
        self.app.push_screen(
            ExportScreen(python=emit.python_snippet(self.plan), manifest=emit.manifest_yaml(self.plan))
        )

    def action_reset_knob(self) -> None:
        focused = self.focused
        row = next((a for a in focused.ancestors_with_self if isinstance(a, KnobRow)), None) if focused else None
        if row is None:
            self.notify("focus a knob to reset it", severity="warning")
            return
        row.set_value(self.initial[row.knob.key])

    def action_show_tab(self, tab: str) -> None:
        self.query_one("#tabs", TabbedContent).active = tab
        target = self.query_one(PhaseBars) if tab == "memory" else self.query_one("#decisions-scroll")
        target.focus()
