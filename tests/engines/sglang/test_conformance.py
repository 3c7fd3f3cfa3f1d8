"""SGLang's allocator, pool and radix-cache contract, run three ways.

Each test runs with elastic KV ``off`` and ``on`` (``kv_mode``); the ``test-sglang-*`` session
runs this file against the upstream wheel (``on`` skips) and against the forked wheel. The
contract is what SGLang's own unit tests for these classes check (they are not on the package
registry; the facts were read from its repository's test/ tree): unique page-aligned indices,
never the padded slot 0, exact capacity accounting, ``None`` when the pool is short, frees
restoring capacity, radix insert/match/lock/evict returning KV indices to the allocator, and
K/V writes readable at the written slots.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from harness.sglang_kv import radix

from .harness import matched, requires_cpu_paged_kernels


def extend(allocator: Any, prefix: list[int], seq: list[int], last_loc: list[int]) -> Any:
    p = torch.tensor(prefix, dtype=torch.int64)
    s = torch.tensor(seq, dtype=torch.int64)
    n = int((s - p).sum())
    return allocator.alloc_extend(p, p, s, s, torch.tensor(last_loc, dtype=torch.int64), n)


def test_paged_alloc_is_page_aligned_unique_and_exact(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=512, page_size=16)
    a = e.allocator
    assert a.available_size() == 512
    idx = a.alloc(64)
    assert idx.shape == (64,)
    assert len(set(idx.tolist())) == 64
    assert 0 not in idx.tolist()  # slot 0's page absorbs padded writes
    pages = idx.view(-1, 16)
    assert torch.equal(pages - pages[:, :1], torch.arange(16).expand(4, 16))
    assert (pages[:, 0] % 16 == 0).all()
    assert a.available_size() == 512 - 64
    a.free(idx)
    assert a.available_size() == 512


def test_paged_alloc_returns_none_when_short(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=256, page_size=16)
    a = e.allocator
    held = a.alloc(256)
    assert held is not None and held.numel() == 256
    assert a.available_size() == 0
    assert a.alloc(16) is None
    assert a.available_size() == 0
    a.free(held)
    assert a.available_size() == 256


@requires_cpu_paged_kernels
def test_alloc_extend_continues_partial_pages(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=512, page_size=16)
    a = e.allocator
    first = extend(a, [0, 0], [20, 5], [-1, -1])
    assert first.numel() == 25
    assert len(set(first.tolist())) == 25
    # request 0: tokens 16..19 on its second page, request 1: 0..4 on its own page
    r0, r1 = first[:20], first[20:]
    assert (r0[:16] // 16).unique().numel() == 1 and (r0[16:] // 16).unique().numel() == 1
    assert (r1 // 16).unique().numel() == 1
    before = a.available_size()
    more = extend(a, [20, 5], [30, 21], [int(r0[-1]), int(r1[-1])])
    # request 0 fills its partial page (20..31 -> no new page up to 32); request 1 needs one
    assert more[:10].tolist() == list(range(int(r0[-1]) + 1, int(r0[-1]) + 11))
    assert more[10:21].tolist() == list(range(int(r1[-1]) + 1, int(r1[-1]) + 12))
    assert more[21:].tolist()[0] % 16 == 0
    assert a.available_size() == before - 16


@requires_cpu_paged_kernels
def test_alloc_decode_takes_a_page_only_at_a_boundary(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=512, page_size=16)
    a = e.allocator
    first = extend(a, [0, 0], [16, 7], [-1, -1])
    last = torch.tensor([int(first[15]), int(first[-1])])
    seq = torch.tensor([17, 8])
    before = a.available_size()
    out = a.alloc_decode(seq, seq, last)
    assert out[0] % 16 == 0 and out[0] // 16 != first[15] // 16  # new page for request 0
    assert int(out[1]) == int(first[-1]) + 1  # request 1 continues its page
    assert a.available_size() == before - 16


def test_free_segment_and_free_group(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=512, page_size=16)
    a = e.allocator
    x, y = a.alloc(32), a.alloc(48)
    a.free_group_begin()
    a.free_segment(x, start_pos=0)
    a.free(y)
    assert a.available_size() == 512 - 80  # deferred until the group ends
    a.free_group_end()
    assert a.available_size() == 512


def test_clear_restores_capacity(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=256, page_size=16)
    a = e.allocator
    a.alloc(128)
    a.clear()
    assert a.available_size() == 256
    assert a.alloc(256) is not None


def test_token_allocator(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=300, page_size=1)
    a = e.allocator
    assert a.available_size() == 300
    idx = a.alloc(120)
    assert len(set(idx.tolist())) == 120 and 0 not in idx.tolist()
    assert a.alloc(181) is None
    rest = a.alloc(180)
    assert a.available_size() == 0
    a.free(idx)
    a.free(rest)
    assert a.available_size() == 300


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_pool_writes_read_back(kv_mode: str, make: Any, mla: bool) -> None:
    e = make(kv_mode, size=256, page_size=16, mla=mla)
    pool, a = e.pool, e.allocator
    idx = a.alloc(32)
    buffers = pool.kv_buffer if mla else pool.k_buffer
    assert buffers[0].shape[0] == 256 + 16
    for layer, buf in enumerate(buffers):
        vals = torch.randn(32, *buf.shape[1:]).to(buf.dtype)
        buf[idx] = vals
        assert torch.equal(buf[idx], vals), layer
    if not mla:
        v = torch.full((32, *pool.v_buffer[1].shape[1:]), 3.0, dtype=pool.v_buffer[1].dtype)
        pool.v_buffer[1][idx] = v
        assert torch.equal(pool.get_value_buffer(1)[idx], v)


def test_radix_insert_match_lock_evict(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=512, page_size=16)
    a = e.allocator
    tree = radix(a, 16)
    tokens = list(range(1000, 1064))
    kv = a.alloc(64)
    tree.insert(InsertParams(key=RadixKey(token_ids=array("q", tokens)), value=kv))
    assert tree.evictable_size() == 64
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=array("q", [*tokens, 7]))))
    assert matched(m) == 64
    # a locked path is not evictable
    tree.inc_lock_ref(m.last_device_node)
    assert tree.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 0
    tree.dec_lock_ref(m.last_device_node)
    assert tree.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 64
    assert tree.evictable_size() == 0
    assert a.available_size() == 512


def test_radix_page_aligned_match_extra_key_and_lock_accounting(kv_mode: str, make: Any) -> None:
    e = make(kv_mode, size=512, page_size=16)
    a = e.allocator
    tree = radix(a, 16)
    tokens = array("q", range(1, 41))  # 40 tokens: only 2 whole pages are cached
    kv = a.alloc(48)
    tree.insert(InsertParams(key=RadixKey(token_ids=tokens), value=kv[:40]))
    assert tree.evictable_size() == 32
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=tokens[:20])))
    assert matched(m) == 16  # matches stop at page boundaries
    other = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=tokens, extra_key="lora")))
    assert matched(other) == 0  # extra keys isolate namespaces
    full = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=tokens)))
    tree.inc_lock_ref(full.last_device_node)
    assert (tree.evictable_size(), tree.protected_size()) == (0, 32)
    tree.dec_lock_ref(full.last_device_node)
    assert (tree.evictable_size(), tree.protected_size()) == (32, 0)
