"""The suite's own guard: a session that leaves a ``kvcore-*`` entry in ``/dev/shm`` fails,
and ledgers and host device counts of a session go to its private directory."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_session_that_leaves_a_file_in_dev_shm_fails(pytester: pytest.Pytester) -> None:
    stray = Path("/dev/shm") / f"kvcore-hygiene-{uuid.uuid4().hex}"
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        test_stray=f"""
        import os
        from pathlib import Path

        def test_writes_outside_its_directory():
            assert os.environ["KVCORE_LEDGER_DIR"] != "/dev/shm"
            Path({str(stray)!r}).write_text("left behind")
        """
    )
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    finally:
        stray.unlink(missing_ok=True)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*left*{stray.name}*in /dev/shm*"])


def test_ledgers_and_host_counts_go_to_the_sessions_private_directory() -> None:
    ledgers, counts = Path(os.environ["KVCORE_LEDGER_DIR"]), os.environ["KVCORE_HOST_SHARED_DIR"]
    assert ledgers.is_dir() and ledgers.parent == Path(counts).parent
    assert ledgers.parent.name.startswith("kvcore-tests-")
