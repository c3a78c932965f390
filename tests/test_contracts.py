"""The project's checks on itself, run by the README's test command so that CI enforces them:
import-linter's contracts (pyproject.toml), ruff's lint and format, and the type checker."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[dev]'"
    return found


def test_import_contracts_hold():
    done = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_ruff_passes():
    done = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_code_is_formatted():
    """``ruff format`` (pyproject's line length): run it, or the commit hook, before committing."""
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.timeout(600)
def test_the_planner_and_the_runtime_type_check():
    """mypy over ``[tool.mypy] files`` (planner/, agilerl/distributed/): no errors."""
    done = subprocess.run([_tool("mypy"), "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout


def test_the_commit_hooks_run_the_same_checks():
    """.pre-commit-config.yaml runs what this module runs, on the same installed tools."""
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert all(repo["repo"] == "local" for repo in config["repos"])  # nothing downloaded
    entries = {hook["id"]: hook for hook in hooks}
    assert entries["ruff"]["entry"].split()[:2] == ["ruff", "check"]
    assert entries["ruff-format"]["entry"].split()[:2] == ["ruff", "format"]
    assert entries["import-contracts"]["entry"].split()[0] == "lint-imports"
    assert entries["import-contracts"]["pass_filenames"] is False  # the contracts are over the whole project
    assert entries["mypy"]["entry"].split()[0] == "mypy" and entries["mypy"]["pass_filenames"] is False


def test_no_function_longer_than_150_lines():
    """Long functions are split along their steps (planner.choose.plan, the probe worker): the
    limit is checked here so that it stays true."""
    import ast

    long = []
    for package in ("agilerl", "planner", "tui"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 150:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
