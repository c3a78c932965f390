"""Command-line parsing shared by ``agilerl-plan`` and ``python -m agilerl.train``.

Bad input is one line on stderr and exit status 2: ``prog: error: argument
--gpus: must be a positive integer, got '0'``. argparse's default prints the
whole usage first, which for a parser with fifty flags buries the line that
matters.

The library logs (``logging.getLogger("agilerl")`` / ``"planner"`` and their
children) and never prints; :func:`show_logs` is how a command shows those
records to its user.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

__all__ = [
    "ArgumentParser",
    "positive_int",
    "non_negative_int",
    "positive_float",
    "margin_fraction",
    "show_logs",
    "quiet_bitsandbytes",
    "cannot_write_in",
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage stays in ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def port_number(text: str) -> int | None:
    """``text`` as a TCP port a rendezvous can listen on (1-65535), else None."""
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None


def host_port(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` split at its last colon, else None (no host, or no valid port)."""
    host, _, port = text.rpartition(":")
    number = port_number(port)
    return (host, number) if host and number is not None else None


def positive_float(text: str) -> float:
    """A finite number > 0 (``inf`` and ``nan`` are refused: no budget or timeout means either)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def margin_fraction(text: str) -> float:
    """A fraction in [0, 1): the share of memory kept free."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}") from None
    if not (0.0 <= value < 1.0):
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1) of GPU memory, got {text!r}")
    return value


class _CurrentStream(logging.StreamHandler):
    """A handler writing to ``sys.stdout`` or ``sys.stderr`` as it is when a record comes (a redirect
    or a test's capture made after the handler was installed included)."""

    def __init__(self, stream: str) -> None:
        self._which = stream
        super().__init__()

    @property
    def stream(self):  # StreamHandler's attribute, looked up at every record
        return getattr(sys, self._which)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; the current stream wins
        pass


@contextmanager
def show_logs(stream: str, *names: str, level: int = logging.INFO) -> Iterator[None]:
    """Within the block, show the records of the loggers ``names`` (``"agilerl"``, ``"planner"``)
    at ``level`` and above on ``stream`` (``"stdout"`` or ``"stderr"``), the message alone, one line
    each; the loggers' levels and handlers are restored after. A command wraps its work in this:
    the library decides what to say (and, under torchrun, which rank says it), the command where
    its user sees it."""
    handler = _CurrentStream(stream)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > level:
            logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved):
            logger.removeHandler(handler)
            logger.setLevel(old)


def quiet_bitsandbytes() -> None:
    """Keep bitsandbytes' import-time warning about its optional CPU kernel package (``Failed to
    load CPU gemm_4bit_forward from kernels-community``, printed wherever peft is imported) off a
    command's output when the command runs no 4-bit kernel; its errors still show."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def cannot_write_in(folder: str | os.PathLike) -> str | None:
    """Why no file can be created in ``folder``, an existing directory, or None where one can: it
    creates and deletes an empty file, as the write will. A permission check says yes to root on a
    read-only mount or under ``/proc``, where a long run's first checkpoint would then fail."""
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".agilerl-write-check-")
    except OSError as err:
        return err.strerror or str(err)
    os.close(handle)
    os.unlink(name)
    return None
