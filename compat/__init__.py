"""The engine version x GPU backend matrix (``compat/matrix.toml``) and its readers.

This package is repository tooling, not part of the ``kvcore`` distribution: ``noxfile.py``,
the tests and the README renderer import it from the checkout.
"""

from compat.matrix import (
    BACKENDS,
    STATUSES,
    Artifact,
    BackendStatus,
    EngineRelease,
    MatrixError,
    load,
)

__all__ = [
    "BACKENDS",
    "STATUSES",
    "Artifact",
    "BackendStatus",
    "EngineRelease",
    "MatrixError",
    "load",
]
