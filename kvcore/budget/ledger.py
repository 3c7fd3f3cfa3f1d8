"""The per-GPU shared ledger: one file per physical GPU recording every kvcore instance on it.

Several engine instances on one GPU must see one truth about who holds what. Each GPU has
one ledger file, ``<dir>/kvcore-gpu-<device uuid>.ledger``, keyed by the backend's
``device_uuid()``. ``<dir>`` is ``/dev/shm`` (shared memory: gone on reboot, like the
memory it describes) unless ``KVCORE_LEDGER_DIR`` names another directory (tests).

File layout (little-endian, fixed size, version ``LAYOUT_VERSION``)::

    header (256 bytes)  magic "KVCLEDGR", layout version, header/record size, capacity,
                        device uuid and total bytes, GPU-wide budget + its revision,
                        sum of mapped bytes, change generation, last seen device free bytes
    records (64 x 384)  one slot per instance: state, pid + process start time + pid
                        namespace, a random token, engine + version, instance name, model,
                        device ordinal, limit + limit revision, mapped bytes, reserve bytes,
                        trim deadline, refusal count, registration and last update times

A file whose magic, version, sizes or device uuid do not match, or that is not a regular
file, or that every user may write (anyone could have planted it), is refused with
``LedgerError`` and never written to. A new ledger is written completely to a temporary
file and published with ``link(2)``, so the path never holds a half-made ledger.

Locking. Every access holds ``flock(2)`` on the ledger file: exclusive to write, shared to
read, so a reader never sees a torn record (the critical sections are a few struct reads
and writes, microseconds). A thread lock serialises the threads of one process, which share
the open file description. A lock held for longer than ``LOCK_TIMEOUT_S`` (e.g. by a
stopped process) raises ``LedgerBusy`` (a ``LedgerError``) instead of hanging the caller;
a serving instance's ``LedgerGate`` waits ``GATE_LOCK_WAIT_S`` at most and never fails on
contention alone (its docstring says what each call does then), and an instance starting
(``GpuLedger.open``, registering) waits up to ``REGISTER_LOCK_WAIT_S``, with a warning every
``LOCK_TIMEOUT_S``.

Permissions. The file is created with mode 0600 (only the creating user's instances share
it). To let the instances of several users share one GPU, set ``KVCORE_LEDGER_GROUP`` to a
group all of them belong to before the first instance starts: the ledger is then created
with mode 0660 and that group. Existing ledgers keep their mode.

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
only its usage fields. ``LedgerGate`` (``kvcore.budget.gate.MemoryGate``) is how a page
allocator uses all this.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import grp
import logging
import math
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.errors import (
    LedgerBusy,
    LedgerError,
    LedgerNotFound,
    RevisionConflict,
    UnknownInstance,
)

if TYPE_CHECKING:
    from kvcore.vmm.base import MemInfo, VmmBackend

log = logging.getLogger(__name__)

DIR_ENV = "KVCORE_LEDGER_DIR"
"""Environment variable naming the directory of ledger files (default ``/dev/shm``)."""
GROUP_ENV = "KVCORE_LEDGER_GROUP"
"""Environment variable naming a group: new ledgers are created 0660 with that group."""
DEFAULT_DIR = Path("/dev/shm")
FILE_PREFIX = "kvcore-gpu-"
FILE_SUFFIX = ".ledger"

MAGIC = b"KVCLEDGR"
LAYOUT_VERSION = 1
CAPACITY = 64
MAX_BYTES = 1 << 56
"""The largest size a ledger field holds (64 PiB): CAPACITY records of it still sum below
2**64, the width of the ledger's unsigned fields."""
"""Instance slots per GPU ledger."""
LOCK_TIMEOUT_S = 5.0
REGISTER_LOCK_WAIT_S = 120.0
"""An instance starting (opening the ledger, registering) waits this long for a held lock."""
GATE_LOCK_WAIT_S = 0.05
"""How long a serving instance's gate waits for the ledger lock on its hot path before it
treats the ledger as busy (``LedgerGate``): an allocation miss, a deferred release."""
SWEEP_INTERVAL_S = 1.0
"""A gate refused by the budget re-checks for dead instances at most this often."""
DEVICE_FREE_INTERVAL_S = 1.0
"""A gate with a ``mem_info`` source refreshes the header's device-free figure this often."""

_HEADER_SIZE = 256
_RECORD_SIZE = 384
_UUID_BYTES = 64
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:+/-]{0,62}$")


class _Layout:
    """Named little-endian fields at fixed offsets inside a fixed-size area."""

    def __init__(self, fields: list[tuple[str, str]], size: int) -> None:
        self.all = struct.Struct("<" + "".join(code for _, code in fields))
        self.names = [name for name, _ in fields]
        self.field: dict[str, tuple[int, struct.Struct]] = {}
        offset = 0
        for name, code in fields:
            one = struct.Struct("<" + code)
            self.field[name] = (offset, one)
            offset += one.size
        if offset > size:  # pragma: no cover - a layout edit that forgot the size
            raise AssertionError(f"layout needs {offset} bytes, has {size}")
        self.size = size

    def get(self, buf: mmap.mmap, base: int, name: str) -> int | float | bytes:
        offset, one = self.field[name]
        value: int | float | bytes = one.unpack_from(buf, base + offset)[0]
        return value

    def put(self, buf: mmap.mmap, base: int, name: str, value: int | float | bytes) -> None:
        offset, one = self.field[name]
        one.pack_into(buf, base + offset, value)

    def span(self, first: str, last: str) -> tuple[int, struct.Struct]:
        """Offset and struct of the consecutive fields ``first`` .. ``last`` (one
        ``unpack_from`` instead of one per field, for the gate's hot path)."""
        i, j = self.names.index(first), self.names.index(last)
        codes = "".join(self.field[n][1].format[1:] for n in self.names[i : j + 1])
        return self.field[first][0], struct.Struct("<" + codes)


_HEADER = _Layout(
    [
        ("magic", "8s"),
        ("version", "I"),
        ("header_size", "I"),
        ("record_size", "I"),
        ("capacity", "I"),
        ("created", "d"),
        ("device_total", "Q"),
        ("budget", "Q"),
        ("budget_revision", "Q"),
        ("total_mapped", "Q"),
        ("generation", "Q"),
        ("device_free", "Q"),
        ("device_free_time", "d"),
        ("device_uuid", f"{_UUID_BYTES}s"),
    ],
    _HEADER_SIZE,
)

_RECORD = _Layout(
    [
        ("state", "I"),
        ("pid", "i"),
        ("start_time", "Q"),
        ("pidns", "Q"),
        ("token", "Q"),
        ("device", "i"),
        ("flags", "I"),
        ("limit", "Q"),
        ("limit_revision", "Q"),
        ("mapped", "Q"),
        ("reserve", "Q"),
        ("denied", "Q"),
        ("trim_until", "d"),
        ("registered", "d"),
        ("updated", "d"),
        ("engine", "16s"),
        ("engine_version", "32s"),
        ("name", "64s"),
        ("model", "128s"),
    ],
    _RECORD_SIZE,
)

_FILE_SIZE = _HEADER_SIZE + CAPACITY * _RECORD_SIZE
_ID_OFF, _ID = _RECORD.span("state", "token")  # state, pid, start time, pidns, token
_REC_HOT_OFF, _REC_HOT = _RECORD.span("limit", "denied")
_HDR_HOT_OFF, _HDR_HOT = _HEADER.span("device_total", "total_mapped")
_HDR_TOTAL_OFF, _HDR_TOTAL = _HEADER.span("total_mapped", "generation")


class State(enum.IntEnum):
    """A record slot's stored state."""

    FREE = 0
    ACTIVE = 1


class Flag(enum.IntFlag):
    """Bits of a record's ``flags``."""

    NONE = 0
    OVER_LIMIT = 1
    """The limit was lowered below the instance's use; it gets no new memory until use
    falls under the limit (deferred lowering)."""


class Liveness(enum.Enum):
    """Whether the process behind a record still runs, as seen from this process."""

    LIVE = "live"
    STALE = "stale"
    UNKNOWN = "unknown"
    """Written from another pid namespace: cannot be judged here, never reclaimed here."""


@dataclass(frozen=True)
class InstanceRecord:
    """One instance's record as read from the ledger (a copy; it does not change)."""

    slot: int
    pid: int
    start_time: int
    pidns: int
    device: int
    engine: str
    engine_version: str
    name: str
    model: str
    limit: int
    """Bytes; 0 means no per-instance limit (only the GPU budget applies)."""
    limit_revision: int
    mapped: int
    reserve: int
    denied: int
    """How many ``try_acquire`` calls were refused (limit or budget)."""
    over_limit: bool
    trim_until: float
    registered: float
    updated: float
    liveness: Liveness = Liveness.LIVE

    @property
    def in_use(self) -> int:
        """Mapped bytes holding live blocks (mapped minus the idle reserve)."""
        return max(0, self.mapped - self.reserve)

    @property
    def trimming(self) -> bool:
        return self.trim_until > time.time()


@dataclass(frozen=True)
class LedgerSnapshot:
    """The whole ledger at one instant (read under one shared lock)."""

    path: Path
    device_uuid: str
    device_total: int
    budget_setting: int
    """The stored budget: 0 means "the device total"."""
    budget_revision: int
    total_mapped: int
    device_free: int
    """Device free bytes last reported by an instance (0 with ``device_free_time`` 0: never)."""
    device_free_time: float
    generation: int
    records: tuple[InstanceRecord, ...]

    @property
    def budget(self) -> int:
        """The effective GPU-wide budget in bytes."""
        return self.budget_setting or self.device_total

    def find(self, name: str) -> InstanceRecord | None:
        for rec in self.records:
            if rec.name == name:
                return rec
        return None


def ledger_dir() -> Path:
    """The directory holding ledger files: ``$KVCORE_LEDGER_DIR`` or ``/dev/shm``."""
    value = os.environ.get(DIR_ENV, "")
    return Path(value) if value else DEFAULT_DIR


def ledger_path(device_uuid: str, directory: Path | None = None) -> Path:
    """Where the ledger of ``device_uuid`` lives (whether or not it exists)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", device_uuid)
    return (directory or ledger_dir()) / f"{FILE_PREFIX}{safe}{FILE_SUFFIX}"


def list_ledgers(directory: Path | None = None) -> list[Path]:
    """Paths of the ledger files in ``directory`` (sorted; not validated)."""
    base = directory or ledger_dir()
    try:
        return sorted(base.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))
    except OSError:
        return []


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


def _encode(value: str, size: int, what: str) -> bytes:
    raw = value.encode()
    if len(raw) >= size:
        raise LedgerError(
            f"{what} {value!r} is {len(raw)} bytes; the ledger stores at most {size - 1}",
            hint=f"use a shorter {what}",
        )
    return raw


def _decode(raw: int | float | bytes) -> str:
    assert isinstance(raw, bytes)
    return raw.rstrip(b"\0").decode(errors="replace")


def _int(value: int | float | bytes) -> int:
    assert isinstance(value, int)
    return value


def _float(value: int | float | bytes) -> float:
    assert isinstance(value, float)
    return value


def _refuse(path: Path, what: str) -> LedgerError:
    return LedgerError(
        f"{path} is not a kvcore ledger this version can use: {what}",
        hint=(
            f"it was left untouched; if no kvcore instance runs on this GPU, remove it "
            f"(rm {path}) and restart, or set {DIR_ENV} to use another directory"
        ),
    )


class GpuLedger:
    """An open ledger file of one GPU. Thread-safe; one per process and GPU is enough.

    Open with ``GpuLedger.open``; ``close`` unmaps the file (records stay). Instances
    register through ``LedgerGate``; the control plane uses ``snapshot``,
    ``reclaim_stale``, ``set_limit``, ``set_budget`` and ``request_trim``.
    """

    def __init__(self, path: Path, fd: int, buf: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._buf = buf
        self._tlock = threading.Lock()
        self._pid = os.getpid()
        self._pidns = _pid_namespace()
        self.device_uuid = _decode(_HEADER.get(buf, 0, "device_uuid"))

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
            _create(path, device_uuid, device_total)
        return cls.open_path(path, expect_uuid=device_uuid, waiter="an instance opening it")

    @classmethod
    def open_path(
        cls, path: Path, *, expect_uuid: str | None = None, waiter: str | None = None
    ) -> GpuLedger:
        """Open an existing ledger file by path (``kvctl``, ``kvtop``). Raises as ``open``;
        ``waiter`` (an instance starting) waits for a held lock as ``_lock_patiently``."""
        try:
            # O_NONBLOCK: a FIFO planted at the path must not hang us (no effect on files)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise LedgerNotFound(
                f"no kvcore ledger at {path}",
                hint="a ledger is created when the first kvcore instance starts on the GPU "
                "(engine with elastic KV on); check KVCORE_LEDGER_DIR if you set it",
            ) from None
        except OSError as exc:
            raise LedgerError(
                f"cannot open the kvcore ledger {path}: {exc.strerror}",
                hint=f"run as the user that started the instances, or see {GROUP_ENV} "
                "in kvcore.budget.ledger to share a GPU between users",
            ) from None
        try:
            if waiter is None:
                _lock_fd(fd, fcntl.LOCK_SH, path)
            else:
                _lock_patiently(fd, fcntl.LOCK_SH, path, waiter)
            try:
                st = os.fstat(fd)
                size = st.st_size
                if not stat.S_ISREG(st.st_mode):
                    raise _refuse(path, "not a regular file")
                if st.st_mode & 0o002:
                    raise _refuse(path, "writable by every user (kvcore creates 0600 or 0660)")
                _check_owner(path, fd, st)
                if size < _HEADER_SIZE:
                    raise _refuse(path, f"{size} bytes, shorter than a ledger header")
                head = os.pread(fd, _HEADER_SIZE, 0)
                _check_header(path, head, size, expect_uuid)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            buf = mmap.mmap(fd, _FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
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

    @contextlib.contextmanager
    def _locked(self, exclusive: bool, waiter: str | None = None) -> Iterator[mmap.mmap]:
        """The file lock (``waiter``: an instance starting, which waits patiently and names
        itself in the warnings, ``_lock_patiently``) and the mapped buffer."""
        with self._tlock:
            self._check_usable()
            op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            if waiter is None:
                _lock_fd(self._fd, op, self.path)
            else:
                _lock_patiently(self._fd, op, self.path, waiter)
            try:
                self._check_size()
                yield self._buf
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _check_size(self) -> None:
        """Under the file lock: the file still covers the whole map. A file truncated under
        the map would make the next access a SIGBUS; this raises ``LedgerError`` first."""
        size = os.fstat(self._fd).st_size
        if size < _FILE_SIZE:
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
        judged after the lock is dropped (it reads ``/proc``)."""
        with self._locked(exclusive=False) as buf:
            h = {name: _HEADER.get(buf, 0, name) for name in _HEADER.names}
            records = [
                _read_record(buf, slot)
                for slot in range(CAPACITY)
                if _RECORD.get(buf, _base(slot), "state") != State.FREE
            ]
        return LedgerSnapshot(
            path=self.path,
            device_uuid=_decode(h["device_uuid"]),
            device_total=_int(h["device_total"]),
            budget_setting=_int(h["budget"]),
            budget_revision=_int(h["budget_revision"]),
            total_mapped=_int(h["total_mapped"]),
            device_free=_int(h["device_free"]),
            device_free_time=_float(h["device_free_time"]),
            generation=_int(h["generation"]),
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
        with self._locked(exclusive=True) as buf:
            return self._reclaim_locked(buf)

    def _reclaim_locked(self, buf: mmap.mmap) -> list[InstanceRecord]:
        reclaimed: list[InstanceRecord] = []
        total = 0
        for slot in range(CAPACITY):
            base = _base(slot)
            if _RECORD.get(buf, base, "state") == State.FREE:
                continue
            rec = _read_record(buf, slot)
            liveness = self._liveness(rec)
            if liveness is Liveness.STALE:
                buf[base : base + _RECORD_SIZE] = bytes(_RECORD_SIZE)
                reclaimed.append(replace(rec, liveness=liveness))
            else:
                total += rec.mapped
        if reclaimed or _HEADER.get(buf, 0, "total_mapped") != total:
            _HEADER.put(buf, 0, "total_mapped", total)
            _bump(buf)
        return reclaimed

    def set_limit(
        self, name: str, limit: int, *, if_revision: int | None = None
    ) -> tuple[InstanceRecord, InstanceRecord]:
        """Set instance ``name``'s limit to ``limit`` bytes (0: none); returns the record
        before and after. Lowering below current use is deferred by the instance's gate
        (no new memory until use falls), never an error. Raises ``UnknownInstance``
        (message lists the known names) and, when ``if_revision`` is given and is not the
        current limit revision, ``RevisionConflict`` (nothing changed)."""
        _check_bytes("limit", limit)
        with self._locked(exclusive=True) as buf:
            self._reclaim_locked(buf)
            before = self._find_locked(buf, name)
            if if_revision is not None and before.limit_revision != if_revision:
                raise RevisionConflict(
                    f"the limit of {name!r} is at revision {before.limit_revision} "
                    f"({_fmt_limit(before.limit)}), not {if_revision}",
                    hint="another writer changed it; re-read it (kvctl list) and retry",
                )
            base = _base(before.slot)
            _RECORD.put(buf, base, "limit", limit)
            _RECORD.put(buf, base, "limit_revision", before.limit_revision + 1)
            flags = Flag(_int(_RECORD.get(buf, base, "flags")))
            if limit and before.mapped > limit:
                flags |= Flag.OVER_LIMIT
            else:
                flags &= ~Flag.OVER_LIMIT
            _RECORD.put(buf, base, "flags", int(flags))
            _bump(buf)
            after = _read_record(buf, before.slot)
        return before, after

    def set_budget(self, budget: int, *, if_revision: int | None = None) -> int:
        """Set the GPU-wide budget in bytes (0: the device total); returns the new budget
        revision. Lowering below current use is deferred like a limit. Raises
        ``RevisionConflict`` when ``if_revision`` is given and stale."""
        _check_bytes("budget", budget)
        with self._locked(exclusive=True) as buf:
            rev = _int(_HEADER.get(buf, 0, "budget_revision"))
            if if_revision is not None and rev != if_revision:
                raise RevisionConflict(
                    f"the GPU budget is at revision {rev}, not {if_revision}",
                    hint="another writer changed it; re-read it (kvctl list) and retry",
                )
            _HEADER.put(buf, 0, "budget", budget)
            _HEADER.put(buf, 0, "budget_revision", rev + 1)
            _bump(buf)
        return rev + 1

    def request_trim(self, name: str, hold_s: float) -> InstanceRecord:
        """Ask instance ``name`` to drop its whole reserve and keep none for ``hold_s``
        seconds (``math.inf``: until the next trim request says otherwise). Its gate's
        ``reserve_target`` returns 0 meanwhile. Raises ``UnknownInstance``."""
        with self._locked(exclusive=True) as buf:
            self._reclaim_locked(buf)
            rec = self._find_locked(buf, name)
            until = math.inf if math.isinf(hold_s) else time.time() + max(0.0, hold_s)
            _RECORD.put(buf, _base(rec.slot), "trim_until", until)
            _bump(buf)
            return _read_record(buf, rec.slot)

    def _find_locked(self, buf: mmap.mmap, name: str) -> InstanceRecord:
        known: list[str] = []
        for slot in range(CAPACITY):
            if _RECORD.get(buf, _base(slot), "state") == State.FREE:
                continue
            rec = _read_record(buf, slot)
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
        with self._locked(exclusive=True) as buf:
            _HEADER.put(buf, 0, "device_free", max(0, free))
            _HEADER.put(buf, 0, "device_free_time", time.time())

    # -- instance side (used by LedgerGate) ----------------------------------------------

    def _register(
        self,
        *,
        name: str,
        engine: str,
        engine_version: str,
        model: str,
        device: int,
        limit: int,
    ) -> tuple[int, int]:
        _check_bytes("limit", limit)
        if not _NAME_RE.match(name):
            raise LedgerError(
                f"instance name {name!r} is not usable",
                hint="use 1-63 characters: letters, digits and . _ @ : + / - "
                "(starting with a letter or digit)",
            )
        encoded = {
            "engine": _encode(engine, 16, "engine"),
            "engine_version": _encode(engine_version, 32, "engine version"),
            "name": _encode(name, 64, "instance name"),
            "model": _encode(model, 128, "model"),
        }
        pid = os.getpid()
        start = process_start_time(pid)
        assert start is not None
        token = secrets.randbits(63) | 1
        with self._locked(exclusive=True, waiter=f"registering {name!r}") as buf:
            self._reclaim_locked(buf)
            free_slot = None
            for slot in range(CAPACITY):
                base = _base(slot)
                if _RECORD.get(buf, base, "state") == State.FREE:
                    free_slot = free_slot if free_slot is not None else slot
                elif _decode(_RECORD.get(buf, base, "name")) == name:
                    other = _int(_RECORD.get(buf, base, "pid"))
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
            base = _base(free_slot)
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
                **encoded,
            }
            buf[base : base + _RECORD_SIZE] = bytes(_RECORD_SIZE)
            _RECORD.all.pack_into(buf, base, *(values[n] for n in _RECORD.names))
            _bump(buf)
        return free_slot, token

    @contextlib.contextmanager
    def _own(self, slot: int, token: int, exclusive: bool = True) -> Iterator[mmap.mmap]:
        with self._locked(exclusive) as buf:
            base = _base(slot)
            if (
                _RECORD.get(buf, base, "state") != State.ACTIVE
                or _RECORD.get(buf, base, "token") != token
            ):
                raise LedgerError(
                    f"this instance's record (slot {slot}) in {self.path} was removed by "
                    "another process",
                    hint="the ledger thought this process dead (another pid namespace, or "
                    "the file was replaced); restart the instance",
                )
            yield buf


def _base(slot: int) -> int:
    return _HEADER_SIZE + slot * _RECORD_SIZE


def _bump(buf: mmap.mmap) -> None:
    _HEADER.put(buf, 0, "generation", _int(_HEADER.get(buf, 0, "generation")) + 1)


def _read_record(buf: mmap.mmap, slot: int) -> InstanceRecord:
    v = dict(zip(_RECORD.names, _RECORD.all.unpack_from(buf, _base(slot)), strict=True))
    if v["state"] not in (State.FREE, State.ACTIVE):
        raise LedgerError(
            f"record {slot} of the ledger has an unknown state {v['state']}: the file is corrupt",
            hint="if no kvcore instance runs on this GPU, remove the ledger file and restart",
        )
    return InstanceRecord(
        slot=slot,
        pid=v["pid"],
        start_time=v["start_time"],
        pidns=v["pidns"],
        device=v["device"],
        engine=_decode(v["engine"]),
        engine_version=_decode(v["engine_version"]),
        name=_decode(v["name"]),
        model=_decode(v["model"]),
        limit=v["limit"],
        limit_revision=v["limit_revision"],
        mapped=v["mapped"],
        reserve=v["reserve"],
        denied=v["denied"],
        over_limit=bool(v["flags"] & Flag.OVER_LIMIT),
        trim_until=v["trim_until"],
        registered=v["registered"],
        updated=v["updated"],
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


def _lock_fd(fd: int, op: int, path: Path, timeout: float | None = None) -> None:
    """``flock`` with a deadline: a holder stuck for ``timeout`` seconds (default
    ``LOCK_TIMEOUT_S``) raises ``LedgerBusy``."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    wait = LOCK_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + wait
    delay = 0.0001
    while True:
        time.sleep(delay)
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise LedgerBusy(
                    f"the ledger {path} stayed locked for {wait:g} s",
                    hint="a process holding it is stuck or stopped; find it with "
                    f"`fuser {path}` (or lslocks)",
                ) from None
            delay = min(delay * 2, 0.005)


def _lock_patiently(fd: int, op: int, path: Path, waiter: str) -> None:
    """``_lock_fd`` for an instance starting (``waiter`` names it): a lock held by a stopped
    ``kvctl`` or process is waited for up to ``REGISTER_LOCK_WAIT_S``, with a warning every
    ``LOCK_TIMEOUT_S``, and only then ``LedgerBusy`` is raised."""
    deadline = time.monotonic() + REGISTER_LOCK_WAIT_S
    while True:
        wait = min(LOCK_TIMEOUT_S, max(deadline - time.monotonic(), 0.0))
        try:
            _lock_fd(fd, op, path, timeout=wait)
            return
        except LedgerBusy as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("kvcore: %s waits for the ledger lock: %s", waiter, exc)


def _check_header(path: Path, head: bytes, size: int, expect_uuid: str | None) -> None:
    magic, version, header_size, record_size, capacity = struct.unpack_from("<8sIIII", head)
    if magic != MAGIC:
        raise _refuse(path, f"unknown magic {magic!r} (a foreign file)")
    if version != LAYOUT_VERSION:
        raise _refuse(path, f"layout version {version}; this kvcore reads version {LAYOUT_VERSION}")
    if (header_size, record_size, capacity) != (_HEADER_SIZE, _RECORD_SIZE, CAPACITY):
        raise _refuse(path, f"sizes {header_size}/{record_size}/{capacity} do not match")
    if size != _FILE_SIZE:
        raise _refuse(path, f"{size} bytes instead of {_FILE_SIZE} (truncated or grown)")
    offset, one = _HEADER.field["device_uuid"]
    stored = one.unpack_from(head, offset)[0].rstrip(b"\0").decode(errors="replace")
    if expect_uuid is not None and stored != expect_uuid:
        raise _refuse(path, f"it belongs to device {stored!r}, not {expect_uuid!r}")


def _check_owner(path: Path, fd: int, st: os.stat_result) -> None:
    """Refuse a ledger another user owns, unless ``KVCORE_LEDGER_GROUP`` names the group the
    file belongs to (sharing a GPU between users); refuse one with an access ACL (its
    mode bits then do not say who may write it)."""
    if st.st_uid != os.geteuid():
        group = os.environ.get(GROUP_ENV, "")
        try:
            shared = bool(group) and grp.getgrnam(group).gr_gid == st.st_gid
        except KeyError:
            shared = False
        if not shared:
            raise _refuse(
                path,
                f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); anyone "
                f"could have created it first (to share a GPU between users, set {GROUP_ENV} "
                "to the ledger's group)",
            )
    try:
        os.getxattr(fd, "system.posix_acl_access")
    except OSError:  # no ACL (ENODATA), or a file system without them
        return
    raise _refuse(path, "it carries an access ACL (kvcore ledgers rely on their mode bits)")


def _create(path: Path, device_uuid: str, device_total: int) -> None:
    """Write a complete new ledger beside ``path`` and publish it atomically with
    ``link(2)``; losing the race to another creator is fine (theirs is used)."""
    uuid_raw = _encode(device_uuid, _UUID_BYTES, "device uuid")
    group = os.environ.get(GROUP_ENV, "")
    mode = 0o660 if group else 0o600
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise LedgerError(
            f"cannot create a kvcore ledger in {path.parent}: {exc.strerror}",
            hint=f"make {path.parent} writable or set {DIR_ENV} to a writable directory",
        ) from None
    try:
        if group:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise LedgerError(
                    f"{GROUP_ENV}={group!r} names no group on this machine",
                    hint="set it to an existing group (see `getent group`) or unset it",
                ) from None
            try:
                os.fchown(fd, -1, gid)
            except OSError as exc:
                raise LedgerError(
                    f"cannot give the new ledger to group {group!r}: {exc.strerror}",
                    hint=f"run as a member of {group!r} or unset {GROUP_ENV}",
                ) from None
        os.fchmod(fd, mode)  # exact mode whatever the umask
        head = bytearray(_HEADER_SIZE)
        values: dict[str, int | float | bytes] = {
            "magic": MAGIC,
            "version": LAYOUT_VERSION,
            "header_size": _HEADER_SIZE,
            "record_size": _RECORD_SIZE,
            "capacity": CAPACITY,
            "created": time.time(),
            "device_total": device_total,
            "budget": 0,
            "budget_revision": 1,
            "total_mapped": 0,
            "generation": 1,
            "device_free": 0,
            "device_free_time": 0.0,
            "device_uuid": uuid_raw,
        }
        _HEADER.all.pack_into(head, 0, *(values[n] for n in _HEADER.names))
        os.write(fd, bytes(head) + bytes(_FILE_SIZE - _HEADER_SIZE))
        os.fsync(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise LedgerError(
                    f"cannot publish the kvcore ledger {path}: {exc.strerror}",
                    hint=f"check {path.parent} is writable",
                ) from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class LedgerGate:
    """``kvcore.budget.gate.MemoryGate`` backed by the per-GPU ledger: registers this
    instance (a record in the GPU's ledger) and admits memory within its limit and the
    GPU budget minus what the other instances hold.

    * ``try_acquire(n)`` claims ``n`` bytes when ``mapped + n <= limit`` (if a limit is
      set) and ``total + n <= budget``; otherwise ``False`` (an allocation miss). When the
      budget refuses, dead instances are reclaimed (at most once per
      ``SWEEP_INTERVAL_S``) and the check repeated once.
    * A limit lowered below use (``kvctl limit``) refuses new memory until use falls
      under it; ``reserve_target`` shrinks the reserve first. Never an error.
    * ``reserve_target(wanted)`` is 0 while a trim is requested (``kvctl trim``).
    * ``close`` removes the record (also done for it by the stale sweep if the process
      dies). Every method raises ``LedgerError`` if the record was removed under it.
    * Lock contention is never an error here: when another process holds the ledger's lock
      for longer than ``GATE_LOCK_WAIT_S`` (a slow ``kvctl``, a stopped process),
      ``try_acquire`` is a miss, ``release`` is deferred (the record keeps the bytes, which
      overstates this instance to the others, never the reverse, until the next call that
      gets the lock applies it), ``report_reserve`` is skipped, ``reserve_target`` keeps
      the reserve and ``headroom`` promises nothing.
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
        mem_info: Callable[[], MemInfo] | None = None,
        on_change: Callable[[InstanceRecord], None] | None = None,
    ) -> None:
        """Register instance ``name`` in ``ledger``. ``limit`` is bytes (0: none);
        ``mem_info`` (the backend's) lets the gate publish the device's free memory;
        ``on_change`` is called with a fresh record after each change (metrics), and
        once more at ``close`` with nothing mapped.
        Raises ``LedgerError`` if the name is taken by a live instance or the ledger is
        full."""
        self.ledger = ledger
        self.name = name
        self._slot, self._token = ledger._register(
            name=name,
            engine=engine,
            engine_version=engine_version,
            model=model,
            device=device,
            limit=limit,
        )
        self._base = _base(self._slot)
        self._mem_info = mem_info
        self._on_change = on_change
        self._last_sweep = 0.0
        self._last_free = 0.0
        self._owns_ledger = False
        self._pending_release = 0  # bytes released while the ledger was busy
        self._last_busy_log = 0.0
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
        on_change: Callable[[InstanceRecord], None] | None = None,
        directory: Path | None = None,
    ) -> LedgerGate:
        """Open (or create, sized by ``backend.mem_info().total``) the ledger of
        ``backend``'s device and register there; the gate publishes the device's free
        memory from ``backend.mem_info`` and closes the ledger with itself. Arguments as
        for the constructor; ``directory`` overrides ``ledger_dir()``. Raises as both."""
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
                mem_info=backend.mem_info,
                on_change=on_change,
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
        if nbytes < 0:
            raise LedgerError(f"try_acquire({nbytes}): negative size", hint="a caller bug")
        if nbytes > MAX_BYTES:
            return False  # more than any device: refused like any request beyond the budget
        try:
            self._maybe_note_free()
            ok, budget_refused = self._try_acquire_once(nbytes)
            if ok or not budget_refused:
                return ok
            now = time.monotonic()
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
        """(admitted, refused by the budget rather than the limit)."""
        base = self._base
        buf = self._enter(exclusive=True)
        try:
            mapped, _, limit, total, budget, denied = self._figures(buf)
            if (limit and mapped + nbytes > limit) or total + nbytes > budget:
                _RECORD.put(buf, base, "denied", denied + 1)
                if limit and mapped > limit:
                    _RECORD.put(buf, base, "flags", int(Flag.OVER_LIMIT))
                return False, not (limit and mapped + nbytes > limit)
            _RECORD.put(buf, base, "mapped", mapped + nbytes)
            _RECORD.put(buf, base, "updated", time.time())
            _RECORD.put(buf, base, "flags", 0)
            _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, total + nbytes, self._generation(buf))
            rec = _read_record(buf, self._slot) if self._on_change else None
        finally:
            self._leave()
        if rec is not None and self._on_change is not None:
            self._on_change(rec)
        return True, False

    def release(self, nbytes: int) -> None:
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
            _RECORD.put(buf, base, "mapped", now_mapped)
            if reserve > now_mapped:
                _RECORD.put(buf, base, "reserve", now_mapped)
            _RECORD.put(buf, base, "updated", time.time())
            if not limit or now_mapped <= limit:
                _RECORD.put(buf, base, "flags", 0)
            _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, max(0, total - nbytes), self._generation(buf))
            rec = _read_record(buf, self._slot) if self._on_change else None
        finally:
            self._leave()
        if rec is not None and self._on_change is not None:
            self._on_change(rec)

    def report_reserve(self, nbytes: int) -> None:
        try:
            buf = self._enter(exclusive=True)
        except LedgerBusy:
            return  # informational: the next report catches up
        base = self._base
        try:
            mapped, _, _, total, _, _ = self._figures(buf)
            _RECORD.put(buf, base, "reserve", max(0, min(nbytes, mapped)))
            _RECORD.put(buf, base, "updated", time.time())
            _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, total, self._generation(buf))
            rec = _read_record(buf, self._slot) if self._on_change else None
        finally:
            self._leave()
        if rec is not None and self._on_change is not None:
            self._on_change(rec)

    def reserve_target(self, wanted: int) -> int:
        try:
            buf = self._enter(exclusive=False)
        except LedgerBusy:
            return wanted  # keep the reserve (it is charged already) until the ledger frees
        try:
            if _float(_RECORD.get(buf, self._base, "trim_until")) > time.time():
                return 0
            mapped, reserve, limit, total, budget, _ = self._figures(buf)
        finally:
            self._leave()
        in_use = max(0, mapped - reserve)
        room = budget - (total - mapped) - in_use
        if limit:
            room = min(room, limit - in_use)
        return max(0, min(wanted, room))

    def headroom(self) -> int:
        """Bytes ``try_acquire`` would admit now (the instance limit and the GPU budget
        minus what every instance holds); 0 while over either. Beyond the ``MemoryGate``
        protocol: ``PageAllocator.available()`` uses it."""
        try:
            buf = self._enter(exclusive=False)
        except LedgerBusy:
            return 0  # promise no room the ledger cannot confirm
        try:
            mapped, _, limit, total, budget, _ = self._figures(buf)
        finally:
            self._leave()
        room = budget - total
        if limit:
            room = min(room, limit - mapped)
        return max(0, room)

    # -- the hot path: no context managers, one unpack for the record, one for the header --

    def _enter(self, *, exclusive: bool) -> mmap.mmap:
        """Take the thread lock and the file lock (waiting ``GATE_LOCK_WAIT_S`` at most:
        ``LedgerBusy``) and check the record is still ours; exclusive, apply a release
        deferred while the ledger was busy. The caller must call ``_leave`` (in a
        ``finally``) once this returned."""
        led = self.ledger
        led._tlock.acquire()
        try:
            led._check_usable()
            op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            _lock_fd(led._fd, op, led.path, timeout=GATE_LOCK_WAIT_S)
        except BaseException:
            led._tlock.release()
            raise
        try:
            led._check_size()  # a truncated file would SIGBUS on the read below
        except LedgerError:
            self._leave()
            raise
        state, _, _, _, token = _ID.unpack_from(led._buf, self._base + _ID_OFF)
        if state != State.ACTIVE or token != self._token:
            self._leave()
            raise LedgerError(
                f"this instance's record (slot {self._slot}) in {led.path} was removed by "
                "another process",
                hint="the ledger thought this process dead (another pid namespace, or "
                "the file was replaced); restart the instance",
            )
        if exclusive and self._pending_release:
            self._apply_pending_release(led._buf)
        return led._buf

    def _apply_pending_release(self, buf: mmap.mmap) -> None:
        """Write the releases deferred while the ledger was busy. Caller holds the
        exclusive lock."""
        mapped, reserve, _, total, _, _ = self._figures(buf)
        nbytes = min(self._pending_release, mapped)
        self._pending_release = 0
        _RECORD.put(buf, self._base, "mapped", mapped - nbytes)
        if reserve > mapped - nbytes:
            _RECORD.put(buf, self._base, "reserve", mapped - nbytes)
        _HDR_TOTAL.pack_into(buf, _HDR_TOTAL_OFF, max(0, total - nbytes), self._generation(buf))

    def _note_busy(self, what: str, exc: LedgerBusy) -> None:
        now = time.monotonic()
        if now - self._last_busy_log >= 10.0:  # a stuck holder: say so, not on every call
            self._last_busy_log = now
            log.warning("kvcore: %s: %s", what, exc)  # str(exc) carries the hint

    def _leave(self) -> None:
        fcntl.flock(self.ledger._fd, fcntl.LOCK_UN)
        self.ledger._tlock.release()

    def _figures(self, buf: mmap.mmap) -> tuple[int, int, int, int, int, int]:
        """(mapped, reserve, limit, GPU total, effective budget, denied), under the lock."""
        limit, _, mapped, reserve, denied = _REC_HOT.unpack_from(buf, self._base + _REC_HOT_OFF)
        device_total, budget, _, total = _HDR_HOT.unpack_from(buf, _HDR_HOT_OFF)
        return mapped, reserve, limit, total, budget or device_total, denied

    @staticmethod
    def _generation(buf: mmap.mmap) -> int:
        return _int(_HEADER.get(buf, 0, "generation")) + 1

    # -- the rest ------------------------------------------------------------------------

    def record(self) -> InstanceRecord:
        """This instance's record now."""
        with self.ledger._own(self._slot, self._token, exclusive=False) as buf:
            return _read_record(buf, self._slot)

    def close(self) -> None:
        """Remove this instance's record (its bytes leave the GPU total); close the ledger
        if ``from_backend`` opened it. Idempotent; tolerates a record already reclaimed."""
        if self._closed:
            return
        self._closed = True
        last = None
        with contextlib.suppress(LedgerError), self.ledger._own(self._slot, self._token) as buf:
            base = _base(self._slot)
            last = _read_record(buf, self._slot)
            total = _int(_HEADER.get(buf, 0, "total_mapped"))
            _HEADER.put(buf, 0, "total_mapped", max(0, total - last.mapped))
            buf[base : base + _RECORD_SIZE] = bytes(_RECORD_SIZE)
            _bump(buf)
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
        now = time.monotonic()
        if now - self._last_free < DEVICE_FREE_INTERVAL_S:
            return
        self._last_free = now
        self.ledger.note_device_free(self._mem_info().free)
