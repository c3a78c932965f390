"""The explorer's screens: the main explorer and its dialogs."""

from ._dialogs import ExportScreen, HelpScreen, SavePrompt
from ._explorer import ExplorerScreen
from ._model_picker import ModelPicker, matching_models

__all__ = [
    "ExplorerScreen",
    "ExportScreen",
    "HelpScreen",
    "ModelPicker",
    "SavePrompt",
    "matching_models",
]
