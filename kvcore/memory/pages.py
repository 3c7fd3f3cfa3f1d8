"""The page allocator: which page ids hold physical memory, and the reserve that keeps the
driver off the scheduler thread.

A ``PageAllocator`` owns the page states of one engine's virtual KV tensors and decides
every page transition; a ``kvcore.memory.mapper.PageMapper`` carries them
out (locally, or on every TP x PP worker). The block ledger (``kvcore.memory.blocks``) is its
caller: it ``acquire``\\ s pages when it has no free block left on a mapped page and
``release``\\ s a page once every block on it is free.

Page states (``PageState``)::

    FREE (unbacked) --map--> IN_USE --release--> RESERVED (mapped, idle) --acquire--> IN_USE
      ^                        |  \\--release(fence)--> FENCED --retire--> RESERVED / UNMAP_QUEUED
      |                        \\--release, reserve full--> UNMAP_QUEUED --unmap--> UNMAPPING
      \\------------------------------------------ commit ------------------------------/
    any failed rollback --> QUARANTINED (never handed out again)
    an inconsistent state --> the whole allocator fails (every later call raises PoolFailed)

The reserve. Up to ``reserve_max`` released pages stay mapped in the reserve (fewer when the
gate's ``reserve_target`` says so); a background thread keeps at least ``reserve_min`` there
by mapping ahead, more when demand asks for it: with ``reserve_min > 0`` the refill target
is twice the largest ``acquire`` seen within ``demand_window`` seconds (two bursts' worth),
between ``reserve_min`` and the reserve's cap, so a burst is covered without keeping
``reserve_max`` mapped while demand is low (``reserve_min=0`` never maps ahead). An
``acquire`` at least as large as the demand renews its window; without one the demand
halves each window.

Mapping ahead of a growing engine. ``map_ahead`` pages (0: off) let an engine that grows
find its next pages mapped by the background thread, without keeping memory once it stops:
while there is demand the refill target may reach ``map_ahead`` (twice the demand, as
above) and the reserve keeps that many idle pages even beyond ``reserve_max``; once the
demand has decayed to nothing, the pages beyond ``reserve_max`` are unmapped. With
``reserve_min=0`` nothing is mapped ahead before the first ``acquire``, which maps on the
calling thread. A
background round refills before it unmaps: an unmap first waits for the device to finish
its queued work, which would hold the refill back by up to a step. While the reserve covers
demand, ``acquire`` and ``release`` make no mapper (hence no driver) call on the calling
thread: they move page ids between lists under one lock. Surplus pages are unmapped by the
background thread too, so an unmap's wait for the device never lands on the scheduler
thread. Only when the reserve and the pages waiting to be unmapped cannot cover a request
does ``acquire`` map on the calling thread.

Giving memory back progressively. The driver's cost of an unmap is per mapping, whatever
its size (tens of microseconds for each handle's unmap, zero-page grant and release), so a
round that unmaps gigabytes of small handles takes hundreds of milliseconds. A round
therefore unmaps its pages in chunks that double from one page id, waiting for the device
once (in the first chunk's ``prepare_unmap``: every page of the round left use before it)
and settling the gate after each chunk: another instance sharing the budget can map the
first bytes after one page's driver calls, and this instance's own ``acquire`` waiting for
pages in flight retries after each chunk.

Background rounds. The background thread's work comes in *rounds*: read the gate's
``reserve_target`` (and ``overage``, where it has one), map a refill batch for the reserve,
unmap the queued surplus, release pooled handles when asked to (and all of them while over
the limit), report the idle memory to the gate. The thread runs each round with the
interpreter's switch interval shortened (``switch_interval``,
``kvcore.memory.switch_interval``): every driver call gives up the GIL, and beside an
engine thread running Python, taking it back would otherwise wait up to 5 ms per call. A
map on the caller's thread runs shortened too: the engine's other threads (vLLM's output
thread, this allocator's own) would hold up the caller's calls the same way.
With ``background=False`` no thread is started and ``run_round()`` runs one round on the
calling thread (``flush()`` runs them until nothing is left to do); everything else
behaves the same. Every
time-based decision (retry back-off, unmap back-off, the demand window) reads ``clock``
(default ``time.monotonic``), so a caller (a test) that passes its own clock decides when
a back-off has passed. The waits on other threads (the thread's idle sleep of at most
``poll_interval``, an ``acquire`` waiting for a mapper call in flight, ``flush(timeout)``)
are real waits on conditions.

Pages in flight. A page the background thread is mapping for the reserve or unmapping is
still capacity: ``available()`` counts it, and an ``acquire`` that would otherwise miss
waits for that mapper call to finish and tries again, so a free followed at once by an
allocation of the same room succeeds exactly as it would on a static pool, and a refill an
acquire woke never takes the page that acquire then needs.

Shedding. A limit lowered below what is in use (``kvctl limit``) stops growth at once (the
gate refuses new pages) and cuts the reserve first; what is still in use beyond it can only
come back from the engine, which holds cached blocks there. Each round turns the gate's
``overage()`` into ``shed_wanted()`` pages; an engine reads it every step and frees cached
blocks that empty that many pages, and ``set_shed_listener`` wakes an engine that is idle.
A raised or removed limit admits new pages at the next ``acquire`` or refill.

Fences. ``release(ids, fence=step)`` keeps the pages mapped until ``retire(upto)`` with
``upto >= step``: engines pass monotonically increasing step numbers, and one ``retire`` of
the last finished step frees everything released behind it or any earlier step.

Accounting. The gate is charged for exactly the device memory the mapper holds
(``PageMapper.held_bytes``: mapped pages, handles the mapper pools for reuse, handles whose
release failed, quarantined pages), never for a byte twice. By default
(``charge_fixed_bytes=True``) it is also charged the mapper's ``fixed_bytes``
(``LocalPageMapper``: the cache's zero page, up to 128 MiB; see ``kvcore.memory.virtual_cache
.default_zero_page_bytes``), from construction to ``close``, so a per-GPU
ledger shows what an instance really holds; a gate that refuses them at construction
raises ``PoolFailed``. A budget for ``n`` pages is therefore ``n * page_bytes +
fixed_bytes``. ``charge_fixed_bytes=False`` leaves the zero page out (whole-page
arithmetic in tests; a caller that charges it elsewhere). Before a map the allocator
charges the most the map can add (``pages - mapper.pooled_pages`` pages: a map served from
the pool charges nothing); after every mapper call it settles the charge to ``held_bytes``,
giving back only real shrinkage. Charges and mapper calls happen under one lock, so the
figures cannot move in between. Pooled handles count as idle memory, like the reserve:
``report_reserve`` includes them, and when the gate's ``reserve_target`` cuts the idle
memory, or on ``trim()``, the pool is released first.

Failure handling (invariants 2 and 3 of ``docs/architecture.md``):

* a physical shortage (the gate refuses, the mapper raises ``OutOfDeviceMemory``) or a map
  the mapper rolled back cleanly (any other ``VmmError``) is a *miss*: ``acquire`` returns
  ``None`` and every page it touched is back where it was;
* ``PageQuarantined`` from the mapper quarantines the pages it names (every page of the call
  when it names none): capacity shrinks, the caller sees a miss. The gate stays charged for
  whatever memory the mapper still holds for them;
* ``PoolFailed`` from the mapper, any other exception from the mapper or the gate, or a
  state the allocator cannot explain fails the allocator: that call and every later one
  raise ``PoolFailed``.

The mapper and the gate's ``try_acquire`` / ``release`` are called with one lock held
(``PageMapper`` implementations need not be thread-safe); the allocator's own state is
guarded by another, never held across a mapper or gate call.
"""

from __future__ import annotations

import enum
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kvcore.budget.gate import MemoryGate, UnlimitedGate
from kvcore.errors import (
    InvalidTransition,
    PageQuarantined,
    PoolFailed,
    VmmError,
)
from kvcore.memory.mapper import PageMapper
from kvcore.memory.switch_interval import DEFAULT_BACKGROUND_SWITCH_S, shortened

__all__ = [
    "BACKGROUND_THREAD_NAME",
    "TRANSITIONS",
    "WAIT_LOG_TEXT",
    "PageAllocator",
    "PageState",
    "PageStats",
]

log = logging.getLogger(__name__)

BACKGROUND_THREAD_NAME = "kvcore-page-refill"
"""The name of every allocator's background thread (``background=True``)."""

WAIT_LOG_TEXT = "waits for the mapper call in flight on pages"
"""Part of the ``DEBUG`` record this module's logger emits each time a caller waits for
pages another thread has in a mapper call instead of missing; logged with the allocator's
lock held, so the awaited call cannot finish before the caller is waiting (tests listen for
it to know the caller is blocked)."""


class PageState(enum.IntEnum):
    """The state of one page id (the diagram in the module docstring)."""

    FREE = 0
    """Unbacked: never mapped, or unmapped and its handle committed. Reads hit the zero page."""
    MAPPING = 1
    """A map of this page is in flight."""
    IN_USE = 2
    """Mapped and handed out by ``acquire``: blocks on it may be live."""
    RESERVED = 3
    """Mapped and idle in the reserve; ``acquire`` hands it out without a driver call."""
    FENCED = 4
    """Released behind a fence: still mapped (an in-flight batch may read it) until
    ``retire(upto)`` with ``upto >= fence``."""
    UNMAP_QUEUED = 5
    """Released surplus, still mapped, waiting for the background unmap; ``acquire`` may
    take it back without a driver call."""
    UNMAPPING = 6
    """``prepare_unmap`` / ``commit_unmap`` in flight."""
    QUARANTINED = 7
    """A rollback failed: the page is never handed out again."""


_S = PageState
TRANSITIONS: frozenset[tuple[PageState, PageState]] = frozenset(
    {
        (_S.FREE, _S.MAPPING),
        (_S.MAPPING, _S.IN_USE),
        (_S.MAPPING, _S.RESERVED),
        (_S.MAPPING, _S.FREE),
        (_S.MAPPING, _S.QUARANTINED),
        (_S.RESERVED, _S.IN_USE),
        (_S.RESERVED, _S.UNMAP_QUEUED),
        (_S.IN_USE, _S.RESERVED),
        (_S.IN_USE, _S.FENCED),
        (_S.IN_USE, _S.UNMAP_QUEUED),
        (_S.IN_USE, _S.UNMAPPING),
        (_S.FENCED, _S.RESERVED),
        (_S.FENCED, _S.UNMAP_QUEUED),
        (_S.FENCED, _S.UNMAPPING),
        (_S.UNMAP_QUEUED, _S.IN_USE),
        (_S.UNMAP_QUEUED, _S.RESERVED),
        (_S.UNMAP_QUEUED, _S.UNMAPPING),
        (_S.RESERVED, _S.UNMAPPING),
        (_S.UNMAPPING, _S.FREE),
        (_S.UNMAPPING, _S.RESERVED),
        (_S.UNMAPPING, _S.QUARANTINED),
    }
)
"""Every legal ``(from, to)`` page transition. The allocator fails (``PoolFailed``) rather
than make any other."""

# plain ints on the hot path (an IntEnum hashes and compares in Python code)
_FREE, _MAPPING, _IN_USE, _RESERVED = 0, 1, 2, 3
_FENCED, _QUEUED, _UNMAPPING, _QUARANTINED = 4, 5, 6, 7
_RELEASING = 255  # transient marker while ``release`` / ``retire`` move their ids
_LEGAL = frozenset({(int(a), int(b)) for a, b in TRANSITIONS} | {(_FENCED, _RELEASING)})
_BACKED = frozenset({_IN_USE, _RESERVED, _FENCED, _QUEUED, _UNMAPPING})


@dataclass(frozen=True)
class PageStats:
    """A snapshot of the allocator (``PageAllocator.stats()``); counts are page ids unless
    named otherwise."""

    num_pages: int
    page_bytes: int
    mapped: int
    """Pages holding physical memory (in use, reserved, fenced, waiting for or in unmap)."""
    in_use: int
    reserved: int
    fenced: int
    """Released pages waiting for their fence to retire."""
    pending_fences: int
    """Fences with at least one page behind them."""
    pooled: int
    """Pages' worth of unmapped handles the mapper keeps for reuse (``mapper.pooled_pages``)."""
    charged_bytes: int
    """Bytes charged to the gate: what the mapper held after its last call
    (``mapper.held_bytes``), mapped, pooled, quarantined and unreleased memory alike, plus
    its ``fixed_bytes`` (the zero page) with ``charge_fixed_bytes``."""
    unmap_pending: int
    """Pages queued for, or in, the background unmap."""
    quarantined: int
    free: int
    """Unbacked pages that can still be mapped."""
    misses: int
    """``acquire`` calls that returned ``None``."""
    caller_mapper_calls: int
    """Mapper calls made outside background rounds: ``acquire`` / ``acquire_ids`` mapping
    on the calling thread (the scheduler's), and ``close``."""
    refill_mapper_calls: int
    """Mapper calls made by background rounds (the refill/unmap thread, or ``run_round``
    with ``background=False``)."""
    failed: bool


class PageAllocator:
    """Page states, the pre-mapped reserve and its background rounds for one ``PageMapper``.

    ``gate`` admits every byte mapped (default: an ``UnlimitedGate``). ``reserve_min`` /
    ``reserve_max`` bound the reserve in pages (``0 <= reserve_min <= reserve_max``);
    ``map_ahead`` how many pages a growing engine may find mapped ahead (module docstring;
    ``0 <= map_ahead <= num_pages``);
    ``retry_interval`` is how long (seconds of ``clock``) background rounds wait before
    mapping again after a miss (doubling per further miss, up to 20x, while the batch
    halves) and before unmapping again after a failed unmap (likewise doubling);
    ``refill_batch`` the most pages a round maps in one mapper call (each batch joins the
    reserve as soon as it is mapped, and the mapper is free in between for a caller that
    must map on its own thread), ``charge_fixed_bytes`` whether the gate is also charged the
    mapper's ``fixed_bytes`` (module docstring),
    ``poll_interval`` how often the idle background thread re-reads the gate's
    ``reserve_target`` and reports the reserve, ``demand_window`` how long (seconds of
    ``clock``) the largest recent ``acquire`` raises the refill target (module docstring).
    ``switch_interval`` is the interpreter's switch interval (seconds) while a background
    round runs and while a map runs on a caller's thread (``kvcore.memory.switch_interval``:
    each driver call otherwise waits up to 5 ms to take the GIL back from whichever other
    thread runs Python meanwhile; ``None`` leaves it alone).
    ``clock`` returns the time in seconds for every one of those decisions (default
    ``time.monotonic``; it must never go back). ``background=False`` starts no thread: the
    owner runs the rounds with ``run_round()`` (or ``flush()``). Every method is
    thread-safe. Raises ``ValueError`` for bounds that do not fit the mapper's page count.
    """

    def __init__(
        self,
        mapper: PageMapper,
        gate: MemoryGate | None = None,
        *,
        reserve_min: int = 0,
        reserve_max: int = 0,
        map_ahead: int = 0,
        retry_interval: float = 0.05,
        poll_interval: float = 0.25,
        refill_batch: int = 8,
        charge_fixed_bytes: bool = True,
        demand_window: float = 2.0,
        switch_interval: float | None = DEFAULT_BACKGROUND_SWITCH_S,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        num_pages = mapper.num_pages
        if refill_batch < 1:
            raise ValueError(f"page allocator: refill_batch must be >= 1, got {refill_batch}")
        if not 0 <= reserve_min <= reserve_max <= num_pages:
            raise ValueError(
                f"page allocator: need 0 <= reserve_min ({reserve_min}) <= reserve_max "
                f"({reserve_max}) <= num_pages ({num_pages})"
            )
        if not 0 <= map_ahead <= num_pages:
            raise ValueError(
                f"page allocator: need 0 <= map_ahead ({map_ahead}) <= num_pages ({num_pages})"
            )
        self._mapper = mapper
        self._gate: MemoryGate = gate if gate is not None else UnlimitedGate()
        headroom = getattr(self._gate, "headroom", None)  # optional beyond MemoryGate
        self._headroom: Callable[[], int | None] | None = headroom if callable(headroom) else None
        overage = getattr(self._gate, "overage", None)  # optional beyond MemoryGate
        self._overage: Callable[[], int] | None = overage if callable(overage) else None
        wants = getattr(self._gate, "note_wanted", None)  # optional beyond MemoryGate
        held_back = getattr(self._gate, "held_back", None)  # optional beyond MemoryGate
        self._held_back_fn: Callable[[], bool] | None = held_back if callable(held_back) else None
        both = getattr(self._gate, "headroom_held_back", None)  # the two in one read
        self._room: Callable[[], tuple[int | None, bool]] = (
            both if callable(both) else self._room_in_two_reads
        )
        # the gate's held_back() as last read (available(), each round): while set, acquire
        # puts no reserved or unmap-queued page back in use
        self._held_back = False
        self._reported_idle = 0  # idle bytes (reserve, pooled handles) last reported to the gate
        self._note_wanted: Callable[[int], None] | None = wants if callable(wants) else None
        self._shed = 0  # in-use pages the gate wants back; refreshed by every round
        self._shed_listener: Callable[[], None] | None = None
        self._num_pages = num_pages
        self._page_bytes = mapper.page_bytes
        self._reserve_min = reserve_min
        self._clock = clock
        self._demand_window = demand_window
        self._demand = 0  # the largest acquire since _demand_since (pages)
        self._demand_since = clock()
        self._refill_goal = reserve_min  # _refill_target_locked() before the gate's cap
        self._reserve_max = reserve_max
        self._map_ahead = map_ahead
        self._tracks_demand = bool(reserve_min or map_ahead)
        self._retry_interval = retry_interval
        self._poll_interval = poll_interval
        if switch_interval is not None and switch_interval <= 0:
            raise ValueError(
                f"page allocator: switch_interval must be positive or None, got {switch_interval}"
            )
        self._switch_interval = switch_interval

        self._state = bytearray(num_pages)  # PageState per page id
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # lowest id on top
        self._reserve: list[int] = []
        self._unmap_queue: list[int] = []
        self._fenced: dict[int, list[int]] = {}  # fence -> pages released behind it
        self._fence_heap: list[int] = []  # the keys of _fenced, smallest first
        self._retired_upto: int | None = None  # the largest ``retire(upto)`` so far
        self._charged = 0  # bytes charged to the gate; written under _mapper_lock
        # device memory the mapper holds whatever the page states (a cache's zero page)
        self._fixed_bytes = int(getattr(mapper, "fixed_bytes", 0)) if charge_fixed_bytes else 0
        self._pooled = 0  # mapper.pooled_pages after its last call; written under _mapper_lock
        self._trim_pool = False  # trim() asked the background thread to drop the pool
        self._reserve_cap = reserve_max  # gate-approved reserve size, refreshed off-thread
        self._ahead_cap = map_ahead  # gate-approved map_ahead, refreshed with _reserve_cap
        self._refill_paused = False  # set by trim() until the next acquire
        self._retry_at = 0.0  # no background map before this time (of _clock)
        self._backoff = retry_interval  # doubles on each background miss, up to 20x
        self._unmap_retry_at = 0.0  # no background unmap before this (after a failed one)
        self._unmap_backoff = retry_interval
        self._refill_batch = refill_batch
        self._batch_limit = refill_batch  # pages per background map; halves on each miss
        self._reserve_dirty = True
        self._busy = False  # a background round is running
        self._kick = False  # flush() asked for a round
        self._rounds = 0
        self._misses = 0
        self._calls_caller = 0
        self._calls_refill = 0  # written only by the one background round running
        # pages a background round has in a mapper call now (MAPPING for the reserve,
        # UNMAPPING): capacity an acquire waits for rather than misses (invariant 2)
        self._bg_maps: list[int] = []
        self._bg_unmaps: list[int] = []
        self._bg_progress = 0  # background mapper calls (or unmap chunks) finished so far
        self._failure: str | None = None
        self._failure_cause: BaseException | None = None
        self._closed = False
        self._stop = False

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the background thread waits here
        self._settled = threading.Condition(self._lock)  # flush() waits here
        self._mapper_lock = threading.Lock()
        self._round_lock = threading.Lock()  # one run_round() at a time (background=False)
        with self._mapper_lock:  # a mapper reused from an earlier allocator may hold memory
            if not self._settle_charge_locked():
                raise PoolFailed(
                    f"page allocator: the gate refuses the "
                    f"{mapper.held_bytes + self._fixed_bytes} bytes the mapper already holds "
                    f"({self._fixed_bytes} of them its zero page)",
                    hint="trim or close the mapper's earlier user first, or raise the limit",
                )
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name=BACKGROUND_THREAD_NAME, daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------------ public seam

    @property
    def num_pages(self) -> int:
        """Page ids managed (``mapper.num_pages``)."""
        return self._num_pages

    @property
    def switch_interval(self) -> float | None:
        """The interpreter's switch interval while a background round runs (seconds;
        ``None``: left alone)."""
        return self._switch_interval

    @property
    def page_bytes(self) -> int:
        """Device bytes one mapped page id costs (``mapper.page_bytes``)."""
        return self._page_bytes

    @property
    def gate(self) -> MemoryGate:
        """The memory gate every mapped byte is charged to (an ``UnlimitedGate`` when none
        was given)."""
        return self._gate

    def acquire(self, n: int) -> list[int] | None:
        """Hand out ``n`` mapped page ids, now ``IN_USE``.

        Taken from the reserve first, then from pages waiting to be unmapped, then mapped
        on this thread (after ``gate.try_acquire``). While the gate holds the instance back
        (``held_back()``, as ``available()`` or the last background round read it: over
        its limit, or over its share while another instance waits), idle pages are not put
        back in use: they go back to the driver, and only the gate can admit new ones.
        When that falls short while a background round is mapping pages for the reserve or
        unmapping pages (whose bytes then return to the gate), ``acquire`` waits for that
        mapper call and tries again, so pages in flight never turn into a miss: without a
        budget it succeeds whenever ``n`` unquarantined pages exist. Returns ``None`` on a
        physical miss (gate refused, out of device memory, a rolled-back or quarantining
        map, too few unquarantined pages) with every page it touched back where it was.
        Raises ``PoolFailed`` once the allocator has failed.
        """
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"page allocator: cannot acquire {n} pages")
        while True:
            ids = self._acquire_once(n)
            if ids is not None:
                return ids
            with self._lock:  # a miss: pages a background round holds may still serve it
                if not self._wait_for_background_locked(n):
                    self._misses += 1
                    return None

    def _acquire_once(self, n: int) -> list[int] | None:
        """One ``acquire`` attempt; ``None`` on a miss with everything put back."""
        with self._lock:
            if self._failure is not None or self._closed:
                self._check_usable()
            self._refill_paused = False
            reserve = self._reserve
            if n >= self._demand and self._tracks_demand:  # renewed, or a larger burst
                self._note_demand_locked(n)
            if self._held_back:  # over what the gate allows: idle pages go back, not in use
                reserve = []
            if len(reserve) >= n:  # the hot path: no mapper or gate call
                ids = reserve[-n:]
                del reserve[-n:]
                state = self._state
                for p in ids:
                    if state[p] != _RESERVED:
                        self._fail_locked(f"reserve page {p} is {_name(state[p])}, not RESERVED")
                    state[p] = _IN_USE
                self._reserve_dirty = True
                if len(reserve) < self._refill_goal:
                    self._wake.notify()
                return ids
            from_reserve = reserve[:]
            reserve.clear()
            self._move(from_reserve, _RESERVED, _IN_USE)
            queue = self._unmap_queue if not self._held_back else []
            k = min(len(queue), n - len(from_reserve))
            reclaimed = queue[len(queue) - k :]
            del queue[len(queue) - k :]
            self._move(reclaimed, _QUEUED, _IN_USE)
            ids = from_reserve + reclaimed
            need = n - len(ids)
            self._reserve_dirty = True
            self._wake.notify()
            if need == 0:
                return ids
            if need > len(self._free):
                self._undo_acquire(ids)
                return None
            fresh = self._free[len(self._free) - need :]
            del self._free[len(self._free) - need :]
            self._move(fresh, _FREE, _MAPPING)
        mapped = self._map(fresh, refill=False)
        with self._lock:
            if mapped:
                self._move(fresh, _MAPPING, _IN_USE)
                return ids + fresh
            self._undo_acquire(ids)
            self._check_usable()
            return None

    def acquire_ids(self, page_ids: Sequence[int]) -> bool:
        """Make these specific page ids ``IN_USE`` (e.g. the page of a block the ledger pins
        for good). Pages in the reserve or queued for unmap are taken without a driver call;
        free ones are mapped on this thread; a page another thread is mapping or unmapping
        is waited for. Returns ``False`` on a physical miss (nothing changed). Raises
        ``InvalidTransition`` for a page already in use, fenced or quarantined,
        ``PoolFailed`` once the allocator has failed."""
        ids = list(dict.fromkeys(page_ids))
        with self._lock:
            self._check_usable()
            state = self._state
            bad = [p for p in ids if not 0 <= p < self._num_pages]
            if bad:
                raise InvalidTransition(
                    f"page allocator: page ids {bad} are outside 0..{self._num_pages - 1}",
                    ids=bad,
                )
            # a page another thread is mapping or unmapping settles within that call; a map
            # on a caller's thread signals nothing, hence the bounded waits
            while any(state[p] in (_MAPPING, _UNMAPPING) for p in ids):
                log.debug("kvcore: acquire_ids %s %s", WAIT_LOG_TEXT, ids)
                self._wake.notify()
                self._settled.wait(self._poll_interval)
                self._check_usable()
            bad = [p for p in ids if state[p] not in (_FREE, _RESERVED, _QUEUED)]
            if bad:
                raise InvalidTransition(
                    f"page allocator: cannot acquire pages {bad} in state "
                    f"{[PageState(state[p]).name for p in bad]}",
                    ids=bad,
                    hint="only free, reserved or unmap-queued pages can be acquired",
                )
            fresh = [p for p in ids if state[p] == _FREE]
            for p in ids:
                if state[p] == _RESERVED:
                    self._reserve.remove(p)
                    self._move((p,), _RESERVED, _IN_USE)
                elif state[p] == _QUEUED:
                    self._unmap_queue.remove(p)
                    self._move((p,), _QUEUED, _IN_USE)
            for p in fresh:
                self._free.remove(p)
            self._move(fresh, _FREE, _MAPPING)
            self._reserve_dirty = True
            self._wake.notify()
        if not fresh:
            return True
        mapped = self._map(fresh, refill=False)
        with self._lock:
            if mapped:
                self._move(fresh, _MAPPING, _IN_USE)
                return True
            self._undo_acquire([p for p in ids if p not in fresh])
            self._misses += 1
            self._check_usable()
            return False

    def release(self, page_ids: Sequence[int], fence: int | None = None) -> None:
        """Give back ``IN_USE`` pages whose blocks are all free.

        Without a ``fence`` each page goes to the reserve while it is below the gate's
        reserve target, else it is queued for a background round to unmap
        (``prepare_unmap`` + ``commit_unmap``, then the gate's charge settled). With a
        ``fence`` (an engine step number) the pages stay mapped until ``retire(upto)`` with
        ``upto >= fence``: the barrier that proves no in-flight batch still reads them; a
        fence at or below a ``retire`` already made has passed, and the pages are released
        at once. Makes no mapper call. Raises ``InvalidTransition`` (nothing changed) for a
        page not in use or named twice, ``PoolFailed`` once failed.
        """
        with self._lock:
            if self._failure is not None or self._closed:
                self._check_usable()
            state = self._state
            num_pages = self._num_pages
            for i, p in enumerate(page_ids):
                if not 0 <= p < num_pages or state[p] != _IN_USE:
                    if not 0 <= p < self._num_pages:
                        shown = "out of range"
                    elif state[p] == _RELEASING:
                        shown = "named twice"
                    else:
                        shown = f"in state {PageState(state[p]).name}"
                    for q in page_ids[:i]:
                        state[q] = _IN_USE
                    raise InvalidTransition(
                        f"page allocator: cannot release page {p}: {shown}",
                        ids=(p,),
                        hint="release only pages acquire() handed out, once each",
                    )
                state[p] = _RELEASING
            if self._shed:  # every page leaving use counts until the next round recounts
                self._shed = max(0, self._shed - len(page_ids))
            if fence is not None and (self._retired_upto is None or fence > self._retired_upto):
                for p in page_ids:
                    state[p] = _FENCED
                behind = self._fenced.get(fence)
                if behind is None:
                    self._fenced[fence] = behind = []
                    heapq.heappush(self._fence_heap, fence)
                behind.extend(page_ids)
                return
            self._park(page_ids)

    def retire(self, upto: int) -> int:
        """Every barrier up to ``upto`` has passed (engines: the last step whose batch
        finished): pages released behind any fence ``<= upto`` go to the reserve or the
        unmap queue like an unfenced ``release``, and a later ``release`` behind such a fence
        is released at once. Returns how many pages it freed (0 when nothing was behind
        those fences). O(pages freed + log(fences) per fence retired); makes no mapper
        call."""
        with self._lock:
            self._check_usable()
            if self._retired_upto is None or upto > self._retired_upto:
                self._retired_upto = upto
            heap = self._fence_heap
            pages: list[int] = []
            while heap and heap[0] <= upto:
                pages += self._fenced.pop(heapq.heappop(heap))
            if not pages:
                return 0
            self._move(pages, _FENCED, _RELEASING)
            self._park(pages)
            return len(pages)

    def trim(self) -> int:
        """Give idle memory back to the driver: the whole reserve is unmapped by the next
        background round, then the mapper's pooled handles are released, and the refill
        stays paused until the next ``acquire``. Returns the reserve pages dropped. Makes
        no mapper call (``flush()`` waits for, or with ``background=False`` runs, the
        rounds that do it)."""
        with self._lock:
            self._check_usable()
            dropped = self._reserve[:]
            self._reserve.clear()
            self._move(dropped, _RESERVED, _QUEUED)
            self._unmap_queue.extend(dropped)
            self._refill_paused = True
            self._trim_pool = True
            self._reserve_dirty = True
            self._wake.notify()
            return len(dropped)

    def note_wanted(self, pages: int) -> None:
        """The engine is ``pages`` pages short of what it asked for (its free figure,
        ``available()``, did not cover a request): tell the gate, where it listens
        (``note_wanted``, optional beyond ``MemoryGate``: the per-GPU ledger's gate marks
        the instance waiting when the shared budget is what it lacks, so instances over
        their share give way, ``kvcore.budget.shares``). Any thread; makes no mapper call.
        Raises what the gate raises (``LedgerError`` when its record was removed)."""
        if pages <= 0:
            return
        note = self._note_wanted
        if note is not None:
            note(pages * self._page_bytes)

    def shed_wanted(self) -> int:
        """Pages in use that the gate wants back now: its ``overage()`` (a limit lowered
        below use, ``kvctl limit``) in pages, less the pages already on their way out
        (released behind a fence, queued for unmap, unmapping). The engine answers by
        freeing cached blocks that empty that many pages (vLLM's pool: ``shed``); the
        allocator itself never takes a page in use. Recounted by every background round
        (every ``poll_interval`` at least) and lowered by every ``release`` in between, so
        an engine that asks every step never sheds the same overage twice. A plain read
        (no lock, no gate call): cheap enough for every engine step. 0 with a gate that
        has no ``overage``, and once closed."""
        return 0 if self._closed else self._shed

    def take_shed(self) -> int:
        """``shed_wanted()``, and no further ask until the next background round recounts:
        for an engine that cannot choose which pages its eviction empties (SGLang's radix
        tree evicts tokens), so that it answers one ask once instead of evicting again at
        every iteration until a round sees what came back."""
        with self._lock:
            wanted, self._shed = self._shed, 0
        return 0 if self._closed else wanted

    def set_shed_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener()`` (no argument, no lock held, on the background thread or
        ``run_round``'s caller) after every round that leaves ``shed_wanted() > 0``: how an
        engine that is idle, and so never steps, learns that it should shed (vLLM: wake its
        engine core). It must be quick and must not call back into this allocator on the
        calling thread; what it raises is logged and ignored. ``None`` removes it."""
        self._shed_listener = listener

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until a full background round has run after this call and nothing is left
        to do: no unmap pending, the reserve within its bounds (or the refill blocked by a
        miss, a pause or no free pages). Returns ``False`` on timeout (``timeout`` seconds
        of real time; ``None``: no limit). For tests, benchmarks and the control plane;
        never needed on the hot path.

        With ``background=False`` it runs the rounds itself, on this thread: ``run_round()``
        until it reports nothing more to do now (at most ``num_pages + 3`` rounds), then
        returns whether everything is settled; ``False`` when work remains that waits for
        ``clock`` to pass a back-off (a failed unmap). ``timeout`` is not used then.
        Raises ``PoolFailed`` once the allocator has failed or is closed."""
        if self._thread is None:
            more = self.run_round()
            for _ in range(self._num_pages + 2):
                if not more:
                    break
                more = self.run_round()
            with self._lock:
                self._check_usable()
                return self._idle_locked()
        with self._lock:
            self._check_usable()
            # a round that *starts* after this call sees everything done before it
            need = self._rounds + (2 if self._busy else 1)
            self._kick = True
            self._wake.notify()
            done = self._settled.wait_for(
                lambda: (
                    self._failure is not None
                    or (self._rounds >= need and not self._busy and self._idle_locked())
                ),
                timeout,
            )
            self._check_usable()
            return done

    def run_round(self) -> bool:
        """Run one background round on this thread (``background=False`` only): read the
        gate's ``reserve_target``, map one refill batch for the reserve (unless a miss's
        back-off has not passed on ``clock``), unmap the queued surplus (likewise after a
        failed unmap), release the mapper's pooled handles after ``trim()`` or when the
        gate cuts the idle memory, and report the idle memory (``gate.report_reserve``).
        Its mapper calls count as ``refill_mapper_calls``.

        Call it where the background thread would run: after ``release``, ``retire`` or
        ``trim`` (surplus pages stay mapped, and count as ``available()``, until a round
        unmaps them), after an ``acquire`` that drew the reserve below its refill target,
        and now and then (an engine step) for the gate's ``reserve_target`` and the demand
        window. Rounds run one at a time: a second thread's call waits for the first.

        Returns ``True`` when more work is ready now (another call would do it: a further
        refill batch, say), ``False`` when nothing is left until a caller acts or ``clock``
        passes a back-off. Raises ``RuntimeError`` when the allocator runs its own thread
        (``background=True``), ``PoolFailed`` once the allocator has failed or is closed,
        or when this round fails it (a mapper or gate error it cannot explain)."""
        if self._thread is not None:
            raise RuntimeError(
                "page allocator: run_round() is for background=False; the background thread "
                "runs the rounds here"
            )
        with self._round_lock:
            with self._lock:
                self._check_usable()
                self._busy = True
                self._kick = False
            try:
                self._work()
            except PoolFailed:
                raise
            except Exception as exc:
                self._fail(f"a background round failed: {exc!r}", exc)
            except BaseException as exc:  # interrupted mid-round: the pages' state is unknown
                with self._lock:
                    self._record_failure_locked(f"a background round was interrupted: {exc!r}", exc)
                raise
            finally:
                with self._lock:
                    self._busy = False
                    self._settled.notify_all()
            with self._lock:
                return self._has_work_locked()

    def state(self, page_id: int) -> PageState:
        """The current state of one page id."""
        with self._lock:
            return PageState(self._state[page_id])

    def available(self) -> int:
        """Pages ``acquire`` could hand out now: in the reserve, queued for unmap, in a
        background mapper call (``acquire`` waits for those), and free pages the mapper's
        pool or the gate would still admit (``gate.headroom()`` where the gate has one);
        0 while the gate holds the instance back (``held_back()``, read here when the gate
        has no room to give: a gate with room holds nobody back; both in one read where the
        gate has ``headroom_held_back()``). An
        upper bound: the device itself may still run out. A snapshot read without the lock
        (engines ask before every allocation): a page a background round moves meanwhile
        may be missed or, once, counted twice. Raises ``PoolFailed`` once failed."""
        if self._failure is not None or self._closed:
            self._check_usable()
        room, self._held_back = self._room()
        if self._held_back:  # idle pages are on their way back; the gate admits none
            return 0
        free = len(self._free)
        if isinstance(room, int):
            free = min(free, self._pooled + max(room, 0) // self._page_bytes)
        inflight = len(self._bg_maps) + len(self._bg_unmaps)  # ``acquire`` waits for them
        return len(self._reserve) + len(self._unmap_queue) + free + inflight

    def _room_in_two_reads(self) -> tuple[int | None, bool]:
        """``(gate.headroom(), gate.held_back())`` for a gate without
        ``headroom_held_back``: ``None`` room where it has no ``headroom``; ``held_back()``
        read only when there is no room to give (a gate with room holds nobody back)."""
        room = self._headroom() if self._headroom is not None else None
        if isinstance(room, int) and room > 0:
            return room, False
        return room, self._held_back_fn() if self._held_back_fn is not None else False

    def stats(self) -> PageStats:
        """A consistent snapshot of page counts and mapper-call counters."""
        with self._lock:
            counts = [0] * len(PageState)
            for s in self._state:
                counts[s if s != _RELEASING else _IN_USE] += 1
            return PageStats(
                num_pages=self._num_pages,
                page_bytes=self._page_bytes,
                mapped=sum(counts[s] for s in _BACKED),
                in_use=counts[_IN_USE],
                reserved=counts[_RESERVED],
                fenced=counts[_FENCED],
                pending_fences=len(self._fenced),
                pooled=self._pooled,
                charged_bytes=self._charged,
                unmap_pending=counts[_QUEUED] + counts[_UNMAPPING],
                quarantined=counts[_QUARANTINED],
                free=counts[_FREE],
                misses=self._misses,
                caller_mapper_calls=self._calls_caller,
                refill_mapper_calls=self._calls_refill,
                failed=self._failure is not None,
            )

    def close(self) -> None:
        """Stop the background thread (if any; with ``background=False``, wait for a
        ``run_round`` in progress), unmap every mapped page (in use ones included: the
        engine is going away), release the mapper's pooled handles and settle the gate's
        charge to what the mapper still holds: nothing, unless pages are quarantined or a
        release failed (the mapper's own ``close``, which the owner calls next, releases
        those; closing the gate drops their charge). The charge for the mapper's
        ``fixed_bytes`` ends here too (the owner closes the cache next). Idempotent.
        Raises ``PoolFailed`` if the final unmap of a healthy allocator failed; after a
        fail-stop it only tries."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            self._wake.notify_all()
            self._settled.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._round_lock:  # a run_round() on another thread finishes its round first
            pass
        with self._lock:
            backed = [p for p in range(self._num_pages) if self._state[p] in _BACKED]
            for p in backed:
                self._state[p] = _UNMAPPING
            self._reserve.clear()
            self._unmap_queue.clear()
            self._fenced.clear()
            self._fence_heap.clear()
        error: BaseException | None = None
        with self._mapper_lock:
            try:
                if backed:
                    self._calls_caller += 2
                    self._mapper.prepare_unmap(backed)
                    self._mapper.commit_unmap(backed)
            except BaseException as exc:  # close is best effort; report at the end
                error = exc
            try:
                self._calls_caller += 1
                self._mapper.trim_pool()
            except BaseException as exc:
                log.warning("kvcore: releasing the mapper's pooled handles at close: %r", exc)
            try:
                self._settle_charge_locked(closing=True)
                self._gate.report_reserve(0)
            except BaseException as exc:
                log.error("kvcore: settling the gate's charge at close failed: %r", exc)
        with self._lock:
            if error is None:
                for p in backed:
                    self._state[p] = _FREE
        if error is not None and self._failure is None:  # a failed allocator already said so
            raise PoolFailed(
                f"page allocator: unmapping {len(backed)} pages at close failed: {error}",
                hint="the mapper's close() releases what is left",
            ) from error

    def __enter__(self) -> PageAllocator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state helpers

    def _move(self, pages: Sequence[int], frm: int, to: int) -> None:
        """Transition ``pages`` from ``frm`` to ``to`` (``PageState`` values); any surprise
        fails the allocator. Caller holds ``_lock``."""
        if (frm, to) not in _LEGAL:
            self._fail_locked(f"illegal page transition {_name(frm)} -> {_name(to)}")
        state = self._state
        for p in pages:
            if state[p] != frm:
                self._fail_locked(
                    f"page {p} is {_name(state[p])}, expected {_name(frm)} (moving to {_name(to)})"
                )
            state[p] = to

    def _park(self, pages: Sequence[int]) -> None:
        """Released pages (marked ``_RELEASING``, checked by the caller) go to the reserve up
        to its cap, the rest to the unmap queue. Caller holds ``_lock``."""
        state = self._state
        room = self._keep_locked() - len(self._reserve)
        if room >= len(pages):
            for p in pages:
                state[p] = _RESERVED
            self._to_reserve(pages)
        else:
            room = max(room, 0)
            keep, drop = pages[:room], pages[room:]
            for p in keep:
                state[p] = _RESERVED
            self._to_reserve(keep)
            for p in drop:
                state[p] = _QUEUED
            self._unmap_queue.extend(drop)
            self._wake.notify()
        self._reserve_dirty = True

    def _to_reserve(self, pages: Sequence[int]) -> None:
        """Add mapped idle pages to the reserve, which stays sorted highest id first:
        ``acquire`` hands out the lowest ids (dense, consecutive pages: one run of block ids)
        and a surplus unmaps the highest. Caller holds ``_lock``."""
        reserve = self._reserve
        reserve.extend(pages)
        reserve.sort(reverse=True)

    def _wait_for_background_locked(self, n: int) -> bool:
        """Wait until the running background round's next mapper call is done (pages it is
        mapping for the reserve, or the next chunk of pages it is unmapping): ``True`` when
        there was one and it finished, so that an ``acquire`` of ``n`` pages that missed
        may try again. Caller holds ``_lock``."""
        if not (self._bg_maps or self._bg_unmaps):
            return False
        log.debug("kvcore: acquire(%d) %s %s", n, WAIT_LOG_TEXT, self._bg_maps + self._bg_unmaps)
        seen = self._bg_progress
        progressed = self._settled.wait_for(
            lambda: self._bg_progress != seen or self._failure is not None, _SETTLE_TIMEOUT
        )
        self._check_usable()
        return progressed

    def _undo_acquire(self, ids: list[int]) -> None:
        """Put pages a failed acquire took back, as reserved (the background thread trims
        any surplus). Caller holds ``_lock``."""
        self._move(ids, _IN_USE, _RESERVED)
        self._to_reserve(ids)
        self._reserve_dirty = True
        self._wake.notify()

    def _idle_locked(self) -> bool:
        if self._unmap_queue or self._trim_pool or len(self._reserve) > self._keep_locked():
            return False
        return self._refill_deficit_locked() == 0 or self._refill_blocked_locked()

    def _note_demand_locked(self, n: int) -> None:
        """Set the demand to ``n`` pages and the refill goal to twice that (within
        ``reserve_min`` .. ``max(reserve_max, map_ahead)``) for ``demand_window`` seconds.
        Caller holds ``_lock``."""
        self._demand = n
        self._demand_since = self._clock()
        self._refill_goal = self._goal_for_locked(n)

    def _goal_for_locked(self, demand: int) -> int:
        ceiling = max(self._reserve_max, self._map_ahead) if demand else self._reserve_max
        return min(max(self._reserve_min, 2 * demand), ceiling)

    def _keep_locked(self) -> int:
        """How many idle pages the reserve may hold now: the gate-approved reserve, and while
        there is demand at least the gate-approved ``map_ahead``. Caller holds ``_lock``."""
        if self._ahead_cap > self._reserve_cap:
            self._decay_demand_locked()
            if self._demand:
                return self._ahead_cap
        return self._reserve_cap

    def _decay_demand_locked(self) -> None:
        if self._demand and self._clock() - self._demand_since > self._demand_window:
            self._demand //= 2  # demand fell: the goal decays, one halving per window
            self._demand_since = self._clock()
            self._refill_goal = self._goal_for_locked(self._demand)

    def _refill_target_locked(self) -> int:
        if self._refill_paused:
            return 0
        self._decay_demand_locked()
        return min(self._refill_goal, self._keep_locked())

    def _refill_deficit_locked(self) -> int:
        return max(self._refill_target_locked() - len(self._reserve), 0)

    def _refill_blocked_locked(self) -> bool:
        return not self._free or self._clock() < self._retry_at

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise PoolFailed(
                f"page allocator failed: {self._failure}",
                hint="fail-stop: restart the engine; the per-GPU ledger reclaims its pages",
            ) from self._failure_cause
        if self._closed:
            raise PoolFailed("page allocator is closed", hint="build a new one")

    def _fail_locked(self, reason: str, cause: BaseException | None = None) -> NoReturn:
        """Fail-stop: record why (the first reason wins), wake everyone, raise
        ``PoolFailed``. Caller holds ``_lock``."""
        self._record_failure_locked(reason, cause)
        self._check_usable()
        raise AssertionError("unreachable")  # pragma: no cover

    def _record_failure_locked(self, reason: str, cause: BaseException | None) -> None:
        """Fail-stop without raising: the first reason wins; everyone waiting wakes up.
        Caller holds ``_lock``."""
        if self._failure is None:
            self._failure = reason
            self._failure_cause = cause
            self._wake.notify_all()
            self._settled.notify_all()

    def _fail(self, reason: str, cause: BaseException | None = None) -> NoReturn:
        with self._lock:
            self._fail_locked(reason, cause)

    # ------------------------------------------------------------------ mapper calls

    def _count_call(self, refill: bool) -> None:
        if refill:
            self._calls_refill += 1
        else:
            self._calls_caller += 1

    def _map(self, pages: list[int], *, refill: bool) -> bool:
        """Map ``MAPPING`` pages. ``True``: mapped, still ``MAPPING`` for the caller to move
        on. ``False``: a miss, the pages are ``FREE`` (or quarantined) again. Raises
        ``PoolFailed`` when the allocator failed.

        The gate is charged first for the most the map can add (pooled handles cost
        nothing more), then settled to what the mapper holds after the call. A map that
        grew the mapper beyond that charge (only if something else drove the mapper) and
        that the gate then refuses is undone: a miss."""
        with self._mapper_lock:
            growth = max(len(pages) - self._mapper.pooled_pages, 0) * self._page_bytes
            try:
                admitted = self._gate_acquire(growth)
            except PoolFailed:  # the gate broke: fail-stop, the pages were never mapped
                self._return_to_free(pages)
                raise
            if not admitted:
                self._return_to_free(pages)
                return False
            self._charged += growth
            quarantined: list[int] | None = None
            try:
                self._count_call(refill)
                with shortened(self._switch_interval):  # on the engine's thread too
                    self._mapper.map(pages)
            except PageQuarantined as exc:
                quarantined = _named_or_all(exc.page_ids, pages)
            except PoolFailed as exc:
                self._fail(f"mapper failed while mapping pages {pages}: {exc}", exc)
            except VmmError:  # out of device memory, or a map the mapper rolled back cleanly
                quarantined = []
            except BaseException as exc:
                self._fail(f"unexpected error while mapping pages {pages}: {exc!r}", exc)
            if self._settle_charge_locked():
                if quarantined is None:
                    return True
            elif quarantined is None:
                log.error(
                    "kvcore: mapping pages %s grew the mapper to %d bytes, beyond what the "
                    "gate admits (was the mapper driven by another caller?); undoing it",
                    pages,
                    self._mapper.held_bytes,
                )
                quarantined = self._undo_map_locked(pages)
            self._to_free(pages, _MAPPING, quarantined=quarantined)
            return False

    def _undo_map_locked(self, pages: list[int]) -> list[int]:
        """Unmap pages this allocator just mapped (the gate refused what they cost); the
        pages that could not be unmapped, to quarantine. Caller holds ``_mapper_lock``."""
        try:
            self._mapper.prepare_unmap(pages)
        except PageQuarantined as exc:
            return _named_or_all(exc.page_ids, pages)
        except VmmError:
            return list(pages)
        except BaseException as exc:
            self._fail(f"undoing the map of pages {pages} failed: {exc!r}", exc)
        try:
            self._mapper.commit_unmap(pages)
        except VmmError:  # unbacked; a handle release waits for a retry (still charged)
            pass
        except BaseException as exc:
            self._fail(f"undoing the map of pages {pages} failed: {exc!r}", exc)
        self._settle_charge_locked()
        return []

    def _return_to_free(self, pages: list[int]) -> None:
        with self._lock:
            self._move(pages, _MAPPING, _FREE)
            self._free.extend(reversed(pages))

    def _unmap(self, pages: list[int], *, synchronize: bool = True) -> bool:
        """Unmap ``UNMAPPING`` pages (background rounds only) and return their bytes.
        ``False`` when the prepare failed and the pages went back to the reserve.
        ``synchronize=False``: the device was waited for after these pages left use (an
        earlier chunk of the same round)."""
        try:
            # not under _mapper_lock: the prepare waits for the device (mapper.py), and an
            # acquire mapping other pages on the engine's thread meanwhile must not wait too
            self._calls_refill += 1  # written by the one round running only
            self._mapper.prepare_unmap(pages, synchronize=synchronize)
        except PageQuarantined as exc:
            bad = _named_or_all(exc.page_ids, pages)
            self._settle_unmap_failure(pages, bad)
            return False
        except PoolFailed as exc:
            self._fail(f"mapper failed while unmapping pages {pages}: {exc}", exc)
        except VmmError:  # the mapper restored the mappings: the pages stay mapped
            self._settle_unmap_failure(pages, [])
            return False
        except BaseException as exc:
            self._fail(f"unexpected error while unmapping pages {pages}: {exc!r}", exc)
        quarantined: list[int] = []
        for attempt in (1, 2):  # commit is idempotent: one retry
            try:
                with self._mapper_lock:
                    self._calls_refill += 1
                    try:
                        self._mapper.commit_unmap(pages)
                    finally:  # what was released (or pooled) settles either way
                        self._settle_charge_locked()
                break
            except PageQuarantined as exc:
                quarantined = _named_or_all(exc.page_ids, pages)
                break
            except PoolFailed as exc:
                self._fail(f"mapper failed while committing unmap of {pages}: {exc}", exc)
            except VmmError:
                if attempt == 2:  # handles in an unknown state: never reuse these ids
                    quarantined = list(pages)
            except BaseException as exc:
                self._fail(f"unexpected error committing unmap of {pages}: {exc!r}", exc)
        self._to_free(pages, _UNMAPPING, quarantined=quarantined)
        return True

    def _to_free(self, pages: list[int], frm: int, quarantined: Sequence[int]) -> None:
        """Pages leave a failed or finished mapper call: ``quarantined`` ones for good, the
        others unbacked. (The gate's charge follows ``mapper.held_bytes``, not these.)"""
        bad = set(quarantined)
        with self._lock:
            self._move(quarantined, frm, _QUARANTINED)
            done = [p for p in pages if p not in bad]
            self._move(done, frm, _FREE)
            self._free.extend(done)

    # ------------------------------------------------------------------ the gate's charge

    def _settle_charge_locked(self, *, closing: bool = False) -> bool:
        """Make the gate's charge what the mapper holds (with its ``fixed_bytes`` until
        ``closing``): give back what it no longer holds, claim what it holds beyond the
        charge. ``False`` when the gate refused such growth (the charge stays short by that
        much). Caller holds ``_mapper_lock``."""
        held = self._mapper.held_bytes + (0 if closing else self._fixed_bytes)
        self._pooled = self._mapper.pooled_pages
        if held < self._charged:
            self._gate_release(self._charged - held)
            self._charged = held
        elif held > self._charged:
            if not self._gate_acquire(held - self._charged):
                return False
            self._charged = held
        return True

    def _gate_acquire(self, nbytes: int) -> bool:
        if nbytes <= 0:
            return True
        try:
            return self._gate.try_acquire(nbytes)
        except BaseException as exc:  # the books can no longer be kept: fail-stop
            self._fail(f"the memory gate failed to admit {nbytes} bytes: {exc!r}", exc)

    def _gate_release(self, nbytes: int) -> None:
        try:
            self._gate.release(nbytes)
        except BaseException as exc:
            self._fail(f"the memory gate failed to take back {nbytes} bytes: {exc!r}", exc)

    def _trim_pool_locked(self) -> None:
        """Release the mapper's pooled handles and settle the charge. A failed release stays
        held (and charged) and is retried by the mapper later. Caller holds
        ``_mapper_lock``; only background rounds call it."""
        self._count_call(refill=True)
        try:
            self._mapper.trim_pool()
        except VmmError as exc:
            log.warning("kvcore: releasing pooled handles failed (retried later): %s", exc)
        except BaseException as exc:
            self._fail(f"mapper failed while releasing its pool: {exc!r}", exc)
        finally:
            self._settle_charge_locked()

    def _settle_unmap_failure(self, pages: list[int], quarantined: Sequence[int]) -> None:
        """A prepare failed: quarantined pages leave, the rest are still mapped and go back
        to the reserve; the next unmap waits ``retry_interval``, doubling per further
        failure."""
        with self._lock:
            self._move(quarantined, _UNMAPPING, _QUARANTINED)
            kept = [p for p in pages if p not in quarantined]
            self._move(kept, _UNMAPPING, _RESERVED)
            self._to_reserve(kept)
            self._unmap_retry_at = self._clock() + self._unmap_backoff
            self._unmap_backoff = min(2 * self._unmap_backoff, 20 * self._retry_interval)

    # ------------------------------------------------------------------ background rounds

    def _run(self) -> None:
        """The background thread: a round whenever there is work, or every
        ``poll_interval``, until ``close`` or a failure."""
        try:
            while self._await_round():
                with shortened(self._switch_interval):
                    self._work()
        except PoolFailed:
            pass  # recorded; every caller now sees it
        except BaseException as exc:  # pragma: no cover - defensive
            self._fail(f"background thread died: {exc!r}", exc)
        finally:
            with self._lock:
                self._busy = False
                self._settled.notify_all()

    def _await_round(self) -> bool:
        """Wait (background thread) until there is work or ``poll_interval`` passed, then
        mark a round as running. ``False`` when the thread should stop instead."""
        with self._lock:
            while not self._stop and self._failure is None and not self._has_work_locked():
                self._busy = False
                self._settled.notify_all()
                if not self._wake.wait(self._wait_timeout_locked()):
                    break  # timed out: poll the gate, report the reserve
            if self._stop or self._failure is not None:
                return False
            self._busy = True
            self._kick = False
            return True

    def _work(self) -> None:
        """One round of background work (module docstring), ``_busy`` set by the caller:
        the background thread, or ``run_round``."""
        pb = self._page_bytes
        # idle pages: the reserve (or what is mapped ahead), then the pool
        wanted = max(self._reserve_max, self._map_ahead) + self._pooled
        allowed = max(self._gate.reserve_target(wanted * pb) // pb, 0)
        over = self._overage() if self._overage is not None else 0
        held_back = self._held_back_fn() if self._held_back_fn is not None else False
        with self._lock:
            self._held_back = held_back
            self._reserve_cap = min(allowed, self._reserve_max)
            self._ahead_cap = min(allowed, self._map_ahead)
            self._shed = self._shed_count_locked(over)
            # the pool goes first when the gate cuts the idle memory, and all of it on trim()
            trim_asked, self._trim_pool = self._trim_pool, False
            pool_keep = 0 if trim_asked else allowed - max(self._reserve_cap, self._ahead_cap)
            # over its limit, the instance keeps no idle handle: the ones this round's
            # unmaps pool go back in the same round, not one poll interval later
            drop_pool = allowed < wanted or over > 0
            unmaps, maps = self._plan_locked()
        if maps:
            if self._map(maps, refill=True):
                with self._lock:
                    self._move(maps, _MAPPING, _RESERVED)
                    self._to_reserve(maps)
                    self._backoff = self._retry_interval
                    self._batch_limit = min(2 * self._batch_limit, self._refill_batch)
                    self._background_map_done_locked()
            else:  # a miss: wait longer and ask for less next time
                with self._lock:
                    self._retry_at = self._clock() + self._backoff
                    self._backoff = min(2 * self._backoff, 20 * self._retry_interval)
                    self._batch_limit = max(len(maps) // 2, 1)
                    self._background_map_done_locked()
        if unmaps:  # after the refill (module docstring)
            self._unmap_progressively(unmaps)
        if trim_asked or (drop_pool and self._pooled > pool_keep):  # trim: retry releases too
            with self._mapper_lock:
                self._trim_pool_locked()
        with self._lock:
            reserve_bytes = (len(self._reserve) + self._pooled) * pb
            self._reserve_dirty = False
        self._gate.report_reserve(reserve_bytes)
        self._reported_idle = reserve_bytes
        with self._lock:
            self._rounds += 1
            self._settled.notify_all()
        listener = self._shed_listener
        if listener is not None and self.shed_wanted():
            try:
                listener()
            except Exception:  # the engine's business: the allocator goes on
                log.exception("kvcore: the shed listener raised")

    def _unmap_progressively(self, pages: list[int]) -> None:
        """Unmap this round's ``UNMAPPING`` pages in chunks of 1, 2, 4, ... page ids, each
        settling the gate's charge, the device waited for once (module docstring: giving
        memory back progressively). A failed prepare puts that chunk (behind the unmap
        back-off) and every page after it back in the reserve."""
        start, size = 0, 1
        while start < len(pages):
            chunk = pages[start : start + size]
            unmapped = self._unmap(chunk, synchronize=start == 0)
            start += size
            size *= 2
            with self._lock:
                rest = pages[start:]
                if unmapped:
                    self._unmap_backoff = self._retry_interval
                elif rest:  # they wait for the back-off with the failed chunk
                    self._move(rest, _UNMAPPING, _RESERVED)
                    self._to_reserve(rest)
                    rest = []
                self._bg_unmaps[:] = rest
                self._bg_progress += 1
                self._settled.notify_all()
            if not rest:
                return

    def _shed_count_locked(self, overage: int) -> int:
        """``overage`` bytes as pages in use to shed, less the pages already leaving use and
        the idle pages the gate has not been told of yet (it counts them as in use)."""
        if overage <= 0:
            return 0
        leaving = len(self._unmap_queue) + len(self._bg_unmaps)
        leaving += sum(len(pages) for pages in self._fenced.values())
        idle = (len(self._reserve) + self._pooled) * self._page_bytes
        leaving += max(0, idle - self._reported_idle) // self._page_bytes
        return max(0, -(-overage // self._page_bytes) - leaving)

    def _background_map_done_locked(self) -> None:
        """The background mapper call on ``_bg_maps`` is over: its pages are where it left
        them; wake an ``acquire`` waiting for them. Caller holds ``_lock``."""
        self._bg_maps.clear()
        self._bg_progress += 1
        self._settled.notify_all()

    def _unmap_pending_locked(self) -> bool:
        return bool(self._unmap_queue) or len(self._reserve) > self._keep_locked()

    def _has_work_locked(self) -> bool:
        if self._kick or self._trim_pool:
            return True
        if self._unmap_pending_locked() and self._clock() >= self._unmap_retry_at:
            return True
        return self._refill_deficit_locked() > 0 and not self._refill_blocked_locked()

    def _wait_timeout_locked(self) -> float:
        now = self._clock()
        wait = self._poll_interval
        if self._refill_deficit_locked() > 0 and self._free and self._retry_at > now:
            wait = min(wait, self._retry_at - now)
        if self._unmap_pending_locked() and self._unmap_retry_at > now:
            wait = min(wait, self._unmap_retry_at - now)
        return wait

    def _plan_locked(self) -> tuple[list[int], list[int]]:
        """Pick this round's unmaps and maps and move their pages into flight."""
        reserve = self._reserve
        surplus = len(reserve) - self._keep_locked()
        unmap_now = self._clock() >= self._unmap_retry_at
        if surplus > 0 and unmap_now:
            drop = reserve[:surplus]
            del reserve[:surplus]
            self._move(drop, _RESERVED, _QUEUED)
            self._unmap_queue.extend(drop)
        deficit = self._refill_deficit_locked()
        queue = self._unmap_queue
        if deficit and queue:  # take back pages still mapped before mapping new ones
            k = min(deficit, len(queue))
            back = queue[len(queue) - k :]
            del queue[len(queue) - k :]
            self._move(back, _QUEUED, _RESERVED)
            self._to_reserve(back)
            deficit -= k
        maps: list[int] = []
        if deficit and not self._refill_blocked_locked():
            k = min(deficit, len(self._free), self._batch_limit)
            maps = self._free[len(self._free) - k :]
            del self._free[len(self._free) - k :]
            self._move(maps, _FREE, _MAPPING)
        unmaps: list[int] = []
        if unmap_now:
            unmaps = queue[:]
            queue.clear()
            self._move(unmaps, _QUEUED, _UNMAPPING)
        self._bg_maps[:] = maps
        self._bg_unmaps[:] = unmaps
        return unmaps, maps


_SETTLE_TIMEOUT = 30.0
"""Seconds (real time) an ``acquire`` waits for a background round's mapper calls at most:
far beyond any healthy driver call, so only a driver that hangs turns the wait into a
miss."""


def _name(state: int) -> str:
    return PageState(state).name if state != _RELEASING else "RELEASING"


def _named_or_all(named: Sequence[int], pages: Sequence[int]) -> list[int]:
    """The pages of a call a ``PageQuarantined`` names; all of them when it names none."""
    inside = set(named) & set(pages)
    return [p for p in pages if p in inside] if inside else list(pages)
