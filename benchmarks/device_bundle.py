"""Pack what an engine's kvcore tests import, for a GPU machine that cannot install anything.

The GPU machine (``docs/benchmarks.md``) has Python, torch, Triton, cuda-python and pytest,
no network and no SGLang; the engine test environments here are CPU venvs on another Python.
This script runs the engine's tests once in such a venv, records every module file they
import, and writes ``<out>/bundle.tar.gz``: a ``site/`` directory to put first on
``PYTHONPATH`` there, holding

* the imported files of each pure-Python distribution (plus the non-Python files beside
  them and its ``.dist-info``, which ``importlib.metadata`` version checks read);
* for distributions with CPython-version-specific extension modules, the whole wheel for the
  target Python, fetched with ``pip download`` (the registry is reachable here);
* for the engine itself (``--engine``), every Python file of it from the venv (the forked
  wheel, patches applied: on a GPU it takes import branches the CPU run never takes), with
  each version-specific extension replaced by the target Python's build from the upstream
  wheel of the same version (SGLang's Rust radix-tree core).

Distributions the GPU machine already provides (torch and its requirements, Triton, numpy,
pytest) are left out: its own builds must be used there. ``manifest.json`` lists what went
in and from where.

    python -m benchmarks.device_bundle --venv .nox/test-sglang-0-5-23 \
        --tests tests/engines/sglang --engine sglang --python 3.12 --out .sgdev \
        --import sglang.srt.mem_cache.rust_tree_core.adapter \
        sglang.srt.mem_cache.rust_tree_core.mem_cache rich._emoji_codes \
        --data sglang/kernels/jit/include sglang/kernels/jit/csrc \
        --pythonpath tests/engines/sglang/shim

``--reuse-imports`` takes the file list recorded by the previous run (``imported.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROVIDED = {
    "torch", "triton", "numpy", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
    "filelock", "fsspec", "typing_extensions", "pytest", "pluggy", "iniconfig", "packaging",
    "setuptools", "pip", "kvcore", "nvidia",
}  # fmt: skip
"""Distributions (normalised names) the GPU machine's image provides, or the checkout does."""

_RECORDER = """
import atexit, json, os, sys
def _dump():
    files = sorted({getattr(m, "__file__", None) or "" for m in list(sys.modules.values())})
    with open(os.environ["KVCORE_BUNDLE_FILES"], "w") as f:
        json.dump([p for p in files if p], f)
atexit.register(_dump)
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        sys.exit(f"{venv}: no lib/python3*/site-packages (is it a venv?)")
    return found[0]


def _imported_files(
    venv: Path, tests: list[str], modules: list[str], env_extra: dict[str, str]
) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kvcore_bundle_recorder.py").write_text(_RECORDER)
        out = Path(tmp, "files.json")
        env = {**os.environ, **env_extra, "KVCORE_BUNDLE_FILES": str(out)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, env.get("PYTHONPATH")]))
        code = (
            "import kvcore_bundle_recorder, importlib, sys, pytest; "
            f"[importlib.import_module(m) for m in {modules!r}]; "
            f"sys.exit(pytest.main({['-q', '-p', 'no:cacheprovider', *tests]!r}))"
        )
        run = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, cwd=ROOT)
        if run.returncode not in (0, 1):  # 1: some tests failed; the imports still count
            sys.exit(f"the test run to record imports ended with {run.returncode}")
        return [Path(p) for p in json.loads(out.read_text())]


def _distributions(site: Path) -> dict[str, tuple[Path, list[str]]]:
    """File (relative to ``site``) -> (dist-info dir, RECORD paths) for every installed dist."""
    owners: dict[str, tuple[Path, list[str]]] = {}
    for info in site.glob("*.dist-info"):
        record = info / "RECORD"
        if not record.exists():
            continue
        paths = [line.split(",")[0] for line in record.read_text().splitlines() if line]
        for p in paths:
            owners[p] = (info, paths)
    return owners


def _dist_name(info: Path) -> tuple[str, str]:
    name, version = info.name[: -len(".dist-info")].split("-", 1)
    return name, version


def _download(name: str, version: str, python: str, dest: Path) -> Path:
    abi = "cp" + python.replace(".", "")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_34_x86_64",
        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
        "-d", str(dest), f"{name}=={version}", "-q",
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob(f"{_norm(name)}-{version}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        sys.exit(f"pip download {name}=={version} for Python {python}: no wheel")
    return wheels[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--venv", type=Path, required=True, help="venv with the engine and tests")
    ap.add_argument("--tests", nargs="+", required=True, help="pytest targets to record")
    ap.add_argument("--engine", required=True, help="the engine's distribution name")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (X.Y)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--import",
        dest="modules",
        nargs="*",
        default=[],
        help="modules to import besides what the tests import (lazily loaded ones)",
    )
    ap.add_argument(
        "--data",
        nargs="*",
        default=[],
        help="site-packages-relative directories to take whole (sources read at run time)",
    )
    ap.add_argument("--reuse-imports", action="store_true", help="skip the recording run")
    ap.add_argument("--pythonpath", default="", help="extra PYTHONPATH for the test run")
    args = ap.parse_args(argv)

    site = _site_packages(args.venv.resolve())
    recorded = args.out / "imported.json"
    if args.reuse_imports and recorded.exists():
        files = [Path(p) for p in json.loads(recorded.read_text())]
    else:
        env = {"PYTHONPATH": args.pythonpath}
        files = _imported_files(args.venv, args.tests, args.modules, env)
        args.out.mkdir(parents=True, exist_ok=True)
        recorded.write_text(json.dumps([str(p) for p in files]))
    owners = _distributions(site)
    staging = args.out / "site"
    wheels = args.out / "wheels"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    wheels.mkdir(exist_ok=True)

    used: dict[Path, set[str]] = {}
    for f in files:
        try:
            rel = f.resolve().relative_to(site).as_posix()
        except ValueError:
            continue  # the stdlib, the checkout
        if rel in owners:
            used.setdefault(owners[rel][0], set()).add(rel)

    manifest: dict[str, str] = {}
    this_abi = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    for info, rels in sorted(used.items()):
        name, version = _dist_name(info)
        if _norm(name) in PROVIDED:
            continue
        record = owners[next(iter(rels))][1]
        engine = _norm(name) == _norm(args.engine)
        native = [p for p in (rels if engine else record) if p.endswith(".so") and this_abi in p]
        if native and not engine:
            wheel = _download(name, version, args.python, wheels)
            with zipfile.ZipFile(wheel) as z:
                z.extractall(staging)
            manifest[name] = f"{wheel.name} (target Python's wheel)"
            continue
        keep = set(rels) | {p for p in record if p.startswith(info.name + "/")}
        if engine:  # on the GPU it takes import branches the CPU run never saw
            keep |= {p for p in record if p.endswith(".py")}
        dirs = {str(Path(p).parent) for p in rels}
        keep |= {
            p for p in record
            if str(Path(p).parent) in dirs and not p.endswith((".py", ".pyc", ".so"))
        }  # fmt: skip
        for p in sorted(keep):
            src = site / p
            if src.is_file() and "__pycache__" not in p:
                (staging / p).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, staging / p)
        manifest[name] = f"{version}: {len(rels)} imported files from {args.venv}"
        if engine and native:
            upstream_version = version.split("+", 1)[0]
            wheel = _download(name, upstream_version, args.python, wheels)
            with zipfile.ZipFile(wheel) as z:
                for p in native:
                    target_name = p.replace(this_abi, "cpython-" + args.python.replace(".", ""))
                    if target_name in z.namelist():
                        (staging / target_name).write_bytes(z.read(target_name))
                        manifest[target_name] = f"from {wheel.name}"
    for data in args.data:
        src = site / data
        if not src.is_dir():
            sys.exit(f"--data {data}: no such directory in {site}")
        shutil.copytree(src, staging / data, dirs_exist_ok=True)
        manifest[data] = "whole directory (--data)"
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    bundle = args.out / "bundle.tar.gz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(staging, arcname="site")
    print(f"{bundle}: {bundle.stat().st_size / 2**20:.1f} MiB, {len(manifest)} entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
