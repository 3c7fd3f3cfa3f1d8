"""A synthetic upstream engine for the patch-queue tests, built per test, fully offline.

``toyeng`` is published as wheels shaped like the real engines' (a package with Python
sources, a compiled extension and a binary data file, a ``.data`` scripts dir, a WHEEL file
whose tag differs from the filename's platform tag as vLLM's does). Releases:

* 1.0.0: pinned in the test matrix; the series is written against it;
* 1.0.1: unrelated upstream edits only (a patch-free rebase);
* 1.1.0: rewrites the lines ``PATCHED_LINE`` patches (a rebase that conflicts);
* 2.0.0: moves ``toyeng/core.py`` to ``toyeng/pool.py`` unchanged (the patch must follow);
* 3.0.0: drops ``toyeng/core.py`` (the patched file is gone).

The "index" is a directory served by ``DirectorySource``; the cache is per test.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from patchq import gitcmd
from patchq.artifacts import ArtifactCache, DirectorySource, sha256_of
from patchq.workspace import Workspace

ENGINE = "toyeng"
PLATFORM = "manylinux_2_28_x86_64"

CORE_100 = """\
\"\"\"The toy engine's block pool.\"\"\"


class BlockPool:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))

    def get_new_blocks(self, n):
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def free_blocks(self, ids):
        self.free.extend(ids)
"""
# The line the test patch replaces; 1.1.0 rewrites it upstream too.
PATCHED_LINE = "        taken, self.free = self.free[:n], self.free[n:]\n"


def release_sources(version: str) -> dict[str, str]:
    """The Python sources of toyeng ``version``."""
    core = CORE_100
    util = "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"
    if version in ("1.0.1", "1.1.0"):
        util += "\n\ndef ceil_div(a, b):\n    return -(-a // b)\n"
    if version == "1.1.0":
        core = core.replace(
            PATCHED_LINE, "        taken = self.free[:n]\n        del self.free[:n]\n"
        )
    if version in ("2.0.0", "3.0.0"):
        moved = {"toyeng/pool.py": core} if version == "2.0.0" else {}
        return {
            "toyeng/__init__.py": f'__version__ = "{version}"\n',
            **moved,
            "toyeng/util.py": util,
            "toyeng/config/defaults.json": '{"block_size": 16}\n',
        }
    return {
        "toyeng/__init__.py": f'__version__ = "{version}"\n',
        "toyeng/core.py": core,
        "toyeng/util.py": util,
        "toyeng/config/defaults.json": '{"block_size": 16}\n',
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_release_wheel(directory: Path, version: str) -> Path:
    """Write the toyeng ``version`` wheel into ``directory`` and return its path."""
    dist_info = f"{ENGINE}-{version}.dist-info"
    members: dict[str, bytes] = {k: v.encode() for k, v in release_sources(version).items()}
    members["toyeng/_native.abi3.so"] = b"\x7fELF\0\0fake-extension-" + version.encode()
    members["toyeng/weights.bin"] = b"\0\1\2\3binary"
    members[f"{ENGINE}-{version}.data/scripts/toyeng-serve"] = b"#!python\nprint('serve')\n"
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {ENGINE}\nVersion: {version}\nSummary: toy\n\n".encode()
    )
    # Like vLLM's: the WHEEL tag says linux_x86_64 while the filename says manylinux.
    members[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
        b"Tag: cp38-abi3-linux_x86_64\n"
    )
    record = [_record_line(n, d) for n, d in members.items()] + [f"{dist_info}/RECORD,,"]
    members[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{ENGINE}-{version}-cp38-abi3-{PLATFORM}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 2, 3, 4, 6))
            info.external_attr = (0o755 if "scripts/" in name else 0o644) << 16
            zf.writestr(info, data)
    return path


def matrix_entry(wheel: Path, version: str, short: str) -> str:
    """A compat matrix ``[[engine]]`` block pinning ``wheel``."""
    return f"""
[[engine]]
name = "{ENGINE}"
version = "{version}"
short = "{short}"
python = ["3.11"]

[[engine.artifact]]
kind = "wheel"
filename = "{wheel.name}"
sha256 = "{sha256_of(wheel)}"

[engine.backends]
cuda = {{ status = "untested", note = "toy" }}
rocm = {{ status = "untested", note = "toy" }}
host = {{ status = "tested-cpu", note = "toy" }}
"""


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic index: the three toyeng releases as wheels (built once)."""
    directory = tmp_path_factory.mktemp("index")
    for version in ("1.0.0", "1.0.1", "1.1.0", "2.0.0", "3.0.0"):
        build_release_wheel(directory, version)
    return directory


@pytest.fixture
def ws(tmp_path: Path, index_dir: Path) -> Workspace:
    """A workspace over a temporary repo root pinning toyeng 1.0.0 (short ``1.0``)."""
    root = tmp_path / "repo"
    root.mkdir()
    matrix = tmp_path / "matrix.toml"
    wheel = next(index_dir.glob(f"{ENGINE}-1.0.0-*.whl"))
    matrix.write_text("# test matrix\n" + matrix_entry(wheel, "1.0.0", "1.0"))
    cache = ArtifactCache(tmp_path / "cache", DirectorySource(index_dir))
    return Workspace(root=root, matrix_path=matrix, cache=cache)


def commit_patch(fork: Path, path: str, old: str, new: str, subject: str, trailers: bool = True):
    """Edit ``path`` in ``fork`` (replace ``old`` by ``new``) and commit it as one patch."""
    target = fork / path
    text = target.read_text() if target.exists() else ""
    assert old in text, f"{old!r} not in {path}"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text.replace(old, new, 1) if old else new)
    body = (
        "Why: the kvcore seam.\nUpstream: not-suitable: kvcore-specific\n"
        "Drop-when: upstream grows an allocator hook.\n"
        if trailers
        else "No trailers here.\n"
    )
    gitcmd.git(fork, "add", path)
    gitcmd.git(fork, "commit", "-q", "-m", f"{subject}\n\n{body}", author_date=True)
