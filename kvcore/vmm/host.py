"""The ``host`` backend: real virtual-memory management on Linux CPU memory.

It mirrors the CUDA driver's VMM with the kernel's own primitives, so every layer above it
runs the same code paths on a machine without a GPU:

=====================  ==============================================================
CUDA driver            host backend
=====================  ==============================================================
``cuMemAddressReserve``  anonymous ``PROT_NONE`` ``mmap`` (``MAP_NORESERVE``), aligned
                       to the granularity, at an address the kernel picks
``cuMemCreate``          ``memfd_create`` + ``ftruncate`` (lazy: costs nothing until
                       touched); counted against the configured device size
``cuMemMap``             ``mmap(va, size, PROT_NONE, MAP_FIXED | MAP_SHARED, fd)``
``cuMemSetAccess``       ``mprotect`` read-write, or read-only
``cuMemUnmap``           the ``PROT_NONE`` reservation re-established over the range
                       (``MAP_FIXED``), atomically replacing the mapping
``cuMemRelease``         ``close(fd)``; the memory returns once no mapping remains
=====================  ==============================================================

Unbacked addresses fault like on a GPU (``SIGSEGV`` instead of an illegal-address error),
and a read-only mapping faults on write, which is what the zero page relies on.

Device size. ``mem_info()`` reports a configurable device of ``device_bytes`` (constructor
argument, else ``KVCORE_HOST_DEVICE_BYTES``, else half the machine's RAM); ``create`` raises
``OutOfDeviceMemory`` beyond it. Accounting follows CUDA: a handle's bytes count from
``create`` until it is released *and* its last mapping is gone. The count is per backend
object by default. With ``shared_accounting=True`` (or ``KVCORE_HOST_SHARED_ACCOUNTING=1``)
every process using the same device id shares one count, kept in a ``flock``-ed file under
``/dev/shm`` (``KVCORE_HOST_SHARED_DIR`` names another directory) whose entries of dead
processes are reclaimed on each update; this makes ``mem_info`` meaningful to two engine
processes on one host "device". The per-GPU ledger (``kvcore.budget.ledger``) stays the
authority on who holds what; this count only models the driver's free memory.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.errors import OutOfDeviceMemory, VmmError
from kvcore.vmm.base import Handle, MemInfo, VmmBackend

if TYPE_CHECKING:
    import torch

DEVICE_BYTES_ENV = "KVCORE_HOST_DEVICE_BYTES"
SHARED_ACCOUNTING_ENV = "KVCORE_HOST_SHARED_ACCOUNTING"
DEFAULT_GRANULARITY = 2 << 20
SHARED_DIR_ENV = "KVCORE_HOST_SHARED_DIR"
"""Environment variable naming the directory of the shared device counts (default
``/dev/shm``; tests point it at a private directory)."""
DEFAULT_SHARED_DIR = Path("/dev/shm")


def shared_dir() -> Path:
    """The directory of the shared device counts: ``$KVCORE_HOST_SHARED_DIR`` or
    ``/dev/shm``."""
    value = os.environ.get(SHARED_DIR_ENV, "")
    return Path(value) if value else DEFAULT_SHARED_DIR


_PROT_NONE = 0x0
_PROT_READ = 0x1
_PROT_WRITE = 0x2
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_RESERVE_FLAGS = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE


class _Libc:
    """The three libc calls Python's ``mmap`` module cannot make (fixed addresses)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = lib.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mprotect = lib.mprotect
        self.mprotect.restype = ctypes.c_int
        self.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


_libc: _Libc | None = None


def _get_libc() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def _errno_name(code: int) -> str:
    return errno.errorcode.get(code, str(code))


def _mmap(va: int, size: int, prot: int, flags: int, fd: int) -> int:
    addr = _get_libc().mmap(va or None, size, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        code = ctypes.get_errno()
        raise VmmError(
            "mmap",
            {"addr": va, "length": size, "prot": prot, "flags": hex(flags), "fd": fd},
            _errno_name(code),
        )
    return int(addr)


def _munmap(va: int, size: int) -> None:
    if _get_libc().munmap(va, size) != 0:
        raise VmmError("munmap", {"addr": va, "length": size}, _errno_name(ctypes.get_errno()))


def _mprotect(va: int, size: int, prot: int) -> None:
    if _get_libc().mprotect(va, size, prot) != 0:
        raise VmmError(
            "mprotect", {"addr": va, "length": size, "prot": prot}, _errno_name(ctypes.get_errno())
        )


@dataclass
class _Segment:
    """One physical handle: a memfd of ``size`` bytes and where it is mapped."""

    fd: int
    size: int
    mapped_at: set[int]
    released: bool = False


class HostBackend(VmmBackend):
    """Linux memfd + mmap virtual memory (see the module docstring).

    ``device`` only distinguishes host "devices" (their ids and shared counts);
    ``device_bytes`` is the simulated physical memory; ``granularity`` must be a multiple
    of the OS page size.
    """

    name = "host"

    def __init__(
        self,
        device: int = 0,
        *,
        device_bytes: int | None = None,
        granularity: int = DEFAULT_GRANULARITY,
        shared_accounting: bool | None = None,
    ) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        if granularity <= 0 or granularity % page:
            raise VmmError(
                "HostBackend",
                {"granularity": granularity},
                "EINVAL",
                hint=f"use a positive multiple of the OS page size ({page})",
            )
        self.device = device
        self._granularity = granularity
        self._device_bytes = _device_bytes(device_bytes)
        self._uuid = _host_device_uuid(device)
        if shared_accounting is None:
            shared_accounting = os.environ.get(SHARED_ACCOUNTING_ENV, "") not in ("", "0")
        self._shared = _SharedCount(self._uuid) if shared_accounting else None
        self._lock = threading.RLock()
        self._next_handle = 1
        self._segments: dict[int, _Segment] = {}
        self._reservations: dict[int, int] = {}
        self._map_starts: list[int] = []  # sorted
        self._maps: dict[int, tuple[int, int]] = {}  # va -> (handle, size)
        self._used = 0
        self._closed = False

    # -- facts ---------------------------------------------------------------------------

    def granularity(self) -> int:
        return self._granularity

    def device_uuid(self) -> str:
        return self._uuid

    def mem_info(self) -> MemInfo:
        used = self._shared.total() if self._shared is not None else self._used
        return MemInfo(free=max(0, self._device_bytes - used), total=self._device_bytes)

    @property
    def live_handles(self) -> int:
        """Handles created and not yet released (tests use it to prove nothing leaked)."""
        with self._lock:
            return sum(1 for s in self._segments.values() if not s.released)

    @property
    def used_bytes(self) -> int:
        """Bytes this backend holds on the device (unreleased or still-mapped handles)."""
        return self._used

    # -- virtual address space -----------------------------------------------------------

    def reserve(self, size: int) -> int:
        with self._lock:
            self._check("reserve", {"size": size}, size)
            gran = self._granularity
            raw = _mmap(0, size + gran, _PROT_NONE, _RESERVE_FLAGS, -1)
            va = -(-raw // gran) * gran
            head, tail = va - raw, raw + size + gran - (va + size)
            if head:
                _munmap(raw, head)
            if tail:
                _munmap(va + size, tail)
            self._reservations[va] = size
            return va

    def free_reservation(self, va: int, size: int) -> None:
        with self._lock:
            args: dict[str, object] = {"va": va, "size": size}
            self._check("free_reservation", args, size)
            if self._reservations.get(va) != size:
                raise VmmError("free_reservation", args, "EINVAL", hint="not a reservation")
            if self._maps_in(va, size):
                raise VmmError(
                    "free_reservation", args, "EBUSY", hint="unmap every page in it first"
                )
            _munmap(va, size)
            del self._reservations[va]

    # -- physical memory -----------------------------------------------------------------

    def create(self, size: int) -> Handle:
        with self._lock:
            args: dict[str, object] = {"size": size}
            self._check("create", args, size)
            self._charge(args, size)
            try:
                try:
                    fd = os.memfd_create(f"kvcore-host{self.device}", os.MFD_CLOEXEC)
                except OSError as exc:
                    raise VmmError("memfd_create", args, _errno_name(exc.errno or 0)) from exc
                try:
                    os.ftruncate(fd, size)
                except OSError as exc:
                    os.close(fd)
                    raise VmmError(
                        "ftruncate", {"fd": fd, "length": size}, _errno_name(exc.errno or 0)
                    ) from exc
            except BaseException:
                self._uncharge(size)
                raise
            handle = self._next_handle
            self._next_handle += 1
            self._segments[handle] = _Segment(fd=fd, size=size, mapped_at=set())
            return Handle(handle)

    def release(self, handle: Handle) -> None:
        with self._lock:
            args: dict[str, object] = {"handle": int(handle)}
            seg = self._segment("release", args, handle)
            try:
                os.close(seg.fd)
            except OSError as exc:
                raise VmmError(
                    "close", {"fd": seg.fd, **args}, _errno_name(exc.errno or 0)
                ) from exc
            seg.released = True
            self._retire_if_unused(int(handle), seg)

    # -- mappings ------------------------------------------------------------------------

    def map(self, va: int, size: int, handle: Handle) -> None:
        with self._lock:
            args: dict[str, object] = {"va": va, "size": size, "handle": int(handle)}
            self._check("map", args, size, va)
            seg = self._segment("map", args, handle)
            if size != seg.size:
                raise VmmError(
                    "map", args, "EINVAL", hint=f"a handle is mapped whole ({seg.size} bytes)"
                )
            self._require_reserved("map", args, va, size)
            if self._maps_in(va, size):
                raise VmmError("map", args, "EEXIST", hint="unmap the range first")
            _mmap(va, size, _PROT_NONE, _MAP_FIXED | _MAP_SHARED, seg.fd)
            bisect.insort(self._map_starts, va)
            self._maps[va] = (int(handle), size)
            seg.mapped_at.add(va)

    def set_access(self, va: int, size: int, *, writable: bool = True) -> None:
        with self._lock:
            args: dict[str, object] = {"va": va, "size": size, "writable": writable}
            self._check("set_access", args, size, va)
            self._whole_mappings("set_access", args, va, size)
            _mprotect(va, size, _PROT_READ | (_PROT_WRITE if writable else 0))

    def unmap(self, va: int, size: int) -> None:
        with self._lock:
            args: dict[str, object] = {"va": va, "size": size}
            self._check("unmap", args, size, va)
            covered = self._whole_mappings("unmap", args, va, size)
            _mmap(va, size, _PROT_NONE, _MAP_FIXED | _RESERVE_FLAGS, -1)
            for start in covered:
                handle, _ = self._maps.pop(start)
                del self._map_starts[bisect.bisect_left(self._map_starts, start)]
                seg = self._segments[handle]
                seg.mapped_at.discard(start)
                self._retire_if_unused(handle, seg)

    def synchronize(self) -> None:
        """CPU accesses are synchronous: nothing to wait for."""

    def as_tensor(self, va: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        import torch

        if size == 0:
            return torch.empty(0, dtype=dtype)
        buf = (ctypes.c_char * size).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)

    def close(self) -> None:
        """Unmap everything, close every handle, free every reservation. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for va in list(self._reservations):
                size = self._reservations.pop(va)
                _munmap(va, size)
            self._maps.clear()
            self._map_starts.clear()
            for seg in self._segments.values():
                if not seg.released:
                    os.close(seg.fd)
            self._segments.clear()
            self._uncharge(self._used)

    # -- internals -----------------------------------------------------------------------

    def _check(self, call: str, args: dict[str, object], size: int, va: int = 0) -> None:
        if self._closed:
            raise VmmError(call, args, "closed", hint="the host backend was closed")
        gran = self._granularity
        if size <= 0 or size % gran or va % gran:
            raise VmmError(
                call, args, "EINVAL", hint=f"sizes and addresses are multiples of {gran}"
            )

    def _segment(self, call: str, args: dict[str, object], handle: Handle) -> _Segment:
        if self._closed:
            raise VmmError(call, args, "closed", hint="the host backend was closed")
        seg = self._segments.get(int(handle))
        if seg is None or seg.released:
            raise VmmError(call, args, "EBADF", hint="unknown or released handle")
        return seg

    def _require_reserved(self, call: str, args: dict[str, object], va: int, size: int) -> None:
        for base, length in self._reservations.items():
            if base <= va and va + size <= base + length:
                return
        raise VmmError(call, args, "EINVAL", hint="the range is not inside a reservation")

    def _maps_in(self, va: int, size: int) -> list[int]:
        """Starts of mappings overlapping ``[va, va+size)``."""
        starts = self._map_starts
        i = bisect.bisect_left(starts, va)
        if i > 0:
            prev = starts[i - 1]
            if prev + self._maps[prev][1] > va:
                i -= 1
        out = []
        while i < len(starts) and starts[i] < va + size:
            out.append(starts[i])
            i += 1
        return out

    def _whole_mappings(self, call: str, args: dict[str, object], va: int, size: int) -> list[int]:
        """The mappings exactly tiling ``[va, va+size)``; raises if any byte is unmapped or a
        mapping sticks out of the range (CUDA refuses partial unmaps the same way)."""
        out = []
        pos = va
        while pos < va + size:
            entry = self._maps.get(pos)
            if entry is None:
                raise VmmError(call, args, "EINVAL", hint=f"{pos:#x} is not the start of a mapping")
            out.append(pos)
            pos += entry[1]
        if pos != va + size:
            raise VmmError(call, args, "EINVAL", hint="the range ends inside a mapping")
        return out

    def _charge(self, args: dict[str, object], size: int) -> None:
        if self._shared is not None:
            ok = self._shared.add(size, limit=self._device_bytes)
        else:
            ok = self._used + size <= self._device_bytes
        if not ok:
            free = self.mem_info().free
            raise OutOfDeviceMemory(
                "create",
                args,
                "out of device memory",
                hint=f"host device {self._uuid} has {free} of {self._device_bytes} bytes free; "
                f"raise {DEVICE_BYTES_ENV} or release handles",
            )
        self._used += size

    def _uncharge(self, size: int) -> None:
        if size == 0:
            return
        self._used -= size
        if self._shared is not None:
            self._shared.add(-size, limit=None)

    def _retire_if_unused(self, handle: int, seg: _Segment) -> None:
        if seg.released and not seg.mapped_at:
            del self._segments[handle]
            self._uncharge(seg.size)


def _device_bytes(explicit: int | None) -> int:
    if explicit is not None:
        value = explicit
    elif raw := os.environ.get(DEVICE_BYTES_ENV):
        try:
            value = int(raw, 0)
        except ValueError:
            raise VmmError(
                "HostBackend",
                {DEVICE_BYTES_ENV: raw},
                "EINVAL",
                hint="set it to a byte count, e.g. 8589934592",
            ) from None
    else:
        value = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    if value <= 0:
        raise VmmError("HostBackend", {"device_bytes": value}, "EINVAL", hint="must be positive")
    return value


def _host_device_uuid(device: int) -> str:
    """``HOST-<uuid>``: stable for this machine and device index, different elsewhere."""
    try:
        machine = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine = ""
    seed = f"{machine or socket.gethostname()}:{device}"
    return f"HOST-{uuid.uuid5(uuid.NAMESPACE_OID, 'kvcore-host:' + seed)}"


class _SharedCount:
    """Bytes held on one host device by every live process: a JSON table
    (``{pid: [start_time, bytes]}``) in ``kvcore-hostdev-<uuid>.json``, updated under an
    ``flock`` of ``<that>.lock`` by writing a new file and renaming it over the old one, so a
    process killed mid-update leaves the old table or the new one, never a torn one.
    Entries of dead processes are dropped on update; content that is not such a table
    counts as empty. Both files are opened without following symlinks: a link planted at
    the predictable path is refused (``VmmError``), not written through."""

    def __init__(self, device_uuid: str) -> None:
        base = shared_dir()
        self.path = base / f"kvcore-hostdev-{device_uuid}.json"
        self._lock_path = base / f"kvcore-hostdev-{device_uuid}.json.lock"
        self._me = str(os.getpid())
        self._start = _start_time(os.getpid())

    def total(self) -> int:
        return self._update(0, None)[1]

    def add(self, delta: int, *, limit: int | None) -> bool:
        return self._update(delta, limit)[0]

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise VmmError(
                "open",
                {"path": str(path), "purpose": "the shared device count"},
                errno.errorcode.get(exc.errno or 0, str(exc)),
                hint="remove whatever is at that path (a symlink is refused), or set "
                f"{SHARED_DIR_ENV} to a directory of your own",
            ) from exc

    def _read(self) -> dict[str, list[int]]:
        try:
            fd = self._open(self.path, os.O_RDONLY)
        except VmmError:
            if not self.path.exists() and not self.path.is_symlink():
                return {}
            raise
        try:
            raw = os.read(fd, 1 << 20)
        finally:
            os.close(fd)
        try:
            table = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        if not isinstance(table, dict):
            return {}
        return {
            pid: [int(v[0]), int(v[1])]
            for pid, v in table.items()
            if isinstance(pid, str)
            and pid.isdigit()
            and isinstance(v, list)
            and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        }

    def _write(self, table: dict[str, list[int]]) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{self._me}.tmp")
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, json.dumps(table).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def _update(self, delta: int, limit: int | None) -> tuple[bool, int]:
        lock = self._open(self._lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = {
                pid: v
                for pid, v in self._read().items()
                if _start_time(int(pid)) == v[0] and v[1] > 0
            }
            total = sum(v[1] for v in table.values())
            if limit is not None and delta > 0 and total + delta > limit:
                return False, total
            mine = table.get(self._me, [self._start, 0])[1] + delta
            if mine > 0:
                table[self._me] = [self._start, mine]
            else:
                table.pop(self._me, None)
            if delta or not self.path.exists():
                self._write(table)
            return True, total + delta
        finally:
            os.close(lock)


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks (guards against pid reuse); -1 if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])
