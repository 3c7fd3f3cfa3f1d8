"""Every budget test gets its own ledger directory (inherited by the processes it starts),
and no ledger group from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcore.budget.ledger_file as ledger_file


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ledger_file.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ledger_file.GROUP_ENV, raising=False)
    return tmp_path
