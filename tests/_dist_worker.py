"""Rank-side runner for tests._dist: ``python -m tests._dist_worker MODULE CASES OUT_DIR``."""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from pathlib import Path


def main() -> None:
    module_name, case_names, out_dir = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])
    import torch

    from agilerl.distributed import get_rank, get_world_size, init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_seconds=60)
    rank, world = get_rank(), get_world_size()
    module = importlib.import_module(module_name)
    cases = module.cases
    from tests._dist import CaseContext

    shared = out_dir / "shared"
    shared.mkdir(exist_ok=True)
    ctx = CaseContext(rank=rank, world_size=world, shared_dir=shared)
    results = out_dir / f"rank{rank}.jsonl"
    for name in case_names:
        start = time.monotonic()
        try:
            torch.manual_seed(0)
            cases.cases[name](ctx)
            ok, detail = True, ""
        except Exception:  # a failing case must not stop the others
            ok, detail = False, traceback.format_exc(limit=12)
        with results.open("a") as f:
            f.write(json.dumps({"case": name, "ok": ok, "detail": detail, "seconds": time.monotonic() - start}) + "\n")
        # Keep ranks in step so a case that failed on one rank cannot leave the
        # others blocked inside the next case's collectives.
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
