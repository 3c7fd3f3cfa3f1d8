"""Every error the patch-queue tooling raises, in one hierarchy.

Each error names what failed and its context (engine, version, patch, file) and carries
``hint``: the next command a maintainer runs. ``str(err)`` renders all of it, so the CLI and
the nox sessions print the exception as is. Catch ``PatchqError`` to handle them all.
"""

from __future__ import annotations

from typing import Any


class PatchqError(Exception):
    """Base of every patchq error.

    ``engine``/``version``/``patch``/``file`` say where (each may be ``None``); ``hint`` is the
    next thing to run or do (may be empty).
    """

    def __init__(
        self,
        message: str,
        *,
        engine: str | None = None,
        version: str | None = None,
        patch: str | None = None,
        file: str | None = None,
        hint: str = "",
    ) -> None:
        self.message = message
        self.engine = engine
        self.version = version
        self.patch = patch
        self.file = file
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        where = [" ".join(p for p in (self.engine, self.version) if p)]
        if self.patch:
            where.append(f"patch {self.patch}")
        if self.file:
            where.append(f"file {self.file}")
        prefix = ": ".join(w for w in where if w)
        text = f"{prefix}: {self.message}" if prefix else self.message
        if self.hint:
            text += f"\n  next: {self.hint}"
        return text


class ArtifactError(PatchqError):
    """An upstream release artifact cannot be found on the index or downloaded."""


class HashMismatch(ArtifactError):
    """An artifact's sha256 differs from the one recorded in ``compat/matrix.toml``. The file
    is never used; nothing else in the cache is touched."""


class SeriesError(PatchqError):
    """A series directory is malformed: a listed patch is missing, a patch is not listed, or a
    patch body lacks the ``Why:``/``Upstream:``/``Drop-when:`` trailers."""


class GitError(PatchqError):
    """A git command failed; ``command`` and ``output`` hold what ran and what it said."""

    def __init__(self, message: str, *, command: list[str], output: str, **context: Any) -> None:
        self.command = command
        self.output = output
        super().__init__(message, **context)


class ForkError(PatchqError):
    """A fork checkout is in a state the command cannot work from (exists already, missing,
    an ``am`` in progress, uncommitted edits)."""


class ApplyError(PatchqError):
    """A committed patch does not apply to the release it belongs to."""


class ExportMismatch(PatchqError):
    """Re-exporting a fork does not reproduce the committed patch files byte for byte."""


class RebaseConflict(PatchqError):
    """Replaying a series onto a new release stopped at a conflict. ``report`` lists, per
    conflicting file, the hunks (line numbers of conflict markers) to resolve; the fork is left
    in the ``git am`` state so the maintainer can resolve and continue or abort. ``files`` is
    the same per file as data (``{path: {"hunks": [...], "markers": [...]}}``) and ``index``
    the 1-based position of the stopped patch in the series."""

    def __init__(
        self,
        message: str,
        *,
        report: list[str],
        files: dict[str, dict[str, list[Any]]] | None = None,
        index: int = 0,
        **context: Any,
    ) -> None:
        self.report = report
        self.files = files or {}
        self.index = index
        super().__init__(message, **context)


class BuildError(PatchqError):
    """A forked wheel could not be built or failed its install check."""
