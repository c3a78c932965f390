"""Calibrate the estimate from the tuner's measured trials, judged on trials the fit did not see.

Every third launched trial that measured (in trial order) is held out when
there are at least four; the kernel-dependent coefficients
(planner.calibration.FITTED) are fitted on the rest, starting from the ones in
use, and both sets are scored on the held-out trials by the mean absolute
relative error of the estimated peak. With fewer trials nothing can be held
out: the errors are in-sample, the report says so, and the fit is not saved
(an unjudged fit of ten coefficients on two or three runs would steer every
later plan). A judged fit is saved (and used by later plans through
``coefficients_for``) only when it is no worse on the held-out trials than
the coefficients in use.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from agilerl.distributed import FSDPConfig

from ..calibration import Sample, fit_coefficients, save_calibration
from ..hardware import Cluster
from ..memory import Coefficients
from ..spec import ModelSpec
from ..workload import Workload

__all__ = ["CalibrationReport", "calibrate", "MIN_FOR_HOLDOUT"]

MIN_FOR_HOLDOUT = 4


class CalibrationReport(BaseModel):
    num_samples: int
    num_fit: int
    num_held_out: int
    in_sample: bool
    error_before: float | None = None  # mean |estimated - measured| / measured peak, on the judged trials
    error_after: float | None = None
    max_error_before: float | None = None
    max_error_after: float | None = None
    saved_path: str | None = None
    note: str

    def line(self) -> str:
        if self.error_before is None:
            return f"calibration: {self.note}"
        where = "in-sample" if self.in_sample else f"on {self.num_held_out} held-out trial(s)"
        return (
            f"calibration: peak error {where}: before {self.error_before:.1%} (max {self.max_error_before:.1%}), "
            f"after {self.error_after:.1%} (max {self.max_error_after:.1%}); fitted on {self.num_fit}. "
            f"{self.note}"
        )


def _samples(trials: list[Any], spec: ModelSpec, cluster: Cluster) -> list[Sample]:
    # The probe's per-phase "total" counts tensors only: a Sample compares it with the estimate on
    # the trials' own device less what no tracker sees (context, allocator slack, NCCL), which
    # these samples cannot fit. (Estimating as on a CPU device instead counted an offloaded
    # optimizer's host state as device memory: +75% on such trials.)
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        measured = {ph: v for ph, v in (t.user_attrs.get("measured_phases") or {}).items() if v > 0}
        if not measured or t.user_attrs.get("status") not in ("fits", "over_budget"):
            continue
        key = json.loads(t.user_attrs["key"])
        fsdp = FSDPConfig.model_validate(key["fsdp"]) if key["fsdp"] is not None else None
        out.append(Sample(spec, Workload.model_validate(key["workload"]), cluster, fsdp, measured))
    return out


def _errors(samples: list[Sample], coefficients: Coefficients) -> tuple[float, float]:
    errs = [abs(s.peak_error(coefficients)) for s in samples]
    return sum(errs) / len(errs), max(errs)


def calibrate(
    trials: list[Any], *, spec: ModelSpec, cluster: Cluster, coefficients: Coefficients | None, save: bool = True
) -> CalibrationReport:
    """Fit, judge and (when no worse) save the coefficients for ``cluster.gpu`` from launched trials."""
    current = coefficients or Coefficients()
    samples = _samples(trials, spec, cluster)
    n = len(samples)
    if n == 0:
        return CalibrationReport(
            num_samples=0, num_fit=0, num_held_out=0, in_sample=True, note="no measured trials to calibrate from"
        )
    if n >= MIN_FOR_HOLDOUT:
        held = [s for i, s in enumerate(samples) if i % 3 == 2]
        fit_on = [s for i, s in enumerate(samples) if i % 3 != 2]
        judged, in_sample, note = held, False, ""
    else:
        fit_on, judged, in_sample = samples, samples, True
        note = (
            f"only {n} measured trial(s), fewer than {MIN_FOR_HOLDOUT}: none held out, so these errors "
            "flatter the fit; "
        )
    fitted = fit_coefficients(fit_on, start=current)
    before, max_before = _errors(judged, current)
    after, max_after = _errors(judged, fitted)
    saved = None
    if in_sample:
        note += "not saved."
    elif after <= before and save:
        saved = str(save_calibration(cluster.gpu, fitted))
        note += f"saved to {saved}; later plans for {cluster.gpu.name} use it."
    elif after <= before:
        note += "not saved (calibration off)."
    else:
        note += "not saved: the fit is worse than the coefficients in use on the judged trials."
    return CalibrationReport(
        num_samples=n,
        num_fit=len(fit_on),
        num_held_out=0 if in_sample else len(judged),
        in_sample=in_sample,
        error_before=before,
        error_after=after,
        max_error_before=max_before,
        max_error_after=max_after,
        saved_path=saved,
        note=note.strip(),
    )
