"""Upstream release artifacts: found on the package index, cached outside the repository,
checked against the sha256 recorded in ``compat/matrix.toml`` before every use.

* ``ArtifactCache.fetch(release, kind, python)`` is the one way the tooling gets a pinned
  wheel or sdist. It downloads the exact file by name (nothing is resolved or built), verifies
  it and returns its path in the cache.
* Where files come from is an ``ArtifactSource``: ``IndexSource`` reads the PEP 691 JSON simple
  API of the index pip is configured with (``PIP_INDEX_URL``, ``pip config``, else pip's own
  default); ``DirectorySource`` serves files from a local directory (tests, offline mirrors).
* The cache is ``$KVCORE_ARTIFACT_CACHE``, else ``$XDG_CACHE_HOME/kvcore/artifacts``, else
  ``~/.cache/kvcore/artifacts``. A download lands in ``<file>.part`` and is renamed only once
  its hash matches; a mismatching download is kept as ``<file>.rejected`` for inspection. A
  cached file whose hash no longer matches is refused and left alone (nothing is deleted).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from compat.matrix import Artifact, EngineRelease
from patchq.console import download_bar, info
from patchq.errors import ArtifactError, HashMismatch

CACHE_ENV = "KVCORE_ARTIFACT_CACHE"
_CHUNK = 1 << 20
_JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a release as a source lists it; ``sha256`` when the source publishes it."""

    filename: str
    url: str
    sha256: str | None
    size: int | None = None


class ArtifactSource(Protocol):
    """Lists the files of one release of a project."""

    def files(self, project: str, version: str) -> list[RemoteFile]:
        """Every file of ``project`` ``version``; raises ``ArtifactError`` if unreachable."""
        ...


def release_of(filename: str) -> tuple[str, Version] | None:
    """(canonical project name, version) of a wheel or sdist filename, ``None`` otherwise."""
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return canonicalize_name(name), version


def _of_release(files: list[RemoteFile], project: str, version: str) -> list[RemoteFile]:
    want = (canonicalize_name(project), Version(version))
    return [f for f in files if release_of(f.filename) == want]


@functools.cache
def _pip_config() -> dict[str, str]:
    """``pip config list`` as a dict (``global.index-url`` -> value); empty if pip fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    config = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip().strip("'\"")
    return config


def _pip_setting(name: str) -> str | None:
    env = os.environ.get(f"PIP_{name.upper().replace('-', '_')}")
    if env:
        return env
    config = _pip_config()
    for scope in (":env:", "download", "global", "install"):
        if f"{scope}.{name}" in config:
            return config[f"{scope}.{name}"]
    return None


def configured_index_url() -> str:
    """The index pip would use here: ``PIP_INDEX_URL``, else ``pip config``'s ``index-url``,
    else pip's built-in default."""
    url = _pip_setting("index-url")
    if url:
        return url
    try:
        from pip._internal.models.index import PyPI
    except ImportError as exc:
        raise ArtifactError(
            "no package index configured and pip is not importable here to name its default",
            hint="set PIP_INDEX_URL to the index to download pinned releases from",
        ) from exc
    return str(PyPI.simple_url)


def _ssl_context() -> ssl.SSLContext:
    cert = _pip_setting("cert")
    return ssl.create_default_context(cafile=cert if cert and Path(cert).exists() else None)


class IndexSource:
    """Files of a release from a PEP 691 JSON simple index (``index_url`` or pip's)."""

    def __init__(self, index_url: str | None = None) -> None:
        self.index_url = index_url or configured_index_url()

    def files(self, project: str, version: str) -> list[RemoteFile]:
        base = self.index_url.rstrip("/") + "/"
        page = urllib.parse.urljoin(base, f"{canonicalize_name(project)}/")
        request = urllib.request.Request(page, headers={"Accept": _JSON_ACCEPT})
        try:
            with urllib.request.urlopen(request, context=_ssl_context(), timeout=60) as resp:
                ctype = resp.headers.get("Content-Type", "")
                body = resp.read()
        except (urllib.error.URLError, OSError) as exc:
            raise ArtifactError(
                f"cannot read the index page {page}: {exc}",
                engine=project,
                version=version,
                hint="check network access to the index pip is configured with (pip config list)",
            ) from exc
        if "json" not in ctype:
            raise ArtifactError(
                f"the index at {self.index_url} does not serve the PEP 691 JSON API "
                f"(Content-Type {ctype!r})",
                engine=project,
                version=version,
                hint="point PIP_INDEX_URL at an index with the JSON simple API",
            )
        listed = [
            RemoteFile(
                filename=f["filename"],
                url=urllib.parse.urljoin(page, f["url"]),
                sha256=f.get("hashes", {}).get("sha256"),
                size=f.get("size"),
            )
            for f in json.loads(body)["files"]
        ]
        # downloads go over https, or the index's own scheme (a local file:// mirror)
        allowed = {"https", urllib.parse.urlsplit(self.index_url).scheme}
        for remote in listed:
            scheme = urllib.parse.urlsplit(remote.url).scheme
            if scheme not in allowed:
                raise ArtifactError(
                    f"the index at {self.index_url} lists {remote.filename} at {remote.url}: "
                    f"scheme {scheme!r} is neither https nor the index's own",
                    engine=project,
                    version=version,
                    hint="use an index that serves its files over https or its own scheme",
                )
        return _of_release(listed, project, version)


class DirectorySource:
    """Files of a release from a local directory (tests, offline mirrors); hashes computed."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def files(self, project: str, version: str) -> list[RemoteFile]:
        listed = [
            RemoteFile(p.name, p.resolve().as_uri(), sha256_of(p), p.stat().st_size)
            for p in sorted(self.directory.iterdir())
            if p.is_file()
        ]
        return _of_release(listed, project, version)


def default_cache_dir() -> Path:
    """Where artifacts are cached when no directory is given (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvcore" / "artifacts"


def sha256_of(path: Path) -> str:
    """The hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock next to ``path`` (several sessions share one cache)."""
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class ArtifactCache:
    """Verified local copies of pinned artifacts (see the module docstring)."""

    def __init__(self, directory: Path | None = None, source: ArtifactSource | None = None):
        self.directory = Path(directory) if directory else default_cache_dir()
        self._source = source

    @property
    def source(self) -> ArtifactSource:
        """Where missing files are downloaded from (the configured index by default)."""
        if self._source is None:
            self._source = IndexSource()
        return self._source

    def fetch(self, release: EngineRelease, kind: str, python: str | None = None) -> Path:
        """The verified local path of ``release``'s ``kind`` artifact (the wheel for
        ``python`` where wheels are per interpreter), downloading it if not cached.

        Raises ``compat.MatrixError`` if the matrix pins no such artifact, ``ArtifactError``
        if the source lacks it and ``HashMismatch`` if its bytes differ from the pinned hash.
        """
        return self.fetch_artifact(release, release.artifact(kind, python))

    def fetch_artifact(self, release: EngineRelease, artifact: Artifact) -> Path:
        """``fetch`` for an ``Artifact`` already picked from ``release``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / artifact.filename
        with _locked(path):
            if not path.exists():
                self._download(release, artifact, path)
            actual = sha256_of(path)
            if actual != artifact.sha256:
                raise HashMismatch(
                    f"cached {path} has sha256 {actual}, compat/matrix.toml pins "
                    f"{artifact.sha256}; refusing to use it",
                    engine=release.name,
                    version=release.version,
                    file=artifact.filename,
                    hint=f"if the pin is right, delete that one file (rm {path}) and run again",
                )
        return path

    def _download(self, release: EngineRelease, artifact: Artifact, path: Path) -> None:
        ctx = {"engine": release.name, "version": release.version, "file": artifact.filename}
        listed = {f.filename: f for f in self.source.files(release.name, release.version)}
        remote = listed.get(artifact.filename)
        if remote is None:
            raise ArtifactError(
                f"the index lists no {artifact.filename} (it has: {sorted(listed) or 'nothing'})",
                hint="check the filename pinned in compat/matrix.toml",
                **ctx,
            )
        if remote.sha256 and remote.sha256 != artifact.sha256:
            raise HashMismatch(
                f"the index publishes sha256 {remote.sha256} for {artifact.filename}, "
                f"compat/matrix.toml pins {artifact.sha256}; not downloading it",
                hint="check which of the two is right before changing compat/matrix.toml",
                **ctx,
            )
        part = path.with_name(path.name + ".part")
        digest = hashlib.sha256()
        try:
            stream = urllib.request.urlopen(remote.url, context=_ssl_context(), timeout=120)
        except (urllib.error.URLError, OSError) as exc:
            raise ArtifactError(
                f"cannot download {remote.url}: {exc}", hint="run again when it is reachable", **ctx
            ) from exc
        info(f"downloading {artifact.filename} into {self.directory}")
        with (
            stream,
            open(part, "wb") as fh,
            download_bar(artifact.filename, remote.size) as (bar, task),
        ):
            while chunk := stream.read(_CHUNK):
                fh.write(chunk)
                digest.update(chunk)
                bar.advance(task, len(chunk))
        if digest.hexdigest() != artifact.sha256:
            rejected = path.with_name(path.name + ".rejected")
            os.replace(part, rejected)
            raise HashMismatch(
                f"downloaded bytes have sha256 {digest.hexdigest()}, compat/matrix.toml pins "
                f"{artifact.sha256}; kept the download as {rejected} and used nothing",
                hint="check the pin and the index; delete the .rejected file when done",
                **ctx,
            )
        os.replace(part, path)
