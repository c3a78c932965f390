"""Finding the live processes a test launched, by a variable in their environment (inherited by every
descendant, so launchers, ranks and their children all carry it)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["with_env", "free_port", "interruptible"]


def with_env(name: str, value: str) -> list[int]:
    """Pids of live processes (not this one) whose environment has ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or a zombie
                pass
    return found


def free_port() -> int:
    """A TCP port on this host nobody listens on now (a rendezvous, a database server)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def interruptible(cmd: list[str], env: dict[str, str]):
    """``cmd`` started with its stderr piped (text) and SIGINT's default disposition, as from a
    terminal: a shell that runs the suite in the background ignores SIGINT, and Python keeps an
    ignored SIGINT ignored, so a Ctrl-C test would otherwise send a signal nobody hears."""
    import signal
    import subprocess

    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
