"""The ``backend`` fixture: every VMM backend (see ``tests/vmm_backends.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcore.vmm import VmmBackend
from tests.vmm_backends import BACKEND_PARAMS, make_backend


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> Iterator[VmmBackend]:
    b = make_backend(request.param)
    try:
        yield b
    finally:
        b.close()
