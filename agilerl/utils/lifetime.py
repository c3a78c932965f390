"""Processes that die with their parent, and who owns a running trial.

Linux only where it matters (``prctl``, ``/proc``); elsewhere these are no-ops
and the tuner falls back on heartbeats and on its own clean-up of orphans.

- :func:`die_with_parent`: the kernel sends SIGKILL to this process when its
  parent dies (``PR_SET_PDEATHSIG``). The probe's launcher (torchrun) sets it
  before exec, and each probe rank and each ``agilerl.train`` rank under
  torchrun sets it at start, so ``kill -9`` of a tuner, of ``agilerl-plan
  probe`` or of torchrun takes the whole launch with it (torchrun starts its
  ranks in sessions of their own, so without this they would run on).
- :func:`identity` / :func:`is_gone`: a process named by host, pid, boot id and
  start time, so a rerun knows at once that a RUNNING trial's tuner is dead
  (a recycled pid or a reboot cannot pass for it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

__all__ = ["die_with_parent", "identity", "is_gone"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits; exit now if it already has.

    ``parent_pid``: the parent expected (for a ``preexec_fn``, the launching
    process); by default the current parent.
    """
    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent_pid is None else parent_pid
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: heartbeats and kill_orphans remain
        return
    if os.getppid() != expected:  # the parent died before the request took effect
        os._exit(1)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def identity(pid: int | None = None) -> dict[str, Any]:
    """Who ``pid`` (default: this process) is, in terms that survive pid reuse and reboots."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(), "start": _start_time(pid)}


def is_gone(owner: dict[str, Any] | None) -> bool:
    """Whether the process ``owner`` names (an :func:`identity`) is certainly dead.

    Only a process on this host can be judged; anything else is not gone (its
    heartbeat decides).
    """
    if not owner or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    boot = _boot_id()
    if boot is not None and owner.get("boot_id") not in (None, boot):
        return True  # the host rebooted since
    start = _start_time(owner["pid"])
    return start is None or (owner.get("start") is not None and start != owner["start"])
