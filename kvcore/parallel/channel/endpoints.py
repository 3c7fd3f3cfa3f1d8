"""Where the channel's sockets live, who may connect to them, and how they are cleaned up.

Layout::

    <base>/kvcore-<uid>/            0700, owned by this uid (refused otherwise)
        ch-<pid>-<start>/           one per engine instance, 0700
            rank-<r>.sock           worker ``r``'s listening socket

``<base>`` is ``$KVCORE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR``, else ``/tmp``. ``<pid>``
is the engine process that created the instance directory and ``<start>`` its start time
(``/proc/<pid>/stat`` field 22), so a recycled pid is not mistaken for a live owner.

Life cycle:

* the engine process calls ``ChannelDirectory.create()`` before its workers start; it hands
  the path to them (``ChannelDirectory.env()`` sets ``KVCORE_CHANNEL`` for child processes;
  ``channel_dir_from_env()`` reads it back in a worker);
* worker ``r`` binds ``socket_path(dir, r)``; global rank ``r = pp_rank * tp_size +
  tp_rank`` (vLLM's numbering);
* ``ChannelDirectory.remove()`` (also run at interpreter exit) deletes the directory and
  every socket in it; ``reclaim_stale()`` (run by every ``create``) deletes directories
  whose owner process is gone, so a crashed instance leaves nothing a later one cannot
  reclaim (invariant 5 of ``docs/architecture.md``).

Every accepted connection is checked with ``SO_PEERCRED``: only a process of this uid may
drive or serve a channel (``check_peer``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from kvcore.errors import ChannelError, PeerRejected

RUNTIME_DIR_ENV = "KVCORE_RUNTIME_DIR"
"""Overrides the base directory of every channel directory."""
CHANNEL_ENV = "KVCORE_CHANNEL"
"""Carries an instance's channel directory from the engine process to its workers."""

_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_INSTANCE_RE = re.compile(r"^ch-(\d+)-(\d+)$")
_CRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCredentials:
    """The process at the other end of a Unix socket, as the kernel reports it."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected Unix socket (Linux)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return PeerCredentials(pid, uid, gid)


def check_peer(sock: socket.socket, *, uid: int | None = None) -> PeerCredentials:
    """Refuse a peer of another uid (default: this process's effective uid). Returns the
    peer's credentials; raises ``PeerRejected``."""
    expected = os.geteuid() if uid is None else uid
    cred = peer_credentials(sock)
    if cred.uid != expected:
        raise PeerRejected(
            f"channel peer pid {cred.pid} runs as uid {cred.uid}, expected uid {expected}",
            hint="run the engine and its workers as the same user",
        )
    return cred


def runtime_base() -> Path:
    """The base directory for channel directories (see the module docstring)."""
    for env in (RUNTIME_DIR_ENV, "XDG_RUNTIME_DIR"):
        value = os.environ.get(env)
        if value:
            return Path(value)
    return Path("/tmp")


def user_root(base: Path | None = None) -> Path:
    """``<base>/kvcore-<uid>``, created 0700 if absent. Raises ``ChannelError`` when it
    exists but is not a directory owned by this uid with mode 0700 (another user may have
    planted it in a shared ``/tmp``)."""
    root = (runtime_base() if base is None else base) / f"kvcore-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700, parents=True)
    info = os.lstat(root)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.geteuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise ChannelError(
            f"channel root {root} is not a private directory of uid {os.geteuid()}",
            hint=f"remove it, or point {RUNTIME_DIR_ENV} at a directory only you can write",
        )
    return root


def socket_path(channel_dir: Path | str, rank: int) -> Path:
    """The listening socket of worker ``rank`` in an instance's channel directory. Raises
    ``ChannelError`` when the path is too long for a Unix socket address."""
    path = Path(channel_dir) / f"rank-{rank}.sock"
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ChannelError(
            f"channel socket path {path} is longer than {_SUN_PATH_MAX} bytes",
            hint=f"set {RUNTIME_DIR_ENV} to a short directory",
        )
    return path


def channel_dir_from_env() -> Path:
    """The channel directory the engine exported to this (worker) process. Raises
    ``ChannelError`` when ``KVCORE_CHANNEL`` is unset."""
    value = os.environ.get(CHANNEL_ENV)
    if not value:
        raise ChannelError(
            f"{CHANNEL_ENV} is not set in this worker process",
            hint="the engine process must create a ChannelDirectory and export env() to "
            "its workers before they start",
        )
    return Path(value)


def process_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process ``pid``; ``None`` if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[19])


def _owner_alive(pid: int, start: int) -> bool:
    return process_start_time(pid) == start


def reclaim_stale(base: Path | None = None) -> list[Path]:
    """Remove the channel directories whose owner process is gone; returns them."""
    root = user_root(base)
    removed: list[Path] = []
    for entry in root.iterdir():
        match = _INSTANCE_RE.match(entry.name)
        if match is None or _owner_alive(int(match[1]), int(match[2])):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


class ChannelDirectory:
    """One engine instance's private socket directory. Create with ``create``; remove with
    ``remove`` (idempotent; also registered to run at interpreter exit)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._removed = False
        self._owner_pid = os.getpid()
        atexit.register(self.remove)

    @classmethod
    def create(cls, base: Path | None = None) -> ChannelDirectory:
        """Reclaim stale directories under ``base``, then create this process's directory
        (mode 0700). Raises ``ChannelError`` if this process already has one or the root is
        unsafe."""
        root = user_root(base)
        reclaim_stale(base)
        pid = os.getpid()
        start = process_start_time(pid)
        path = root / f"ch-{pid}-{start if start is not None else 0}"
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            raise ChannelError(
                f"channel directory {path} already exists for this process",
                hint="create one ChannelDirectory per engine instance and reuse it",
            ) from None
        socket_path(path, 9999)  # fail now, not at bind time, if the paths are too long
        return cls(path)

    def env(self) -> dict[str, str]:
        """Environment entries that tell worker processes where the channel is."""
        return {CHANNEL_ENV: str(self.path)}

    def remove(self) -> None:
        """Delete the directory and every socket in it. Idempotent. A forked child that
        inherited this object leaves the directory alone."""
        if self._removed or os.getpid() != self._owner_pid:
            return
        self._removed = True
        atexit.unregister(self.remove)
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> ChannelDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ChannelDirectory({str(self.path)!r})"
