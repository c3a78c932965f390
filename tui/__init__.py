"""The interactive explorer (Textual) of the memory planner: ``tui.app.main`` / ``tui.app.run``."""

from .app import DEFAULT_MODEL, ExplorerApp, main, run

__all__ = ["DEFAULT_MODEL", "ExplorerApp", "main", "run"]
