"""Virtual KV tensors at stable addresses, and the mapper that backs their pages locally.

``VirtualKVCache(backend, geometry)`` reserves the virtual ranges of one worker's KV cache
(one per (layer, buffer) for the ``per-layer`` layout, one for ``compound``; see
``kvcore.geometry``), maps a shared read-only *zero page* at every page slot, and hands out
per-layer views ``view(layer, buffer, dtype=, block_shape=)`` of shape
``(num_blocks, *block_shape)`` whose ``data_ptr()`` never changes while the cache lives
(DESIGN.md invariant 4: CUDA graphs capture these pointers).

The zero page is one physical handle of ``zero_page_bytes`` mapped at every unbacked page
slot (``page_bytes / zero_page_bytes`` mappings per slot), so a stray read (padding, the null
block) returns zeros. Its size trades device memory for driver calls: every unmap and map of
a page slot removes or re-creates its zero mappings, and each mapping costs a ``cuMemMap``
plus its share of ``cuMemSetAccess`` (~40 us on an H200) or ``cuMemUnmap`` (~25 us) whatever
its size. A one-granule zero page made a 10 GiB handoff of 128 MiB pages spend ~200 ms
re-mapping 5,120 zero granules (GPU suite, commit a472e75). The default is therefore the
largest size that divides ``page_bytes`` and is at most ``ZERO_PAGE_MAX_BYTES`` (128 MiB):
one zero mapping per slot up to 128 MiB pages, at most ``range / 128 MiB`` mappings over a
whole range, for one handle of up to 128 MiB of device memory per cache. Pass
``zero_page_bytes=`` (a multiple of the granularity dividing ``page_bytes``) to trade the
other way. The zero page is real device memory: ``LocalPageMapper.fixed_bytes`` reports it
(``PageAllocator`` charges it to the memory gate by default).

A write through an unbacked block is a bug: normally the zero page is read-only and the
write faults (``SIGSEGV`` on ``host``, an illegal-address error on a GPU). With
``sanity=True`` the zero page is mapped writable instead, so the write lands, and
``check_zero_page()`` (run by ``LocalPageMapper`` before every transition) raises
``ZeroPageWritten`` naming the dirty offsets and the blocks the write may have come through.

``LocalPageMapper(cache)`` implements ``kvcore.mapper.PageMapper`` on this process's cache.
Per page id it tracks a state::

    unbacked --map--> mapped --prepare_unmap--> prepared --commit_unmap--> unbacked
                        ^                           |
                        +--------abort_unmap--------+
    any failed rollback --> quarantined (never handed out again)
    unknown state       --> failed mapper (every later call raises PoolFailed)

and per page slot (one per handle) the exact mapping: zero page, nothing, or its handle.
Every transition of a call is all-or-nothing: on a driver error the slots touched so far are
moved back along the inverse path. The mapper trusts the backend contract (a failed call
changed nothing); a driver that breaks it is caught when a rollback step on that slot then
fails, and the page is quarantined (its slots are cleared piecewise at ``close``).
Physical handles come from a bounded pool of handles freed by earlier commits before new
ones are created.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcore.errors import (
    GeometryError,
    InvalidTransition,
    KvcoreError,
    PageQuarantined,
    PoolFailed,
    VmmError,
    ZeroPageWritten,
)
from kvcore.geometry import KVGeometry

if TYPE_CHECKING:
    from kvcore.vmm.base import Handle, VmmBackend

log = logging.getLogger(__name__)

_MAX_REPORTED = 16

ZERO_PAGE_MAX_BYTES = 128 << 20
"""Upper bound of the default zero page size (see the module docstring): on an H200 a
handle of 128 MiB or more maps and set-accesses at under 1 us per 2 MiB."""


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
        self._reserved: list[tuple[int, int]] = []  # everything to free at close
        reserved = self._reserved
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
            except (VmmError, _Broken):
                log.exception("kvcore: cleanup after a failed VirtualKVCache init failed")
            raise

    # -- addresses -----------------------------------------------------------------------

    @property
    def zero_handle(self) -> Handle | None:
        """The shared zero page's handle (``None`` once closed)."""
        return self._zero

    @property
    def num_pages(self) -> int:
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
        shown = ", ".join(f"L{ly}/B{k}/block {b}" for ly, k, b in candidates[:_MAX_REPORTED])
        raise ZeroPageWritten(
            f"{len(offsets)} byte(s) written into the shared zero page at offsets "
            f"{_ranges_text(offsets)}; candidate (layer/buffer/block): {shown}"
            + (" ..." if len(candidates) > _MAX_REPORTED else ""),
            offsets=offsets,
            candidates=candidates,
            hint="a block was written while kvcore had no page mapped under it: check that "
            "the engine writes only blocks it allocated and has not freed",
        )

    def _candidates(self, offsets: list[int], pages: Iterable[int]) -> list[tuple[int, int, int]]:
        """Every ``(layer, buffer, block)`` whose bytes sit at one of ``offsets`` of a zero
        page mapping in one of ``pages`` (at most ``4 * _MAX_REPORTED``)."""
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
                        if len(out) >= 4 * _MAX_REPORTED:
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
                    raise _Broken(va, size) from err
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
        for va, size in self._reserved:
            try:
                self.backend.unmap(va, size)
            except VmmError as err:
                # not one clean tiling of mappings (a failed init or a broken page): take
                # them down slot by slot so the reservation can still be freed
                errors.append(err)
                self._unmap_piecewise(va, size)
            try:
                self.backend.free_reservation(va, size)
            except VmmError as err:
                errors.append(err)
        self._reserved.clear()
        if self._zero is not None:
            try:
                self.backend.release(self._zero)
            except VmmError as err:
                errors.append(err)
            self._zero = None
        if errors:
            raise errors[0]

    def _unmap_piecewise(self, va: int, size: int) -> None:
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


class _Broken(Exception):
    """A slot's state is unknown after a failed rollback step."""

    def __init__(self, va: int, size: int) -> None:
        super().__init__(f"slot {va:#x}+{size:#x} is in an unknown state")


class PageState(enum.Enum):
    """Where a page id stands in ``LocalPageMapper``."""

    UNBACKED = "unbacked"
    MAPPED = "mapped"
    PREPARED = "prepared"
    QUARANTINED = "quarantined"


class _Slot(enum.Enum):
    ZERO = "zero"  # the zero page is mapped here
    EMPTY = "empty"  # nothing mapped (reserved only)
    BACKED = "backed"  # the page's handle is mapped, read-write
    UNKNOWN = "unknown"  # a quarantined page's slot: cleared piecewise before reuse at close
    # an unmap of a ZERO / BACKED slot raised: it may or may not have taken effect
    SUSPECT_ZERO = "suspect-zero"
    SUSPECT_BACKED = "suspect-backed"


# module-level names of the members: an Enum member read through its class costs ~100 ns
_ZERO, _EMPTY, _BACKED, _UNKNOWN = _Slot.ZERO, _Slot.EMPTY, _Slot.BACKED, _Slot.UNKNOWN
_SUSPECT = {_Slot.SUSPECT_ZERO: _ZERO, _Slot.SUSPECT_BACKED: _BACKED}
_SUSPECT_OF = {_ZERO: _Slot.SUSPECT_ZERO, _BACKED: _Slot.SUSPECT_BACKED}
_UNBACKED_S, _MAPPED_S = PageState.UNBACKED, PageState.MAPPED
_PREPARED_S, _QUARANTINED_S = PageState.PREPARED, PageState.QUARANTINED


@dataclass
class _Page:
    state: PageState = PageState.UNBACKED
    handles: list[Handle] = field(default_factory=list)
    slots: list[_Slot] = field(default_factory=list)


class LocalPageMapper:
    """``PageMapper`` over one ``VirtualKVCache`` in this process (module docstring).

    ``pool_pages`` bounds the physical handles kept for reuse after ``commit_unmap``
    (in pages; each page is ``handles_per_page`` handles). Pooled handles hold device memory:
    ``held_bytes`` counts them (with every other handle not yet released) and
    ``trim_pool()`` gives them back. Thread-safe; calls are serialised.

    Raises, besides what ``kvcore.mapper`` documents: ``InvalidTransition`` when an id is
    out of range, repeated, or not in the state the transition needs (nothing changed).
    ``commit_unmap`` raises the ``VmmError`` of a failed handle release *after* the pages
    are unbacked (a retry is a no-op; the handle is released again at ``close``).
    """

    def __init__(self, cache: VirtualKVCache, *, pool_pages: int = 4) -> None:
        self.cache = cache
        self.backend = cache.backend
        self.geometry = cache.geometry
        # geometry figures are properties computed per read: the hot path reads these
        self._num_pages = cache.geometry.num_pages
        self._hpp = cache.geometry.handles_per_page
        self._handle_bytes = cache.geometry.page_bytes
        self._range_vas = tuple(va for va, _ in cache.ranges)
        self._slot_vas = tuple(enumerate(self._range_vas))  # (slot index, range base)
        self._check_zero = cache.sanity  # sanity mode: scan the zero page before transitions
        self.pool_max = pool_pages * self._hpp
        self._pages = [_Page(slots=[_ZERO] * len(cache.ranges)) for _ in range(cache.num_pages)]
        self._pool: list[Handle] = []
        self._pending_release: list[Handle] = []
        self._live_handles = 0  # created and not released: what held_bytes reports
        self._failed: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()  # no method re-enters it

    # -- PageMapper ----------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_device_bytes

    @property
    def fixed_bytes(self) -> int:
        """Device bytes held for the cache's whole life whatever the page states: the shared
        zero page (``VirtualKVCache.zero_page_bytes``). Not part of ``held_bytes``; the page
        allocator charges it to its gate beside ``held_bytes`` (``kvcore.mapper``)."""
        return self.cache.zero_page_bytes

    @property
    def held_bytes(self) -> int:
        """Device bytes of every handle this mapper created and has not released: mapped,
        prepared and quarantined pages, pooled handles, failed releases (not the cache's
        zero page)."""
        return self._live_handles * self._handle_bytes

    @property
    def pooled_pages(self) -> int:
        """Whole pages' worth of pooled handles (a ``map`` takes these before creating)."""
        return len(self._pool) // self._hpp

    def map(self, page_ids: Sequence[int]) -> None:
        with self._lock:
            if self._closed or self._failed is not None:
                self._usable()
            ids = self._validate("map", page_ids, _UNBACKED_S)
            if not ids:
                return
            if self._check_zero:
                self._sanity()
            hpp = self._hpp
            handles = self._take_handles(len(ids) * hpp)
            if len(ids) == 1:
                self._pages[ids[0]].handles = handles
            else:
                for i, p in enumerate(ids):
                    self._pages[p].handles = handles[i * hpp : (i + 1) * hpp]
            self._transact(ids, _BACKED, _ZERO, _MAPPED_S, _UNBACKED_S)

    def prepare_unmap(self, page_ids: Sequence[int]) -> None:
        with self._lock:
            if self._closed or self._failed is not None:
                self._usable()
            ids = self._validate("prepare_unmap", page_ids, _MAPPED_S)
            if not ids:
                return
            if self._check_zero:
                self._sanity()
        # no kernel submitted so far still reads these pages once this returns; waited for
        # outside the lock, so a map of other pages meanwhile never waits for the device
        self.backend.synchronize()
        with self._lock:
            if self._closed or self._failed is not None:
                self._usable()
            ids = self._validate("prepare_unmap", ids, _MAPPED_S)
            self._transact(ids, _ZERO, _BACKED, _PREPARED_S, _MAPPED_S)

    def commit_unmap(self, page_ids: Sequence[int]) -> None:
        with self._lock:
            if self._closed or self._failed is not None:
                self._usable()
            ids = self._validate("commit_unmap", page_ids, _PREPARED_S, also_ok=_UNBACKED_S)
            freed: list[Handle] = []
            for p in ids:
                page = self._pages[p]
                if page.state is _PREPARED_S:
                    freed += page.handles
                    page.handles = []
                    page.state = _UNBACKED_S
            errors = self._give_back(freed)
            if errors:
                raise errors[0]

    def abort_unmap(self, page_ids: Sequence[int]) -> None:
        with self._lock:
            self._usable()
            ids = self._validate("abort_unmap", page_ids, _PREPARED_S)
            if ids:
                self._transact(ids, _BACKED, _ZERO, _MAPPED_S, _PREPARED_S)

    def close(self) -> None:
        """Move every page back to the zero page and release every handle (pooled,
        pending and quarantined ones too). Idempotent; later calls raise ``PoolFailed``.
        Raises the first ``VmmError`` after trying everything."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors: list[BaseException] = []
            handles: list[Handle] = []
            for p, page in enumerate(self._pages):
                for i, (va, size) in enumerate(self.cache.slots(p)):
                    try:
                        self._move(page, i, va, size, _ZERO)
                    except (VmmError, _Broken) as err:
                        errors.append(err)
                handles.extend(page.handles)
                page.handles = []
                page.state = _UNBACKED_S
            handles.extend(self._pool)
            self._pool.clear()
            handles.extend(self._pending_release)
            self._pending_release.clear()
            for h in handles:
                try:
                    self.backend.release(h)
                    self._live_handles -= 1
                except VmmError as err:
                    errors.append(err)
            if errors:
                first = errors[0]
                raise first if isinstance(first, VmmError) else PoolFailed(str(first))

    # -- introspection -------------------------------------------------------------------

    def state(self, page_id: int) -> PageState:
        """The state of ``page_id``."""
        return self._pages[page_id].state

    def stats(self) -> dict[str, int]:
        """Page counts per state, pooled handles and handles awaiting a release retry."""
        with self._lock:
            out = {s.value: 0 for s in PageState}
            for page in self._pages:
                out[page.state.value] += 1
            out["pooled_handles"] = len(self._pool)
            out["pending_release"] = len(self._pending_release)
            return out

    @property
    def failed(self) -> bool:
        """True once the mapper stopped on an unknown state."""
        return self._failed is not None

    def trim_pool(self, keep_pages: int = 0) -> None:
        """Release pooled handles until at most ``keep_pages`` pages' worth remain (memory
        back to the driver), and retry the releases that failed earlier. Raises the first
        ``VmmError`` after trying them all (a handle that failed stays in ``held_bytes``
        until a later retry or ``close``)."""
        with self._lock:
            keep = max(keep_pages, 0) * self._hpp
            extra = self._pool[keep:]
            del self._pool[keep:]
            retry, self._pending_release = self._pending_release, []
            errors = self._release_all(extra + retry)
            if errors:
                raise errors[0]

    # -- transitions ---------------------------------------------------------------------

    def _transact(
        self,
        ids: list[int],
        target: _Slot,
        origin: _Slot,
        done_state: PageState,
        undone_state: PageState,
    ) -> None:
        """Move every slot of ``ids`` to ``target``; on a driver error move the touched
        slots back to ``origin`` and raise (``PageQuarantined`` if a page could not be
        moved back). Any other exception fails the mapper."""
        size = self._handle_bytes
        slot_vas = self._slot_vas
        move = self._move
        pages = self._pages
        started = 0  # ids[:started] were touched
        try:
            for p in ids:
                started += 1
                page = pages[p]
                off = p * size
                for i, va in slot_vas:
                    move(page, i, va + off, size, target)
        except (VmmError, _Broken) as err:
            bad = self._roll_back(ids[:started], origin, undone_state)
            if undone_state is _UNBACKED_S:
                # handles of pages back on the zero page return to the pool; a quarantined
                # page keeps its handles until close
                freed: list[Handle] = []
                for p in set(ids) - set(bad):
                    freed.extend(self._pages[p].handles)
                    self._pages[p].handles = []
                self._give_back(freed)
            if bad:
                raise PageQuarantined(
                    f"rollback of {_ranges_text(bad)} failed after {err}; quarantined",
                    page_ids=bad,
                    hint="capacity drops by these pages; the engine can continue",
                ) from err
            if isinstance(err, _Broken) and isinstance(err.__cause__, VmmError):
                raise err.__cause__ from None  # the slot was put right by the rollback
            raise
        except Exception as exc:
            self._fail(exc)
            raise PoolFailed(
                f"unexpected {type(exc).__name__} while moving pages {_ranges_text(ids)}: {exc}",
                hint="the mapper stopped (fail-stop); restart the engine",
            ) from exc
        except BaseException as exc:
            self._fail(exc)
            raise
        for p in ids:
            pages[p].state = done_state

    def _roll_back(self, touched: list[int], origin: _Slot, state: PageState) -> list[int]:
        bad: list[int] = []
        for p in reversed(touched):
            page = self._pages[p]
            try:
                for i, (va, size) in reversed(list(enumerate(self.cache.slots(p)))):
                    self._move(page, i, va, size, origin)
                page.state = state
            except (VmmError, _Broken) as err:
                log.error("kvcore: page %d quarantined: rollback failed: %s", p, err)
                page.state = _QUARANTINED_S
                page.slots = [_UNKNOWN] * len(page.slots)
                bad.append(p)
        return sorted(bad)

    def _move(self, page: _Page, i: int, va: int, size: int, target: _Slot) -> None:
        """Drive slot ``i`` of ``page`` to ``target`` through EMPTY; every step updates the
        recorded state only once the backend confirmed it."""
        slots = page.slots
        current = slots[i]
        if current is target:
            return
        backend = self.backend
        if current is _ZERO or current is _BACKED:
            try:
                backend.unmap(va, size)
            except VmmError:
                # the unmap may have taken effect all the same: the slot is suspect until a
                # rollback finds out (below) instead of trusting the old state
                slots[i] = _SUSPECT_OF[current]
                raise
        elif current is _UNKNOWN:
            self.cache._unmap_piecewise(va, size)
        elif current in _SUSPECT:
            old = _SUSPECT[current]
            if target is old:  # a rollback: whether the unmap took effect, mapping tells
                try:
                    if old is _ZERO:
                        self.cache._map_zero_range(va, size)
                    else:
                        backend.map(va, size, page.handles[i])
                except VmmError:  # the range is still mapped: the failed unmap did nothing
                    slots[i] = old
                    return
                if old is _BACKED:
                    slots[i] = _EMPTY  # until access is granted
                    self._grant(va, size)
                slots[i] = old
                return
            self.cache._unmap_piecewise(va, size)
        slots[i] = _EMPTY
        if target is _ZERO:
            self.cache._map_zero_range(va, size)
        elif target is _BACKED:
            backend.map(va, size, page.handles[i])
            self._grant(va, size)
        slots[i] = target

    def _grant(self, va: int, size: int) -> None:
        """Make a slot just mapped to its page's handle read-write; if that fails, unmap it
        again (``_Broken`` when even that fails) and raise: the slot is then empty."""
        backend = self.backend
        try:
            backend.set_access(va, size, writable=True)
        except VmmError:
            try:
                backend.unmap(va, size)
            except VmmError as err:
                raise _Broken(va, size) from err
            raise

    # -- handles -------------------------------------------------------------------------

    def _take_handles(self, n: int) -> list[Handle]:
        """``n`` handles of ``page_bytes``: pooled ones first, then new ones. On failure
        everything taken goes back and the error is raised (``OutOfDeviceMemory``: a
        miss)."""
        pool = self._pool
        if len(pool) >= n:  # the pool covers it: no driver call
            taken = pool[len(pool) - n :]
            del pool[len(pool) - n :]
            return taken
        taken = [pool.pop() for _ in range(len(pool))]
        try:
            while len(taken) < n:
                taken.append(self.backend.create(self._handle_bytes))
                self._live_handles += 1
        except VmmError:
            self._give_back(taken)
            raise
        except Exception as exc:
            self._give_back(taken)
            self._fail(exc)
            raise PoolFailed(f"unexpected {type(exc).__name__} in create: {exc}") from exc
        return taken

    def _give_back(self, handles: list[Handle]) -> list[BaseException]:
        pool = self._pool
        room = self.pool_max - len(pool)
        if len(handles) <= room and not self._pending_release:  # all to the pool
            pool += handles
            return []
        room = max(room, 0)
        self._pool.extend(handles[:room])
        retry, self._pending_release = self._pending_release, []
        return self._release_all(handles[room:] + retry)

    def _release_all(self, handles: list[Handle]) -> list[BaseException]:
        errors: list[BaseException] = []
        for h in handles:
            try:
                self.backend.release(h)
                self._live_handles -= 1
            except VmmError as err:
                self._pending_release.append(h)
                errors.append(err)
        return errors

    # -- guards --------------------------------------------------------------------------

    def _validate(
        self,
        call: str,
        page_ids: Sequence[int],
        need: PageState,
        also_ok: PageState | None = None,
    ) -> list[int]:
        pages, n = self._pages, self._num_pages
        if len(page_ids) == 1:  # the most common call: one page id
            p = int(page_ids[0])
            if 0 <= p < n:
                s = pages[p].state
                if s is need or s is also_ok:
                    return [p]
        ids = [int(p) for p in page_ids]
        if len(ids) == 1:
            pass  # out of range or in the wrong state: reported below
        elif len(set(ids)) == len(ids) and all(
            0 <= p < n and pages[p].state in (need, also_ok) for p in ids
        ):
            return ids  # the common case; below, the same checks again to say what is wrong
        if len(set(ids)) != len(ids):
            dup = sorted({p for p in ids if ids.count(p) > 1})
            raise InvalidTransition(f"{call}: page ids repeated: {dup}", ids=dup)
        out_of_range = [p for p in ids if not 0 <= p < self.num_pages]
        if out_of_range:
            raise InvalidTransition(
                f"{call}: page ids {out_of_range} outside 0..{self.num_pages - 1}",
                ids=out_of_range,
            )
        wrong = [p for p in ids if self._pages[p].state not in (need, also_ok)]
        if wrong:
            states = {p: self._pages[p].state.value for p in wrong[:_MAX_REPORTED]}
            raise InvalidTransition(
                f"{call} needs pages in state {need.value!r}; got {states}",
                ids=wrong,
                hint="quarantined pages are never handed out again"
                if any(self._pages[p].state is _QUARANTINED_S for p in wrong)
                else "",
            )
        return ids

    def _usable(self) -> None:
        if self._closed:
            raise PoolFailed("the page mapper is closed")
        if self._failed is not None:
            raise PoolFailed(
                f"the page mapper stopped after {type(self._failed).__name__}: {self._failed}",
                hint="restart the engine; the per-GPU ledger reclaims what it held",
            ) from self._failed

    def _fail(self, exc: BaseException) -> None:
        log.critical("kvcore: page mapper failed (fail-stop): %r", exc)
        self._failed = exc

    def _sanity(self) -> None:
        if self.cache.sanity:
            self.cache.check_zero_page(self._unbacked())

    def _unbacked(self) -> list[int]:
        return [p for p, page in enumerate(self._pages) if _ZERO in page.slots]


def _ranges_text(values: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``'3-5, 9'`` (first few runs only)."""
    runs: list[str] = []
    vals = sorted(values)
    i = 0
    while i < len(vals) and len(runs) < _MAX_REPORTED:
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        runs.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    if i < len(vals):
        runs.append("...")
    return ", ".join(runs)
