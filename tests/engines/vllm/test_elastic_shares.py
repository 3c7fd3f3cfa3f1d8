"""Shares of a GPU budget under the real vLLM scheduler (forked wheel, host backend): an
engine that borrowed the whole budget gives way to one that starts later, and vLLM's KV
cache usage counts an engine's own blocks, not the budget others hold.

Two schedulers run in one process, stepped in turn, on one per-GPU ledger in a private
directory (their instances differ by capacity, which their record names carry). Their page
allocators unmap on their own background threads, so a page one engine frees reaches the
other a step or two later; the assertions compare whole runs, never single steps.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from harness.vllm.scheduler import (
    BLOCK,
    BPP,
    GRAN,
    host_settings,
    make_request,
    make_scheduler,
    step,
)
from kvcore.adapters.vllm import memory_for
from kvcore.adapters.vllm.checks import scheduler_preempts_to_reclaim
from kvcore.adapters.vllm.pool import ElasticBlockPool
from kvcore.budget.gate import BudgetGate
from kvcore.budget.ledger import GpuLedger
from kvcore.budget.shares import share_of
from kvcore.vmm import open_backend

DEVICE = 64 << 20


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    yield
    gc.collect()  # pools close their kvcore memory when collected


def _scheduler(ledger_dir: Path, num_blocks: int, reclaim: str | None = None) -> Scheduler:
    settings = host_settings(gpu_ledger=True, ledger_dir=str(ledger_dir), reclaim=reclaim)
    settings["backend_options"]["device_bytes"] = DEVICE
    return make_scheduler(num_blocks, max_num_seqs=32, kvcore=settings)


def _pool(scheduler: Scheduler) -> ElasticBlockPool:
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    return pool


def _requests(prefix: str, n: int) -> list:  # type: ignore[type-arg]
    # 15 blocks of prompt and 4 tokens out: 16 blocks (2 pages) each, none added by decode
    return [
        make_request(f"{prefix}{i}", [1000 * i + j for j in range(15 * BLOCK)], max_tokens=4)
        for i in range(n)
    ]


def test_a_borrowing_engine_gives_way_to_one_that_starts_later(tmp_path: Path) -> None:
    a = _scheduler(tmp_path, 64 * BPP)
    b = _scheduler(tmp_path, 48 * BPP)  # another capacity: another record name
    name_a, name_b = (_pool(s).ledger.pages.gate.name for s in (a, b))
    uuid = open_backend("host", 0, granularity=GRAN, device_bytes=DEVICE).device_uuid()
    ledger = GpuLedger.open(uuid, directory=tmp_path)
    idle = ledger.snapshot().total_mapped  # each one's zero page and null block's page
    ledger.set_budget(idle + 24 * GRAN)
    backlog = _requests("a", 40)  # more than the budget holds at once
    for r in backlog:
        a.add_request(r)
    for _ in range(3):
        step(a)
    snap = ledger.snapshot()
    rec_a = snap.find(name_a)
    assert rec_a is not None
    assert snap.total_mapped >= snap.budget - GRAN, "a borrowed the whole budget"
    assert rec_a.mapped > share_of(snap, rec_a)
    burst = _requests("b", 8)
    for r in burst:
        b.add_request(r)
    peak_b = 0
    a_left_when_b_done = None
    for _ in range(2000):
        if not (a.has_unfinished_requests() or b.has_unfinished_requests()):
            break
        step(a)
        step(b)
        snap = ledger.snapshot()
        assert snap.total_mapped <= snap.budget
        rec_b = snap.find(name_b)
        assert rec_b is not None
        peak_b = max(peak_b, rec_b.mapped)
        if a_left_when_b_done is None and all(r.is_finished() for r in burst):
            a_left_when_b_done = sum(not r.is_finished() for r in backlog)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in backlog + burst)
    # Without shares, a would admit its own backlog into every page it frees and b would
    # start only once a's backlog drained. With them, a gives way as its requests finish.
    assert a_left_when_b_done is not None and a_left_when_b_done >= 5, a_left_when_b_done
    assert peak_b >= share_of(snap, rec_b) - 2 * GRAN, "b reached about its share"
    del a, b
    gc.collect()
    assert ledger.snapshot().records == ()
    ledger.close()


@pytest.mark.parametrize(
    "reclaim",
    [
        "drain",
        pytest.param(
            "preempt",
            marks=pytest.mark.skipif(
                not scheduler_preempts_to_reclaim(), reason="no patch 0011 in this series"
            ),
        ),
    ],
)
def test_a_borrower_with_long_requests_gives_way(tmp_path: Path, reclaim: str) -> None:
    """A borrows the whole budget with requests that keep growing (one block every 16
    decode steps, up to ``decode`` steps each) and a large backlog; then B starts a burst.
    A admits none of its backlog into the pages it should give back. With ``reclaim``
    ``"drain"`` those pages empty as A's running requests finish, so B's burst is served
    within the lifetime of A's requests, not after A's backlog; with ``"preempt"`` A
    preempts the requests that alone fill such a page, one page a step, so B's burst is
    served within a few of its own request lifetimes, and A recomputes only a few
    requests."""
    decode = 400
    a = _scheduler(tmp_path, 64 * BPP, reclaim)
    b = _scheduler(tmp_path, 48 * BPP, reclaim)
    uuid = open_backend("host", 0, granularity=GRAN, device_bytes=DEVICE).device_uuid()
    ledger = GpuLedger.open(uuid, directory=tmp_path)
    idle = ledger.snapshot().total_mapped
    ledger.set_budget(idle + 24 * GRAN)
    # 6 blocks of prompt each and outputs of 1/8 .. 8/8 of ``decode``, so that some of A's
    # requests finish all the time; 96 of them, three times A's max_num_seqs
    backlog = [
        make_request(
            f"a{i}", [1000 * i + j for j in range(6 * BLOCK)], max_tokens=decode * (1 + i % 8) // 8
        )
        for i in range(96)
    ]
    for r in backlog:
        a.add_request(r)
    for _ in range(2 * BLOCK):  # A's running requests spread over the whole budget
        step(a)
    snap = ledger.snapshot()
    assert snap.total_mapped >= snap.budget - GRAN, "a borrowed the whole budget"
    burst = _requests("b", 16)
    for r in burst:
        b.add_request(r)
    burst_done = None
    a_left = None
    for n in range(20 * decode):
        if not (a.has_unfinished_requests() or b.has_unfinished_requests()):
            break
        step(a)
        step(b)
        _pool(a).ledger.pages.flush()  # a background round between steps, as between a
        _pool(b).ledger.pages.flush()  # GPU's slower steps: the figures are step counts
        snap = ledger.snapshot()
        assert snap.total_mapped <= snap.budget
        if burst_done is None and all(r.is_finished() for r in burst):
            burst_done = n
            a_left = sum(not r.is_finished() for r in backlog)
    everything = backlog + burst
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in everything)
    assert all(len(r.output_token_ids) == r.max_tokens for r in everything)
    # within the lifetime of A's longest requests, with most of A's backlog still to run
    # (without the admission check's shortage signal, or with A admitting its backlog into
    # the free blocks of the pages it should empty, B waits for nearly all of it)
    assert burst_done is not None and burst_done <= decode, burst_done
    assert a_left is not None and a_left >= len(backlog) // 2, a_left
    if reclaim == "preempt":
        # one page a step, the requests alone on it preempted: B's 16 requests (a prefill
        # and 4 decode steps each) are done within a few of their lifetimes, long before
        # A's requests would have drained the pages (measured: 19 steps against 230)
        assert burst_done <= 4 * BLOCK, burst_done
    else:
        assert burst_done > 4 * BLOCK, burst_done  # what preempting saves
    del a, b
    gc.collect()
    assert ledger.snapshot().records == ()
    ledger.close()


def test_kv_cache_usage_counts_the_engines_own_blocks_not_the_budget() -> None:
    """vLLM's ``kv_cache_usage_perc`` upstream is ``1 - free / capacity``; under a budget
    that admits fewer blocks than the capacity, that would count as used every block the
    budget withholds. The elastic pool reports the blocks requests hold."""
    # the zero page, the null block's page (7 blocks free) and 2 pages: 23 of 63 blocks
    gate = BudgetGate(4 * GRAN)
    scheduler = make_scheduler(8 * BPP, gate=gate)
    pool = _pool(scheduler)
    memory = memory_for(scheduler.kv_cache_config)
    assert pool.get_usage() == 0.0
    (req,) = _requests("u", 1)
    scheduler.add_request(req)
    step(scheduler)
    held = 15  # the prompt's blocks (240 tokens); decode adds one at the next step
    assert pool.get_usage() == pytest.approx(held / (8 * BPP - 1))
    upstream = 1.0 - pool.get_num_free_blocks() / (8 * BPP - 1)
    assert upstream == pytest.approx(1 - 8 / (8 * BPP - 1)), "would count 40 withheld as used"
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert pool.get_usage() == 0.0
    memory.close()


def test_preempting_to_reclaim_needs_the_scheduler_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch 0011 lets the scheduler preempt for a neighbour; every pinned release's series
    has it, so "preempt" is the default. A vLLM without the seam (a series not yet rebased
    onto it, simulated here) drains by default and refuses an explicit "preempt" at
    start-up, naming the key."""
    from kvcore.adapters.config import ElasticConfig
    from kvcore.adapters.vllm import checks
    from kvcore.errors import UnsupportedConfiguration

    default, drain = ElasticConfig.parse(None), ElasticConfig.parse({"reclaim": "drain"})
    preempt = ElasticConfig.parse({"reclaim": "preempt"})
    assert scheduler_preempts_to_reclaim()
    assert checks.resolved_reclaim(default) == "preempt"
    for config in (default, drain, preempt):
        checks.check_elastic_config(config)

    monkeypatch.setattr(checks, "scheduler_preempts_to_reclaim", lambda: False)
    assert checks.resolved_reclaim(default) == "drain"
    assert checks.resolved_reclaim(drain) == "drain"
    checks.check_elastic_config(default)
    checks.check_elastic_config(drain)
    with pytest.raises(UnsupportedConfiguration, match='reclaim="preempt"'):
        checks.check_elastic_config(preempt)
