"""Virtual KV tensors at stable addresses, backed by a shared zero page until mapped.

``VirtualKVCache(backend, geometry)`` reserves the virtual ranges of one worker's KV cache
(one per (layer, buffer) for the ``per-layer`` layout, one for ``compound``; see
``kvcore.memory.geometry``), maps a shared read-only *zero page* at every page slot, and hands out
per-layer views ``view(layer, buffer, dtype=, block_shape=)`` of shape
``(num_blocks, *block_shape)`` whose ``data_ptr()`` never changes while the cache lives
(invariant 4 of ``docs/architecture.md``: CUDA graphs capture these pointers).

The zero page is one physical handle of ``zero_page_bytes`` mapped at every unbacked page
slot (``page_bytes / zero_page_bytes`` mappings per slot), so a stray read (padding, the null
block) returns zeros. Its size trades device memory for driver calls: every unmap and map of
a page slot removes or re-creates its zero mappings, and each mapping costs a ``cuMemMap``
plus its share of ``cuMemSetAccess`` or ``cuMemUnmap``, whatever its size, so a small zero
page multiplies the driver calls of every page transition by the granules in a page. The
default is therefore the largest size that divides ``page_bytes`` and is at most
``ZERO_PAGE_MAX_BYTES`` (128 MiB): one zero mapping per slot up to 128 MiB pages, at most
``range / 128 MiB`` mappings over a whole range, for one handle of up to 128 MiB of device
memory per cache. Pass ``zero_page_bytes=`` (a multiple of the granularity dividing
``page_bytes``) to trade the other way. The zero page is real device memory:
``LocalPageMapper.fixed_bytes`` reports it (``PageAllocator`` charges it to the memory gate
by default).

A write through an unbacked block is a bug: normally the zero page is read-only and the
write faults (``SIGSEGV`` on ``host``, an illegal-address error on a GPU). With
``sanity=True`` the zero page is mapped writable instead, so the write lands, and
``check_zero_page()`` (run by ``LocalPageMapper`` before every transition) raises
``ZeroPageWritten`` naming the dirty offsets and the blocks the write may have come through.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kvcore.errors import (
    GeometryError,
    KvcoreError,
    VmmError,
    ZeroPageWritten,
)
from kvcore.memory._report import MAX_REPORTED, runs_text
from kvcore.memory.geometry import KVGeometry

if TYPE_CHECKING:
    from kvcore.vmm.base import Handle, VmmBackend

log = logging.getLogger(__name__)


ZERO_PAGE_MAX_BYTES = 128 << 20
"""Upper bound of the default zero page size (see the module docstring): large enough that a
page slot of up to 128 MiB needs one zero mapping, small enough to be a modest fixed cost
per cache."""


def default_zero_page_bytes(page_bytes: int, granularity: int) -> int:
    """The largest multiple of ``granularity`` that divides ``page_bytes`` and is at most
    ``ZERO_PAGE_MAX_BYTES`` (at least one granule)."""
    granules = page_bytes // granularity
    cap = max(ZERO_PAGE_MAX_BYTES // granularity, 1)
    best = 1
    d = 1
    while d * d <= granules:
        if granules % d == 0:
            for k in (d, granules // d):
                if best < k <= cap:
                    best = k
        d += 1
    return best * granularity


class VirtualKVCache:
    """The reserved virtual ranges of one KV cache, their zero page and stable views.

    ``dtype`` is the default element type of ``view``. ``geometry.granularity`` must be the
    backend's granularity (or a multiple of it). ``zero_page_bytes`` sizes the shared zero
    page (default ``default_zero_page_bytes(page_bytes, granularity)``, one granule with
    ``sanity``, whose check reads all of it before every transition; module docstring).
    Construction maps the zero page everywhere; ``close()`` unmaps it and frees the ranges
    (a ``LocalPageMapper`` on the cache must be closed first). ``contiguous`` (per-layer
    only): the ranges are carved back to back out of one reservation, range ``i`` at
    ``i * range_bytes``, so that ``flat()`` spans them all (an engine that views one buffer
    per layer region, as vLLM's layer-outermost layouts do). Raises ``VmmError`` (nothing
    left reserved) if the backend refuses, ``GeometryError`` for sizes that do not tile.
    """

    def __init__(
        self,
        backend: VmmBackend,
        geometry: KVGeometry,
        *,
        dtype: torch.dtype = torch.uint8,
        sanity: bool = False,
        zero_page_bytes: int | None = None,
        contiguous: bool = False,
    ) -> None:
        gran = backend.granularity()
        if geometry.page_bytes % gran:
            raise GeometryError(
                f"page_bytes={geometry.page_bytes} is not a multiple of the {backend.name} "
                f"backend's granularity {gran}",
                hint=f"build the KVGeometry with granularity={gran}",
            )
        if zero_page_bytes is None:  # sanity mode scans it before every transition: keep it small
            zero_page_bytes = gran if sanity else default_zero_page_bytes(geometry.page_bytes, gran)
        if zero_page_bytes <= 0 or zero_page_bytes % gran or geometry.page_bytes % zero_page_bytes:
            raise GeometryError(
                f"zero_page_bytes={zero_page_bytes} must be a multiple of the granularity "
                f"{gran} that divides page_bytes={geometry.page_bytes}",
                hint="leave it unset for the default",
            )
        self.zero_page_bytes = zero_page_bytes
        """Size of the shared zero page's handle (device memory held while the cache lives)."""
        self.backend = backend
        self.geometry = geometry
        self.dtype = dtype
        self.sanity = sanity
        self.granularity = gran
        self._closed = False
        self._bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        n_ranges = geometry.handles_per_page  # one range per handle of a page id
        size = geometry.range_bytes
        self.ranges: tuple[tuple[int, int], ...] = ()
        """``(va, size)`` of each reserved range: index ``layer * kv_buffers + buffer`` for
        per-layer, a single range for compound."""
        self._zero: Handle | None = None
        self._probe_va = 0
        # every VA reservation, the probe's included: what close frees
        self._reservations: list[tuple[int, int]] = []
        reserved = self._reservations
        try:
            if contiguous and n_ranges > 1:
                whole = backend.reserve(size * n_ranges)
                reserved.append((whole, size * n_ranges))
                self.ranges = tuple((whole + i * size, size) for i in range(n_ranges))
            else:
                for _ in range(n_ranges):
                    reserved.append((backend.reserve(size), size))
                self.ranges = tuple(reserved)
            zb = zero_page_bytes
            self._probe_va = backend.reserve(zb)
            reserved.append((self._probe_va, zb))
            self._zero = backend.create(zb)
            # fresh device memory is not guaranteed to be zero: clear it through the probe
            backend.map(self._probe_va, zb, self._zero)
            backend.set_access(self._probe_va, zb, writable=True)
            backend.as_tensor(self._probe_va, zb, torch.uint8).zero_()
            backend.synchronize()
            backend.set_access(self._probe_va, zb, writable=sanity)
            for va, sz in self.ranges:
                self._map_zero_range(va, sz)
        except BaseException:
            try:
                self._teardown()
            except (VmmError, SlotStateUnknown):
                log.exception("kvcore: cleanup after a failed VirtualKVCache init failed")
            raise

    # -- addresses -----------------------------------------------------------------------

    @property
    def zero_handle(self) -> Handle | None:
        """The shared zero page's handle (``None`` once closed)."""
        return self._zero

    @property
    def num_pages(self) -> int:
        """Page ids the ranges cover (``geometry.num_pages``)."""
        return self.geometry.num_pages

    def slots(self, page_id: int) -> list[tuple[int, int]]:
        """``(va, size)`` of each handle slot of ``page_id`` (``handles_per_page`` of them,
        in range order)."""
        pb = self.geometry.page_bytes
        return [(va + page_id * pb, pb) for va, _ in self.ranges]

    def range_index(self, layer: int, buffer: int) -> int:
        """Which range holds ``(layer, buffer)`` (always 0 for compound)."""
        g = self.geometry
        if not (0 <= layer < g.num_layers and 0 <= buffer < g.kv_buffers):
            raise IndexError(
                f"(layer={layer}, buffer={buffer}) outside {g.num_layers} layers x "
                f"{g.kv_buffers} buffers"
            )
        return layer * g.kv_buffers + buffer if g.layout == "per-layer" else 0

    def block_address(self, layer: int, buffer: int, block: int) -> int:
        """Virtual address of ``block``'s bytes in ``(layer, buffer)``."""
        g = self.geometry
        va = self.ranges[self.range_index(layer, buffer)][0]
        if g.layout == "per-layer":
            return va + block * g.block_bytes
        return va + block * g.page_block_bytes + (layer * g.kv_buffers + buffer) * g.block_bytes

    # -- views ---------------------------------------------------------------------------

    def view(
        self,
        layer: int,
        buffer: int,
        dtype: torch.dtype | None = None,
        block_shape: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The ``(num_blocks, *block_shape)`` tensor of ``(layer, buffer)``.

        ``block_shape`` defaults to ``(block_bytes // itemsize,)`` and must cover exactly
        ``block_bytes``. Compound views are strided: consecutive blocks are
        ``layers * kv_buffers * block_bytes`` apart. The data pointer is fixed for the
        cache's life; reading an unbacked block gives zeros.
        """
        g = self.geometry
        dtype = dtype or self.dtype
        item = torch.empty(0, dtype=dtype).element_size()
        if block_shape is None:
            if g.block_bytes % item:
                raise GeometryError(
                    f"block_bytes={g.block_bytes} is not a multiple of {dtype}'s size {item}"
                )
            block_shape = (g.block_bytes // item,)
        shape = tuple(int(d) for d in block_shape)
        if math.prod(shape) * item != g.block_bytes:
            raise GeometryError(
                f"block_shape={shape} of {dtype} is {math.prod(shape) * item} bytes, "
                f"not block_bytes={g.block_bytes}",
                hint="make the block shape's element count times the item size equal block_bytes",
            )
        self._check_open()
        index = self.range_index(layer, buffer)
        base = self._base(index, dtype)
        inner = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * shape[i + 1]
        if g.layout == "per-layer":
            stride, offset = g.block_bytes // item, 0
        else:
            stride = g.page_block_bytes // item
            offset = (layer * g.kv_buffers + buffer) * g.block_bytes // item
        return base.as_strided((g.num_blocks, *shape), (stride, *inner), offset)

    def flat(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Every range as one 1-D tensor of ``dtype`` (stable address, unbacked pages read as
        zeros): the compound range, or per-layer ranges reserved ``contiguous``. Raises
        ``GeometryError`` for per-layer ranges reserved apart."""
        self._check_open()
        va, size = self.ranges[0]
        for nxt, sz in self.ranges[1:]:
            if nxt != va + size:
                raise GeometryError(
                    "flat(): the per-layer ranges of this cache are not contiguous",
                    hint="build the VirtualKVCache with contiguous=True",
                )
            size += sz
        key = (-1, dtype)  # not a range index: the whole span
        base = self._bases.get(key)
        if base is None:
            base = self.backend.as_tensor(self.ranges[0][0], size, dtype)
            self._bases[key] = base
        return base

    def _base(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        key = (index, dtype)
        base = self._bases.get(key)
        if base is None:
            va, size = self.ranges[index]
            base = self.backend.as_tensor(va, size, dtype)
            self._bases[key] = base
        return base

    # -- zero page -----------------------------------------------------------------------

    def map_zero(self, va: int, size: int) -> None:
        """Map the zero page at every ``zero_page_bytes`` of ``[va, va+size)`` (which holds
        no mapping; ``size`` a multiple of it) and grant read (sanity mode: read-write)
        access. All or nothing."""
        self._map_zero_range(va, size)

    def check_zero_page(self, unbacked_pages: Iterable[int] | None = None) -> None:
        """Raise ``ZeroPageWritten`` if any byte of the zero page is non-zero, naming the
        offsets and the blocks of ``unbacked_pages`` (default: every page) a write may have
        come through. In sanity mode the page is zeroed again before raising."""
        self._check_open()
        probe = self.backend.as_tensor(self._probe_va, self.zero_page_bytes, torch.uint8)
        self.backend.synchronize()
        dirty = torch.nonzero(probe).flatten()
        if dirty.numel() == 0:
            return
        offsets = [int(x) for x in dirty.cpu().tolist()]
        if self.sanity:
            probe.zero_()
            self.backend.synchronize()
        pages = range(self.num_pages) if unbacked_pages is None else unbacked_pages
        candidates = self._candidates(offsets, pages)
        shown = ", ".join(f"L{ly}/B{k}/block {b}" for ly, k, b in candidates[:MAX_REPORTED])
        raise ZeroPageWritten(
            f"{len(offsets)} byte(s) written into the shared zero page at offsets "
            f"{runs_text(offsets)}; candidate (layer/buffer/block): {shown}"
            + (" ..." if len(candidates) > MAX_REPORTED else ""),
            offsets=offsets,
            candidates=candidates,
            hint="a block was written while kvcore had no page mapped under it: check that "
            "the engine writes only blocks it allocated and has not freed",
        )

    def _candidates(self, offsets: list[int], pages: Iterable[int]) -> list[tuple[int, int, int]]:
        """Every ``(layer, buffer, block)`` whose bytes sit at one of ``offsets`` of a zero
        page mapping in one of ``pages`` (at most ``4 * MAX_REPORTED``)."""
        g = self.geometry
        gran = self.zero_page_bytes
        unit = math.gcd(gran, g.block_bytes)
        reps = sorted({off // unit * unit for off in offsets})
        out: set[tuple[int, int, int]] = set()
        for page in pages:
            for i in range(g.page_bytes // gran):
                for off in reps:
                    rel = i * gran + off
                    for r in range(len(self.ranges)):
                        if g.layout == "per-layer":
                            block = page * g.blocks_per_page + rel // g.block_bytes
                            layer, buffer = divmod(r, g.kv_buffers)
                        else:
                            block = page * g.blocks_per_page + rel // g.page_block_bytes
                            row = (rel % g.page_block_bytes) // g.block_bytes
                            layer, buffer = divmod(row, g.kv_buffers)
                        if block < g.num_blocks:
                            out.add((layer, buffer, block))
                        if len(out) >= 4 * MAX_REPORTED:
                            return sorted(out)
        return sorted(out)

    def _map_zero_range(self, va: int, size: int) -> None:
        zero = self._zero
        assert zero is not None
        zb = self.zero_page_bytes
        backend = self.backend
        done = 0
        try:
            if size == zb:  # one zero mapping per page slot: the common case
                backend.map(va, zb, zero)
                done = zb
            else:
                for off in range(0, size, zb):
                    backend.map(va + off, zb, zero)
                    done += zb
            backend.set_access(va, size, writable=self.sanity)
        except BaseException:
            if done:
                # best effort; if this fails too the caller sees the original error and
                # treats the range's state as unknown
                try:
                    self.backend.unmap(va, done)
                except VmmError as err:
                    raise SlotStateUnknown(va, size) from err
            raise

    # -- life ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the zero page, free the ranges, release the zero handle. Idempotent. The
        views must not be used afterwards. Raises the first ``VmmError`` after trying
        everything."""
        if self._closed:
            return
        self._closed = True
        self._bases.clear()
        self._teardown()

    def _teardown(self) -> None:
        errors: list[BaseException] = []
        for va, size in self._reservations:
            try:
                self.backend.unmap(va, size)
            except VmmError as err:
                # not one clean tiling of mappings (a failed init or a broken page): take
                # them down slot by slot so the reservation can still be freed
                errors.append(err)
                self.unmap_piecewise(va, size)
            try:
                self.backend.free_reservation(va, size)
            except VmmError as err:
                errors.append(err)
        self._reservations.clear()
        if self._zero is not None:
            try:
                self.backend.release(self._zero)
            except VmmError as err:
                errors.append(err)
            self._zero = None
        if errors:
            raise errors[0]

    def unmap_piecewise(self, va: int, size: int) -> None:
        """Take down whatever is mapped in ``[va, va+size)``: page-, zero-page- or
        granule-sized pieces, skipping what is not mapped. For a range whose mappings are
        unknown (``SlotStateUnknown``, a failed init); never raises."""
        page, zb, gran = self.geometry.page_bytes, self.zero_page_bytes, self.granularity
        off = 0
        while off < size:
            step = gran
            lengths = [n for n in (page, zb) if off % n == 0 and off + n <= size] + [gran]
            for length in dict.fromkeys(lengths):
                try:
                    self.backend.unmap(va + off, length)
                    step = length
                    break
                except VmmError:
                    continue
            off += step

    def _check_open(self) -> None:
        if self._closed:
            raise KvcoreError("the virtual KV cache is closed")


class SlotStateUnknown(Exception):
    """A slot's mappings are unknown: a map failed and unmapping what it had done failed
    too. Raised by ``map_zero``; the caller must treat the slot as broken (quarantine it,
    or clear it with ``unmap_piecewise``)."""

    def __init__(self, va: int, size: int) -> None:
        super().__init__(f"slot {va:#x}+{size:#x} is in an unknown state")
