"""Sessions for building, checking and testing kvcore and its forked engines.

``nox --list`` shows every session with its one-line description. Engine sessions are
generated from ``compat/matrix.toml``; no version list is written here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from compat import load as load_matrix  # noqa: E402

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

PYTHON = "3.11"
# The CPU build of torch; pip takes it from the local wheel directory where one exists.
TORCH = "torch==2.13.0"
MATRIX = load_matrix()


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Run pre-commit (ruff check and format, mypy on kvcore/, file fixers) on all files."""
    session.install("pre-commit")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the CPU test suite (host backend; GPU tests skip) — the command CI runs."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    env = {"PYTHONHASHSEED": "0"}
    session.run("pytest", *(session.posargs or ["-q"]), env=env)


def _engine_keys() -> list[str]:
    return [rel.key for rel in MATRIX]


if os.environ.get("KVCORE_NOX_DEBUG"):
    print("engine sessions from compat/matrix.toml:", _engine_keys(), file=sys.stderr)
