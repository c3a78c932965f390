"""A real PostgreSQL server for the tests that share a tuning study between workers.

``initdb`` and ``pg_ctl`` must be on the PATH (or under /usr/lib/postgresql/*/bin);
on Debian and Ubuntu ``apt-get install postgresql`` provides them. The server
runs from a temporary folder on a free localhost port, trusts local
connections, and is stopped (and its folder removed) when the context exits.
As root it runs as the ``postgres`` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests._procs import free_port

__all__ = ["postgres_server"]


def _binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(
            f"PostgreSQL's {name} is not installed: apt-get install postgresql (the tuner's shared-"
            "study tests need a real server)"
        )
    return found


@contextmanager
def postgres_server(database: str = "tune") -> Iterator[str]:
    """Start a server; yield a ``postgresql://`` URL of an empty ``database``; stop it."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    root = Path(tempfile.mkdtemp(prefix="agilerl-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, log, port = root / "data", root / "server.log", free_port()

    def run(*cmd: str) -> None:
        proc = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr or proc.stdout}")

    run(initdb, "-D", str(data), "-A", "trust", "-U", "agilerl", "--no-sync", "-E", "UTF8")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
    run(pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
    try:
        import psycopg

        with psycopg.connect(f"postgresql://agilerl@127.0.0.1:{port}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        yield f"postgresql://agilerl@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True, timeout=60
        )
        shutil.rmtree(root, ignore_errors=True)
