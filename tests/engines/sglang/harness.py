"""Fixtures for tests against the real SGLang KV-cache classes (allocators, pools, radix cache).

These tests need SGLang installed (the pinned upstream wheel or the forked ``+kvcore`` one):
the ``test-sglang-<version>`` nox sessions build that environment and run them three ways
(upstream wheel; forked wheel with elastic KV off; forked wheel with it on). Without SGLang
(the plain ``tests`` session) ``conftest.py`` leaves the directory uncollected.

The stacks themselves come from ``harness.sglang_kv`` (the SGLang benchmarks build theirs
there too); this module holds the pytest hooks, fixtures and marks around it.

``kv_mode`` parametrises each conformance test over ``off`` (SGLang's own buffers and
allocator) and ``on`` (kvcore's, through the same seams the patch series adds); ``on`` skips
on the upstream wheel, which lacks the seams.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import sglang

from harness.sglang_kv import HOST as HOST  # re-exported: the tests take it from here
from harness.sglang_kv import PATCHED, Engine, build


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"sglang {sglang.__version__} ({'kvcore fork' if PATCHED else 'upstream'}); "
        f"KVCORE_SGLANG_EXPECT={os.environ.get('KVCORE_SGLANG_EXPECT', '-')}"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expect = os.environ.get("KVCORE_SGLANG_EXPECT")
    if expect and expect != ("patched" if PATCHED else "upstream"):
        raise pytest.UsageError(
            f"KVCORE_SGLANG_EXPECT={expect} but the installed SGLang is "
            f"{'the kvcore fork' if PATCHED else 'upstream'}"
        )


@pytest.fixture(params=["off", "on"])
def kv_mode(request: pytest.FixtureRequest) -> str:
    if request.param == "on" and not PATCHED:
        pytest.skip("elastic KV needs the kvcore fork of SGLang")
    return str(request.param)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Collects engines built in a test and closes their kvcore memory afterwards."""
    built: list[Engine] = []
    yield built
    for e in built:
        if e.scope is not None:
            e.scope.close()


@pytest.fixture
def make(engines: list[Engine]) -> Any:
    def _make(mode: str, **kwargs: Any) -> Engine:
        e = build(mode, **kwargs)
        engines.append(e)
        return e

    return _make


requires_fork = pytest.mark.skipif(not PATCHED, reason="needs the kvcore fork of SGLang")

_paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
requires_cpu_paged_kernels = pytest.mark.skipif(
    not hasattr(_paged, "alloc_decode_naive"),
    reason=f"SGLang {sglang.__version__}'s paged alloc_extend/alloc_decode launch Triton "
    "kernels unconditionally (no CPU path before 0.5.23)",
)


def matched(result: Any) -> int:
    """Tokens a radix ``match_prefix`` matched on the device (the field's name changed
    after 0.5.20: ``device_indices`` -> ``device_prefix_len``)."""
    n = getattr(result, "device_prefix_len", None)
    return int(n) if n is not None else len(result.device_indices)
