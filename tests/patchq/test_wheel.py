"""The forked wheel: upstream wheel + the fork's sources, local version, installable."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest

from patchq.errors import BuildError
from patchq.export import export
from patchq.fork import materialize
from patchq.wheel import _record_text, build, verify_install
from patchq.workspace import Workspace
from tests.patchq.conftest import PATCHED_LINE, commit_patch

SEAM = "        taken = self.allocator.take(n)  # kvcore seam\n"


def _members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        assert zf.testzip() is None  # every member's CRC checks out
        return {i.filename: zf.read(i) for i in zf.infolist()}


def _assert_record_matches(members: dict[str, bytes], dist_info: str) -> None:
    rows = csv.reader(io.StringIO(members[f"{dist_info}/RECORD"].decode()))
    listed = {name: (digest, size) for name, digest, size in rows}
    assert set(listed) == set(members)
    for name, (digest, size) in listed.items():
        if name.endswith("RECORD"):
            assert (digest, size) == ("", "")
            continue
        raw = hashlib.sha256(members[name]).digest()
        assert digest == "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        assert int(size) == len(members[name])


def test_record_quotes_paths_that_hold_a_comma() -> None:
    # pip parses RECORD as CSV: an unquoted comma in a file name splits the row.
    rows = [("pkg/a,b.json", "sha256=x", "3"), ('pkg/q"uote.py', "sha256=y", "4")]
    assert list(csv.reader(io.StringIO(_record_text(rows)))) == [list(r) for r in rows]


def test_empty_series_gives_the_upstream_wheel_with_only_the_version_changed(
    ws: Workspace,
) -> None:
    rel = ws.release("toyeng", "1.0.0")
    wheel = build(ws, rel)
    assert wheel == ws.dist_dir / "toyeng-1.0.0+kvcore.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    upstream = _members(ws.cache.fetch(rel, "wheel", "3.11"))
    forked = _members(wheel)
    renamed = {
        n.replace("toyeng-1.0.0.", "toyeng-1.0.0+kvcore.0.", 1): d for n, d in upstream.items()
    }
    assert set(forked) == set(renamed)
    differ = {n for n in forked if forked[n] != renamed[n]}
    assert differ == {
        "toyeng-1.0.0+kvcore.0.dist-info/METADATA",
        "toyeng-1.0.0+kvcore.0.dist-info/RECORD",
    }
    assert b"Version: 1.0.0+kvcore.0\n" in forked["toyeng-1.0.0+kvcore.0.dist-info/METADATA"]
    # The release's WHEEL file (and its own tag line) is kept as shipped.
    assert (
        forked["toyeng-1.0.0+kvcore.0.dist-info/WHEEL"] == upstream["toyeng-1.0.0.dist-info/WHEEL"]
    )
    _assert_record_matches(forked, "toyeng-1.0.0+kvcore.0.dist-info")


def test_series_build_swaps_in_patched_sources_and_installs_with_the_local_version(
    ws: Workspace,
) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", PATCHED_LINE, SEAM, "core: allocator seam")
    commit_patch(fork, "toyeng/kvcore_hook.py", "", "HOOK = None\n", "add the hook module")
    export(ws, rel)
    wheel = build(ws, rel)  # includes the fresh-venv install check
    assert wheel.name.startswith("toyeng-1.0.0+kvcore.1-cp38-abi3-manylinux_2_28_x86_64")
    members = _members(wheel)
    assert members["toyeng/core.py"] == (fork / "toyeng/core.py").read_bytes()
    assert members["toyeng/kvcore_hook.py"] == b"HOOK = None\n"
    assert members["toyeng/_native.abi3.so"].startswith(b"\x7fELF")  # the release's binary
    with zipfile.ZipFile(wheel) as zf:  # modes and dates of untouched members are upstream's
        script = zf.getinfo("toyeng-1.0.0+kvcore.1.data/scripts/toyeng-serve")
        assert (script.external_attr >> 16) & 0o777 == 0o755
        assert script.date_time == (2024, 1, 2, 3, 4, 6)
    _assert_record_matches(members, "toyeng-1.0.0+kvcore.1.dist-info")
    # Same series, same bytes.
    first = wheel.read_bytes()
    assert build(ws, rel, install_check=False).read_bytes() == first


def test_install_check_catches_a_wheel_that_differs_from_the_fork(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", PATCHED_LINE, SEAM, "core: allocator seam")
    upstream = ws.cache.fetch(rel, "wheel", "3.11")
    with pytest.raises(BuildError) as err:
        verify_install(upstream, rel, fork, "1.0.0")
    assert err.value.file == "toyeng/core.py"


def test_a_patched_module_that_does_not_compile_fails_the_build(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", PATCHED_LINE, "        taken = (\n", "core: broken")
    export(ws, rel)
    with pytest.raises(BuildError, match="does not compile"):
        build(ws, rel)


def _toy_wheel_needing_a_dep(ws: Workspace) -> tuple[Any, Path, Path]:
    """The toy engine's release, fork and forked wheel, its ``toyeng.core`` made to import
    ``toy_dep`` (a third-party dependency the fresh venv lacks)."""
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", '"""The toy', 'import toy_dep\n"""The toy', "core: dep")
    export(ws, rel)
    return rel, fork, build(ws, rel, install_check=False)


def _deps_env(path: Path, module_source: str) -> Path:
    """A venv whose site-packages holds ``toy_dep.py`` (the engine's "dependency")."""
    venv.create(path, with_pip=False)
    site = next(path.glob("lib/python*/site-packages"))
    (site / "toy_dep.py").write_text(module_source)
    return path


def test_changed_modules_import_for_real_when_a_deps_env_is_given(
    ws: Workspace, tmp_path: Path
) -> None:
    rel, fork, wheel = _toy_wheel_needing_a_dep(ws)
    version = "1.0.0+kvcore.1"
    # Without the dependencies: reported, not failed (byte identity and compile still checked).
    notes = verify_install(wheel, rel, fork, version)
    assert notes == ["toyeng.core: not importable without its dependencies (toy_dep)"]
    good = _deps_env(tmp_path / "deps", "VALUE = 1\n")
    assert verify_install(wheel, rel, fork, version, deps_env=good) == []
    broken = _deps_env(tmp_path / "broken", "raise RuntimeError('dependency broken')\n")
    with pytest.raises(BuildError, match=r"importing toyeng\.core fails: RuntimeError"):
        verify_install(wheel, rel, fork, version, deps_env=broken)


def test_a_failed_import_does_not_poison_the_next_modules_check(
    ws: Workspace, tmp_path: Path
) -> None:
    # SGLang 0.5.23's shape: the package's __init__ imports a namespace subpackage, then fails
    # on a missing dependency. Python drops ``toyeng`` from sys.modules but keeps ``toyeng.ns``,
    # so in one process every later ``toyeng.ns.*`` import dies with ``KeyError: 'toyeng'`` (or
    # passes from sys.modules without running). Each module is checked in its own process.
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    init = '__version__ = "1.0.0"\n'
    commit_patch(
        fork, "toyeng/__init__.py", init, f"{init}import toyeng.ns.base\nimport toy_dep\n", "init"
    )
    commit_patch(fork, "toyeng/ns/base.py", "", "BASE = 1\n", "add ns.base")
    commit_patch(
        fork, "toyeng/ns/second.py", "", "from toyeng.ns.base import BASE\n", "add ns.second"
    )
    export(ws, rel)
    wheel = build(ws, rel, install_check=False)
    version = "1.0.0+kvcore.1"
    notes = verify_install(wheel, rel, fork, version)
    assert notes == [
        f"{m}: not importable without its dependencies (toy_dep)"
        for m in ("toyeng", "toyeng.ns.base", "toyeng.ns.second")
    ]
    broken = _deps_env(tmp_path / "broken", "raise RuntimeError('dependency broken')\n")
    with pytest.raises(BuildError) as err:
        verify_install(wheel, rel, fork, version, deps_env=broken)
    message = str(err.value)  # the first module, its real cause and where it was raised
    assert "importing toyeng fails: RuntimeError: dependency broken" in message
    assert "toy_dep.py" in message and "KeyError" not in message


def test_a_deps_env_missing_a_package_names_it_and_the_module(
    ws: Workspace, tmp_path: Path
) -> None:
    rel, fork, wheel = _toy_wheel_needing_a_dep(ws)
    empty = tmp_path / "empty"
    venv.create(empty, with_pip=False)
    with pytest.raises(BuildError) as err:
        verify_install(wheel, rel, fork, "1.0.0+kvcore.1", deps_env=empty)
    message = " ".join(str(err.value).split())
    assert "importing toyeng.core fails: ModuleNotFoundError: No module named 'toy_dep'" in message
    assert f"install toy_dep's distribution into {empty}" in message


def test_the_install_check_of_another_python_fails_when_that_python_is_missing(
    ws: Workspace,
) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    wheel = build(ws, rel, install_check=False)
    with pytest.raises(BuildError, match=r"needs a working python3\.99 on PATH") as err:
        verify_install(wheel, rel, fork, "1.0.0+kvcore.0", python="3.99")
    assert "--no-install-check" in str(err.value)  # never a silent skip


def _python312() -> Path | None:
    """A directory holding a working ``python3.12`` (PATH, else a pyenv install)."""
    candidates: list[str | Path | None] = [
        shutil.which("python3.12"),
        *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")),
    ]
    for exe in candidates:
        if exe is None:
            continue
        ok = subprocess.run([str(exe), "-c", "pass"], capture_output=True, check=False)
        if ok.returncode == 0:
            return Path(exe).parent
    return None


PY312 = _python312()


@pytest.mark.skipif(PY312 is None, reason="needs a python3.12")
def test_the_install_check_runs_under_the_chosen_python(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{PY312}:{os.environ['PATH']}")
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", '"""The toy', 'import toy_dep\n"""The toy', "core: dep")
    export(ws, rel)
    wheel = build(ws, rel, python="3.12", install_check=False)  # abi3: the same wheel
    # The changed module imports toy_dep, which asserts the interpreter it runs under.
    deps = tmp_path / "deps312"
    subprocess.run(["python3.12", "-m", "venv", "--without-pip", str(deps)], check=True)
    site = next(deps.glob("lib/python3.12/site-packages"))
    (site / "toy_dep.py").write_text("import sys\nassert sys.version_info[:2] == (3, 12)\n")
    version = "1.0.0+kvcore.1"
    assert verify_install(wheel, rel, fork, version, deps_env=deps, python="3.12") == []
    with pytest.raises(BuildError, match="AssertionError"):  # the same env under 3.11 fails
        verify_install(wheel, rel, fork, version, deps_env=deps, python="3.11")
