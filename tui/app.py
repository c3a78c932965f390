"""``agilerl-plan-tui`` / ``agilerl-plan MODEL --tui``: the interactive explorer of memory plans.

agilerl-plan-tui [MODEL] [--gpus N] [--gpus-per-node N] [--gpu H100-80GB] [--gpu-memory GIB]
"""

from __future__ import annotations

import argparse
import sys

from textual.app import App
from textual.binding import Binding

from agilerl.utils.cli import positive_float, positive_int
from planner.hardware import GPUS, gpu_by_name, memory_bytes

from ._knobs import initial_values
from .screens import ExplorerScreen, HelpScreen

__all__ = ["DEFAULT_MODEL", "ExplorerApp", "main", "run"]

DEFAULT_MODEL = "Qwen/Qwen2.5-7B"


class ExplorerApp(App[None]):
    """One explorer screen, with its dialogs on top."""

    CSS_PATH = "explorer.tcss"
    TITLE = "agilerl-plan explorer"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding(
            "f1",
            "help",
            "Help",
            key_display="F1",
            tooltip="This help (also ? outside a text field)",
        ),
        Binding("question_mark", "help", "Help", show=False),
        Binding("ctrl+q", "quit", "Quit", tooltip="Leave the explorer"),
    ]

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        gpus: int = 1,
        gpus_per_node: int | None = None,
        gpu: str = "H100-80GB",
        gpu_memory_gib: float | None = None,
        host_memory_gib: float | None = None,
        allow_download: bool = False,
    ) -> None:
        super().__init__()
        values = initial_values(
            num_gpus=gpus,
            gpus_per_node=gpus_per_node,
            gpu=gpu,
            gpu_memory_gib=gpu_memory_gib,
            host_memory_gib=host_memory_gib,
        )
        self.explorer = ExplorerScreen(model, values, allow_download=allow_download)

    def get_default_screen(self) -> ExplorerScreen:
        return self.explorer

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        keys: list[tuple[str, str]] = []
        seen: set[str] = set()
        for b in (*ExplorerScreen.BINDINGS, *self.BINDINGS):  # the screen repeats quit and help first
            if b.show and b.key not in seen:
                seen.add(b.key)
                keys.append((b.key_display or b.key, b.tooltip or b.description))
        keys += [
            ("Tab / Shift+Tab", "next / previous knob"),
            ("Up / Down", "double / halve a number; previous / next phase in the bars"),
            ("Enter", "open a choice; pick a model in the list"),
        ]
        self.push_screen(HelpScreen(keys))


def run(
    model: str = DEFAULT_MODEL,
    *,
    gpus: int = 1,
    gpus_per_node: int | None = None,
    gpu: str = "H100-80GB",
    gpu_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
    allow_download: bool = False,
) -> None:
    """Run the explorer in this terminal until the user quits; ValueError, before anything is
    drawn, when there is no terminal, a figure is not a device's, or the model cannot be found
    (offline unless ``allow_download``: then its config may come from the hub)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ValueError(
            "the explorer needs a terminal (stdin and stdout are not one here): "
            "plan with agilerl-plan MODEL --format table|json|yaml|python instead"
        )
    if gpu_memory_gib is not None:
        memory_bytes(gpu_memory_gib, "--gpu-memory")  # nan, inf, 0: one line, not a traceback
    if host_memory_gib is not None:
        memory_bytes(host_memory_gib, "--host-memory")
    check_model(model, allow_download=allow_download)
    ExplorerApp(
        model,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        gpu_memory_gib=gpu_memory_gib,
        host_memory_gib=host_memory_gib,
        allow_download=allow_download,
    ).run()


def run_with(args: argparse.Namespace) -> None:
    """:func:`run` with a command line's model, GPUs and GPU (agilerl-plan-tui, agilerl-plan --tui)."""
    run(
        args.model,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu=args.gpu,
        gpu_memory_gib=args.gpu_memory,
        host_memory_gib=args.host_memory,
        allow_download=getattr(args, "allow_download", False),
    )


def check_model(model: str, *, allow_download: bool = False) -> None:
    """ValueError in one line when ``model`` names nothing the planner can read."""
    from planner.models import ModelNotFound, load_model_spec

    try:
        load_model_spec(model, allow_download=allow_download)
    except ModelNotFound as err:
        raise ValueError(str(err)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agilerl-plan-tui",
        description="Explore GRPO + LoRA memory plans interactively: move the knobs, watch "
        "each GPU's memory per phase and the chosen FSDPConfig.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"catalog name or hub id, model directory, config.json, or 'tiny:<arch>?...' [default: {DEFAULT_MODEL}]",
    )
    p.add_argument("--gpus", type=positive_int, default=1, help="trainer GPUs in total")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs per node (default: all on one node)")
    p.add_argument("--gpu", default="H100-80GB", help=f"GPU kind: {', '.join(GPUS)}")
    p.add_argument(
        "--gpu-memory",
        type=positive_float,
        default=None,
        metavar="GIB",
        help="GPU memory in GiB (overrides the catalog figure of --gpu)",
    )
    p.add_argument(
        "--host-memory",
        type=positive_float,
        default=None,
        metavar="GIB",
        help="host memory (RAM) per node in GiB: judged by the plan [default: reported, not judged]",
    )
    p.add_argument(
        "--allow-download",
        action="store_true",
        help="fetch a model's config from the hub if it is not local (every model picked in the explorer too)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        gpu_by_name(args.gpu)
    except KeyError as err:
        print(f"agilerl-plan-tui: error: {str(err).strip(chr(39))}", file=sys.stderr)
        return 2
    try:
        run_with(args)
    except ValueError as err:
        print(f"agilerl-plan-tui: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
