"""``patchq roll``: pin a new release, rebase the nearest series onto it, build, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compat import matrix
from patchq import gitcmd
from patchq.__main__ import main
from patchq.artifacts import sha256_of
from patchq.errors import ForkError, RebaseConflict, SeriesError
from patchq.fork import am_in_progress
from patchq.rebase import rebase
from patchq.roll import nearest_source, roll
from patchq.series import read
from patchq.workspace import Workspace
from tests.patchq.test_rebase import PATCHES, SEAM, _series_on_100


def _report(ws: Workspace, version: str) -> dict:
    return json.loads((ws.root / f"build/roll/toyeng-{version}/report.json").read_text())


def test_a_clean_roll_pins_the_release_builds_it_and_writes_the_report(
    ws: Workspace, index_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _series_on_100(ws)
    report = roll(ws, "toyeng", "1.0.1")
    new = matrix.find("toyeng", "1.0.1", ws.matrix_path)
    wheel = next(index_dir.glob("toyeng-1.0.1-*.whl"))
    assert new.artifact("wheel", "3.11").sha256 == sha256_of(wheel)
    assert (ws.cache.directory / wheel.name).is_file()  # fetched and verified
    assert set(new.backends) == set(matrix.BACKENDS)
    assert {b.status for b in new.backends.values()} == {"untested"}
    assert all("rolled from 1.0.0" in b.note for b in new.backends.values())
    assert read(ws.root / "patches/toyeng/1.0.1").patches == PATCHES
    assert report == _report(ws, "1.0.1")
    assert report["status"] == "done" and report["source"] == "1.0.0"
    assert [p["result"] for p in report["patches"]] == ["clean", "clean"]
    assert [p["range_diff"] for p in report["patches"]] == ["identical", "identical"]
    # core.py: one line replaced; the hook module is a new file, not an upstream line
    assert report["upstream_lines_touched"]["1.0.1"] == {
        "added": 1,
        "removed": 1,
        "new_file_lines": 1,
    }
    assert report["upstream_lines_touched"]["1.0.0"] == report["upstream_lines_touched"]["1.0.1"]
    assert Path(report["wheel"]).name.startswith("toyeng-1.0.1+kvcore.1-")
    assert Path(report["wheel"]).is_file()
    assert set(report["timings_s"]) == {"fetch", "rebase", "build"}
    assert (ws.root / "build/roll/toyeng-1.0.1/range-diff.txt").read_text().strip()
    assert not (ws.root / "forks/toyeng/1.0.1/.git/kvcore-roll.json").exists()
    err = capsys.readouterr().err
    assert "[1/3] fetching 1 artifacts" in err and "[3/3] building" in err
    assert "roll toyeng 1.0.0 -> 1.0.1: done" in err
    assert "upstream lines touched: 1.0.0: 1+/1-" in err


def test_a_conflicting_roll_stops_with_the_hunks_and_continue_finishes(ws: Workspace) -> None:
    _series_on_100(ws)
    matrix_before = ws.matrix_path.read_text()
    with pytest.raises(RebaseConflict) as err:
        roll(ws, "toyeng", "1.1.0", install_check=False)
    assert "nox -s roll -- toyeng 1.1.0 --continue" in err.value.hint
    assert "python -m patchq roll toyeng 1.1.0 --continue" in "\n".join(err.value.report)
    stopped = _report(ws, "1.1.0")
    assert stopped["status"] == "stopped"
    assert [p["result"] for p in stopped["patches"]] == ["conflict", "pending"]
    files = stopped["patches"][0]["conflict_files"]
    assert list(files) == ["toyeng/core.py"]
    assert files["toyeng/core.py"]["markers"] == [10]
    assert files["toyeng/core.py"]["hunks"][0].startswith("@@ -")
    assert ws.matrix_path.read_text() == matrix_before
    assert not (ws.root / "patches/toyeng/1.1.0").exists()
    fork = ws.root / "forks/toyeng/1.1.0"
    assert am_in_progress(fork)

    with pytest.raises(RebaseConflict):  # not resolved yet: the same stop again
        roll(ws, "toyeng", "1.1.0", resume=True, install_check=False)
    # 1.1.0 rewrote only the line the seam replaces: the patch's side is the resolution
    gitcmd.git(fork, "checkout", "--theirs", "toyeng/core.py")
    assert SEAM in (fork / "toyeng/core.py").read_text()
    gitcmd.git(fork, "add", "toyeng/core.py")

    report = roll(ws, "toyeng", "1.1.0", resume=True, install_check=False)
    assert report["status"] == "done"
    assert [p["result"] for p in report["patches"]] == ["resolved", "clean"]
    assert report["patches"][0]["range_diff"] == "changed"
    assert list(report["patches"][0]["conflict_files"]) == ["toyeng/core.py"]
    assert set(report["timings_s"]) == {"fetch", "rebase", "build"}
    assert Path(report["wheel"]).is_file()
    new = matrix.find("toyeng", "1.1.0", ws.matrix_path)
    assert {b.status for b in new.backends.values()} == {"untested"}
    assert read(ws.root / "patches/toyeng/1.1.0").patches == PATCHES
    with pytest.raises(ForkError, match="no roll to continue"):
        roll(ws, "toyeng", "1.1.0", resume=True)


def test_continue_after_the_rebase_was_finished_by_rebase_itself_builds_and_reports(
    ws: Workspace,
) -> None:
    _series_on_100(ws)
    with pytest.raises(RebaseConflict):
        roll(ws, "toyeng", "3.0.0", install_check=False)  # toyeng/core.py is gone upstream
    fork = ws.root / "forks/toyeng/3.0.0"
    gitcmd.git(fork, "am", "--skip")  # drop the seam patch; the rest replays
    rebase(ws, "toyeng", "3.0.0", resume=True)
    report = roll(ws, "toyeng", "3.0.0", resume=True, install_check=False)
    assert [p["result"] for p in report["patches"]] == ["dropped", "clean"]


def test_roll_refuses_a_pinned_release_and_an_existing_fork(ws: Workspace) -> None:
    _series_on_100(ws)
    with pytest.raises(SeriesError, match=r"pinned in compat/matrix\.toml already") as err:
        roll(ws, "toyeng", "1.0")
    assert "python -m patchq rebase toyeng 1.0.0" in err.value.hint
    (ws.root / "forks/toyeng/1.0.1").mkdir(parents=True)
    with pytest.raises(ForkError, match="exists already"):
        roll(ws, "toyeng", "1.0.1")
    assert roll(ws, "toyeng", "1.0.1", force=True, install_check=False)["status"] == "done"


def test_the_source_is_the_nearest_pinned_release_with_a_series(ws: Workspace) -> None:
    _series_on_100(ws)
    roll(ws, "toyeng", "1.0.1", install_check=False)
    assert nearest_source(ws, "toyeng", "2.0.0").version == "1.0.1"  # the nearest older one
    assert nearest_source(ws, "toyeng", "1.0.2").version == "1.0.1"
    assert nearest_source(ws, "toyeng", "0.9.0").version == "1.0.0"  # the nearest newer one
    roll(ws, "toyeng", "2.0.0", install_check=False)
    # 1.0.1 < 1.5.0 < 2.0.0: 1.0.1 differs by 0 majors, 2.0.0 by 1
    assert nearest_source(ws, "toyeng", "1.5.0").version == "1.0.1"
    assert nearest_source(ws, "toyeng", "1.9.0").version == "1.0.1"
    assert nearest_source(ws, "toyeng", "2.0.1").version == "2.0.0"


def test_the_cli_refuses_to_roll_a_release_the_matrix_pins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["roll", "vllm", "0.33.0"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "SeriesError" in err and "pinned in compat/matrix.toml already" in err
    assert "next: rebase onto it instead: python -m patchq rebase vllm 0.33.0" in err


def test_range_diff_pairs_are_read_with_the_padding_of_longer_series() -> None:
    from patchq.roll import _RANGE_PAIR

    line = " 9:  478d7ae !  9:  7ac96ce v1/engine: elastic KV resolves a layout"
    assert _RANGE_PAIR.match(line).groups() == ("9", "!", "9")  # type: ignore[union-attr]
    assert _RANGE_PAIR.match("10:  0fe0502 = 10:  8437c75 config").groups() == ("10", "=", "10")  # type: ignore[union-attr]
    assert _RANGE_PAIR.match(" 3:  0fe0502 <  -:  ------- gone").groups() == ("3", "<", "-")  # type: ignore[union-attr]
