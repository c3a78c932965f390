"""Screenshots of the explorer (pytest-textual-snapshot).

Catalog models, fixed sizes, no cursor blink, and the estimate's default coefficients (not the
shipped or user calibration, which refits change). Update after a deliberate change of the look
or of the estimate: ``pytest tests/tui/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from textual.pilot import Pilot
from textual.widgets import Input

from planner import calibration
from planner.memory import Coefficients
from tui.app import ExplorerApp

from ._helpers import BIG_MODEL, MODEL, SMALL, WIDE, settle

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _default_coefficients(monkeypatch):
    monkeypatch.setattr(calibration, "coefficients_for", lambda gpu: Coefficients())
    monkeypatch.setattr(calibration, "coefficients_source", lambda gpu: "defaults")


async def _ready(pilot: Pilot) -> None:
    await settle(pilot)
    for field in pilot.app.screen.query(Input):
        field.cursor_blink = False
    await pilot.pause()


def test_fits_wide(snap_compare):
    assert snap_compare(ExplorerApp(MODEL, gpus=8), terminal_size=WIDE, run_before=_ready)


def test_fits_80x24(snap_compare):
    assert snap_compare(ExplorerApp(MODEL, gpus=8), terminal_size=SMALL, run_before=_ready)


def test_does_not_fit_80x24(snap_compare):
    assert snap_compare(ExplorerApp("Qwen/Qwen2.5-14B", gpu="L4"), terminal_size=SMALL, run_before=_ready)


def test_fsdp_decisions_wide(snap_compare):
    app = ExplorerApp(BIG_MODEL, gpus=16, gpus_per_node=8)

    async def fsdp_tab(pilot: Pilot) -> None:
        await _ready(pilot)
        await pilot.press("f3")
        await pilot.pause()

    assert snap_compare(app, terminal_size=WIDE, run_before=fsdp_tab)
