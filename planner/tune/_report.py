"""What the tuner prints: one progress line per trial, the table of trials, their JSON."""

from __future__ import annotations

from typing import Any

from ..hardware import fmt_bytes

__all__ = ["progress_line", "trials_table", "trial_json", "KNOB_LABELS"]

#: Short column labels for the tuned knobs.
KNOB_LABELS = {
    "sharding": "shard",
    "optim_cpu_offload": "optoff",
    "shard_group_size": "group",
    "reshard_after_forward": "reshard",
    "wrap_every_n_blocks": "wrap",
    "prefetch_units": "pf",
    "backward_prefetch_units": "bpf",
    "micro_batch_size_per_gpu": "micro",
    "gradient_checkpointing": "ckpt",
    "logprob_chunk_size": "chunk",
}


def _state(t: Any) -> str:
    return getattr(t.state, "name", str(t.state))


def _knobs(t: Any, varying: list[str] | None = None) -> str:
    knobs = t.user_attrs.get("knobs") or {}
    names = varying if varying is not None else list(knobs)
    return " ".join(f"{KNOB_LABELS.get(k, k)}={_short(knobs[k])}" for k in names if k in knobs)


def _short(v: Any) -> str:
    return {True: "T", False: "F", None: "-"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)


def progress_line(t: Any, *, launched: int, max_launches: int, best: tuple[Any, float, int] | None) -> str:
    """``trial k/K #n: status, peak, step time, tokens/s; best so far``.

    ``best``: the best candidate's first trial, its median tokens/s and its number of runs.
    """
    a = t.user_attrs
    status = a.get("status", _state(t).lower())
    head = f"trial {launched}/{max_launches} #{t.number}" if a.get("launched") else f"#{t.number} (not launched)"
    if "confirm_of" in a:
        head += f" (second run of #{a['confirm_of']})"
    parts = [f"{head} [{_knobs(t)}]: {status}"]
    if status == "repeat":
        parts[-1] += f" of #{a.get('repeat_of')} ({a.get('repeat_status')})"
    if a.get("peak_bytes") is not None:
        parts.append(f"peak {fmt_bytes(a['peak_bytes'])} ({a.get('peak_phase')})")
    if a.get("step_seconds_median") is not None:
        parts.append(f"step {a['step_seconds_median']:.3f} s")
        parts.append(f"{a.get('tokens_per_second', 0):,.0f} tokens/s")
    if status not in ("fits", "repeat") and a.get("why"):
        parts.append(a["why"])
    line = ", ".join(parts)
    if best is not None:
        trial, tokens, runs = best
        line += f"; best so far {tokens:,.0f} tokens/s (#{trial.number}" + (f", {runs} runs)" if runs > 1 else ")")
    else:
        line += "; nothing measured to fit yet"
    return line


def trials_table(trials: list[Any], *, best_numbers: tuple[int, ...] = ()) -> str:
    """One row per trial: the knobs that vary, state, estimated and measured peak, tokens/s, why infeasible."""
    all_knobs: dict[str, set[str]] = {}
    with_knobs = [t.user_attrs["knobs"] for t in trials if t.user_attrs.get("knobs")]
    for knobs in with_knobs:
        for k, v in knobs.items():
            all_knobs.setdefault(k, set()).add(repr(v))
    # A knob is "the same in every trial" only where every trial has it (FSDP knobs are absent unsharded).
    same = {k: next(iter(v)) for k, v in all_knobs.items() if len(v) == 1 and all(k in knobs for knobs in with_knobs)}
    varying = [k for k in all_knobs if k not in same]
    fixed = same
    rows = [("#", "params", "state", "est. peak", "peak", "step s", "tokens/s", "why infeasible")]
    for t in sorted(trials, key=lambda t: t.number):
        a = t.user_attrs
        status = a.get("status", _state(t).lower())
        if status == "repeat":
            status = f"repeat #{a.get('repeat_of')}"
        elif "confirm_of" in a:
            status = f"{status} (2nd of #{a['confirm_of']})"
        mark = "*" if t.number in best_numbers else ""
        step = a.get("step_seconds_median")
        tokens = a.get("tokens_per_second")
        rows.append(
            (
                f"{t.number}{mark}",
                _knobs(t, varying),
                status,
                fmt_bytes(a.get("estimated_peak_bytes")),
                fmt_bytes(a.get("peak_bytes")),
                f"{step:.3f}" if step is not None else "-",
                f"{tokens:,.0f}" if tokens else "-",
                "" if a.get("status") in ("fits", "repeat") else (a.get("why") or "")[:90],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    if fixed:
        lines.append("same in every trial: " + ", ".join(f"{k}={v}" for k, v in fixed.items()))
    if best_numbers:
        lines.append("* best: trial " + ", ".join(f"#{n}" for n in best_numbers))
    return "\n".join(line.rstrip() for line in lines)


def trial_json(t: Any) -> dict[str, Any]:
    a = dict(t.user_attrs)
    a.pop("key", None)
    return {"number": t.number, "state": _state(t), "value": t.value, "params": t.params, **a}
