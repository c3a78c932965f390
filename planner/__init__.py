"""agilerl-plan: per-GPU memory of an LLM fine-tuning run, and the FSDPConfig that fits it.

The public API, importable from here::

    from planner import load_model_spec, Workload, Cluster, gpu_by_name, plan, estimate

- the estimate: :func:`estimate` (``planner.memory``) with :class:`Estimate`,
  :class:`PhaseEstimate` and :class:`Coefficients`; the coefficients a GPU gets:
  :func:`coefficients_for` (``planner.calibration``);
- its inputs: :func:`load_model_spec` / :class:`ModelSpec` (a model read on the meta
  device, or the catalog's), :class:`Workload`, :class:`Cluster` / :class:`GPU`;
- the request: :class:`PlanRequest` (cluster, workload, fixed FSDPConfig fields, sharding,
  margin; validated once, :class:`RequestError` naming each bad field) (``planner.request``);
- the choice: :func:`plan_request` (a request, with its GPU's coefficients) or :func:`plan`,
  with :class:`Plan` and :class:`Decision`, :func:`check_inputs`, :func:`suggest_fixes`
  (``planner.choose``);
- its outputs: ``planner.emit`` (table, JSON, manifest, Python snippet).

The measured side, which runs real trainers, lives in ``planner.probe`` (torchrun
probes) and ``planner.tune`` (Optuna studies of probes); the command line in
``planner.cli``. Names load on first use, so ``import planner`` costs nothing and
imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agilerl.utils.lazy import lazy_names

_LAZY = {
    "estimate": "memory",
    "Estimate": "memory",
    "PhaseEstimate": "memory",
    "Coefficients": "memory",
    "coefficients_for": "calibration",
    "load_model_spec": "models",
    "ModelNotFound": "models",
    "ModelSpec": "spec",
    "Workload": "workload",
    "Cluster": "hardware",
    "GPU": "hardware",
    "gpu_by_name": "hardware",
    "plan": "choose",
    "Plan": "choose",
    "Decision": "choose",
    "check_inputs": "choose",
    "suggest_fixes": "choose",
    "plan_request": "choose",
    "PlanRequest": "request",
    "RequestError": "request",
}

__all__ = [
    "estimate",
    "Estimate",
    "PhaseEstimate",
    "Coefficients",
    "coefficients_for",
    "load_model_spec",
    "ModelNotFound",
    "ModelSpec",
    "Workload",
    "Cluster",
    "GPU",
    "gpu_by_name",
    "plan",
    "Plan",
    "Decision",
    "check_inputs",
    "suggest_fixes",
    "plan_request",
    "PlanRequest",
    "RequestError",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)


if TYPE_CHECKING:  # pragma: no cover
    from .calibration import coefficients_for  # noqa: F401
    from .choose import Decision, Plan, check_inputs, plan, plan_request, suggest_fixes  # noqa: F401
    from .hardware import GPU, Cluster, gpu_by_name  # noqa: F401
    from .memory import Coefficients, Estimate, PhaseEstimate, estimate  # noqa: F401
    from .models import ModelNotFound, load_model_spec  # noqa: F401
    from .request import PlanRequest, RequestError  # noqa: F401
    from .spec import ModelSpec  # noqa: F401
    from .workload import Workload  # noqa: F401
