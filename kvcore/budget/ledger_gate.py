"""``LedgerGate``: the ``kvcore.budget.gate.MemoryGate`` an engine instance charges, backed
by the per-GPU ledger (``kvcore.budget.ledger``).

The gate registers the instance (a record in the GPU's ledger) and admits memory within its
limit and the GPU budget minus what the other instances hold. Its calls sit on the page
allocator's paths (the reserve refill thread, and the scheduler thread on a reserve miss),
so they take the ledger's lock for a few field reads and writes and never wait long for it:
``GATE_LOCK_WAIT_S`` at most, after which a call treats the ledger as busy (never an
error; ``LedgerGate`` says what each call does then).

The gate runs no thread of its own. Its periodic work happens inside its calls, spaced on
its ``clock``: a budget refusal sweeps the ledger for dead instances at most once per
``SWEEP_INTERVAL_S``; a gate with a ``mem_info`` source publishes the device's free bytes
at most once per ``DEVICE_FREE_INTERVAL_S`` (from ``try_acquire`` and ``release``); a
ledger that stays busy is logged at most once per ``BUSY_LOG_INTERVAL_S``. A test passes a
fake ``clock`` (and ``wall_clock``, which the trim deadline is compared with) to drive
these decisions without sleeping.

Shares (``kvcore.budget.shares``). Beyond the limit and the budget, the gate enforces the
instance's share while another instance below its own share waits: it marks this instance
waiting when the budget refuses it below its share (and on ``note_wanted``), and while
someone else waits it admits nothing beyond this instance's share (``try_acquire``,
``headroom``, ``reserve_target``) and asks for the cached KV above it back (``overage``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import (
    HEADER,
    MAX_BYTES,
    RECORD,
    Flag,
    InstanceRecord,
    read_record,
    record_offset,
)
from kvcore.budget.shares import (
    WANT_HOLD_S,
    WANT_REFRESH_S,
    Contention,
    contention,
    header_wanted_until,
    mark_wanted,
)
from kvcore.errors import LedgerBusy, LedgerError

if TYPE_CHECKING:
    from kvcore.vmm.base import MemInfo, VmmBackend

log = logging.getLogger(__name__)

GATE_LOCK_WAIT_S = 0.05
"""How long a serving instance's gate waits for the ledger lock on its hot path before it
treats the ledger as busy: an allocation miss, a deferred release."""
SWEEP_INTERVAL_S = 1.0
"""A gate refused by the budget re-checks for dead instances at most this often."""
DEVICE_FREE_INTERVAL_S = 1.0
"""A gate with a ``mem_info`` source refreshes the header's device-free figure this often."""
BUSY_LOG_INTERVAL_S = 10.0
"""A ledger that stays busy (a stuck holder) is logged at most this often, not per call."""

# the hot path reads these consecutive fields with one unpack each
_REC_HOT_OFF, _REC_HOT = RECORD.span("limit", "denied")  # limit, revision, mapped, reserve, denied
_HDR_HOT_OFF, _HDR_HOT = HEADER.span("device_total", "total_mapped")
_HDR_TOTAL_OFF, _HDR_TOTAL = HEADER.span("total_mapped", "generation")
_HDR_GEN_OFF, _HDR_GEN = HEADER.span("generation", "generation")


class LedgerGate:
    """``kvcore.budget.gate.MemoryGate`` backed by the per-GPU ledger (module docstring).

    * ``try_acquire(n)`` claims ``n`` bytes when ``mapped + n <= limit`` (if a limit is
      set) and ``total + n <= budget``; otherwise ``False`` (an allocation miss). When the
      budget refuses, dead instances are reclaimed (at most once per
      ``SWEEP_INTERVAL_S``) and the check repeated once.
    * A limit lowered below use (``kvctl limit``) refuses new memory until use falls
      under it; ``reserve_target`` shrinks the reserve first and ``overage`` tells the
      engine how much cached KV to drop. Never an error; a raised or removed limit admits
      memory again at once.
    * ``reserve_target(wanted)`` is 0 while a trim is requested (``kvctl trim``).
    * Shares (module docstring): refused by the budget below its share, the instance is
      marked waiting; while another instance waits, this one gets nothing beyond its share
      (``try_acquire`` refuses, ``headroom`` and ``reserve_target`` stop at it) and
      ``overage`` asks for the cached KV above it. ``note_wanted(n)`` marks the instance
      waiting when its engine could not even ask (its free figure was short).
    * ``close`` removes the record (also done for it by the stale sweep if the process
      dies). Every method raises ``LedgerError`` if the record was removed under it.
    * Lock contention is never an error here: when another process holds the ledger's lock
      for longer than ``GATE_LOCK_WAIT_S`` (a slow ``kvctl``, a stopped process),
      ``try_acquire`` is a miss, ``release`` is deferred (the record keeps the bytes, which
      overstates this instance to the others, never the reverse, until the next call that
      gets the lock applies it), ``report_reserve`` is skipped, ``reserve_target`` keeps
      the reserve, ``headroom`` promises nothing and ``overage`` asks for nothing.
    """

    def __init__(
        self,
        ledger: GpuLedger,
        *,
        name: str,
        engine: str,
        engine_version: str = "",
        model: str = "",
        device: int = 0,
        limit: int = 0,
        share: int = 0,
        give_back: str = "all",
        mem_info: Callable[[], MemInfo] | None = None,
        on_change: Callable[[InstanceRecord], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Register instance ``name`` in ``ledger`` (``GpuLedger.register``). ``limit`` is
        bytes (0: none), ``share`` bytes (0: an equal part of the budget); ``give_back``:
        what ``overage`` asks for while another instance waits, ``"all"`` above the share
        (an engine that drains pages: every one must start emptying at once) or
        ``"asked"`` (an engine that preempts to empty pages within steps: only what the
        waiting instances ask for, so little is given back for nobody); ``mem_info`` (the
        backend's) lets the gate publish the device's free memory; ``on_change`` is called
        with a fresh record after each change (metrics), and once more at ``close`` with
        nothing mapped. ``clock`` (seconds, only differences matter) spaces the periodic
        work (module docstring); ``wall_clock`` (seconds since the epoch, as every process
        on the machine reads it) stamps the record's ``updated``, and is what a trim
        deadline and the waiting marks of shares are compared with.
        Raises ``ValueError`` for another ``give_back`` (nothing registered), ``LedgerError``
        if the name is taken by a live instance or the ledger is full, and as
        ``GpuLedger.register``."""
        if give_back not in ("all", "asked"):  # before the record exists
            raise ValueError(f'give_back must be "all" or "asked", got {give_back!r}')
        self.ledger = ledger
        self.name = name
        self._reg = ledger.register(
            name=name,
            engine=engine,
            engine_version=engine_version,
            model=model,
            device=device,
            limit=limit,
            share=share,
        )
        self._slot = self._reg.slot
        self._unlock = ledger.unlock  # ends what ``_enter`` began
        self._base = record_offset(self._slot)
        self._mem_info = mem_info
        self._on_change = on_change
        self._give_back_asked = give_back == "asked"
        self._clock = clock
        self._wall = wall_clock
        self._last_sweep = -math.inf  # clock readings of the last sweep, publication, log
        self._last_free = -math.inf
        self._last_busy_log = -math.inf
        self._last_want = -math.inf  # clock reading of the last waiting mark
        self._owns_ledger = False
        self._pending_release = 0  # bytes released while the ledger was busy
        self._closed = False

    @classmethod
    def from_backend(
        cls,
        backend: VmmBackend,
        *,
        name: str,
        engine: str,
        engine_version: str = "",
        model: str = "",
        limit: int = 0,
        share: int = 0,
        give_back: str = "all",
        on_change: Callable[[InstanceRecord], None] | None = None,
        directory: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> LedgerGate:
        """Open (or create, sized by ``backend.mem_info().total``) the ledger of
        ``backend``'s device and register there; the gate publishes the device's free
        memory from ``backend.mem_info`` and closes the ledger with itself. Arguments as
        for the constructor; ``directory`` overrides ``ledger_dir()``. Raises as
        ``GpuLedger.open`` and the constructor (the ledger is closed again then)."""
        info = backend.mem_info()
        ledger = GpuLedger.open(backend.device_uuid(), device_total=info.total, directory=directory)
        try:
            gate = cls(
                ledger,
                name=name,
                engine=engine,
                engine_version=engine_version,
                model=model,
                device=backend.device,
                limit=limit,
                share=share,
                give_back=give_back,
                mem_info=backend.mem_info,
                on_change=on_change,
                clock=clock,
                wall_clock=wall_clock,
            )
        except BaseException:
            ledger.close()
            raise
        gate._owns_ledger = True
        with contextlib.suppress(LedgerBusy):  # informative; the gate publishes it again
            ledger.note_device_free(info.free)
        return gate

    # -- MemoryGate ----------------------------------------------------------------------

    def try_acquire(self, nbytes: int) -> bool:
        """Claim ``nbytes`` (class docstring). Returns ``False`` for a refusal by the limit
        or the budget, a request beyond any device, or a busy ledger. Raises
        ``LedgerError`` for a negative size or a record removed under the gate."""
        if nbytes < 0:
            raise LedgerError(f"try_acquire({nbytes}): negative size", hint="a caller bug")
        if nbytes > MAX_BYTES:
            return False  # more than any device: refused like any request beyond the budget
        try:
            self._maybe_note_free()
            ok, budget_refused = self._try_acquire_once(nbytes)
            if ok or not budget_refused:
                return ok
            now = self._clock()
            if now - self._last_sweep < SWEEP_INTERVAL_S:
                return False
            self._last_sweep = now
            if not self.ledger.reclaim_stale():
                return False
            return self._try_acquire_once(nbytes)[0]
        except LedgerBusy as exc:
            self._note_busy("an allocation waits", exc)
            return False

    def _try_acquire_once(self, nbytes: int) -> tuple[bool, bool]:
        """(admitted, refused by the budget rather than the limit or a share)."""
        base = self._base
        buf = self._enter(exclusive=True)
        try:
            mapped, _, limit, total, budget, denied = self._figures(buf)
            by_limit = bool(limit and mapped + nbytes > limit)
            if by_limit or total + nbytes > budget:
                RECORD.put(buf, base, "denied", denied + 1)
                if limit and mapped > limit:
                    RECORD.put(buf, base, "flags", int(Flag.OVER_LIMIT))
                if not by_limit and self._mark_if_below_share(buf, mapped, budget, nbytes):
                    self._last_want = self._clock()  # the budget refused: this one waits
                return False, not by_limit
            waits = self._others_wait(buf, budget)
            if waits is not None and mapped + nbytes > waits.share:  # stay at the share
                RECORD.put(buf, base, "denied", denied + 1)
                RECORD.put(buf, base, "flags", int(Flag.YIELDING))
                return False, False
            RECORD.put(buf, base, "mapped", mapped + nbytes)
            RECORD.put(buf, base, "updated", self._wall())
            RECORD.put(buf, base, "flags", 0)
            _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, total + nbytes, self._generation(buf))
            rec = read_record(buf, self._slot) if self._on_change else None
        finally:
            self._unlock()
        if rec is not None and self._on_change is not None:
            self._on_change(rec)
        return True, False

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` claimed earlier; deferred (not lost) while the ledger is
        busy. Raises ``LedgerError`` when that is more than the instance holds (nothing
        changes) or the record was removed under the gate."""
        try:
            self._release_now(nbytes)
        except LedgerBusy as exc:
            self._pending_release += nbytes
            self._note_busy(f"{self._pending_release} released bytes wait for it", exc)
            return
        with contextlib.suppress(LedgerBusy):  # informational: the next call catches up
            self._maybe_note_free()

    def _release_now(self, nbytes: int) -> None:
        base = self._base
        buf = self._enter(exclusive=True)
        try:
            mapped, reserve, limit, total, _, _ = self._figures(buf)
            if nbytes < 0 or nbytes > mapped:
                raise LedgerError(
                    f"release({nbytes}) by {self.name!r}, which holds {mapped} bytes",
                    hint="the page allocator released more than it acquired: a kvcore bug",
                )
            now_mapped = mapped - nbytes
            RECORD.put(buf, base, "mapped", now_mapped)
            if reserve > now_mapped:
                RECORD.put(buf, base, "reserve", now_mapped)
            RECORD.put(buf, base, "updated", self._wall())
            if not limit or now_mapped <= limit:
                RECORD.put(buf, base, "flags", 0)
            # A waiting mark outlives releases: a waiting instance frees the pages of its
            # own finished requests while its queue still wants more than it holds, and a
            # mark cleared then lets the borrower take back (and re-admit into) what it
            # just gave up. The mark ends WANT_HOLD_S after the last refusal.
            _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, max(0, total - nbytes), self._generation(buf))
            rec = read_record(buf, self._slot) if self._on_change else None
        finally:
            self._unlock()
        if rec is not None and self._on_change is not None:
            self._on_change(rec)

    def report_reserve(self, nbytes: int) -> None:
        """Record that ``nbytes`` of the claimed bytes idle in the reserve (capped at what
        the instance holds); skipped while the ledger is busy. Raises ``LedgerError`` when
        the record was removed under the gate."""
        try:
            buf = self._enter(exclusive=True)
        except LedgerBusy:
            return  # informational: the next report catches up
        base = self._base
        try:
            mapped, _, _, total, _, _ = self._figures(buf)
            RECORD.put(buf, base, "reserve", max(0, min(nbytes, mapped)))
            RECORD.put(buf, base, "updated", self._wall())
            _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, total, self._generation(buf))
            rec = read_record(buf, self._slot) if self._on_change else None
        finally:
            self._unlock()
        if rec is not None and self._on_change is not None:
            self._on_change(rec)

    def reserve_target(self, wanted: int) -> int:
        """Reserve bytes the allocator may keep now, at most ``wanted``: 0 while a trim
        holds, else what fits the limit and the budget beside the bytes in use; ``wanted``
        while the ledger is busy. Raises ``LedgerError`` when the record was removed."""
        try:
            buf = self._enter(exclusive=False)
        except LedgerBusy:
            return wanted  # keep the reserve (it is charged already) until the ledger frees
        try:
            if RECORD.get_float(buf, self._base, "trim_until") > self._wall():
                return 0
            mapped, reserve, limit, total, budget, _ = self._figures(buf)
            waits = self._others_wait(buf, budget)
        finally:
            self._unlock()
        in_use = max(0, mapped - reserve)
        room = budget - (total - mapped) - in_use
        if limit:
            room = min(room, limit - in_use)
        if waits is not None:  # another instance waits: no idle memory beyond the share
            room = min(room, waits.share - in_use)
        return max(0, min(wanted, room))

    def headroom(self) -> int:
        """Bytes ``try_acquire`` would admit now (the instance limit and the GPU budget
        minus what every instance holds); 0 while over either or while the ledger is busy.
        Beyond the ``MemoryGate`` protocol: ``PageAllocator.available()`` uses it (through
        ``headroom_held_back``). Raises ``LedgerError`` when the record was removed."""
        return self.headroom_held_back()[0]

    def overage(self) -> int:
        """Bytes to give back: what this instance uses (mapped less its idle reserve)
        beyond its limit (``kvctl limit`` lowered below use), or, while another instance
        below its share waits, its use beyond its share (``give_back="asked"``: at most its
        part of what the waiting instances ask for beyond the budget's free bytes,
        ``Contention.give_back``); 0 otherwise, and while the ledger is busy. A lowered GPU
        budget asks nobody in particular: it only refuses new memory until the total falls
        under it. Beyond the ``MemoryGate`` protocol: the page allocator reads it once per
        background round.
        Raises ``LedgerError`` when the record was removed."""
        try:
            buf = self._enter(exclusive=False)
        except LedgerBusy:
            return 0  # shed nothing on a reading the ledger cannot confirm
        try:
            mapped, reserve, limit, total, budget, _ = self._figures(buf)
            waits = self._others_wait(buf, budget)
        finally:
            self._unlock()
        over = mapped - reserve - limit if limit else 0
        if waits is not None:  # the idle reserve goes first (reserve_target), then this
            above = mapped - reserve - waits.share
            if self._give_back_asked:
                above = min(above, waits.give_back(mapped, budget - total))
            over = max(over, above)
        return max(0, over)

    def held_back(self) -> bool:
        """Whether this instance maps more than it may hold now: more than its limit, or
        more than its share while another instance below its own share waits. The page
        allocator then puts no idle page (reserve, queued for unmap) back in use: those
        pages are on their way back to the driver. ``False`` while the ledger is busy.
        Beyond the ``MemoryGate`` protocol. Raises ``LedgerError`` when the record was
        removed."""
        return self.headroom_held_back()[1]

    def headroom_held_back(self) -> tuple[int, bool]:
        """``(headroom(), held_back())`` from one read of the ledger: one lock instead of
        two for ``PageAllocator.available()``, which asks before every allocation that
        needs a page (under a full budget, every time). ``(0, False)`` while the ledger is
        busy: no room and nothing held back that it cannot confirm. Raises ``LedgerError``
        when the record was removed."""
        try:
            buf = self._enter(exclusive=False)
        except LedgerBusy:
            return 0, False
        try:
            mapped, _, limit, total, budget, _ = self._figures(buf)
            waits = self._others_wait(buf, budget)
        finally:
            self._unlock()
        room = budget - total
        held = bool(limit) and mapped > limit
        if limit:
            room = min(room, limit - mapped)
        if waits is not None:
            room = min(room, waits.share - mapped)
            held = held or mapped > waits.share
        return max(0, room), held

    def note_wanted(self, nbytes: int) -> None:
        """The engine could not get ``nbytes`` more it asked for (its free figure, which
        includes this gate's headroom, was short): mark the instance waiting when the GPU
        budget, not its own limit, is what stands in the way and it holds less than its
        share (``kvcore.budget.shares``). At most once per ``WANT_REFRESH_S`` of ``clock``;
        skipped while the ledger is busy. Beyond the ``MemoryGate`` protocol. Raises
        ``LedgerError`` when the record was removed."""
        now = self._clock()
        if nbytes <= 0 or now - self._last_want < WANT_REFRESH_S:
            return
        self._last_want = now
        try:
            buf = self._enter(exclusive=True)
        except LedgerBusy:
            return  # the next shortage asks again
        try:
            mapped, _, limit, total, budget, _ = self._figures(buf)
            if limit and mapped + nbytes > limit:
                return  # its own limit: nobody else's memory would help
            if total + nbytes <= budget:
                return  # the budget has room: the shortage is not another instance's doing
            self._mark_if_below_share(buf, mapped, budget, nbytes)
        finally:
            self._unlock()

    def _mark_if_below_share(self, buf: mmap.mmap, mapped: int, budget: int, nbytes: int) -> bool:
        """Mark this instance waiting for ``nbytes`` (at most what takes it to its share)
        when it maps less than its share; whether it did. Caller holds the exclusive lock."""
        now = self._wall()
        share = contention(buf, self._slot, budget, now).share
        if share <= mapped:
            return False
        mark_wanted(buf, self._slot, now + WANT_HOLD_S, min(nbytes, share - mapped), now)
        return True

    def _others_wait(self, buf: mmap.mmap, budget: int) -> Contention | None:
        """This instance's share when another instance below its own share waits now;
        ``None`` when nobody else waits (the common case: one header read, no scan).
        Caller holds the lock."""
        now = self._wall()
        if header_wanted_until(buf) <= now:
            return None
        found = contention(buf, self._slot, budget, now)
        return found if found.others_wait else None

    # -- the hot path: no context managers, one unpack for the record, one for the header --

    def _enter(self, *, exclusive: bool) -> mmap.mmap:
        """Lock the ledger (waiting ``GATE_LOCK_WAIT_S`` at most: ``LedgerBusy``) with the
        record checked to be still ours; exclusive, apply a release deferred while the
        ledger was busy. The caller must call ``_unlock`` (in a ``finally``) once this
        returned."""
        buf = self.ledger.lock_record(self._reg, exclusive=exclusive, timeout=GATE_LOCK_WAIT_S)
        if exclusive and self._pending_release:
            self._apply_pending_release(buf)
        return buf

    def _apply_pending_release(self, buf: mmap.mmap) -> None:
        """Write the releases deferred while the ledger was busy. Caller holds the
        exclusive lock."""
        mapped, reserve, _, total, _, _ = self._figures(buf)
        nbytes = min(self._pending_release, mapped)
        self._pending_release = 0
        RECORD.put(buf, self._base, "mapped", mapped - nbytes)
        if reserve > mapped - nbytes:
            RECORD.put(buf, self._base, "reserve", mapped - nbytes)
        _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, max(0, total - nbytes), self._generation(buf))

    def _note_busy(self, what: str, exc: LedgerBusy) -> None:
        now = self._clock()
        if now - self._last_busy_log >= BUSY_LOG_INTERVAL_S:
            self._last_busy_log = now
            log.warning("kvcore: %s: %s", what, exc)  # str(exc) carries the hint

    def _figures(self, buf: mmap.mmap) -> tuple[int, int, int, int, int, int]:
        """(mapped, reserve, limit, GPU total, effective budget, denied), under the lock."""
        limit, _, mapped, reserve, denied = _REC_HOT.unpack_from(buf, self._base + _REC_HOT_OFF)
        device_total, budget, _, total = _HDR_HOT.unpack_from(buf, _HDR_HOT_OFF)
        return mapped, reserve, limit, total, budget or device_total, denied

    @staticmethod
    def _generation(buf: mmap.mmap) -> int:
        generation: int = _HDR_GEN.unpack_from(buf, _HDR_GEN_OFF)[0]
        return generation + 1

    # -- the rest ------------------------------------------------------------------------

    def record(self) -> InstanceRecord:
        """This instance's record now. Raises ``LedgerError`` when it was removed, and as
        ``GpuLedger.lock`` (``LedgerBusy`` after ``LOCK_TIMEOUT_S``)."""
        return self.ledger.instance_record(self._reg)

    def close(self) -> None:
        """Remove this instance's record (its bytes leave the GPU total); close the ledger
        if ``from_backend`` opened it. Idempotent; tolerates a record already reclaimed
        (and a ledger it cannot lock: the stale sweep removes the record once this process
        is gone)."""
        if self._closed:
            return
        self._closed = True
        last = None
        with contextlib.suppress(LedgerError):
            last = self.ledger.unregister(self._reg)
        if last is not None and self._on_change is not None:
            self._on_change(replace(last, mapped=0, reserve=0))  # gone: holds nothing
        if self._owns_ledger:
            self.ledger.close()

    def __enter__(self) -> LedgerGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _maybe_note_free(self) -> None:
        if self._mem_info is None:
            return
        now = self._clock()
        if now - self._last_free < DEVICE_FREE_INTERVAL_S:
            return
        self._last_free = now
        self.ledger.note_device_free(self._mem_info().free)
