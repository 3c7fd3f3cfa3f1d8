"""Harness for tests against the real SGLang KV-cache classes (allocators, pools, radix cache).

These tests need SGLang installed (the pinned upstream wheel or the forked ``+kvcore`` one):
the ``test-sglang-<version>`` nox sessions build that environment and run them three ways
(upstream wheel; forked wheel with elastic KV off; forked wheel with it on). Without SGLang
(the plain ``tests`` session) ``conftest.py`` leaves the directory uncollected.

``kv_mode`` parametrises each conformance test over ``off`` (SGLang's own buffers and
allocator) and ``on`` (kvcore's, through the same seams the patch series adds); ``on`` skips
on the upstream wheel, which lacks the seams.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sglang
import torch
from sglang.srt.mem_cache import memory_pool

PATCHED = hasattr(memory_pool, "KV_BUFFER_HOOK")
"""Whether the installed SGLang is the kvcore fork (the series' buffer seam is present)."""

# Small on purpose: a 64 KiB host granularity keeps pages small, so a few hundred tokens
# span several physical pages.
HOST = {"backend": "host", "backend_options": {"device_bytes": 1 << 30, "granularity": 1 << 16}}


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


@dataclass
class Engine:
    """One SGLang KV stack built for a test: pool, allocator, and the kvcore scope if on."""

    mode: str
    pool: Any
    allocator: Any
    scope: Any = None

    @property
    def manager(self) -> Any:
        return self.pool.kvcore_manager

    def pages(self) -> Any:
        """Page-allocator stats once background unmaps have settled."""
        self.manager.pages.flush()
        return self.manager.stats()


def build(
    mode: str,
    *,
    size: int = 512,
    page_size: int = 16,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 64,
    mla: bool = False,
    device: str = "cpu",
    **kvcore: Any,
) -> Engine:
    """Build a KV pool and its allocator the way SGLang's configurator does, with kvcore
    (``mode="on"``, options ``HOST | kvcore``; on ``device="cuda"`` the ``cuda`` backend at
    its own granularity) or without (``"off"``)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    def make_pool() -> Any:
        if mla:
            return memory_pool.MLATokenToKVPool(
                size=size,
                page_size=page_size,
                dtype=torch.bfloat16,
                kv_lora_rank=head_dim,
                qk_rope_head_dim=16,
                layer_num=layers,
                device=device,
                enable_memory_saver=False,
            )
        return memory_pool.MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=torch.bfloat16,
            head_num=heads,
            head_dim=head_dim,
            layer_num=layers,
            device=device,
            enable_memory_saver=False,
        )

    def make_allocator(pool: Any) -> Any:
        if page_size == 1:
            return TokenToKVPoolAllocator(size, torch.bfloat16, device, pool, False)
        return PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, device, pool, False)

    if mode == "off":
        pool = make_pool()
        return Engine(mode, pool, make_allocator(pool))
    from kvcore.adapters.sglang import ElasticScope

    backend = HOST if device == "cpu" else {"backend": "cuda"}
    scope = ElasticScope({**backend, **kvcore})
    with scope:
        pool = make_pool()
    return Engine(mode, pool, scope.allocator(make_allocator(pool)), scope)


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
