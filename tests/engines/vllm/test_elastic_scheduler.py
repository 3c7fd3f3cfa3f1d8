"""Elastic KV under the real vLLM scheduler and KV-cache manager (forked wheel, host backend).

The scheduler, its requests and each step with a stand-in model output come from
``harness.vllm.scheduler``: everything vLLM-side is the release's own code.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import RequestStatus

from harness.vllm.scheduler import (
    BLOCK,
    BLOCK_BYTES,
    BPP,
    GRAN,
    SPEC,
    host_settings,
    make_request,
    make_scheduler,
    step,
)
from kvcore.adapters.vllm import elastic_kv_buffer, elastic_settings, memory_for
from kvcore.adapters.vllm.pool import ElasticBlockPool
from kvcore.budget.gate import BudgetGate
from kvcore.errors import GeometryError, KvcoreError, UnsupportedConfiguration


def pool_of(scheduler: Scheduler) -> ElasticBlockPool:
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    return pool


def mapped_pages(pool: ElasticBlockPool) -> int:
    return pool.ledger.pages.stats().in_use


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    yield
    gc.collect()  # pools close their kvcore memory when collected


def test_elastic_off_builds_upstream_block_pool() -> None:
    scheduler = make_scheduler(64, elastic=False)
    assert type(scheduler.kv_cache_manager.block_pool) is BlockPool


def test_pages_map_as_blocks_fill_and_unmap_when_they_empty() -> None:
    scheduler = make_scheduler(8 * BPP)
    pool = pool_of(scheduler)
    assert mapped_pages(pool) == 1  # the null block's page, for good
    # 3 requests of 40 tokens: 3 blocks each (+1 for the sampled token's slot at most)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 40, max_tokens=3))
    step(scheduler)
    used = pool.ledger.used()
    assert used >= 1 + 3 * 3
    assert mapped_pages(pool) == -(-used // BPP)  # dense: partly used pages filled first
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert pool.ledger.used() == 1
    assert mapped_pages(pool) == 1  # every page that emptied was given back


def test_prefix_cached_blocks_stay_mapped_until_evicted() -> None:
    scheduler = make_scheduler(8 * BPP, caching=True)
    pool = pool_of(scheduler)
    prompt = list(range(1, 4 * BLOCK + 1))  # 4 full blocks
    scheduler.add_request(make_request("a", prompt))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    cached = pool.num_cached_free_blocks()
    assert cached == 4
    assert pool.ledger.used() == 1 + cached  # invariant 1: cached blocks stay allocated
    assert mapped_pages(pool) >= 1
    scheduler.add_request(make_request("b", [*prompt, 99]))
    out = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK  # a prefix-cache hit
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert pool.trim(10**6) == 4
    assert pool.num_cached_free_blocks() == 0
    assert pool.ledger.used() == 1
    assert mapped_pages(pool) == 1


def test_eviction_prefers_blocks_that_empty_a_whole_page() -> None:
    scheduler = make_scheduler(8 * BPP, caching=True)
    pool = pool_of(scheduler)
    manager = scheduler.kv_cache_manager
    # a: 7 blocks, fills page 0 next to the null block; b: 8 blocks, page 1.
    a = make_request("a", list(range(1000, 1000 + (BPP - 1) * BLOCK)))
    b = make_request("b", list(range(2000, 2000 + BPP * BLOCK)))
    for req in (a, b):
        assert manager.allocate_slots(req, req.num_tokens) is not None
    pages = {
        r.request_id: {pool.ledger.page_of(x) for x in manager.get_block_ids(r.request_id)[0]}
        for r in (a, b)
    }
    assert pages == {"a": {0}, "b": {1}}
    manager.free(a)
    manager.free(b)  # LRU: a's blocks are the oldest
    assert pool.num_cached_free_blocks() == 2 * BPP - 1
    assert mapped_pages(pool) == 2
    # LRU would evict a's 7 blocks first: page 0 keeps the null block, no memory comes back.
    assert pool.trim(BPP) == BPP
    assert mapped_pages(pool) == 1  # page 1 went back whole
    assert all(pool.blocks[i].block_hash is not None for i in range(1, BPP))  # a's kept
    assert all(pool.blocks[i].block_hash is None for i in range(BPP, 2 * BPP))


def test_tight_physical_budget_requests_wait_or_preempt_and_all_finish() -> None:
    limit_pages = 4  # 32 blocks, the null block's page included
    scheduler = make_scheduler(
        16 * BPP, max_num_seqs=8, kvcore=host_settings(limit_bytes=limit_pages * GRAN)
    )
    pool = pool_of(scheduler)
    reqs = [make_request(f"r{i}", [i + 1] * 5 * BLOCK, max_tokens=40) for i in range(8)]
    for r in reqs:
        scheduler.add_request(r)
    peak_running = 0
    waited = False
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
        steps += 1
        assert steps < 2000
        peak_running = max(peak_running, len(scheduler.running))
        waited |= len(scheduler.waiting) > 0
        assert mapped_pages(pool) <= limit_pages  # the budget held
    assert waited  # capacity was short: requests waited (or were preempted back to waiting)
    assert peak_running < len(reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert all(len(r.output_token_ids) == 40 for r in reqs)
    assert pool.ledger.used() == 1


def test_kv_buffer_has_a_stable_address_and_backs_allocated_blocks() -> None:
    kv = KVCacheConfig(
        num_blocks=4 * BPP, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], SPEC)]
    )
    kv.kvcore = host_settings()
    buf = elastic_kv_buffer(kv, torch.device("cpu"), 4 * BPP * BLOCK_BYTES)
    ptr = buf.data_ptr()
    assert buf.numel() == 4 * BPP * BLOCK_BYTES
    assert int(buf[-BLOCK_BYTES:].abs().sum()) == 0  # unbacked: the zero page
    ledger = memory_for(kv).ledger
    ids = ledger.alloc(2 * BPP)
    assert ids is not None
    for b in ids:
        buf[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES] = 3
    assert buf.data_ptr() == ptr
    assert int(buf[ids[0] * BLOCK_BYTES]) == 3
    ledger.free(ids)
    memory_for(kv).close()


class _ClosingBudgetGate(BudgetGate):
    """A budget gate that records being closed (``ElasticKVMemory`` takes a given gate over)."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_given_gate_is_charged_and_bounds_the_scheduler() -> None:
    limit_pages = 3
    gate = _ClosingBudgetGate(limit_pages * GRAN)
    scheduler = make_scheduler(6 * BPP, gate=gate)
    pool = pool_of(scheduler)
    memory = memory_for(scheduler.kv_cache_config)
    assert pool.ledger is memory.ledger  # the pool took the memory made with the gate
    assert gate.held == memory.stats().charged_bytes > 0  # the null block's page
    # 4 requests of 2 blocks each want more pages than the gate admits: they wait, then finish
    reqs = [make_request(f"g{i}", list(range(i * 100, i * 100 + 2 * BLOCK)), 4) for i in range(4)]
    for r in reqs:
        scheduler.add_request(r)
    peak = 0
    for _ in range(60):
        step(scheduler)
        assert gate.held <= gate.limit
        peak = max(peak, gate.held)
        if all(r.is_finished() for r in reqs):
            break
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert peak > GRAN  # pages beyond the null block's were charged to this gate
    memory.close()
    assert gate.closed


class _CountingBudgetGate(BudgetGate):
    """A budget gate that counts its headroom reads (the per-GPU ledger's take file locks)."""

    reads = 0

    def headroom(self) -> int | None:
        self.reads += 1
        return super().headroom()


def test_the_free_block_count_reads_the_gate_once_per_change_and_stays_exact() -> None:
    """vLLM asks ``get_num_free_blocks`` before every request's allocation. The pool reads
    the gate again only after its own ledger changed or at a step hook, and the figure it
    gives always equals a fresh read while nobody else changes the gate."""
    gate = _CountingBudgetGate(4 * GRAN)  # the null block's page, a short page, 2 for requests
    scheduler = make_scheduler(8 * BPP, gate=gate, max_num_seqs=16)
    pool = pool_of(scheduler)
    memory = memory_for(scheduler.kv_cache_config)
    asked = stale = changes = 0
    cached, alloc, free = pool.get_num_free_blocks, pool.ledger.alloc, pool.ledger.free

    def checked() -> int:
        nonlocal asked, stale
        asked += 1
        got = cached()
        reads = gate.reads  # the check's own read is not the pool's
        stale += got != pool.ledger.available() + len(pool._claimed) + pool.num_cached_free_blocks()
        gate.reads = reads
        return got

    def counted(call: Any) -> Any:
        def change(*args: Any, **kwargs: Any) -> Any:
            nonlocal changes
            changes += 1
            return call(*args, **kwargs)

        return change

    pool.get_num_free_blocks = checked  # type: ignore[method-assign]
    pool.ledger.alloc, pool.ledger.free = counted(alloc), counted(free)  # type: ignore[method-assign]
    reqs = [make_request(f"c{i}", list(range(i * 100, i * 100 + 3 * BLOCK)), 12) for i in range(12)]
    for r in reqs:
        scheduler.add_request(r)
    steps = reads = asks = 0
    while scheduler.has_unfinished_requests():
        assert steps < 300, "the requests never finished"
        gate.reads = changes = 0
        before = asked
        step(scheduler)
        steps += 1
        # per ledger change: the ask after it, and get_new_blocks' own live checks (2)
        assert gate.reads <= 2 + 3 * changes, (steps, gate.reads, changes, asked - before)
        reads += gate.reads
        asks += asked - before
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert stale == 0, f"{stale} of {asked} answers differed from a fresh read"
    assert reads < asks / 2, f"the gate was read {reads} times for {asks} asks"
    memory.close()


def test_a_budget_raised_by_another_process_is_seen_at_the_next_step() -> None:
    """What changes the gate outside this pool (another instance, ``kvctl``) shows in the
    free block count from the next step hook on, so waiting requests start then."""
    gate = BudgetGate(3 * GRAN)  # 15 free blocks: one request of 8 at a time
    scheduler = make_scheduler(9 * BPP, gate=gate, max_num_seqs=8)
    pool = pool_of(scheduler)
    memory = memory_for(scheduler.kv_cache_config)
    reqs = [make_request(f"r{i}", list(range(i * 100, i * 100 + BPP * BLOCK)), 4) for i in range(4)]
    for r in reqs:
        scheduler.add_request(r)
    step(scheduler)
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 3
    before = pool.get_num_free_blocks()
    gate.limit = 8 * GRAN  # raised from outside: the pool is not told
    assert pool.get_num_free_blocks() == before, "read once per step, not per call"
    step(scheduler)
    assert len(scheduler.running) == 4, "the raised budget admitted the waiting requests"
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    memory.close()


def test_a_gate_given_for_existing_memory_or_a_failed_start_is_refused() -> None:
    kv = KVCacheConfig(
        num_blocks=7 * BPP, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], SPEC)]
    )
    kv.kvcore = host_settings()
    memory = memory_for(kv)
    with pytest.raises(KvcoreError, match="already exists"):
        memory_for(kv, gate=_ClosingBudgetGate(GRAN))
    assert memory_for(kv, gate=memory.gate) is memory  # its own gate again: no conflict
    memory.close()
    bad = KVCacheConfig(
        num_blocks=5 * BPP, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], SPEC)]
    )
    bad.kvcore = host_settings(page_bytes=GRAN + BLOCK_BYTES // 2)  # not whole blocks per page
    gate = _ClosingBudgetGate(GRAN)
    with pytest.raises(GeometryError):
        memory_for(bad, gate=gate)
    assert gate.closed  # taken over even when the start fails


class _Parallel:
    tensor_parallel_size = 2
    pipeline_parallel_size = 1
    data_parallel_size = 1
    distributed_executor_backend = "ray"  # TP x PP > 1 needs vLLM's mp executor (parallel.py)


def test_unsupported_configuration_is_named_at_start_up() -> None:
    scheduler = make_scheduler(64, elastic=False)
    config = scheduler.vllm_config
    kv = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], SPEC)]
    )
    assert elastic_settings(config, kv)["backend"] == "cuda"
    config.cache_config.kvcore_config = {"limit_gb": 3}
    with pytest.raises(UnsupportedConfiguration, match="limit_gb"):
        elastic_settings(config, kv)
    config.cache_config.kvcore_config = None
    assert elastic_settings(config, kv)["release_fence"] is False
    config.scheduler_config.async_scheduling = True  # supported: the release fence is wired
    assert elastic_settings(config, kv)["release_fence"] is True
    config.scheduler_config.async_scheduling = False
    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32, attention_chunk_size=64
    )
    hybrid = KVCacheConfig(  # two groups are fine; a spec without a kvcore layout is not
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l"], SPEC), KVCacheGroupSpec(["m"], chunked)],
    )
    with pytest.raises(UnsupportedConfiguration, match=r"group 1 .*ChunkedLocalAttentionSpec"):
        elastic_settings(config, hybrid)
    parallel = config.parallel_config
    object.__setattr__(config, "parallel_config", _Parallel())
    try:
        with pytest.raises(UnsupportedConfiguration, match="TP x PP = 2 needs vLLM's mult"):
            elastic_settings(config, kv)
    finally:
        object.__setattr__(config, "parallel_config", parallel)


def _serve_in_child(ledger_dir: str, budget: int, name: str, queue: Any, barrier: Any) -> None:
    """Child process: a real scheduler on the shared per-GPU ledger; reports what it saw."""
    from kvcore.budget.ledger import GpuLedger
    from kvcore.vmm import open_backend

    settings = host_settings(gpu_ledger=True, ledger_dir=ledger_dir)
    settings["backend_options"]["device_bytes"] = 64 << 20
    scheduler = make_scheduler(16 * BPP, max_num_seqs=8, kvcore=settings)
    pool = pool_of(scheduler)
    uuid = open_backend("host", 0, granularity=GRAN, device_bytes=64 << 20).device_uuid()
    ledger = GpuLedger.open(uuid, directory=Path(ledger_dir))
    reqs = [make_request(f"{name}{i}", [i + 1] * 5 * BLOCK, max_tokens=30) for i in range(6)]
    for r in reqs:
        scheduler.add_request(r)
    barrier.wait()  # both schedulers run at once
    peak_total = 0
    steps = 0
    waited = 0  # steps that left a request waiting: only KV memory can (8 seqs, 2048 tokens)
    while scheduler.has_unfinished_requests() and steps < 3000:
        step(scheduler)
        steps += 1
        waited += len(scheduler.waiting) > 0
        peak_total = max(peak_total, ledger.snapshot().total_mapped)
    finished = sum(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    queue.put((name, finished, len(reqs), peak_total, waited))
    barrier.wait()  # keep the record until the other one is done too
    del scheduler, pool
    gc.collect()


def test_two_schedulers_in_two_processes_share_one_budget(tmp_path: Path) -> None:
    import multiprocessing as mp

    from kvcore.budget.ledger import GpuLedger
    from kvcore.vmm import open_backend

    backend = open_backend("host", 0, granularity=GRAN, device_bytes=64 << 20)
    budget = 6 * GRAN  # both instances' KV together: 6 pages (48 blocks)
    ledger = GpuLedger.open(backend.device_uuid(), device_total=64 << 20, directory=tmp_path)
    ledger.set_budget(budget)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(target=_serve_in_child, args=(str(tmp_path), budget, n, queue, barrier))
        for n in ("a", "b")
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for name, finished, total, peak, _waited in results:
        assert finished == total, name  # every request finished in both engines
        assert peak <= budget  # the shared budget held at every step either one saw
    # the budget, not the capacity (128 blocks each), was binding: requests waited. (Page
    # allocator misses are no signal: claim_blocks only claims what the gate's headroom
    # admits, so a miss needs the other process to take the headroom in between.)
    assert sum(w for *_, w in results) > 0
    assert ledger.snapshot().records == ()  # both records gone at shutdown
    ledger.close()
    backend.close()
