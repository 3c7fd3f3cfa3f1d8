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
    # tests/engines/ need an engine installed: their own sessions (test-<engine>-<v>) run them.
    session.run("pytest", *(session.posargs or ["-q", "--ignore=tests/engines"]), env=env)
    if not session.posargs:  # the full suite (CI) also proves every series still applies
        session.notify("patches-check")
        for engine_session in SGLANG_TEST_SESSIONS:  # the real SGLang classes, three ways
            session.notify(engine_session)
        for engine_session in VLLM_TEST_SESSIONS:  # vLLM's tests/v1/core, three ways (~7 min)
            session.notify(engine_session)


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


# --- SGLang engine tests (tests/engines/sglang/): the real SGLang allocator, pool and radix
# cache on CPU, three ways: the pinned upstream wheel, then the forked wheel with elastic KV off
# and on. One session per pinned SGLang release that has a pinned CPU dependency list. ---
SGLANG_TESTS = ROOT / "tests" / "engines" / "sglang"


def _sglang_test_session(version: str, short: str) -> str | None:
    requirements = SGLANG_TESTS / f"requirements-{version}.txt"
    if not requirements.exists():
        return None
    name = f"test-sglang-{short}"

    def test_sglang(session: nox.Session) -> None:
        session.install("--no-deps", TORCH, "-r", str(requirements))
        session.install("--no-deps", "-e", ".")
        env = {"PYTHONHASHSEED": "0", "PYTHONPATH": str(SGLANG_TESTS / "shim")}
        pytest_args = session.posargs or ["-q", "-p", "no:cacheprovider"]
        fetch = ("python", "-m", "patchq", "fetch", "sglang", version, "wheel", "--python")
        upstream = session.run(*fetch, PYTHON, silent=True).strip().splitlines()[-1]
        session.install("--no-deps", "--force-reinstall", upstream)
        session.run(
            "pytest",
            str(SGLANG_TESTS),
            *pytest_args,
            env={**env, "KVCORE_SGLANG_EXPECT": "upstream"},
        )
        if not (ROOT / "patches" / "sglang" / version / "series").exists():
            session.log(f"no patch series for sglang {version}: upstream run only")
            return
        built = session.run(
            "python", "-m", "patchq", "build", "sglang", version, "--no-install-check", silent=True
        )
        forked = sorted(
            (ROOT / "dist").glob(f"sglang-{version}+kvcore.*-cp311-*.whl"),
            key=lambda p: p.stat().st_mtime,
        )
        if not forked:
            session.error(f"patchq build produced no forked wheel:\n{built}")
        session.install("--no-deps", "--force-reinstall", str(forked[-1]))
        session.run(
            "pytest",
            str(SGLANG_TESTS),
            *pytest_args,
            env={**env, "KVCORE_SGLANG_EXPECT": "patched"},
        )

    test_sglang.__doc__ = (
        f"SGLang {version} KV tests on CPU: upstream wheel, then forked wheel (elastic off, on)."
    )
    nox.session(name=name, python=PYTHON)(test_sglang)
    return name


SGLANG_TEST_SESSIONS = [
    s
    for rel in MATRIX
    if rel.name == "sglang"
    if (s := _sglang_test_session(rel.version, rel.short))
]


# --- vLLM engine tests (tests/engines/vllm/): the pinned release's own tests/v1/core three
# ways (upstream wheel; forked wheel with elastic KV off; forked wheel with elastic KV on),
# then kvcore's tests against the real vLLM scheduler. One session per pinned vLLM release
# that has a pinned CPU dependency list. ---
VLLM_TESTS = ROOT / "tests" / "engines" / "vllm"


def _vllm_test_session(version: str, short: str) -> str | None:
    requirements = VLLM_TESTS / f"requirements-{version}.txt"
    if not requirements.exists():
        return None
    name = f"test-vllm-{short}"

    def test_vllm(session: nox.Session) -> None:
        session.install("--no-deps", TORCH, "-r", str(requirements))
        session.install("--no-deps", "-e", ".")
        # torchvision: registry wheels link CUDA torch; an import-only stand-in (see its doc)
        env = {"PYTHONPATH": str(SGLANG_TESTS / "shim")}
        out = Path(session.create_tmp()) / f"vllm-{version}"
        suite = ("python", str(VLLM_TESTS / "upstream_suite.py"))
        fetch = ("python", "-m", "patchq", "fetch", "vllm", version, "wheel")
        wheel = str(session.run(*fetch, silent=True)).strip().splitlines()[-1]
        session.install("--no-deps", "--force-reinstall", wheel)
        runs = [str(out / "upstream.json")]
        session.run(
            *suite,
            "run",
            "--version",
            version,
            "--mode",
            "upstream",
            "--out",
            runs[0],
            *session.posargs,
            env=env,
        )
        if (ROOT / "patches" / "vllm" / version / "series").exists():
            session.run(
                "python",
                "-m",
                "patchq",
                "build",
                "vllm",
                version,
                "--no-install-check",
                silent=True,
            )
            forked = sorted(
                (ROOT / "dist").glob(f"vllm-{version}+kvcore.*.whl"),
                key=lambda p: p.stat().st_mtime,
            )
            if not forked:
                session.error("patchq build produced no forked vLLM wheel")
            session.install("--no-deps", "--force-reinstall", str(forked[-1]))
            for mode in ("elastic-off", "elastic-on"):
                runs.append(str(out / f"{mode}.json"))
                session.run(
                    *suite,
                    "run",
                    "--version",
                    version,
                    "--mode",
                    mode,
                    "--out",
                    runs[-1],
                    *session.posargs,
                    env=env,
                )
            session.run("pytest", "-q", str(VLLM_TESTS), env={**env, "PYTHONHASHSEED": "0"})
        else:
            session.log(f"no patch series for vllm {version}: upstream run only")
        session.run(*suite, "compare", *runs, env=env)

    test_vllm.__doc__ = (
        f"vLLM {version} tests/v1/core on CPU three ways (upstream, elastic off, elastic on) "
        "and kvcore's scheduler tests."
    )
    nox.session(name=name, python=PYTHON)(test_vllm)
    return name


VLLM_TEST_SESSIONS = [
    s for rel in MATRIX if rel.name == "vllm" if (s := _vllm_test_session(rel.version, rel.short))
]


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
    built = session.run(
        "python", "-m", "patchq", "build", "vllm", DEMO_VLLM, "--no-install-check", silent=True
    )
    wheel = str(built).strip().splitlines()[-1]  # patchq build prints the wheel path last
    session.install("--no-deps", "--force-reinstall", wheel)
    session.run("python", "benchmarks/colocate.py", *session.posargs)
