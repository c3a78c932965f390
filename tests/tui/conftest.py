"""Explorer test setup: snapshots are stored as .svg files."""

from __future__ import annotations

try:
    from pytest_textual_snapshot import SVGImageExtension
except ImportError:  # the dev extra is not installed: test_snapshots.py skips itself
    SVGImageExtension = None

if SVGImageExtension is not None:
    # pytest-textual-snapshot 1.0.0 (the last release that accepts a syrupy for pytest 9) names
    # its file extension with syrupy 4's private ``_file_extension``; syrupy >= 5 reads
    # ``file_extension`` and would otherwise store the SVG screenshots as ``.raw`` files.
    SVGImageExtension.file_extension = "svg"
