"""The real single-process memory stack the page-allocator and ledger tests run on.

backend wrapped in a ``FaultInjector`` -> ``VirtualKVCache`` -> ``LocalPageMapper`` ->
``PageAllocator`` (-> ``BlockLedger``). On ``host`` pages are small (64 KiB granularity) and
the device size is set per test, so tests can exhaust it; on ``cuda`` (``gpu``-marked, run
by the lead on the H200) pages are the driver's granularity and device exhaustion tests
stay host-only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvcore.accounting import MemoryGate
from kvcore.blocks import BlockLedger
from kvcore.geometry import KVGeometry, Layout
from kvcore.pages import PageAllocator
from kvcore.tensors import LocalPageMapper, VirtualKVCache
from kvcore.tensors import PageState as MapperState
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


@dataclass
class MemStack:
    vmm: FaultInjector
    geometry: KVGeometry
    cache: VirtualKVCache
    mapper: LocalPageMapper
    pages: PageAllocator

    def ledger(self, reserved_blocks: tuple[int, ...] = ()) -> BlockLedger:
        return BlockLedger(self.geometry, self.pages, reserved_blocks)

    def mapped_pages(self) -> set[int]:
        """Pages the mapper has physical memory mapped for."""
        pages = range(self.geometry.num_pages)
        return {p for p in pages if self.mapper.state(p) is MapperState.MAPPED}

    def block_bytes_view(self, layer: int = 0, buffer: int = 0) -> torch.Tensor:
        """``(num_blocks, block_bytes)`` uint8 view of one (layer, buffer)."""
        return self.cache.view(layer, buffer, torch.uint8)

    def close(self) -> None:
        """Close everything and check nothing is left: no handle, no mapping."""
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
    pool_pages: int = 0,
    refill_batch: int = 8,
    charge_fixed_bytes: bool | None = False,
    retry_interval: float = 0.01,
    demand_window: float = 2.0,
) -> MemStack:
    """A fresh stack. ``device_pages`` (host only): how many page ids fit on the "device"
    beside the zero page; default: all of them. ``pool_pages=0`` makes every commit release
    its handles, so device memory follows the page states exactly."""
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
    allocator = PageAllocator(
        mapper,
        gate,
        reserve_min=reserve_min,
        reserve_max=reserve_max,
        retry_interval=retry_interval,
        refill_batch=refill_batch,
        demand_window=demand_window,
        **charge,
    )
    return MemStack(vmm, geometry, cache, mapper, allocator)
