"""Elastic KV inside the real SGLang allocator, pool and radix cache (the kvcore fork only).

Physical pages are observed through the page allocator's stats on the host backend: extend
and decode allocation map pages, freeing and radix eviction unmap them, the cached-token
bound holds, a tight budget is an allocation failure the scheduler handles, unsupported
configurations fail at start-up naming the setting, elastic off is upstream's code.
"""

from __future__ import annotations

import argparse
import logging
import re
from array import array
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache import memory_pool
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from harness.sglang_kv import radix
from kvcore.errors import KvcoreError, UnsupportedConfiguration

from .harness import HOST as HOST_CONFIG
from .harness import PATCHED, build, requires_cpu_paged_kernels, requires_fork
from .test_conformance import extend

pytestmark = requires_fork

# MHA, 2 layers x K/V, 2 heads x 64 dims, bf16: 256 bytes a token row, 4 KiB a 16-token
# SGLang page; a 64 KiB host page holds 16 SGLang pages (256 tokens).
TOKENS_PER_PAGE = 256


@requires_cpu_paged_kernels
def test_extend_and_decode_map_pages_on_demand(make: Any) -> None:
    e = make("on", size=2048, page_size=16)
    a = e.allocator
    base = e.pages()
    assert base.in_use == 1  # the padded page 0 (block 0) only
    out = extend(a, [0, 0], [300, 200], [-1, -1])
    assert out.numel() == 500
    after_extend = e.pages()
    # 19 + 13 SGLang pages + reserved block 0 = 33 blocks -> 3 physical pages
    assert after_extend.in_use == 3
    assert after_extend.mapped == 3
    rows = torch.tensor([int(out[299]), int(out[-1])])
    seq = torch.tensor([301, 201])
    dec = a.alloc_decode(seq, seq, rows)
    assert dec.numel() == 2
    assert e.pages().in_use == 3  # decode filled partly used pages, no new mapping


@pytest.mark.parametrize(("option", "interval"), [({}, 50e-6), ({"background_switch_us": 0}, None)])
def test_the_page_thread_takes_the_configured_switch_interval(
    make: Any, option: dict[str, Any], interval: float | None
) -> None:
    e = make("on", size=2048, page_size=16, **option)
    assert e.manager.pages.switch_interval == (
        pytest.approx(interval) if interval is not None else None
    )


def test_each_cache_clear_reports_the_page_work_since_the_last(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    e = make("on", size=2048, page_size=1)
    a = e.allocator
    caplog.set_level(logging.INFO, logger="kvcore.adapters.sglang.manager")

    def reports() -> list[str]:
        got = [r.getMessage() for r in caplog.records if "page work" in r.getMessage()]
        caplog.clear()
        return got

    assert a.alloc(1500) is not None  # new pages, mapped on this (the scheduler's) thread
    a.clear()  # SGLang's /flush_cache
    (line,) = reports()
    calls = re.search(
        r"\(cache cleared\): mapper calls (\d+) on the scheduler's thread and 0", line
    )
    assert calls and int(calls.group(1)) >= 1 and "0 misses" in line
    assert e.manager.pages.flush()  # the page thread unmaps what the clear freed
    a.clear()
    (line,) = reports()
    assert re.search(
        r"mapper calls 0 on the scheduler's thread and [1-9]\d* in the background", line
    )
    a.clear()  # nothing happened since: nothing to report
    assert reports() == []


def test_free_unmaps_empty_pages(make: Any) -> None:
    e = make("on", size=2048, page_size=16)
    a = e.allocator
    idx = a.alloc(4 * TOKENS_PER_PAGE)
    assert e.pages().in_use == 5
    a.free(idx)
    s = e.pages()
    assert s.in_use == 1 and s.mapped == 1  # only block 0's page stays
    assert a.available_size() == 2048


def test_radix_eviction_unmaps_pages(make: Any) -> None:
    e = make("on", size=2048, page_size=16)
    a = e.allocator
    tree = radix(a, 16)
    kv = a.alloc(2 * TOKENS_PER_PAGE)
    tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(kv.numel()))), value=kv))
    assert e.pages().in_use == 3  # cached prefixes keep their pages (invariant 1)
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    assert tree.evict(EvictParams(num_tokens=kv.numel())).num_tokens_evicted == kv.numel()
    assert e.pages().in_use == 1


def test_cached_token_bound_holds_at_every_allocation(make: Any) -> None:
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    bound = 128
    e = make("on", size=2048, page_size=16, max_cached_tokens=bound)
    a = e.allocator
    tree = radix(a, 16)
    for i in range(6):
        kv = a.alloc(64)
        key = RadixKey(token_ids=array("q", range(i * 1000, i * 1000 + 64)))
        tree.insert(InsertParams(key=key, value=kv))
        a.kvcore_step(tree)  # the scheduler's next iteration (patch 0006, every version)
        assert tree.evictable_size() <= bound
        evict_from_tree_cache(tree, 16)  # what SGLang runs before every allocation
        assert tree.evictable_size() <= bound
    assert a.conservation_available_size() + tree.evictable_size() == 2048 + 16 - 16


def test_tight_budget_is_an_allocation_miss(make: Any) -> None:
    # budget: 2 physical pages of 4 x 64 KiB (2 layers x K/V) plus one 64 KiB granule (the
    # zero page, charged to the gate) -> block 0's page + one more page
    e = make("on", size=2048, page_size=16, limit_bytes=2 * 4 * (1 << 16) + (1 << 16))
    a = e.allocator
    # the rest of block 0's page (15 SGLang pages) and one more page (16), not 2048 tokens
    assert a.available_size() == (15 + 16) * 16
    used_before = e.manager.ledger.used()
    assert a.alloc(600 // 16 * 16) is None  # the allocator's normal failure
    assert e.manager.ledger.used() == used_before  # nothing half-allocated
    # what the scheduler asks before a decode step: not enough, so it retracts
    assert a.check_decode_capacity(num_tokens=600, tree_cache=None) is False
    ok = a.alloc(13 * 16)
    assert ok is not None and ok.numel() == 13 * 16
    # the leak check's conservation term stays logical: everything is accounted for
    assert a.conservation_available_size() + 13 * 16 == 2048 + 16 - 16


def test_device_out_of_memory_without_a_budget_says_which_setting_prevents_it(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # a host "device" of block 0's page, one more page (4 x 64 KiB each) and the zero page:
    # no budget, so the free count is logical (2,048 tokens) and the third page misses
    device = {"device_bytes": 2 * 4 * (1 << 16) + (1 << 16), "granularity": 1 << 16}
    e = make("on", size=2048, page_size=16, backend_options=device)
    a = e.allocator
    caplog.set_level(logging.ERROR, logger="kvcore.adapters.sglang.manager")
    assert a.available_size() == 2048
    used_before = e.manager.ledger.used()
    assert a.alloc(600 // 16 * 16) is None  # upstream's miss: SGLang raises its own error
    assert e.manager.ledger.used() == used_before  # nothing half-allocated
    (line,) = [r.getMessage() for r in caplog.records]
    assert "device refused this elastic pool a page (37 blocks asked" in line
    assert "gpu_ledger" in line and "limit_bytes" in line
    caplog.clear()
    assert a.alloc(3000) is None  # more than the pool holds: SGLang's own shortage
    assert caplog.records == []
    assert a.alloc(13 * 16) is not None  # the page that fits still serves


def test_buffer_pointers_never_move(make: Any) -> None:
    e = make("on", size=2048, page_size=16)
    ptrs = [b.data_ptr() for b in (*e.pool.k_buffer, *e.pool.v_buffer)]
    x = e.allocator.alloc(1024)
    e.allocator.free(x)
    e.allocator.alloc(512)
    assert ptrs == [b.data_ptr() for b in (*e.pool.k_buffer, *e.pool.v_buffer)]


def test_mla_pool_is_elastic(make: Any) -> None:
    # an MLA token row is 80 bf16 values: a 64 KiB-aligned page holds 4096 tokens
    e = make("on", size=16384, page_size=16, mla=True)
    before = e.pages().in_use
    idx = e.allocator.alloc(8192)
    assert e.pages().in_use > before
    e.allocator.free(idx)
    assert e.pages().in_use == before


def test_scope_restores_upstream_buffers() -> None:
    e = build("on", size=256, page_size=16)
    try:
        assert memory_pool.KV_BUFFER_HOOK is None  # closed after the pools were built
        off = build("off", size=256, page_size=16)
        assert not hasattr(off.pool, "kvcore_manager")
        assert off.pool.k_buffer[0].shape == e.pool.k_buffer[0].shape
        assert off.pool.k_buffer[0].dtype == e.pool.k_buffer[0].dtype
    finally:
        e.scope.close()


def test_shutdown_releases_everything(make: Any) -> None:
    e = build("on", size=2048, page_size=16)
    e.allocator.alloc(1024)
    backend = e.manager.backend
    e.scope.close()
    assert e.manager.pages.stats().mapped == 0
    e.scope.close()  # idempotent
    assert backend is not None


def test_unsupported_allocator_is_named_at_startup(make: Any) -> None:
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    from kvcore.adapters.sglang import elastic_allocator

    class Fake(SWATokenToKVPoolAllocator):  # only the class matters: never constructed
        def __init__(self) -> None:
            pass

    with pytest.raises(UnsupportedConfiguration, match=r"SWATokenToKVPoolAllocator|Fake"):
        elastic_allocator(Fake())
    e = make("on", size=256, page_size=16)
    with pytest.raises(UnsupportedConfiguration, match="speculative decoding"):
        elastic_allocator(e.allocator)


def test_unsupported_pool_is_named_at_startup() -> None:
    from kvcore.adapters.sglang import ElasticScope

    scope = ElasticScope({"backend": "host"})
    with scope, pytest.raises(UnsupportedConfiguration, match="whole number of pages"):
        memory_pool.MHATokenToKVPool(
            size=250,
            page_size=16,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=64,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
    assert memory_pool.KV_BUFFER_HOOK is None
    scope.close()


def test_bad_config_is_named() -> None:
    from kvcore.adapters.sglang import ElasticConfig

    with pytest.raises(UnsupportedConfiguration, match="unknown key"):
        ElasticConfig.parse({"limit": 5})
    with pytest.raises(UnsupportedConfiguration, match="limit_bytes"):
        ElasticConfig.parse('{"limit_bytes": -1}')
    assert ElasticConfig.parse(None).backend == "cuda"


def test_preempting_to_reclaim_is_refused_at_start_up() -> None:
    """SGLang's scheduler has no seam to preempt for a neighbour: asking for it fails when
    the scope opens, before any pool exists; the default and "drain" open."""
    from kvcore.adapters.sglang import ElasticScope

    with pytest.raises(UnsupportedConfiguration, match='reclaim="preempt"'):
        ElasticScope({"backend": "host", "reclaim": "preempt"})
    for config in ({"backend": "host"}, {"backend": "host", "reclaim": "drain"}):
        ElasticScope(config).close()


@pytest.mark.skipif(not PATCHED, reason="fork only")
def test_server_args_flag_in_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert "--kvcore-elastic" in parser.format_help()
    args = parser.parse_args(
        ["--model-path", "m", "--kvcore-elastic", "--kvcore-config", '{"limit_bytes": 1}']
    )
    assert args.kvcore_elastic is True and args.kvcore_config == {"limit_bytes": 1}
    assert parser.parse_args(["--model-path", "m"]).kvcore_elastic is False


def test_rank_registers_in_the_gpu_ledger_and_leaves_it(tmp_path: Any) -> None:
    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_file import list_ledgers

    e = build("on", size=2048, page_size=16, gpu_ledger=True, ledger_dir=str(tmp_path))
    try:
        e.allocator.alloc(4 * TOKENS_PER_PAGE)
        e.manager.pages.flush()
        (path,) = list_ledgers(tmp_path)
        ledger = GpuLedger.open_path(path)
        try:
            (record,) = ledger.snapshot().records
            assert record.engine == "sglang"
            # mapped pages, plus what kvcore charges besides (zero page, pooled handles)
            assert record.mapped >= e.pages().mapped * e.manager.geometry.page_device_bytes > 0
        finally:
            ledger.close()
    finally:
        e.scope.close()
    ledger = GpuLedger.open_path(path)
    try:
        assert ledger.snapshot().records == ()  # clean shutdown removes the rank's record
    finally:
        ledger.close()


class _ConfiguratorStub:
    """Stands in for a ``KVCacheConfigurator`` *instance* so the real, patched
    ``KVCacheConfigurator.configure`` runs without a model: building the real one needs a
    model config, a model and a distributed runtime. Its collaborators are the real pool and
    allocator classes; only the sizing steps (model-dependent) are fixed numbers here."""

    device = "cpu"
    gpu_id = 0
    kv_cache_dtype = torch.bfloat16
    use_mla_backend = False
    is_draft_worker = False
    memory_pool_config = None
    req_to_token_pool = None
    token_to_kv_pool_allocator = None

    class spec_algorithm:
        @staticmethod
        def is_none() -> bool:
            return True

    def _resolve_memory_pool_config(self, pre_model_load_memory: int) -> Any:
        return None

    def _derive_pool_sizes(self, *, config: Any) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(
            max_total_num_tokens=2048,
            max_running_requests=8,
            full_max_total_num_tokens=None,
            swa_max_total_num_tokens=None,
        )

    def _init_pools(self, *, sizes: Any, req_to_token_pool: Any, token_to_kv_pool_allocator: Any):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.kv_cache_configurator import _InitializedPools

        pool = memory_pool.MHATokenToKVPool(
            size=2048,
            page_size=16,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=64,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        alloc = PagedTokenToKVPoolAllocator(2048, 16, torch.bfloat16, "cpu", pool, False)
        rtt = memory_pool.ReqToTokenPool(
            size=8, max_context_len=4096, device="cpu", enable_memory_saver=False
        )
        return _InitializedPools(
            req_to_token_pool=rtt, token_to_kv_pool=pool, token_to_kv_pool_allocator=alloc
        )


@pytest.mark.parametrize("elastic", [False, True], ids=["off", "on"])
def test_patched_configurator_builds_elastic_pools_only_when_asked(elastic: bool) -> None:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from kvcore.adapters.sglang import ElasticPagedTokenToKVPoolAllocator

    set_global_server_args_for_scheduler(
        ServerArgs(model_path="dummy", kvcore_elastic=elastic, kvcore_config=HOST_CONFIG)
    )
    result = KVCacheConfigurator.configure(_ConfiguratorStub(), pre_model_load_memory=0)
    alloc, pool = result.token_to_kv_pool_allocator, result.token_to_kv_pool
    try:
        assert memory_pool.KV_BUFFER_HOOK is None
        if not elastic:  # exactly upstream's objects
            assert type(alloc) is PagedTokenToKVPoolAllocator
            assert not hasattr(pool, "kvcore_manager")
            return
        assert isinstance(alloc, ElasticPagedTokenToKVPoolAllocator)
        assert alloc.get_kvcache() is pool and alloc.ledger is pool.kvcore_manager.ledger
        idx = alloc.alloc(64)
        pool.k_buffer[1][idx] = 1.0
        assert pool.kvcore_manager.stats().in_use >= 1
    finally:
        manager = getattr(pool, "kvcore_manager", None)
        if manager is not None:
            manager.close()


def test_leak_check_conserves_kvcore_accounting(make: Any) -> None:
    """The scheduler's real ``_check_full_pool`` on a budget-limited elastic pool: balanced
    books pass although the physical room is far below the free tokens, and a lost token
    range is still reported (the check is adapted, not switched off)."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.invariant_checker import (
        SchedulerInvariantChecker,
    )
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=16))
    e = make("on", size=2048, page_size=16, limit_bytes=2 * 4 * (1 << 16) + (1 << 16))
    a = e.allocator
    tree = radix(a, 16)
    tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(64))), value=a.alloc(64)))
    a.alloc(32)  # a running request's tokens: "uncached" to the checker
    # the checker's own state, reduced to what _check_full_pool reads for a plain MHA pool
    checker = SimpleNamespace(
        token_to_kv_pool_allocator=a,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        tree_cache=tree,
        pool_stats_observer=SimpleNamespace(session_held_tokens=lambda: 0),
        max_total_num_tokens=2048,
        _check_pool_invariant=SchedulerInvariantChecker._check_pool_invariant,
    )
    stats = SimpleNamespace(
        full_evictable_size=tree.evictable_size(), full_available_size=a.available_size()
    )
    assert a.available_size() < 2048 - 96  # physical room: the budget, not the free tokens
    leak, msg = SchedulerInvariantChecker._check_full_pool(checker, stats, uncached=32)
    assert not leak, msg
    leak, msg = SchedulerInvariantChecker._check_full_pool(checker, stats, uncached=0)
    assert leak, msg  # 32 tokens nobody accounts for


@pytest.mark.parametrize("budget", [{"limit_bytes": 1 << 30}, {"gpu_ledger": True}])
def test_physical_budget_needs_agreeing_ranks(budget: dict[str, Any]) -> None:
    """A budget at TP > 1 is agreed over SGLang's attention-TP CPU group
    (``test_tp_agreement.py`` runs two ranks): without that group it is refused at start-up,
    as is a budget at PP > 1 (pipeline stages are not agreed). No budget: allowed."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_size=2, attn_tp_size=2, moe_tp_size=2):
        with pytest.raises(UnsupportedConfiguration, match="attention-TP 2"):
            build("on", size=256, page_size=16, **budget)
        assert memory_pool.KV_BUFFER_HOOK is None
        e = build("on", size=256, page_size=16)
        e.scope.close()
    with get_parallel().override(pp_size=2):
        with pytest.raises(UnsupportedConfiguration, match="PP 2"):
            build("on", size=256, page_size=16, **budget)
        assert memory_pool.KV_BUFFER_HOOK is None


# -- fault injection: every failure path the adapter claims to handle ----------------------


@requires_cpu_paged_kernels
def test_a_failing_index_kernel_gives_the_staged_pages_back(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.mem_cache.allocator import paged

    e = make("on", size=2048, page_size=16)
    a = e.allocator
    used = e.manager.ledger.used()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected: index kernel failed")

    monkeypatch.setattr(paged, "alloc_extend_naive", broken)
    with pytest.raises(RuntimeError, match="injected"):
        extend(a, [0, 0], [300, 200], [-1, -1])
    assert e.manager.ledger.used() == used  # the ledger got its blocks back
    assert a.free_pages.numel() == 0
    monkeypatch.setattr(paged, "alloc_decode_naive", broken)
    with pytest.raises(RuntimeError, match="injected"):
        seq = torch.tensor([17])
        a.alloc_decode(seq, seq, torch.tensor([15]))
    assert e.manager.ledger.used() == used


@requires_cpu_paged_kernels
def test_free_gives_back_exactly_the_pages_named_as_a_run_or_scattered(make: Any) -> None:
    """``free`` sends pages forming one run to the ledger as a range, any other set page by
    page: either way exactly those blocks are freed; a double free raises naming a block
    and changes nothing."""
    e = make("on", size=2048, page_size=16)
    a, ledger = e.allocator, e.manager.ledger
    used = ledger.used()
    out = extend(a, [0, 0, 0], [64, 64, 64], [-1, -1, -1])  # 12 pages
    tokens: dict[int, list[int]] = {}
    for t in out.tolist():
        tokens.setdefault(t // 16, []).append(t)
    pages = sorted(tokens)
    assert len(pages) == 12 and ledger.used() == used + 12
    run = next(p for p in pages if p + 1 in tokens and p + 2 in tokens)
    a.free(torch.tensor(tokens[run + 2] + tokens[run] + tokens[run + 1]))  # one run
    assert ledger.used() == used + 9
    assert not any(ledger.is_allocated(p) for p in (run, run + 1, run + 2))
    with pytest.raises(KvcoreError, match=f"block {run}: not allocated"):
        a.free(torch.tensor(tokens[run]))  # a double free
    rest = [p for p in pages if p not in (run, run + 1, run + 2)]
    scattered = [rest[0], rest[2], rest[-1]]  # not one run
    a.free(torch.tensor([t for p in scattered for t in tokens[p]]))
    assert ledger.used() == used + 6
    assert all(ledger.is_allocated(p) != (p in scattered) for p in rest)
    a.free(torch.tensor([t for p in rest if p not in scattered for t in tokens[p]]))
    assert ledger.used() == used and e.pages().in_use == 1  # page 0: the reserved block


@requires_cpu_paged_kernels
def test_extend_on_the_triton_path_calls_the_kernel_as_upstream_does(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elastic extend launches SGLang's Triton index kernel itself (GPU path). No Triton
    here, so the kernel is replaced, for both allocators, by a recorder that runs SGLang's
    own torch fallback with the Triton argument order: the elastic launch must pass what
    upstream's does (grid, lengths, last locations, page size) and index the same tokens."""
    from sglang.srt.mem_cache.allocator import paged

    from kvcore.adapters.sglang import allocators

    calls: list[tuple[Any, tuple[Any, ...]]] = []

    class Recorder:  # stands in for the Triton kernel: kernel[grid](*args)
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any) -> None:
                calls.append((grid, args))
                prefix, seq, last, pages, out, _, page_size = args
                paged.alloc_extend_naive(prefix, seq, last, pages, out, page_size, out.device)

            return launch

    monkeypatch.setattr(paged, "alloc_extend_kernel", Recorder())
    monkeypatch.setattr(allocators, "alloc_extend_kernel", Recorder())
    outs = []
    for mode in ("off", "on"):
        a = make(mode, size=2048, page_size=16).allocator
        a.use_triton_kernels = True
        outs.append(extend(a, [0, 16, 0], [300, 40, 17], [-1, 15, -1]))
    (up_grid, up), (el_grid, el) = calls
    assert el_grid == up_grid == (3,)
    for i in (0, 1, 2, 5, 6):  # prefix lens, seq lens, last locations, next pow2, page size
        same = torch.equal(el[i], up[i]) if isinstance(up[i], torch.Tensor) else el[i] == up[i]
        assert same, i
    assert outs[1].shape == outs[0].shape == (300 + 24 + 17,)
    assert torch.equal(outs[1] % 16, outs[0] % 16)  # the same slots of (other) pages
    assert len(set(outs[1].tolist())) == outs[1].numel()


@pytest.mark.parametrize(("kind", "nth"), [("reserve", 2), ("create", 1), ("map", 3)])
def test_a_failing_driver_call_at_startup_leaves_nothing_behind(kind: str, nth: int) -> None:
    from kvcore.adapters.config import ElasticConfig
    from kvcore.adapters.sglang import ElasticKVManager
    from kvcore.vmm.faults import FaultInjector
    from kvcore.vmm.host import HostBackend

    backend = FaultInjector(HostBackend(0, device_bytes=1 << 30, granularity=1 << 16))
    backend.fail(kind, nth=nth)
    with pytest.raises(KvcoreError):
        ElasticKVManager(
            ElasticConfig(backend="host"),
            num_layers=2,
            kv_buffers=2,
            row_bytes=256,
            page_size=16,
            num_rows=2048 + 16,
            backend=backend,
        )
    assert not backend.live_handles  # every handle created was released
    assert backend.mapped_ranges() == []
    backend.close()
