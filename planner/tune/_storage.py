"""Where a study lives, how a running trial says it is alive, and who cleans up after a dead tuner.

- ``--storage``: a SQLite file by default (``./agilerl-tune.db``), ``memory`` for a
  throw-away study, or any SQLAlchemy URL (PostgreSQL lets workers on several
  nodes tune one study). RDB storages record heartbeats: a trial whose tuner
  died is marked FAIL by the next tuner that opens the study
  (``optuna.storages.fail_stale_trials``).
- Every probe a tuner launches carries ``AGILERL_TUNE_OWNER=<host>:<pid>`` in its
  environment. A tuner killed outright (SIGKILL) cannot stop its probe; the next
  tuner on the host kills every process whose owner is dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_STORAGE",
    "OWNER_ENV",
    "storage_url",
    "open_storage",
    "default_study_name",
    "heartbeat",
    "owner_tag",
    "kill_orphans",
    "redact",
]

DEFAULT_STORAGE = "agilerl-tune.db"
OWNER_ENV = "AGILERL_TUNE_OWNER"
_MEMORY = ("memory", ":memory:")


def storage_url(text: str | None) -> str | None:
    """The SQLAlchemy URL for ``--storage`` (None: in memory, nothing kept).

    A plain path is a SQLite file (its folder must exist); a URL must parse as
    a SQLAlchemy URL. Raises ValueError saying which forms are accepted.
    """
    text = (text if text is not None else DEFAULT_STORAGE).strip()
    accepted = (
        "expected a SQLite file path (default ./agilerl-tune.db), 'memory', or a SQLAlchemy URL "
        "such as sqlite:///tune.db or postgresql://user:password@host/db"
    )
    if not text:
        raise ValueError(f"--storage is empty: {accepted}")
    if text.lower() in _MEMORY:
        return None
    if "://" not in text:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", text) and not re.match(r"^[A-Za-z]:[\\/]", text):
            raise ValueError(f"--storage {text!r} looks like a URL without '//': {accepted}")
        path = Path(text).expanduser().resolve()
        if path.is_dir():
            raise ValueError(f"--storage {text!r} is a directory: {accepted}")
        if not path.parent.is_dir():
            raise ValueError(f"--storage {text!r}: folder {path.parent} does not exist")
        from urllib.parse import quote

        # SQLAlchemy reads '?' as the start of a query and decodes '%XX': escaped, the file is the one named
        return f"sqlite:///{quote(str(path), safe='/')}"
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
    except ArgumentError as err:
        raise ValueError(f"--storage {redact(text)!r} is not a valid SQLAlchemy URL ({err}): {accepted}") from None
    from sqlalchemy.exc import NoSuchModuleError

    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise ValueError(
            f"--storage {redact(text)!r}: no database dialect {url.drivername!r} in SQLAlchemy: {accepted}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        hint = " (pip install psycopg2-binary)" if url.get_backend_name() == "postgresql" else ""
        raise ValueError(f"--storage {redact(text)!r}: its database driver is not installed: {err}{hint}") from None
    if url.drivername.startswith("sqlite") and url.database not in (None, "", ":memory:"):
        folder = Path(url.database).expanduser().resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--storage {text!r}: folder {folder} does not exist")
    return text


def redact(url: str) -> str:
    """The URL with any password hidden (for messages and output)."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def open_storage(text: str | None, *, heartbeat_interval_s: int = 10, grace_period_s: int | None = None) -> Any:
    """An Optuna storage for ``--storage`` (see :func:`storage_url`); ValueError when it cannot be opened."""
    import optuna

    url = storage_url(text)
    if url is None:
        return optuna.storages.InMemoryStorage()
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        engine_kwargs["connect_args"] = {"timeout": 60}  # several workers may share one file
        _check_sqlite_is_a_study(url)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_interval_s,
                grace_period=grace_period_s or 3 * heartbeat_interval_s,
            )
    except ImportError as err:
        raise ValueError(f"--storage {redact(url)}: its database driver is not installed ({err})") from None
    except Exception as err:  # SQLAlchemy's OperationalError and friends: report, do not trace back
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--storage {redact(url)}: cannot open it: {first}") from None


def _check_sqlite_is_a_study(url: str) -> None:
    """Refuse a SQLite file that already holds tables and none of Optuna's: opening it as a
    storage would add Optuna's tables to another program's database before refusing it."""
    import sqlite3

    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:" or not Path(database).expanduser().is_file():
        return
    uri = Path(database).expanduser().resolve().as_uri() + "?mode=ro"  # '#', '?' and '%' escaped
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=60)) as db:  # the storage's own wait
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:
        raise ValueError(f"--storage {redact(url)}: cannot open it: {err}") from None
    if tables and not {"studies", "version_info"} <= tables:
        raise ValueError(
            f"--storage {redact(url)}: a SQLite database of something else (tables {', '.join(sorted(tables)[:4])}); "
            "give a new file or an Optuna study's"
        )


def default_study_name(model: str, parts: dict[str, Any]) -> str:
    """``<model>-<N>x<gpu>-<digest of everything the measurements depend on>``."""
    stem = re.sub(r"[^A-Za-z0-9.]+", "-", model.removeprefix("tiny:")).strip("-")[:48]
    cluster = parts.get("cluster", {})
    gpu = re.sub(r"[^A-Za-z0-9.]+", "-", str(cluster.get("gpu", {}).get("name", "gpu"))).strip("-")
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{stem}-{cluster.get('num_gpus', 1)}x{gpu}-{digest}"


@contextmanager
def heartbeat(storage: Any, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat every interval while the block runs (a daemon thread).

    The probe's own wait loop owns the main thread, so that Ctrl-C reaches its
    kill-the-launch path; the heartbeat therefore runs beside it.
    """
    interval = getattr(storage, "heartbeat_interval", None)
    if not interval or not hasattr(storage, "record_heartbeat"):
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # noqa: BLE001 - a missed beat must not kill the trial; the next one retries
                pass
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"agilerl-tune-heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def owner_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_orphans() -> list[int]:
    """SIGKILL every process on this host launched by a tuner that is no longer alive; their pids."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    host = socket.gethostname()
    marker = f"{OWNER_ENV}=".encode()
    killed = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if not var.startswith(marker):
                continue
            owner_host, _, owner_pid = var[len(marker) :].decode(errors="replace").rpartition(":")
            if owner_host == host and owner_pid.isdigit() and not _alive(int(owner_pid)):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
                except (ProcessLookupError, PermissionError):
                    pass
            break
    return killed
