"""Elastic KV's lifecycle in the real vLLM (forked wheel, host backend): the memory registry,
clean shutdown through the patched ``Scheduler.shutdown`` / ``release_kv_memory`` (the worker's
seam), the release fence under vLLM's own ``AsyncScheduler``, and elastic memory profiling
against vLLM's own ``request_memory``.

The model runner is absent, as in vLLM's own scheduler tests: each step's
``ModelRunnerOutput`` is a stand-in (``harness.vllm.scheduler.model_output``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.config import CacheConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.mem_utils import MemorySnapshot
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import request_memory

from harness.vllm.scheduler import (
    BLOCK,
    BPP,
    SPEC,
    kv_cache_config,
    make_request,
    model_output,
    vllm_config,
)
from kvcore.adapters.vllm.memory import ElasticKVMemory
from kvcore.adapters.vllm.pool import ElasticBlockPool
from kvcore.adapters.vllm.profiling import elastic_request_memory, plan_memory
from kvcore.adapters.vllm.runtime import (
    close_all,
    elastic_settings,
    memory_for,
    release_kv_memory,
)
from kvcore.budget.ledger import GpuLedger
from kvcore.errors import KvcoreError
from kvcore.memory.pages import PageState
from kvcore.vmm import open_backend
from kvcore.vmm.faults import FaultInjector

GRAN = 4096
MIB = 1 << 20


def _elastic(
    vllm_config: VllmConfig,
    num_blocks: int,
    *,
    gran: int = GRAN,
    device_bytes: int | None = None,
    **options: Any,
) -> KVCacheConfig:
    """A KV cache config resolved as the patched engine core does (``elastic_settings``)."""
    vllm_config.cache_config.kvcore_config = {
        "backend": "host",
        "backend_options": {"granularity": gran}
        if device_bytes is None
        else {"granularity": gran, "device_bytes": device_bytes},
        **options,
    }
    kv = kv_cache_config(num_blocks)
    kv.kvcore = elastic_settings(vllm_config, kv)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return kv


def _scheduler(vllm_config: VllmConfig, kv: KVCacheConfig) -> Scheduler:
    register_all_kvcache_specs(vllm_config)
    cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        block_size=BLOCK,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


STOP = 9  # the stop token of ``_stopping_request``


def _stopping_request(rid: str, num_tokens: int) -> Request:
    """A request that stops when it samples ``STOP`` (which the scheduler cannot foresee)."""
    params = SamplingParams(max_tokens=64, stop_token_ids=[STOP])
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=params,
        pooling_params=None,
    )


def _output(out: SchedulerOutput, stop: frozenset[str] = frozenset()) -> ModelRunnerOutput:
    """Token 7 for every scheduled request; ``STOP`` for those in ``stop``."""
    return model_output(out, lambda r: [STOP if r in stop else 7])


def _pool(scheduler: Scheduler) -> ElasticBlockPool:
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    return pool


def _records(ledger_dir: Path, uuid: str) -> list[str]:
    with GpuLedger.open(uuid, directory=ledger_dir) as ledger:
        return [r.name for r in ledger.snapshot().records]


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    close_all()  # every memory of the process, the pools' own included: no gc needed


# ------------------------------------------------------------------ registry


def test_a_closed_memory_is_never_handed_out_again() -> None:
    config = vllm_config(async_scheduling=False)
    kv = _elastic(config, 4 * BPP)
    first = memory_for(kv)
    assert memory_for(kv) is first
    first.close()
    second = memory_for(kv)
    assert second is not first and not second.closed
    # closing through the registry (the worker's shutdown) forgets it too
    release_kv_memory()
    assert second.closed
    third = memory_for(kv)
    assert third is not second and not third.closed
    # a block pool built after the close takes the live memory, not a closed one
    scheduler = _scheduler(config, kv)
    assert _pool(scheduler).ledger is third.ledger


def test_close_all_closes_a_pools_own_memory_while_the_pool_still_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler without a worker in its process makes its memory itself; that memory
    closes with the pool (``close``, or its collection), and ``close_all`` closes it at a
    known point: the ledger record is gone without the garbage collector."""
    monkeypatch.setenv("KVCORE_LEDGER_DIR", str(tmp_path))
    config = vllm_config(async_scheduling=False)
    kv = _elastic(config, 4 * BPP, gpu_ledger=True)
    scheduler = _scheduler(config, kv)  # no memory_for first: the pool's own memory
    pool = _pool(scheduler)
    probe = open_backend("host", 0, granularity=GRAN)
    uuid = probe.device_uuid()
    probe.close()
    assert len(_records(tmp_path, uuid)) == 1
    close_all()
    assert _records(tmp_path, uuid) == []
    assert pool.ledger.pages.stats().mapped == 0
    scheduler.shutdown()  # the pool's own close afterwards: nothing left, no error


# ------------------------------------------------------------------ shutdown


def _ledger_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[VllmConfig, KVCacheConfig, FaultInjector, ElasticKVMemory]:
    monkeypatch.setenv("KVCORE_LEDGER_DIR", str(tmp_path))
    config = vllm_config(async_scheduling=False)
    kv = _elastic(config, 8 * BPP, gpu_ledger=True)
    backend = FaultInjector(open_backend("host", 0, granularity=GRAN, device_bytes=64 * MIB))
    memory = memory_for(kv, backend=backend)  # the worker side, as in an engine core
    return config, kv, backend, memory


def _fill(scheduler: Scheduler, n: int) -> None:
    for i in range(n):
        scheduler.add_request(make_request(f"r{i}", list(range(BPP * BLOCK)), max_tokens=8))
    out = scheduler.schedule()
    scheduler.update_from_output(out, _output(out))


def test_shutdown_unmaps_every_page_and_removes_the_ledger_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, kv, backend, memory = _ledger_kv(tmp_path, monkeypatch)
    scheduler = _scheduler(config, kv)
    _fill(scheduler, 3)
    assert memory.stats().in_use >= 4  # three requests' pages and the null block's
    uuid = backend.device_uuid()
    name = memory.gate.name  # type: ignore[attr-defined]
    assert name in _records(tmp_path, uuid)

    scheduler.shutdown()  # the patched Scheduler.shutdown closes the pool's memory
    assert memory.closed
    assert name not in _records(tmp_path, uuid)
    assert memory.mapper is not None and memory.mapper.held_bytes == 0
    assert backend.mapped_ranges() == [] and not backend.live_handles
    release_kv_memory()  # the worker's seam after the scheduler's: nothing left, no error


def test_a_failing_unmap_at_shutdown_still_releases_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config, kv, backend, memory = _ledger_kv(tmp_path, monkeypatch)
    scheduler = _scheduler(config, kv)
    _fill(scheduler, 2)
    uuid = backend.device_uuid()
    name = memory.gate.name  # type: ignore[attr-defined]
    backend.fail("unmap")  # the allocator's final unmap fails; nothing was unmapped by it

    with caplog.at_level(logging.ERROR, logger="kvcore"):
        release_kv_memory()  # the worker's seam: logs, never raises into vLLM's teardown
    assert memory.closed
    assert "closing the page allocator failed" in caplog.text
    assert name not in _records(tmp_path, uuid)  # the ledger record went anyway
    assert backend.mapped_ranges() == [] and not backend.live_handles  # the mapper's close
    scheduler.shutdown()  # the scheduler's seam after it: the memory is closed already
    assert memory_for(kv) is not memory  # never handed out again


def test_close_raises_after_releasing_everything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, backend, memory = _ledger_kv(tmp_path, monkeypatch)
    assert memory.pages is not None and memory.pages.acquire(3) is not None
    uuid = backend.device_uuid()
    backend.fail("unmap")
    with pytest.raises(KvcoreError, match="page allocator failed") as err:
        memory.close()
    assert err.value.__cause__ is not None
    assert memory.closed and memory.gate.name not in _records(tmp_path, uuid)  # type: ignore[attr-defined]
    assert backend.mapped_ranges() == [] and not backend.live_handles
    memory.close()  # idempotent, silent


# ------------------------------------------------------------------ release fence


def test_async_scheduling_keeps_a_freed_page_mapped_until_the_batch_in_flight_is_done() -> None:
    config = vllm_config(async_scheduling=True)
    kv = _elastic(config, 8 * BPP)
    assert kv.kvcore is not None and kv.kvcore["release_fence"] is True
    scheduler = _scheduler(config, kv)
    assert isinstance(scheduler, AsyncScheduler)
    pool = _pool(scheduler)
    pages = pool.ledger.pages
    # "f" fills the null block's page; "a" fills a page of its own and samples its stop
    # token in batch 1, which the scheduler learns only after handing out batch 2
    scheduler.add_request(make_request("f", list(range(100)), max_tokens=50))
    scheduler.add_request(_stopping_request("a", BPP * BLOCK - 2))

    out1 = scheduler.schedule()  # batch 1: the prefill
    blocks = scheduler.kv_cache_manager.get_block_ids("a")[0]
    page = pool.ledger.page_of(blocks[0])
    assert {pool.ledger.page_of(b) for b in blocks} == {page}
    out2 = scheduler.schedule()  # batch 2 handed out before batch 1's output: "a" is in it
    assert "a" in out2.num_scheduled_tokens

    scheduler.update_from_output(out1, _output(out1, frozenset({"a"})))  # "a" stops
    assert "a" not in scheduler.requests or scheduler.requests["a"].is_finished()
    assert not any(pool.ledger.is_allocated(b) for b in blocks)  # every block is free ...
    assert pages.state(page) == PageState.FENCED  # ... but the page stays mapped
    assert pages.flush()
    assert pages.state(page) == PageState.FENCED  # the background thread leaves it alone

    scheduler.update_from_output(out2, _output(out2))  # batch 2 done: the fence retires
    assert pages.flush()
    assert pages.state(page) == PageState.FREE  # unmapped (reserve_max 0)
    assert pages.stats().fenced == 0


def test_synchronous_scheduling_releases_at_once() -> None:
    config = vllm_config(async_scheduling=False)
    kv = _elastic(config, 8 * BPP)
    assert kv.kvcore is not None and kv.kvcore["release_fence"] is False
    scheduler = _scheduler(config, kv)
    pool = _pool(scheduler)
    scheduler.add_request(make_request("a", list(range(BPP * BLOCK - 1)), max_tokens=1))
    out = scheduler.schedule()
    page = pool.ledger.page_of(scheduler.kv_cache_manager.get_block_ids("a")[0][0])
    scheduler.update_from_output(out, _output(out))
    assert pool.ledger.pages.flush()
    assert pool.ledger.pages.state(page) == PageState.FREE


# ------------------------------------------------------------------ memory profiling


def test_a_second_instance_plans_with_its_logical_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCORE_LEDGER_DIR", str(tmp_path))
    device_bytes, gran = 1 << 30, 2 * MIB  # 2 MiB pages: few mappings for 600 MiB
    # instance 1 already holds 60% of the device in KV pages
    config1 = vllm_config(async_scheduling=False)
    kv1 = _elastic(
        config1,
        400 * (gran // SPEC.page_size_bytes),
        gran=gran,
        device_bytes=device_bytes,
        gpu_ledger=True,
    )
    backend1 = open_backend("host", 0, granularity=gran, device_bytes=device_bytes)
    first = memory_for(kv1, backend=backend1)
    held = int(device_bytes * 0.6) // gran
    assert first.pages is not None and first.pages.acquire(held) is not None

    # instance 2 starts on the same device: the device's numbers come from kvcore's backend
    # (instance 1's: one host device, one count), given to vLLM as its init snapshot
    info = backend1.mem_info()
    snapshot = MemorySnapshot(
        auto_measure=False, device="cpu", free_memory=info.free, total_memory=info.total
    )
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9)
    cache.kvcore_elastic = True
    cache.kvcore_config = config1.cache_config.kvcore_config
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(snapshot, cache)  # upstream: refuses, the memory is not free now

    plan = plan_memory(cache, backend=backend1)
    logical = math.ceil(device_bytes * 0.9)
    assert plan.logical == logical and plan.total == device_bytes
    assert plan.held_by_others >= held * gran  # instance 1's record in the ledger
    assert plan.physical == min(plan.free, plan.budget - plan.held_by_others)  # type: ignore[operator]
    assert 0 < plan.physical < device_bytes * 0.5

    # through the worker's seam: the configured backend is opened on its own (a host device
    # of the same size, counted per backend) and the logical figure comes back
    assert elastic_request_memory(snapshot, cache) == logical
    assert elastic_request_memory(snapshot, cache, external_weight_memory=16 * MIB) == (
        logical - 16 * MIB
    )

    # and the second instance does start: its own memory registers in the same ledger
    kv2 = kv_cache_config(16 * (gran // SPEC.page_size_bytes))
    kv2.kvcore = kv1.kvcore
    second = memory_for(kv2)
    assert not second.closed
    assert len(_records(tmp_path, backend1.device_uuid())) == 2
