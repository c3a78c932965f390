"""tui.app's command line: the flags are a public surface (agilerl-plan-tui, agilerl-plan --tui)."""

from __future__ import annotations

import pytest

import tui.app
from tui.app import DEFAULT_MODEL, main, parser

pytestmark = pytest.mark.timeout(60)


def test_flags_are_pinned():
    flags = {a.dest: a.option_strings for a in parser()._actions if a.dest != "help"}
    assert flags == {
        "model": [],
        "gpus": ["--gpus"],
        "gpus_per_node": ["--gpus-per-node"],
        "gpu": ["--gpu"],
        "gpu_memory": ["--gpu-memory"],
        "host_memory": ["--host-memory"],
        "allow_download": ["--allow-download"],
    }


def test_main_runs_the_explorer_with_the_parsed_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(tui.app, "run", lambda model, **kw: calls.append((model, kw)))
    assert (
        main(
            [
                "meta-llama/Llama-3.1-70B",
                "--gpus",
                "16",
                "--gpus-per-node",
                "8",
                "--gpu",
                "h200",
                "--gpu-memory",
                "120",
                "--host-memory",
                "2048",
            ]
        )
        == 0
    )
    assert calls == [
        (
            "meta-llama/Llama-3.1-70B",
            {
                "gpus": 16,
                "gpus_per_node": 8,
                "gpu": "h200",
                "gpu_memory_gib": 120.0,
                "host_memory_gib": 2048.0,
                "allow_download": False,
            },
        )
    ]
    assert main([]) == 0
    assert calls[-1] == (
        DEFAULT_MODEL,
        {
            "gpus": 1,
            "gpus_per_node": None,
            "gpu": "H100-80GB",
            "gpu_memory_gib": None,
            "host_memory_gib": None,
            "allow_download": False,
        },
    )
    assert main(["Qwen/Qwen2.5-7B", "--allow-download"]) == 0  # as agilerl-plan --tui takes it
    assert calls[-1][1]["allow_download"] is True


def test_an_unknown_gpu_kind_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(tui.app, "run", lambda *a, **kw: pytest.fail("must not start"))
    assert main(["--gpu", "H1OO"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


def test_without_a_terminal_it_says_so_and_draws_nothing(monkeypatch, capsys):
    monkeypatch.setattr(tui.app.ExplorerApp, "run", lambda self: pytest.fail("must not start"))
    assert main(["qwen2.5-0.5b"]) == 2  # pytest's stdin and stdout are not terminals
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a terminal" in err


def test_an_unknown_model_is_a_usage_error_before_the_explorer_opens(monkeypatch, capsys):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.setattr(tui.app.ExplorerApp, "run", lambda self: pytest.fail("must not start"))
    assert main(["no-such-org/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model" in err


def test_plan_flags_the_explorer_would_ignore_are_refused(monkeypatch, capsys):
    from planner.cli import main as plan_main

    monkeypatch.setattr(tui.app, "run", lambda *a, **kw: pytest.fail("must not start"))
    assert plan_main(["qwen2.5-0.5b", "--tui", "--micro-batch-size-per-gpu", "4", "--format", "json"]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch-size-per-gpu" in err and "--format" in err and err.count("\n") == 1
    # LoRA targets have a knob of their own there
    assert plan_main(["qwen2.5-0.5b", "--tui", "--lora-targets", "q_proj,v_proj"]) == 2
    assert "set --lora-targets in the explorer" in capsys.readouterr().err


def test_plan_with_tui_opens_the_explorer_with_its_flags(monkeypatch):
    from planner.cli import main as plan_main

    calls = []
    monkeypatch.setattr(tui.app, "run", lambda model, **kw: calls.append((model, kw)))
    argv = ["qwen2.5-0.5b", "--tui", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h200", "--host-memory", "512"]
    assert plan_main(argv) == 0
    assert calls == [
        (
            "qwen2.5-0.5b",
            {
                "gpus": 16,
                "gpus_per_node": 8,
                "gpu": "h200",
                "gpu_memory_gib": None,
                "host_memory_gib": 512.0,
                "allow_download": False,
            },
        )
    ]


def test_a_gpu_memory_that_is_no_devices_is_one_line_before_the_explorer_starts(monkeypatch, capsys):
    """A plain float took nan and inf, and the explorer raised on them (a traceback)."""
    monkeypatch.setattr(tui.app.sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(tui.app.sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(tui.app.ExplorerApp, "run", lambda self: pytest.fail("must not start"))
    for text in ("nan", "inf", "0"):
        with pytest.raises(SystemExit) as exit_:
            main(["--gpu-memory", text])
        assert exit_.value.code == 2
        assert "--gpu-memory" in capsys.readouterr().err
    assert main(["--gpu-memory", "1e-9"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
    for flag in ("--host-memory", "--gpu-memory"):  # a figure past any device's: one line, exit 2
        assert main([flag, "1e300"]) == 2
        assert flag in capsys.readouterr().err


def test_allow_download_reaches_the_explorers_model_loads(monkeypatch):
    """`agilerl-plan MODEL --tui --allow-download` was accepted, then every load was offline."""
    import argparse

    seen = []
    monkeypatch.setattr(tui.app, "check_model", lambda model, *, allow_download: seen.append(allow_download))
    monkeypatch.setattr(tui.app.sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(tui.app.sys.stdout, "isatty", lambda: True)
    apps = []
    monkeypatch.setattr(tui.app.ExplorerApp, "run", lambda self: apps.append(self))
    args = argparse.Namespace(
        model=DEFAULT_MODEL,
        gpus=1,
        gpus_per_node=None,
        gpu="H100-80GB",
        gpu_memory=None,
        host_memory=None,
        allow_download=True,
    )
    tui.app.run_with(args)
    assert seen == [True] and apps[0].explorer.allow_download is True
