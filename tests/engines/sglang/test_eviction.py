"""Page-aware radix eviction inside SGLang's real ``RadixCache`` (the Python tree).

MHA, 2 layers x K/V, 2 heads x 64 dims, bf16, SGLang pages of 16 tokens: a 64 KiB host
page holds 256 tokens. Physical page 0 holds block 0 (SGLang's padded page) and 240 tokens
of a running request; page 1 holds cached prefix A (older) and 128 tokens of a running
request; page 2 holds cached prefix B (newer) alone. LRU evicts A first, which returns no
page; page-aware eviction evicts B first, which returns page 2.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvcore.adapters.sglang import eviction

from .harness import matched, requires_fork
from .test_conformance import radix

pytestmark = requires_fork


def _requires_allocator_eviction() -> Any:
    from kvcore.adapters.sglang.allocators import _eviction_asks_allocator

    return pytest.mark.skipif(
        not _eviction_asks_allocator(),
        reason="this SGLang's pre-allocation eviction does not go through the allocator "
        "(evict_to_free_tokens, 0.5.23+), where kvcore installs the page-aware order",
    )


PAGE = 4 * (64 << 10)  # device bytes of one page id: 4 handles of 64 KiB


def _key(base: int, n: int) -> RadixKey:
    return RadixKey(token_ids=array("q", range(base, base + n)))


def _setup(make: Any, **kvcore: Any) -> tuple[Any, Any, Any]:
    e = make("on", size=2048, page_size=16, **kvcore)
    a = e.allocator
    tree = radix(a, 16)
    a.alloc(240)  # a running request: page 0 (with block 0) is full
    kv_a = a.alloc(128)  # page 1, first half
    a.alloc(128)  # a running request: page 1, second half
    kv_b = a.alloc(256)  # page 2, alone
    tree.insert(InsertParams(key=_key(0, 128), value=kv_a))
    tree.insert(InsertParams(key=_key(10_000, 256), value=kv_b))
    assert e.pages().in_use == 3
    return e, a, tree


def _cached(tree: Any, base: int, n: int) -> int:
    return matched(tree.match_prefix(MatchPrefixParams(key=_key(base, n))))


def test_sglang_lru_alone_evicts_the_older_leaf_and_returns_no_page(make: Any) -> None:
    """The baseline: SGLang's own strategy, as the tree is built (nothing installed)."""
    e, _, tree = _setup(make)
    assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    assert _cached(tree, 0, 128) == 0 and _cached(tree, 10_000, 256) == 256
    assert e.pages().in_use == 3  # A's tokens share page 1 with a running request


def test_page_aware_eviction_returns_a_whole_page_first(make: Any) -> None:
    e, a, tree = _setup(make)
    assert eviction.install(tree, a) is True
    assert eviction.install(tree, a) is True  # idempotent: wrapped once
    assert isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
    assert not isinstance(tree.eviction_strategy.base, eviction.PageAwareEviction)
    assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 256
    assert _cached(tree, 0, 128) == 128 and _cached(tree, 10_000, 256) == 0
    assert e.pages().in_use == 2  # page 2 went back
    # then upstream's order among the rest: A goes next
    assert tree.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 128


@_requires_allocator_eviction()
def test_sglangs_allocation_path_installs_it(make: Any) -> None:
    """``evict_from_tree_cache`` (what SGLang runs before every allocation) under a budget
    of the three mapped pages: the shortfall is met by evicting B, returning its page."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    e, a, tree = _setup(make, limit_bytes=3 * PAGE + (64 << 10))
    assert a.available_size() < 128
    evict_from_tree_cache(tree, 128)
    assert isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
    assert _cached(tree, 10_000, 256) == 0 and _cached(tree, 0, 128) == 128
    assert e.pages().in_use == 2
    assert a.available_size() >= 128
    assert a.alloc(128) is not None


@_requires_allocator_eviction()
def test_the_cached_token_bound_evicts_page_aware(make: Any) -> None:
    """``max_cached_tokens=128`` with memory to spare: only the bound evicts (256 of the 384
    cached tokens). LRU would take A and then B (384 tokens, no page from A); page-aware
    eviction takes B alone, returns its page and keeps A cached."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    e, _, tree = _setup(make, max_cached_tokens=128)
    evict_from_tree_cache(tree, 16)
    assert tree.evictable_size() == 128
    assert _cached(tree, 0, 128) == 128 and _cached(tree, 10_000, 256) == 0
    assert e.pages().in_use == 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_empties_a_page_reads_the_ledger(make: Any, page_size: int) -> None:
    e = make("on", size=2048, page_size=page_size)
    a = e.allocator
    tokens_per_page = 256
    first = a.alloc(tokens_per_page - page_size)  # page 0 minus block 0
    second = a.alloc(tokens_per_page)  # page 1 whole
    strategy = eviction.PageAwareEviction(None, a.ledger, page_size, lambda v: v)
    assert strategy.empties_a_page(second)
    assert not strategy.empties_a_page(first)  # page 0 keeps reserved block 0: never returned
    assert not strategy.empties_a_page(second[: tokens_per_page // 2])
    assert not strategy.empties_a_page(second[:0])


def test_a_tree_without_a_python_strategy_is_left_alone(make: Any) -> None:
    """What the Rust ``TreeCore`` looks like to ``install``: a ``tree_core`` without an
    ``eviction_strategy``; nothing is changed and ``False`` says so."""
    from types import SimpleNamespace

    e = make("on", size=512, page_size=16)
    native = SimpleNamespace(tree_core=SimpleNamespace())
    assert eviction.install(native, e.allocator) is False
    assert vars(native.tree_core) == {}
