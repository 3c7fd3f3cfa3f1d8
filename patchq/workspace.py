"""Where the patch-queue tooling reads and writes: one ``Workspace`` per repository checkout.

A workspace ties together the repository root (``patches/``, ``forks/``, ``dist/`` under it),
the compat matrix it reads releases from and the artifact cache. Tests build one over a
temporary directory, a temporary matrix and a local artifact source, so nothing touches the
real checkout or the network.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from compat import matrix
from compat.matrix import EngineRelease
from patchq.artifacts import ArtifactCache

REPO_ROOT = Path(__file__).resolve().parent.parent


def running_python() -> str:
    """The running interpreter as the matrix names Pythons (``"3.11"``)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class Workspace:
    """The repository root, matrix file and artifact cache the commands work on."""

    root: Path = REPO_ROOT
    matrix_path: Path = matrix.MATRIX_PATH
    cache: ArtifactCache = field(default_factory=ArtifactCache)

    def releases(self) -> list[EngineRelease]:
        """Every pinned release in matrix order."""
        return matrix.load(self.matrix_path)

    def release(self, engine: str, version: str) -> EngineRelease:
        """The pinned release (full or short version); raises ``compat.MatrixError``."""
        return matrix.find(engine, version, self.matrix_path)

    def series_dir(self, rel: EngineRelease) -> Path:
        """``patches/<engine>/<version>/`` of this workspace."""
        return self.root / rel.patch_dir

    def fork_dir(self, rel: EngineRelease) -> Path:
        """``forks/<engine>/<version>/`` of this workspace."""
        return self.root / "forks" / rel.name / rel.version

    @property
    def dist_dir(self) -> Path:
        """Where forked wheels are written."""
        return self.root / "dist"
