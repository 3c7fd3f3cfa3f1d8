"""``patches-check``: every committed series applies exactly and re-exports byte for byte.

For each pinned release with a series: the trailers are present, the series applies to the
pinned wheel's sources in a scratch fork that holds nothing but that release (so no three-way
merge can paper over a difference), and ``format_patches`` of that fork reproduces the
committed patch files exactly (a patch that applied at an offset re-exports with other hunk
headers and fails here). The developer's own fork under ``forks/`` is never touched.
"""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from compat.matrix import EngineRelease
from patchq.console import info
from patchq.errors import ApplyError, ExportMismatch, SeriesError
from patchq.export import format_patches
from patchq.fork import materialize
from patchq.series import check_paths, check_trailers, read
from patchq.workspace import Workspace


def _first_difference(committed: Path, exported: Path) -> str:
    old = committed.read_text(errors="replace").splitlines()
    new = exported.read_text(errors="replace").splitlines()
    diff = difflib.unified_diff(old, new, "committed", "re-exported", n=1, lineterm="")
    return "\n".join(list(diff)[:12])


def check_release(ws: Workspace, rel: EngineRelease, *, python: str | None = None) -> bool:
    """Check ``rel``'s series; ``False`` when it has none (nothing to check), ``True`` when it
    passed. Raises ``SeriesError``, ``ApplyError`` or ``ExportMismatch`` naming the patch."""
    ctx = {"engine": rel.name, "version": rel.version}
    series = read(ws.series_dir(rel), **ctx)
    if not series.exists:
        info(f"{rel.name} {rel.version}: no series at {rel.patch_dir}/series: nothing to check")
        return False
    check_trailers(series, **ctx)
    check_paths(series, **ctx)
    redo = (
        f"python -m patchq materialize {rel.name} {rel.version} --force, fix the fork, "
        f"python -m patchq export {rel.name} {rel.version}"
    )
    with tempfile.TemporaryDirectory(prefix="patchq-check-") as tmp:
        try:
            fork = materialize(ws, rel, dest=Path(tmp) / "fork", python=python, series=series)
        except ApplyError as exc:
            raise ApplyError(exc.message, patch=exc.patch, file=exc.file, hint=redo, **ctx) from exc
        exported = Path(tmp) / "export"
        names = format_patches(fork, exported)
        if names != list(series.patches):
            raise ExportMismatch(
                f"re-export gives the patches {names}, the series lists {list(series.patches)}",
                hint=redo,
                **ctx,
            )
        for name in names:
            if (exported / name).read_bytes() != (series.directory / name).read_bytes():
                raise ExportMismatch(
                    "re-exporting the applied patch does not reproduce the committed file "
                    "(applied at an offset, or edited by hand):\n"
                    + _first_difference(series.directory / name, exported / name),
                    patch=name,
                    hint=redo,
                    **ctx,
                )
    info(f"{rel.name} {rel.version}: {len(names)} patches apply exactly and re-export identically")
    return True


def _refuse_unpinned_series(ws: Workspace) -> None:
    pinned = {(rel.name, rel.version) for rel in ws.releases()}
    for series_file in sorted((ws.root / "patches").glob("*/*/series")):
        engine, version = series_file.parent.parent.name, series_file.parent.name
        if (engine, version) not in pinned:
            raise SeriesError(
                f"{series_file.parent} holds a series for a release compat/matrix.toml does not "
                "pin, so nothing can check it",
                engine=engine,
                version=version,
                hint="pin the release in compat/matrix.toml (nox -s rebase-<engine> does) or "
                "delete the directory",
            )


def check_all(
    ws: Workspace, engine: str | None = None, version: str | None = None
) -> dict[str, bool]:
    """``check_release`` for every pinned release (or those of ``engine``/``version``);
    returns ``{"<engine> <version>": checked}``. Stops at the first failing series; without
    ``engine``, a series directory of a release the matrix does not pin fails too."""
    results = {}
    if engine is None:
        _refuse_unpinned_series(ws)
    for rel in ws.releases():
        if engine and rel.name != engine:
            continue
        if version and version not in (rel.version, rel.short):
            continue
        results[f"{rel.name} {rel.version}"] = check_release(ws, rel)
    return results
