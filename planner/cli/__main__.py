"""``python -m planner.cli``: the same as ``agilerl-plan``."""

from . import main

raise SystemExit(main())
