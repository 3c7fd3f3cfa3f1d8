"""The real single-process memory stack the page-allocator and ledger tests run on.

backend wrapped in a ``FaultInjector`` -> ``VirtualKVCache`` -> ``LocalPageMapper`` ->
``PageAllocator`` (-> ``BlockLedger``). On ``host`` pages are small (64 KiB granularity) and
the device size is set per test, so tests can exhaust it; on ``cuda`` (``gpu``-marked) pages
are the driver's granularity and device exhaustion tests stay host-only.

``build_stack(background=False)`` builds the allocator without its thread and with a
``FakeClock``: the test runs the background rounds (``pages.run_round()``, ``pages.flush()``)
and moves the clock past a back-off (``stack.clock.advance``), so nothing waits on real time.
Tests about the thread itself keep ``background=True`` and wait on events and conditions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvcore.budget.gate import MemoryGate
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.geometry import KVGeometry, Layout
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.mapper import MappingState as MapperState
from kvcore.memory.pages import BACKGROUND_THREAD_NAME, WAIT_LOG_TEXT, PageAllocator
from kvcore.memory.switch_interval import DEFAULT_BACKGROUND_SWITCH_S
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.vmm import VmmBackend, open_backend
from kvcore.vmm.faults import FaultInjector
from kvcore.vmm.host import HostBackend

HOST_GRANULARITY = 64 << 10
LAYERS, BUFFERS = 2, 2

BACKENDS = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
"""Parametrize a test over these to run it on every backend."""


WAIT_TIMEOUT = 30.0
"""Seconds a test waits for an event at most: a bound that only a hung test reaches."""


class FakeClock:
    """A ``PageAllocator(clock=...)`` that moves only when the test says (``advance``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _WaitListener(logging.Handler):
    """Sets ``event`` when ``thread`` logs that it waits for pages in flight
    (``kvcore.memory.pages.WAIT_LOG_TEXT``)."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(logging.DEBUG)
        self.event = event
        self.thread: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is self.thread and WAIT_LOG_TEXT in record.getMessage():
            self.event.set()


@contextmanager
def _listening(handler: logging.Handler) -> Iterator[None]:
    logger = logging.getLogger(PageAllocator.__module__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class PageThreadHold:
    """A ``PageMapper`` in front of another that, while ``armed``, holds every ``map`` and
    ``prepare_unmap`` the page allocator's background thread makes until ``release()``:
    the test decides when pages in flight land (``entered`` is set once one is held)."""

    def __init__(self, inner: LocalPageMapper) -> None:
        self.inner = inner
        self.armed = False
        self.entered = threading.Event()
        self._go = threading.Event()

    def release(self) -> None:
        self.armed = False
        self._go.set()

    def call_past(
        self, fn: Callable[[], Any], *, started: Callable[[list[Any]], None] | None = None
    ) -> Any:
        """``fn()`` on another thread while the page thread is held; the hold is lifted
        once ``fn`` waits for the held call (the allocator logs ``WAIT_LOG_TEXT`` on
        ``fn``'s thread) or has returned without waiting, so a call that gives up on pages
        in flight is seen to return while they are still in flight. ``started(results)``
        runs once ``fn``'s thread is going. Returns what ``fn`` returned."""
        got: list[Any] = []
        ready = threading.Event()  # fn is waiting for the held call, or fn is done

        def call() -> None:
            try:
                got.append(fn())
            finally:
                ready.set()

        listener = _WaitListener(ready)
        caller = threading.Thread(target=call)
        listener.thread = caller
        with _listening(listener):
            caller.start()
            if started is not None:
                started(got)
            assert ready.wait(WAIT_TIMEOUT), "the call neither returned nor waited"
            self.release()
            caller.join(WAIT_TIMEOUT)
        assert not caller.is_alive() and got
        return got[0]

    def _hold(self) -> None:
        if self.armed and threading.current_thread().name == BACKGROUND_THREAD_NAME:
            self.entered.set()
            self._go.wait()

    def map(self, page_ids: Sequence[int]) -> None:
        self._hold()
        self.inner.map(page_ids)

    def prepare_unmap(self, page_ids: Sequence[int], *, synchronize: bool = True) -> None:
        self._hold()
        self.inner.prepare_unmap(page_ids, synchronize=synchronize)

    def __getattr__(self, name: str) -> Any:  # the rest of the PageMapper protocol
        return getattr(self.inner, name)


@contextmanager
def holding_mappers(monkeypatch: pytest.MonkeyPatch, module: Any) -> Iterator[list[PageThreadHold]]:
    """Every ``LocalPageMapper`` that ``module`` (an adapter's memory module) builds while
    this is active is wrapped in a ``PageThreadHold``; the holds, in order. Every hold is
    released on exit."""
    made: list[PageThreadHold] = []
    real = module.LocalPageMapper

    def held(cache: VirtualKVCache, **options: Any) -> PageThreadHold:
        made.append(PageThreadHold(real(cache, **options)))
        return made[-1]

    monkeypatch.setattr(module, "LocalPageMapper", held)
    try:
        yield made
    finally:
        for hold in made:
            hold.release()


@dataclass
class MemStack:
    vmm: FaultInjector
    geometry: KVGeometry
    cache: VirtualKVCache
    mapper: LocalPageMapper
    pages: PageAllocator
    hold: PageThreadHold | None = None
    clock: FakeClock | None = None
    """The allocator's clock when the test drives it (``background=False``)."""

    def ledger(self, pinned: tuple[int, ...] = (), array_stacks: bool = False) -> BlockLedger:
        """A ``BlockLedger`` over the stack; ``pinned`` blocks are allocated for good (its
        ``pinned_blocks``, e.g. vLLM's null block); ``array_stacks`` as the ledger takes it."""
        return BlockLedger(
            self.geometry, self.pages, pinned_blocks=pinned, array_stacks=array_stacks
        )

    def mapped_pages(self) -> set[int]:
        """Pages the mapper has physical memory mapped for."""
        pages = range(self.geometry.num_pages)
        return {p for p in pages if self.mapper.state(p) is MapperState.MAPPED}

    def block_bytes_view(self, layer: int = 0, buffer: int = 0) -> torch.Tensor:
        """``(num_blocks, block_bytes)`` uint8 view of one (layer, buffer)."""
        return self.cache.view(layer, buffer, torch.uint8)

    def close(self) -> None:
        """Close everything and check nothing is left: no handle, no mapping."""
        if self.hold is not None:
            self.hold.release()
        try:
            self.pages.close()
            self.mapper.close()
            self.cache.close()
            assert self.vmm.live_handles == set(), f"leaked handles {self.vmm.live_handles}"
            assert self.vmm.mapped_ranges() == [], f"leaked mappings {self.vmm.mapped_ranges()}"
        finally:
            self.vmm.close()


def build_stack(
    backend: str = "host",
    *,
    num_blocks: int = 64,
    blocks_per_page: int = 4,
    layout: Layout = "compound",
    device_pages: int | None = None,
    gate: MemoryGate | None = None,
    reserve_min: int = 0,
    reserve_max: int = 0,
    map_ahead: int = 0,
    pool_pages: int = 0,
    refill_batch: int = 8,
    charge_fixed_bytes: bool | None = False,
    retry_interval: float = 0.01,
    demand_window: float = 2.0,
    hold_page_thread: bool = False,
    background: bool = True,
    switch_interval: float | None = DEFAULT_BACKGROUND_SWITCH_S,
) -> MemStack:
    """A fresh stack. ``device_pages`` (host only): how many page ids fit on the "device"
    beside the zero page; default: all of them. ``pool_pages=0`` makes every commit release
    its handles, so device memory follows the page states exactly. ``hold_page_thread``:
    the allocator drives the mapper through a ``PageThreadHold`` (``MemStack.hold``).
    ``background=False``: no allocator thread, and a ``FakeClock`` (``MemStack.clock``)
    for its back-offs and demand window (module docstring)."""
    if hold_page_thread and not background:
        raise ValueError("a PageThreadHold holds the allocator's background thread")
    inner: VmmBackend
    if backend == "host":
        gran = HOST_GRANULARITY
        pages = -(-num_blocks // blocks_per_page) if device_pages is None else device_pages
        handles = pages * (LAYERS * BUFFERS if layout == "per-layer" else 1)
        inner = HostBackend(device_bytes=(handles + 1) * gran, granularity=gran)
    else:
        if device_pages is not None:
            pytest.skip("a device size can only be set on the host backend")
        inner = open_backend(backend)
        gran = inner.granularity()
    # a page is one granule per handle: blocks_per_page block rows of all 4 (layer, buffer)
    # pairs (compound) or blocks_per_page blocks in each (layer, buffer) range (per-layer)
    rows = LAYERS * BUFFERS if layout == "compound" else 1
    geometry = KVGeometry(
        num_layers=LAYERS,
        kv_buffers=BUFFERS,
        block_bytes=gran // (blocks_per_page * rows),
        num_blocks=num_blocks,
        page_bytes=gran,
        granularity=gran,
        layout=layout,
    )
    vmm = FaultInjector(inner)
    cache = VirtualKVCache(vmm, geometry)
    mapper = LocalPageMapper(cache, pool_pages=pool_pages)
    # the page-arithmetic tests leave the zero page out of the gate's charge (False) so their
    # figures are whole pages; None takes PageAllocator's default (charged), as engines do
    charge = {} if charge_fixed_bytes is None else {"charge_fixed_bytes": charge_fixed_bytes}
    hold = PageThreadHold(mapper) if hold_page_thread else None
    clock = None if background else FakeClock()
    allocator = PageAllocator(
        mapper if hold is None else hold,
        gate,
        reserve_min=reserve_min,
        reserve_max=reserve_max,
        map_ahead=map_ahead,
        retry_interval=retry_interval,
        refill_batch=refill_batch,
        demand_window=demand_window,
        clock=time.monotonic if clock is None else clock,
        background=background,
        switch_interval=switch_interval,
        **charge,
    )
    return MemStack(vmm, geometry, cache, mapper, allocator, hold, clock)
