"""A patch series on disk: ``patches/<engine>/<version>/series`` and its ``*.patch`` files.

The ``series`` file lists patch filenames in apply order, one per line; blank lines and
``#`` comments are ignored, except the header line ``# kvcore-build: N``, the ``N`` of the
forked wheel's local version ``<version>+kvcore.N``. ``export`` bumps ``N`` whenever the
exported patches differ from the committed ones, so two different forked wheels never share a
version. A directory without a ``series`` file is a release with no series yet.

Every patch is ``git format-patch`` output whose message carries the trailers

* ``Why:``       what the seam is for,
* ``Upstream:``  a PR link (``https://...``) or ``not-suitable: <reason>``,
* ``Drop-when:`` the condition under which the patch can go.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from patchq.errors import SeriesError

SERIES = "series"
_BUILD = re.compile(r"^#\s*kvcore-build:\s*(\d+)\s*$")
TRAILERS = ("Why", "Upstream", "Drop-when")


@dataclass(frozen=True)
class Series:
    """The series of one release: ``directory``, the ordered ``patches`` (filenames) and the
    ``build`` counter (0 where no series exists)."""

    directory: Path
    patches: tuple[str, ...]
    build: int
    exists: bool

    def paths(self) -> list[Path]:
        """The patch files in apply order."""
        return [self.directory / name for name in self.patches]


def header(engine: str, version: str, build: int) -> str:
    """The fixed comment header ``export`` writes on top of a series file."""
    return (
        f"# Patch series for {engine} {version}: applied in this order onto the release's\n"
        f"# sources by `python -m patchq materialize {engine} {version}`.\n"
        f"# Written by `python -m patchq export {engine} {version}`: edit the fork, not here.\n"
        f"# kvcore-build: {build}\n"
    )


def read(directory: Path, *, engine: str = "", version: str = "") -> Series:
    """The series in ``directory``. Raises ``SeriesError`` for a listed file that is missing,
    a ``*.patch`` file the series does not list, or a name listed twice."""
    path = directory / SERIES
    if not path.exists():
        return Series(directory, (), 0, exists=False)
    ctx = {"engine": engine, "version": version}
    build = 0
    names: list[str] = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if match := _BUILD.match(text):
            build = int(match.group(1))
        if not text or text.startswith("#"):
            continue
        if text in names:
            raise SeriesError(f"{path} lists {text} twice", patch=text, **ctx)
        if Path(text).name != text or text in (".", "..") or not text.endswith(".patch"):
            raise SeriesError(
                f"{path} lists {text!r}: series entries are plain *.patch file names in "
                "the series' own directory",
                patch=text,
                hint="list the file's name only (python -m patchq export writes the series)",
                **ctx,
            )
        if not (directory / text).is_file():
            raise SeriesError(
                f"{path} lists {text}, which does not exist",
                patch=text,
                hint="re-export the fork: python -m patchq export " + f"{engine} {version}",
                **ctx,
            )
        names.append(text)
    unlisted = sorted({p.name for p in directory.glob("*.patch")} - set(names))
    if unlisted:
        raise SeriesError(
            f"{directory} holds patches the series does not list: {', '.join(unlisted)}",
            patch=unlisted[0],
            hint="add them to the series in the fork and re-export, or delete them",
            **ctx,
        )
    return Series(directory, tuple(names), build, exists=True)


def message_of(patch_text: str) -> str:
    """The commit message of a format-patch file: the Subject plus the body (up to the
    ``---`` line or the first ``diff --git``)."""
    head, _, rest = patch_text.partition("\n\n")
    subject = next((ln for ln in head.splitlines() if ln.startswith("Subject:")), "")
    # The message ends at the "---" line, or (format-patch --no-stat) at the first diff.
    body = re.split(r"\n---\n|\ndiff --git ", "\n" + rest, maxsplit=1)[0][1:]
    return subject + "\n\n" + body


def missing_trailers(patch_text: str) -> list[str]:
    """The required trailers this patch lacks or leaves empty, and an ``Upstream:`` that is
    neither a link nor ``not-suitable: <reason>``; an empty list when it is complete."""
    message = message_of(patch_text)
    problems = []
    for name in TRAILERS:
        match = re.search(rf"^{re.escape(name)}:[ \t]*(\S.*)$", message, re.MULTILINE)
        if not match:
            problems.append(f"{name}:")
        elif name == "Upstream":
            value = match.group(1).strip()
            ok = re.match(r"https?://\S+", value) or re.match(r"not-suitable:\s*\S", value)
            if not ok:
                problems.append(f"Upstream: ({value!r} is neither a link nor not-suitable: why)")
    return problems


def check_trailers(series: Series, *, engine: str = "", version: str = "") -> None:
    """Raise ``SeriesError`` naming the first patch of ``series`` without every trailer."""
    for path in series.paths():
        missing = missing_trailers(path.read_text(errors="replace"))
        if missing:
            raise SeriesError(
                f"the patch message lacks {', '.join(missing)} (each patch body needs "
                "Why:, Upstream: <link | not-suitable: reason> and Drop-when:)",
                engine=engine,
                version=version,
                patch=path.name,
                hint=f"amend the commit in forks/{engine}/{version} "
                f"(git commit --amend, or git rebase -i refs/kvcore/upstream) and re-export",
            )


def check_paths(series: Series, *, engine: str = "", version: str = "") -> None:
    """Raise ``SeriesError`` naming the first patch of ``series`` that touches a path outside
    the release's own package (``<engine>/``: a top-level ``.pth`` would run at every
    interpreter start) or adds, changes or removes a symlink (its target's bytes would be
    packed into the forked wheel)."""
    package = f"{engine}/"
    for path in series.paths():
        for line in path.read_text(errors="replace").splitlines():
            problem = ""
            if line.startswith("diff --git "):
                for name in line.split()[2:4]:
                    inner = name.split("/", 1)[1] if "/" in name else name
                    parts = Path(inner).parts
                    if not inner.startswith(package) or ".." in parts:
                        problem = f"touches {inner}, outside the release's package {package}"
            elif line.endswith(" 120000") and "mode" in line:
                problem = "adds, changes or removes a symlink"
            if problem:
                raise SeriesError(
                    f"the patch {problem}",
                    engine=engine,
                    version=version,
                    patch=path.name,
                    hint=f"keep patches to regular files under {package} and re-export",
                )


def lines_touched(patch_text: str) -> dict[str, int]:
    """What a format-patch file changes: ``added`` and ``removed`` lines of files that exist
    upstream (the "upstream lines touched") and ``new_file_lines``, the lines of files it
    creates."""
    counts = {"added": 0, "removed": 0, "new_file_lines": 0}
    new_file = in_hunk = False  # the message and the file headers count for nothing
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            new_file = in_hunk = False
        elif not in_hunk:
            new_file = new_file or line.startswith("new file mode ")
            in_hunk = line.startswith("@@ ")
        elif line.startswith("+"):
            counts["new_file_lines" if new_file else "added"] += 1
        elif line.startswith("-"):
            counts["removed"] += 1
    return counts
