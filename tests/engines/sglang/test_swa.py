"""Hybrid sliding-window KV (``SWAKVPool`` + ``SWATokenToKVPoolAllocator``) with elastic KV
off and on, against the real SGLang classes.

``kv_mode`` tests check the contract both ways (SGLang's own buffers and allocator vs
kvcore's), SWA eviction through SGLang's serving radix cache (``UnifiedRadixCache`` with
full and SWA components) included; the others check what kvcore adds: both sub-pools' pages
are mapped on demand and unmapped on free / window slide / eviction, both charge the rank's
one gate, available sizes count the shared headroom once, and a budget that fits the full
side but not the SWA side yields ``None`` with nothing held.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.swa import (
    PureSWATokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from kvcore.errors import UnsupportedConfiguration

from .harness import HOST, PATCHED, requires_cpu_paged_kernels, requires_fork

PS = 16  # SGLang page size (tokens); one kvcore block
FULL, SWA = 1024, 384  # tokens per sub-pool: 65 and 25 blocks (block 0: the padded page)
# a block of one layer's K (or V) is 16 tokens x 2 heads x 64 x bf16 = 4 KiB: 16 blocks per
# 64 KiB host page, so the full side spans 5 pages and the SWA side 2
PAGE = 1 << 16


class Stack:
    """An ``SWAKVPool`` and its allocator built the way SGLang's configurator does."""

    def __init__(
        self,
        mode: str,
        page_size: int = PS,
        *,
        full: int = FULL,
        swa: int = SWA,
        agreement: Any = None,
        **kvcore: Any,
    ) -> None:
        self.scope: Any = None

        def pool() -> SWAKVPool:
            return SWAKVPool(
                size=full,
                size_swa=swa,
                page_size=page_size,
                dtype=torch.bfloat16,
                head_num=2,
                head_dim=64,
                swa_attention_layer_ids=[0, 2, 3],
                full_attention_layer_ids=[1],
                device="cpu",
                enable_memory_saver=False,
            )

        if mode == "on":
            from kvcore.adapters.sglang import ElasticScope

            self.scope = ElasticScope({**HOST, **kvcore}, agreement=agreement)
            with self.scope:
                self.pool = pool()
        else:
            self.pool = pool()
        alloc = SWATokenToKVPoolAllocator(
            full, swa, page_size, torch.bfloat16, "cpu", self.pool, False
        )
        self.alloc = self.scope.allocator(alloc) if self.scope else alloc

    @property
    def full(self) -> Any:
        return self.pool.full_kv_pool.kvcore_manager

    @property
    def swa(self) -> Any:
        return self.pool.swa_kv_pool.kvcore_manager

    def mapped(self) -> tuple[int, int]:
        for m in (self.full, self.swa):
            assert m.pages.flush()
        return self.full.stats().mapped, self.swa.stats().mapped

    def extend(self, seq_len: int, prefix_len: int = 0, last_loc: int = -1) -> Any:
        t = torch.tensor
        return self.alloc.alloc_extend(
            t([prefix_len]),
            t([prefix_len]),
            t([seq_len]),
            t([seq_len]),
            t([last_loc]),
            seq_len - prefix_len,
        )

    def close(self) -> None:
        if self.scope is not None:
            self.scope.close()


@pytest.fixture
def stacks() -> Any:
    built: list[Stack] = []

    def make(mode: str, **kw: Any) -> Stack:
        s = Stack(mode, **kw)
        built.append(s)
        return s

    yield make
    for s in built:
        s.close()


# -- the contract, elastic off and on ---------------------------------------------------------


@requires_cpu_paged_kernels
def test_extend_maps_full_to_swa_and_free_restores_both_sides(kv_mode: str, stacks: Any) -> None:
    s = stacks(kv_mode)
    full0, swa0 = s.alloc.full_available_size(), s.alloc.swa_available_size()
    out = s.extend(40)
    assert out is not None and out.numel() == 40
    assert len(set(out.tolist())) == 40 and 0 not in (out // PS).tolist()
    swa_idx = s.alloc.translate_loc_from_full_to_swa(out)
    assert (swa_idx > 0).all() and len(set(swa_idx.tolist())) == 40
    assert s.alloc.full_available_size() == full0 - 48  # three pages each side
    assert s.alloc.swa_available_size() == swa0 - 48
    s.alloc.free(out)
    assert (s.alloc.full_available_size(), s.alloc.swa_available_size()) == (full0, swa0)
    assert (s.alloc.translate_loc_from_full_to_swa(out) == 0).all()


@requires_cpu_paged_kernels
def test_window_slide_frees_swa_pages_only(kv_mode: str, stacks: Any) -> None:
    s = stacks(kv_mode)
    out = s.extend(64)
    swa_before = s.alloc.swa_available_size()
    full_before = s.alloc.full_available_size()
    s.alloc.free_swa(out[:32])  # two pages slid out of the window
    assert s.alloc.swa_available_size() == swa_before + 32
    assert s.alloc.full_available_size() == full_before
    assert (s.alloc.translate_loc_from_full_to_swa(out[:32]) == 0).all()
    s.alloc.free_full(out[:32])
    s.alloc.free(out[32:])
    assert s.alloc.swa_available_size() == SWA


@requires_cpu_paged_kernels
def test_short_swa_side_fails_the_whole_extend(kv_mode: str, stacks: Any) -> None:
    s = stacks(kv_mode)
    assert s.extend(SWA + PS) is None  # fits the full side, not the SWA side
    assert s.alloc.full_available_size() == FULL
    assert s.extend(SWA) is not None


def test_token_granular_alloc_pairs_both_sides(kv_mode: str, stacks: Any) -> None:
    s = stacks(kv_mode, page_size=1)
    out = s.alloc.alloc(10)
    assert out is not None
    swa_idx = s.alloc.translate_loc_from_full_to_swa(out)
    assert (swa_idx > 0).all()
    assert s.alloc.alloc(SWA) is None  # the SWA side is short
    s.alloc.free(out)
    assert s.alloc.available_size() == SWA


@requires_cpu_paged_kernels
def test_swa_layer_writes_read_back_at_translated_slots(kv_mode: str, stacks: Any) -> None:
    s = stacks(kv_mode)
    out = s.extend(20)
    swa_loc = s.alloc.translate_loc_from_full_to_swa(out)
    k = torch.randn(20, 2, 64).to(torch.bfloat16)
    for layer_id, loc in ((0, swa_loc), (1, out)):  # 0: a sliding-window layer, 1: full
        sub, is_swa = s.pool.layers_mapping[layer_id]
        pool = s.pool.swa_kv_pool if is_swa else s.pool.full_kv_pool
        s.pool.get_key_buffer(layer_id)[loc] = k
        s.pool.get_value_buffer(layer_id)[loc] = -k
        assert torch.equal(pool.k_buffer[sub][loc], k)
        assert torch.equal(pool.v_buffer[sub][loc], -k)
        if kv_mode == "on":  # the sub-pool's buffers are its kvcore manager's views
            va, size = pool.kvcore_manager.cache.ranges[sub * 2]
            assert va <= pool.k_buffer[sub].data_ptr() < va + size


# -- what kvcore adds ---------------------------------------------------------------------------


@requires_fork
@requires_cpu_paged_kernels
def test_both_sub_pools_map_on_demand_and_unmap_on_free(stacks: Any) -> None:
    s = stacks("on")
    assert s.mapped() == (1, 1)  # block 0's page (SGLang's padded page) on each side
    out = s.extend(16 * 20)  # 20 blocks: the full side's page 0 (16 blocks) and page 1
    assert out is not None
    assert s.mapped() == (2, 2)
    s.alloc.free_swa(out[: 16 * 8])  # the window slides past 8 SWA blocks
    s.alloc.free_full(out[: 16 * 8])
    s.alloc.free(out[16 * 8 :])
    assert s.mapped() == (1, 1)


@requires_fork
@requires_cpu_paged_kernels
def test_both_sub_pools_charge_one_gate(stacks: Any) -> None:
    s = stacks("on", limit_bytes=32 * PAGE)
    assert s.full.gate is not s.swa.gate
    gate = s.scope.gate.gate
    assert gate is not None and gate.limit == 32 * PAGE
    out = s.extend(16 * 20)
    assert out is not None
    s.mapped()
    held = s.full.stats().charged_bytes + s.swa.stats().charged_bytes
    assert gate.held == held > 0
    s.alloc.free(out)
    s.mapped()
    assert gate.held == s.full.stats().charged_bytes + s.swa.stats().charged_bytes


@requires_fork
@requires_cpu_paged_kernels
def test_tight_shared_budget_yields_none_and_holds_nothing(stacks: Any) -> None:
    quiet = {"reserve_min": 0, "reserve_max": 0}
    probe = stacks("on", **quiet)
    probe.mapped()
    start = probe.scope.gate.gate.held  # both block-0 pages and both caches' zero pages
    full_page = probe.full.geometry.page_device_bytes
    assert full_page < probe.swa.geometry.page_device_bytes
    # room for one more full-side page, not for a second SWA page
    s = stacks("on", limit_bytes=start + full_page, **quiet)
    s.mapped()
    used = (s.full.ledger.used(), s.swa.ledger.used())
    out = s.extend(16 * 20)  # needs page 1 on both sides: the full side gets it, SWA misses
    assert out is None
    assert (s.full.ledger.used(), s.swa.ledger.used()) == used  # the full side gave it back
    assert s.mapped() == (1, 1)
    assert (s.alloc.translate_loc_from_full_to_swa(torch.arange(1, FULL)) == 0).all()
    small = s.extend(16 * 4)  # fits the pages already mapped on both sides
    assert small is not None
    s.alloc.free(small)
    assert s.mapped() == (1, 1)
    assert s.scope.gate.gate.held <= start + full_page  # (an unmapped page's handle may pool)


@requires_fork
def test_unsupported_swa_allocators_are_named_at_startup(stacks: Any) -> None:
    s = stacks("on", page_size=1)
    pure = PureSWATokenToKVPoolAllocator(SWA, 1, torch.bfloat16, "cpu", s.pool, False)
    with pytest.raises(UnsupportedConfiguration, match="PureSWATokenToKVPoolAllocator"):
        s.scope.allocator(pure)
    with pytest.raises(UnsupportedConfiguration, match="speculative decoding"):
        s.scope.allocator(s.alloc)


def test_upstream_pool_is_untouched_without_the_scope() -> None:
    s = Stack("off")
    assert not hasattr(s.pool.full_kv_pool, "kvcore_manager")
    assert type(s.alloc) is SWATokenToKVPoolAllocator
    assert PATCHED or s.scope is None


@requires_fork
@requires_cpu_paged_kernels
def test_available_sizes_count_the_shared_headroom_once(stacks: Any) -> None:
    quiet = {"reserve_min": 0, "reserve_max": 0}
    probe = stacks("on", **quiet)
    probe.mapped()
    start = probe.scope.gate.gate.held
    full_page = probe.full.geometry.page_device_bytes  # 128 KiB: 1 layer x K,V
    swa_page = probe.swa.geometry.page_device_bytes  # 384 KiB: 3 layers x K,V
    s = stacks("on", limit_bytes=start + full_page + swa_page, **quiet)
    s.mapped()
    page_tokens = 16 * PS  # 16 blocks of 16 tokens per page, on both sides
    held = 15 * PS  # free on each side's block-0 page
    # the headroom buys one page on each side together: 256 more tokens, not the 4 full
    # pages (1024 tokens) it would buy the full side alone
    assert s.alloc.full_available_size() == held + page_tokens
    assert s.alloc.swa_available_size() == SWA  # the SWA side's logical size binds first
    assert s.alloc.available_size() == SWA
    out = s.extend(SWA)
    assert out is not None
    assert s.alloc.available_size() == 0
    assert s.extend(PS) is None
    s.alloc.free(out)


def swa_radix(s: Stack, window: int) -> Any:
    """SGLang's serving radix cache (``UnifiedRadixCache``) with full and SWA components."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    req = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    return UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=req,
            token_to_kv_pool_allocator=s.alloc,
            page_size=PS,
            sliding_window_size=window,
            tree_components=(ComponentType.FULL, ComponentType.SWA),
        )
    )


@requires_cpu_paged_kernels
def test_radix_swa_eviction_frees_the_swa_side_first(kv_mode: str, stacks: Any) -> None:
    pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = stacks(kv_mode, reserve_min=0, reserve_max=0)  # (kvcore options: used when on)
    tree = swa_radix(s, window=64)
    out = s.extend(16 * PS)
    tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(1000, 1256))), value=out))
    assert tree.swa_evictable_size() == tree.full_evictable_size() == 16 * PS
    got = tree.evict(EvictParams(num_tokens=0, swa_num_tokens=8 * PS))
    assert got.num_tokens_evicted == 0 and got.swa_num_tokens_evicted >= 8 * PS
    swa_freed = got.swa_num_tokens_evicted
    assert s.alloc.swa_available_size() == SWA - 16 * PS + swa_freed
    assert s.alloc.full_available_size() == FULL - 16 * PS
    if kv_mode == "on":  # SWA blocks went back to the SWA ledger only
        assert s.swa.ledger.used() == 1 + 16 - swa_freed // PS
        assert s.full.ledger.used() == 1 + 16
    got = tree.evict(EvictParams(num_tokens=16 * PS))
    assert got.num_tokens_evicted == 16 * PS
    assert (s.alloc.full_available_size(), s.alloc.swa_available_size()) == (FULL, SWA)
    if kv_mode == "on":
        assert s.mapped() == (1, 1)


@requires_fork
@requires_cpu_paged_kernels
def test_cached_token_bound_holds_for_the_swa_allocator(stacks: Any) -> None:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = stacks("on", max_cached_tokens=4 * PS)
    tree = swa_radix(s, window=64)
    out = s.extend(16 * PS)
    tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(1000, 1256))), value=out))
    assert tree.full_evictable_size() == 16 * PS
    s.alloc.evict_to_free_tokens(tree, PS)  # SGLang calls this before every allocation
    assert tree.full_evictable_size() <= 4 * PS
    assert s.full.ledger.used() <= 1 + 4


@requires_cpu_paged_kernels
def test_grouped_frees_release_both_sides_at_group_end(kv_mode: str, stacks: Any) -> None:
    s = stacks(kv_mode, reserve_min=0, reserve_max=0)
    a, b = s.extend(3 * PS), s.extend(2 * PS)
    assert a is not None and b is not None
    s.alloc.free_group_begin()
    s.alloc.free(a)
    s.alloc.free_swa(b[:PS])  # a window slide inside the same group
    assert s.alloc.full_available_size() == FULL - 5 * PS  # nothing released yet
    s.alloc.free_group_end()
    assert s.alloc.full_available_size() == FULL - 2 * PS
    assert s.alloc.swa_available_size() == SWA - PS
    s.alloc.free_full(b[:PS])
    s.alloc.free(b[PS:])
    assert (s.alloc.full_available_size(), s.alloc.swa_available_size()) == (FULL, SWA)
    if kv_mode == "on":
        assert s.mapped() == (1, 1)


# -- TP agreement (a scripted peer rank; two real ranks: test_tp_agreement.py) ----------------


@requires_fork
@requires_cpu_paged_kernels
def test_agreed_pairs_roll_back_both_sides_when_a_peer_misses(stacks: Any) -> None:
    """Under an agreement every pair is one decision: when the peer rank missed a pair this
    rank got, both sides give their blocks and pages back and the index mapping stays clear;
    both available sizes are the agreed joint figures plus what was freed since, read
    without a collective, refreshed by ``kvcore_step``."""
    from tests.parallel.test_agreement import ScriptedPeer

    peer = ScriptedPeer()  # rank 1, answering the MIN all-reduce from a script
    s = stacks("on", limit_bytes=1 << 30, agreement=peer, reserve_min=0, reserve_max=0)
    assert [len(c) for c in peer.calls] == [2]  # the room (full, SWA) agreed at build
    first = s.extend(16 * 4)
    assert first is not None and peer.calls[-1][0] == 1 and len(peer.calls[-1]) == 3
    books = (s.full.ledger.used(), s.swa.ledger.used(), s.mapped())
    mapping = s.alloc.full_to_swa_index_mapping.clone()
    peer.script = [[0, 99, 99], [5, 3]]  # the peer missed; then 5 and 3 blocks of room there
    assert s.extend(16 * 20) is None  # 20 blocks: new pages on both sides here
    assert (s.full.ledger.used(), s.swa.ledger.used(), s.mapped()) == books
    assert torch.equal(s.alloc.full_to_swa_index_mapping, mapping)
    assert (s.alloc.full_available_size(), s.alloc.swa_available_size()) == (5 * PS, 3 * PS)
    calls = len(peer.calls)
    s.alloc.free(first)  # 4 blocks on each side
    assert (s.alloc.full_available_size(), s.alloc.swa_available_size()) == (9 * PS, 7 * PS)
    assert len(peer.calls) == calls  # reading and freeing never call the group
    peer.script = [[40, 40]]  # the peer's budget was freed by another instance
    s.alloc.kvcore_step()
    assert len(peer.calls) == calls + 1
    assert s.alloc.full_available_size() == 40 * PS
    assert s.alloc.swa_available_size() == SWA  # capped by the SWA side's logical free count


@requires_fork
def test_agreed_token_pairs_roll_back_and_a_failed_collective_leaks_nothing(stacks: Any) -> None:
    """Token-granular pairs (``page_size`` 1) roll back the same way; a collective that
    fails (a peer died) raises ``AgreementError`` after both sides gave their tokens back."""
    from kvcore.errors import AgreementError
    from tests.parallel.test_agreement import ScriptedPeer

    peer = ScriptedPeer()
    s = stacks("on", page_size=1, limit_bytes=1 << 30, agreement=peer)
    used = (s.full.ledger.used(), s.swa.ledger.used())
    mapping = s.alloc.full_to_swa_index_mapping.clone()
    peer.script = [[0, 99, 99]]
    assert s.alloc.alloc(10) is None
    assert (s.full.ledger.used(), s.swa.ledger.used()) == used
    peer.fail = True
    with pytest.raises(AgreementError):
        s.alloc.alloc(10)
    assert (s.full.ledger.used(), s.swa.ledger.used()) == used
    assert torch.equal(s.alloc.full_to_swa_index_mapping, mapping)


@requires_fork
def test_swa_cache_bound_is_refused_where_sglang_cannot_honour_it() -> None:
    """SGLang < 0.5.23 builds an ``SWARadixCache`` (evictable size a (full, SWA) pair) that
    the cache bound does not handle: ``max_cached_tokens`` with the SWA allocator is refused
    there by name (0.5.23+: ``test_cached_token_bound_holds_for_the_swa_allocator``)."""
    from kvcore.adapters.sglang.eviction import eviction_asks_allocator

    if eviction_asks_allocator():
        pytest.skip("SGLang >= 0.5.23 honours the bound for the SWA allocator")
    with pytest.raises(UnsupportedConfiguration, match="max_cached_tokens"):
        Stack("on", page_size=1, max_cached_tokens=64)
