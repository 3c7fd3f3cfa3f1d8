"""The per-GPU ledger file: where it lives, its layout, how it is created, validated, opened
and locked. The lowest layer of the ledger: ``kvcore.budget.ledger`` (``GpuLedger``, the
admin and registration API) and ``kvcore.budget.ledger_gate`` (``LedgerGate``) build on it.

Several engine instances on one GPU must see one truth about who holds what. Each GPU has
one ledger file, ``<dir>/kvcore-gpu-<device uuid>.ledger``, keyed by the backend's
``device_uuid()``. ``<dir>`` is ``/dev/shm`` (shared memory: gone on reboot, like the
memory it describes) unless ``KVCORE_LEDGER_DIR`` names another directory (tests).

File layout (little-endian, fixed size, version ``LAYOUT_VERSION``)::

    header (256 bytes)  magic "KVCLEDGR", layout version, header/record size, capacity,
                        device uuid and total bytes, GPU-wide budget + its revision,
                        sum of mapped bytes, change generation, last seen device free bytes,
                        the latest time until which an instance below its share waits
    records (64 x 384)  one slot per instance: state, pid + process start time + pid
                        namespace, a random token, engine + version, instance name, model,
                        device ordinal, limit + limit revision, mapped bytes, reserve bytes,
                        trim deadline, refusal count, registration and last update times,
                        share (0: an equal share of the budget), until when it waits
                        and how many bytes it still asks for

Invariants every writer keeps (under the exclusive lock): the header's ``total_mapped`` is
the sum of the active records' ``mapped``; every change a reader may care about bumps
``generation``; a free slot is all zero bytes.

A file whose magic, version, sizes or device uuid do not match, or that is not a regular
file, or that every user may write (anyone could have planted it), is refused with
``LedgerError`` and never written to. A new ledger is written completely to a temporary
file and published with ``link(2)``, so the path never holds a half-made ledger.

Locking. Every access holds ``flock(2)`` on the ledger file: exclusive to write, shared to
read, so a reader never sees a torn record (the critical sections are a few struct reads
and writes). ``lock_fd`` waits for a held lock ``LOCK_TIMEOUT_S`` at most, then raises
``LedgerBusy`` (a ``LedgerError``) instead of hanging the caller (a stopped process may
hold it); ``lock_patiently``, for an instance starting, waits up to
``REGISTER_LOCK_WAIT_S`` with a warning every ``LOCK_TIMEOUT_S``.

Permissions. The file is created with mode 0600 (only the creating user's instances share
it). To let the instances of several users share one GPU, set ``KVCORE_LEDGER_GROUP`` to a
group all of them belong to before the first instance starts: the ledger is then created
with mode 0660 and that group. Existing ledgers keep their mode.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import grp
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from kvcore.errors import LedgerBusy, LedgerError, LedgerNotFound

log = logging.getLogger(__name__)

DIR_ENV = "KVCORE_LEDGER_DIR"
"""Environment variable naming the directory of ledger files (default ``/dev/shm``)."""
GROUP_ENV = "KVCORE_LEDGER_GROUP"
"""Environment variable naming a group: new ledgers are created 0660 with that group."""
DEFAULT_DIR = Path("/dev/shm")
FILE_PREFIX = "kvcore-gpu-"
FILE_SUFFIX = ".ledger"

MAGIC = b"KVCLEDGR"
LAYOUT_VERSION = 3
"""1: no shares. 2: records carry ``share`` and ``wanted_until``, the header
``wanted_until`` (``kvcore.budget.shares``). 3: records carry ``wanted_bytes``."""
CAPACITY = 64
"""Instance slots per GPU ledger."""
MAX_BYTES = 1 << 56
"""The largest size a ledger field holds (64 PiB): CAPACITY records of it still sum below
2**64, the width of the ledger's unsigned fields."""
LOCK_TIMEOUT_S = 5.0
"""How long ``lock_fd`` waits for a held lock (by default) before ``LedgerBusy``."""
REGISTER_LOCK_WAIT_S = 120.0
"""An instance starting (opening the ledger, registering) waits this long for a held lock."""

_HEADER_SIZE = 256
_RECORD_SIZE = 384
_UUID_BYTES = 64
FILE_SIZE = _HEADER_SIZE + CAPACITY * _RECORD_SIZE
"""The exact size of a ledger file of this layout."""


class Layout:
    """Named little-endian fields at fixed offsets inside a fixed-size area (the header,
    or one record). Accessors read and write a mapped ledger in place; the caller holds
    the file lock (shared to read, exclusive to write)."""

    def __init__(self, fields: list[tuple[str, str]], size: int) -> None:
        self.all = struct.Struct("<" + "".join(code for _, code in fields))
        """All fields in order: ``all.unpack_from(buf, base)`` reads a whole area."""
        self.names = [name for name, _ in fields]
        self.field: dict[str, tuple[int, struct.Struct]] = {}
        """Offset inside the area and struct of each field."""
        offset = 0
        for name, code in fields:
            one = struct.Struct("<" + code)
            self.field[name] = (offset, one)
            offset += one.size
        if offset > size:  # pragma: no cover - a layout edit that forgot the size
            raise AssertionError(f"layout needs {offset} bytes, has {size}")
        self.size = size

    def get(self, buf: mmap.mmap, base: int, name: str) -> int | float | bytes:
        """Field ``name`` of the area starting at ``base``."""
        offset, one = self.field[name]
        value: int | float | bytes = one.unpack_from(buf, base + offset)[0]
        return value

    def get_int(self, buf: mmap.mmap, base: int, name: str) -> int:
        """An integer field (``get``, typed)."""
        value = self.get(buf, base, name)
        assert isinstance(value, int)
        return value

    def get_float(self, buf: mmap.mmap, base: int, name: str) -> float:
        """A floating-point field (``get``, typed)."""
        value = self.get(buf, base, name)
        assert isinstance(value, float)
        return value

    def get_text(self, buf: mmap.mmap, base: int, name: str) -> str:
        """A text field, decoded (undecodable bytes replaced)."""
        return _decode(self.get(buf, base, name))

    def put(self, buf: mmap.mmap, base: int, name: str, value: int | float | bytes) -> None:
        """Write field ``name`` of the area starting at ``base``."""
        offset, one = self.field[name]
        one.pack_into(buf, base + offset, value)

    def span(self, first: str, last: str) -> tuple[int, struct.Struct]:
        """Offset and struct of the consecutive fields ``first`` .. ``last``: one
        ``unpack_from`` instead of one per field, for a hot path."""
        i, j = self.names.index(first), self.names.index(last)
        codes = "".join(self.field[n][1].format[1:] for n in self.names[i : j + 1])
        return self.field[first][0], struct.Struct("<" + codes)


HEADER = Layout(
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
        ("wanted_until", "d"),
    ],
    _HEADER_SIZE,
)
"""The header's fields (at offset 0 of the file)."""

RECORD = Layout(
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
        ("share", "Q"),
        ("wanted_until", "d"),
        ("wanted_bytes", "Q"),
    ],
    _RECORD_SIZE,
)
"""A record's fields (at ``record_offset(slot)``)."""


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
    YIELDING = 2
    """The instance holds more than its share while another one below its share waits:
    it gets no new memory beyond its share until the other stops waiting
    (``kvcore.budget.shares``)."""


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
    share: int = 0
    """Bytes guaranteed to this instance while others borrow (``kvctl share``); 0 means an
    equal share of the GPU budget (``kvcore.budget.shares``)."""
    wanted_until: float = 0.0
    """Wall-clock time until which the instance counts as waiting for memory below its
    share (0: never waited)."""
    wanted_bytes: int = 0
    """While it waits: the largest refusal since its mark went live, at most what takes it
    to its share (what preempting borrowers give back for it, ``kvcore.budget.shares``)."""
    yielding: bool = False
    """Refused memory beyond its share at its last request because another instance waits."""
    liveness: Liveness = Liveness.LIVE

    @property
    def in_use(self) -> int:
        """Mapped bytes holding live blocks (mapped minus the idle reserve)."""
        return max(0, self.mapped - self.reserve)

    @property
    def trimming(self) -> bool:
        """A trim request still holds the instance's reserve at zero."""
        return self.trim_until > time.time()

    @property
    def waiting(self) -> bool:
        """The instance asked for memory below its share within the last
        ``kvcore.budget.shares.WANT_HOLD_S`` and was refused by the budget."""
        return self.wanted_until > time.time()


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
        """The record of instance ``name``, or ``None``."""
        for rec in self.records:
            if rec.name == name:
                return rec
        return None


# -- where ledgers live ----------------------------------------------------------------


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


# -- records in a mapped ledger (the caller holds the file lock) ---------------------------


def record_offset(slot: int) -> int:
    """Byte offset of record ``slot`` in the file (the ``base`` of ``RECORD``'s accessors)."""
    return _HEADER_SIZE + slot * _RECORD_SIZE


def read_record(buf: mmap.mmap, slot: int) -> InstanceRecord:
    """Record ``slot`` as an ``InstanceRecord`` (liveness not judged: ``LIVE``). Raises
    ``LedgerError`` for a state no kvcore writes (a corrupt file)."""
    v = dict(zip(RECORD.names, RECORD.all.unpack_from(buf, record_offset(slot)), strict=True))
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
        share=v["share"],
        wanted_until=v["wanted_until"],
        wanted_bytes=v["wanted_bytes"],
        yielding=bool(v["flags"] & Flag.YIELDING),
    )


def is_free(buf: mmap.mmap, slot: int) -> bool:
    """Whether record ``slot`` is a free slot."""
    return RECORD.get(buf, record_offset(slot), "state") == State.FREE


def clear_record(buf: mmap.mmap, slot: int) -> None:
    """Make record ``slot`` a free slot (all zero bytes). The caller keeps the header's
    ``total_mapped`` right and bumps the generation."""
    base = record_offset(slot)
    buf[base : base + _RECORD_SIZE] = bytes(_RECORD_SIZE)


def bump_generation(buf: mmap.mmap) -> None:
    """Count one change in the header's ``generation``."""
    HEADER.put(buf, 0, "generation", HEADER.get_int(buf, 0, "generation") + 1)


def encode_text(value: str, size: int, what: str) -> bytes:
    """``value`` encoded for a text field of ``size`` bytes (NUL-padded, so at most
    ``size - 1`` bytes of text). Raises ``LedgerError`` naming ``what`` when it is longer."""
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


# -- locking -------------------------------------------------------------------------------


def lock_fd(fd: int, op: int, path: Path, timeout: float | None = None) -> None:
    """``flock(fd, op)`` with a deadline: a holder stuck for ``timeout`` seconds (default
    ``LOCK_TIMEOUT_S``) raises ``LedgerBusy`` naming ``path``."""
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


def lock_patiently(fd: int, op: int, path: Path, waiter: str) -> None:
    """``lock_fd`` for an instance starting (``waiter`` names it): a lock held by a stopped
    ``kvctl`` or process is waited for up to ``REGISTER_LOCK_WAIT_S``, with a warning every
    ``LOCK_TIMEOUT_S``, and only then ``LedgerBusy`` is raised."""
    deadline = time.monotonic() + REGISTER_LOCK_WAIT_S
    while True:
        wait = min(LOCK_TIMEOUT_S, max(deadline - time.monotonic(), 0.0))
        try:
            lock_fd(fd, op, path, timeout=wait)
            return
        except LedgerBusy as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("kvcore: %s waits for the ledger lock: %s", waiter, exc)


# -- opening and creating ------------------------------------------------------------------


def open_mapped(
    path: Path, *, expect_uuid: str | None = None, waiter: str | None = None
) -> tuple[int, mmap.mmap]:
    """Open, validate and map the ledger file at ``path``; returns its descriptor and the
    shared read-write map of the whole file (the caller closes both). ``expect_uuid``:
    refuse a ledger of another device; ``waiter`` (an instance starting) waits for a held
    lock as ``lock_patiently``. Raises ``LedgerNotFound`` when there is no file,
    ``LedgerError`` when it is foreign, of another layout or device, not a regular file,
    writable by everyone, owned by another user (see ``GROUP_ENV``), carries an ACL, or
    cannot be opened; ``LedgerBusy`` when its lock stays held."""
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
            "in kvcore.budget.ledger_file to share a GPU between users",
        ) from None
    try:
        if waiter is None:
            lock_fd(fd, fcntl.LOCK_SH, path)
        else:
            lock_patiently(fd, fcntl.LOCK_SH, path, waiter)
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
        buf = mmap.mmap(fd, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, buf


def create(path: Path, device_uuid: str, device_total: int) -> None:
    """Write a complete new ledger of ``device_uuid`` (``device_total`` bytes) beside
    ``path`` and publish it atomically with ``link(2)``; losing the race to another creator
    is fine (theirs is used). Raises ``LedgerError`` when the directory is not writable, the
    uuid is too long, or ``GROUP_ENV`` names no group or one this user cannot give it to."""
    uuid_raw = encode_text(device_uuid, _UUID_BYTES, "device uuid")
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
            "wanted_until": 0.0,
        }
        HEADER.all.pack_into(head, 0, *(values[n] for n in HEADER.names))
        os.write(fd, bytes(head) + bytes(FILE_SIZE - _HEADER_SIZE))
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


def _refuse(path: Path, what: str) -> LedgerError:
    return LedgerError(
        f"{path} is not a kvcore ledger this version can use: {what}",
        hint=(
            f"it was left untouched; if no kvcore instance runs on this GPU, remove it "
            f"(rm {path}) and restart, or set {DIR_ENV} to use another directory"
        ),
    )


def _check_header(path: Path, head: bytes, size: int, expect_uuid: str | None) -> None:
    magic, version, header_size, record_size, capacity = struct.unpack_from("<8sIIII", head)
    if magic != MAGIC:
        raise _refuse(path, f"unknown magic {magic!r} (a foreign file)")
    if version != LAYOUT_VERSION:
        raise _refuse(path, f"layout version {version}; this kvcore reads version {LAYOUT_VERSION}")
    if (header_size, record_size, capacity) != (_HEADER_SIZE, _RECORD_SIZE, CAPACITY):
        raise _refuse(path, f"sizes {header_size}/{record_size}/{capacity} do not match")
    if size != FILE_SIZE:
        raise _refuse(path, f"{size} bytes instead of {FILE_SIZE} (truncated or grown)")
    offset, one = HEADER.field["device_uuid"]
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
