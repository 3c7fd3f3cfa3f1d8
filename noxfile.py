"""Sessions for building, checking and testing kvcore and its forked engines.

``nox --list`` shows every session with its one-line description. Engine sessions are
generated from ``compat/matrix.toml``; no version list is written here. Every session runs on
Python 3.11 (``PYTHON``; ``tests-3.10`` on ``OLDEST_PYTHON``); without that interpreter on PATH
a session fails, it is not skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from compat import load as load_matrix  # noqa: E402

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]
# A session whose interpreter is missing fails (nox's default outside CI is a skip, exit 0: a
# false green). `--no-error-on-missing-interpreters` restores the skip.
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
OLDEST_PYTHON = "3.10"
"""The oldest Python ``pyproject.toml`` admits (``requires-python``): ``tests-3.10`` runs the
library's suite on it."""
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
    session.install("matplotlib")  # tests/benchmarks draw the benchmarks' plots
    # tests/test_noxfile.py runs nox itself, with the interpreter running this nox
    env = {"PYTHONHASHSEED": "0", "KVCORE_NOX_PYTHON": sys.executable}
    # tests/engines/ need an engine installed: their own sessions (test-<engine>-<v>) run them.
    session.run("pytest", *(session.posargs or ["-q", "--ignore=tests/engines"]), env=env)
    if not session.posargs:  # the full suite (CI) also proves every series still applies
        session.notify(f"tests-{OLDEST_PYTHON}")
        session.notify("patches-check")
        for engine_session in SGLANG_TEST_SESSIONS:  # the real SGLang classes, three ways
            session.notify(engine_session)
        for engine_session in VLLM_TEST_SESSIONS:  # vLLM's tests/v1/core, three ways (~7 min)
            session.notify(engine_session)


# The repository's own tooling (patchq, compat, this noxfile) needs Python 3.11 (tomllib);
# the kvcore library does not, and its suite is what runs on the oldest Python.
_TOOLING_TESTS = ("tests/compat", "tests/patchq", "tests/test_noxfile.py")


@nox.session(name=f"tests-{OLDEST_PYTHON}", python=OLDEST_PYTHON)
def tests_oldest_python(session: nox.Session) -> None:
    """Run the kvcore library's CPU suite on Python 3.10, the oldest pyproject.toml admits."""
    # PyPI has no CPU-only torch for this Python: this takes its CUDA build (about 4.6 GB of
    # venv), which runs on a CPU as well; GPU tests skip as in `tests`.
    session.install(TORCH)
    session.install("-e", ".[test]")
    ignored = [f"--ignore={path}" for path in ("tests/engines", *_TOOLING_TESTS)]
    args = session.posargs or ["-q", *ignored]
    session.run("pytest", *args, env={"PYTHONHASHSEED": "0"})
    _prune_venv(session)


# --- progress of the long phases (first run: ~22 min on 2 cores, most of it pip and vLLM's
# tests/v1/core) and where their verbose output goes. ---
LOGS = ROOT / "build" / "logs"
"""Full output of the runs whose console line is a summary (vLLM's tests/v1/core three ways)."""
PROGRESS_EVERY_S = 60.0
_PYTEST_PERCENT = re.compile(rb"\[\s*(\d+)%\]")


def _pytest_percent(log: Path) -> str:
    """The last ``[ NN%]`` pytest -q wrote to ``log``, or ``""``."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, log.stat().st_size - 8192))
            found = _PYTEST_PERCENT.findall(fh.read())
    except OSError:
        return ""
    return f", {int(found[-1])}% of the tests" if found else ""


@contextmanager
def _progress(session: nox.Session, what: str, log: Path | None = None) -> Iterator[None]:
    """Log ``what: still running (N s)`` every ``PROGRESS_EVERY_S`` while the block runs (with
    pytest's percentage from ``log``), so a phase that prints nothing for minutes shows it is
    alive."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            pct = _pytest_percent(log) if log else ""
            session.log(f"{what}: still running ({time.monotonic() - start:.0f} s{pct})")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


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

    # The session runs on 3.11, so that is the wheel's Python unless `-- --python X.Y` asks for
    # another one the matrix pins (its install check then needs a working pythonX.Y on PATH).
    build.__doc__ = (
        f"Build the forked {name} {version} wheel (+kvcore.N) for Python {PYTHON} (-- --python "
        "X.Y: another) into dist/; install-check."
    )
    nox.session(name=f"build-{name}-{short}", python=PYTHON)(build)


def _rebase_session(name: str) -> None:
    def rebase(session: nox.Session) -> None:
        if not session.posargs:
            session.error(f"usage: nox -s rebase-{name} -- <version> [--from V] [--continue]")
        _patchq(session, "rebase", name, *session.posargs)

    rebase.__doc__ = f"Replay a {name} series onto another release: -- <version> [--from V]."
    nox.session(name=f"rebase-{name}", python=PYTHON)(rebase)


@nox.session(python=PYTHON)
def roll(session: nox.Session) -> None:
    """Pin a new release: fetch, rebase the nearest series, build, report (-- <engine> <v>)."""
    if len(session.posargs) < 2:
        session.error("usage: nox -s roll -- <engine> <version> [--continue] [--force]")
    _patchq(session, "roll", *session.posargs)


for _rel in MATRIX:
    _build_session(_rel.name, _rel.version, _rel.short)
for _name in dict.fromkeys(rel.name for rel in MATRIX):
    _rebase_session(_name)


# --- engine tests (tests/engines/<engine>/): one session per pinned release that has a pinned
# CPU dependency list (tests/engines/<engine>/requirements-<version>.txt), all of one shape:
# the tests with the pinned upstream wheel, then (where patches/<engine>/<version>/ holds a
# series) with the forked wheel that patchq builds. Only `_EngineTests` differs per engine.
# CI (`tests`) runs the sessions of releases marked host tested-cpu in compat/matrix.toml. ---
ENGINE_TESTS = ROOT / "tests" / "engines"
# torchvision: registry wheels link CUDA torch; an import-only stand-in (see its doc)
TORCHVISION_SHIM = ENGINE_TESTS / "sglang" / "shim"
_Stage = Callable[[nox.Session, str, dict[str, str]], None]
PRUNE_ENV = "KVCORE_PRUNE_VENVS"
"""Set to 1 (``.ci/run`` does), an engine test session removes its venv when it ends."""


def _prune_venv(session: nox.Session) -> None:
    """Remove the session's venv when ``PRUNE_ENV`` says so: each engine venv is ~2.3 GB
    (``tests-3.10``'s 4.6 GB) and CI starts from a clean clone anyway, so the peak disk
    holds one of them instead of all nine."""
    if os.environ.get(PRUNE_ENV) == "1":
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@dataclass(frozen=True)
class _EngineTests:
    """What one engine's ``test-<engine>-<short>`` sessions run at each stage."""

    engine: str
    doc: str
    """The session's description; ``{version}`` is filled in."""
    fetch_args: tuple[str, ...]
    """Arguments after ``patchq fetch <engine> <version> wheel`` choosing the upstream wheel."""
    forked_glob: str
    """The forked wheel ``patchq build`` writes into dist/; ``{version}`` is filled in."""
    upstream: _Stage
    """Called as ``(session, version, env)`` with the upstream wheel installed."""
    patched: _Stage
    """Called the same way with the forked wheel installed (only where a series exists)."""
    finish: Callable[[nox.Session, str, dict[str, str], bool], None] = lambda *_: None
    """Called last, also told whether ``patched`` ran."""

    def session(self, version: str, short: str) -> str | None:
        """Define ``test-<engine>-<short>``; returns its name, or ``None`` (no session) when
        the release has no pinned CPU dependency list."""
        requirements = ENGINE_TESTS / self.engine / f"requirements-{version}.txt"
        if not requirements.exists():
            return None

        def test_engine(session: nox.Session) -> None:
            with _progress(session, f"installing torch and {requirements.name} (first run: ~2 GB)"):
                session.install("--no-deps", TORCH, "-r", str(requirements))
            session.install("--no-deps", "-e", ".")
            env = {"PYTHONHASHSEED": "0", "PYTHONPATH": str(TORCHVISION_SHIM)}
            fetch = ("python", "-m", "patchq", "fetch", self.engine, version, "wheel")
            # stdout (the path) is captured; patchq's download bar and steps go to the console
            upstream = str(session.run(*fetch, *self.fetch_args, silent=True, stderr=None))
            session.install("--no-deps", "--force-reinstall", upstream.strip().splitlines()[-1])
            self.upstream(session, version, env)
            patched = (ROOT / "patches" / self.engine / version / "series").exists()
            if patched:
                build = ("python", "-m", "patchq", "build", self.engine, version)
                built = session.run(*build, "--no-install-check", silent=True, stderr=None)
                forked = sorted(
                    (ROOT / "dist").glob(self.forked_glob.format(version=version)),
                    key=lambda p: p.stat().st_mtime,
                )
                if not forked:
                    session.error(f"patchq build produced no forked {self.engine} wheel:\n{built}")
                session.install("--no-deps", "--force-reinstall", str(forked[-1]))
                self.patched(session, version, env)
            else:
                session.log(f"no patch series for {self.engine} {version}: upstream run only")
            self.finish(session, version, env, patched)
            _prune_venv(session)

        test_engine.__doc__ = self.doc.format(version=version)
        name = f"test-{self.engine}-{short}"
        nox.session(name=name, python=PYTHON)(test_engine)
        return name


# SGLang (tests/engines/sglang/): the real SGLang allocator, pool and radix cache on CPU; the
# patched run covers elastic KV off and on.
def _sglang_pytest(expect: str) -> _Stage:
    def run(session: nox.Session, version: str, env: dict[str, str]) -> None:
        pytest_args = session.posargs or ["-q", "-p", "no:cacheprovider"]
        tests = str(ENGINE_TESTS / "sglang")
        session.run("pytest", tests, *pytest_args, env={**env, "KVCORE_SGLANG_EXPECT": expect})

    return run


SGLANG = _EngineTests(
    engine="sglang",
    doc="SGLang {version} KV tests on CPU: upstream wheel, then forked wheel (elastic off, on).",
    fetch_args=("--python", PYTHON),
    forked_glob="sglang-{version}+kvcore.*-cp311-*.whl",
    upstream=_sglang_pytest("upstream"),
    patched=_sglang_pytest("patched"),
)


# vLLM (tests/engines/vllm/): the release's own tests/v1/core three ways (upstream wheel;
# forked wheel with elastic KV off; with elastic KV on; `upstream_suite.py compare` judges
# them), then kvcore's tests against the real vLLM scheduler. The three-way run takes most of
# a session's time, so it runs on the oldest and the newest vLLM release that have a pinned
# CPU dependency list (the ends of the range a patch must work across); the releases between
# build their forked wheel and run kvcore's tests only.
VLLM_TESTS = ENGINE_TESTS / "vllm"
VLLM_MODES = ("upstream", "elastic-off", "elastic-on")
VLLM_SUITE = ("python", "-m", "tests.engines.vllm.upstream_suite")
# the co-location demo's engine cores (benchmarks/colocate.py) need vLLM: they run here too
COLOCATE_RUN_TEST = ROOT / "tests" / "benchmarks" / "test_colocate_run.py"
_VLLM_TESTED = sorted(
    (
        rel.version
        for rel in MATRIX
        if rel.name == "vllm" and (VLLM_TESTS / f"requirements-{rel.version}.txt").exists()
    ),
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
VLLM_THREE_WAY = frozenset({_VLLM_TESTED[0], _VLLM_TESTED[-1]} if _VLLM_TESTED else ())


def _vllm_results(session: nox.Session, version: str, mode: str) -> str:
    return str(Path(session.create_tmp()) / f"vllm-{version}" / f"{mode}.json")


def _vllm_suite(session: nox.Session, version: str, env: dict[str, str], mode: str) -> None:
    """One run of the release's tests/v1/core. pytest's output (the tracebacks of the ~80
    tests that fail upstream on CPU) goes to ``build/logs/``; the console gets a line a
    minute and the run's counts. The patched modes leave out what failed upstream (about
    half of a run's time; ``compare``, in ``_vllm_compare``, judges only tests that passed
    upstream)."""
    suite = (*VLLM_SUITE, "run", "--version", version)
    if mode != "upstream":
        suite += ("--skip-failing-in", _vllm_results(session, version, "upstream"))
    out = _vllm_results(session, version, mode)
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"test-vllm-{version}-{mode}.log"
    session.log(f"vLLM {version} tests/v1/core [{mode}] (a few minutes): full output in {log}")
    failed = True
    with open(log, "w") as fh, _progress(session, f"tests/v1/core [{mode}]", log):
        try:
            session.run(*suite, "--mode", mode, "--out", out, *session.posargs, env=env, stdout=fh)
            failed = False
        finally:
            fh.flush()
            # pytest's closing counts and the suite's summary line; when the run itself
            # failed (not a test: the harness), the last 30 lines of the log
            tail = log.read_text(errors="replace").splitlines()[-30 if failed else -3 :]
            for line in (ln for ln in tail if ln.strip()):
                session.log(line if failed else line.strip("= "))


def _vllm_upstream(session: nox.Session, version: str, env: dict[str, str]) -> None:
    if version in VLLM_THREE_WAY:
        _vllm_suite(session, version, env, "upstream")
    else:
        session.log(f"vLLM {version}: tests/v1/core runs on {sorted(VLLM_THREE_WAY)} only")


def _vllm_patched(session: nox.Session, version: str, env: dict[str, str]) -> None:
    if version in VLLM_THREE_WAY:
        _vllm_suite(session, version, env, "elastic-off")
        _vllm_suite(session, version, env, "elastic-on")
    session.run("pytest", "-q", str(VLLM_TESTS), str(COLOCATE_RUN_TEST), env=env)


def _vllm_compare(session: nox.Session, version: str, env: dict[str, str], patched: bool) -> None:
    if version not in VLLM_THREE_WAY:
        return
    runs = [_vllm_results(session, version, m) for m in (VLLM_MODES if patched else VLLM_MODES[:1])]
    session.run(*VLLM_SUITE, "compare", *runs, env=env)


VLLM = _EngineTests(
    engine="vllm",
    doc="vLLM {version} on CPU: kvcore's scheduler tests on the forked wheel; on the oldest "
    "and newest release also tests/v1/core three ways (upstream, elastic off, elastic on).",
    fetch_args=(),
    forked_glob="vllm-{version}+kvcore.*.whl",
    upstream=_vllm_upstream,
    patched=_vllm_patched,
    finish=_vllm_compare,
)


def _test_sessions(spec: _EngineTests) -> list[str]:
    """Define ``spec``'s session for every pinned release of its engine; return the ones CI
    runs (``tests`` notifies them): those of releases that compat/matrix.toml marks host
    ``tested-cpu``. A new release's session runs by hand until it passes and the matrix says
    so."""
    in_ci = []
    for rel in MATRIX:
        if rel.name != spec.engine:
            continue
        name = spec.session(rel.version, rel.short)
        host = rel.backends.get("host")
        if name and host is not None and host.status == "tested-cpu":
            in_ci.append(name)
    return in_ci


SGLANG_TEST_SESSIONS = _test_sessions(SGLANG)
VLLM_TEST_SESSIONS = _test_sessions(VLLM)


# --- co-location demo (benchmarks/colocate.py): vLLM's real v1 scheduler in two engine-core
# processes with a stand-in executor, one KV budget, elastic (kvcore + per-GPU ledger, host
# backend) vs static (upstream, budget split evenly). Runs on CPU in a few minutes. ---
DEMO_VLLM = "0.33.0"


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Co-location demo on CPU: two vLLM engine cores, one KV budget, elastic vs static."""
    requirements = ROOT / "tests" / "engines" / "vllm" / f"requirements-{DEMO_VLLM}.txt"
    session.install("--no-deps", TORCH, "-r", str(requirements))
    session.install("matplotlib", "rich")
    session.install("--no-deps", "-e", ".")
    build = ("python", "-m", "patchq", "build", "vllm", DEMO_VLLM, "--no-install-check")
    built = session.run(*build, silent=True, stderr=None)
    wheel = str(built).strip().splitlines()[-1]  # patchq build prints the wheel path last
    session.install("--no-deps", "--force-reinstall", wheel)
    session.run("python", "-m", "benchmarks.colocate", *session.posargs)
