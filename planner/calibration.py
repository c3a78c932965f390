"""Coefficients of the estimate per device kind: shipped defaults, then the user's calibration.

Shipped: ``planner/coefficients_<kind>.json`` fitted by benchmarks/accuracy.py
(CPU probes; also the GPU default until GPU probes exist). A calibration the
tuner fits from trials on a GPU kind is stored in the user's cache directory
(``$AGILERL_CACHE/calibration/<gpu>.json``) and wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from .hardware import GPU
from .memory import Coefficients

__all__ = ["coefficients_for", "calibration_path", "save_calibration"]

_SHIPPED = Path(__file__).resolve().parent


def calibration_path(gpu: GPU) -> Path:
    root = os.environ.get("AGILERL_CACHE") or os.path.join(Path.home(), ".cache", "agilerl")
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in gpu.name)
    return Path(root) / "calibration" / f"{safe}.json"


def coefficients_for(gpu: GPU) -> Coefficients:
    user = calibration_path(gpu)
    if user.exists():
        return Coefficients.model_validate_json(user.read_text())
    shipped = _SHIPPED / "coefficients_cpu.json"
    if shipped.exists():
        return Coefficients.model_validate_json(shipped.read_text())
    return Coefficients()


def save_calibration(gpu: GPU, coefficients: Coefficients) -> Path:
    path = calibration_path(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(coefficients.model_dump_json(indent=1))
    return path
