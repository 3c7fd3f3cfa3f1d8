"""Exporting a fork's commits as the committed series, with deterministic ``format-patch``.

``format_patches`` is the only place that turns commits into patch files. Its flags make the
bytes a function of the commits alone: zero commit ids, no signature (the git version), full
blob ids (so ``git am --3way`` can rebuild the base on another release), no diffstat, no
``[PATCH n/m]`` numbering (adding a patch does not rewrite every other one), the Myers diff,
``a/``/``b/`` prefixes, no rename detection; user and system git config are ignored.

``export`` replaces ``patches/<engine>/<version>/`` as a whole or not at all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from compat.matrix import EngineRelease
from patchq import gitcmd
from patchq.console import info
from patchq.errors import ForkError
from patchq.fork import UPSTREAM_REF, am_in_progress
from patchq.series import SERIES, Series, check_paths, check_trailers, header, read
from patchq.workspace import Workspace

FORMAT_PATCH = (
    "format-patch",
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-stat",
    "--no-numbered",
    "--no-thread",
    "--no-renames",
    "--no-color",
    "--diff-algorithm=myers",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--subject-prefix=PATCH",
)


def format_patches(
    repo: Path, dest: Path, base: str = UPSTREAM_REF, head: str = "HEAD"
) -> list[str]:
    """Write one patch file per commit of ``base..head`` in ``repo`` into ``dest`` (created);
    return their filenames in order."""
    dest.mkdir(parents=True, exist_ok=True)
    out = gitcmd.out(repo, *FORMAT_PATCH, "-o", str(dest), f"{base}..{head}")
    return [Path(line).name for line in out.splitlines() if line]


def _require_clean(repo: Path, rel: EngineRelease) -> None:
    ctx = {"engine": rel.name, "version": rel.version}
    if not (repo / ".git").is_dir():
        raise ForkError(
            f"no fork at {repo}",
            hint=f"python -m patchq materialize {rel.name} {rel.version}",
            **ctx,
        )
    if am_in_progress(repo):
        raise ForkError(
            f"`git am` is in progress in {repo}",
            hint=f"finish it (cd {repo}; git am --continue) or git -C {repo} am --abort",
            **ctx,
        )
    dirty = gitcmd.out(repo, "status", "--porcelain")
    if dirty:
        raise ForkError(
            f"{repo} has changes that are not committed:\n{dirty}",
            hint=f"commit them in the fork (cd {repo}; git add ...; git commit) or drop them",
            **ctx,
        )


def _same_patches(old_dir: Path, old: list[str], new_dir: Path, new: list[str]) -> bool:
    if old != new:
        return False
    return all((old_dir / n).read_bytes() == (new_dir / n).read_bytes() for n in new)


def export(ws: Workspace, rel: EngineRelease, *, fork: Path | None = None) -> Path:
    """Write the commits ``refs/kvcore/upstream..HEAD`` of ``fork`` (default the release's
    fork) as ``patches/<engine>/<version>/`` and return that directory.

    The directory is replaced atomically: files other than ``series`` and ``*.patch`` are
    kept; ``# kvcore-build`` goes up by one when the patches differ from the committed ones.
    Raises ``ForkError`` for a missing, dirty or mid-``am`` fork and ``SeriesError`` (before
    anything is written) for a commit without the required trailers.
    """
    fork = fork or ws.fork_dir(rel)
    _require_clean(fork, rel)
    target = ws.series_dir(rel)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.export")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        names = format_patches(fork, staging)
        old = read(target, engine=rel.name, version=rel.version)
        staged = Series(staging, tuple(names), 0, exists=True)
        check_trailers(staged, engine=rel.name, version=rel.version)
        check_paths(staged, engine=rel.name, version=rel.version)
        if old.exists and _same_patches(target, list(old.patches), staging, names):
            build = old.build
        else:
            build = old.build + 1
        text = header(rel.name, rel.version, build) + "".join(f"{n}\n" for n in names)
        (staging / SERIES).write_text(text)
        if target.is_dir():
            for kept in target.iterdir():
                if kept.name != SERIES and kept.suffix != ".patch":
                    shutil.copy2(kept, staging / kept.name)
        _swap_in(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    info(f"exported {len(names)} patches to {target} (kvcore-build {build})")
    return target


def _swap_in(staging: Path, target: Path) -> None:
    """Replace directory ``target`` by ``staging`` with two renames."""
    retired = target.with_name(f".{target.name}.old")
    shutil.rmtree(retired, ignore_errors=True)
    if target.exists():
        target.rename(retired)
    staging.rename(target)
    shutil.rmtree(retired, ignore_errors=True)
