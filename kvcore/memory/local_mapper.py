"""The page mapper that backs one process's virtual KV cache with its own handles.

``LocalPageMapper(cache)`` implements ``kvcore.memory.mapper.PageMapper`` on this process's cache.
Per page id it tracks a ``MappingState``::

    unmapped --map--> mapped --prepare_unmap--> prepared --commit_unmap--> unmapped
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
ones are created. A ``map`` of consecutive page ids (a burst's fresh pages) takes the zero page
off, and grants access to, each slot index's run of adjacent ranges with one driver call
each, where a page at a time needs one per page slot: the first fill of an engine's cache is
made of such maps, on its scheduler's thread when the reserve runs dry.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcore.errors import (
    InvalidTransition,
    PageQuarantined,
    PoolFailed,
    VmmError,
)
from kvcore.memory._report import MAX_REPORTED, runs_text
from kvcore.memory.mapper import MappingState
from kvcore.memory.virtual_cache import SlotStateUnknown, VirtualKVCache

if TYPE_CHECKING:
    from kvcore.vmm.base import Handle

log = logging.getLogger(__name__)


class _Slot(enum.Enum):
    ZERO = "zero"  # the zero page is mapped here
    EMPTY = "empty"  # nothing mapped (the VA range is still reserved)
    BACKED = "backed"  # the page's handle is mapped, read-write
    UNKNOWN = "unknown"  # a quarantined page's slot: cleared piecewise before reuse at close
    # an unmap of a ZERO / BACKED slot raised: it may or may not have taken effect
    SUSPECT_ZERO = "suspect-zero"
    SUSPECT_BACKED = "suspect-backed"


# module-level names of the members: the hot path reads these, not attributes of the class
_ZERO, _EMPTY, _BACKED, _UNKNOWN = _Slot.ZERO, _Slot.EMPTY, _Slot.BACKED, _Slot.UNKNOWN
_SUSPECT = {_Slot.SUSPECT_ZERO: _ZERO, _Slot.SUSPECT_BACKED: _BACKED}
_SUSPECT_OF = {_ZERO: _Slot.SUSPECT_ZERO, _BACKED: _Slot.SUSPECT_BACKED}
_UNBACKED_S, _MAPPED_S = MappingState.UNMAPPED, MappingState.MAPPED
_PREPARED_S, _QUARANTINED_S = MappingState.PREPARED, MappingState.QUARANTINED


@dataclass
class _Page:
    state: MappingState = MappingState.UNMAPPED
    handles: list[Handle] = field(default_factory=list)
    slots: list[_Slot] = field(default_factory=list)


DEFAULT_POOL_PAGES = 4
"""Page ids' worth of handles a ``LocalPageMapper`` pools by default (class docstring)."""
DEFAULT_POOL_MAX_BYTES = 256 << 20
"""The most device memory the default pool keeps: 4 page ids of a Llama-3-8B-shaped cache
under vLLM's per-layer layout at 2 MiB handles (32 handles a page id)."""


class LocalPageMapper:
    """``PageMapper`` over one ``VirtualKVCache`` in this process (module docstring).

    ``pool_pages`` bounds the physical handles kept for reuse after ``commit_unmap``
    (in pages; each page is ``handles_per_page`` handles); ``None``: ``DEFAULT_POOL_PAGES``,
    fewer where that would keep more than ``DEFAULT_POOL_MAX_BYTES`` (none where one page
    exceeds it): pooled handles are idle device memory that an instance keeps while a
    neighbour above its share is refused, so their bytes stay bounded whatever the page.
    ``held_bytes`` counts them (with every other handle not yet released) and
    ``trim_pool()`` gives them back. Thread-safe; calls are serialised.

    Raises, besides what ``kvcore.memory.mapper`` documents: ``InvalidTransition`` when an id is
    out of range, repeated, or not in the state the transition needs (nothing changed).
    ``commit_unmap`` raises the ``VmmError`` of a failed handle release *after* the pages
    are unbacked (a retry is a no-op; the handle is released again at ``close``).
    """

    def __init__(self, cache: VirtualKVCache, *, pool_pages: int | None = None) -> None:
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
        if pool_pages is None:
            pool_pages = min(
                DEFAULT_POOL_PAGES, DEFAULT_POOL_MAX_BYTES // cache.geometry.page_device_bytes
            )
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
        """Page ids of the cache (``PageMapper.num_pages``)."""
        return self._num_pages

    @property
    def page_bytes(self) -> int:
        """Device bytes one mapped page id costs: every handle of the page
        (``KVGeometry.page_device_bytes``)."""
        return self.geometry.page_device_bytes

    @property
    def fixed_bytes(self) -> int:
        """Device bytes held for the cache's whole life whatever the page states: the shared
        zero page (``VirtualKVCache.zero_page_bytes``). Not part of ``held_bytes``; the page
        allocator charges it to its gate beside ``held_bytes`` (``kvcore.memory.mapper``)."""
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
        """``PageMapper.map``: back every slot of ``page_ids`` with a handle (pooled ones
        first), all or nothing. Raises ``OutOfDeviceMemory`` or the driver's ``VmmError``
        after a clean rollback, ``PageQuarantined`` when the rollback failed,
        ``InvalidTransition`` for a page not unmapped, ``ZeroPageWritten`` (sanity mode)
        when the zero page was written, ``PoolFailed`` once failed."""
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
            self._transact(ids, _BACKED, _ZERO, _MAPPED_S, _UNBACKED_S, by_run=True)

    def prepare_unmap(self, page_ids: Sequence[int], *, synchronize: bool = True) -> None:
        """``PageMapper.prepare_unmap``: wait for the device (outside the lock; skipped with
        ``synchronize=False``, whose caller vouches for an earlier wait), then put the zero
        page back under every slot of ``page_ids``, keeping their handles. Raises like
        ``map``; after a clean rollback the pages are still mapped."""
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
        if synchronize:
            self.backend.synchronize()
        with self._lock:
            if self._closed or self._failed is not None:
                self._usable()
            ids = self._validate("prepare_unmap", ids, _MAPPED_S)
            self._transact(ids, _ZERO, _BACKED, _PREPARED_S, _MAPPED_S)

    def commit_unmap(self, page_ids: Sequence[int]) -> None:
        """``PageMapper.commit_unmap``: pool or release the handles of prepared pages
        (unmapped ones are skipped: idempotent). A failed release raises its ``VmmError``
        after the pages are unmapped (class docstring)."""
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
        """``PageMapper.abort_unmap``: map the kept handles of prepared pages again. Raises
        like ``map``."""
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
                    except (VmmError, SlotStateUnknown) as err:
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

    def state(self, page_id: int) -> MappingState:
        """The state of ``page_id``."""
        return self._pages[page_id].state

    def stats(self) -> dict[str, int]:
        """Page counts per state, pooled handles and handles awaiting a release retry."""
        with self._lock:
            out = {s.value: 0 for s in MappingState}
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
        done_state: MappingState,
        undone_state: MappingState,
        *,
        by_run: bool = False,
    ) -> None:
        """Move every slot of ``ids`` to ``target``; on a driver error move the touched
        slots back to ``origin`` and raise (``PageQuarantined`` if a page could not be
        moved back). Any other exception fails the mapper. ``by_run`` (a map: ``target``
        backed, ``origin`` the zero page) backs each run of consecutive ids whose slots are
        all on the zero page with ``_map_run``."""
        size = self._handle_bytes
        slot_vas = self._slot_vas
        move = self._move
        pages = self._pages
        started = 0  # ids[:started] were touched
        try:
            for run in _consecutive(ids) if by_run else [[p] for p in ids]:
                started += len(run)
                if len(run) > 1 and all(s is _ZERO for p in run for s in pages[p].slots):
                    self._map_run(run)
                    continue
                for p in run:
                    page = pages[p]
                    off = p * size
                    for i, va in slot_vas:
                        move(page, i, va + off, size, target)
        except (VmmError, SlotStateUnknown) as err:
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
                    f"rollback of {runs_text(bad)} failed after {err}; quarantined",
                    page_ids=bad,
                    hint="capacity drops by these pages; the engine can continue",
                ) from err
            if isinstance(err, SlotStateUnknown) and isinstance(err.__cause__, VmmError):
                raise err.__cause__ from None  # the slot was put right by the rollback
            raise
        except Exception as exc:
            self._fail(exc)
            raise PoolFailed(
                f"unexpected {type(exc).__name__} while moving pages {runs_text(ids)}: {exc}",
                hint="the mapper stopped (fail-stop); restart the engine",
            ) from exc
        except BaseException as exc:
            self._fail(exc)
            raise
        for p in ids:
            pages[p].state = done_state

    def _roll_back(self, touched: list[int], origin: _Slot, state: MappingState) -> list[int]:
        bad: list[int] = []
        for p in reversed(touched):
            page = self._pages[p]
            try:
                for i, (va, size) in reversed(list(enumerate(self.cache.slots(p)))):
                    self._move(page, i, va, size, origin)
                page.state = state
            except (VmmError, SlotStateUnknown) as err:
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
            self.cache.unmap_piecewise(va, size)
        elif current in _SUSPECT:
            old = _SUSPECT[current]
            if target is old:  # a rollback: whether the unmap took effect, mapping tells
                try:
                    if old is _ZERO:
                        self.cache.map_zero(va, size)
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
            self.cache.unmap_piecewise(va, size)
        slots[i] = _EMPTY
        if target is _ZERO:
            self.cache.map_zero(va, size)
        elif target is _BACKED:
            backend.map(va, size, page.handles[i])
            self._grant(va, size)
        slots[i] = target

    def _map_run(self, run: list[int]) -> None:
        """Back every slot of the consecutive page ids ``run`` (each slot on the zero page,
        each page with its handles), one slot index at a time: that slot's ranges of the run
        are adjacent, so one unmap takes the zero page off all of them and one
        ``set_access`` grants the handles mapped there (both may span whole mappings: the
        backend contract), where ``_move`` makes one of each per page. A driver error leaves
        every slot as a rollback expects: EMPTY, SUSPECT_ZERO where the unmap raised, and
        SUSPECT_BACKED where a handle is mapped and could not be taken off again."""
        size = self._handle_bytes
        pages = [self._pages[p] for p in run]
        span = size * len(run)
        backend = self.backend
        for i, range_va in self._slot_vas:
            base = range_va + run[0] * size
            try:
                backend.unmap(base, span)
            except VmmError:
                for page in pages:
                    page.slots[i] = _Slot.SUSPECT_ZERO
                raise
            for page in pages:
                page.slots[i] = _EMPTY
            mapped = 0
            try:
                for page in pages:
                    backend.map(base + mapped * size, size, page.handles[i])
                    mapped += 1
                backend.set_access(base, span, writable=True)
            except VmmError:
                if mapped:
                    try:
                        backend.unmap(base, mapped * size)
                    except VmmError:
                        for page in pages[:mapped]:
                            page.slots[i] = _Slot.SUSPECT_BACKED
                raise
            for page in pages:
                page.slots[i] = _BACKED

    def _grant(self, va: int, size: int) -> None:
        """Make a slot just mapped to its page's handle read-write; if that fails, unmap it
        again (``SlotStateUnknown`` when even that fails) and raise: the slot is then empty."""
        backend = self.backend
        try:
            backend.set_access(va, size, writable=True)
        except VmmError:
            try:
                backend.unmap(va, size)
            except VmmError as err:
                raise SlotStateUnknown(va, size) from err
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
        need: MappingState,
        also_ok: MappingState | None = None,
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
            states = {p: self._pages[p].state.value for p in wrong[:MAX_REPORTED]}
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


def _consecutive(ids: list[int]) -> list[list[int]]:
    """``ids`` in their order, cut where an id does not follow the one before it."""
    runs: list[list[int]] = []
    for p in ids:
        if runs and runs[-1][-1] + 1 == p:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs
