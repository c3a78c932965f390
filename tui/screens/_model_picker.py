"""Pick a model: search the built-in catalog, or type a directory, a config.json or a tiny: name."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList

from agilerl.utils.sources import existing_path
from planner import catalog

__all__ = ["ModelPicker", "matching_models"]


def matching_models(query: str) -> tuple[list[str], bool]:
    """Catalog names holding every word of ``query`` (any case), True; else close names, False."""
    words = query.lower().split()
    found = [n for n in catalog.names() if all(w in n.lower() for w in words)]
    if found or not words:
        return found, True
    return catalog.suggest(query), False


def _is_typed_source(text: str) -> bool:
    """A tiny: name or an existing path is used as typed, not as a search."""
    return text.startswith("tiny:") or (bool(text) and existing_path(text) is not None)


class ModelPicker(ModalScreen[str | None]):
    """Enter takes the highlighted catalog model, or the typed text when no catalog name holds it
    (a path, a tiny: name, a hub id in the local cache), unless Up/Down picked a suggestion."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Cancel"),
        Binding("down", "move(1)", "Next", show=False),
        Binding("up", "move(-1)", "Previous", show=False),
    ]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current
        self._matched = True  # the list holds catalog names containing the query
        self._moved = False  # the user moved the highlight since the last keystroke

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="picker-dialog"):
            yield Label(
                "Model: search the catalog, or type a directory, config.json or tiny:<arch>?...",
                classes="dialog-title",
            )
            yield Input(placeholder="search", id="picker-query")
            yield OptionList(*catalog.names(), id="picker-list")
            yield Label("Enter: choose   Up/Down: move   Escape: cancel", classes="dialog-hint")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        names = catalog.names()
        if self.current in names:
            options.highlighted = names.index(self.current)

    def on_input_changed(self, event: Input.Changed) -> None:
        options = self.query_one(OptionList)
        found, self._matched = matching_models(event.value)
        self._moved = False
        options.clear_options()
        options.add_options(found)
        if options.option_count:
            options.highlighted = 0

    def action_move(self, step: int) -> None:
        options = self.query_one(OptionList)
        if options.option_count:
            current = options.highlighted if options.highlighted is not None else -step
            options.highlighted = (current + step) % options.option_count
            self._moved = True

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        options = self.query_one(OptionList)
        if not text and not self._moved:
            self.dismiss(None)  # nothing typed or picked: the model stays
            return
        typed = _is_typed_source(text) or (text and not self._matched)
        if options.highlighted is None or (typed and not self._moved):
            self.dismiss(text or None)
        else:
            self.dismiss(str(options.get_option_at_index(options.highlighted).prompt))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(str(event.option.prompt))
