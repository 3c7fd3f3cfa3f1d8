"""Run a pinned vLLM release's own ``tests/v1/core`` on CPU, and compare runs.

The tests come from the release's sdist at run time (fetched and sha256-checked by
``python -m patchq fetch``; never committed). The harness extracts ``tests/`` and the
sdist's ``pyproject.toml`` (pytest markers) into a work directory and adds what a CPU
machine without network needs:

* ``tests/v1/core/conftest.py`` overriding ``should_do_global_cleanup_after_test`` (the root
  conftest's autouse cleanup touches an accelerator);
* a local Hugging Face hub cache with small ``config.json`` files for the models the tests
  name (``HF_HUB_OFFLINE=1``: nothing is downloaded), written from ``harness/hf_configs.py``;
* ``VLLM_TARGET_DEVICE=cpu``.

Modes (``--mode``): ``upstream`` and ``elastic-off`` run the tests as they are (the second
against the forked wheel: it must behave as upstream); ``elastic-on`` adds an autouse
fixture that sets ``KVCacheConfig.kvcore`` on every ``KVCacheConfig`` a test builds that
elastic KV supports (every group full attention, sliding window, MLA or Mamba,
``checks.check_kv_cache_config``; what start-up validation would refuse keeps upstream's
pool, as a real engine would refuse to start elastic). ``kvcore`` is the one
switch the patched engine reads: every such coordinator-built block pool becomes kvcore's
``ElasticBlockPool`` on the ``host`` backend with 4 KiB pages. Tests that build vLLM's
``BlockPool`` directly test upstream's class in every mode.

``run --skip-failing-in RUN.json`` leaves out the tests that failed or errored in that
earlier run (the upstream run: on this CPU machine about half of the suite's time goes to
tests that cannot start an engine core here, in every mode). ``compare`` judges only tests
that passed upstream, so leaving the others out of the patched runs loses no verdict.

``run`` writes ``<out>`` (JSON: nodeid -> passed/failed/skipped/error); ``compare`` prints
the table of modes and exits 1 when a patched mode fails a test that upstream passed,
unless that test is listed in ``ELASTIC_EXPECTED`` with the reason.

Usage, from the repository root (the ``test-vllm-<short>`` nox session runs these)::

    python -m tests.engines.vllm.upstream_suite run --version 0.33.0 --mode upstream \
        --out .results/upstream.json
    python -m tests.engines.vllm.upstream_suite compare .results/*.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.hf_configs import write_hub_cache

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

MODES = ("upstream", "elastic-off", "elastic-on")

_CLEANUP_OVERRIDE = """
# Written by kvcore's upstream_suite.py: CPU runs skip the accelerator cleanup.
import pytest


@pytest.fixture()
def should_do_global_cleanup_after_test() -> bool:
    return False
"""

_ELASTIC_ON = """
# Written by kvcore's upstream_suite.py (--mode elastic-on): every KVCacheConfig a test
# builds carries kvcore settings, so the patched coordinator builds kvcore's elastic pool.
import pytest


@pytest.fixture(autouse=True)
def _kvcore_elastic_on(monkeypatch):
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcore.adapters.vllm.checks import check_kv_cache_config
    from kvcore.errors import UnsupportedConfiguration

    original = KVCacheConfig.__init__
    elastic = []

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:  # what start-up validation would refuse runs upstream's pool, as it would
            check_kv_cache_config(self)
        except UnsupportedConfiguration:
            return
        if self.kvcore is None:
            # 4 KiB pages: the tests' tiny blocks then span many pages
            self.kvcore = {"backend": "host", "backend_options": {"granularity": 4096}}
            elastic.append(True)

    monkeypatch.setattr(KVCacheConfig, "__init__", init)
    yield
    if elastic:
        # the memories of finished tests would pile up (each holds its zero-page mappings)
        # until mmap hits ENOMEM: close them here, as an engine's shutdown does (a
        # gc.collect() per test did it too, at ~0.45 s each over vLLM's ~650k objects)
        from kvcore.adapters.vllm.runtime import close_all

        close_all()
"""


# Where ``run --skip-failing-in`` lists the tests to leave out, beside the conftest; the
# conftest's collection hook (``_skip_hook``) deselects them.
_SKIP_FILE = "kvcore_skip.json"


def junit_key(nodeid: str) -> str:
    """The key ``parse_junit`` gives the test pytest calls ``nodeid``: JUnit's classname
    (the module path dotted, then any classes) with dots made slashes, ``.py::``, the
    test's name with its parameters (``tests/v1/core/test_x.py::TestA::test_b[1]`` ->
    ``tests/v1/core/test_x/TestA.py::test_b[1]``). As pytest's JUnit report, the nodeid is
    split before its parameters, which may hold ``::`` or dots."""
    address, bracket, params = nodeid.partition("[")
    path, *rest = address.split("::")
    classname = ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]])
    return classname.replace(".", "/") + ".py::" + rest[-1] + bracket + params


def _skip_hook() -> str:
    """The conftest text that deselects the tests keyed in ``_SKIP_FILE``. It carries
    ``junit_key``'s own source: the extracted tree cannot import this module."""
    return f"""
# Written by kvcore's upstream_suite.py (--skip-failing-in): deselect the tests that failed
# in the run named there; they cannot show a regression (compare judges only tests that
# passed upstream).
import json as _json
from pathlib import Path as _Path

{inspect.getsource(junit_key)}

def pytest_collection_modifyitems(config, items):
    skip = set(_json.loads((_Path(__file__).parent / "{_SKIP_FILE}").read_text()))
    kept, left_out = [], []
    for item in items:
        (left_out if junit_key(item.nodeid) in skip else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
"""


def write_conftest(folder: Path, mode: str, skip: frozenset[str] = frozenset()) -> None:
    """Write the harness's ``conftest.py`` for ``mode`` into ``folder`` (replacing the
    release's), and the list of tests it deselects (``skip``, keyed as ``junit_key``)."""
    text = _CLEANUP_OVERRIDE + (_ELASTIC_ON if mode == "elastic-on" else "")
    (folder / _SKIP_FILE).unlink(missing_ok=True)
    if skip:
        (folder / _SKIP_FILE).write_text(json.dumps(sorted(skip), indent=0))
        text += _skip_hook()
    (folder / "conftest.py").write_text(text)


def _fetch_sdist(version: str) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "patchq", "fetch", "vllm", version, "sdist"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def prepare(version: str, work: Path, mode: str, skip: frozenset[str] = frozenset()) -> Path:
    """Extract the release's tests into ``work/<mode>`` and write the harness files; the
    tests keyed in ``skip`` (``junit_key``) are deselected."""
    tree = work / mode
    if not (tree / "tests").is_dir():
        sdist = _fetch_sdist(version)
        prefix = f"vllm-{version}/"
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"
            ]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(tree, members=members, filter="data")
    write_conftest(tree / "tests" / "v1" / "core", mode, skip)
    write_hub_cache(work / "hf-hub")
    return tree


def failing_in(run_json: Path) -> frozenset[str]:
    """The tests a ``run`` output records as failed or errored."""
    results = json.loads(run_json.read_text())["results"]
    return frozenset(n for n, r in results.items() if r["outcome"] in ("failed", "error"))


def run(
    version: str,
    mode: str,
    work: Path,
    out: Path,
    pytest_args: list[str],
    skip: frozenset[str] = frozenset(),
) -> int:
    """Run the release's ``tests/v1/core`` in ``mode`` less the tests keyed in ``skip``;
    write the results to ``out``. Returns 0 when pytest ran (failures are for ``compare``
    to judge), pytest's code when it could not."""
    out = out.resolve()  # pytest runs in the extracted tree
    tree = prepare(version, work, mode, skip)
    junit = out.with_suffix(".xml")
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(work / "hf-hub"),
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        PYTHONHASHSEED="0",
        KVCORE_HOST_DEVICE_BYTES=str(4 << 30),
    )
    env.pop("PYTHONPATH", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "--timeout=300",
        f"--junitxml={junit}",
        *pytest_args,
    ]
    if not any(not a.startswith("-") for a in pytest_args):
        cmd.append("tests/v1/core")
    started = time.monotonic()
    rc = subprocess.run(cmd, cwd=tree, env=env, check=False).returncode
    results = parse_junit(junit)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "version": version,
                "mode": mode,
                "wall_s": round(time.monotonic() - started, 1),
                "left_out": len(skip),
                "results": results,
            },
            indent=1,
            sort_keys=True,
        )
    )
    counts = _counts(results)
    left = f", {len(skip)} failing upstream left out" if skip else ""
    print(f"vllm {version} tests/v1/core [{mode}]: {_fmt(counts)}{left} (pytest rc={rc})")
    return 0 if rc in (0, 1) else rc  # failures are judged by `compare`, not here


def parse_junit(path: Path) -> dict[str, dict[str, str]]:
    """A JUnit XML report's tests: ``junit_key`` -> ``{"outcome", "why"}`` (outcome passed,
    failed, error or skipped; why: the first line of the message, at most 200 characters);
    empty when the report is missing."""
    results: dict[str, dict[str, str]] = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        name = case.get("name", "")
        nodeid = cls.replace(".", "/") + ".py::" + name if cls else name
        outcome, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                why = (
                    (child.get("message") or "").splitlines()[0][:200]
                    if child.get("message")
                    else ""
                )
                break
            if child.tag == "skipped":
                outcome, why = "skipped", (child.get("message") or "")[:200]
        results[nodeid] = {"outcome": outcome, "why": why}
    return results


def _counts(results: dict[str, dict[str, str]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in results.values():
        counts[r["outcome"]] += 1
    return counts


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items())


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def compare(paths: list[Path], expected: dict[str, str]) -> int:
    """Print per-file pass counts of each mode and every regression; 1 on a regression."""
    runs = {}
    for p in paths:
        data = json.loads(p.read_text())
        runs[data["mode"]] = data
    if "upstream" not in runs:
        print("compare: no upstream run given", file=sys.stderr)
        return 2
    modes = [m for m in MODES if m in runs]
    base = runs["upstream"]["results"]
    files = sorted({_file_of(n) for n in base})
    header = f"{'file':58} " + " ".join(f"{m:>13}" for m in modes)
    print(header)
    for f in files:
        row = []
        for m in modes:
            res = [r for n, r in runs[m]["results"].items() if _file_of(n) == f]
            ok = sum(r["outcome"] == "passed" for r in res)
            row.append(f"{ok:>6}/{len(res):<6}")
        print(f"{f:58} " + " ".join(row))
    totals = " ".join(
        f"{m}: {_fmt(_counts(runs[m]['results']))} in {runs[m]['wall_s']} s" for m in modes
    )
    print(totals)
    status = 0
    for m in modes[1:]:
        for nodeid, r in sorted(base.items()):
            if r["outcome"] != "passed":
                continue
            got = runs[m]["results"].get(nodeid, {"outcome": "missing", "why": ""})
            if got["outcome"] == "passed":
                continue
            reason = expected.get(nodeid) if m == "elastic-on" else None
            if reason:
                print(f"[{m}] expected difference: {nodeid}: {reason}")
                continue
            print(f"[{m}] REGRESSION: {nodeid}: {got['outcome']} {got['why']}")
            status = 1
    not_passing = {n: r for n, r in base.items() if r["outcome"] in ("failed", "error")}
    if not_passing:
        print(f"failing upstream on this CPU machine ({len(not_passing)}):")
        for nodeid, r in sorted(not_passing.items()):
            print(f"  {nodeid}: {r['why']}")
    return status


def _expected() -> dict[str, str]:
    path = HERE / "elastic_expected.json"
    if not path.exists():
        return {}
    data: dict[str, str] = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=textwrap.dedent(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--version", required=True)
    r.add_argument("--mode", choices=MODES, required=True)
    r.add_argument("--work", type=Path, default=ROOT / ".nox" / "_vllm-upstream-tests")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument(
        "--skip-failing-in",
        type=Path,
        metavar="RUN_JSON",
        help="leave out the tests that failed or errored in this earlier run's output",
    )
    r.add_argument("pytest_args", nargs="*")
    c = sub.add_parser("compare")
    c.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        skip = failing_in(args.skip_failing_in) if args.skip_failing_in else frozenset()
        return run(
            args.version, args.mode, args.work / args.version, args.out, args.pytest_args, skip
        )
    return compare(args.paths, _expected())


if __name__ == "__main__":
    sys.exit(main())
