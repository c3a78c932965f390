"""Probes: a short real run of the trainer, measured (the planner's ground truth, the tuner's trial).

``run_probe`` launches ``torchrun`` on the worker (``planner.probe._worker``), which builds the
real trainer and runs real steps on synthetic batches of exactly the requested shapes; the
parent imports no torch. ``planner.probe.tracking`` holds the torch-side trackers the worker
records each phase with, and ``planner.probe.gloo`` the settled collectives that make gloo free
what FSDP2 drops when it drops it (importing either imports torch).
"""

from ._launch import COMPONENTS, PHASES, Device, Measurement, ProbeRequest, RankMeasurement, default_device, run_probe
from ._model import probe_model, random_weights

__all__ = [
    "ProbeRequest",
    "Measurement",
    "RankMeasurement",
    "run_probe",
    "Device",
    "default_device",
    "PHASES",
    "COMPONENTS",
    "probe_model",
    "random_weights",
]
