"""The knobs, by group, in a scrolling column; the model button on top."""

from __future__ import annotations

from collections.abc import Mapping

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Button, Label

from .._knobs import knob_table
from ._knob_row import KnobRow

__all__ = ["KnobPanel"]

_GROUP_TITLES = {
    "cluster": "Cluster",
    "plan": "Planner",
    "workload": "Workload",
    "fsdp": "FSDPConfig (auto: planner)",
}


class KnobPanel(VerticalScroll):
    """Every knob of :func:`tui._knobs.knob_table`, started from ``values``."""

    def __init__(self, model: str, values: Mapping[str, str | bool], **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.initial = dict(values)

    def compose(self) -> ComposeResult:
        yield Label("Model", classes="knob-group")
        yield Button(
            self.model,
            id="model-button",
            compact=True,
            tooltip="A catalog model, a model directory or config.json, or tiny:<arch>?... (^o)",
        )
        group = None
        for knob in knob_table():
            if knob.group != group:
                yield Label(_GROUP_TITLES[knob.group], classes="knob-group")
            group = knob.group
            yield KnobRow(knob, self.initial[knob.key])

    def rows(self) -> dict[str, KnobRow]:
        return {row.knob.key: row for row in self.query(KnobRow)}

    def values(self) -> dict[str, str | bool]:
        return {key: row.value for key, row in self.rows().items()}

    def show_errors(self, errors: Mapping[str, str]) -> None:
        for key, row in self.rows().items():
            row.show_error(errors.get(key))

    def show_notes(self, notes: Mapping[str, str]) -> None:
        """Under each knob in ``notes`` (by key), what the plan made of its value."""
        for key, row in self.rows().items():
            row.show_note(notes.get(key))

    def set_model(self, model: str) -> None:
        self.model = model
        self.query_one("#model-button", Button).label = model
