"""The real single-process memory stack the page-allocator and ledger tests run on.

host backend (memfd + mmap) wrapped in a ``FaultInjector`` -> ``VirtualKVCache`` ->
``LocalPageMapper`` -> ``PageAllocator`` (-> ``BlockLedger``). Small pages (64 KiB
granularity) keep each stack a few MiB, so a test can build many and exhaust the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.accounting import MemoryGate
from kvcore.blocks import BlockLedger
from kvcore.geometry import KVGeometry, Layout
from kvcore.pages import PageAllocator
from kvcore.tensors import LocalPageMapper, VirtualKVCache
from kvcore.tensors import PageState as MapperState
from kvcore.vmm.faults import FaultInjector
from kvcore.vmm.host import HostBackend

GRANULARITY = 64 << 10
BLOCK_BYTES = 4 << 10  # compound: 2 layers x 2 buffers x 4 KiB = 16 KiB per block row


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
        self.pages.close()
        self.mapper.close()
        self.cache.close()
        assert self.vmm.live_handles == set(), f"leaked handles {self.vmm.live_handles}"
        assert self.vmm.mapped_ranges() == [], f"leaked mappings {self.vmm.mapped_ranges()}"


def build_stack(
    *,
    num_blocks: int = 64,
    blocks_per_page: int = 4,
    layout: Layout = "compound",
    device_pages: int | None = None,
    gate: MemoryGate | None = None,
    reserve_min: int = 0,
    reserve_max: int = 0,
    pool_pages: int = 0,
    retry_interval: float = 0.01,
) -> MemStack:
    """A fresh stack. ``device_pages``: how many page ids fit on the host "device" (beside
    the zero page); default: all of them. ``pool_pages=0`` makes every commit release its
    handles, so device memory follows the page states exactly."""
    layers, buffers = 2, 2
    # a page is one granule per handle either way: 4 blocks of 4 x 4 KiB rows (compound)
    # or 4 blocks of 16 KiB in each of the 4 (layer, buffer) ranges (per-layer)
    block_bytes = BLOCK_BYTES if layout == "compound" else BLOCK_BYTES * layers * buffers
    row = block_bytes * (layers * buffers if layout == "compound" else 1)
    geometry = KVGeometry(
        num_layers=layers,
        kv_buffers=buffers,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        page_bytes=row * blocks_per_page,
        granularity=GRANULARITY,
        layout=layout,
    )
    pages = geometry.num_pages if device_pages is None else device_pages
    device_bytes = (pages * geometry.page_device_bytes) + GRANULARITY  # + the zero page
    vmm = FaultInjector(HostBackend(device_bytes=device_bytes, granularity=GRANULARITY))
    cache = VirtualKVCache(vmm, geometry)
    mapper = LocalPageMapper(cache, pool_pages=pool_pages)
    allocator = PageAllocator(
        mapper,
        gate,
        reserve_min=reserve_min,
        reserve_max=reserve_max,
        retry_interval=retry_interval,
    )
    return MemStack(vmm, geometry, cache, mapper, allocator)
