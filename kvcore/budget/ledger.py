"""The per-GPU shared ledger: one file per physical GPU recording every kvcore instance on it.

``GpuLedger`` is an open ledger file (``kvcore.budget.ledger_file`` has the file itself:
where it lives, its layout, creation, validation and locking). It offers the control
plane's API (``snapshot``, ``reclaim_stale``, ``set_limit``, ``set_share``, ``set_budget``,
``request_trim``: ``kvctl``, ``kvtop``, the metrics exporter) and the instance side's
(``register``, ``unregister``, ``lock_record``: ``kvcore.budget.ledger_gate.LedgerGate``,
the ``MemoryGate`` a page allocator charges).

Locking. Every access holds the file's ``flock`` (``ledger_file``). A thread lock
serialises the threads of one process, which share the open file description. A lock held
for longer than ``ledger_file.LOCK_TIMEOUT_S`` (e.g. by a stopped process) raises
``LedgerBusy`` (a ``LedgerError``) instead of hanging the caller; an instance starting
(``GpuLedger.open``, ``register``) waits up to ``ledger_file.REGISTER_LOCK_WAIT_S``, with a
warning every ``LOCK_TIMEOUT_S``; a serving instance's gate chooses its own, short wait
(``lock_record``'s ``timeout``).

Stale records. A record whose pid is gone, is a zombie, or belongs to a newer process (its
start time in ``/proc/<pid>/stat`` differs) is reclaimed (its bytes leave the GPU total)
by the next ``register``, by ``reclaim_stale`` (``kvctl``, ``kvtop``) and by a gate whose
request the budget refused. Records written from another pid namespace cannot be judged
here and are left alone (``Liveness.UNKNOWN``); instances sharing a GPU must share a pid
namespace for dead ones to be reclaimed automatically (containers: ``--pid=host``).

Limits. An instance's ``limit`` (0: none) caps its mapped bytes; the header's ``budget``
(0: the device total) caps the sum over all instances. Each change bumps a revision;
``set_limit(..., if_revision=)`` is a compare-and-set, so a writer acting on an old reading
cannot undo a newer change. Instances never write their own limit back: the gate writes
only its usage fields.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvcore.budget.ledger_file import (
    CAPACITY,
    FILE_SIZE,
    HEADER,
    MAX_BYTES,
    RECORD,
    Flag,
    InstanceRecord,
    LedgerSnapshot,
    Liveness,
    State,
    bump_generation,
    clear_record,
    create,
    encode_text,
    is_free,
    ledger_path,
    lock_fd,
    lock_patiently,
    open_mapped,
    read_record,
    record_offset,
)
from kvcore.errors import LedgerError, RevisionConflict, UnknownInstance

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:+/-]{0,62}$")
_ID_OFF, _ID = RECORD.span("state", "token")  # state, pid, start time, pidns, token


@dataclass(frozen=True)
class Registration:
    """Which record an instance registered (``GpuLedger.register``): its slot, and the
    random token that tells it from any later record in the same slot."""

    slot: int
    token: int
    offset: int = field(init=False, repr=False, compare=False)
    """The record's byte offset in the file (``ledger_file.record_offset``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", record_offset(self.slot))


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22);
    ``None`` when no such process runs (gone, or a zombie whose memory is already freed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class GpuLedger:
    """An open ledger file of one GPU. Thread-safe; one per process and GPU is enough.

    Open with ``GpuLedger.open``; ``close`` unmaps the file (records stay). Instances
    register through ``LedgerGate``; the control plane uses ``snapshot``,
    ``reclaim_stale``, ``set_limit``, ``set_budget`` and ``request_trim``. Every method
    raises ``LedgerError`` once the ledger is closed, in a child forked after it was opened,
    or when the file was truncated under it; ``LedgerBusy`` when another process holds the
    file's lock too long (module docstring).
    """

    def __init__(self, path: Path, fd: int, buf: mmap.mmap) -> None:
        """Adopt an open, validated ledger (``ledger_file.open_mapped``); use ``open``."""
        self.path = path
        self._fd = fd
        self._buf = buf
        self._tlock = threading.Lock()
        self._pid = os.getpid()
        self._pidns = _pid_namespace()
        self.device_uuid = HEADER.get_text(buf, 0, "device_uuid")

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        device_uuid: str,
        *,
        device_total: int | None = None,
        directory: Path | None = None,
    ) -> GpuLedger:
        """Open the ledger of ``device_uuid``; create it when ``device_total`` (the GPU's
        physical bytes) is given and none exists. Raises ``LedgerNotFound`` when none
        exists and ``device_total`` is ``None``; ``LedgerError`` when the file is foreign,
        of another layout version, for another device, or not accessible."""
        path = ledger_path(device_uuid, directory)
        if device_total is not None and not path.exists():
            create(path, device_uuid, device_total)
        return cls.open_path(path, expect_uuid=device_uuid, waiter="an instance opening it")

    @classmethod
    def open_path(
        cls, path: Path, *, expect_uuid: str | None = None, waiter: str | None = None
    ) -> GpuLedger:
        """Open an existing ledger file by path (``kvctl``, ``kvtop``). Raises as ``open``;
        ``waiter`` (an instance starting) waits for a held lock as
        ``ledger_file.lock_patiently``."""
        fd, buf = open_mapped(path, expect_uuid=expect_uuid, waiter=waiter)
        return cls(path, fd, buf)

    def close(self) -> None:
        """Unmap and close the file. Records stay; idempotent."""
        with self._tlock:
            if self._fd < 0:
                return
            self._buf.close()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> GpuLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- locking -------------------------------------------------------------------------

    def lock(
        self, *, exclusive: bool, timeout: float | None = None, waiter: str | None = None
    ) -> mmap.mmap:
        """Take the thread lock and the file lock (exclusive to write, shared to read) and
        return the mapped file; the caller must call ``unlock`` (in a ``finally``) once this
        returned. ``timeout``: how long to wait for another holder (default
        ``ledger_file.LOCK_TIMEOUT_S``); ``waiter`` (an instance starting) waits patiently
        instead and names itself in the warnings (``ledger_file.lock_patiently``). Raises
        ``LedgerBusy`` when the lock stays held, ``LedgerError`` when the ledger is closed,
        used after a fork, or its file was truncated (nothing is held then). Writers keep
        the file's invariants (``ledger_file``'s docstring)."""
        self._tlock.acquire()
        try:
            self._check_usable()
            op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            if waiter is None:
                lock_fd(self._fd, op, self.path, timeout=timeout)
            else:
                lock_patiently(self._fd, op, self.path, waiter)
        except BaseException:
            self._tlock.release()
            raise
        try:
            self._check_size()  # a truncated file would SIGBUS on the next read
        except BaseException:
            self.unlock()
            raise
        return self._buf

    def unlock(self) -> None:
        """Release what ``lock`` (or ``lock_record``) took."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._tlock.release()

    @contextlib.contextmanager
    def locked(self, exclusive: bool, waiter: str | None = None) -> Iterator[mmap.mmap]:
        """``lock`` ... ``unlock`` as a context manager yielding the mapped file."""
        buf = self.lock(exclusive=exclusive, waiter=waiter)
        try:
            yield buf
        finally:
            self.unlock()

    def lock_record(
        self, reg: Registration, *, exclusive: bool, timeout: float | None = None
    ) -> mmap.mmap:
        """``lock``, then check that ``reg``'s record is still the registrant's; the caller
        must call ``unlock`` once this returned. Raises as ``lock``, and ``LedgerError``
        (nothing held) when another process removed or replaced the record."""
        # ``lock`` inlined: this is every gate call's way in
        self._tlock.acquire()
        try:
            self._check_usable()
            lock_fd(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, self.path, timeout)
        except BaseException:
            self._tlock.release()
            raise
        try:
            self._check_size()
            state, _, _, _, token = _ID.unpack_from(self._buf, reg.offset + _ID_OFF)
            if state != State.ACTIVE or token != reg.token:
                raise _removed(self.path, reg.slot)
        except BaseException:
            self.unlock()
            raise
        return self._buf

    @contextlib.contextmanager
    def _own(self, reg: Registration, exclusive: bool = True) -> Iterator[mmap.mmap]:
        buf = self.lock_record(reg, exclusive=exclusive)
        try:
            yield buf
        finally:
            self.unlock()

    def _check_size(self) -> None:
        """Under the file lock: the file still covers the whole map. A file truncated under
        the map would make the next access a SIGBUS; this raises ``LedgerError`` first."""
        size = os.fstat(self._fd).st_size
        if size < FILE_SIZE:
            raise LedgerError(
                f"the ledger {self.path} was truncated to {size} bytes while in use",
                hint="something outside kvcore damaged it: stop the instances on this GPU, "
                "remove the file, restart them",
            )

    def _check_usable(self) -> None:
        if self._fd < 0:
            raise LedgerError(f"ledger {self.path} is closed", hint="open it again")
        if os.getpid() != self._pid:
            # a forked child shares the parent's open file description, hence its flock:
            # the lock would not exclude the parent
            raise LedgerError(
                f"ledger {self.path} was opened by process {self._pid} and used after a fork",
                hint="open the ledger (and register a gate) in the process that uses it",
            )

    # -- reading -------------------------------------------------------------------------

    def snapshot(self) -> LedgerSnapshot:
        """Every active record and the header, read under one shared lock. Liveness is
        judged after the lock is dropped (it reads ``/proc``). Raises ``LedgerError`` for a
        corrupt record."""
        with self.locked(exclusive=False) as buf:
            header = (
                HEADER.get_text(buf, 0, "device_uuid"),
                HEADER.get_int(buf, 0, "device_total"),
                HEADER.get_int(buf, 0, "budget"),
                HEADER.get_int(buf, 0, "budget_revision"),
                HEADER.get_int(buf, 0, "total_mapped"),
                HEADER.get_int(buf, 0, "device_free"),
                HEADER.get_float(buf, 0, "device_free_time"),
                HEADER.get_int(buf, 0, "generation"),
            )
            records = [read_record(buf, slot) for slot in range(CAPACITY) if not is_free(buf, slot)]
        uuid, total, budget, budget_rev, mapped, free, free_time, generation = header
        return LedgerSnapshot(
            path=self.path,
            device_uuid=uuid,
            device_total=total,
            budget_setting=budget,
            budget_revision=budget_rev,
            total_mapped=mapped,
            device_free=free,
            device_free_time=free_time,
            generation=generation,
            records=tuple(replace(r, liveness=self._liveness(r)) for r in records),
        )

    def _liveness(self, rec: InstanceRecord) -> Liveness:
        if rec.pidns and self._pidns and rec.pidns != self._pidns:
            return Liveness.UNKNOWN
        if process_start_time(rec.pid) != rec.start_time:
            return Liveness.STALE
        return Liveness.LIVE

    # -- control plane -------------------------------------------------------------------

    def reclaim_stale(self) -> list[InstanceRecord]:
        """Free the records of dead processes and recompute the GPU total from the live
        records (healing a total left inconsistent by a writer killed mid-update).
        Returns the reclaimed records."""
        with self.locked(exclusive=True) as buf:
            return self._reclaim_locked(buf)

    def _reclaim_locked(self, buf: mmap.mmap) -> list[InstanceRecord]:
        reclaimed: list[InstanceRecord] = []
        total = 0
        for slot in range(CAPACITY):
            if is_free(buf, slot):
                continue
            rec = read_record(buf, slot)
            liveness = self._liveness(rec)
            if liveness is Liveness.STALE:
                clear_record(buf, slot)
                reclaimed.append(replace(rec, liveness=liveness))
            else:
                total += rec.mapped
        if reclaimed or HEADER.get(buf, 0, "total_mapped") != total:
            HEADER.put(buf, 0, "total_mapped", total)
            bump_generation(buf)
        return reclaimed

    def set_limit(
        self, name: str, limit: int, *, if_revision: int | None = None
    ) -> tuple[InstanceRecord, InstanceRecord]:
        """Set instance ``name``'s limit to ``limit`` bytes (0: none); returns the record
        before and after. Lowering below current use is deferred by the instance's gate
        (no new memory until use falls; the engine is asked to shed cached KV down to it,
        ``LedgerGate.overage``), never an error. Raises ``UnknownInstance``
        (message lists the known names) and, when ``if_revision`` is given and is not the
        current limit revision, ``RevisionConflict`` (nothing changed)."""
        _check_bytes("limit", limit)
        with self.locked(exclusive=True) as buf:
            self._reclaim_locked(buf)
            before = self._find_locked(buf, name)
            if if_revision is not None and before.limit_revision != if_revision:
                raise RevisionConflict(
                    f"the limit of {name!r} is at revision {before.limit_revision} "
                    f"({_fmt_limit(before.limit)}), not {if_revision}",
                    hint="another writer changed it; re-read it (kvctl list) and retry",
                )
            base = record_offset(before.slot)
            RECORD.put(buf, base, "limit", limit)
            RECORD.put(buf, base, "limit_revision", before.limit_revision + 1)
            flags = Flag(RECORD.get_int(buf, base, "flags"))
            if limit and before.mapped > limit:
                flags |= Flag.OVER_LIMIT
            else:
                flags &= ~Flag.OVER_LIMIT
            RECORD.put(buf, base, "flags", int(flags))
            bump_generation(buf)
            after = read_record(buf, before.slot)
        return before, after

    def set_share(self, name: str, share: int) -> tuple[InstanceRecord, InstanceRecord]:
        """Set instance ``name``'s share to ``share`` bytes (0: an equal part of the GPU
        budget); returns the record before and after. The share is what the instance keeps
        while others below their own share wait: above it, it yields them what it frees
        (``kvcore.budget.shares``). A share above what the instance maps is applied as it
        grows; shares summing to more than the budget cannot all be honoured at once.
        Raises ``UnknownInstance``."""
        _check_bytes("share", share)
        with self.locked(exclusive=True) as buf:
            self._reclaim_locked(buf)
            before = self._find_locked(buf, name)
            RECORD.put(buf, record_offset(before.slot), "share", share)
            bump_generation(buf)
            after = read_record(buf, before.slot)
        return before, after

    def set_budget(self, budget: int, *, if_revision: int | None = None) -> int:
        """Set the GPU-wide budget in bytes (0: the device total); returns the new budget
        revision. Lowering below current use is deferred like a limit. Raises
        ``RevisionConflict`` when ``if_revision`` is given and stale."""
        _check_bytes("budget", budget)
        with self.locked(exclusive=True) as buf:
            rev = HEADER.get_int(buf, 0, "budget_revision")
            if if_revision is not None and rev != if_revision:
                raise RevisionConflict(
                    f"the GPU budget is at revision {rev}, not {if_revision}",
                    hint="another writer changed it; re-read it (kvctl list) and retry",
                )
            HEADER.put(buf, 0, "budget", budget)
            HEADER.put(buf, 0, "budget_revision", rev + 1)
            bump_generation(buf)
        return rev + 1

    def request_trim(self, name: str, hold_s: float) -> InstanceRecord:
        """Ask instance ``name`` to drop its whole reserve and keep none for ``hold_s``
        seconds (``math.inf``: until the next trim request says otherwise); returns its
        record after the request. Its gate's ``reserve_target`` returns 0 meanwhile.
        Raises ``UnknownInstance``."""
        with self.locked(exclusive=True) as buf:
            self._reclaim_locked(buf)
            rec = self._find_locked(buf, name)
            until = math.inf if math.isinf(hold_s) else time.time() + max(0.0, hold_s)
            RECORD.put(buf, record_offset(rec.slot), "trim_until", until)
            bump_generation(buf)
            return read_record(buf, rec.slot)

    def _find_locked(self, buf: mmap.mmap, name: str) -> InstanceRecord:
        known: list[str] = []
        for slot in range(CAPACITY):
            if is_free(buf, slot):
                continue
            rec = read_record(buf, slot)
            if rec.name == name:
                return rec
            known.append(rec.name)
        listed = ", ".join(sorted(known)) if known else "none"
        raise UnknownInstance(
            f"no instance named {name!r} on GPU {self.device_uuid} (known: {listed})",
            hint="names are shown by `kvctl list`",
        )

    def note_device_free(self, free: int) -> None:
        """Record the device's free bytes as the driver reports them now (``kvtop`` shows
        memory held outside kvcore from it)."""
        with self.locked(exclusive=True) as buf:
            HEADER.put(buf, 0, "device_free", max(0, free))
            HEADER.put(buf, 0, "device_free_time", time.time())

    # -- instance side (LedgerGate) ------------------------------------------------------

    def register(
        self,
        *,
        name: str,
        engine: str,
        engine_version: str = "",
        model: str = "",
        device: int = 0,
        limit: int = 0,
        share: int = 0,
    ) -> Registration:
        """Add a record for instance ``name`` of this process (``LedgerGate`` calls it when
        it opens), reclaiming stale records first; waits patiently for a held lock (an
        instance starting). ``limit`` is bytes (0: none); ``share`` bytes (0: an equal part
        of the budget, ``kvcore.budget.shares``). Returns the record's
        ``Registration``; ``unregister`` removes it. Raises ``LedgerError`` when the name
        is not usable or taken by a live instance, a text is too long for its field, the
        limit or share is out of range, or the ledger is full; ``LedgerBusy`` when the lock
        stays held past ``ledger_file.REGISTER_LOCK_WAIT_S``."""
        _check_bytes("limit", limit)
        _check_bytes("share", share)
        if not _NAME_RE.match(name):
            raise LedgerError(
                f"instance name {name!r} is not usable",
                hint="use 1-63 characters: letters, digits and . _ @ : + / - "
                "(starting with a letter or digit)",
            )
        encoded = {
            "engine": encode_text(engine, 16, "engine"),
            "engine_version": encode_text(engine_version, 32, "engine version"),
            "name": encode_text(name, 64, "instance name"),
            "model": encode_text(model, 128, "model"),
        }
        pid = os.getpid()
        start = process_start_time(pid)
        assert start is not None
        token = secrets.randbits(63) | 1
        with self.locked(exclusive=True, waiter=f"registering {name!r}") as buf:
            self._reclaim_locked(buf)
            free_slot = None
            for slot in range(CAPACITY):
                base = record_offset(slot)
                if is_free(buf, slot):
                    free_slot = free_slot if free_slot is not None else slot
                elif RECORD.get_text(buf, base, "name") == name:
                    other = RECORD.get_int(buf, base, "pid")
                    raise LedgerError(
                        f"an instance named {name!r} already runs on GPU "
                        f"{self.device_uuid} (pid {other})",
                        hint="give this instance another name",
                    )
            if free_slot is None:
                raise LedgerError(
                    f"the ledger of GPU {self.device_uuid} is full ({CAPACITY} instances)",
                    hint="run `kvctl clean` to reclaim records of dead instances",
                )
            now = time.time()
            values: dict[str, int | float | bytes] = {
                "state": int(State.ACTIVE),
                "pid": pid,
                "start_time": start,
                "pidns": self._pidns,
                "token": token,
                "device": device,
                "flags": 0,
                "limit": limit,
                "limit_revision": 1,
                "mapped": 0,
                "reserve": 0,
                "denied": 0,
                "trim_until": 0.0,
                "registered": now,
                "updated": now,
                "share": share,
                "wanted_until": 0.0,
                "wanted_bytes": 0,
                **encoded,
            }
            clear_record(buf, free_slot)
            RECORD.all.pack_into(buf, record_offset(free_slot), *(values[n] for n in RECORD.names))
            bump_generation(buf)
        return Registration(free_slot, token)

    def instance_record(self, reg: Registration) -> InstanceRecord:
        """The registrant's record now (read under the shared lock). Raises ``LedgerError``
        when another process removed it, and as ``lock``."""
        with self._own(reg, exclusive=False) as buf:
            return read_record(buf, reg.slot)

    def unregister(self, reg: Registration) -> InstanceRecord:
        """Remove the registrant's record; its bytes leave the GPU total. Returns the
        record as it was. Raises ``LedgerError`` when another process removed it already
        (nothing changed), and as ``lock``."""
        with self._own(reg) as buf:
            last = read_record(buf, reg.slot)
            total = HEADER.get_int(buf, 0, "total_mapped")
            HEADER.put(buf, 0, "total_mapped", max(0, total - last.mapped))
            clear_record(buf, reg.slot)
            bump_generation(buf)
        return last


def _removed(path: Path, slot: int) -> LedgerError:
    return LedgerError(
        f"this instance's record (slot {slot}) in {path} was removed by another process",
        hint="the ledger thought this process dead (another pid namespace, or "
        "the file was replaced); restart the instance",
    )


def _fmt_limit(limit: int) -> str:
    return f"{limit} bytes" if limit else "no limit"


def _check_bytes(what: str, n: int) -> None:
    """Refuse a size a ledger field cannot hold, naming it (``LedgerError``)."""
    if not 0 <= n <= MAX_BYTES:
        raise LedgerError(
            f"{what} {n} bytes is outside 0 .. {MAX_BYTES} (64 PiB)",
            hint="give bytes >= 0 (0: none) no larger than any device",
        )
