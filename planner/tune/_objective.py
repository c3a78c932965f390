"""The tuner's objective: measured tokens per second, constrained by measured peak memory.

``objective(trial)`` builds a candidate with ``trial.suggest_*`` (planner.tune._space),
estimates it, and launches a probe only when the estimate says it can fit the
device at all and, where the host memory is given, that the busiest node's host holds it (no
trial measures a node's host). Every outcome is a finished trial:

==============  =====================  ===========================================
status          value                  constraint (> 0: infeasible)
==============  =====================  ===========================================
fits            measured tokens/s      (peak - limit) / budget, <= 0
over_budget     measured tokens/s      (peak - limit) / budget, > 0
rejected        0, never launched      (estimated peak - limit) / budget, > 0; or the
                                       host's: (node host - its limit) / host memory
oom, crashed    0                      1 (as bad as twice the budget)
repeat          the earlier result     the earlier result
==============  =====================  ===========================================

``limit`` is the budget less the safety margin. The estimate gate uses the whole
budget, not the limit: a candidate the estimate puts inside the margin is worth
measuring (the margin covers the estimate's error, which the probe does not have).
A repeat (a candidate measured before in this study, which samplers over small
discrete spaces propose again) returns the earlier result instead of a second
launch, as Optuna's FAQ suggests for duplicated parameters; only a queued
confirmation (user attribute ``confirm_of``) measures a candidate again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..choose import host_judge
from ..hardware import Cluster, fmt_bytes
from ..memory import Coefficients, estimate
from ..probe import Measurement, ProbeRequest
from ..spec import ModelSpec
from ._space import Candidate, Space, suggest_candidate

__all__ = ["Objective", "CONSTRAINT_KEY", "INFEASIBLE_FAILURE", "STATUSES"]

#: Name of the memory constraint (``trial.set_constraint``) and of the user attribute mirroring it.
CONSTRAINT_KEY = "constraint"
#: The constraint of a run that measured nothing (out of memory, crashed, timed out).
INFEASIBLE_FAILURE = 1.0
STATUSES = ("fits", "over_budget", "rejected", "oom", "crashed", "repeat", "interrupted")


def set_constraint(trial: Any, value: float) -> None:
    """Record the memory constraint where the sampler reads it (and as a user attribute for tables).

    Optuna >= 5 reads ``trial.set_constraint``; older releases read the user
    attribute through ``TPESampler(constraints_func=...)`` (see planner.tune._study).
    """
    trial.set_user_attr(CONSTRAINT_KEY, float(value))
    if hasattr(trial, "set_constraint"):
        trial.set_constraint("memory", float(value))


class Objective:
    """``objective(trial) -> tokens/s``: suggest a candidate, gate it by the estimate, probe it.

    ``probe`` runs one :class:`ProbeRequest` (``planner.probe.run_probe`` or a fake);
    ``request`` is the template every launch copies (model, ranks, device, budget,
    timeouts); ``previous(key)`` returns an earlier finished trial's user
    attributes for a candidate key, or None. ``claim(trial, key)``, with workers
    sharing the study, returns once no other running trial is measuring ``key``
    (so ``previous`` then has its result) and says whether a launch slot is left.
    """

    def __init__(
        self,
        *,
        space: Space,
        spec: ModelSpec,
        cluster: Cluster,
        coefficients: Coefficients | None,
        margin_fraction: float,
        request: ProbeRequest,
        probe: Callable[[ProbeRequest], Measurement],
        previous: Callable[[str], dict[str, Any] | None] | None = None,
        claim: Callable[[Any, str], bool] | None = None,
    ) -> None:
        if not 0 <= margin_fraction < 1:
            raise ValueError(f"margin_fraction must be in [0, 1), got {margin_fraction}")
        self.space, self.spec, self.cluster, self.coefficients = space, spec, cluster, coefficients
        self.request, self.probe, self.previous, self.claim = request, probe, previous, claim
        self.budget_bytes = cluster.gpu.memory_bytes
        self.limit_bytes = int(self.budget_bytes * (1 - margin_fraction))
        # a node's host, judged as plan() judges it (None: the host memory is not given)
        self.host = host_judge(
            spec, request.workload, cluster, coefficients=coefficients, margin_fraction=margin_fraction
        )

    def __call__(self, trial: Any) -> float:
        confirming = "confirm_of" in trial.user_attrs  # a queued second run of a measured candidate
        candidate = suggest_candidate(trial, self.space)
        est = estimate(self.spec, candidate.workload, self.cluster, candidate.fsdp, coefficients=self.coefficients)
        for key, value in {
            "key": candidate.key,
            "knobs": candidate.knobs(),
            "estimated_peak_bytes": est.peak_bytes,
            "estimated_peak_phase": est.peak_phase,
            "budget_bytes": self.budget_bytes,
            "limit_bytes": self.limit_bytes,
            "launched": False,
        }.items():
            trial.set_user_attr(key, value)
        earlier = self.previous(candidate.key) if self.previous and not confirming else None
        if earlier is None and self.claim is not None and not confirming:
            # Workers sharing the study: wait out another worker's run of this candidate, then reuse it.
            if not self.claim(trial, candidate.key):
                import optuna

                trial.set_user_attr("status", "not_launched")
                trial.set_user_attr("why", "the study's launch budget was used up by other workers meanwhile")
                raise optuna.TrialPruned()
            earlier = self.previous(candidate.key) if self.previous else None
        if earlier is not None:
            return self._repeat(trial, earlier)
        if (rejected := self.rejection(est)) is not None:
            why, violation = rejected
            trial.set_user_attr("status", "rejected")
            trial.set_user_attr("why", why)
            set_constraint(trial, violation)
            return 0.0
        request = self.request.model_copy(update={"workload": candidate.workload, "fsdp": candidate.fsdp})
        trial.set_user_attr("launched", True)
        return self._record(trial, self.probe(request), est)

    def _repeat(self, trial: Any, earlier: dict[str, Any]) -> float:
        for key in (
            "peak_bytes",
            "peak_phase",
            "step_seconds_median",
            "step_seconds_spread",
            "tokens_per_second",
            "why",
        ):
            if key in earlier:
                trial.set_user_attr(key, earlier[key])
        trial.set_user_attr("status", "repeat")
        trial.set_user_attr("repeat_of", earlier.get("number"))
        trial.set_user_attr("repeat_status", earlier.get("status"))
        set_constraint(trial, earlier.get(CONSTRAINT_KEY, INFEASIBLE_FAILURE))
        return float(earlier.get("value") or 0.0)

    def _record(self, trial: Any, m: Measurement, est: Any) -> float:
        trial.set_user_attr("wall_seconds", round(m.wall_seconds, 2))
        if not m.ok or m.oom:
            status = "oom" if m.oom else "crashed"
            first = (m.failure or "failed").strip().splitlines()[0][:300]
            why = f"out of memory in phase {m.oom_phase}" if m.oom else first
            trial.set_user_attr("status", status)
            trial.set_user_attr("why", why)
            set_constraint(trial, INFEASIBLE_FAILURE)
            return 0.0
        phases = sorted({ph for r in m.ranks for ph in r.phases})
        tokens = m.tokens_per_second or 0.0
        for key, value in {
            "peak_bytes": m.peak_bytes,
            "peak_phase": m.peak_phase,
            "step_seconds_median": m.step_seconds_median,
            "step_seconds_spread": m.step_seconds_spread,
            "tokens_per_second": tokens,
            "step_seconds": m.step_seconds,
            "measured_phases": {ph: m.phase_total(ph) for ph in phases},
        }.items():
            trial.set_user_attr(key, value)
        violation = (m.peak_bytes - self.limit_bytes) / self.budget_bytes
        # A checkpoint save is part of every run but no trial writes one: its estimate stands in.
        saving = est.phases["save"].total if "save" in est.phases and "save" not in phases else 0
        if violation <= 0 and saving > self.limit_bytes:
            violation = (saving - self.limit_bytes) / self.budget_bytes
            trial.set_user_attr("status", "over_budget")
            trial.set_user_attr(
                "why",
                f"estimated save phase {fmt_bytes(saving)} (trials write no checkpoint) over the "
                f"{fmt_bytes(self.limit_bytes)} limit (budget less the margin)",
            )
        elif violation > 0:
            trial.set_user_attr("status", "over_budget")
            trial.set_user_attr(
                "why",
                f"measured peak {fmt_bytes(m.peak_bytes)} in {m.peak_phase} over the "
                f"{fmt_bytes(self.limit_bytes)} limit (budget less the margin)",
            )
        else:
            trial.set_user_attr("status", "fits")
        set_constraint(trial, violation)
        return float(tokens)

    def admits(self, candidate: Candidate) -> bool:
        """Whether the estimate lets ``candidate`` be launched (:meth:`rejection`)."""
        est = estimate(self.spec, candidate.workload, self.cluster, candidate.fsdp, coefficients=self.coefficients)
        return self.rejection(est) is None

    def rejection(self, est: Any) -> tuple[str, float] | None:
        """Why the estimate ``est`` keeps a candidate from launch, and its constraint, or None: its
        GPU peak over the budget, or (where the host memory is given) its busiest node's host over
        the host's limit, which no trial measures."""
        if est.peak_bytes > self.budget_bytes:
            why = (
                f"estimated peak {fmt_bytes(est.peak_bytes)} in {est.peak_phase} over the "
                f"{fmt_bytes(self.budget_bytes)} budget: not launched"
            )
            return why, (est.peak_bytes - self.limit_bytes) / self.budget_bytes
        if self.host is not None and (host := self.host(est)).over:
            given = self.cluster.host_memory_per_node_bytes or host.limit_bytes
            return f"estimated {host.words()}: not launched", (host.need_bytes - host.limit_bytes) / given
        return None
