"""Load and validate ``compat/matrix.toml``.

``load()`` is the one reader of the matrix. It returns the pinned releases in file order and
raises ``MatrixError`` (naming the entry and the field) for anything malformed, so a bad edit
fails ``nox --list`` and the test suite at once rather than a build an hour later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

MATRIX_PATH = Path(__file__).with_name("matrix.toml")
BACKENDS = ("cuda", "rocm", "host")
STATUSES = ("tested-gpu", "tested-cpu", "untested", "unsupported")
ARTIFACT_KINDS = ("sdist", "wheel")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class MatrixError(ValueError):
    """``compat/matrix.toml`` is malformed; the message names the entry and field to fix."""


@dataclass(frozen=True)
class Artifact:
    """One upstream file a fork is built from, as the package registry serves it."""

    kind: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class BackendStatus:
    """How far one engine version is proven on one GPU backend."""

    status: str
    note: str


@dataclass(frozen=True)
class EngineRelease:
    """One pinned upstream engine release and its row of the test matrix."""

    name: str
    version: str
    short: str
    python: tuple[str, ...]
    artifacts: tuple[Artifact, ...]
    backends: dict[str, BackendStatus]

    @property
    def key(self) -> str:
        """The name used in nox sessions and paths, e.g. ``vllm-0.33``."""
        return f"{self.name}-{self.short}"

    @property
    def patch_dir(self) -> str:
        """The series directory relative to the repository root."""
        return f"patches/{self.name}/{self.version}"

    def artifact(self, kind: str, python: str | None = None) -> Artifact:
        """The artifact of ``kind``; for per-interpreter wheels, the one for ``python``
        (``"3.11"``). Raises ``MatrixError`` when the matrix pins none."""
        tag = f"-cp{python.replace('.', '')}-" if python else None
        for art in self.artifacts:
            if art.kind != kind:
                continue
            if tag is None or tag in art.filename or "-abi3-" in art.filename:
                return art
        wanted = f"{kind} for Python {python}" if python else kind
        raise MatrixError(
            f"{self.name} {self.version}: compat/matrix.toml pins no {wanted}; "
            f"add an [[engine.artifact]] entry with its filename and sha256"
        )


def _require(table: dict[str, object], key: str, where: str, typ: type) -> object:
    if key not in table:
        raise MatrixError(f"{where}: missing field '{key}'")
    value = table[key]
    if not isinstance(value, typ):
        raise MatrixError(f"{where}: field '{key}' must be a {typ.__name__}, got {value!r}")
    return value


def _parse_engine(raw: dict[str, object], index: int) -> EngineRelease:
    where = f"compat/matrix.toml engine #{index + 1}"
    name = str(_require(raw, "name", where, str))
    version = str(_require(raw, "version", where, str))
    where = f"compat/matrix.toml {name} {version}"
    short = str(_require(raw, "short", where, str))
    python = _require(raw, "python", where, list)
    assert isinstance(python, list)
    artifacts = []
    raw_artifacts = _require(raw, "artifact", where, list)
    assert isinstance(raw_artifacts, list)
    for art in raw_artifacts:
        kind = str(_require(art, "kind", where, str))
        if kind not in ARTIFACT_KINDS:
            raise MatrixError(f"{where}: artifact kind {kind!r} is not one of {ARTIFACT_KINDS}")
        filename = str(_require(art, "filename", where, str))
        sha = str(_require(art, "sha256", where, str))
        if not _SHA256.match(sha):
            raise MatrixError(f"{where}: {filename}: sha256 must be 64 lowercase hex digits")
        artifacts.append(Artifact(kind, filename, sha))
    raw_backends = _require(raw, "backends", where, dict)
    assert isinstance(raw_backends, dict)
    backends = {}
    for backend in BACKENDS:
        if backend not in raw_backends:
            raise MatrixError(f"{where}: backends.{backend} is missing (every backend needs a row)")
        entry = raw_backends[backend]
        status = str(_require(entry, "status", f"{where} backends.{backend}", str))
        if status not in STATUSES:
            raise MatrixError(f"{where}: backends.{backend}.status {status!r} not in {STATUSES}")
        note = str(_require(entry, "note", f"{where} backends.{backend}", str))
        backends[backend] = BackendStatus(status, note)
    unknown = set(raw_backends) - set(BACKENDS)
    if unknown:
        raise MatrixError(f"{where}: unknown backends {sorted(unknown)}; known: {BACKENDS}")
    return EngineRelease(name, version, short, tuple(python), tuple(artifacts), backends)


def load(path: Path = MATRIX_PATH) -> list[EngineRelease]:
    """Every pinned release in file order. Raises ``MatrixError`` on a malformed file."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    engines = [_parse_engine(raw, i) for i, raw in enumerate(data.get("engine", []))]
    keys = [e.key for e in engines]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise MatrixError(f"compat/matrix.toml: duplicate engine entries {sorted(dupes)}")
    return engines


def find(engine: str, version: str, path: Path = MATRIX_PATH) -> EngineRelease:
    """The pinned release ``engine`` ``version`` (full ``0.33.0`` or short ``0.33``)."""
    for rel in load(path):
        if rel.name == engine and version in (rel.version, rel.short):
            return rel
    pinned = ", ".join(f"{r.name} {r.version}" for r in load(path))
    raise MatrixError(f"{engine} {version} is not pinned in compat/matrix.toml (pinned: {pinned})")
