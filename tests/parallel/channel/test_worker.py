"""``WorkerListener`` driven frame by frame by a raw coordinator connection, over a real
host-backed ``LocalPageMapper`` in this process: the transaction rules hold end to end
(retransmits are no-ops, a prepare after its abort is refused, commit is idempotent), CLOSE
closes the mapper, and one rank is served by one listener."""

from __future__ import annotations

import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore.errors import ChannelError
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.mapper import MappingState
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.parallel.channel import ChannelDirectory, WorkerListener
from kvcore.parallel.channel.messages import (
    MAGIC,
    SCHEMA_VERSION,
    FrameReader,
    Hello,
    Kind,
    Op,
    Reply,
    Request,
    Welcome,
    encode,
    recv_message,
    send_message,
)
from kvcore.vmm import open_backend

GRAN = 64 << 10


@pytest.fixture
def mapper() -> Iterator[LocalPageMapper]:
    backend = open_backend("host", device_bytes=16 << 20, granularity=GRAN)
    geometry = KVGeometry(
        num_layers=2,
        kv_buffers=2,
        block_bytes=4096,
        num_blocks=32,
        page_bytes=GRAN,
        granularity=GRAN,
    )
    cache = VirtualKVCache(backend, geometry)
    local = LocalPageMapper(cache)
    yield local
    local.close()
    cache.close()
    backend.close()


@pytest.fixture
def directory() -> Iterator[ChannelDirectory]:
    base = Path(tempfile.mkdtemp(prefix="kvc"))
    channel_dir = ChannelDirectory.create(base)
    yield channel_dir
    channel_dir.remove()
    shutil.rmtree(base, ignore_errors=True)


class _Session:
    def __init__(self, path: Path, rank: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.reader = FrameReader()
        send_message(self.sock, Hello(rank=rank, world_size=1, instance="test"))
        self.welcome = recv_message(self.sock, self.reader)

    def ask(self, op: Op, txn: int, *pages: int) -> Reply:
        send_message(self.sock, Request(op, txn, pages))
        reply = recv_message(self.sock, self.reader)
        assert isinstance(reply, Reply) and (reply.op, reply.txn) == (op, txn)
        return reply


def test_transaction_rules_end_to_end(mapper: LocalPageMapper, directory: ChannelDirectory) -> None:
    listener = WorkerListener(mapper, rank=0, channel_dir=directory.path).start()
    session = _Session(listener.path, 0)
    assert session.welcome == Welcome(0, session.welcome.pid, 8, GRAN, GRAN)  # zero page: GRAN

    assert session.ask(Op.MAP, 1, 0, 1).ok
    assert session.ask(Op.MAP, 1, 0, 1).ok  # retransmit: applied once
    assert [mapper.state(p) for p in (0, 1)] == [MappingState.MAPPED] * 2

    assert session.ask(Op.ABORT, 2, 0).ok  # the abort overtook its prepare
    late = session.ask(Op.PREPARE, 2, 0)
    assert late.error is not None and late.error.type == "TransactionRefused"
    assert "prepare after its abort" in late.error.message
    assert mapper.state(0) is MappingState.MAPPED  # refused: nothing changed

    assert session.ask(Op.PREPARE, 3, 0).ok
    assert mapper.state(0) is MappingState.PREPARED
    assert session.ask(Op.COMMIT, 3, 0).ok
    assert session.ask(Op.COMMIT, 3, 0).ok  # idempotent
    assert mapper.state(0) is MappingState.UNMAPPED

    error = session.ask(Op.MAP, 4, 1).error  # already mapped: the mapper refuses
    assert error is not None and error.type == "InvalidTransition"

    assert session.ask(Op.MAP, 6, 2, 3).ok
    assert session.ask(Op.UNDO_MAP, 6).ok  # the rollback of a map on another worker's failure
    assert [mapper.state(p) for p in (2, 3)] == [MappingState.UNMAPPED] * 2
    late = session.ask(Op.MAP, 6, 2, 3)
    assert late.error is not None and late.error.type == "TransactionRefused"
    assert mapper.held_bytes == GRAN  # page 1 only: no pooled handle kept

    assert session.ask(Op.CLOSE, 5).ok
    assert listener.wait_closed(5)
    assert recv_message(session.sock, session.reader) is None  # session ended
    listener.close()
    assert not listener.path.exists()
    session.sock.close()


def test_one_listener_per_rank(mapper: LocalPageMapper, directory: ChannelDirectory) -> None:
    first = WorkerListener(mapper, rank=0, channel_dir=directory.path).start()
    with pytest.raises(ChannelError, match="served by another live listener"):
        WorkerListener(mapper, rank=0, channel_dir=directory.path).start()
    first.close()
    stale = WorkerListener(mapper, rank=1, channel_dir=directory.path)
    stale.path.touch()  # left behind by a dead listener
    stale.start()
    assert _Session(stale.path, 1).welcome is not None
    stale.close()


def test_a_handshake_has_one_deadline_not_one_per_byte(
    mapper: LocalPageMapper, directory: ChannelDirectory
) -> None:
    """A peer sending a byte every 0.1 s never completes a Hello; with a 0.5 s handshake
    deadline the worker cuts it off however steadily it trickles, and still serves the
    coordinator that comes next."""
    listener = WorkerListener(
        mapper, rank=0, channel_dir=directory.path, handshake_timeout=0.5
    ).start()
    try:
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.settimeout(10)
        slow.connect(str(listener.path))
        # a well-formed header announcing a 1,000-byte Hello body, then that body a byte at
        # a time: every recv of the worker gets data well within 0.5 s
        slow.send(struct.pack("!4sHBBI", MAGIC, SCHEMA_VERSION, Kind.HELLO, 0, 1000))
        slow.settimeout(0.1)
        cut = False
        for _ in range(100):  # 10 s of trickling at most
            try:
                slow.send(b" ")
            except OSError:
                cut = True
                break
            try:
                slow.recv(4096)  # the worker's refusal, or b"": it ended the handshake
                cut = True
                break
            except TimeoutError:
                continue
        slow.close()
        assert cut, "the worker kept a trickling handshake open"
        session = _Session(listener.path, 0)
        assert isinstance(session.welcome, Welcome)
        session.sock.close()
    finally:
        listener.close()


def test_a_failed_thread_start_fails_that_connection_only(
    mapper: LocalPageMapper, directory: ChannelDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    listener = WorkerListener(mapper, rank=0, channel_dir=directory.path).start()
    real_start = threading.Thread.start
    failed: list[bool] = []

    def start_once_failing(self: threading.Thread) -> None:
        if self.name.endswith("-conn") and not failed:
            failed.append(True)
            raise RuntimeError("can't start new thread")
        real_start(self)

    try:
        monkeypatch.setattr(threading.Thread, "start", start_once_failing)
        first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        first.settimeout(10)
        first.connect(str(listener.path))
        assert first.recv(16) == b""  # closed: no thread to serve it
        first.close()
        session = _Session(listener.path, 0)  # the accept loop still runs
        assert isinstance(session.welcome, Welcome) and failed
        session.sock.close()
    finally:
        monkeypatch.undo()
        listener.close()


def _refusal_of(sock: socket.socket) -> str:
    """The error type and message of the refusal the worker sends on ``sock``."""
    sock.settimeout(30)
    reply = recv_message(sock, FrameReader())
    assert isinstance(reply, Reply) and reply.error is not None, reply
    return f"{reply.error.type}: {reply.error.message}"


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    return sock


def test_a_peer_past_the_handshake_deadline_is_told_so(
    mapper: LocalPageMapper, directory: ChannelDirectory
) -> None:
    """The deadline ends reading only: the silent peer gets a ``PeerRejected`` naming the
    deadline, not a connection cut off with no answer, and the listener records why."""
    listener = WorkerListener(
        mapper, rank=0, channel_dir=directory.path, handshake_timeout=0.3
    ).start()
    try:
        with _connect(listener.path) as silent:
            refusal = _refusal_of(silent)
        assert refusal.startswith("PeerRejected") and "handshake deadline" in refusal
        assert listener.refused == 1 and "handshake deadline" in listener.rejected[-1]
    finally:
        listener.close()


def test_a_connection_beyond_max_handshakes_gets_a_typed_refusal(
    mapper: LocalPageMapper, directory: ChannelDirectory
) -> None:
    from kvcore.parallel.channel.worker import MAX_HANDSHAKES

    listener = WorkerListener(
        mapper, rank=0, channel_dir=directory.path, handshake_timeout=30
    ).start()
    held = [_connect(listener.path) for _ in range(MAX_HANDSHAKES)]  # silent: all in flight
    try:
        with _connect(listener.path) as extra:
            refusal = _refusal_of(extra)
        assert refusal.startswith("PeerRejected") and "MAX_HANDSHAKES" in refusal
        assert listener.refused == 1
    finally:
        for sock in held:
            sock.close()
        listener.close()


def test_the_refusal_reasons_kept_are_bounded(
    mapper: LocalPageMapper, directory: ChannelDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcore.parallel.channel import worker

    monkeypatch.setattr(worker, "REJECTED_KEPT", 2)
    listener = WorkerListener(mapper, rank=0, channel_dir=directory.path).start()
    try:
        for n in range(3):
            with _connect(listener.path) as stranger:
                stranger.sendall(encode(Hello(rank=7, world_size=1, instance=f"x{n}")))
                assert _refusal_of(stranger).startswith("PeerRejected")
        assert listener.refused == 3 and len(listener.rejected) == 2
    finally:
        listener.close()


class _IntervalSeen:
    """A ``PageMapper`` in front of another that notes the interpreter's switch interval at
    each ``map`` (made on the listener's session thread)."""

    def __init__(self, inner: LocalPageMapper) -> None:
        self.inner = inner
        self.seen: list[float] = []

    def map(self, page_ids: list[int]) -> None:
        self.seen.append(sys.getswitchinterval())
        self.inner.map(page_ids)

    def __getattr__(self, name: str) -> object:  # the rest of the PageMapper protocol
        return getattr(self.inner, name)


@pytest.mark.parametrize("configured", [50e-6, None], ids=["shortened", "left-alone"])
def test_requests_are_applied_under_the_configured_switch_interval(
    mapper: LocalPageMapper, directory: ChannelDirectory, configured: float | None
) -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    seen = _IntervalSeen(mapper)
    listener = WorkerListener(
        seen,  # type: ignore[arg-type]
        rank=0,
        channel_dir=directory.path,
        switch_interval=configured,
    ).start()
    try:
        session = _Session(listener.path, 0)
        assert session.ask(Op.MAP, 1, 0).ok
        assert seen.seen == [pytest.approx(configured if configured else 0.005)]
        assert sys.getswitchinterval() == 0.005  # put back once the request was answered
        assert session.ask(Op.CLOSE, 2).ok
        session.sock.close()
    finally:
        listener.close()
        sys.setswitchinterval(before)
