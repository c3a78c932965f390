"""``python -m tui [MODEL] [--gpus N] ...``: the explorer (same as ``agilerl-plan-tui``)."""

from .app import main

raise SystemExit(main())
