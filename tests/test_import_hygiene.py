"""What each entry point imports: the planner stays headless and torch-free where it says so.

One parametrised check in a fresh interpreter per case (``sys.modules`` of this process already
holds everything). The static side, which module may import which, is pyproject.toml's
import-linter contracts, run by tests/test_contracts.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

CASES = {
    "FSDPConfig": (
        "from agilerl.distributed import FSDPConfig; FSDPConfig(tp=1).check_world(8)",
        ("torch",),
    ),
    "the planner core": (
        "import planner.catalog, planner.choose, planner.emit, planner.memory, planner.models",
        ("torch", "transformers", "peft", "optuna", "textual"),
    ),
    "the planner's public API": (
        """
        import planner
        assert {n for n in planner.__all__ if getattr(planner, n) is None} == set()
        """,
        ("torch", "transformers", "peft", "optuna", "textual"),
    ),
    "every catalog spec": (
        """
        import planner.catalog as c
        specs = [c.load_spec(n) for n in c.names()]
        c.resolve('qwen2.5-7b'); c.suggest('qwen2-7b')
        assert len(specs) > 50, len(specs)
        """,
        ("torch", "transformers", "peft", "yaml"),
    ),
    "a catalog plan on the command line": (
        """
        from planner.cli import main
        assert main(['meta-llama/Llama-3.1-70B', '--gpus', '8']) in (0, 3)
        """,
        ("torch", "transformers", "peft", "textual", "optuna"),
    ),
    "the tuner's command-line glue": (
        """
        import argparse
        import planner.choose, planner.memory, planner.probe, planner.tune
        planner.tune.add_tune_arguments(argparse.ArgumentParser())
        """,
        ("optuna", "sqlalchemy", "torch", "transformers", "peft"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_an_entry_point_imports(case):
    code, forbidden = CASES[case]
    script = textwrap.dedent(code) + f"\nimport sys\nprint(sorted(m for m in {forbidden!r} if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", f"{case} imported {done.stdout.splitlines()[-1]}"
