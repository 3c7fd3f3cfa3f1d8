"""Backend parameters shared by the VMM and virtual-tensor tests.

``host`` always runs; ``cuda`` is marked ``gpu`` and skips without a GPU (see
``tests/conftest.py``).
"""

from __future__ import annotations

import pytest

from kvcore.vmm import VmmBackend, open_backend

HOST_DEVICE_BYTES = 64 << 20

BACKEND_PARAMS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def make_backend(name: str, **options: object) -> VmmBackend:
    """A fresh backend; the host one gets a small device so tests can exhaust it."""
    if name == "host":
        options.setdefault("device_bytes", HOST_DEVICE_BYTES)
    return open_backend(name, **options)
