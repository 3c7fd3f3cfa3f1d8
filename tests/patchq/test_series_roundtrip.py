"""Materialize a fork from a pinned release, export its commits, re-apply, check."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from patchq import gitcmd
from patchq.check import check_all, check_release
from patchq.errors import ApplyError, ExportMismatch, ForkError, SeriesError
from patchq.export import export
from patchq.fork import UPSTREAM_REF, base_ref, materialize
from patchq.series import missing_trailers, read
from patchq.workspace import Workspace
from tests.patchq.conftest import PATCHED_LINE, commit_patch, matrix_entry, release_sources


def _seam_patches(fork: Path) -> None:
    commit_patch(
        fork,
        "toyeng/core.py",
        PATCHED_LINE,
        "        taken = self.allocator.take(n)  # kvcore seam\n",
        "core: ask an allocator for new blocks",
    )
    commit_patch(fork, "toyeng/kvcore_hook.py", "", "HOOK = None\n", "add the kvcore hook module")


def test_fork_base_is_the_wheels_package_sources_with_a_reproducible_id(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0")
    fork = materialize(ws, rel)
    assert fork == ws.root / "forks/toyeng/1.0.0"
    tracked = set(gitcmd.out(fork, "ls-files").splitlines())
    # Sources only: no compiled extension, no binary data, no dist-info or .data dir.
    assert tracked == set(release_sources("1.0.0"))
    for name, text in release_sources("1.0.0").items():
        assert (fork / name).read_text() == text
    base = gitcmd.out(fork, "rev-parse", UPSTREAM_REF)
    assert gitcmd.out(fork, "rev-parse", base_ref("1.0.0")) == base
    assert gitcmd.out(fork, "rev-parse", "HEAD") == base
    again = materialize(ws, rel, dest=ws.root / "elsewhere")
    assert gitcmd.out(again, "rev-parse", "HEAD") == base


def test_export_then_materialize_round_trips_byte_for_byte(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    head = gitcmd.out(fork, "rev-parse", "HEAD")
    series_dir = export(ws, rel)
    series = read(series_dir)
    assert series.patches == (
        "0001-core-ask-an-allocator-for-new-blocks.patch",
        "0002-add-the-kvcore-hook-module.patch",
    )
    assert series.build == 1
    first = series.paths()[0].read_text()
    assert first.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] core: ask an allocator" in first
    assert "index " in first and " | " not in first  # full index, no diffstat
    assert not first.rstrip().endswith(gitcmd.out(fork, "version").split()[-1])  # no signature
    committed = {p.name: p.read_bytes() for p in series_dir.iterdir()}

    refork = materialize(ws, rel, force=True)
    # Same patches, same fixed committer: the same commits.
    assert gitcmd.out(refork, "rev-parse", "HEAD") == head
    export(ws, rel)
    assert {p.name: p.read_bytes() for p in series_dir.iterdir()} == committed
    assert check_release(ws, rel) is True


def test_export_bumps_the_build_number_only_when_patches_change(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    assert read(export(ws, rel)).build == 1
    assert read(export(ws, rel)).build == 1
    commit_patch(fork, "toyeng/util.py", "max(lo", "max(lo ", "util: spacing")
    assert read(export(ws, rel)).build == 2


def test_export_refuses_a_patch_without_trailers_and_writes_nothing(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    export(ws, rel)
    before = {p.name: p.read_bytes() for p in ws.series_dir(rel).iterdir()}
    commit_patch(fork, "toyeng/util.py", "max(lo", "max(lo ", "util: no reasons", trailers=False)
    with pytest.raises(SeriesError, match="lacks Why:, Upstream:, Drop-when:") as err:
        export(ws, rel)
    assert err.value.patch == "0003-util-no-reasons.patch"
    assert "git commit --amend" in err.value.hint
    assert {p.name: p.read_bytes() for p in ws.series_dir(rel).iterdir()} == before


def test_export_refuses_uncommitted_edits(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    (fork / "toyeng/util.py").write_text("edited\n")
    with pytest.raises(ForkError, match="not committed"):
        export(ws, rel)
    assert not ws.series_dir(rel).exists()


def test_materialize_refuses_to_overwrite_a_fork(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    materialize(ws, rel)
    with pytest.raises(ForkError, match="exists already") as err:
        materialize(ws, rel)
    assert "python -m patchq export toyeng 1.0.0" in err.value.hint


def test_check_says_there_is_nothing_to_check_without_a_series(ws: Workspace) -> None:
    assert check_all(ws) == {"toyeng 1.0.0": False}


def test_check_refuses_a_hand_edited_patch_that_applies_at_an_offset(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    path = export(ws, rel) / "0001-core-ask-an-allocator-for-new-blocks.patch"
    text = path.read_text()
    header = next(line for line in text.splitlines() if line.startswith("@@ "))
    old_start = header.split()[1]  # "-7,7"
    line_no = int(old_start[1:].split(",")[0])
    shifted = header.replace(f"-{line_no},", f"-{line_no + 2},").replace(
        f"+{line_no},", f"+{line_no + 2},"
    )
    path.write_text(text.replace(header, shifted))
    with pytest.raises(ExportMismatch) as err:
        check_release(ws, rel)
    assert err.value.patch == path.name
    assert "python -m patchq materialize toyeng 1.0.0 --force" in err.value.hint


def test_check_refuses_a_series_naming_a_missing_or_omitting_a_patch(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    directory = export(ws, rel)
    (directory / "0002-add-the-kvcore-hook-module.patch").rename(directory / "stray.patch")
    with pytest.raises(SeriesError, match="does not exist"):
        check_release(ws, rel)
    series = (directory / "series").read_text()
    (directory / "series").write_text(series.replace("0002-add-the-kvcore-hook-module", "stray"))
    (directory / "extra.patch").write_text("x")
    with pytest.raises(SeriesError, match=r"does not list: extra\.patch"):
        check_release(ws, rel)


@pytest.mark.parametrize(
    "entry", ["../outside/0001-x.patch", "sub/0001-x.patch", "/tmp/0001-x.patch", "notes.txt"]
)
def test_a_series_entry_that_is_not_a_plain_patch_name_is_refused(
    tmp_path: Path, entry: str
) -> None:
    """``build`` applies what ``read`` returns: an entry reaching outside the series'
    directory must be refused there, not only by ``check``."""
    directory = tmp_path / "patches" / "toyeng" / "1.0.0"
    directory.mkdir(parents=True)
    outside = (directory / entry).resolve()
    if not entry.startswith("/"):
        outside.parent.mkdir(parents=True, exist_ok=True)
        outside.write_text("x")
    (directory / "series").write_text(entry + "\n")
    with pytest.raises(SeriesError, match="plain"):
        read(directory)


def test_patch_files_never_contain_compiled_members(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    wheel = ws.cache.fetch(rel, "wheel", "3.11")
    with zipfile.ZipFile(wheel) as zf:
        assert "toyeng/_native.abi3.so" in zf.namelist()
    fork = materialize(ws, rel)
    assert not (fork / "toyeng/_native.abi3.so").exists()
    assert not (fork / "toyeng/weights.bin").exists()


def test_check_refuses_a_series_that_only_a_three_way_merge_would_apply(
    ws: Workspace, index_dir: Path
) -> None:
    # A util.py patch written on 1.0.0 (hunk at the end of the file), committed as the series
    # of 1.0.1, where upstream appended a function: a rebase would merge it, check must not.
    wheel = next(index_dir.glob("toyeng-1.0.1-*.whl"))
    ws.matrix_path.write_text(ws.matrix_path.read_text() + matrix_entry(wheel, "1.0.1", "1.0.1"))
    old, new = ws.release("toyeng", "1.0.0"), ws.release("toyeng", "1.0.1")
    fork = materialize(ws, old)
    commit_patch(fork, "toyeng/util.py", "max(lo", "max(lo ", "util: spacing")
    export(ws, old)
    shutil.copytree(ws.series_dir(old), ws.series_dir(new))
    with pytest.raises(ApplyError, match="does not apply to the pinned release") as err:
        check_release(ws, new)
    assert err.value.patch == "0001-util-spacing.patch"
    assert err.value.version == "1.0.1"


def test_check_refuses_a_patch_whose_context_was_edited_by_hand(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    path = export(ws, rel) / "0001-core-ask-an-allocator-for-new-blocks.patch"
    context = "\n         self.free = list(range(num_blocks))\n"
    assert context in path.read_text()
    path.write_text(path.read_text().replace(context, "\n         self.free = []\n"))
    with pytest.raises(ApplyError) as err:
        check_release(ws, rel)
    assert err.value.patch == path.name
    assert "python -m patchq materialize toyeng 1.0.0 --force" in err.value.hint


@pytest.mark.parametrize(
    ("body", "missing"),
    [
        ("Why: seam\nUpstream: https://github.com/o/r/pull/1\nDrop-when: merged\n", []),
        ("Why: seam\nUpstream: not-suitable: kvcore only\nDrop-when: never\n", []),
        ("Upstream: not-suitable: x\nDrop-when: y\n", ["Why:"]),
        ("Why:\nUpstream: not-suitable: x\nDrop-when: y\n", ["Why:"]),
        ("Why: a\nUpstream: maybe later\nDrop-when: y\n", ["Upstream: ('maybe later' is"]),
        ("Why: a\nUpstream: not-suitable:\nDrop-when: y\n", ["Upstream: ('not-suitable:' is"]),
        ("Why: a\n", ["Upstream:", "Drop-when:"]),
    ],
)
def test_trailer_rules(body: str, missing: list[str]) -> None:
    patch = (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: a <a@b>\nSubject: [PATCH] x\n\n" + body + "---\n"
        "diff --git a/x b/x\n+Why: in the diff does not count\n"
    )
    found = missing_trailers(patch)
    assert len(found) == len(missing)
    for got, want in zip(found, missing, strict=True):
        assert got.startswith(want)


def test_check_refuses_a_series_of_a_release_the_matrix_does_not_pin(ws: Workspace) -> None:
    stray = ws.root / "patches/toyeng/9.9.9"
    stray.mkdir(parents=True)
    (stray / "series").write_text("# kvcore-build: 1\n")
    with pytest.raises(SeriesError, match="does not pin") as err:
        check_all(ws)
    assert err.value.version == "9.9.9"


def test_export_needs_a_fork(ws: Workspace) -> None:
    with pytest.raises(ForkError, match="no fork at") as err:
        export(ws, ws.release("toyeng", "1.0.0"))
    assert err.value.hint == "python -m patchq materialize toyeng 1.0.0"


def test_a_patch_adding_a_symlink_or_a_file_outside_the_package_is_refused(
    ws: Workspace,
) -> None:
    """A symlink's target bytes would land in the forked wheel, a top-level ``.pth`` would
    run at every interpreter start: export refuses both, naming the patch."""
    rel = ws.release("toyeng", "1.0.0")
    fork = materialize(ws, rel)
    _seam_patches(fork)
    (fork / "toyeng" / "hostname").symlink_to("/etc/hostname")
    gitcmd.git(fork, "add", "toyeng/hostname")
    body = "Why: x.\nUpstream: not-suitable: x\nDrop-when: never.\n"
    gitcmd.git(fork, "commit", "-q", "-m", f"link\n\n{body}", author_date=True)
    with pytest.raises(SeriesError, match="symlink"):
        export(ws, rel)
    gitcmd.git(fork, "reset", "-q", "--hard", "HEAD~1")
    commit_patch(fork, "evil.pth", "", "import os\n", "a startup hook")
    with pytest.raises(SeriesError, match=r"outside the release's package toyeng/"):
        export(ws, rel)
