"""``--output`` of agilerl-plan and its tuner: checked before anything is planned, and
written so that nothing is lost.

A regular file (or a new one) is replaced through a temporary file and a rename, so a
reader never sees half a manifest; a symlink is followed, so the link stays and its target
gets the manifest. Anything else that exists (``/dev/stdout``, a FIFO) is written into as
it is: renaming over it would replace the device node or the pipe with a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote  # a SQLite URL's path is escaped (planner.tune.storage_url)

from agilerl.utils.cli import cannot_write_in
from agilerl.utils.sources import existing_path

__all__ = ["check_output", "write_output"]


def _target(path: str, what: str = "--output") -> Path:
    """``path`` with ``~`` expanded and symlinks followed; ValueError where it cannot be."""
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as err:  # ~user without a home; a loop of links
        raise ValueError(f"{what} {path!r}: {getattr(err, 'strerror', None) or err}") from None


def check_output(
    path: str | None, model: str | None = None, storage: str | None = None, *, what: str = "--output"
) -> None:
    """Refuse an ``--output`` that cannot be written, or that is the model's own config.json or the
    tuner's study (``storage``, a SQLAlchemy URL), before anything is planned. ``what`` names the
    path in the error (the explorer's save prompt says "the path")."""
    if path is None:
        return
    if not path.strip():
        raise ValueError(f"{what} is empty: give a file path for the manifest, e.g. plan.yaml")
    target = _target(path, what)
    try:
        if target.is_dir():
            raise ValueError(f"{what} {path!r} is a directory: give a file path for the manifest, e.g. plan.yaml")
        if not target.parent.exists():
            raise ValueError(f"{what} {path!r}: folder {target.parent} does not exist")
        if not target.parent.is_dir():
            raise ValueError(f"{what} {path!r}: {target.parent} is a file, not a folder")
        if not target.exists() or target.is_file():  # written through a new file in the folder
            if why := cannot_write_in(target.parent):
                raise ValueError(f"{what} {path!r}: cannot write in {target.parent} ({why})")
    except OSError as err:  # a name longer than the file system allows
        raise ValueError(f"{what} {path!r}: {err.strerror or err}") from None
    if model is not None and target == _model_config(model):
        raise ValueError(f"{what} {path!r} is the model's own config.json: give another path for the manifest")
    if storage is not None and storage.startswith("sqlite:///") and target == _target(unquote(storage[10:])):
        raise ValueError(f"{what} {path!r} is the tuner's study database (--storage): give another path")


def _model_config(model: str) -> Path | None:
    """The config.json a local model argument reads (None for a hub id or a catalog name)."""
    source = existing_path(model)
    if source is not None and source.is_dir():
        return (source / "config.json").resolve()
    if source is not None and source.is_file():
        return source.resolve()
    return None


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (see the module docstring); OSError when the system refuses."""
    target = _target(path)
    if target.exists() and not target.is_file():
        with open(target, "w") as out:
            out.write(text)
        return
    tmp = target.with_name(f".agilerl-plan.tmp{os.getpid()}")  # short: any name the folder allows still fits
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
