"""SGLang's real KV pool and allocator, built the way its configurator builds them, with
kvcore's elastic memory (``mode="on"``, through the seams the kvcore fork adds) or without
(``"off"``). Needs SGLang installed: the pinned upstream wheel or the forked ``+kvcore`` one
(``on`` needs the fork)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache import memory_pool

PATCHED = hasattr(memory_pool, "KV_BUFFER_HOOK")
"""Whether the installed SGLang is the kvcore fork (the series' buffer seam is present)."""

# Small on purpose: a 64 KiB host granularity keeps pages small, so a few hundred tokens
# span several physical pages.
HOST = {"backend": "host", "backend_options": {"device_bytes": 1 << 30, "granularity": 1 << 16}}


@dataclass
class Engine:
    """One SGLang KV stack: pool, allocator, and the kvcore scope if on."""

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


def radix(allocator: Any, page_size: int) -> Any:
    """SGLang's ``RadixCache`` over ``allocator``, with a small request-to-token pool."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    req_pool = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    return RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        )
    )


def unified_radix(allocator: Any, page_size: int) -> Any:
    """SGLang's serving tree (``UnifiedRadixCache``, full attention only) on the tree core
    ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` selects now (SGLang 0.5.23 and later)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    req = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    return UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=req,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            tree_components=(ComponentType.FULL,),
        )
    )
