"""A soak of the per-GPU ledger, page allocator and worker channel under abuse, on CPU
(issue 19).

``--instances`` kvcore instances (processes on the ``host`` backend) share one per-GPU
ledger in a private directory for ``--seconds``. Each is a synthetic one (``LedgerGate`` ->
``PageAllocator`` -> ``BlockLedger``, allocating and freeing random blocks) or, ``--vllm K``
of them, a real vLLM 0.33 ``Scheduler`` with kvcore's ``ElasticBlockPool`` on the same
ledger, stepping requests with a fake model output (run the soak with the ``test-vllm-0.33``
venv's Python then). Meanwhile the controller, at random: kills a serving instance (one
whose record is in the ledger; a vLLM one once it has stepped) with SIGKILL and starts a new
one of the same kind, changes instance limits and the GPU budget, and holds the ledger's
lock for up to a second, now and then for 6 s (a stopped ``kvctl``). It samples the ledger
all along.

With ``--channel`` a TP=2 instance joins them for the whole soak: a ``ChannelCoordinator``
(under the same ledger, gate, allocator and random load) over two real worker processes,
and a hostile process that, for as long, attacks it two ways:

* hostile peers on the workers' sockets while the real session runs: garbage, deeply nested
  or oversized or wrong-version frames, a request with a wrong page count, a request before
  any Hello, Hellos for another rank or a second session, a handshake trickled byte by byte,
  silence, ``3 x MAX_HANDSHAKES`` connections at once, and connections that vanish;
* hostile workers facing fresh coordinators: garbage, deeply nested, wrong-rank or
  2^60-page Welcomes, two ranks disagreeing on ``num_pages``, silence after the Hello, and
  garbage, oversized or no replies in session.

At the end it stops every instance and checks:

* while the GPU total the ledger shows is above the budget, it never grows (a budget lowered
  under use is deferred by design: no instance gets new memory until the total is under
  it): ``over_budget`` counts samples where it grew;
* every instance either was serving when stopped (it answers SIGTERM by closing cleanly and
  exiting 0) or fail-stopped with a message (a non-zero exit and a line on stderr), at the
  end or during the soak (``exits_during_soak``: each is counted and replaced at once);
  ``silent`` counts any other outcome; an instance that closed cleanly left no record
  (``records_left_by_clean_exits``);
* after the last instance is gone, the ledger holds no record and no memory
  (``leaked_records``, ``leaked_bytes``);
* with ``--vllm``: the vLLM instances stepped (``vllm_steps``) and finished requests;
* with ``--channel``: the coordinator served to the end (``channel_maps`` kept succeeding
  after every hostile act: ``acts_without_later_map``; no map failed), each hostile peer
  got the refusal the channel documents (``MalformedMessage``, ``OversizedMessage``,
  ``VersionMismatch``, ``PeerRejected`` for a wrong rank, a second session, the handshake
  deadline or ``MAX_HANDSHAKES``) and each hostile worker the coordinator error it
  documents (``MalformedMessage``, ``ChannelError``, ``WorkerLost``, ``PoolFailed``):
  ``unexpected`` lists any other; the workers refused exactly the hostile connections
  (``unaccounted_connections``); and no thread, file descriptor, channel directory or
  mapped page was left in the coordinator, the workers or the hostile process (``leaks``).

    python -m benchmarks.hardening_soak --seconds 60 --json F
    .nox/test-vllm-0-33/bin/python -m benchmarks.hardening_soak \\
        --seconds 60 --vllm 1 --channel --json F

Prints the counts and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

MiB = 1 << 20
DEVICE = 256 * MiB
GRAN = 64 << 10
ROOT = Path(__file__).resolve().parents[1]
SELF = [sys.executable, "-m", "benchmarks.hardening_soak"]
"""How the soak starts its own processes (each a role of this module, chosen by argv)."""
WORLD = 2  # ranks of the channel instance

_STOP = threading.Event()


def _on_term(*_: object) -> None:
    _STOP.set()


def device_uuid() -> str:
    """The host backend's device 0: the ledger every kind of instance registers in."""
    from kvcore.vmm.host import HostBackend

    return HostBackend(device_bytes=DEVICE, granularity=GRAN).device_uuid()


def _geometry() -> Any:
    from kvcore.memory.geometry import KVGeometry

    return KVGeometry(
        num_layers=1, kv_buffers=1, block_bytes=GRAN // 4, num_blocks=4 * 256,
        page_bytes=GRAN, granularity=GRAN,
    )  # fmt: skip


def _churn(blocks: Any, rng: random.Random, live: list[list[int]]) -> None:
    """One step of the random load: free a random live allocation or allocate 1-63 blocks."""
    if live and rng.random() < 0.45:
        blocks.free(live.pop(rng.randrange(len(live))))
    else:
        got = blocks.alloc(rng.randrange(1, 64))
        if got is not None:
            live.append(got)
    time.sleep(0.0005)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _other_threads() -> list[str]:
    """Names of this process's live threads but the main one, after joining each briefly
    (threads that are ending are not leaks)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(timeout=5)
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())


def _write_json(path: Path, doc: Any) -> None:
    """Replace ``path`` with ``doc`` atomically (a reader sees the old or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- instances


def instance(name: str, state: Path) -> int:
    """One synthetic instance's body (``--instance NAME STATE``): the random load on
    ``LedgerGate`` -> ``PageAllocator`` -> ``BlockLedger`` until SIGTERM. Creates ``state``
    once its record is in the ledger (the controller kills only instances that have one).
    Returns 0 after a clean close, 3 after a fail-stop (said on stderr)."""
    from kvcore.budget import GpuLedger, LedgerGate
    from kvcore.errors import KvcoreError
    from kvcore.memory.blocks import BlockLedger
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.pages import PageAllocator
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm.host import HostBackend

    backend = HostBackend(device_bytes=DEVICE, granularity=GRAN)
    geometry = _geometry()
    signal.signal(signal.SIGTERM, _on_term)
    rng = random.Random(os.getpid())
    live: list[list[int]] = []
    try:  # registering may meet the ledger locked too long: a fail-stop too
        ledger = GpuLedger.open(device_uuid(), device_total=DEVICE)
        gate = LedgerGate(ledger, name=name, engine="soak")
        cache = VirtualKVCache(backend, geometry)
        mapper = LocalPageMapper(cache)
        pages = PageAllocator(mapper, gate, reserve_min=1, reserve_max=4)
        blocks = BlockLedger(geometry, pages)
        _write_json(state, {})
        while not _STOP.is_set():
            _churn(blocks, rng, live)
        for ids in live:
            blocks.free(ids)
        pages.close()
        mapper.close()
        cache.close()
        gate.close()
        ledger.close()
        backend.close()
        return 0
    except KvcoreError as exc:  # fail-stop: say why, leave the rest to the ledger's sweep
        print(f"{name}: fail-stop: {exc}", file=sys.stderr, flush=True)
        return 3


def vllm_instance(name: str, state: Path) -> int:
    """A real vLLM 0.33 scheduler's body (``--vllm-instance NAME``): kvcore's
    ``ElasticBlockPool`` on the host backend and the soak's ledger (256 blocks of 64 KiB,
    one a page, prefix caching on), kept at 8 requests of random lengths, half sharing a
    prefix, stepped with a fake model output until SIGTERM. Writes its step and
    finished-request counts to ``state`` every 20 steps (so a SIGKILLed one still counts;
    the file's existence tells the controller it is serving) and at the end. Returns 0
    after a clean close, 3 after a fail-stop (said on stderr)."""
    signal.signal(signal.SIGTERM, _on_term)  # before the imports: they take seconds
    from harness.vllm.scheduler import SPEC_64K, make_request, make_scheduler, step
    from kvcore.errors import KvcoreError

    settings = {
        "backend": "host",
        "backend_options": {"granularity": GRAN, "device_bytes": DEVICE},
        "gpu_ledger": True,  # the ledger directory comes from KVCORE_LEDGER_DIR
    }
    rng = random.Random(os.getpid())
    shared = [rng.randrange(1, 30_000) for _ in range(48)]
    steps = added = 0
    try:
        scheduler = make_scheduler(
            256, caching=True, max_num_seqs=8, kvcore=settings, spec=SPEC_64K
        )
        pool = scheduler.kv_cache_manager.block_pool
        if type(pool).__name__ != "ElasticBlockPool":  # upstream vLLM ignores the settings
            print(f"{name}: vLLM built a {type(pool).__name__}: not the forked vLLM",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 2
        while not _STOP.is_set():
            while scheduler.get_num_unfinished_requests() < 8:
                tokens = [rng.randrange(1, 30_000) for _ in range(rng.randrange(16, 160))]
                prompt = [*shared, *tokens] if added % 2 else tokens
                scheduler.add_request(
                    make_request(f"{name}-{added}", prompt, max_tokens=rng.randrange(4, 64))
                )
                added += 1
            step(scheduler)
            steps += 1
            if steps % 20 == 1:
                finished = added - scheduler.get_num_unfinished_requests()
                _write_json(state, {"steps": steps, "finished": finished})
        finished = added - scheduler.get_num_unfinished_requests()
        pool.close()  # every page unmapped, the ledger record removed
        _write_json(state, {"steps": steps, "finished": finished})
        return 0
    except KvcoreError as exc:
        print(f"{name}: fail-stop: {exc}", file=sys.stderr, flush=True)
        return 3


# ----------------------------------------------------------------------------- channel


def channel_worker(channel_dir: Path, rank: int, report: Path, handshake: float) -> int:
    """One channel worker's body (``--channel-worker DIR RANK REPORT``): a host-backed
    ``LocalPageMapper`` behind a ``WorkerListener`` until the coordinator's ``CLOSE`` (or
    its parent process is gone). Writes ``report``: sessions, refusals by kind, and what
    was left after the close (mapped pages, handles, threads, file descriptors). Returns
    0."""
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.parallel.channel import WorkerListener
    from kvcore.vmm.host import HostBackend

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the coordinator's CLOSE ends a worker
    parent = os.getppid()
    backend = HostBackend(device_bytes=DEVICE, granularity=GRAN)
    cache = VirtualKVCache(backend, _geometry())
    mapper = LocalPageMapper(cache)
    fds0 = _fds()
    listener = WorkerListener(
        mapper, rank=rank, channel_dir=channel_dir, handshake_timeout=handshake
    ).start()
    refusals: Counter[str] = Counter()

    def drain() -> None:
        while listener.rejected:
            refusals[refusal_kind(listener.rejected.popleft())] += 1

    while not listener.wait_closed(0.2) and os.getppid() == parent:
        drain()
    listener.close()
    drain()
    pages_left = backend.live_handles - 1  # the cache's zero page stays until cache.close
    threads_left = _other_threads()
    fds_left = _fds() - fds0
    mapper.close()
    cache.close()
    _write_json(
        report,
        {
            "rank": rank,
            "sessions": listener.sessions,
            "refused": listener.refused,
            "refusals": dict(refusals),
            "pages_left": pages_left,
            "handles_left": backend.live_handles,
            "threads_left": threads_left,
            "fds_left": fds_left,
        },
    )
    backend.close()
    return 0


def channel_engine(base: Path, report: Path, handshake: float) -> int:
    """The engine side of a TP=2 instance (``--channel-engine BASE REPORT``): a
    ``ChannelCoordinator`` over ``WORLD`` worker processes it starts, under ``LedgerGate`` ->
    ``PageAllocator`` -> ``BlockLedger`` and the random load, until SIGTERM. Prints its
    channel directory on stdout once serving. Writes ``report``: each successful page map's
    time (``time.monotonic``, which every process on the machine shares), map failures by
    type, what was left after the close (held bytes, the directory, threads, file
    descriptors) and the workers' reports. Returns 0 after a clean close, 3 after a
    fail-stop (said on stderr)."""
    from kvcore.budget import GpuLedger, LedgerGate
    from kvcore.errors import KvcoreError
    from kvcore.memory.blocks import BlockLedger
    from kvcore.memory.pages import PageAllocator
    from kvcore.parallel.channel import ChannelCoordinator, ChannelDirectory

    map_times: list[float] = []
    map_errors: Counter[str] = Counter()

    class Counted(ChannelCoordinator):
        """Records the outcome of every page map the allocator asks for."""

        def map(self, page_ids: Any) -> None:
            try:
                super().map(page_ids)
            except KvcoreError as exc:
                map_errors[type(exc).__name__] += 1
                raise
            map_times.append(time.monotonic())

    signal.signal(signal.SIGTERM, _on_term)
    uuid = device_uuid()
    fds0 = _fds()
    directory = ChannelDirectory.create(base)
    workers: list[subprocess.Popen[bytes]] = []
    for rank in range(WORLD):
        rank_report = report.with_name(f"{report.name}.rank{rank}")
        argv = ["--channel-worker", str(directory.path), str(rank), str(rank_report)]
        argv += ["--handshake-timeout", str(handshake)]
        with rank_report.with_name(rank_report.name + ".err").open("wb") as err:  # not a pipe
            workers.append(subprocess.Popen([*SELF, *argv], stderr=err))
    code, held = 0, -1
    try:
        coordinator = Counted(directory, world_size=WORLD, timeout=10.0, connect_timeout=60.0)
        ledger = GpuLedger.open(uuid, device_total=DEVICE)
        gate = LedgerGate(ledger, name="channel", engine="soak-channel")
        pages = PageAllocator(coordinator, gate, reserve_min=1, reserve_max=4)
        blocks = BlockLedger(_geometry(), pages)
        print(directory.path, flush=True)
        rng = random.Random(os.getpid())
        live: list[list[int]] = []
        while not _STOP.is_set():
            _churn(blocks, rng, live)
        for ids in live:
            blocks.free(ids)
        pages.close()
        held = coordinator.held_bytes
        coordinator.close()  # every worker unmaps everything; the directory goes
        gate.close()
        ledger.close()
    except KvcoreError as exc:
        print(f"channel: fail-stop: {exc}", file=sys.stderr, flush=True)
        code = 3
    finally:
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        directory.remove()
    ranks = []
    for rank in range(WORLD):
        path = report.with_name(f"{report.name}.rank{rank}")
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    _write_json(
        report,
        {
            "map_times": map_times,
            "map_errors": dict(map_errors),
            "held_bytes_at_close": held,
            "threads_left": _other_threads(),
            "fds_left": _fds() - fds0,
            "workers": ranks,
        },
    )
    return code


# ----------------------------------------------------------------------------- hostile peers

PEER_KINDS = (
    "garbage", "deep_json", "oversized", "wrong_version", "bad_count", "no_hello",
    "wrong_rank", "second_session", "trickle", "silent", "flood", "truncated", "vanish",
)  # fmt: skip
"""Hostile connections to a worker's socket (``hostile_peer``)."""

PEER_EXPECTED: dict[str, frozenset[str]] = {
    "garbage": frozenset({"MalformedMessage"}),
    "deep_json": frozenset({"MalformedMessage"}),
    "oversized": frozenset({"OversizedMessage"}),
    "wrong_version": frozenset({"VersionMismatch"}),
    "bad_count": frozenset({"MalformedMessage"}),
    "no_hello": frozenset({"MalformedMessage"}),
    "wrong_rank": frozenset({"PeerRejected"}),
    "second_session": frozenset({"PeerRejected"}),
    "trickle": frozenset({"PeerRejected"}),  # the handshake deadline
    "silent": frozenset({"PeerRejected"}),  # the handshake deadline
    "flood": frozenset({"PeerRejected"}),  # MAX_HANDSHAKES, or the deadline
    "truncated": frozenset({"vanished"}),
    "vanish": frozenset({"vanished"}),
}
"""What the worker answers each kind with, as the peer sees it (``vanished``: the peer
left before any answer)."""


def _frame(
    kind: int, body: bytes, *, version: int | None = None, length: int | None = None
) -> bytes:
    from kvcore.parallel.channel.messages import MAGIC, SCHEMA_VERSION

    ver = SCHEMA_VERSION if version is None else version
    size = len(body) if length is None else length
    return struct.pack("!4sHBBI", MAGIC, ver, kind, 0, size) + body


def _await_refusal(sock: socket.socket, reader: Any, wait: float) -> str:
    """What the worker answers on ``sock`` within ``wait`` seconds: the error type its
    refusal names, ``closed`` (closed with no answer), ``held`` (nothing yet), or
    ``accepted:<message type>`` (a hostile peer was served)."""
    from kvcore.errors import KvcoreError
    from kvcore.parallel.channel.messages import Reply, recv_message

    sock.settimeout(wait)
    try:
        message = recv_message(sock, reader)
    except TimeoutError:
        return "held"
    except (OSError, KvcoreError):
        return "closed"
    if message is None:
        return "closed"
    if isinstance(message, Reply) and message.error is not None:
        return message.error.type
    return f"accepted:{type(message).__name__}"


def hostile_peer(path: Path, kind: str, *, rank: int, deadline: float) -> list[str]:
    """Attack the worker of ``rank`` listening at ``path`` with one hostile connection of
    ``kind`` (``PEER_KINDS``; ``flood``: ``3 x MAX_HANDSHAKES`` at once), its handshake
    deadline being ``deadline`` seconds. Returns each connection's outcome: what
    ``_await_refusal`` saw within ``4 x deadline + 2`` seconds, ``vanished`` (the peer left
    first) or ``connect_failed`` (it never reached the worker)."""
    from kvcore.parallel.channel.messages import FrameReader, Hello, Kind, Op, Request, encode
    from kvcore.parallel.channel.worker import MAX_HANDSHAKES

    wait = 4 * deadline + 2
    count = 3 * MAX_HANDSHAKES if kind == "flood" else 1
    socks: list[socket.socket] = []
    outcomes: list[str] = []
    try:
        for _ in range(count):
            sock = _connect(path, wait)
            if sock is None:
                outcomes.append("connect_failed")
            else:
                socks.append(sock)
        payload = {
            "garbage": b"\xff" + os.urandom(63),
            "deep_json": _frame(Kind.HELLO, b"[" * 100_000),
            "oversized": _frame(Kind.HELLO, b"", length=1 << 30),
            "wrong_version": _frame(Kind.HELLO, b"{}", version=0xFFFF),
            "bad_count": _frame(Kind.REQUEST, struct.pack("!BQI", Op.MAP, 1, 1000) + bytes(8)),
            "no_hello": encode(Request(Op.MAP, 1, (0,))),
            "wrong_rank": encode(Hello(rank + 1, WORLD, "hostile")),
            "second_session": encode(Hello(rank, WORLD, "hostile")),
            "truncated": encode(Hello(rank, WORLD, "hostile"))[:20],
        }.get(kind, b"")
        for sock in socks:
            reader = FrameReader()
            with contextlib.suppress(OSError):  # refused before it read everything
                sock.sendall(payload)
            if kind in ("truncated", "vanish"):
                outcomes.append("vanished")
            elif kind == "trickle":
                outcomes.append(_trickle(sock, reader, deadline, wait))
            else:
                outcomes.append(_await_refusal(sock, reader, wait))
    finally:
        for sock in socks:
            sock.close()
    return outcomes


def _connect(path: Path, wait: float) -> socket.socket | None:
    """A connection to ``path``, retried while the listener's backlog is full (the kernel
    refuses at once then) for up to ``wait`` seconds; ``None`` if none was made."""
    end = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(wait)
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= end:
                return None
            time.sleep(0.01)
        except OSError:
            sock.close()
            return None


def _trickle(sock: socket.socket, reader: Any, deadline: float, wait: float) -> str:
    """A header announcing a 1,000-byte Hello, then a byte every ``deadline / 5`` seconds
    until the worker answers or stops reading."""
    from kvcore.parallel.channel.messages import Kind

    with contextlib.suppress(OSError):
        sock.sendall(_frame(Kind.HELLO, b"", length=1000))
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            sock.send(b" ")
        except OSError:  # the worker stopped reading: its refusal is on the way
            break
        outcome = _await_refusal(sock, reader, deadline / 5)
        if outcome != "held":
            return outcome
    return _await_refusal(sock, reader, 2.0)


def refusal_kind(reason: str) -> str:
    """How a worker refused a connection, from one entry of ``WorkerListener.rejected``:
    ``MAX_HANDSHAKES``, ``handshake deadline``, ``wrong rank``, ``second session``, or the
    refusal's error type."""
    for text, kind in (
        ("MAX_HANDSHAKES", "MAX_HANDSHAKES"),
        ("handshake deadline", "handshake deadline"),
        ("reached rank", "wrong rank"),
        ("already serves a coordinator session", "second session"),
    ):
        if text in reason:
            return kind
    return reason.split(":", 1)[0]


# ----------------------------------------------------------------------------- hostile workers

WORKER_EXPECTED = {
    "garbage_welcome": "MalformedMessage",
    "deep_welcome": "MalformedMessage",
    "wrong_rank_welcome": "MalformedMessage",
    "huge_num_pages": "MalformedMessage",
    "disagreeing_num_pages": "ChannelError",
    "silent": "WorkerLost",
    "garbage_reply": "PoolFailed",
    "oversized_reply": "PoolFailed",
    "no_reply": "PoolFailed",
}
"""Hostile workers (``hostile_worker``) and the error their coordinator raises: at the
handshake (it refuses the channel) or at the first map (it fails the channel: fail-stop)."""


class _StandIn:
    """A hostile worker serving rank ``rank``'s socket in ``directory`` from a thread: reads
    the Hello, then sends ``welcome`` (``None``: stays silent until the coordinator gives
    up), then reads one request and sends ``reply`` (``None``: closes the connection)."""

    def __init__(self, directory: Path, rank: int, welcome: bytes | None, reply: bytes | None):
        from kvcore.parallel.channel import socket_path

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(socket_path(directory, rank)))
        self.sock.listen(1)
        self.sock.settimeout(30)
        self.welcome, self.reply = welcome, reply
        self.thread = threading.Thread(target=self._serve, name=f"soak-standin-{rank}")
        self.thread.start()

    def _serve(self) -> None:
        from kvcore.errors import KvcoreError
        from kvcore.parallel.channel.messages import FrameReader, recv_message

        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn, contextlib.suppress(OSError, KvcoreError):
            conn.settimeout(30)
            reader = FrameReader()
            recv_message(conn, reader)  # the Hello
            if self.welcome is None:
                conn.recv(1)  # until the coordinator closes
                return
            conn.sendall(self.welcome)
            if recv_message(conn, reader) is not None and self.reply is not None:
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=35)


def hostile_worker(base: Path, kind: str, *, deadline: float) -> str:
    """Start a coordinator on a fresh channel directory under ``base`` whose workers are
    stand-ins, rank 0 hostile as ``kind`` says (``WORKER_EXPECTED``; for
    ``disagreeing_num_pages`` rank 1 is), with ``deadline`` seconds for the handshake and
    each request. Map one page on it if it starts, then close it. Returns the type of the
    error the coordinator raised (``served``: none). Removes the directory."""
    from kvcore.errors import KvcoreError
    from kvcore.parallel.channel import ChannelCoordinator
    from kvcore.parallel.channel.messages import Kind, Op, Reply, Welcome, encode

    def welcome(rank: int, num_pages: int = 8) -> bytes:
        return encode(Welcome(rank, os.getpid(), num_pages, GRAN))

    ok = encode(Reply(Op.MAP, 1))
    script: dict[str, list[tuple[bytes | None, bytes | None]]] = {
        "garbage_welcome": [(b"\xff" + os.urandom(63), ok)],
        "deep_welcome": [(_frame(Kind.WELCOME, b"[" * 100_000), ok)],
        "wrong_rank_welcome": [(welcome(5), ok)],
        "huge_num_pages": [(_huge_welcome(), ok)],
        "disagreeing_num_pages": [(welcome(0), ok), (welcome(1, 9), ok)],
        "silent": [(None, None)],
        "garbage_reply": [(welcome(0), b"\xff" + os.urandom(63))],
        "oversized_reply": [(welcome(0), _frame(Kind.REPLY, b"", length=1 << 30))],
        "no_reply": [(welcome(0), None)],
    }
    directory = Path(tempfile.mkdtemp(prefix="w", dir=base))
    stand_ins = [_StandIn(directory, r, w, rep) for r, (w, rep) in enumerate(script[kind])]
    outcome = "served"
    try:
        coordinator = ChannelCoordinator(
            directory, world_size=len(stand_ins), timeout=deadline, connect_timeout=deadline
        )
        try:
            coordinator.map([0])
        finally:
            coordinator.close()
    except KvcoreError as exc:
        outcome = type(exc).__name__
    finally:
        for stand_in in stand_ins:
            stand_in.close()
        shutil.rmtree(directory, ignore_errors=True)
    return outcome


def _huge_welcome() -> bytes:
    """A Welcome announcing 2^60 pages (``Welcome`` itself would encode it)."""
    from kvcore.parallel.channel.messages import Kind

    body = json.dumps(
        {"rank": 0, "pid": 1, "num_pages": 1 << 60, "page_bytes": GRAN, "fixed_bytes": 0}
    )
    return _frame(Kind.WELCOME, body.encode())


def hostile(channel_dir: Path, seconds: float, report: Path, deadline: float, seed: int) -> int:
    """The hostile process's body (``--hostile DIR SECONDS REPORT``): for ``seconds``,
    hostile peers on the workers of ``channel_dir`` (three acts in four) and hostile
    workers (the fourth), one act at a time. Writes ``report``: each act's end time
    (``time.monotonic``), the outcomes by kind, and what the process was left holding
    (threads, file descriptors, directories). Returns 0."""
    from kvcore.parallel.channel import socket_path

    rng = random.Random(seed)
    fds0 = _fds()
    base = Path(tempfile.mkdtemp(prefix="kvh"))  # short: socket paths live under it
    peers: dict[str, Counter[str]] = {k: Counter() for k in PEER_KINDS}
    workers: dict[str, Counter[str]] = {k: Counter() for k in WORKER_EXPECTED}
    act_ends: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if rng.random() < 0.75:
            kind, rank = rng.choice(PEER_KINDS), rng.randrange(WORLD)
            path = socket_path(channel_dir, rank)
            peers[kind].update(hostile_peer(path, kind, rank=rank, deadline=deadline))
        else:
            kind = rng.choice(sorted(WORKER_EXPECTED))
            workers[kind][hostile_worker(base, kind, deadline=deadline)] += 1
        act_ends.append(time.monotonic())
    dirs_left = len(os.listdir(base))
    shutil.rmtree(base, ignore_errors=True)
    _write_json(
        report,
        {
            "act_ends": act_ends,
            "peers": {k: dict(v) for k, v in peers.items()},
            "workers": {k: dict(v) for k, v in workers.items()},
            "threads_left": _other_threads(),
            "fds_left": _fds() - fds0,
            "dirs_left": dirs_left,
        },
    )
    return 0


def channel_counts(engine: dict[str, Any] | None, attacks: dict[str, Any] | None) -> dict[str, Any]:
    """The soak's channel counts from the channel engine's and the hostile process's
    reports (``None``: that process left none)."""
    engine = engine or {}
    attacks = attacks or {}
    maps = engine.get("map_times", [])
    ends = attacks.get("act_ends", [])
    ranks = [w for w in engine.get("workers") or [] if w]
    unexpected: list[str] = []
    for kind, outcomes in attacks.get("peers", {}).items():
        unexpected += [f"peer {kind}: {o} x{n}" for o, n in outcomes.items()
                       if o not in PEER_EXPECTED[kind]]  # fmt: skip
    for kind, outcomes in attacks.get("workers", {}).items():
        unexpected += [f"worker {kind}: {o} x{n}" for o, n in outcomes.items()
                       if o != WORKER_EXPECTED[kind]]  # fmt: skip
    connections = sum(
        n for outcomes in attacks.get("peers", {}).values()
        for o, n in outcomes.items() if o != "connect_failed"
    )  # fmt: skip
    refusals: Counter[str] = Counter()
    for w in ranks:
        refusals.update(w["refusals"])
    leaks = {
        "coordinator_threads": engine.get("threads_left", ["no report"]),
        "coordinator_fds": engine.get("fds_left", -1),
        "coordinator_held_bytes": engine.get("held_bytes_at_close", -1),
        "worker_pages": sum(w["pages_left"] for w in ranks),
        "worker_handles": sum(w["handles_left"] for w in ranks),
        "worker_threads": [t for w in ranks for t in w["threads_left"]],
        "worker_fds": sum(w["fds_left"] for w in ranks),
        "hostile_threads": attacks.get("threads_left", ["no report"]),
        "hostile_fds": attacks.get("fds_left", -1),
        "hostile_dirs": attacks.get("dirs_left", -1),
    }
    gaps = [b - a for a, b in itertools.pairwise(maps)]
    return {
        "channel_maps": len(maps),
        "channel_map_errors": engine.get("map_errors", {"no report": 1}),
        "channel_max_map_gap_s": round(max(gaps, default=0.0), 3),
        "channel_sessions": [w["sessions"] for w in ranks],
        "hostile_acts": len(ends),
        "acts_without_later_map": sum(1 for t in ends if not maps or t > maps[-1]),
        "hostile_connections": connections,
        "peer_outcomes": attacks.get("peers", {}),
        "worker_refusals": dict(refusals),
        "unaccounted_connections": connections - sum(w["refused"] for w in ranks),
        "hostile_workers": attacks.get("workers", {}),
        "unexpected": unexpected,
        "leaks": leaks,
    }


def channel_failed(counts: dict[str, Any]) -> bool:
    """Whether the channel counts show a failed check (see the module docstring)."""
    leaks = counts["leaks"]
    return bool(
        not counts["channel_maps"]
        or counts["channel_map_errors"]
        or counts["channel_sessions"] != [1] * WORLD
        or counts["acts_without_later_map"]
        or counts["unaccounted_connections"]
        or counts["unexpected"]
        or any(leaks.values())
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument(
        "--vllm", type=int, default=0, metavar="K",
        help="how many of the instances are real vLLM 0.33 schedulers (needs the forked vLLM)",
    )  # fmt: skip
    parser.add_argument(
        "--channel", action="store_true",
        help="add a TP=2 channel instance and the hostile peers and workers attacking it",
    )  # fmt: skip
    parser.add_argument(
        "--handshake-timeout", type=float, default=2.0,
        help="the channel workers' handshake deadline in seconds",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--instance", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-instance", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--channel-worker", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--channel-engine", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hostile", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    deadline_s = args.handshake_timeout
    if args.instance:
        name, state = args.instance
        return instance(name, Path(state))
    if args.vllm_instance:
        name, state = args.vllm_instance
        return vllm_instance(name, Path(state))
    if args.channel_worker:
        where, rank, report = args.channel_worker
        return channel_worker(Path(where), int(rank), Path(report), deadline_s)
    if args.channel_engine:
        base, report = args.channel_engine
        return channel_engine(Path(base), Path(report), deadline_s)
    if args.hostile:
        where, seconds, report = args.hostile
        return hostile(Path(where), float(seconds), Path(report), deadline_s, args.seed)
    if not 0 <= args.vllm <= args.instances:
        parser.error("--vllm must be between 0 and --instances")
    return soak(args)


def soak(args: argparse.Namespace) -> int:
    """The controller (see the module docstring). Returns the exit status."""
    from kvcore.budget.ledger import GpuLedger
    from kvcore.errors import KvcoreError

    rng = random.Random(args.seed)
    counts: dict[str, Any] = dict.fromkeys(
        ("kills", "limit_changes", "budget_changes", "lock_holds", "samples", "over_budget",
         "served_to_the_end", "fail_stops", "silent", "exits_during_soak",
         "records_left_by_clean_exits",
         "leaked_records", "leaked_bytes"), 0,
    )  # fmt: skip
    if args.vllm:
        counts.update(dict.fromkeys(("vllm_started", "vllm_kills", "vllm_steps",
                                     "vllm_finished_requests"), 0))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvcore-soak-") as tmp_name:
        tmp = Path(tmp_name)
        os.environ["KVCORE_LEDGER_DIR"] = tmp_name  # the controller's ledger is the instances'
        if args.vllm:  # the model config vLLM reads, without network, in a hub they inherit
            from harness.vllm import write_hub

            write_hub()
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING")
        procs: dict[str, subprocess.Popen[bytes]] = {}
        kinds: dict[str, str] = {}
        serial = 0

        def stderr_of(name: str) -> Path:
            return tmp / f"{name}.err"

        def state_of(name: str) -> Path:
            return tmp / f"{name}.state"

        def spawn(name: str, *argv: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
            # stderr goes to a file: a pipe nobody reads until the end would fill and block
            with stderr_of(name).open("wb") as err:
                return subprocess.Popen([*SELF, *argv], env=env, stdout=stdout, stderr=err)

        def start(kind: str) -> None:
            nonlocal serial
            serial += 1
            name = f"{'v' if kind == 'vllm' else 'i'}{serial}"
            kinds[name] = kind
            if kind == "vllm":
                counts["vllm_started"] += 1
                argv = ("--vllm-instance", name, str(state_of(name)))
                procs[name] = spawn(name, *argv, stdout=subprocess.DEVNULL)
            else:
                procs[name] = spawn(name, "--instance", name, str(state_of(name)))

        def tally_vllm(name: str) -> None:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(state_of(name).read_text())
                counts["vllm_steps"] += state["steps"]
                counts["vllm_finished_requests"] += state["finished"]

        clean_pids: set[int] = set()
        outcomes: list[tuple[str, int, str]] = []

        def settle(name: str, proc: subprocess.Popen[bytes]) -> None:
            """Count how an instance that is gone (not by the controller's SIGKILL) ended."""
            code = proc.wait()
            err = stderr_of(name).read_text(errors="replace")
            outcomes.append((name, code, err.strip()[-300 if code == 0 else -3000 :]))
            if kinds[name] == "vllm":
                tally_vllm(name)
            if code == 0:
                counts["served_to_the_end"] += 1
                clean_pids.add(proc.pid)
            elif "fail-stop" in err:
                counts["fail_stops"] += 1
            else:
                counts["silent"] += 1

        for n in range(args.instances):
            start("vllm" if n < args.vllm else "synthetic")
        channel: subprocess.Popen[bytes] | None = None
        attacker: subprocess.Popen[bytes] | None = None
        engine_report, attack_report = tmp / "channel.json", tmp / "hostile.json"
        if args.channel:
            channel = spawn(
                "channel", "--channel-engine", str(tmp / "rt"), str(engine_report),
                "--handshake-timeout", str(args.handshake_timeout), stdout=subprocess.PIPE,
            )  # fmt: skip
            assert channel.stdout is not None
            where = channel.stdout.readline().decode().strip()  # its directory, once serving
            if where:
                attacker = spawn(
                    "hostile", "--hostile", where, str(args.seconds), str(attack_report),
                    "--handshake-timeout", str(args.handshake_timeout), "--seed", str(args.seed),
                )  # fmt: skip
        time.sleep(1.0)
        ledger = GpuLedger.open(device_uuid(), device_total=DEVICE)
        prev = (0, DEVICE)  # (total, budget) of the last sample
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            for name in [n for n, proc in procs.items() if proc.poll() is not None]:
                settle(name, procs.pop(name))  # it ended by itself: count it, replace it
                counts["exits_during_soak"] += 1
                start(kinds[name])
            roll = rng.random()
            if roll < 0.1:  # kill -9 one that serves (has a record; a vLLM one: steps)
                eligible = sorted(n for n in procs if state_of(n).exists())
                if eligible:
                    name = rng.choice(eligible)
                    procs[name].kill()
                    procs.pop(name).wait()
                    counts["kills"] += 1
                    if kinds[name] == "vllm":
                        counts["vllm_kills"] += 1
                        tally_vllm(name)
                    start(kinds[name])
            elif roll < 0.3:
                snap = ledger.snapshot()
                if snap.records:
                    rec = rng.choice(snap.records)
                    limit = rng.choice((0, rng.randrange(1, 64) * MiB))
                    try:
                        ledger.set_limit(rec.name, limit)
                        counts["limit_changes"] += 1
                    except KvcoreError:  # the record went away meanwhile
                        pass
            elif roll < 0.4:
                budget = rng.randrange(16, 256) * MiB
                ledger.set_budget(budget)
                counts["budget_changes"] += 1
            elif roll < 0.45:  # a stopped kvctl holding the lock (now and then past 5 s)
                fd = os.open(ledger.path, os.O_RDWR)
                fcntl.flock(fd, fcntl.LOCK_EX)
                time.sleep(6.0 if rng.random() < 0.1 else rng.uniform(0.05, 1.0))
                os.close(fd)
                counts["lock_holds"] += 1
            snap = ledger.snapshot()
            counts["samples"] += 1
            # above the budget, the total may only fall (a budget lowered under use is
            # deferred: no instance gets new memory until the total is under it); a sample
            # right after a change of the budget starts the comparison afresh
            if (
                snap.total_mapped > snap.budget
                and snap.budget == prev[1]
                and snap.total_mapped > prev[0]
            ):
                counts["over_budget"] += 1
            prev = (snap.total_mapped, snap.budget)
            time.sleep(0.05)
        if attacker is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                attacker.wait(timeout=120)  # it ends at its own deadline, after the act under way
        if channel is not None:  # lift budget and limits: the channel instance maps again
            ledger.set_budget(0)
            for rec in ledger.snapshot().records:
                with contextlib.suppress(KvcoreError):
                    ledger.set_limit(rec.name, 0)
            time.sleep(2 * args.handshake_timeout)  # the last refusals settle
        time.sleep(3.0)  # the instances started last reach their SIGTERM handler
        if channel is not None:
            procs["channel"] = channel
            kinds["channel"] = "channel"
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            settle(name, proc)
        if attacker is not None:
            if attacker.poll() is None:
                attacker.kill()
            outcomes.append(("hostile", attacker.wait(), stderr_of("hostile").read_text()[-300:]))
        snap = ledger.snapshot()  # before the sweep: a clean close removes its own record
        counts["records_left_by_clean_exits"] = sum(r.pid in clean_pids for r in snap.records)
        ledger.reclaim_stale()
        snap = ledger.snapshot()
        counts["leaked_records"] = len(snap.records)
        counts["leaked_bytes"] = snap.total_mapped
        ledger.close()
        if args.channel:
            counts.update(channel_counts(_read_report(engine_report), _read_report(attack_report)))
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "counts": counts,
           "outcomes": outcomes}  # fmt: skip
    print(json.dumps(counts, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    bad = counts["over_budget"] or counts["silent"] or counts["leaked_records"]
    bad = bad or counts["leaked_bytes"] or counts["records_left_by_clean_exits"]
    bad = bad or (args.vllm and not counts["vllm_steps"])
    bad = bad or (args.channel and channel_failed(counts))
    return 1 if bad else 0


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
