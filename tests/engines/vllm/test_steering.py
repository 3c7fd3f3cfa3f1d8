"""Steering a serving instance: ``kvctl limit`` lowered and lifted under the real vLLM
scheduler (forked wheel, host backend, a private per-GPU ledger).

What a user who lowers an instance's limit while it serves expects (issue 20, point 5): it
stops growing at once, sheds its cached blocks down to the limit, keeps serving under it
(requests wait, none fails), and grows again as soon as the limit is lifted (kvcached's
issue #498 is the opposite). An idle instance sheds too: vLLM's engine core is woken
through its own idle-state callbacks and ``WAKEUP`` request (``kvcore.adapters.vllm.idle``),
run here by vLLM's own ``EngineCoreProc._process_input_queue``.
"""

from __future__ import annotations

import gc
import queue
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.request import RequestStatus

from harness.vllm.scheduler import BLOCK, BPP, GRAN, host_settings, make_request, make_scheduler
from harness.vllm.scheduler import step as run_step
from kvcore.adapters.vllm.idle import attach_engine_core
from kvcore.adapters.vllm.pool import ElasticBlockPool
from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import InstanceRecord
from kvcore.cli import kvctl, kvtop
from kvcore.vmm import open_backend

DEVICE_BYTES = 64 << 20
WAIT_S = 30.0
"""The most a test waits for the engine core's thread: only a hung test reaches it."""


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    yield
    gc.collect()  # pools close their kvcore memory when collected


class Instance:
    """One elastic scheduler registered in a private per-GPU ledger, and that ledger."""

    def __init__(self, ledger_dir: Path, num_blocks: int) -> None:
        settings = host_settings(gpu_ledger=True, ledger_dir=str(ledger_dir))
        settings["backend_options"]["device_bytes"] = DEVICE_BYTES
        self.dir = ledger_dir
        self.scheduler = make_scheduler(num_blocks, caching=True, max_num_seqs=8, kvcore=settings)
        pool = self.scheduler.kv_cache_manager.block_pool
        assert isinstance(pool, ElasticBlockPool)
        self.pool = pool
        backend = open_backend("host", 0, granularity=GRAN, device_bytes=DEVICE_BYTES)
        self.ledger = GpuLedger.open(backend.device_uuid(), directory=ledger_dir)
        (record,) = self.ledger.snapshot().records
        self.name = record.name
        self.zero = record.mapped - self.pool.ledger.pages.stats().in_use * GRAN

    def record(self) -> InstanceRecord:
        found = self.ledger.snapshot().find(self.name)
        assert found is not None
        return found

    def settle(self) -> InstanceRecord:
        """The page allocator's rounds run to the end (unmaps done, the ask recounted)."""
        assert self.pool.ledger.pages.flush()
        return self.record()

    def kvctl(self, *argv: str) -> None:
        assert kvctl.main(["--dir", str(self.dir), *argv]) == kvctl.EXIT_OK

    def kvtop_percent(self, capsys: pytest.CaptureFixture[str]) -> int:
        """The share of its limit ``kvtop --once`` shows for this instance."""
        capsys.readouterr()
        assert kvtop.main(["--dir", str(self.dir), "--once"]) == kvtop.EXIT_OK
        row = next(ln for ln in capsys.readouterr().out.splitlines() if self.name in ln)
        found = re.search(r"(\d+)%", row)
        assert found is not None, row
        return int(found.group(1))

    def serve(self, prefix: int, count: int, blocks: int, limit: int | None = None) -> int:
        """``count`` requests of distinct ``blocks``-block prompts, run to the end; asserts
        every one finished and, with ``limit``, that the record never held more. Returns
        the steps that left a request waiting."""
        reqs = [
            make_request(f"{prefix}-{i}", [prefix * 1000 + i] * (blocks * BLOCK), max_tokens=2)
            for i in range(count)
        ]
        for req in reqs:
            self.scheduler.add_request(req)
        waited = steps = 0
        while self.scheduler.has_unfinished_requests():
            assert steps < 2000, "the requests never finished"
            run_step(self.scheduler)
            steps += 1
            waited += len(self.scheduler.waiting) > 0
            if limit is not None:
                assert self.record().mapped <= limit, f"step {steps}: over the limit"
        assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
        while self.scheduler.has_requests():  # the step that reports them finished, as the
            run_step(self.scheduler)  # engine core runs it: then it is idle
        return waited

    def close(self) -> None:
        """vLLM's own shutdown (the patched ``Scheduler.shutdown`` closes the pool)."""
        self.scheduler.shutdown()
        assert self.ledger.snapshot().records == (), "the record is gone at shutdown"
        self.ledger.close()


def test_a_lowered_limit_sheds_cached_blocks_keeps_serving_and_lifting_it_grows_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inst = Instance(tmp_path, 32 * BPP)
    pages = inst.pool.ledger.pages
    try:
        inst.serve(1, 6, 3 * BPP)  # 6 prompts of 3 pages: cached, and mapped, when done
        held = inst.settle()
        assert inst.pool.num_cached_free_blocks() == 6 * 3 * BPP
        assert held.mapped == inst.zero + (1 + 18) * GRAN  # the null block's page and 18 more

        limit = inst.zero + 8 * GRAN
        inst.kvctl("limit", inst.name, str(limit))
        rec = inst.settle()
        assert rec.over_limit or rec.mapped > limit
        assert pages.shed_wanted() == 11  # 19 pages in use, 8 allowed
        assert inst.kvtop_percent(capsys) > 100  # kvtop shows it over its limit
        # the next step sheds: whole pages of cached blocks, least recently used first
        inst.serve(2, 1, 1)
        rec = inst.settle()
        assert rec.mapped <= limit and pages.shed_wanted() == 0
        assert inst.pool.num_cached_free_blocks() <= 8 * BPP - 1  # beside the null block
        assert not rec.over_limit
        assert inst.kvtop_percent(capsys) <= 100

        # under the limit it keeps serving: 8 requests of 3 pages wait their turn, all finish
        waited = inst.serve(3, 8, 3 * BPP, limit=limit)
        assert waited > 0, "the limit, not the capacity, was binding"
        assert inst.settle().mapped <= limit

        inst.kvctl("limit", inst.name, "none")  # lifted: growth comes back (kvcached #498)
        inst.serve(4, 8, 3 * BPP)
        assert inst.settle().mapped >= inst.zero + 20 * GRAN, "grew past the old limit"
    finally:
        inst.close()


def _idle_engine_core(inst: Instance) -> EngineCoreProc:
    """vLLM's ``EngineCoreProc`` with only what its idle loop reads: the scheduler, the input
    and abort queues and the idle-state callbacks. ``__init__`` is skipped because it starts
    a model executor and the engine's sockets; the loop that runs is vLLM's own code."""
    core = object.__new__(EngineCoreProc)
    core.scheduler = inst.scheduler
    core.input_queue = queue.Queue()
    core.aborts_queue = queue.Queue()
    core._idle_state_callbacks = []
    core.process_input_queue_block = True
    core.engines_running = False
    core.batch_queue = None
    core.shutdown_state = EngineShutdownState.RUNNING
    return core


def test_an_idle_engine_core_is_woken_to_shed_when_its_limit_is_lowered(tmp_path: Path) -> None:
    inst = Instance(tmp_path, 32 * BPP)
    pages = inst.pool.ledger.pages
    core = _idle_engine_core(inst)
    waker = attach_engine_core(core)
    assert waker is not None
    loop = threading.Thread(target=core._process_input_queue, name="engine-core", daemon=True)
    try:
        inst.serve(1, 6, 3 * BPP)
        assert inst.settle().mapped == inst.zero + 19 * GRAN
        loop.start()  # idle: blocked in input_queue.get(), as vLLM waits for requests
        assert waker.wakeups == 0

        limit = inst.zero + 8 * GRAN
        inst.kvctl("limit", inst.name, str(limit))
        inst.settle()  # the round that sees the overage posts one wake-up
        deadline = time.monotonic() + WAIT_S
        while waker.shed_blocks == 0:
            assert time.monotonic() < deadline, "the idle engine core never shed"
            time.sleep(0.01)
        assert waker.shed_blocks == 11 * BPP  # whole pages of cached blocks, on its thread
        rec = inst.settle()
        assert rec.mapped <= limit and pages.shed_wanted() == 0
        assert waker.wakeups == 1, "one wake-up per ask"
        assert loop.is_alive(), "back to waiting for requests"
    finally:
        core.shutdown_state = EngineShutdownState.REQUESTED
        core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        if loop.ident is not None:
            loop.join(WAIT_S)
        assert not loop.is_alive()
        inst.close()


def test_no_wake_up_is_attached_without_an_elastic_pool_or_an_input_queue(tmp_path: Path) -> None:
    inst = Instance(tmp_path, 8 * BPP)
    try:
        core = _idle_engine_core(inst)
        del core.input_queue  # an in-process engine core: it sheds at its next step only
        assert attach_engine_core(core) is None
        upstream = object.__new__(EngineCoreProc)
        upstream.scheduler = make_scheduler(8 * BPP, elastic=False)
        upstream.input_queue = queue.Queue()
        upstream._idle_state_callbacks = []
        assert attach_engine_core(upstream) is None
    finally:
        inst.close()
