"""The coordinator facing a broken worker: a bad handshake refuses the channel; garbage,
oversized or wrong-version replies, or a dropped connection, fail it (fail-stop).

The peer here is a deliberately broken stand-in written in the test (a thread serving the
rank's socket), not a real worker: a real ``WorkerListener`` cannot be made to send these
frames. The real workers' side of every fault is in ``test_cluster.py``."""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcore.errors import (
    ChannelError,
    MalformedMessage,
    PeerRejected,
    PoolFailed,
    VersionMismatch,
    WorkerLost,
)
from kvcore.parallel.channel import ChannelCoordinator, ChannelDirectory, socket_path
from kvcore.parallel.channel.messages import (
    MAGIC,
    SCHEMA_VERSION,
    FrameReader,
    Kind,
    Op,
    RemoteError,
    Reply,
    Request,
    Welcome,
    encode,
    recv_message,
)

Answer = Callable[[Request], bytes | None]
"""What the stand-in sends back for a request; ``None`` closes the connection."""


class _StandIn:
    """Serves rank ``rank``'s socket: answers the handshake with ``welcome`` bytes, then
    each request with ``answer(request)``."""

    def __init__(self, directory: Path, rank: int, welcome: bytes, answer: Answer) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(socket_path(directory, rank)))
        self.sock.listen(1)
        self.welcome, self.answer = welcome, answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            reader = FrameReader()
            recv_message(conn, reader)  # Hello
            conn.sendall(self.welcome)
            while (request := recv_message(conn, reader)) is not None:
                assert isinstance(request, Request)
                data = self.answer(request)
                if data is None:
                    return
                conn.sendall(data)


def _welcome(rank: int = 0, num_pages: int = 4) -> bytes:
    return encode(Welcome(rank=rank, pid=1, num_pages=num_pages, page_bytes=4096))


def _ok(request: Request) -> bytes:
    return encode(Reply(request.op, request.txn))


@pytest.fixture
def directory() -> Iterator[ChannelDirectory]:
    base = Path(tempfile.mkdtemp(prefix="kvc"))
    channel_dir = ChannelDirectory.create(base)
    yield channel_dir
    channel_dir.remove()
    shutil.rmtree(base, ignore_errors=True)


def _coordinator(directory: ChannelDirectory, world_size: int = 1) -> ChannelCoordinator:
    return ChannelCoordinator(directory, world_size=world_size, timeout=5, connect_timeout=5)


def test_healthy_stand_in_round_trip(directory: ChannelDirectory) -> None:
    _StandIn(directory.path, 0, _welcome(), _ok)
    coordinator = _coordinator(directory)
    coordinator.map([0, 1])
    coordinator.prepare_unmap([1])
    coordinator.commit_unmap([1])
    coordinator.close()
    assert not directory.path.exists()


@pytest.mark.parametrize(
    ("welcome", "error", "text"),
    [
        (struct.pack("!4sHBBI", MAGIC, 99, Kind.WELCOME, 0, 2) + b"{}", VersionMismatch, "99"),
        (_welcome(rank=3), MalformedMessage, "answered the handshake"),
        (
            encode(Reply(Op.HELLO, 0, RemoteError("PeerRejected", "busy"))),
            PeerRejected,
            "busy",
        ),
    ],
    ids=["wrong-version", "wrong-rank", "refused"],
)
def test_bad_handshake_refuses_the_channel(
    directory: ChannelDirectory, welcome: bytes, error: type[Exception], text: str
) -> None:
    _StandIn(directory.path, 0, welcome, _ok)
    with pytest.raises(error, match=text):
        _coordinator(directory)


def test_missing_worker_is_reported_after_the_connect_timeout(
    directory: ChannelDirectory,
) -> None:
    with pytest.raises(WorkerLost, match="no worker listening") as info:
        ChannelCoordinator(directory, world_size=1, connect_timeout=0.2)
    assert info.value.rank == 0


def test_workers_disagreeing_on_num_pages_are_refused(directory: ChannelDirectory) -> None:
    _StandIn(directory.path, 0, _welcome(0, num_pages=4), _ok)
    _StandIn(directory.path, 1, _welcome(1, num_pages=5), _ok)
    with pytest.raises(ChannelError, match="disagree on num_pages"):
        _coordinator(directory, world_size=2)


@pytest.mark.parametrize(
    ("answer", "text"),
    [
        (lambda r: b"\x00" * 64, "magic"),
        (lambda r: struct.pack("!4sHBBI", MAGIC, SCHEMA_VERSION, Kind.REPLY, 0, 1 << 30), "cap"),
        (lambda r: struct.pack("!4sHBBI", MAGIC, 7, Kind.REPLY, 0, 2) + b"{}", "version 7"),
        (lambda r: _welcome(), "sent Welcome"),
        (lambda r: None, "connection closed"),
    ],
    ids=["garbage", "oversized", "wrong-version", "wrong-type", "closed"],
)
def test_broken_reply_fails_the_channel(
    directory: ChannelDirectory, answer: Answer, text: str
) -> None:
    good = _StandIn(directory.path, 0, _welcome(0), _ok)
    _StandIn(directory.path, 1, _welcome(1), answer)
    coordinator = _coordinator(directory, world_size=2)
    with pytest.raises(PoolFailed, match=f"rank 1.*{text}"):
        coordinator.map([2])
    assert coordinator.failed is not None
    with pytest.raises(PoolFailed):
        coordinator.map([3])  # fail-stop: every later call
    coordinator.close()  # local cleanup only
    assert not directory.path.exists()
    good.thread.join(timeout=5)
    assert not good.thread.is_alive()  # the healthy worker saw its connection close


def test_a_worker_whose_backlog_is_full_times_out_instead_of_blocking(
    directory: ChannelDirectory,
) -> None:
    """A listener that never accepts, its backlog full: the coordinator gives up at its
    connect timeout (a plain blocking connect would wait far past it)."""
    path = str(socket_path(directory.path, 0))
    listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listen.bind(path)
    listen.listen(0)
    fillers = []
    try:
        for _ in range(4):  # fill the backlog (non-blocking connects beyond it fail at once)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except (BlockingIOError, OSError):
                s.close()
                break
            fillers.append(s)
        done = threading.Event()
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                ChannelCoordinator(directory, world_size=1, connect_timeout=0.5)
            except BaseException as exc:  # what the coordinator raised
                errors.append(exc)
            done.set()

        threading.Thread(target=connect, daemon=True).start()
        assert done.wait(30), "the coordinator blocked past its connect timeout"
        assert errors and isinstance(errors[0], WorkerLost), errors
    finally:
        for s in fillers:
            s.close()
        listen.close()
