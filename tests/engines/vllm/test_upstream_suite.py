"""The three-way harness of vLLM's own tests (``upstream_suite``): the patched runs leave out
exactly the tests that failed or errored upstream, and keep every other, whatever its shape
(module function, class method, parametrized)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.engines.vllm import upstream_suite

_TESTS = """
import pytest


def test_passes():
    pass


def test_fails():
    raise AssertionError("upstream fails this on CPU")


@pytest.fixture
def broken():
    raise RuntimeError("engine core initialization failed")


def test_errors(broken):
    pass


class TestGroup:
    def test_passes(self):
        pass

    def test_fails(self):
        raise AssertionError


@pytest.mark.parametrize("n", [1, 2, "a.b::c"])
def test_param(n):
    assert n != 2
"""


def _run(tree: Path, junit: Path) -> dict[str, dict[str, str]]:
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"],
        cwd=tree,
        capture_output=True,
        check=False,
    )
    return upstream_suite.parse_junit(junit)


def test_patched_runs_leave_out_what_failed_upstream(tmp_path: Path) -> None:
    suite = tmp_path / "tree" / "tests" / "v1" / "core"
    suite.mkdir(parents=True)
    # the tree is pytest's rootdir, as the sdist's pyproject.toml makes the real one (nox puts
    # tmp_path inside this repository, whose pyproject.toml would be found instead)
    (tmp_path / "tree" / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_shapes.py").write_text(_TESTS)
    upstream_suite.write_conftest(suite, "upstream")
    first = _run(tmp_path / "tree", tmp_path / "upstream.xml")
    run_json = tmp_path / "upstream.json"
    run_json.write_text(json.dumps({"mode": "upstream", "results": first}))

    failing = upstream_suite.failing_in(run_json)
    assert failing == {
        "tests/v1/core/test_shapes.py::test_fails",
        "tests/v1/core/test_shapes.py::test_errors",
        "tests/v1/core/test_shapes/TestGroup.py::test_fails",
        "tests/v1/core/test_shapes.py::test_param[2]",
    }
    assert "tests/v1/core/test_shapes.py::test_param[a.b::c]" in first

    upstream_suite.write_conftest(suite, "elastic-off", failing)
    second = _run(tmp_path / "tree", tmp_path / "patched.xml")
    assert set(second) == set(first) - failing
    assert all(r["outcome"] == "passed" for r in second.values())

    # without a skip list the next run writes no hook and no list: everything runs again
    upstream_suite.write_conftest(suite, "elastic-off")
    assert set(_run(tmp_path / "tree", tmp_path / "again.xml")) == set(first)
