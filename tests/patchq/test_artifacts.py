"""Pinned artifacts: found by exact name, verified by sha256, tampering refused."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from patchq.artifacts import ArtifactCache, DirectorySource, IndexSource, RemoteFile, sha256_of
from patchq.errors import ArtifactError, HashMismatch
from patchq.workspace import Workspace


def test_fetch_downloads_once_and_verifies_on_every_use(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    path = ws.cache.fetch(rel, "wheel", "3.11")
    assert path.parent == ws.cache.directory
    assert sha256_of(path) == rel.artifact("wheel").sha256
    assert ws.cache.fetch(rel, "wheel", "3.11") == path
    assert not list(ws.cache.directory.glob("*.part"))


def test_a_tampered_cached_artifact_is_refused_and_left_alone(ws: Workspace) -> None:
    rel = ws.release("toyeng", "1.0.0")
    path = ws.cache.fetch(rel, "wheel", "3.11")
    neighbour = ws.cache.directory / "unrelated.whl"
    neighbour.write_bytes(b"keep me")
    path.write_bytes(path.read_bytes() + b"tampered")
    with pytest.raises(HashMismatch, match="refusing to use it") as err:
        ws.cache.fetch(rel, "wheel", "3.11")
    assert err.value.file == path.name
    assert f"rm {path}" in err.value.hint
    assert path.exists() and neighbour.read_bytes() == b"keep me"


def test_a_download_with_the_wrong_bytes_is_kept_aside_and_never_used(
    ws: Workspace, tmp_path: Path, index_dir: Path
) -> None:
    bad_index = tmp_path / "bad-index"
    bad_index.mkdir()
    original = next(index_dir.glob("toyeng-1.0.0-*.whl"))
    (bad_index / original.name).write_bytes(original.read_bytes()[:-10] + b"0123456789")
    cache = ArtifactCache(tmp_path / "fresh-cache", DirectorySource(bad_index))
    rel = ws.release("toyeng", "1.0.0")
    with pytest.raises(HashMismatch, match="not downloading it"):
        cache.fetch(rel, "wheel", "3.11")  # the index itself publishes the other hash

    class Lying(DirectorySource):  # publishes the pinned hash, serves other bytes
        def files(self, project: str, version: str) -> list[RemoteFile]:
            pinned = rel.artifact("wheel").sha256
            listed = super().files(project, version)
            return [dataclasses.replace(f, sha256=pinned) for f in listed]

    cache = ArtifactCache(tmp_path / "fresh-cache", Lying(bad_index))
    with pytest.raises(HashMismatch, match=r"kept the download as .*\.rejected"):
        cache.fetch(rel, "wheel", "3.11")
    assert not (cache.directory / original.name).exists()
    assert (cache.directory / f"{original.name}.rejected").exists()


def test_a_file_missing_from_the_index_names_what_the_index_has(
    ws: Workspace, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cache = ArtifactCache(tmp_path / "c", DirectorySource(empty))
    with pytest.raises(ArtifactError, match=r"lists no toyeng-1\.0\.0-.*nothing"):
        cache.fetch(ws.release("toyeng", "1.0.0"), "wheel")


class _Index(http.server.BaseHTTPRequestHandler):
    """A PEP 691 JSON simple index on localhost over ``files`` (``{name: bytes}``)."""

    files: ClassVar[dict[str, bytes]] = {}
    json_api = True
    url_prefix = "../../files/"  # what each file's "url" starts with

    def do_GET(self) -> None:
        if self.path == "/simple/toyeng/":
            if not self.json_api:
                self._send(b"<html></html>", "text/html")
                return
            listing = [
                {
                    "filename": name,
                    "url": f"{self.url_prefix}{name}",
                    "hashes": {"sha256": hashlib.sha256(data).hexdigest()},
                    "size": len(data),
                }
                for name, data in self.files.items()
            ]
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": "toyeng", "files": listing})
            self._send(body.encode(), "application/vnd.pypi.simple.v1+json")
        elif self.path.startswith("/files/") and self.path[7:] in self.files:
            self._send(self.files[self.path[7:]], "application/octet-stream")
        else:
            self.send_error(404)

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def local_index(index_dir: Path) -> Iterator[str]:
    _Index.files = {p.name: p.read_bytes() for p in index_dir.iterdir()}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()
    _Index.json_api = True
    _Index.url_prefix = "../../files/"


def test_index_source_reads_the_json_api_of_pips_configured_index(
    ws: Workspace, tmp_path: Path, local_index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", local_index)
    source = IndexSource()
    assert source.index_url == local_index
    files = source.files("toyeng", "1.0.1")
    assert [f.filename for f in files] == ["toyeng-1.0.1-cp38-abi3-manylinux_2_28_x86_64.whl"]
    assert files[0].url.startswith(local_index.removesuffix("/simple") + "/files/")
    path = ArtifactCache(tmp_path / "c", source).fetch(ws.release("toyeng", "1.0"), "wheel")
    assert sha256_of(path) == ws.release("toyeng", "1.0").artifact("wheel").sha256


def test_an_index_without_the_json_api_is_reported(local_index: str) -> None:
    _Index.json_api = False
    with pytest.raises(ArtifactError, match="does not serve the PEP 691 JSON API"):
        IndexSource(local_index).files("toyeng", "1.0.0")


def test_an_index_listing_files_under_another_scheme_is_refused(local_index: str) -> None:
    _Index.url_prefix = "file:///etc/"  # a hostile or broken index
    with pytest.raises(ArtifactError, match="neither https nor the index's own"):
        IndexSource(local_index).files("toyeng", "1.0.1")
