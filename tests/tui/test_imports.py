"""The explorer on a catalog model needs no torch (the rest of the import checks: tests/test_import_hygiene.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_explorer_plans_a_catalog_model_without_torch():
    out = _python("""
        import asyncio, sys
        import tui
        from tui.app import ExplorerApp

        async def main():
            app = ExplorerApp("Qwen/Qwen2.5-7B", gpus=8)
            async with app.run_test(size=(80, 24)) as pilot:
                for _ in range(600):
                    await pilot.pause(0.05)
                    if app.explorer.plan is not None and not app.explorer.busy:
                        break
                await pilot.press("ctrl+p")
                await pilot.pause()
                return app.explorer.plan

        plan = asyncio.run(main())
        assert plan is not None and plan.model == "Qwen/Qwen2.5-7B"
        print(sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules))
    """)
    assert out.strip().splitlines()[-1] == "[]"
