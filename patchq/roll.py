"""Rolling the series to a release the matrix does not pin yet, in one command.

``roll(ws, engine, version)``:

1. picks the source series: the pinned release of ``engine`` with a series nearest to
   ``version`` (smallest difference of the release numbers, major first; the newer one on a
   tie);
2. finds the new release's files matching the source's pinned artifacts on the index
   (``rebase.new_release``) and downloads and sha256-verifies each of them
   (``ArtifactCache.fetch_artifact``);
3. rebases the series (``rebase.rebase``): ``patches/<engine>/<version>/`` is written and the
   release appended to ``compat/matrix.toml``, every backend ``untested``, noted as rolled;
4. builds the forked wheel into ``dist/`` (``wheel.build``, install check unless told not to);
5. writes ``build/roll/<engine>-<version>/report.json`` (and ``range-diff.txt``) and prints a
   table: per patch applied cleanly / resolved by hand / conflict (with the hunks) / dropped,
   how it compares in the range-diff, the upstream lines it touches; upstream lines touched by
   the source and the new series; the phases' wall times.

A conflict stops the roll with the fork in rebase's ``git am`` state and the report written
(``status: "stopped"``); after a hand fix ``roll(..., resume=True)`` (``--continue``) finishes
the rebase, builds and reports. The roll's own state (source, stops so far, timings) is kept in
the fork's ``.git/kvcore-roll.json`` next to rebase's.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from packaging.version import Version
from rich.table import Table

from compat import matrix as compat_matrix
from compat.matrix import EngineRelease
from patchq.console import console, info
from patchq.errors import ForkError, RebaseConflict, SeriesError
from patchq.rebase import commands, in_progress, new_release, range_diff, rebase, saved_state
from patchq.series import lines_touched, message_of, read
from patchq.wheel import build
from patchq.workspace import Workspace

_STATE = "kvcore-roll.json"  # rebase.saved_state(..., via="roll") reads it
# " 1:  0123abc =  1:  4567def subject" (and "-:  ------- > 2: ..." for an added patch)
_RANGE_PAIR = re.compile(r"^\s*(\d+|-):\s+\S+ ([=!<>])\s+(\d+|-):\s+\S+ ")
_COMPARED = {"=": "identical", "!": "changed", "<": "dropped", ">": "added"}


def nearest_source(ws: Workspace, engine: str, version: str) -> EngineRelease:
    """The pinned release of ``engine`` with a series nearest to ``version``: of the nearest
    older and the nearest newer one, the one whose release numbers differ less (major first;
    the newer one on a tie). Raises ``SeriesError`` when no release of ``engine`` has one."""
    want = Version(version)
    candidates = [
        rel
        for rel in ws.releases()
        if rel.name == engine and Version(rel.version) != want and read(ws.series_dir(rel)).exists
    ]
    if not candidates:
        raise SeriesError(
            "no pinned release of this engine has a series to roll from",
            engine=engine,
            version=version,
            hint=f"write one first (python -m patchq materialize/export {engine} ...)",
        )
    older = [rel for rel in candidates if Version(rel.version) < want]
    newer = [rel for rel in candidates if Version(rel.version) > want]
    neighbours = [max(older, key=_version)] if older else []
    neighbours += [min(newer, key=_version)] if newer else []

    def distance(rel: EngineRelease) -> tuple[tuple[int, ...], bool]:
        have, target = (*_version(rel).release, 0, 0), (*want.release, 0, 0)
        diff = tuple(abs(a - b) for a, b in zip(have[:3], target[:3], strict=True))
        return diff, _version(rel) < want

    return min(neighbours, key=distance)


def _version(rel: EngineRelease) -> Version:
    return Version(rel.version)


def _report_dir(ws: Workspace, engine: str, version: str) -> Path:
    return ws.root / "build" / "roll" / f"{engine}-{version}"


def _save(fork: Path, state: dict[str, Any]) -> None:
    (fork / ".git" / _STATE).write_text(json.dumps(state, indent=1))


def _record_stop(state: dict[str, Any], exc: RebaseConflict) -> None:
    stops = [s for s in state["stops"] if s["index"] != exc.index]
    stops.append({"index": exc.index, "patch": exc.patch, "files": exc.files})
    state["stops"] = stops


def _patch_rows(
    ws: Workspace, state: dict[str, Any], series_dir: Path | None, diff: str
) -> list[dict[str, Any]]:
    """One row per patch of the source series: its result and, once rebased, its lines."""
    src = ws.release(state["engine"], state["source"])
    source = read(ws.series_dir(src))
    rebased = read(series_dir) if series_dir is not None else None
    compared = {}  # source index -> how the range-diff compares it
    for line in diff.splitlines():
        if (match := _RANGE_PAIR.match(line)) and match.group(1) != "-":
            compared[int(match.group(1))] = _COMPARED[match.group(2)]
    # a patch is matched to its rebased self by subject (`git am` keeps it; the file name
    # is renumbered when one before it is dropped)
    by_subject = {_subject(p): p.name for p in rebased.paths()} if rebased else {}
    stops = {s["index"]: s for s in state["stops"]}
    stopped_at = max(stops) if stops and rebased is None else None
    rows = []
    for index, name in enumerate(source.patches, 1):
        row: dict[str, Any] = {"index": index, "patch": name}
        rebased_as = by_subject.get(_subject(source.directory / name))
        if rebased is None and stopped_at is not None and index > stopped_at:
            row["result"] = "pending"
        elif rebased is None and index == stopped_at:
            row["result"] = "conflict"
        elif rebased is not None and rebased_as is None:
            row["result"] = "dropped"
        else:
            row["result"] = "resolved" if index in stops else "clean"
        if index in stops:
            row["conflict_files"] = stops[index]["files"]
        if index in compared:
            row["range_diff"] = compared[index]
        if rebased is not None and rebased_as is not None:
            row["rebased_as"] = rebased_as
            patch = rebased.directory / rebased_as
            row["lines"] = lines_touched(patch.read_text(errors="replace"))
        row["source_lines"] = lines_touched((source.directory / name).read_text(errors="replace"))
        rows.append(row)
    return rows


def _subject(patch: Path) -> str:
    return message_of(patch.read_text(errors="replace")).split("\n", 1)[0]


def _totals(rows: list[dict[str, Any]], key: str) -> dict[str, int]:
    total = {"added": 0, "removed": 0, "new_file_lines": 0}
    for row in rows:
        for name, count in row.get(key, {}).items():
            total[name] += count
    return total


def _write_report(
    ws: Workspace,
    state: dict[str, Any],
    *,
    status: str,
    series_dir: Path | None = None,
    diff: str = "",
    wheel: Path | None = None,
    conflict: RebaseConflict | None = None,
) -> dict[str, Any]:
    engine, version, source = state["engine"], state["version"], state["source"]
    rows = _patch_rows(ws, state, series_dir, diff)
    upstream = {source: _totals(rows, "source_lines")}
    if series_dir is not None:
        upstream[version] = _totals(rows, "lines")
    report = {
        "engine": engine,
        "version": version,
        "source": source,
        "status": status,
        "artifacts": state["artifacts"],
        "patches": rows,
        "upstream_lines_touched": upstream,
        "range_diff": diff,
        "wheel": str(wheel) if wheel else None,
        "timings_s": state["timings"],
        "wall_s": round(sum(state["timings"].values()), 1),
        "since_start_s": round(time.time() - state["started"], 1),
    }
    if conflict is not None:
        report["conflict"] = conflict.report
    out = _report_dir(ws, engine, version)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "range-diff.txt").write_text(diff + "\n" if diff else "")
    _print_table(report, out)
    return report


def _print_table(report: dict[str, Any], out: Path) -> None:
    engine, version, source = report["engine"], report["version"], report["source"]
    table = Table(title=f"roll {engine} {source} -> {version}: {report['status']}")
    table.add_column("patch", no_wrap=True, overflow="ellipsis", max_width=30)  # full: JSON
    table.add_column("result", no_wrap=True)
    table.add_column("range-diff", no_wrap=True)
    table.add_column(f"on {version}", no_wrap=True)
    table.add_column("conflicts in", overflow="fold")
    for row in report["patches"]:
        lines = row.get("lines")
        table.add_row(
            row["patch"].removesuffix(".patch"),
            row["result"],
            row.get("range_diff", ""),
            f"{lines['added']}+/{lines['removed']}-" if lines else "",
            ", ".join(Path(f).name for f in row.get("conflict_files", {})),
        )
    console.print(table)
    touched = "; ".join(
        f"{v}: {t['added']}+/{t['removed']}-"
        + (f" (and {t['new_file_lines']} lines of new files)" if t["new_file_lines"] else "")
        for v, t in report["upstream_lines_touched"].items()
    )
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in report["timings_s"].items())
    info(f"upstream lines touched: {touched}")
    info(f"wall time {report['wall_s']:.1f} s ({timings}); report: {out / 'report.json'}")


class _Timer:
    """Adds each phase's wall time to ``state["timings"]`` (a resumed phase accumulates)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def phase(self, name: str, start: float) -> None:
        timings = self.state["timings"]
        timings[name] = round(timings.get(name, 0.0) + time.monotonic() - start, 1)


def roll(
    ws: Workspace,
    engine: str,
    version: str,
    *,
    resume: bool = False,
    force: bool = False,
    install_check: bool = True,
) -> dict[str, Any]:
    """Roll ``engine``'s series to the unpinned release ``version`` (see the module
    docstring) and return the report. Raises ``SeriesError`` when the release is pinned
    already, ``RebaseConflict`` when the rebase stops (report written; continue with
    ``resume``), ``ForkError`` for an existing fork without ``force`` or nothing to resume, and
    the errors of ``rebase`` and ``build``."""
    if resume:
        return _resume(ws, engine, version, install_check)
    try:
        pinned = ws.release(engine, version)
    except compat_matrix.MatrixError:
        pinned = None
    if pinned is not None:
        raise SeriesError(
            "is pinned in compat/matrix.toml already: roll adds a release the matrix does not pin",
            engine=engine,
            version=pinned.version,
            hint=f"rebase onto it instead: {commands('rebase', engine, pinned.version)[1]}",
        )
    started, clock = time.time(), time.monotonic()
    src = nearest_source(ws, engine, version)
    tgt = new_release(ws, src, version, via="roll")
    fork = ws.root / "forks" / engine / tgt.version
    if fork.exists() and not force:
        raise ForkError(
            f"{fork} exists already",
            engine=engine,
            version=tgt.version,
            hint=f"finish it: {commands('roll', engine, tgt.version)[1]} --continue; or start "
            "over with --force",
        )
    info(f"roll {engine} {tgt.version}: source series {src.version} (nearest pinned with one)")
    state: dict[str, Any] = {
        "engine": engine,
        "version": tgt.version,
        "source": src.version,
        "started": started,
        "stops": [],
        "timings": {},
        "artifacts": [
            {"kind": a.kind, "filename": a.filename, "sha256": a.sha256} for a in tgt.artifacts
        ],
    }
    timer = _Timer(state)
    info(f"[1/3] fetching {len(tgt.artifacts)} artifacts of {engine} {tgt.version}")
    for art in tgt.artifacts:
        path = ws.cache.fetch_artifact(tgt, art)
        info(f"  {art.kind} {art.filename}: sha256 {art.sha256[:16]}... verified ({path})")
    timer.phase("fetch", clock)
    return _rebase_and_build(ws, state, fork, install_check, force=force)


def _rebase_and_build(
    ws: Workspace,
    state: dict[str, Any],
    fork: Path,
    install_check: bool,
    *,
    resume: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    engine, version, timer = state["engine"], state["version"], _Timer(state)
    clock = time.monotonic()
    rebased = None
    if not resume or in_progress(fork):
        info(f"[2/3] rebasing the {state['source']} series onto {version}")
        try:
            rebased = rebase(
                ws,
                engine,
                version,
                source=state["source"],
                resume=resume,
                force=force,
                via="roll",
            )
        except RebaseConflict as exc:
            timer.phase("rebase", clock)
            _record_stop(state, exc)
            _save(fork, state)
            _write_report(ws, state, status="stopped", conflict=exc)
            raise
    timer.phase("rebase", clock)
    _save(fork, state)
    rel = ws.release(engine, version)
    diff = rebased.range_diff if rebased else range_diff(fork, state["source"])
    clock = time.monotonic()
    info(f"[3/3] building the forked {engine} {version} wheel")
    wheel = build(ws, rel, install_check=install_check)
    timer.phase("build", clock)
    report = _write_report(
        ws, state, status="done", series_dir=ws.series_dir(rel), diff=diff, wheel=wheel
    )
    (fork / ".git" / _STATE).unlink()
    return report


def _resume(ws: Workspace, engine: str, version: str, install_check: bool) -> dict[str, Any]:
    fork, state = saved_state(ws, engine, version, via="roll")
    return _rebase_and_build(ws, state, fork, install_check, resume=True)
