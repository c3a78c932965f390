"""``agilerl-plan``: memory plans, probes and tuning from the command line.

    agilerl-plan MODEL --gpus N [--gpu H100-80GB] [workload flags] [--format table|json|yaml|python]
    agilerl-plan MODEL --gpus N --tune [--trials K] [--storage URL]   (short real trials, Optuna)
    agilerl-plan MODEL --tui                                          (interactive explorer)
    agilerl-plan probe MODEL --gpus N [workload and FSDPConfig flags] [--format json]

The command line decides what its user sees: the library logs, and ``main`` turns bad input
into one line and exit code 2. It is the one part of the planner that may open the Textual
explorer (``--tui``).
"""

from ._main import main

__all__ = ["main"]
