"""Where a benchmark's figures come from, for its ``--json`` output."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def commit(*measured: str) -> str:
    """The checkout's short commit, ``+dirty`` when any of the ``measured`` paths (relative
    to the repository root) has uncommitted changes; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *measured],
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` (where ``write_json`` puts the results) and ``--commit SHA`` (the
    commit measured, where the checkout's git cannot say: a copy on a GPU machine)."""
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--commit",
        default=None,
        help="the commit measured, where the checkout's git cannot say (a copy on a GPU "
        "machine); default: read from git",
    )


def write_json(results: dict[str, Any], path: str | None, *, announce: bool = True) -> None:
    """Write ``results`` to ``path`` (nothing when ``None``) and, with ``announce``, say so
    (a benchmark that rewrites its file after each row, so that a timeout keeps the rows
    done, announces only the last write)."""
    if path:
        Path(path).write_text(json.dumps(results, indent=1))
        if announce:
            print(f"wrote {path}")
