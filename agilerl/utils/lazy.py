"""Packages whose public names load from their modules on first use (PEP 562).

``agilerl.distributed``, ``planner`` and ``planner.tune`` keep ``import package`` cheap this
way: ``from agilerl.distributed import FSDPConfig`` imports no torch, and building the
planner's command line imports nothing of the tuner.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, modules: dict[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name in ``modules`` is loaded from
    ``package.<module>`` when first asked for and then kept in the package's namespace;
    ``__dir__`` lists ``public``. Use as ``__getattr__, __dir__ = lazy_names(__name__, ...)``."""
    names = sorted(public)

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__
