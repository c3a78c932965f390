"""Per phase, one GPU's memory as a bar stacked by component, against capacity and margin."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from planner.memory import Estimate
from planner.names import COMPONENTS, PHASES

from .._colors import OVER_COLOR, color_of
from .._knobs import GIB

__all__ = ["PhaseBars", "bar_cells"]

_NAME_WIDTH = 11  # marker + "reference" + space
_TOTAL_WIDTH = 7


def bar_cells(components: dict[str, int], *, scale_bytes: int, width: int) -> list[str | None]:
    """The component in each of ``width`` cells when ``scale_bytes`` spans them (None: empty)."""
    cells: list[str | None] = [None] * width
    order = [c for c in COMPONENTS if c in components] + [c for c in components if c not in COMPONENTS]
    done = 0
    start = 0
    for name in order:
        done += components[name]
        end = min(width, round(done / scale_bytes * width)) if scale_bytes else 0
        cells[start:end] = [name] * (end - start)
        start = max(start, end)
    return cells


class PhaseBars(Widget, can_focus=True):
    """Up/down (or a click) select a phase; :class:`PhaseBars.Selected` says which."""

    BINDINGS = [
        Binding("up,k", "move(-1)", "Previous phase", show=False),
        Binding("down,j", "move(1)", "Next phase", show=False),
    ]

    selected: reactive[str | None] = reactive(None)

    @dataclass
    class Selected(Message):
        phase: str

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.estimate: Estimate | None = None
        self.limit_bytes = 0

    def show(self, estimate: Estimate, *, limit_bytes: int) -> None:
        """Draw ``estimate``; ``limit_bytes`` is capacity less the planner's safety margin."""
        rows = len(self.phases())
        self.estimate, self.limit_bytes = estimate, limit_bytes
        if self.selected not in estimate.phases:
            self.selected = estimate.peak_phase
        self.refresh(layout=len(self.phases()) != rows)

    def phases(self) -> list[str]:
        if self.estimate is None:
            return []
        return [p for p in PHASES if p in self.estimate.phases] + [p for p in self.estimate.phases if p not in PHASES]

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.phases()) + 1

    def watch_selected(self, phase: str | None) -> None:
        if phase is not None:
            self.post_message(self.Selected(phase))

    def action_move(self, step: int) -> None:
        phases = self.phases()
        if phases:
            index = phases.index(self.selected) if self.selected in phases else 0
            self.selected = phases[(index + step) % len(phases)]

    def on_click(self, event: events.Click) -> None:
        phases = self.phases()
        if 0 <= event.y < len(phases):
            self.selected = phases[event.y]

    def render(self) -> Text:
        est = self.estimate
        if est is None:
            return Text("no plan yet", style="dim")
        capacity = est.capacity_bytes
        scale = max(capacity, est.peak_bytes)
        width = max(8, self.content_size.width - _NAME_WIDTH - _TOTAL_WIDTH)
        capacity_cell = round(capacity / scale * width)
        limit_cell = round(min(self.limit_bytes, capacity) / scale * width)
        out = Text(no_wrap=True, overflow="ellipsis")
        for name in self.phases():
            phase = est.phases[name]
            chosen = name == self.selected
            out.append("▶" if chosen else " ", style="bold")
            out.append(
                f"{name:<{_NAME_WIDTH - 2}} ",
                style="reverse" if chosen and self.has_focus else "bold" if chosen else "",
            )
            for i, component in enumerate(bar_cells(phase.components, scale_bytes=scale, width=width)):
                if component is not None:
                    out.append("█", style=OVER_COLOR if i >= capacity_cell else color_of(component))
                elif i < limit_cell:
                    out.append("·", style="dim")
                elif i < capacity_cell:
                    out.append("░", style="yellow")
                else:
                    out.append(" ")
            total = phase.total
            style = f"bold {OVER_COLOR}" if total > capacity else "yellow" if total > self.limit_bytes else ""
            if name == est.peak_phase:
                style += " underline"
            out.append(f"{total / GIB:>{_TOTAL_WIDTH}.1f}", style=style.strip())
            out.append("\n")
        # the capacity first: a narrow panel cuts the legend's end, and the keys matter least
        out.append(f"{format(capacity / GIB, '.1f') + ' GiB':<{_NAME_WIDTH - 1}} ", style="dim")
        out.append("· free ", style="dim")
        out.append("░ margin ", style="yellow")
        out.append("█ over", style=OVER_COLOR)
        return out
