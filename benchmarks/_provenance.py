"""Where a benchmark's figures come from, for its ``--json`` output."""

from __future__ import annotations

import datetime as _dt
import subprocess
from pathlib import Path

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
