"""What the noxfile promises a new user: a session whose Python is missing fails, loudly.

nox's own default outside CI is to skip such a session and exit 0, so ``nox -s tests`` on a
machine without Python 3.11 looked green. The run below asks for an interpreter no machine has
(``--force-python 3.99``) with ``CI`` unset (where nox would error anyway) and creates nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nox() -> list[str]:
    # The tests session passes the interpreter that runs nox (nox is not in its own venv).
    python = os.environ.get("KVCORE_NOX_PYTHON")
    if python:
        return [python, "-m", "nox"]
    found = shutil.which("nox")
    if found is None:
        pytest.skip("nox is not installed here (nox -s tests runs this test)")
    return [found]


def test_a_session_whose_python_is_missing_fails_instead_of_skipping(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    cmd = [*_nox(), "-f", str(ROOT / "noxfile.py"), "-s", "patches-check"]
    cmd += ["--force-python", "3.99", "--envdir", str(tmp_path / "envs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "Session patches-check-3.99 failed: Python interpreter 3.99 not found" in proc.stderr
    assert not list((tmp_path / "envs").glob("patches-check*"))  # no venv was made
