"""Rebasing a series onto another release, with a per-patch conflict report.

``rebase(ws, engine, target, source=...)`` builds ``forks/<engine>/<target>/`` as one
repository holding both releases: the source release's base with its series applied (branch
``kvcore-<source>``) and the target release imported as a second base
(``refs/kvcore/upstream``). The series is replayed onto the target with one
``git am --3way`` run (the patches' full blob ids let git rebuild their original base for the
three-way merge). Then:

* success: the fork's commits are exported to ``patches/<engine>/<target>/``, an unpinned
  target is appended to the compat matrix as ``untested`` (artifact hashes from the index's
  JSON API; the README table is re-rendered) and the range-diff of old vs new series printed;
* conflict: ``RebaseConflict`` lists the patch, each file with the patch's hunks and the
  conflict markers' line numbers, and the commands to continue or abort. The fork stays in the
  ``git am`` state; nothing is written under ``patches/`` or to the matrix until the rebase
  finishes (``rebase(..., resume=True)`` runs ``git am --continue`` and completes it).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from compat import matrix as compat_matrix
from compat.matrix import Artifact, BackendStatus, EngineRelease
from patchq import gitcmd
from patchq.artifacts import RemoteFile, release_of
from patchq.console import info, step
from patchq.errors import ApplyError, ArtifactError, ForkError, RebaseConflict, SeriesError
from patchq.export import export
from patchq.fork import (
    BRANCH,
    UPSTREAM_REF,
    Stop,
    am_in_progress,
    apply_series,
    base_ref,
    import_base,
    init_repo,
    stop_state,
)
from patchq.series import read
from patchq.workspace import Workspace, running_python

_STATE = "kvcore-rebase.json"


@dataclass(frozen=True)
class Rebased:
    """A finished rebase: the written ``series_dir``, the ``fork`` it came from, the
    ``range_diff`` of old vs new series and whether the target was ``added`` to the matrix."""

    series_dir: Path
    fork: Path
    range_diff: str
    added: bool


def _source_release(ws: Workspace, engine: str, target: str, source: str | None) -> EngineRelease:
    if source:
        return ws.release(engine, source)
    with_series = [
        rel
        for rel in ws.releases()
        if rel.name == engine
        and target not in (rel.version, rel.short)
        and read(ws.series_dir(rel)).exists
    ]
    if not with_series:
        raise SeriesError(
            "no pinned release of this engine has a series to rebase",
            engine=engine,
            hint=f"name one with --from, after writing it (python -m patchq export {engine} ...)",
        )
    return max(with_series, key=lambda rel: Version(rel.version))


def _platform_kind(platform: str) -> str:
    """``manylinux_2_34_x86_64`` -> ``manylinux:x86_64`` (family and arch, no glibc/OS
    version), so a new release built against another glibc still matches."""
    family, *rest = platform.split("_")
    while rest and rest[0].isdigit():
        rest.pop(0)
    return f"{family.rstrip('0123456789')}:{'_'.join(rest)}"


def _wheel_key(filename: str) -> tuple[frozenset[tuple[str, str]], frozenset[str]]:
    _, _, _, tags = parse_wheel_filename(filename)
    pairs = frozenset((t.interpreter, t.abi) for t in tags)
    return pairs, frozenset(_platform_kind(t.platform) for t in tags)


def _pick(art: Artifact, files: list[RemoteFile], engine: str, target: str) -> Artifact:
    if art.kind == "sdist":
        found = [f for f in files if f.filename.endswith((".tar.gz", ".zip"))]
    else:
        want = _wheel_key(art.filename)
        found = [f for f in files if f.filename.endswith(".whl") and _wheel_key(f.filename) == want]
    if len(found) != 1 or not found[0].sha256:
        raise ArtifactError(
            f"cannot pick the {art.kind} matching {art.filename} among "
            f"{sorted(f.filename for f in files) or 'no files'}",
            engine=engine,
            version=target,
            hint="add the release to compat/matrix.toml by hand (filename, sha256), then rebase",
        )
    return Artifact(art.kind, found[0].filename, found[0].sha256)


def commands(via: str, engine: str, target: str) -> tuple[str, str]:
    """The nox session and the ``python -m patchq`` command line that run verb ``via``
    (``"rebase"`` or ``"roll"``) for ``engine`` ``target`` (append ``--continue`` to finish)."""
    session = f"roll -- {engine}" if via == "roll" else f"rebase-{engine} --"
    return f"nox -s {session} {target}", f"python -m patchq {via} {engine} {target}"


def new_release(
    ws: Workspace, src: EngineRelease, target: str, *, via: str = "rebase"
) -> EngineRelease:
    """The matrix entry for unpinned ``target``: for each artifact ``src`` pins, the file of
    ``target`` with the same kind and tags, with the sha256 the index publishes; every backend
    of ``src`` ``untested``, with a note naming ``via`` (``"rebase"`` or ``"roll"``). Raises
    ``ArtifactError`` when a file cannot be matched unambiguously."""
    files = ws.cache.source.files(src.name, target)
    artifacts = tuple(_pick(a, files, src.name, target) for a in src.artifacts)
    released = release_of(artifacts[0].filename)
    target = str(released[1]) if released else target  # "0.34" -> "0.34.0", as published
    depth = len(src.short.split("."))
    short = target if src.short == src.version else ".".join(target.split(".")[:depth])
    if any(r.name == src.name and r.short == short for r in ws.releases()):
        short = target
    if via == "roll":
        note = f"rolled from {src.version} by `nox -s roll` (series rebased); not yet run"
    else:
        note = f"series rebased from {src.version} by `nox -s rebase-{src.name}`; not yet run"
    backends = {b: BackendStatus("untested", note) for b in src.backends}
    return EngineRelease(src.name, target, short, src.python, artifacts, backends)


def matrix_block(rel: EngineRelease, *, via: str = "rebase") -> str:
    """``rel`` as a ``compat/matrix.toml`` ``[[engine]]`` block, its comment naming the
    command (``via``) that added it."""
    pythons = ", ".join(f'"{p}"' for p in rel.python)
    if via == "roll":
        added = "# Added by `nox -s roll`: hashes as the index publishes them; the files matched."
    else:
        added = (
            f"# Added by `nox -s rebase-{rel.name}`: hashes as the package index publishes them."
        )
    lines = [
        "",
        added,
        "[[engine]]",
        f'name = "{rel.name}"',
        f'version = "{rel.version}"',
        f'short = "{rel.short}"',
        f"python = [{pythons}]",
    ]
    for art in rel.artifacts:
        lines += [
            "",
            "[[engine.artifact]]",
            f'kind = "{art.kind}"',
            f'filename = "{art.filename}"',
            f'sha256 = "{art.sha256}"',
        ]
    lines += ["", "[engine.backends]"]
    for name, status in rel.backends.items():
        lines.append(
            f"{name} = {{ status = {json.dumps(status.status)}, note = {json.dumps(status.note)} }}"
        )
    return "\n".join(lines) + "\n"


def _add_to_matrix(ws: Workspace, block: str) -> None:
    before = ws.matrix_path.read_text()
    ws.matrix_path.write_text(before.rstrip("\n") + "\n" + block)
    try:
        compat_matrix.load(ws.matrix_path)
    except compat_matrix.MatrixError:
        ws.matrix_path.write_text(before)
        raise
    if ws.matrix_path.resolve() == compat_matrix.MATRIX_PATH.resolve():
        from compat import render

        readme = ws.root / "README.md"
        readme.write_text(render.splice(readme.read_text()))


def _patch_hunks(repo: Path, name: str) -> list[str]:
    patch = repo / ".git" / "rebase-apply" / "patch"
    if not patch.exists():
        return []
    hunks, current = [], None
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[-1]
        elif line.startswith("@@ ") and current == name:
            hunks.append(line.split(" @@", 1)[0] + " @@")
    return hunks


def _conflict(ws: Workspace, fork: Path, state: dict[str, str], stop: Stop) -> RebaseConflict:
    engine, target = state["engine"], state["target"]
    patches = json.loads(state["patches"])
    name = patches[stop.index - 1]
    rel_fork = _shown(ws, fork)
    session, command = commands(state.get("via", "rebase"), engine, target)
    report = [f"patch {stop.index}/{len(patches)} {name} stopped:"]
    files = {}
    for path, lines in stop.files.items():
        files[path] = {"hunks": _patch_hunks(fork, path), "markers": lines}
        hunks = ", ".join(files[path]["hunks"]) or "?"
        where = (
            f"conflict markers at lines {', '.join(map(str, lines))}"
            if lines
            else ("no merge possible (file missing or renamed in the new release?)")
        )
        report.append(f"  file {path}: patch hunks {hunks}; {where}")
    if not stop.files:
        report.append("  " + "\n  ".join(stop.output.strip().splitlines()[-6:]))
    if stop.index < len(patches):
        report.append(f"  still to replay after it: {', '.join(patches[stop.index :])}")
    report += [
        "resolve: edit the files above in the fork, then `git add` them:",
        f"  cd {rel_fork}",
        f"continue: {session} --continue",
        f"  (or {command} --continue; to drop this patch "
        f"instead: git -C {rel_fork} am --skip, then --continue)",
        f"abort: git -C {rel_fork} am --abort && rm -rf {rel_fork}",
        "nothing under patches/ or in compat/matrix.toml has been written",
    ]
    return RebaseConflict(
        "replaying the series stopped at a conflict:\n" + "\n".join(report),
        report=report,
        files=files,
        index=stop.index,
        engine=engine,
        version=target,
        patch=name,
        file=", ".join(stop.files) or None,
        hint=f"resolve in {rel_fork}, then {session} --continue",
    )


def _shown(ws: Workspace, path: Path) -> str:
    try:
        return str(path.relative_to(ws.root))
    except ValueError:
        return str(path)


def rebase(
    ws: Workspace,
    engine: str,
    target: str,
    *,
    source: str | None = None,
    resume: bool = False,
    force: bool = False,
    via: str = "rebase",
) -> Rebased:
    """Replay ``source``'s series (default: the newest pinned release of ``engine`` with one)
    onto release ``target`` and write ``patches/<engine>/<target>/``. ``via`` names the
    command the matrix note and the conflict report's next steps mention (``"roll"``: the
    ``roll`` command drives this rebase).

    Raises ``RebaseConflict`` (fork left in ``git am``; see the module docstring),
    ``ForkError`` when the target fork exists (use ``resume`` or ``force``) or there is nothing
    to resume, ``SeriesError`` when the target already has a series and not ``force``, and the
    artifact errors for the target's files.
    """
    if resume:
        return _resume(ws, engine, target)
    src = _source_release(ws, engine, target, source)
    if target in (src.version, src.short):
        raise SeriesError(
            "cannot rebase a series onto its own release",
            engine=engine,
            version=target,
            hint="name another target version",
        )
    try:
        tgt, added = ws.release(engine, target), False
    except compat_matrix.MatrixError:
        tgt, added = new_release(ws, src, target, via=via), True
    fork = ws.root / "forks" / engine / tgt.version
    ctx = {"engine": engine, "version": tgt.version}
    if read(ws.series_dir(tgt)).exists and not force:
        raise SeriesError(
            f"{tgt.patch_dir} holds a series already",
            hint=f"pass --force to replace it with the rebased {src.version} series",
            **ctx,
        )
    if fork.exists() and not force:
        raise ForkError(
            f"{fork} exists already",
            hint=f"finish it: nox -s rebase-{engine} -- {target} --continue; or start over "
            "with --force",
            **ctx,
        )
    series = read(ws.series_dir(src), engine=engine, version=src.version)
    python = running_python()
    src_wheel = ws.cache.fetch(src, "wheel", python)
    tgt_wheel = ws.cache.fetch(tgt, "wheel", python)
    if fork.exists():
        shutil.rmtree(fork)
    init_repo(fork)
    src_base = import_base(fork, src, src_wheel)
    gitcmd.git(fork, "checkout", "-q", "-f", "-B", f"{BRANCH}-{src.version}", src_base)
    stop = apply_series(fork, series.paths(), engine=engine, version=src.version)
    if stop is not None:
        raise ApplyError(
            "the source series does not apply to its own release",
            engine=engine,
            version=src.version,
            patch=series.patches[stop.index - 1],
            hint=f"python -m patchq check {engine} {src.version}",
        )
    tgt_base = import_base(fork, tgt, tgt_wheel)
    gitcmd.git(fork, "update-ref", UPSTREAM_REF, tgt_base)
    gitcmd.git(fork, "checkout", "-q", "-f", "-B", BRANCH, tgt_base)
    state = {
        "engine": engine,
        "source": src.version,
        "target": tgt.version,
        "patches": json.dumps(list(series.patches)),
        "matrix_block": matrix_block(tgt, via=via) if added else "",
        "via": via,
    }
    (fork / ".git" / _STATE).write_text(json.dumps(state, indent=1))
    with step(f"replaying {len(series.patches)} patches of {src.version} onto {tgt.version}"):
        stop = apply_series(fork, series.paths(), engine=engine, version=tgt.version)
    if stop is not None:
        raise _conflict(ws, fork, state, stop)
    return _finish(ws, fork, state, tgt)


def in_progress(fork: Path) -> bool:
    """Whether a rebase started in ``fork`` waits for ``--continue``."""
    return (fork / ".git" / _STATE).exists()


def saved_state(
    ws: Workspace, engine: str, target: str, *, via: str = "rebase"
) -> tuple[Path, dict[str, Any]]:
    """The fork of ``engine`` ``target`` and the state ``via`` (``"rebase"``, ``"roll"``)
    kept in its ``.git/kvcore-<via>.json`` for ``--continue``. Raises ``ForkError`` (with the
    command that starts one) when there is none."""
    fork = ws.root / "forks" / engine / target
    state_file = fork / ".git" / f"kvcore-{via}.json"
    if not state_file.exists():
        raise ForkError(
            f"no {via} to continue in {fork}",
            engine=engine,
            version=target,
            hint=f"start one: {commands(via, engine, target)[0]}",
        )
    return fork, json.loads(state_file.read_text())


def _resume(ws: Workspace, engine: str, target: str) -> Rebased:
    fork, state = saved_state(ws, engine, target)
    if am_in_progress(fork):
        unmerged = gitcmd.out(fork, "diff", "--name-only", "--diff-filter=U")
        if unmerged:
            stop = stop_state(fork, "")
            raise _conflict(ws, fork, state, stop)
        proc = gitcmd.git(fork, "am", "--continue", check=False)
        if am_in_progress(fork):
            output = (proc.stdout + proc.stderr).decode(errors="replace")
            raise _conflict(ws, fork, state, stop_state(fork, output))
    return _finish(ws, fork, state, _target_release(ws, fork, state))


def _target_release(ws: Workspace, fork: Path, state: dict[str, str]) -> EngineRelease:
    engine, target, block = state["engine"], state["target"], state["matrix_block"]
    if not block:
        return ws.release(engine, target)
    scratch = fork / ".git" / "kvcore-target.toml"
    scratch.write_text(block)
    try:
        return compat_matrix.find(engine, target, scratch)
    finally:
        scratch.unlink()


def range_diff(fork: Path, source: str) -> str:
    """``git range-diff`` of the ``source`` series (branch ``kvcore-<source>`` on its base) vs
    the rebased one (``kvcore`` on ``refs/kvcore/upstream``) in rebase fork ``fork``."""
    return gitcmd.out(
        fork,
        "range-diff",
        "--no-color",
        f"{base_ref(source)}..{BRANCH}-{source}",
        f"{UPSTREAM_REF}..{BRANCH}",
    )


def _finish(ws: Workspace, fork: Path, state: dict[str, str], tgt: EngineRelease) -> Rebased:
    directory = export(ws, tgt, fork=fork)
    if state["matrix_block"]:
        _add_to_matrix(ws, state["matrix_block"])
        info(f"added {tgt.name} {tgt.version} to {ws.matrix_path} as untested")
    (fork / ".git" / _STATE).unlink()
    src = state["source"]
    diff = range_diff(fork, src)
    # The review artifact goes to stdout unwrapped, so it can be redirected to a file.
    print(f"range-diff {tgt.name} {src} -> {tgt.version}:\n{diff or '(empty series)'}", flush=True)
    info(f"rebased series written to {_shown(ws, directory)}; fork at {_shown(ws, fork)}")
    return Rebased(directory, fork, diff, bool(state["matrix_block"]))
