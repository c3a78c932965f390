"""One phase's memory by component: the legend of the bars, with sizes."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from planner.memory import Estimate
from planner.names import COMPONENTS

from .._colors import OVER_COLOR, color_of
from .._knobs import GIB

__all__ = ["ComponentTable"]


class ComponentTable(Static):
    """Components of the selected phase on one GPU, largest share first in the bars' order."""

    phase: str | None = None  # the phase shown

    def show(self, estimate: Estimate, phase: str) -> None:
        self.phase = phase
        ph = estimate.phases[phase]
        table = Table(
            box=None,
            padding=(0, 1),
            show_edge=False,
            expand=False,
            title_justify="left",
            title=Text(f"{phase} phase, per GPU", style="bold"),
        )
        table.add_column("", width=2, no_wrap=True)
        table.add_column("component", no_wrap=True)
        table.add_column("GiB", justify="right", no_wrap=True)
        table.add_column("%", justify="right", no_wrap=True)
        total = ph.total or 1
        order = [c for c in COMPONENTS if c in ph.components] + [c for c in ph.components if c not in COMPONENTS]
        for name in order:
            value = ph.components[name]
            if value:
                table.add_row(
                    Text("██", style=color_of(name)),
                    name,
                    f"{value / GIB:.2f}",
                    f"{100 * value / total:.0f}",
                )
        capacity = estimate.capacity_bytes
        headroom = capacity - ph.total
        table.add_section()
        table.add_row("", Text("total", style="bold"), Text(f"{ph.total / GIB:.2f}", style="bold"), "")
        table.add_row("", "capacity", f"{capacity / GIB:.2f}", "")
        table.add_row(
            "",
            "headroom",
            Text(f"{headroom / GIB:.2f}", style=OVER_COLOR if headroom < 0 else "green"),
            "",
        )
        self.update(table)
