"""Rebasing a series onto another release: clean, conflicting (report, resolve, continue)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compat import matrix
from patchq import gitcmd
from patchq.artifacts import ArtifactCache, DirectorySource, sha256_of
from patchq.check import check_release
from patchq.errors import ArtifactError, ForkError, RebaseConflict, SeriesError
from patchq.export import export
from patchq.fork import am_in_progress, materialize
from patchq.rebase import new_release, rebase
from patchq.series import read
from patchq.workspace import Workspace
from tests.patchq.conftest import PATCHED_LINE, commit_patch

SEAM = "        taken = self.allocator.take(n)  # kvcore seam\n"
PATCHES = ("0001-core-allocator-seam.patch", "0002-add-the-hook-module.patch")


def _series_on_100(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    commit_patch(fork, "toyeng/core.py", PATCHED_LINE, SEAM, "core: allocator seam")
    commit_patch(fork, "toyeng/kvcore_hook.py", "", "HOOK = None\n", "add the hook module")
    export(ws, rel)


def test_clean_rebase_writes_the_series_and_pins_the_release_as_untested(
    ws: Workspace, index_dir: Path
) -> None:
    _series_on_100(ws)
    result = rebase(ws, "toyeng", "1.0.1")
    assert result.series_dir == ws.root / "patches/toyeng/1.0.1"
    assert read(result.series_dir).patches == PATCHES
    assert result.added
    new = matrix.find("toyeng", "1.0.1", ws.matrix_path)
    wheel = next(index_dir.glob("toyeng-1.0.1-*.whl"))
    assert new.artifact("wheel", "3.11").sha256 == sha256_of(wheel)
    assert new.short == "1.0.1"  # "1.0" is taken by 1.0.0
    assert {b.status for b in new.backends.values()} == {"untested"}
    # One range-diff pair per patch, both unchanged ("=": upstream only touched util.py).
    pairs = [ln for ln in result.range_diff.splitlines() if re.match(r"^\d+:\s+\w+ [=!] ", ln)]
    assert len(pairs) == 2 and all(" = " in ln for ln in pairs), result.range_diff
    # The rebased series is a valid series of the new pinned release.
    assert check_release(ws, new) is True


def test_rebase_onto_a_pinned_release_with_a_series_needs_force(ws: Workspace) -> None:
    _series_on_100(ws)
    rebase(ws, "toyeng", "1.0.1")
    before = ws.matrix_path.read_text()
    with pytest.raises(SeriesError, match="holds a series already"):
        rebase(ws, "toyeng", "1.0.0", source="1.0.1")
    result = rebase(ws, "toyeng", "1.0.0", source="1.0.1", force=True)
    assert not result.added and ws.matrix_path.read_text() == before
    # Back on the original release the series is byte-identical: the build counter stays.
    assert read(result.series_dir).build == 1


def test_conflicting_rebase_reports_per_patch_and_writes_nothing_until_resolved(
    ws: Workspace,
) -> None:
    _series_on_100(ws)
    matrix_before = ws.matrix_path.read_text()
    with pytest.raises(RebaseConflict) as err:
        rebase(ws, "toyeng", "1.1.0")
    conflict = err.value
    assert conflict.patch == PATCHES[0]
    assert conflict.file == "toyeng/core.py"
    report = "\n".join(conflict.report)
    assert "patch 1/2 0001-core-allocator-seam.patch" in report
    assert "file toyeng/core.py: patch hunks @@ -" in report
    assert "conflict markers at lines 10" in report
    assert f"still to replay after it: {PATCHES[1]}" in report
    assert "nox -s rebase-toyeng -- 1.1.0 --continue" in report
    assert "git -C forks/toyeng/1.1.0 am --abort" in report
    # Nothing half-written: no series, matrix untouched, fork resolvable.
    assert not (ws.root / "patches/toyeng/1.1.0").exists()
    assert ws.matrix_path.read_text() == matrix_before
    fork = ws.root / "forks/toyeng/1.1.0"
    assert am_in_progress(fork)
    with pytest.raises(ForkError, match="`git am` is in progress"):
        export(ws, ws.release("toyeng", "1.0.0"), fork=fork)

    # Continuing without resolving reports the same conflict again.
    with pytest.raises(RebaseConflict, match=r"toyeng/core\.py"):
        rebase(ws, "toyeng", "1.1.0", resume=True)

    core = fork / "toyeng/core.py"
    lines = core.read_text().splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("<<<<<<<"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith(">>>>>>>"))
    lines[start : end + 1] = [SEAM]
    core.write_text("".join(lines))
    gitcmd.git(fork, "add", "toyeng/core.py")
    result = rebase(ws, "toyeng", "1.1.0", resume=True)
    assert read(result.series_dir).patches == PATCHES
    assert "!" in result.range_diff  # the seam patch changed its context
    rel = matrix.find("toyeng", "1.1.0", ws.matrix_path)
    assert check_release(ws, rel) is True


def test_continue_without_a_rebase_in_progress_says_how_to_start_one(ws: Workspace) -> None:
    with pytest.raises(ForkError, match="no rebase to continue") as err:
        rebase(ws, "toyeng", "1.0.1", resume=True)
    assert err.value.hint == "start one: nox -s rebase-toyeng -- 1.0.1"


def test_a_new_release_pins_the_file_with_the_same_tags_and_the_published_hash(
    ws: Workspace, tmp_path: Path
) -> None:
    index = tmp_path / "idx"
    index.mkdir()
    names = [
        "toyeng-2.0.0-cp38-abi3-manylinux_2_31_x86_64.whl",  # newer glibc, same kind: this one
        "toyeng-2.0.0-cp38-abi3-manylinux_2_31_aarch64.whl",
        "toyeng-2.0.0-cp312-cp312-manylinux_2_31_x86_64.whl",
        "toyeng-2.0.0.tar.gz",
        "toyeng-2.0.1-cp38-abi3-manylinux_2_31_x86_64.whl",  # another version
    ]
    for name in names:
        (index / name).write_bytes(name.encode())
    ws = Workspace(ws.root, ws.matrix_path, ArtifactCache(tmp_path / "c", DirectorySource(index)))
    src = ws.release("toyeng", "1.0.0")
    new = new_release(ws, src, "2.0")  # as typed; the entry gets the published version
    assert new.version == "2.0.0"
    art = new.artifact("wheel", "3.11")
    assert art.filename == names[0] and art.sha256 == sha256_of(index / names[0])
    assert (new.short, new.python) == ("2.0", src.python)
    (index / "toyeng-2.0.0-cp38-abi3-manylinux_2_35_x86_64.whl").write_bytes(b"twin")
    with pytest.raises(ArtifactError, match="cannot pick the wheel"):
        new_release(ws, src, "2.0.0")


def test_a_patch_follows_its_file_when_upstream_moves_it(ws: Workspace) -> None:
    _series_on_100(ws)
    result = rebase(ws, "toyeng", "2.0.0")
    patch = (result.series_dir / PATCHES[0]).read_text()
    assert "diff --git a/toyeng/pool.py b/toyeng/pool.py" in patch
    assert "- ## toyeng/core.py ##" in result.range_diff  # the review artifact shows the move
    assert "+ ## toyeng/pool.py ##" in result.range_diff


def test_a_patched_file_gone_upstream_is_reported_as_unmergeable(ws: Workspace) -> None:
    _series_on_100(ws)
    with pytest.raises(RebaseConflict) as err:
        rebase(ws, "toyeng", "3.0.0")
    report = "\n".join(err.value.report)
    assert "patch 1/2 0001-core-allocator-seam.patch" in report
    assert "file toyeng/core.py: patch hunks @@ -" in report
    assert "no merge possible (file missing or renamed in the new release?)" in report
    assert not (ws.root / "patches/toyeng/3.0.0").exists()
