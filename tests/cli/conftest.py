"""Fixtures for the ``kvctl`` / ``kvtop`` tests: a private ledger directory and real
instance processes registered in it (``tests/ledger_procs.py``)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcore.budget.ledger import process_start_time
from kvcore.budget.ledger_file import DIR_ENV
from tests.ledger_procs import kill, spawn_holder


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    return tmp_path


Spawn = Callable[..., int]


@pytest.fixture
def instance() -> Iterator[Spawn]:
    """``instance(name, nbytes, reserve=0, role="hold")`` starts a real instance process
    holding ``nbytes`` and returns its pid; all are killed after the test."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(name: str, nbytes: int, reserve: int = 0, role: str = "hold") -> int:
        proc, pid = spawn_holder(name, nbytes, reserve, role=role)
        procs.append(proc)
        return pid

    yield spawn
    for proc in procs:
        kill(proc)


def wait_dead(pid: int) -> None:
    """Wait for a SIGKILL to land (the fixture reaps the process later; a zombie counts
    as dead already)."""
    deadline = time.monotonic() + 10
    while process_start_time(pid) is not None:
        assert time.monotonic() < deadline, f"pid {pid} survived SIGKILL"
        time.sleep(0.01)
