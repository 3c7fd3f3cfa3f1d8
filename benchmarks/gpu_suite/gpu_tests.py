"""Step ``pytest``: the ``gpu``-marked tests in a time-limited subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_suite.common import ROOT, Suite, log

_PYTEST_COUNT = re.compile(
    r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)"
)


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's closing line (``3 passed, 1 failed, 2 skipped in 1.2s``)."""
    counts: dict[str, int] = {}
    for line in reversed(text.strip().splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or "no tests ran" in line or "passed" in line):
            for n, word in found:
                key = {"error": "errors", "warning": "warnings"}.get(word, word)
                counts[key] = counts.get(key, 0) + int(n)
            break
    return counts


def gpu_test_files() -> list[str]:
    """Test files under ``tests/`` that use the ``gpu`` mark, directly or through a helper
    module that applies it (collecting only these keeps engine test trees, whose imports
    may not exist on the GPU machine, out of the run)."""
    texts: dict[Path, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            texts[path] = path.read_text()
    root_conftest = ROOT / "tests" / "conftest.py"
    helpers = [
        p.stem
        for p, t in texts.items()
        if "mark.gpu" in t and not _is_test(p) and p.name != "conftest.py"
    ]

    def marks(text: str) -> bool:
        return "mark.gpu" in text or any(h in text for h in helpers)

    # a conftest that applies the mark (through fixtures) covers its whole directory
    dirs = [
        p.parent
        for p, t in texts.items()
        if p.name == "conftest.py" and p != root_conftest and marks(t)
    ]
    return [
        str(p.relative_to(ROOT))
        for p, t in texts.items()
        if _is_test(p) and (marks(t) or any(d in p.parents for d in dirs))
    ]


def _is_test(path: Path) -> bool:
    return path.name.startswith("test_") or path.name.endswith("_test.py")


def step_pytest(suite: Suite) -> dict[str, Any]:
    limit = max(10.0, min(suite.args.pytest_timeout, suite.remaining() - 60))
    targets = suite.args.pytest_targets or gpu_test_files()
    if not targets:
        return {"ok": True, "counts": {}, "note": "no test file carries a gpu mark"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        *targets,
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    log(f"   {' '.join(cmd)} (limit {limit:.0f} s)")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
    (suite.out / "pytest-gpu.log").write_text(output)
    counts = parse_pytest_summary(output)
    tail = output.strip().splitlines()[-15:]
    for line in tail[-5:]:
        log(f"   | {line}")
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    return {
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 1),
        "counts": counts,
        "ok": not timed_out and failed == 0 and proc.returncode in (0, 5),
        "tail": tail,
    }
