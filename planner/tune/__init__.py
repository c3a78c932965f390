"""``agilerl-plan MODEL --gpus N --tune``: refine the planner's choice with short real runs (Optuna).

Each trial is a probe (``planner.probe``: the real trainer under torchrun, in subprocesses)
of one candidate from the space ``plan()`` chooses in (``_space``). The objective is measured
tokens per second, maximised, subject to the measured peak staying within the budget less a
safety margin (``_objective``); candidates the estimate rejects are recorded as constraint
violations without a launch. The planner's own pick is the first trial; optionally
(``--confirm``) the last ones measure the fastest candidates again, and the pick is the
fitting candidate with the best median (``_run``). Studies live in a SQLite file by default
and resume where they stopped (``_storage``, ``_study``). After the trials the estimate is
calibrated on them (``_calibrate``) and the best measured config is emitted like a plan
(``_main``, ``_report``). The command line's ``--tune`` flags are ``_args``.

Names load on first use: building the command line's parser (``add_tune_arguments``) imports
nothing else of the tuner, and Optuna is imported only when a study runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agilerl.utils.lazy import lazy_names

_LAZY = {
    "add_tune_arguments": "_args",
    "TUNE_GROUP_TITLE": "_args",
    "check_tune_arguments": "_args",
    "tune_main": "_main",
    "tune": "_run",
    "TuneResult": "_run",
    "probe_model": "_run",
    "tuned_plan": "_run",
    "Objective": "_objective",
    "Candidate": "_space",
    "Space": "_space",
    "search_space": "_space",
    "suggest_candidate": "_space",
    "grid": "_space",
    "open_storage": "_storage",
    "DEFAULT_STORAGE": "_storage",
    "storage_url": "_storage",
    "CalibrationReport": "_calibrate",
}

__all__ = [
    "add_tune_arguments",
    "TUNE_GROUP_TITLE",
    "check_tune_arguments",
    "tune_main",
    "tune",
    "TuneResult",
    "probe_model",
    "tuned_plan",
    "Objective",
    "Candidate",
    "Space",
    "search_space",
    "suggest_candidate",
    "grid",
    "open_storage",
    "DEFAULT_STORAGE",
    "storage_url",
    "CalibrationReport",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)


if TYPE_CHECKING:  # pragma: no cover
    from ._args import TUNE_GROUP_TITLE, add_tune_arguments, check_tune_arguments  # noqa: F401
    from ._calibrate import CalibrationReport  # noqa: F401
    from ._main import tune_main  # noqa: F401
    from ._objective import Objective  # noqa: F401
    from ._run import TuneResult, probe_model, tune, tuned_plan  # noqa: F401
    from ._space import Candidate, Space, grid, search_space, suggest_candidate  # noqa: F401
    from ._storage import DEFAULT_STORAGE, open_storage, storage_url  # noqa: F401
