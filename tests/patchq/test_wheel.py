"""The forked wheel: upstream wheel + the fork's sources, local version, installable."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import venv
import zipfile
from pathlib import Path

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


def _deps_env(path: Path, module_source: str) -> Path:
    """A venv whose site-packages holds ``toy_dep.py`` (the engine's "dependency")."""
    venv.create(path, with_pip=False)
    site = next(path.glob("lib/python*/site-packages"))
    (site / "toy_dep.py").write_text(module_source)
    return path


def test_changed_modules_import_for_real_when_a_deps_env_is_given(
    ws: Workspace, tmp_path: Path
) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", '"""The toy', 'import toy_dep\n"""The toy', "core: dep")
    export(ws, rel)
    wheel = build(ws, rel, install_check=False)
    version = "1.0.0+kvcore.1"
    # Without the dependencies: reported, not failed (byte identity and compile still checked).
    notes = verify_install(wheel, rel, fork, version)
    assert notes == ["toyeng.core: not importable without its dependencies (toy_dep)"]
    good = _deps_env(tmp_path / "deps", "VALUE = 1\n")
    assert verify_install(wheel, rel, fork, version, deps_env=good) == []
    broken = _deps_env(tmp_path / "broken", "raise RuntimeError('dependency broken')\n")
    with pytest.raises(BuildError, match=r"importing toyeng\.core fails: RuntimeError"):
        verify_install(wheel, rel, fork, version, deps_env=broken)
