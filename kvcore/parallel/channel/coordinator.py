"""The engine's end of the channel: a ``PageMapper`` that runs every page transition on all
TP x PP workers as one transaction.

The seam an engine integration calls, in the engine process (vLLM: EngineCore)::

    channel_dir = ChannelDirectory.create()       # before the workers start
    os.environ.update(channel_dir.env())          # workers inherit KVCORE_CHANNEL
    ...                                           # workers start WorkerListener(rank=r)
    mapper = ChannelCoordinator(channel_dir, world_size=tp * pp)
    pages = PageAllocator(mapper, ...)            # exactly as with a local mapper
    ...
    pages.close(); mapper.close()                 # workers unmap everything; dir removed

Transactions. Each call gets a fresh transaction id, sends one request carrying all its
page ids to every worker, then gathers the replies (workers apply in parallel). Outcomes:

``map``
    every worker mapped -> mapped. Otherwise every reachable worker is told ``UNDO_MAP``
    and the worker's error is raised (``OutOfDeviceMemory`` stays that type: the page
    allocator's miss). A worker that times out is undone too and ``ChannelError`` raised.
``prepare_unmap``
    every worker prepared -> prepared. Otherwise every reachable worker is told ``ABORT``
    and the error raised; the pages stay mapped everywhere.
``commit_unmap``
    idempotent; pages already unmapped are skipped. A worker's error leaves the pages
    prepared (retry the commit).
``abort_unmap``
    every worker restores the pages -> mapped.

Failures that leave no page mapped on some workers only are raised and the channel goes
on. A rollback (undo or abort) that fails on a worker with a driver error is sent to it
once more; if it fails again (or the worker's own rollback quarantined them), the pages are
quarantined (``PageQuarantined`` with ``page_ids``; ``map`` refuses them from then on). A
quarantined page may be left mapped on some workers: it is never handed out again, and
its memory returns when the workers close. Anything the
coordinator cannot vouch for -- a worker whose connection closed, broke, sent a malformed
frame, or stayed silent through a rollback; a worker reporting ``PoolFailed`` or an
unexpected exception; a commit not completed everywhere -- fails the channel: it closes
every connection and raises ``PoolFailed``, and so does every later call (fail-stop;
restart the engine).

Device memory held (``held_bytes``, what the page allocator charges its memory gate): the
pages mapped, prepared or quarantined here, at the largest worker's ``page_bytes`` (each
worker is on its own GPU; the gate stands for the fullest). Workers keep no handle pool
(``WorkerListener`` releases its mapper's pool after every request that can fill it), so
``pooled_pages`` is 0 and ``trim_pool`` has nothing to do. A quarantined page counts in full
even where some workers did release it. ``fixed_bytes`` is the largest worker's zero page
(from the handshake), which the page allocator charges for its whole life.

Thread safety: calls are serialised by a lock, so the page allocator's refill thread and
the scheduling thread may both call; a transaction holds the lock for one round trip to
the slowest worker. Keep the scheduling thread off refills (the page allocator does).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.errors import (
    BackendUnavailable,
    ChannelError,
    InjectedFault,
    InvalidTransition,
    KvcoreError,
    MalformedMessage,
    OutOfDeviceMemory,
    PageQuarantined,
    PeerRejected,
    PoolFailed,
    TransactionRefused,
    VmmError,
    WorkerLost,
)
from kvcore.memory.mapper import MappingState
from kvcore.parallel.channel.endpoints import ChannelDirectory, check_peer, socket_path
from kvcore.parallel.channel.messages import (
    MAX_FRAME_BYTES,
    FrameReader,
    Hello,
    Op,
    RemoteError,
    Reply,
    Request,
    Welcome,
    encode,
    page_list,
    recv_message,
    send_message,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
"""Seconds a worker may take to answer one request before it is rolled back or failed."""
DEFAULT_CONNECT_TIMEOUT = 120.0
"""Seconds to wait for every worker's socket to appear and answer the handshake."""

_SMALL_FRAME = 32 << 10
"""Frames up to this size always fit an idle Unix socket's send buffer."""
_VMM_ERRORS: dict[str, type[VmmError]] = {
    "VmmError": VmmError,
    "OutOfDeviceMemory": OutOfDeviceMemory,
    "InjectedFault": InjectedFault,
}
_CLEAN_ERRORS: dict[str, type[KvcoreError]] = {
    "TransactionRefused": TransactionRefused,
    "InvalidTransition": InvalidTransition,
    "BackendUnavailable": BackendUnavailable,
}
"""Remote errors after which the worker's mapper is known to be unchanged (besides the VMM
errors, which ``PageMapper`` rolls back before raising)."""


@dataclass
class _Round:
    """What one exchange with the workers produced."""

    replies: dict[int, list[Reply]] = field(default_factory=dict)
    lost: dict[int, ChannelError] = field(default_factory=dict)
    """Ranks whose connection closed, broke or carried garbage."""
    timed_out: set[int] = field(default_factory=set)
    """Ranks that did not answer in time (connection still open)."""

    def errors(self) -> dict[int, RemoteError]:
        """The first error reply of each rank that sent one."""
        out: dict[int, RemoteError] = {}
        for rank, replies in sorted(self.replies.items()):
            for reply in replies:
                if reply.error is not None:
                    out[rank] = reply.error
                    break
        return out

    def all_ok(self, ranks: Iterable[int]) -> bool:
        return (
            not self.lost
            and not self.timed_out
            and not self.errors()
            and all(rank in self.replies for rank in ranks)
        )


# connect() outcomes that mean "not listening (yet)": retried until the deadline
_NOT_LISTENING = (FileNotFoundError, ConnectionRefusedError, BlockingIOError, TimeoutError)


class _Worker:
    def __init__(self, rank: int, sock: socket.socket, welcome: Welcome, reader: FrameReader):
        self.rank = rank
        self.sock = sock
        self.welcome = welcome
        self.reader = reader


class ChannelCoordinator:
    """``PageMapper`` over the worker channel. See the module docstring.

    The constructor connects to every rank ``0 .. world_size-1`` of ``channel_dir``
    (waiting up to ``connect_timeout`` seconds for each socket to appear), checks each
    peer's uid and handshake, and requires every worker to report the same ``num_pages``.
    Raises ``ChannelError`` (``PeerRejected`` for a refused handshake) and closes what it
    opened. ``timeout`` bounds each request round. When ``channel_dir`` is a
    ``ChannelDirectory``, ``close`` removes it."""

    def __init__(
        self,
        channel_dir: ChannelDirectory | Path | str,
        *,
        world_size: int,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        max_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        if world_size < 1:
            raise ChannelError(f"world_size must be at least 1, got {world_size}")
        self._directory = channel_dir if isinstance(channel_dir, ChannelDirectory) else None
        self.path = (
            channel_dir.path if isinstance(channel_dir, ChannelDirectory) else Path(channel_dir)
        )
        self.world_size = world_size
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._failed: PoolFailed | None = None
        self._closed = False
        self._txn = 0
        self._workers: list[_Worker] = []
        self._selector = selectors.DefaultSelector()
        try:
            deadline = time.monotonic() + connect_timeout
            for rank in range(world_size):
                self._workers.append(self._connect(rank, deadline))
        except BaseException:
            self._close_sockets()
            raise
        sizes = {w.welcome.num_pages for w in self._workers}
        if len(sizes) != 1:
            self._close_sockets()
            raise ChannelError(
                "workers disagree on num_pages: "
                + ", ".join(f"rank {w.rank}: {w.welcome.num_pages}" for w in self._workers),
                hint="every rank must cover the same blocks per page id (PP stages scale "
                "page_bytes with their layer count)",
            )
        self._num_pages = sizes.pop()
        self._state = [MappingState.UNMAPPED] * self._num_pages
        self._held_pages = 0  # pages not UNMAPPED: they hold memory on the workers
        self._prepared_txn: dict[int, int] = {}
        for worker in self._workers:
            worker.sock.setblocking(True)
            self._selector.register(worker.sock, selectors.EVENT_READ, worker)

    # ------------------------------------------------------------------ PageMapper

    @property
    def num_pages(self) -> int:
        """Page ids every worker's virtual KV tensors cover."""
        return self._num_pages

    @property
    def page_bytes(self) -> int:
        """The largest per-worker ``page_bytes`` (PP stages may differ; see
        ``worker_page_bytes``)."""
        return max(self.worker_page_bytes)

    @property
    def held_bytes(self) -> int:
        """Device bytes the fullest worker holds: every page not unmapped (module
        docstring)."""
        return self._held_pages * self.page_bytes

    @property
    def fixed_bytes(self) -> int:
        """Device bytes the fullest worker holds whatever the page states (its cache's zero
        page, as its handshake reported it; ``kvcore.memory.mapper``)."""
        return max(w.welcome.fixed_bytes for w in self._workers)

    @property
    def pooled_pages(self) -> int:
        """Always 0: workers keep no handle pool."""
        return 0

    def trim_pool(self) -> None:
        """Nothing to release: workers keep no handle pool."""

    @property
    def worker_page_bytes(self) -> tuple[int, ...]:
        """Each rank's device bytes per mapped page id."""
        return tuple(w.welcome.page_bytes for w in self._workers)

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Each rank's process id, as its handshake reported it."""
        return tuple(w.welcome.pid for w in self._workers)

    @property
    def failed(self) -> PoolFailed | None:
        """Why the channel failed (fail-stop), or ``None``."""
        return self._failed

    def state(self, page_id: int) -> MappingState:
        """The coordinator's view of ``page_id``."""
        return self._state[page_id]

    def map(self, page_ids: Sequence[int]) -> None:
        """Map ``page_ids`` on every worker, or on none (module docstring: ``map``).
        Raises the worker's error after the undo, ``PageQuarantined``, ``PoolFailed``."""
        with self._lock:
            pages = self._checked("map", page_ids, MappingState.UNMAPPED)
            if not pages:
                return
            txn = self._next_txn()
            first = self._exchange({w.rank: [Request(Op.MAP, txn, pages)] for w in self._workers})
            if first.all_ok(self._ranks()):
                self._set(pages, MappingState.MAPPED)
                return
            reachable = [r for r in self._ranks() if r not in first.lost]
            undo = self._rollback({r: [Request(Op.UNDO_MAP, txn)] for r in reachable})
            self._settle("map", pages, first, undo)

    def prepare_unmap(self, page_ids: Sequence[int], *, synchronize: bool = True) -> None:
        """Prepare the unmap of ``page_ids`` on every worker, or on none (module docstring:
        ``prepare_unmap``); the pages stay mapped everywhere when it raises. Every worker
        waits for its device whatever ``synchronize`` says (the protocol allows it; the
        channel carries no such flag)."""
        with self._lock:
            pages = self._checked("prepare_unmap", page_ids, MappingState.MAPPED)
            if not pages:
                return
            txn = self._next_txn()
            first = self._exchange(
                {w.rank: [Request(Op.PREPARE, txn, pages)] for w in self._workers}
            )
            if first.all_ok(self._ranks()):
                self._set(pages, MappingState.PREPARED)
                self._prepared_txn.update(dict.fromkeys(pages, txn))
                return
            reachable = [r for r in self._ranks() if r not in first.lost]
            abort = self._rollback({r: [Request(Op.ABORT, txn, pages)] for r in reachable})
            self._settle("prepare_unmap", pages, first, abort)

    def commit_unmap(self, page_ids: Sequence[int]) -> None:
        """Commit prepared unmaps on every worker; idempotent (module docstring:
        ``commit_unmap``). A worker's error leaves the pages prepared; a worker lost fails
        the channel (``PoolFailed``)."""
        with self._lock:
            groups = self._prepared_groups("commit_unmap", page_ids, skip=MappingState.UNMAPPED)
            if not groups:
                return
            requests = [Request(Op.COMMIT, txn, pages) for txn, pages in groups.items()]
            result = self._exchange({w.rank: list(requests) for w in self._workers})
            pages = tuple(p for group in groups.values() for p in group)
            if result.lost or result.timed_out:
                self._fail_from(result, f"commit_unmap of pages {list(pages)}")
            errors = result.errors()
            if errors:
                self._raise_worker_error("commit_unmap", pages, errors)
            self._set(pages, MappingState.UNMAPPED)
            for page in pages:
                del self._prepared_txn[page]

    def abort_unmap(self, page_ids: Sequence[int]) -> None:
        """Restore prepared pages to mapped on every worker (module docstring:
        ``abort_unmap``)."""
        with self._lock:
            groups = self._prepared_groups("abort_unmap", page_ids, skip=MappingState.MAPPED)
            if not groups:
                return
            requests = [Request(Op.ABORT, txn, pages) for txn, pages in groups.items()]
            result = self._rollback({w.rank: list(requests) for w in self._workers})
            pages = tuple(p for group in groups.values() for p in group)
            for page in pages:
                del self._prepared_txn[page]
            if result.lost or result.timed_out:
                self._fail_from(result, f"abort_unmap of pages {list(pages)}")
            errors = result.errors()
            if errors:
                self._quarantine_or_fail("abort_unmap", pages, errors)
            self._set(pages, MappingState.MAPPED)

    def close(self) -> None:
        """Tell every worker to unmap and release everything, then close the connections
        and remove the channel directory (if this coordinator was given the
        ``ChannelDirectory``). Idempotent; after a failure only the local cleanup runs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._failed is None:
                    result = self._exchange(
                        {w.rank: [Request(Op.CLOSE, self._next_txn())] for w in self._workers}
                    )
                    for rank, err in result.errors().items():
                        log.error("rank %d failed to close its mapper: %s", rank, err.message)
            finally:
                self._close_sockets()
                if self._directory is not None:
                    self._directory.remove()

    # ------------------------------------------------------------------ connection

    def _connect(self, rank: int, deadline: float) -> _Worker:
        """Connect to rank ``rank``'s worker and handshake by ``deadline`` (monotonic):
        no socket yet, a refusal or a full backlog is retried until then. Raises
        ``WorkerLost``, ``PeerRejected``, ``MalformedMessage``."""
        path = str(socket_path(self.path, rank))
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # a worker whose backlog is full would block a plain connect past the deadline
            sock.settimeout(max(deadline - time.monotonic(), 0.05))
            try:
                sock.connect(path)
                break
            except (
                FileNotFoundError,
                ConnectionRefusedError,
                BlockingIOError,
                TimeoutError,
            ) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise WorkerLost(
                        f"rank {rank}: no worker listening at {path}: {exc}",
                        rank=rank,
                        hint="start a WorkerListener for every rank, or raise connect_timeout",
                    ) from None
                time.sleep(0.02)
        try:
            check_peer(sock)
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            send_message(sock, Hello(rank, self.world_size, self.path.name))
            reader = FrameReader(max_bytes=self.max_bytes)
            answer = recv_message(sock, reader)
        except TimeoutError:
            sock.close()
            raise WorkerLost(
                f"rank {rank}: no answer to the handshake at {path} before the deadline",
                rank=rank,
                hint="the worker is stuck or overloaded; raise connect_timeout or restart it",
            ) from None
        except BaseException:
            sock.close()
            raise
        if isinstance(answer, Welcome) and answer.rank == rank:
            return _Worker(rank, sock, answer, reader)
        sock.close()
        if isinstance(answer, Reply) and answer.error is not None:
            raise PeerRejected(f"rank {rank} refused the handshake: {answer.error.message}")
        raise MalformedMessage(f"rank {rank} answered the handshake with {answer!r}")

    def _close_sockets(self) -> None:
        self._selector.close()
        for worker in self._workers:
            with contextlib.suppress(OSError):
                worker.sock.close()

    # ------------------------------------------------------------------ exchange

    def _exchange(self, requests: dict[int, list[Request]]) -> _Round:
        """Send every rank its requests, then gather one reply per request (in order)
        until ``timeout``."""
        result = _Round()
        pending: dict[int, list[tuple[Op, int]]] = {}
        frames: dict[tuple[Request, ...], bytes] = {}  # most ranks get the same requests
        for rank, reqs in requests.items():
            batch = tuple(reqs)
            frame = frames.get(batch)
            if frame is None:
                frame = frames[batch] = b"".join(encode(r) for r in reqs)
            if len(frame) > len(reqs) * self.max_bytes:
                raise ChannelError(
                    f"a {reqs[0].op.name} request of {len(reqs[0].pages)} pages exceeds the "
                    f"{self.max_bytes}-byte frame cap",
                    hint="pass fewer pages per call",
                )
            try:
                self._send(self._workers[rank].sock, frame)
            except OSError as exc:
                result.lost[rank] = self._lost(rank, f"send failed: {exc}")
                continue
            pending[rank] = [(r.op, r.txn) for r in reqs]
            result.replies[rank] = []
        deadline = time.monotonic() + self.timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.timed_out.update(pending)
                for rank in pending:
                    result.replies.pop(rank, None)
                break
            for key, _ in self._selector.select(remaining):
                worker: _Worker = key.data
                self._drain(worker, pending, result)
        return result

    def _send(self, sock: socket.socket, frame: bytes) -> None:
        """Sockets stay in blocking mode (no poll per call on the hot path); a frame that
        may not fit the socket buffer is sent under the timeout, so a stuck worker cannot
        block the coordinator."""
        if len(frame) <= _SMALL_FRAME:
            sock.sendall(frame)
            return
        sock.settimeout(self.timeout)
        try:
            sock.sendall(frame)
        finally:
            sock.setblocking(True)

    def _drain(
        self, worker: _Worker, pending: dict[int, list[tuple[Op, int]]], result: _Round
    ) -> None:
        rank = worker.rank
        try:
            data = worker.sock.recv(1 << 16)
        except OSError as exc:
            data, error = b"", f"receive failed: {exc}"
        else:
            error = "connection closed"
        try:
            if not data:
                raise self._lost(rank, error)
            worker.reader.feed(data)
            while (message := worker.reader.pop()) is not None:
                if not isinstance(message, Reply):
                    raise MalformedMessage(f"rank {rank} sent {type(message).__name__}")
                expected = pending.get(rank)
                if expected and (message.op, message.txn) == expected[0]:
                    result.replies[rank].append(message)
                    expected.pop(0)
                    if not expected:
                        del pending[rank]
                elif message.op is Op.HELLO:  # the worker ended the session
                    detail = message.error.message if message.error else "no reason"
                    raise self._lost(rank, f"worker ended the session: {detail}")
                else:
                    log.info(
                        "rank %d: late reply to %s txn %d dropped",
                        rank,
                        message.op.name,
                        message.txn,
                    )
        except ChannelError as exc:
            lost = exc if isinstance(exc, WorkerLost) else self._lost(rank, str(exc))
            result.lost[rank] = lost
            result.replies.pop(rank, None)
            pending.pop(rank, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(worker.sock)

    def _rollback(self, requests: dict[int, list[Request]]) -> _Round:
        """``_exchange`` for a rollback (undo, abort): a rank whose rollback failed with a
        driver error gets it once more (the worker's log makes the retry apply only what
        is still undone); the second answer counts."""
        result = self._exchange(requests)
        retry = {
            rank: requests[rank] for rank, err in result.errors().items() if err.type in _VMM_ERRORS
        }
        if not retry:
            return result
        log.warning("retrying a failed rollback on ranks %s", sorted(retry))
        again = self._exchange(retry)
        for rank in retry:
            result.replies.pop(rank, None)
            if rank in again.lost:
                result.lost[rank] = again.lost[rank]
            elif rank in again.timed_out:
                result.timed_out.add(rank)
            else:
                result.replies[rank] = again.replies[rank]
        return result

    def _lost(self, rank: int, why: str) -> WorkerLost:
        return WorkerLost(
            f"rank {rank} (pid {self._workers[rank].welcome.pid}): {why}",
            rank=rank,
            hint="the worker process died or is not a kvcore worker; restart the engine",
        )

    # ------------------------------------------------------------------ outcomes

    def _settle(self, what: str, pages: tuple[int, ...], first: _Round, rollback: _Round) -> None:
        """After a failed first phase and its rollback: raise what the caller must see."""
        if first.lost or rollback.lost or rollback.timed_out:
            self._fail_from(first if first.lost else rollback, f"{what} of pages {list(pages)}")
        rollback_errors = rollback.errors()
        if rollback_errors:
            self._quarantine_or_fail(f"rollback of {what}", pages, rollback_errors)
        errors = first.errors()
        if errors:
            self._raise_worker_error(what, pages, errors)
        slow = sorted(first.timed_out)
        raise ChannelError(
            f"{what} of pages {list(pages)}: ranks {slow} did not answer within "
            f"{self.timeout}s; rolled back on every worker",
            hint="retry; raise the coordinator's timeout if workers are this slow",
        )

    def _raise_worker_error(
        self, what: str, pages: tuple[int, ...], errors: dict[int, RemoteError]
    ) -> None:
        """Raise the first worker's error, after quarantining or failing as it implies."""
        for rank, err in errors.items():
            if err.type == "PageQuarantined":
                self._quarantine_or_fail(what, pages, {rank: err})
            if err.type not in _VMM_ERRORS and err.type not in _CLEAN_ERRORS:
                self._fail(f"{what}: rank {rank} raised {err.type}: {err.message}")
        rank, err = next(iter(errors.items()))
        raise _rebuild(rank, err)

    def _quarantine_or_fail(
        self, what: str, pages: tuple[int, ...], errors: dict[int, RemoteError]
    ) -> None:
        for rank, err in errors.items():
            if err.type not in ("PageQuarantined", *_VMM_ERRORS):
                self._fail(f"{what}: rank {rank} raised {err.type}: {err.message}")
        named = {p for err in errors.values() for p in err.page_ids if p in pages}
        bad = tuple(sorted(named)) if named else pages
        self._set(bad, MappingState.QUARANTINED)
        for page in bad:
            self._prepared_txn.pop(page, None)
        detail = "; ".join(f"rank {r}: {e.type}: {e.message}" for r, e in errors.items())
        raise PageQuarantined(
            f"{what}: pages {list(bad)} quarantined after a failed rollback ({detail})",
            page_ids=bad,
            hint="capacity drops by these pages; the engine continues",
        )

    def _fail_from(self, result: _Round, what: str) -> None:
        causes = [str(e) for e in result.lost.values()]
        causes += [f"rank {r} timed out after {self.timeout}s" for r in sorted(result.timed_out)]
        self._fail(f"{what}: " + "; ".join(causes))

    def _fail(self, why: str) -> None:
        self._failed = PoolFailed(
            f"worker channel failed: {why}",
            hint="restart the engine; the workers' pages die with their processes",
        )
        log.error("%s", self._failed)
        self._close_sockets()
        raise self._failed

    # ------------------------------------------------------------------ bookkeeping

    def _ranks(self) -> range:
        return range(self.world_size)

    def _next_txn(self) -> int:
        self._txn += 1
        return self._txn

    def _alive(self) -> None:
        if self._failed is not None:
            raise PoolFailed(self._failed.message, hint=self._failed.hint)
        if self._closed:
            raise ChannelError("the worker channel is closed", hint="create a new coordinator")

    def _checked(self, what: str, page_ids: Sequence[int], wanted: MappingState) -> tuple[int, ...]:
        self._alive()
        pages = page_list(page_ids)
        self._check_range(what, pages)
        quarantined = [p for p in pages if self._state[p] is MappingState.QUARANTINED]
        if quarantined:
            raise PageQuarantined(
                f"{what}: pages {quarantined} are quarantined", page_ids=quarantined
            )
        wrong = [p for p in pages if self._state[p] is not wanted]
        if wrong:
            raise InvalidTransition(
                f"{what}: pages {wrong} are {[self._state[p].value for p in wrong]}, "
                f"not {wanted.value}",
                ids=wrong,
            )
        return pages

    def _prepared_groups(
        self, what: str, page_ids: Sequence[int], *, skip: MappingState
    ) -> dict[int, tuple[int, ...]]:
        """Prepared ``page_ids`` grouped by their prepare's txn; ``skip`` pages (already
        where the call leads) are left out; any other state raises ``InvalidTransition``."""
        self._alive()
        pages = page_list(page_ids)
        self._check_range(what, pages)
        groups: dict[int, list[int]] = {}
        wrong: list[int] = []
        for page in pages:
            state = self._state[page]
            if state is MappingState.PREPARED:
                groups.setdefault(self._prepared_txn[page], []).append(page)
            elif state is not skip:
                wrong.append(page)
        if wrong:
            raise InvalidTransition(f"{what}: pages {wrong} are not prepared for unmap", ids=wrong)
        return {txn: tuple(group) for txn, group in groups.items()}

    def _check_range(self, what: str, pages: tuple[int, ...]) -> None:
        bad = [p for p in pages if not 0 <= p < self._num_pages]
        if bad or len(set(pages)) != len(pages):
            raise InvalidTransition(
                f"{what}: page ids must be distinct and in [0, {self._num_pages}); got "
                f"{list(pages)}",
                ids=bad,
            )

    def _set(self, pages: Iterable[int], state: MappingState) -> None:
        held = state is not MappingState.UNMAPPED
        for page in pages:
            self._held_pages += held - (self._state[page] is not MappingState.UNMAPPED)
            self._state[page] = state

    def __repr__(self) -> str:
        status = "failed" if self._failed else "closed" if self._closed else "open"
        return (
            f"ChannelCoordinator({str(self.path)!r}, world_size={self.world_size}, "
            f"num_pages={self._num_pages}, {status})"
        )


def _rebuild(rank: int, err: RemoteError) -> KvcoreError:
    """The exception a worker raised, rebuilt on this side with its rank in the message."""
    vmm = _VMM_ERRORS.get(err.type)
    if vmm is not None:
        return vmm(f"rank {rank}: {err.call or err.message}", {}, err.code, hint=err.hint)
    clean = _CLEAN_ERRORS.get(err.type)
    if clean is not None:
        return clean(f"rank {rank}: {err.message}", hint=err.hint)
    return ChannelError(f"rank {rank}: {err.type}: {err.message}", hint=err.hint)
