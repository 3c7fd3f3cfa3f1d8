"""The channel with real worker processes (spawned, host backend): each worker owns a
``VirtualKVCache`` + ``LocalPageMapper`` behind a ``WorkerListener``; the test process is
the engine and drives a ``ChannelCoordinator``. After every operation and every injected
fault we read each worker's own view (page states, bytes through its KV tensor views) and
check no page is mapped on some workers only."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore.budget.gate import UnlimitedGate
from kvcore.errors import (
    ChannelError,
    InjectedFault,
    InvalidTransition,
    OutOfDeviceMemory,
    PageQuarantined,
    PoolFailed,
)
from kvcore.memory.mapper import MappingState
from kvcore.memory.pages import PageAllocator
from kvcore.parallel.channel.messages import (
    MAGIC,
    SCHEMA_VERSION,
    FrameReader,
    Hello,
    Kind,
    Message,
    Op,
    RemoteError,
    Reply,
    Request,
    encode,
    recv_message,
)
from tests.parallel.channel.cluster import GRANULARITY, NUM_PAGES, Cluster, Topology, page_bytes_for

pytestmark = pytest.mark.slow

_WORKER_STATE = {
    MappingState.UNMAPPED: "unmapped",
    MappingState.MAPPED: "mapped",
    MappingState.PREPARED: "prepared",
}


def assert_consistent(cluster: Cluster, ranks: list[int] | None = None) -> list[str]:
    """Every (live) worker reports the same state for every page that is not quarantined,
    and it is the coordinator's view. Returns that common view."""
    coordinator = cluster.coordinator
    ranks = cluster.live_ranks() if ranks is None else ranks
    views = {rank: cluster.states(rank) for rank in ranks}
    common = views[ranks[0]]
    for page in range(NUM_PAGES):
        if coordinator.state(page) is MappingState.QUARANTINED:
            continue
        seen = {rank: view[page] for rank, view in views.items()}
        assert len(set(seen.values())) == 1, f"page {page} differs across workers: {seen}"
        if coordinator.failed is None:
            assert common[page] == _WORKER_STATE[coordinator.state(page)], page
    return common


def unmap_all(cluster: Cluster) -> None:
    coordinator = cluster.coordinator
    mapped = [p for p in range(NUM_PAGES) if coordinator.state(p) is MappingState.MAPPED]
    coordinator.prepare_unmap(mapped)
    coordinator.commit_unmap(mapped)


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    "topology",
    [Topology(tp=2), Topology(tp=4), Topology(tp=2, pp=2)],
    ids=["tp2", "tp4", "tp2xpp2"],
)
def test_round_trip_agrees_on_every_worker(topology: Topology) -> None:
    with Cluster(topology) as cluster:
        _round_trip(cluster, GRANULARITY)


@pytest.mark.gpu
def test_round_trip_with_cuda_workers_sharing_one_gpu() -> None:
    with Cluster(Topology(tp=2, pp=2), backend="cuda") as cluster:
        _round_trip(cluster, 2 << 20)


def _round_trip(cluster: Cluster, granularity: int) -> None:
    """Map, write, prepare, abort, commit and close, checking every worker's own view."""
    topology = cluster.topology
    coordinator = cluster.coordinator
    ranks = list(range(topology.world_size))
    assert coordinator.num_pages == NUM_PAGES
    assert coordinator.worker_page_bytes == tuple(
        page_bytes_for(topology.layers(r), granularity) for r in ranks
    )
    assert coordinator.page_bytes == max(coordinator.worker_page_bytes)
    assert len(set(coordinator.worker_pids)) == topology.world_size

    coordinator.map([0, 1, 2])  # several pages, one message per worker
    assert assert_consistent(cluster)[:4] == ["mapped"] * 3 + ["unmapped"]
    for rank in ranks:  # each worker's own bytes, through its own tensor views
        for page in (0, 1, 2):
            cluster.write(rank, page, 10 * rank + page + 1)
    for rank in ranks:
        assert [cluster.read(rank, p) for p in (0, 1, 2, 3)] == [
            [10 * rank + 1],
            [10 * rank + 2],
            [10 * rank + 3],
            [0],  # unbacked: the zero page
        ]

    coordinator.prepare_unmap([1, 2])
    assert assert_consistent(cluster)[1:3] == ["prepared"] * 2
    assert all(cluster.read(r, 1) == [0] for r in ranks)  # zero page while prepared
    coordinator.abort_unmap([1])  # the kept handle comes back with its bytes
    assert all(cluster.read(r, 1) == [10 * r + 2] for r in ranks)
    coordinator.commit_unmap([2])
    coordinator.commit_unmap([2])  # idempotent
    assert assert_consistent(cluster)[:3] == ["mapped", "mapped", "unmapped"]
    with pytest.raises(InvalidTransition):
        coordinator.commit_unmap([0])  # mapped, never prepared: refused, unchanged
    with pytest.raises(InvalidTransition):
        coordinator.map([0])

    coordinator.close()  # every worker unmaps and releases everything
    for rank in ranks:
        assert cluster.states(rank) == ["unmapped"] * NUM_PAGES
        assert cluster.listener(rank)[2]  # listener stopped
    assert not cluster.directory.path.exists()
    with pytest.raises(ChannelError, match="closed"):
        coordinator.map([3])


# ------------------------------------------------------------------------ faults, channel lives


@pytest.fixture(scope="module")
def tp2() -> Iterator[Cluster]:
    with Cluster(Topology(tp=2)) as cluster:
        yield cluster


def test_page_allocator_drives_every_worker(tp2: Cluster) -> None:
    """The page allocator uses the coordinator exactly like a local mapper: its refill
    thread maps the reserve on every worker, acquire/release move pages, close unmaps."""
    allocator = PageAllocator(tp2.coordinator, reserve_min=2, reserve_max=3)
    try:
        assert allocator.flush()
        assert assert_consistent(tp2).count("mapped") == 2  # refilled off the caller thread
        pages = allocator.acquire(3)
        assert pages is not None
        for rank in (0, 1):
            for page in pages:
                tp2.write(rank, page, 100 + page)
        assert [tp2.read(1, p) for p in pages] == [[100 + p] for p in pages]
        allocator.release(pages)
        assert allocator.flush()
        assert assert_consistent(tp2).count("mapped") == 3  # reserve_max kept, rest unmapped
        assert allocator.stats().refill_mapper_calls > 0
    finally:
        allocator.close()
    assert assert_consistent(tp2) == ["unmapped"] * NUM_PAGES


def test_the_gate_is_charged_what_every_worker_holds(tp2: Cluster) -> None:
    """Workers keep no pooled handles the coordinator cannot see: the gate's charge is the
    device memory each worker holds (its pages and its zero page, which the handshake
    reports), through maps, unmaps and a rolled-back map."""
    gate = UnlimitedGate()
    zero = tp2.coordinator.fixed_bytes
    assert zero > 0
    # no background thread: check()'s flush runs the rounds that unmap what was released
    allocator = PageAllocator(tp2.coordinator, gate, reserve_min=0, reserve_max=1, background=False)
    assert gate.held == zero

    def check() -> None:
        assert allocator.flush()
        assert [tp2.held(r) + zero for r in (0, 1)] == [gate.held] * 2
        assert gate.held - zero == tp2.coordinator.held_bytes
        assert gate.held == allocator.stats().charged_bytes

    try:
        pages = allocator.acquire(4)
        assert pages is not None and gate.held == 4 * tp2.coordinator.page_bytes + zero
        check()
        allocator.release(pages)  # one stays in the reserve, three are unmapped
        check()
        tp2.fail(1, "map", nth=2)  # rank 1 fails its second page: rolled back everywhere
        assert allocator.acquire(3) is None
        check()
        again = allocator.acquire(3)
        assert again is not None
        check()
        allocator.release(again)
        check()
    finally:
        allocator.close()
    assert gate.held == 0 and [tp2.held(r) for r in (0, 1)] == [0, 0]


def test_worker_error_on_map_is_rolled_back_everywhere(tp2: Cluster) -> None:
    coordinator = tp2.coordinator
    coordinator.map([0])
    tp2.write(0, 0, 5)
    tp2.fail(1, "map", nth=2)  # rank 1 maps page 3 then fails on page 4
    with pytest.raises(InjectedFault, match="rank 1"):
        coordinator.map([3, 4])
    view = assert_consistent(tp2)
    assert view[3:5] == ["unmapped", "unmapped"]  # rank 0's mapping of both was undone
    assert tp2.read(0, 0) == [5]  # untouched pages keep their bytes
    coordinator.map([3, 4])  # the channel goes on
    assert assert_consistent(tp2)[3:5] == ["mapped", "mapped"]
    unmap_all(tp2)


def test_out_of_device_memory_stays_a_miss(tp2: Cluster) -> None:
    tp2.trim(0)  # no pooled handle: the map must create one
    tp2.fail(0, "create")
    with pytest.raises(OutOfDeviceMemory, match="rank 0"):
        tp2.coordinator.map([2])
    assert assert_consistent(tp2)[2] == "unmapped"
    assert tp2.coordinator.failed is None


def test_worker_error_on_prepare_aborts_everywhere(tp2: Cluster) -> None:
    coordinator = tp2.coordinator
    coordinator.map([1])
    for rank in (0, 1):
        tp2.write(rank, 1, 40 + rank)
    tp2.fail(1, "unmap")
    with pytest.raises(InjectedFault, match="rank 1"):
        coordinator.prepare_unmap([1])
    assert assert_consistent(tp2)[1] == "mapped"
    assert [tp2.read(r, 1) for r in (0, 1)] == [[40], [41]]  # rank 0's prepare was aborted
    unmap_all(tp2)


def test_transient_rollback_failure_is_retried(tp2: Cluster) -> None:
    coordinator = tp2.coordinator
    coordinator.map([5])
    coordinator.prepare_unmap([5])
    tp2.fail(1, "map")  # rank 1's first restore fails; the retry succeeds
    coordinator.abort_unmap([5])
    assert assert_consistent(tp2)[5] == "mapped"
    unmap_all(tp2)


def test_failed_rollback_quarantines_the_page(tp2: Cluster) -> None:
    coordinator = tp2.coordinator
    coordinator.map([7])
    coordinator.prepare_unmap([7])
    tp2.fail(1, "map", times=50)  # rank 1 can neither restore nor fall back to the zero page
    with pytest.raises(PageQuarantined) as info:
        coordinator.abort_unmap([7])
    assert info.value.page_ids == (7,)
    assert coordinator.state(7) is MappingState.QUARANTINED
    assert tp2.states(1)[7] == "quarantined"
    with pytest.raises(PageQuarantined):
        coordinator.map([7])  # never handed out again
    tp2.clear(1)
    assert coordinator.failed is None
    assert_consistent(tp2)  # every other page still agrees


def test_slow_worker_times_out_and_is_rolled_back(tp2: Cluster) -> None:
    coordinator = tp2.coordinator
    coordinator.timeout = 1.0
    try:
        tp2.stall(1, "map", 1.6)  # answers after the map round, within the undo round
        with pytest.raises(ChannelError, match=r"did not answer within 1.0s; rolled back"):
            coordinator.map([6])
        assert coordinator.failed is None
        assert assert_consistent(tp2)[6] == "unmapped"
        coordinator.map([6])  # the late reply was dropped; the stream is in step
        assert assert_consistent(tp2)[6] == "mapped"
        unmap_all(tp2)
    finally:
        coordinator.timeout = 20.0


def _rogue(path: Path, data: bytes) -> list[Message]:
    """Connect to a worker socket as a stranger, send ``data``, collect what comes back
    until the worker closes the connection."""
    got: list[Message] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(15)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError):  # refused before it read everything
            sock.sendall(data)
        reader = FrameReader()
        with contextlib.suppress(ConnectionResetError):
            while (message := recv_message(sock, reader)) is not None:
                got.append(message)
    return got


def _refusal(got: list[Message]) -> RemoteError:
    assert len(got) == 1 and isinstance(got[0], Reply) and got[0].error is not None, got
    return got[0].error


def _header(version: int, kind: int, length: int) -> bytes:
    return struct.pack("!4sHBBI", MAGIC, version, kind, 0, length)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "MalformedMessage"),
        (_header(SCHEMA_VERSION, Kind.HELLO, 1 << 30), "OversizedMessage"),
        (_header(SCHEMA_VERSION + 7, Kind.HELLO, 2) + b"{}", "VersionMismatch"),
        (encode(Request(Op.MAP, 1, (0,))), "MalformedMessage"),  # no handshake first
        (encode(Hello(rank=1, world_size=2, instance="x")), "PeerRejected"),  # wrong rank
        (encode(Hello(rank=0, world_size=2, instance="x")), "PeerRejected"),  # 2nd session
    ],
    ids=["garbage", "oversized", "wrong-version", "no-hello", "wrong-rank", "second-session"],
)
def test_stranger_connections_are_refused_and_the_session_goes_on(
    tp2: Cluster, data: bytes, error: str
) -> None:
    before, sessions, _ = tp2.listener(0)
    assert _refusal(_rogue(tp2.socket(0), data)).type == error
    rejected, sessions_after, closed = tp2.listener(0)
    assert len(rejected) == len(before) + 1 and rejected[-1].startswith(error)
    assert (sessions_after, closed) == (sessions, False)
    tp2.coordinator.map([2])  # the coordinator's session is untouched
    assert assert_consistent(tp2)[2] == "mapped"
    unmap_all(tp2)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")
def test_connection_from_another_uid_is_refused(tp2: Cluster) -> None:
    nobody = 65534
    path = tp2.socket(0)

    def connect_as_nobody() -> str:
        pid = os.fork()
        if pid == 0:  # child: become nobody, try to speak to rank 0
            code = 9
            try:
                os.setgroups([])
                os.setgid(nobody)
                os.setuid(nobody)
                try:
                    got = _rogue(path, encode(Hello(rank=0, world_size=2, instance="x")))
                except PermissionError:
                    code = 1
                else:
                    code = 2 if _refusal(got).type == "PeerRejected" else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return {1: "no access", 2: "peer rejected"}.get(os.waitstatus_to_exitcode(status), "?")

    # First line of defence: the 0700 directory keeps other users from the socket at all.
    assert connect_as_nobody() == "no access"
    # Second line: open the path up on purpose; SO_PEERCRED still refuses the stranger.
    opened = [tp2.base, tp2.directory.path.parent, tp2.directory.path, path]
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in opened}
    try:
        for p in opened:
            os.chmod(p, 0o777 if p == path else 0o711)
        assert connect_as_nobody() == "peer rejected"
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
    rejected, _, _ = tp2.listener(0)
    assert f"uid {nobody}" in rejected[-1]
    tp2.coordinator.map([3])
    assert assert_consistent(tp2)[3] == "mapped"
    unmap_all(tp2)


def test_stuck_worker_fails_the_pool(tp2: Cluster) -> None:
    # Last test on this cluster: it ends the coordinator.
    coordinator = tp2.coordinator
    coordinator.timeout = 0.5
    tp2.stall(1, "map", 3.0)
    with pytest.raises(PoolFailed, match="rank 1 timed out"):
        coordinator.map([0])
    with pytest.raises(PoolFailed):
        coordinator.map([1])
    assert coordinator.failed is not None
    assert tp2.states(0)[0] == "unmapped"  # rank 0 was undone before the fail-stop


# ------------------------------------------------------------------------ dead workers


def test_worker_killed_mid_prepare_fails_the_pool_survivors_aborted() -> None:
    with Cluster(Topology(tp=2)) as cluster:
        coordinator = cluster.coordinator
        coordinator.map([0, 1])
        cluster.write(0, 0, 9)
        cluster.die(1, "prepare_unmap", when="before")
        with pytest.raises(PoolFailed, match="rank 1"):
            coordinator.prepare_unmap([0, 1])
        cluster.procs[1].join(timeout=10)
        assert not cluster.alive(1)
        assert cluster.states(0)[:2] == ["mapped", "mapped"]  # the survivor aborted
        assert cluster.read(0, 0) == [9]
        with pytest.raises(PoolFailed):
            coordinator.commit_unmap([0, 1])


def test_worker_killed_mid_commit_fails_the_pool_survivors_committed() -> None:
    with Cluster(Topology(tp=2)) as cluster:
        coordinator = cluster.coordinator
        coordinator.map([2, 3])
        coordinator.prepare_unmap([2, 3])
        cluster.die(0, "commit_unmap", when="after")
        with pytest.raises(PoolFailed, match="rank 0"):
            coordinator.commit_unmap([2, 3])
        cluster.procs[0].join(timeout=10)
        assert cluster.states(1)[2:4] == ["unmapped", "unmapped"]
        with pytest.raises(PoolFailed):
            coordinator.map([4])
