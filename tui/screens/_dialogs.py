"""Small modal screens: the save-path prompt, the copy-ready snippet and manifest, the help."""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static, TabbedContent, TabPane, TextArea

__all__ = ["ExportScreen", "HelpScreen", "SavePrompt"]

HELP_TEXT = (
    "\n[b]Knobs[/b]: Tab / Shift+Tab move between them; the focused one's description shows "
    "below the list (and as a tooltip). Number fields: type a value, or Up / Down to double / "
    "halve it. An empty field or [i]auto[/i] leaves the value to the planner; every FSDPConfig "
    "field is auto or an override you set.\n"
    "[b]Plan[/b]: recomputed on every change, in the background. An invalid knob is marked in "
    "place and the last good plan stays on screen.\n"
    "[b]Bars[/b]: one GPU's memory per phase, stacked by component; the table beside lists the "
    "selected phase (Up / Down in the bars). [yellow]░[/] is the safety margin, [#ff3b30]█[/] "
    "what is over capacity."
)


class SavePrompt(ModalScreen[str | None]):
    """Ask where to write the manifest; Enter saves, Escape cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, default: str = "manifest.yaml") -> None:
        super().__init__()
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="save-dialog"):
            yield Label("Save the manifest YAML (for agilerl-train) to:", classes="dialog-title")
            yield Input(self.default, id="save-path")
            yield Label("Enter: save   Escape: cancel", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or self.default)


class ExportScreen(ModalScreen[None]):
    """The plan as a Python snippet and as a manifest, read-only and copy-ready."""

    BINDINGS = [
        Binding("escape,q", "dismiss(None)", "Close"),
        Binding("c", "copy", "Copy"),
    ]

    def __init__(self, *, python: str, manifest: str) -> None:
        super().__init__()
        self.texts = {"python": python, "manifest": manifest}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="export-dialog"):
            with TabbedContent(id="export-tabs"):
                with TabPane("Python", id="python"):
                    yield TextArea(self.texts["python"], read_only=True, id="python-text")
                with TabPane("Manifest YAML", id="manifest"):
                    yield TextArea(self.texts["manifest"], read_only=True, id="manifest-text")
            yield Label("c: copy to the clipboard   Escape: close", classes="dialog-hint")

    def action_copy(self) -> None:
        shown = self.query_one("#export-tabs", TabbedContent).active or "python"
        self.app.copy_to_clipboard(self.texts[shown])
        self.notify(f"copied the {'Python snippet' if shown == 'python' else 'manifest'}")


class HelpScreen(ModalScreen[None]):
    """Key bindings and how the knobs work."""

    BINDINGS = [Binding("escape,q,f1,question_mark", "dismiss(None)", "Close")]

    def __init__(self, bindings: Iterable[tuple[str, str]]) -> None:
        super().__init__()
        self.bindings = list(bindings)

    def compose(self) -> ComposeResult:
        keys = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
        keys.add_column(style="bold cyan", no_wrap=True)
        keys.add_column()
        for key, what in self.bindings:
            keys.add_row(key, what)
        with VerticalScroll(classes="dialog", id="help-dialog"):
            yield Label("agilerl-plan explorer: keys", classes="dialog-title")
            yield Static(keys)
            yield Static(Text.from_markup(HELP_TEXT))
            yield Label("Escape: close", classes="dialog-hint")
