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
    session.install(*PATCHQ_DEPS)  # tests/patchq drive the repository's patch tooling
    env = {"PYTHONHASHSEED": "0"}
    session.run("pytest", *(session.posargs or ["-q"]), env=env)
    if not session.posargs:  # the full suite (CI) also proves every series still applies
        session.notify("patches-check")


def _engine_keys() -> list[str]:
    return [rel.key for rel in MATRIX]


if os.environ.get("KVCORE_NOX_DEBUG"):
    print("engine sessions from compat/matrix.toml:", _engine_keys(), file=sys.stderr)


# --- patch queue (patchq/): forks, series, forked wheels. Sessions derive from the matrix. ---
PATCHQ_DEPS = ("rich>=13", "packaging>=23")


def _patchq(session: nox.Session, *args: str) -> None:
    session.install(*PATCHQ_DEPS)
    session.run("python", "-m", "patchq", *args)


@nox.session(name="patches-check", python=PYTHON)
def patches_check(session: nox.Session) -> None:
    """Every patch series applies to its pinned release exactly and re-exports byte for byte."""
    _patchq(session, "check", *session.posargs)


def _build_session(name: str, version: str, short: str) -> None:
    def build(session: nox.Session) -> None:
        _patchq(session, "build", name, version, *session.posargs)

    build.__doc__ = (
        f"Build the forked {name} {version} wheel (+kvcore.N) into dist/; install-check."
    )
    nox.session(name=f"build-{name}-{short}", python=PYTHON)(build)


def _rebase_session(name: str) -> None:
    def rebase(session: nox.Session) -> None:
        if not session.posargs:
            session.error(f"usage: nox -s rebase-{name} -- <version> [--from V] [--continue]")
        _patchq(session, "rebase", name, *session.posargs)

    rebase.__doc__ = f"Replay a {name} series onto another release: -- <version> [--from V]."
    nox.session(name=f"rebase-{name}", python=PYTHON)(rebase)


for _rel in MATRIX:
    _build_session(_rel.name, _rel.version, _rel.short)
for _name in dict.fromkeys(rel.name for rel in MATRIX):
    _rebase_session(_name)
