"""Coefficients of the estimate per device kind: shipped defaults, then the user's calibration.

Shipped: ``planner/coefficients_cpu.json`` for CPU probes and
``planner/coefficients_cuda.json`` for every GPU (its GPU-only terms fitted by
benchmarks/gpu_public.py on half of the public A100 peaks). A calibration the
tuner fits from trials on a GPU kind is stored in the user's cache directory
(``$AGILERL_CACHE/calibration/<gpu>.json``) and wins; plan output names which
coefficients it used (:func:`coefficients_source`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .hardware import GPU
from .memory import Coefficients

__all__ = [
    "coefficients_for",
    "coefficients_source",
    "calibration_path",
    "save_calibration",
    "Sample",
    "fit_coefficients",
    "phase_errors",
    "FITTED",
]

_SHIPPED = Path(__file__).resolve().parent


def calibration_path(gpu: GPU) -> Path:
    root = os.environ.get("AGILERL_CACHE") or os.path.join(Path.home(), ".cache", "agilerl")
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in gpu.name)
    return Path(root) / "calibration" / f"{safe}.json"


def _shipped_path(gpu: GPU) -> Path:
    """The shipped coefficients for a device kind: the CPU probes', or the GPUs' (CUDA and
    ROCm alike: the GPU-only terms, fitted on public A100 peaks)."""
    return _SHIPPED / ("coefficients_cpu.json" if gpu.kind == "cpu" else "coefficients_cuda.json")


def coefficients_for(gpu: GPU) -> Coefficients:
    """The user's calibration for this GPU when there is one, else the shipped coefficients
    of its device kind."""
    user = calibration_path(gpu)
    if user.exists():
        try:
            return Coefficients.from_json(user.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:  # pydantic's and json's errors are ValueErrors
            from pydantic import ValidationError

            if isinstance(err, ValidationError):
                first = err.errors()[0]
                where = ".".join(map(str, first["loc"]))
                reason = (f"{where}: " if where else "") + str(first["msg"]).removeprefix("Value error, ")
            else:
                reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise ValueError(
                f"your calibration {user} cannot be read ({reason}); "
                "delete it to plan with the shipped coefficients (a later --tune fits a new one)"
            ) from None
    shipped = _shipped_path(gpu)
    if shipped.exists():
        return Coefficients.from_json(shipped.read_text())
    return Coefficients()


def coefficients_source(gpu: GPU) -> str:
    """Which coefficients :func:`coefficients_for` returns, in words, for plan output."""
    user = calibration_path(gpu)
    if user.exists():
        return f"your calibration for {gpu.name} ({user})"
    return "shipped CPU" if gpu.kind == "cpu" else "shipped CUDA"


def save_calibration(gpu: GPU, coefficients: Coefficients) -> Path:
    """Write the user's calibration for ``gpu`` through a temporary file and a rename: a tuner
    stopped mid-write leaves the old calibration or the new one, never half of one."""
    path = calibration_path(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(coefficients.model_dump_json(indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# -- fitting -------------------------------------------------------------------------------------
#: Coefficients fitted from measured trials: what tensor-level probes can see but the code does not
#: own, FSDP's buffers beside the gathered window. Activations, logits and weights are counted,
#: not fitted; the GPU-only terms are fitted on GPU peaks (benchmarks/gpu_public.py).
FITTED = ("all_gather_overlap",)


class Sample:
    """One measured run: what was estimated from (on the device it ran on), and the measured
    per-phase device tensors (a tracker's totals, or CUDA's ``max_memory_allocated``)."""

    def __init__(self, spec, workload, cluster, fsdp, measured: dict[str, int]) -> None:
        self.spec, self.workload, self.cluster, self.fsdp, self.measured = spec, workload, cluster, fsdp, measured

    def estimated(self, coefficients: Coefficients) -> dict[str, int]:
        """The estimate of each measured phase's tensors: its total less what no tracker and no
        ``max_memory_allocated`` sees (:data:`planner.names.NOT_TENSORS`; none on a CPU device)."""
        from .memory import estimate
        from .names import NOT_TENSORS

        est = estimate(self.spec, self.workload, self.cluster, self.fsdp, coefficients=coefficients)
        return {
            ph: est.phases[ph].total - sum(est.phases[ph].components.get(k, 0) for k in NOT_TENSORS)
            for ph in self.measured
            if ph in est.phases
        }

    def peak_error(self, coefficients: Coefficients) -> float:
        """Relative error of the estimated peak over the measured phases."""
        est = self.estimated(coefficients)
        measured = max(self.measured[ph] for ph in est)
        return (max(est.values()) - measured) / measured


def phase_errors(samples: list[Sample], coefficients: Coefficients) -> list[float]:
    out = []
    for s in samples:
        for ph, value in s.estimated(coefficients).items():
            out.append((value - s.measured[ph]) / s.measured[ph])
    return out


def fit_coefficients(
    samples: list[Sample],
    *,
    start: Coefficients | None = None,
    names: tuple[str, ...] = FITTED,
    iterations: int = 40,
    bounds: tuple[float, float] = (0.0, 32.0),
) -> Coefficients:
    """Least squares on relative per-phase errors (Levenberg-Marquardt, bounded coefficients).

    Only the kernel-dependent coefficients in ``names`` move; the exact terms of
    the estimate (parameters, adapters, optimizer state) are not fitted. A step is
    kept only if it lowers the squared error (the estimate takes maxima of
    sub-peaks, so the problem is not smooth); bounds keep each coefficient to a
    physically plausible multiple of its width.
    """
    import numpy as np

    base = (start or Coefficients()).model_dump()
    lo, hi = bounds
    x = np.clip(np.array([base[n] for n in names], dtype=float), lo, hi)

    def residuals(vec) -> np.ndarray:
        # The peak is what plans are judged by; the phases keep the components honest.
        coefficients = Coefficients(**{**base, **dict(zip(names, vec.tolist()))})
        peaks = [s.peak_error(coefficients) for s in samples]
        return np.array(peaks + [0.5 * e for e in phase_errors(samples, coefficients)])

    r = residuals(x)
    cost = float(r @ r)
    damping = 1e-2
    for _ in range(iterations):
        jac = np.zeros((len(r), len(x)))
        for j in range(len(x)):
            step = max(1e-3, 1e-2 * abs(x[j]))
            xp = x.copy()
            xp[j] += step
            jac[:, j] = (residuals(xp) - r) / step
        jtj = jac.T @ jac
        grad = jac.T @ r
        improved = False
        for _ in range(8):
            delta = np.linalg.solve(jtj + damping * (np.diag(np.diag(jtj)) + 1e-9 * np.eye(len(x))), -grad)
            candidate = np.clip(x + delta, lo, hi)
            r_new = residuals(candidate)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                x, r, cost = candidate, r_new, cost_new
                damping = max(1e-6, damping / 3)
                improved = True
                break
            damping *= 5
        if not improved:
            break
    return Coefficients(**{**base, **dict(zip(names, [round(float(v), 4) for v in x]))})
