"""Backend fixtures shared by the VMM and virtual-tensor tests.

``backend`` is parametrized over every backend: ``host`` always runs; ``cuda`` is marked
``gpu`` and skips without a GPU (see ``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcore.vmm import VmmBackend, open_backend

HOST_DEVICE_BYTES = 64 << 20

BACKEND_PARAMS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def make_backend(name: str) -> VmmBackend:
    """A fresh backend; the host one gets a small device so tests can exhaust it."""
    if name == "host":
        return open_backend("host", device_bytes=HOST_DEVICE_BYTES)
    return open_backend(name)


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> Iterator[VmmBackend]:
    b = make_backend(request.param)
    try:
        yield b
    finally:
        b.close()
