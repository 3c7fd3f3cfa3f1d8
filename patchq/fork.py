"""Fork checkouts: a pinned release's sources as a base commit, the series applied on top.

``forks/<engine>/<version>/`` is a git repository with

* ``refs/kvcore/bases/<version>``: one parentless commit holding the package sources of the
  pinned wheel (every file of its top-level packages except compiled extensions and other
  binaries), so fork and forked wheel agree file for file. Its id depends only on the release:
  the author, committer and dates are fixed.
* ``refs/kvcore/upstream``: the base this checkout's series applies to.
* branch ``kvcore``: the base plus one commit per patch, applied with ``git am --3way``.

The repository's own config names the patchq identity, so plain ``git commit`` and
``git am --continue`` work inside it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from compat.matrix import EngineRelease
from patchq import gitcmd
from patchq.console import info, step
from patchq.errors import ApplyError, ForkError, GitError
from patchq.series import Series, read
from patchq.workspace import Workspace, running_python

UPSTREAM_REF = "refs/kvcore/upstream"
BRANCH = "kvcore"
_COMPILED = (".so", ".pyd", ".dll", ".dylib", ".a", ".o", ".lib", ".pyc", ".exe")
_APPLY_ERROR = re.compile(r"^error: (?:patch failed: )?([^\s:]+):")


def base_ref(version: str) -> str:
    """The ref of the imported release ``version`` inside a fork."""
    return f"refs/kvcore/bases/{version}"


def is_compiled(name: str) -> bool:
    """Whether a wheel member is a compiled extension or library by its name."""
    lower = name.lower()
    return lower.endswith(_COMPILED) or ".so." in lower.rsplit("/", 1)[-1]


def package_sources(wheel: Path) -> Iterator[tuple[str, int, bytes]]:
    """``(path, git mode, bytes)`` of every package source file in ``wheel``: members outside
    ``*.dist-info``/``*.data``, not compiled (by name) and not binary (no NUL byte in the first
    8000 bytes, git's own test)."""
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.infolist():
            top = member.filename.split("/", 1)[0]
            if member.is_dir() or top.endswith((".dist-info", ".data")):
                continue
            if is_compiled(member.filename):
                continue
            data = zf.read(member)
            if b"\0" in data[:8000]:
                continue
            mode = 0o100755 if (member.external_attr >> 16) & 0o111 else 0o100644
            yield member.filename, mode, data


def _fast_import_stream(
    ref: str, message: str, files: Iterator[tuple[str, int, bytes]]
) -> Iterator[bytes]:
    ident = f"{gitcmd.NAME} <{gitcmd.EMAIL}> {gitcmd.EPOCH}"
    msg = message.encode()
    yield f"reset {ref}\ncommit {ref}\nauthor {ident}\ncommitter {ident}\n".encode()
    yield b"data %d\n" % len(msg) + msg + b"\n"
    for path, mode, data in files:
        if "\n" in path or path.startswith('"'):
            raise ForkError(f"cannot import a file named {path!r}", file=path)
        yield f"M {mode:o} inline {path}\ndata {len(data)}\n".encode() + data + b"\n"
    yield b"\n"


def import_base(repo: Path, rel: EngineRelease, wheel: Path) -> str:
    """Commit the package sources of ``wheel`` as ``refs/kvcore/bases/<version>`` in ``repo``
    (replacing that ref) and return the commit id. Raises ``GitError`` if git fails."""
    ref = base_ref(rel.version)
    message = (
        f"upstream: {rel.name} {rel.version}\n\n"
        f"The package sources of {wheel.name}; compiled extensions and other binary files\n"
        f"are not part of the fork (the forked wheel keeps the release's own).\n"
    )
    with step(f"importing {rel.name} {rel.version} sources from {wheel.name}"):
        proc = subprocess.Popen(
            ["git", "-C", str(repo), "fast-import", "--quiet", "--force"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=gitcmd.git_env(author_date=True),
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for chunk in _fast_import_stream(ref, message, package_sources(wheel)):
                proc.stdin.write(chunk)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # fast-import died: its output below says why
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        output = proc.stdout.read().decode(errors="replace")
        proc.wait()
        if proc.returncode != 0:
            raise GitError(
                f"git fast-import failed: {output.strip()}",
                command=["git", "fast-import"],
                output=output,
                engine=rel.name,
                version=rel.version,
            )
    return gitcmd.out(repo, "rev-parse", ref)


def init_repo(path: Path) -> None:
    """A new fork repository at ``path`` with the patchq identity in its own config."""
    path.mkdir(parents=True)
    gitcmd.git(path, "init", "-q", "-b", BRANCH)
    for key, value in (
        ("user.name", gitcmd.NAME),
        ("user.email", gitcmd.EMAIL),
        ("core.autocrlf", "false"),
        ("gc.auto", "0"),
    ):
        gitcmd.git(path, "config", key, value)
    (path / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")


def am_in_progress(repo: Path) -> bool:
    """Whether ``git am`` stopped in ``repo`` and waits for --continue/--skip/--abort."""
    return (repo / ".git" / "rebase-apply").is_dir()


@dataclass(frozen=True)
class Stop:
    """Where ``git am`` stopped: the 1-based index of the patch in the list given to ``am``,
    per file the line numbers of its conflict markers (empty when the file could not be merged
    at all, e.g. deleted upstream), and ``am``'s output."""

    index: int
    files: dict[str, list[int]]
    output: str


def stop_state(repo: Path, output: str) -> Stop:
    """Describe the stopped ``git am`` in ``repo`` (``output``: what ``am`` printed)."""
    next_file = repo / ".git" / "rebase-apply" / "next"
    index = int(next_file.read_text()) if next_file.exists() else 1
    unmerged = gitcmd.out(repo, "diff", "--name-only", "--diff-filter=U").splitlines()
    files: dict[str, list[int]] = {}
    for name in unmerged:
        path = repo / name
        text = path.read_text(errors="replace").splitlines() if path.is_file() else []
        files[name] = [n for n, line in enumerate(text, 1) if line.startswith("<<<<<<<")]
    for line in output.splitlines():
        # git apply's own diagnostics for files no merge could be attempted on
        if match := _APPLY_ERROR.match(line):
            files.setdefault(match.group(1), [])
    return Stop(index, files, output)


def apply_series(
    repo: Path,
    patches: list[Path],
    *,
    engine: str,
    version: str,
) -> Stop | None:
    """Apply ``patches`` in order with one ``git am --3way`` run, one commit each. Returns
    ``None`` when all applied, else the ``Stop`` where ``am`` halted (the repository stays in
    the am state). Raises ``GitError`` when ``am`` fails without stopping at a patch.

    An offset or a hand-edited patch is not detected here: ``check`` re-exports the result and
    compares bytes, which catches both."""
    if not patches:
        return None
    proc = gitcmd.git(repo, "am", "--3way", "--keep-cr", *(str(p) for p in patches), check=False)
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    if proc.returncode != 0:
        if not am_in_progress(repo):
            raise GitError(
                f"git am failed before applying anything:\n{output.strip()}",
                command=["git", "am"],
                output=output,
                engine=engine,
                version=version,
            )
        return stop_state(repo, output)
    return None


def materialize(
    ws: Workspace,
    rel: EngineRelease,
    *,
    dest: Path | None = None,
    python: str | None = None,
    force: bool = False,
    series: Series | None = None,
) -> Path:
    """Create the fork of ``rel`` at ``dest`` (default ``forks/<engine>/<version>/``): the
    pinned wheel (for ``python``, default the running one) imported as the base, the committed
    series applied on top. Returns the fork path.

    Raises ``ForkError`` if ``dest`` exists and not ``force`` (``force`` deletes it: export
    first!), ``ApplyError`` if a patch does not apply (the fork is left in the ``git am``
    state), plus the artifact errors of ``ArtifactCache.fetch``.
    """
    dest = dest or ws.fork_dir(rel)
    ctx = {"engine": rel.name, "version": rel.version}
    if dest.exists():
        if not force:
            raise ForkError(
                f"{dest} exists already",
                hint=f"export its commits first (python -m patchq export {rel.name} "
                f"{rel.version}), then python -m patchq materialize {rel.name} {rel.version} "
                "--force",
                **ctx,
            )
        shutil.rmtree(dest)
    series = series or read(ws.series_dir(rel), **ctx)
    wheel = ws.cache.fetch(rel, "wheel", python or running_python())
    init_repo(dest)
    base = import_base(dest, rel, wheel)
    gitcmd.git(dest, "update-ref", UPSTREAM_REF, base)
    gitcmd.git(dest, "checkout", "-q", "-f", "-B", BRANCH, base)
    with step(f"applying {len(series.patches)} patches onto {rel.name} {rel.version}"):
        stop = apply_series(dest, series.paths(), engine=rel.name, version=rel.version)
    if stop is not None:
        name = series.patches[stop.index - 1]
        raise ApplyError(
            f"does not apply to the pinned release; the fork at {dest} stopped in `git am`:\n"
            + stop.output.strip(),
            patch=name,
            file=", ".join(stop.files) or None,
            hint=f"fix it in the fork (cd {dest}; resolve; git add; git am --continue) and "
            f"re-export, or git -C {dest} am --abort",
            **ctx,
        )
    info(f"fork ready: {dest} (branch {BRANCH}, base {UPSTREAM_REF} = {base[:12]})")
    return dest
