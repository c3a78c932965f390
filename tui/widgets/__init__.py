"""The explorer's widgets: knobs, bars, tables, verdict, decisions."""

from ._component_table import ComponentTable
from ._decisions import DecisionView
from ._knob_panel import KnobPanel
from ._knob_row import KnobRow, StepInput, control_id
from ._phase_bars import PhaseBars, bar_cells
from ._verdict import Verdict

__all__ = [
    "ComponentTable",
    "DecisionView",
    "KnobPanel",
    "KnobRow",
    "PhaseBars",
    "StepInput",
    "Verdict",
    "bar_cells",
    "control_id",
]
