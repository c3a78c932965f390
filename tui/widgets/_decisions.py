"""The chosen FSDPConfig, field by field, with who set each value and the planner's reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.text import Text
from textual.widgets import Static

from agilerl.distributed import FSDPConfig
from planner.choose import Plan
from planner.workload import Workload

__all__ = ["DecisionView"]

#: Workload fields the planner resolves besides FSDPConfig's.
_WORKLOAD_DECISIONS = ("micro_batch_size_per_gpu", "gradient_checkpointing", "logprob_chunk_size")


def _line(out: Text, field: str, value: Any, source: str, reason: str | None) -> None:
    out.append(f"{field} = ", style="bold")
    out.append(repr(value) if isinstance(value, str) else str(value), style="cyan")
    style = {"you": "bold magenta", "planner": "green"}.get(source, "dim")
    out.append(f"  {source}\n", style=style)
    if reason:
        out.append(f"    {reason}\n", style="dim")


class DecisionView(Static):
    """Every FSDPConfig field of a plan, and the workload knobs the planner resolved."""

    def show(self, plan: Plan, *, fixed: Mapping[str, Any], workload_set: Mapping[str, Any]) -> None:
        """``fixed``: FSDPConfig fields the user overrode; ``workload_set``: workload fields set."""
        reasons = plan.reasons()
        out = Text()
        sharding = next((d for d in plan.decisions if d.field == "sharding"), None)
        if plan.fsdp is None:
            out.append("No FSDPConfig: ", style="bold")
            out.append(f"{sharding.value if sharding else 'not sharded'}\n", style="cyan")
            if sharding:
                out.append(f"    {sharding.reason}\n", style="dim")
            if fixed:
                out.append(f"    your overrides ({', '.join(fixed)}) are unused\n", style="yellow")
        else:
            out.append("FSDPConfig\n", style="bold underline")
            if sharding:
                out.append(f"    sharding: {sharding.reason}\n", style="dim")
            for field in FSDPConfig.model_fields:
                source = "you" if field in fixed else "planner" if field in reasons else "default"
                _line(out, field, getattr(plan.fsdp, field), source, reasons.get(field))
        out.append("\nWorkload\n", style="bold underline")
        # the knobs the planner always resolves, then every other workload field it decided (the
        # engine's fraction and sequences, a rollout gather, prompts raised to whole ones per GPU)
        decided = [d.field for d in plan.decisions if d.field in Workload.model_fields]
        for field in dict.fromkeys([*_WORKLOAD_DECISIONS, *decided]):
            # the planner's wherever it gave a reason: it decided the field, or moved the value the
            # knob holds (prompts raised to whole ones per GPU)
            source = "planner" if field in reasons else "you" if workload_set.get(field) is not None else "default"
            _line(out, field, getattr(plan.workload, field), source, reasons.get(field))
        out.append("\nNotes\n", style="bold underline")
        out.append(f"  coefficients: {plan.coefficients_source}\n", style="italic")
        for note in plan.estimate.notes:
            out.append(f"  {note}\n", style="italic")
        self.update(out)
