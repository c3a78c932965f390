"""The shared-prefix forward: the planner's estimate against probes whose groups share their prompt.

    python -m benchmarks.prefix_memory [--device cpu] [--rerun]

In a real GRPO batch the rows of a group share their prompt, and the trainer runs it once
per group (agilerl.utils.shared_prefix): a prefix pass over the distinct prompts, then every
row's completion over its prompt's recorded keys and values. The probe's grouped mode gives
the rows of a group one prompt, as a rollout does. Each grouped row has a twin whose rows
share nothing (the one-pass forward), so the table shows what sharing saves, measured and
estimated; nothing is fitted. Long prompts and short completions (a group of 4 in one
micro-batch) show it best: most of a row is prompt.

Measurements are cached in ``benchmarks/results/prefix_<device>.json``.
"""

from __future__ import annotations

from benchmarks._probe_cache import peak_benchmark_main, peak_request
from benchmarks.padded_memory import MODELS, PHASES  # (the same model and phases, each twin beside)
from planner.probe import ProbeRequest

CONFIGS = [
    dict(model="q128-L4", world=world, gc=gc, micro=4, prompt=384, completion=128, padded=padded, shared=shared)
    for world in (1, 2)
    for gc in (False, True)
    for padded in (False, True)
    for shared in (False, True)
    if not (world == 1 and padded)
]


def request_for(c: dict, device: str) -> ProbeRequest:
    request = peak_request(c, device, MODELS[c["model"]], attn_implementation="sdpa")
    if c["world"] == 1:  # one device: no FSDP
        request = request.model_copy(update={"fsdp": None})
    return request


def main() -> None:
    peak_benchmark_main(__doc__, "prefix", "Shared prompt prefix", CONFIGS, request_for, PHASES)


if __name__ == "__main__":
    main()
