"""One knob: a label, its control (Input, Select or Checkbox) and an inline error line."""

from __future__ import annotations

import math
from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Checkbox, Input, Label, Select

from .._knobs import AUTO, Knob

__all__ = ["KnobRow", "StepInput", "control_id"]


def control_id(key: str) -> str:
    """The DOM id of a knob's control (ids cannot hold dots)."""
    return "knob-" + key.replace(".", "--")


class StepInput(Input):
    """A number field: Up/Down double and halve (fractions step 0.05); below the minimum is auto."""

    BINDINGS = [
        Binding("up", "step(1)", "More", show=False),
        Binding("down", "step(-1)", "Less", show=False),
    ]

    def __init__(self, *args, number: str, can_be_auto: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.number = number
        self.can_be_auto = can_be_auto

    def action_step(self, direction: int) -> None:
        try:
            current = float(self.value) if self.value.strip() not in ("", AUTO) else None
        except ValueError:
            return
        if current is not None and not math.isfinite(current):
            return  # inf or nan (1e400 reads as inf): nothing to step from; the field says why
        self.value = _stepped(current, direction, integer=self.number == "int", can_be_auto=self.can_be_auto)
        self.cursor_position = len(self.value)


def _stepped(current: float | None, direction: int, *, integer: bool, can_be_auto: bool) -> str:
    if current is None:
        return "1" if direction > 0 else ""
    if integer:
        value = int(current) * 2 if direction > 0 else int(current) // 2
        if value < 1:
            return "" if can_be_auto else "1"
        return str(value)
    if current < 1 or (current == 1 and direction < 0):
        return f"{min(1.0, max(0.05, round(current + 0.05 * direction, 2))):g}"
    return f"{current * 2 if direction > 0 else current / 2:g}"


def _flag_label(value: bool) -> str:
    return "true" if value else "false"


class KnobRow(Vertical):
    """A knob's row; posts :class:`KnobRow.Changed` with the raw value when its control changes."""

    @dataclass
    class Changed(Message):
        key: str
        value: str | bool

    def __init__(self, knob: Knob, value: str | bool) -> None:
        super().__init__(classes="knob-row")
        self.knob = knob
        self.initial = value
        self.error: str | None = None
        self.note: str | None = None

    def compose(self) -> ComposeResult:
        knob = self.knob
        with Horizontal(classes="knob-line"):
            yield Label(knob.label, classes="knob-label")
            yield self._control(knob, self.initial)
        yield Label("", classes="knob-error")
        yield Label("", classes="knob-note")

    @staticmethod
    def _control(knob: Knob, value: str | bool) -> Widget:
        cid = control_id(knob.key)
        match knob.kind:
            case "flag":
                return Checkbox(_flag_label(bool(value)), bool(value), id=cid, tooltip=knob.help, compact=True)
            case "choice":
                return Select(
                    [(c, c) for c in knob.choices],
                    value=str(value),
                    allow_blank=False,
                    id=cid,
                    tooltip=knob.help,
                    compact=True,
                )
            case "int" | "float":
                return StepInput(str(value), **_text_options(knob, cid), number=knob.kind, can_be_auto=knob.auto)
            case _:
                return Input(str(value), **_text_options(knob, cid))

    @property
    def control(self) -> Widget:
        return self.query_one(f"#{control_id(self.knob.key)}")

    @property
    def value(self) -> str | bool:
        control = self.control
        if isinstance(control, Checkbox | Input):
            return control.value
        assert isinstance(control, Select)
        return str(control.value)

    def set_value(self, value: str | bool) -> None:
        control = self.control
        if isinstance(control, Checkbox):
            control.value = bool(value)
        elif isinstance(control, Input):
            control.value = str(value)
        else:
            assert isinstance(control, Select)
            control.value = str(value)

    def show_error(self, message: str | None) -> None:
        if message == self.error:
            return  # restyling every row on every keystroke is what would make typing slow
        self.error = message
        self.set_class(bool(message), "-invalid")
        self.query_one(".knob-error", Label).update(message or "")

    def show_note(self, message: str | None) -> None:
        """What the plan made of the value shown (``planned 9: ...``), or None; an error hides it."""
        if message == self.note:
            return
        self.note = message
        self.set_class(bool(message), "-noted")
        self.query_one(".knob-note", Label).update(message or "")

    @on(Input.Changed)
    @on(Select.Changed)
    @on(Checkbox.Changed)
    def _changed(self, event: Input.Changed | Select.Changed | Checkbox.Changed) -> None:
        event.stop()
        if isinstance(event, Checkbox.Changed):
            event.checkbox.label = _flag_label(event.value)
        self.post_message(self.Changed(self.knob.key, self.value))


def _text_options(knob: Knob, cid: str) -> dict:
    """What every text control of a knob is built with."""
    placeholder = knob.placeholder if knob.placeholder is not None else AUTO if knob.auto else ""
    return {"placeholder": placeholder, "id": cid, "tooltip": knob.help, "compact": True}
