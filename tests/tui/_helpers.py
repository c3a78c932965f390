"""Pilot helpers shared by the explorer's tests."""

from __future__ import annotations

import asyncio
import functools
import time

from textual.pilot import Pilot
from textual.widgets import Input, Select
from textual.worker import WorkerFailed

from tui.screens import ExplorerScreen
from tui.widgets import control_id

#: Catalog models: their specs load without torch.
MODEL = "Qwen/Qwen2.5-7B"
BIG_MODEL = "meta-llama/Llama-3.1-70B"
WIDE = (120, 40)
SMALL = (80, 24)


def pilot_test(test):
    """Run an ``async def`` test with asyncio.run (no pytest-asyncio needed).

    Fixtures pass through.
    """

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


async def settle(pilot: Pilot, *, timeout_s: float = 45.0) -> ExplorerScreen:
    """Wait until no model load or plan is under way and every message is handled."""
    screen = pilot.app.explorer
    deadline = time.monotonic() + timeout_s
    while True:
        await pilot.pause()
        try:
            await pilot.app.workers.wait_for_complete()
        except WorkerFailed:  # a plan's bad input, still registered: the explorer says it on its knobs
            pass
        await pilot.pause()
        if not screen.busy:
            return screen
        if time.monotonic() > deadline:
            raise TimeoutError("the explorer is still planning")


def control(pilot: Pilot, key: str):
    return pilot.app.explorer.query_one(f"#{control_id(key)}")


async def set_knob(pilot: Pilot, key: str, value: str) -> ExplorerScreen:
    """Set a knob's control as a user would end up setting it, then wait for the plan."""
    widget = control(pilot, key)
    if isinstance(widget, Select):
        widget.value = value
    else:
        assert isinstance(widget, Input)
        widget.value = value
    return await settle(pilot)
