"""The verdict line: fits or DOES NOT FIT, the peak, the planner's suggested fixes, input errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.text import Text
from textual.widgets import Static

from planner.choose import Plan

from .._colors import OVER_COLOR
from .._knobs import GIB

__all__ = ["Verdict"]


class Verdict(Static):
    """What the current plan says, and why it may be stale."""

    _shown: Text | None = None

    def show(
        self,
        plan: Plan | None,
        *,
        errors: Mapping[str, str],
        status: str = "",
        warnings: Sequence[str] = (),
    ) -> None:
        """``errors``: bad inputs by knob key; ``warnings``: what is off with the plan itself."""
        out = Text()
        if plan is None:
            out.append(status or "no plan yet", style="dim")
        else:
            est = plan.estimate
            if plan.fits:
                out.append(" FITS ", style="bold black on green")
                out.append(
                    f" peak {est.peak_bytes / GIB:.2f} GiB in {est.peak_phase}, "
                    f"{est.headroom_bytes / GIB:.2f} GiB headroom of {est.capacity_bytes / GIB:.2f}"
                )
                if plan.engine_rank is not None:
                    out.append(f"; an engine rank of its own {plan.engine_rank.total / GIB:.2f} GiB")
                if plan.host_limit_bytes is not None:
                    out.append(
                        f"; host {plan.host_per_node_bytes / GIB:.2f} of {plan.host_limit_bytes / GIB:.2f} GiB a node"
                    )
            else:
                out.append(" DOES NOT FIT ", style=f"bold white on {OVER_COLOR}")
                # what is over its limit (the trainers' GPUs where the plan names nothing: a plan
                # that does not fit is over one of its limits)
                over = plan.over() or plan.limits()[:1]
                gpus = [
                    limit for limit in over if limit.what != "host"
                ]  # the trainers' and an engine rank's: one limit
                shown = [limit.short() for limit in over if limit.what == "host"]
                if gpus:
                    shown.insert(0, f"peak {' and '.join(g.short(limit=False) for g in gpus)} > {gpus[0].short_limit}")
                out.append(f" {'; '.join(shown)}", style=f"bold {OVER_COLOR}")
        # the inputs' errors right under the headline: the verdict's height is capped (8 lines),
        # and a fix for the last good plan matters less than what stops the next one
        for key, message in errors.items():
            where = key.split(".", 1)[-1] if key else "input"
            out.append(f"\n⚠ {where}: {message}", style="bold yellow")
        if errors and plan is not None:
            out.append("\n  (showing the last good plan)", style="yellow")
        if plan is not None:
            for fix in () if plan.fits else plan.suggestions:
                out.append("\n  fix: ", style="bold")
                out.append(fix)
            for warning in warnings:
                out.append(f"\n⚠ {warning}", style="bold yellow")
            if status:
                out.append(f"\n{status}", style="dim italic")
        self.set_class(plan is not None and not plan.fits, "-over")
        if out != self._shown:  # an unchanged verdict costs no relayout
            self._shown = out
            self.update(out)
