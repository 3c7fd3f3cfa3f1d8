"""The worker's end of the channel: a listener thread that applies the coordinator's
transactions to this worker's own ``PageMapper``.

The seam an engine integration calls, in each GPU worker process (vLLM: once per TP x PP
rank, after the worker has built its virtual KV tensors)::

    mapper = LocalPageMapper(VirtualKVCache(backend, geometry))     # kvcore.memory.virtual_cache
    listener = WorkerListener(mapper, rank=global_rank).start()    # dir from KVCORE_CHANNEL
    ...                                                             # the worker runs
    listener.close()                                                # on worker shutdown

``start`` binds ``socket_path(channel_dir, rank)`` (mode 0600, inside the instance's 0700
directory) and returns at once; a daemon thread accepts connections. Each connection must
come from this uid (``SO_PEERCRED``), open with a ``Hello`` naming this rank within
``handshake_timeout`` seconds, and be the only coordinator session; anything else is
answered with an error reply (``PeerRejected`` naming the deadline for a handshake not
completed in time, or ``MAX_HANDSHAKES`` for one beyond that many at once), closed, and
counted in ``refused`` (the latest reasons in ``rejected``). The session then lasts
for the instance's life: requests are applied in order, one at a time, each answered with a
``Reply``. A malformed frame on the session ends it (the coordinator fails its pool).

Each request is applied with the interpreter's switch interval shortened
(``switch_interval``, ``kvcore.memory.switch_interval``): the worker's own thread runs the
model meanwhile, and every driver call would otherwise wait up to 5 ms for the GIL.

``UNDO_MAP`` is ``prepare_unmap`` then ``commit_unmap``; once the prepare succeeded the
pages are unmapped, so a failing commit (a handle release, which ``PageMapper`` retries
idempotently later) is logged, not reported.

The mapper keeps no pooled handles between requests: after each ``MAP``, ``UNDO_MAP`` and
``COMMIT`` the listener calls its ``trim_pool()``, because the coordinator accounts the
device memory a worker holds from page states alone (``ChannelCoordinator.held_bytes``). A
``COMMIT`` whose release fails there is answered with the error, as a mapper without a
pool would answer it (the pages stay prepared; the retry releases again).

A ``CLOSE`` request closes the mapper (every page unmapped and released), answers, and
stops the listener. When the session ends without ``CLOSE`` (the engine process died or
failed its pool), the listener keeps the mapper as it is and goes back to accepting: the
worker process is expected to be shut down by its engine. ``close()`` stops the listener
and removes its socket; it never closes the mapper (the worker owns it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from collections import deque
from pathlib import Path

from kvcore.errors import (
    ChannelError,
    KvcoreError,
    MalformedMessage,
    PageQuarantined,
    PeerRejected,
    VmmError,
)
from kvcore.memory.mapper import PageMapper
from kvcore.memory.switch_interval import DEFAULT_BACKGROUND_SWITCH_S, shortened
from kvcore.parallel.channel.endpoints import channel_dir_from_env, check_peer, socket_path
from kvcore.parallel.channel.messages import (
    MAX_FRAME_BYTES,
    FrameReader,
    Hello,
    Op,
    RemoteError,
    Reply,
    Request,
    Welcome,
    recv_message,
    send_message,
)
from kvcore.parallel.channel.transactions import TransactionLog

log = logging.getLogger(__name__)

DEFAULT_HANDSHAKE_TIMEOUT = 5.0


MAX_HANDSHAKES = 8
"""Connections a worker handshakes at once; more are refused (a coordinator makes one)."""
REJECTED_KEPT = 256
"""Refusal reasons a listener keeps: a peer connecting in a loop must not grow its memory."""


class WorkerListener:
    """Serves one worker rank's channel socket. See the module docstring."""

    def __init__(
        self,
        mapper: PageMapper,
        *,
        rank: int,
        channel_dir: Path | str | None = None,
        max_bytes: int = MAX_FRAME_BYTES,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        switch_interval: float | None = DEFAULT_BACKGROUND_SWITCH_S,
    ) -> None:
        self.mapper = mapper
        self.switch_interval = switch_interval
        """The interpreter's switch interval while a request is applied
        (``kvcore.memory.switch_interval``: the worker's own thread runs the model meanwhile;
        ``None`` leaves it alone)."""
        self.rank = rank
        self.channel_dir = Path(channel_dir) if channel_dir is not None else channel_dir_from_env()
        self.path = socket_path(self.channel_dir, rank)
        self.max_bytes = max_bytes
        self.handshake_timeout = handshake_timeout
        self.rejected: deque[str] = deque(maxlen=REJECTED_KEPT)
        """Why each of the latest refused connections was refused, oldest first."""
        self.refused = 0
        """Connections refused so far."""
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)  # in flight at once
        self.sessions = 0
        """Coordinator sessions accepted so far."""
        self._log = TransactionLog()
        self._lock = threading.Lock()
        self._session: socket.socket | None = None
        self._listen: socket.socket | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        """Whether the listener has stopped (``close`` or a ``CLOSE`` request)."""
        return self._closed.is_set()

    def start(self) -> WorkerListener:
        """Bind the socket and start accepting in a daemon thread. Raises ``ChannelError``
        when another live listener already serves this rank."""
        self._claim_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        sock.listen(8)
        self._listen = sock
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"kvcore-channel-rank{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the listener stops; ``False`` on timeout."""
        return self._closed.wait(timeout)

    def close(self) -> None:
        """Stop accepting, end the session, remove the socket. Idempotent; the mapper is
        left as it is."""
        self._closed.set()
        for sock in (self._listen, self._session):
            if sock is not None:
                _shutdown(sock)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # ------------------------------------------------------------------ connections

    def _claim_path(self) -> None:
        if not self.path.exists():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOTSOCK):
                raise
            self.path.unlink()  # left behind by a dead listener of this instance
            return
        finally:
            probe.close()
        raise ChannelError(
            f"channel socket {self.path} is served by another live listener",
            hint="each rank must run exactly one WorkerListener per instance",
        )

    def _accept_loop(self) -> None:
        listen = self._listen
        assert listen is not None
        while not self._closed.is_set():
            try:
                conn, _ = listen.accept()
            except OSError:
                break  # close() shut the socket down
            if not self._handshakes.acquire(blocking=False):  # a flood: refuse, keep serving
                self._refuse_busy(conn)
                continue
            try:
                threading.Thread(
                    target=self._serve,
                    args=(conn,),
                    name=f"kvcore-channel-rank{self.rank}-conn",
                    daemon=True,
                ).start()
            except RuntimeError as exc:  # no thread to spare: this connection only fails
                self._handshakes.release()
                log.error("rank %d: cannot serve a connection: %s", self.rank, exc)
                conn.close()
        listen.close()

    def _refuse_busy(self, conn: socket.socket) -> None:
        """Refuse a connection beyond ``MAX_HANDSHAKES`` on the accept thread: the refusal
        goes out without blocking (a fresh connection's buffer is empty) and the
        connection is closed."""
        with conn:
            conn.setblocking(False)
            self._reject(
                conn,
                PeerRejected(
                    f"rank {self.rank}: too many handshakes at once (MAX_HANDSHAKES = "
                    f"{MAX_HANDSHAKES})",
                    hint="one coordinator connects once per rank; retry later",
                ),
            )

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader(max_bytes=self.max_bytes)
        # one deadline for the whole handshake: a peer trickling a byte at a time is cut off.
        # The cut ends reading only, so the refusal still reaches the peer.
        expired = threading.Event()
        cutoff = threading.Timer(self.handshake_timeout, _expire, args=(conn, expired))
        cutoff.daemon = True
        with conn:
            try:
                cutoff.start()
                try:
                    self._handshake(conn, reader)
                finally:
                    cutoff.cancel()
                    self._handshakes.release()
            except (KvcoreError, OSError) as exc:
                if expired.is_set() or isinstance(exc, TimeoutError):
                    # whatever the read saw once the deadline passed, the deadline is why
                    exc = PeerRejected(
                        f"rank {self.rank}: no complete Hello within the "
                        f"{self.handshake_timeout}s handshake deadline",
                        hint="a coordinator sends its Hello at once; this peer trickled, "
                        "stalled or is not a kvcore coordinator",
                    )
                self._reject(conn, exc)
                return
            try:
                self._session_loop(conn, reader)
            except MalformedMessage as exc:
                log.error("rank %d: malformed request, session ended: %s", self.rank, exc)
                _try_send(conn, Reply(Op.HELLO, 0, remote_error(exc)))
            except OSError as exc:
                log.error("rank %d: session connection failed: %s", self.rank, exc)
            finally:
                with self._lock:
                    self._session = None

    def _handshake(self, conn: socket.socket, reader: FrameReader) -> None:
        check_peer(conn)
        conn.settimeout(self.handshake_timeout)
        hello = recv_message(conn, reader)
        if not isinstance(hello, Hello):
            raise MalformedMessage(f"channel session must open with Hello, got {hello!r}")
        if hello.rank != self.rank:
            raise PeerRejected(f"Hello for rank {hello.rank} reached rank {self.rank}")
        with self._lock:
            if self._session is not None or self._closed.is_set():
                raise PeerRejected(
                    f"rank {self.rank} already serves a coordinator session",
                    hint="one coordinator per instance",
                )
            self._session = conn
            self.sessions += 1
        conn.settimeout(None)
        send_message(
            conn,
            Welcome(
                self.rank,
                os.getpid(),
                self.mapper.num_pages,
                self.mapper.page_bytes,
                int(getattr(self.mapper, "fixed_bytes", 0)),
            ),
        )

    def _reject(self, conn: socket.socket, exc: BaseException) -> None:
        log.warning("rank %d: refused a channel connection: %s", self.rank, exc)
        self.rejected.append(f"{type(exc).__name__}: {exc}")
        self.refused += 1
        _try_send(conn, Reply(Op.HELLO, 0, remote_error(exc)))

    def _session_loop(self, conn: socket.socket, reader: FrameReader) -> None:
        while True:
            message = recv_message(conn, reader)
            if message is None:
                if not self._closed.is_set():
                    log.warning("rank %d: coordinator went away without CLOSE", self.rank)
                return
            if not isinstance(message, Request):
                raise MalformedMessage(f"expected a Request, got {type(message).__name__}")
            with shortened(self.switch_interval):
                reply = self._apply(message)
            if message.op is Op.CLOSE:
                # stopped before the reply goes out: a coordinator that has the reply finds
                # the listener closed, never about to close
                self._closed.set()
                send_message(conn, reply)
                _shutdown_quiet(self._listen)
                return
            send_message(conn, reply)

    # ------------------------------------------------------------------ transitions

    def _apply(self, request: Request) -> Reply:
        reply = self._apply_request(request)
        if request.op in (Op.MAP, Op.UNDO_MAP):  # a rolled-back map pools its handles
            try:
                self.mapper.trim_pool()
            except KvcoreError as exc:  # still held; the mapper retries the release later
                log.warning("rank %d: releasing pooled handles failed: %s", self.rank, exc)
        return reply

    def _apply_request(self, request: Request) -> Reply:
        if request.op is Op.CLOSE:
            try:
                self.mapper.close()
            except Exception as exc:
                return Reply(request.op, request.txn, remote_error(exc))
            return Reply(request.op, request.txn)
        try:
            pages = self._log.begin(request)
        except KvcoreError as exc:
            return Reply(request.op, request.txn, remote_error(exc))
        try:
            if pages:
                self._transition(request.op, pages)
        except Exception as exc:
            self._log.finish(request, pages, ok=False)
            log.warning(
                "rank %d: %s txn %d failed: %s", self.rank, request.op.name, request.txn, exc
            )
            return Reply(request.op, request.txn, remote_error(exc))
        self._log.finish(request, pages, ok=True)
        return Reply(request.op, request.txn)

    def _transition(self, op: Op, pages: tuple[int, ...]) -> None:
        mapper = self.mapper
        if op is Op.MAP:
            mapper.map(pages)
        elif op is Op.UNDO_MAP:
            mapper.prepare_unmap(pages)
            try:
                mapper.commit_unmap(pages)
            except KvcoreError as exc:  # the mappings are gone; only a release failed
                log.warning("rank %d: undo released pages incompletely: %s", self.rank, exc)
        elif op is Op.PREPARE:
            mapper.prepare_unmap(pages)
        elif op is Op.COMMIT:
            mapper.commit_unmap(pages)
            mapper.trim_pool()  # keep no pool (module docstring)
        elif op is Op.ABORT:
            mapper.abort_unmap(pages)


def remote_error(exc: BaseException) -> RemoteError:
    """``exc`` as a ``RemoteError`` for a ``Reply``."""
    if isinstance(exc, KvcoreError):
        message, hint = exc.message, exc.hint
    else:
        message, hint = str(exc), ""
    call = code = ""
    if isinstance(exc, VmmError):
        call, code = exc.call, str(exc.code)
    page_ids = exc.page_ids if isinstance(exc, PageQuarantined) else ()
    return RemoteError(type(exc).__name__, message, hint, page_ids, call, code)


def _try_send(conn: socket.socket, reply: Reply) -> None:
    with contextlib.suppress(OSError):
        send_message(conn, reply)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _shutdown_quiet(sock: socket.socket | None) -> None:
    if sock is not None:
        _shutdown(sock)


def _expire(conn: socket.socket, expired: threading.Event) -> None:
    """End a handshake that ran past its deadline: its pending ``recv`` returns ``b""``;
    the write side stays open for the refusal."""
    expired.set()
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RD)
