"""The channel with real worker processes (spawned, host backend): each worker owns a
``VirtualKVCache`` + ``LocalPageMapper`` behind a ``WorkerListener``; the test process is
the engine and drives a ``ChannelCoordinator``. After every operation and every injected
fault we read each worker's own view (page states, bytes through its KV tensor views) and
check no page is mapped on some workers only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcore.channel import PageState
from kvcore.errors import (
    ChannelError,
    InjectedFault,
    InvalidTransition,
    OutOfDeviceMemory,
    PageQuarantined,
    PoolFailed,
)
from tests.channel.cluster import NUM_PAGES, Cluster, Topology, page_bytes_for

pytestmark = pytest.mark.slow

_WORKER_STATE = {
    PageState.UNMAPPED: "unbacked",
    PageState.MAPPED: "mapped",
    PageState.PREPARED: "prepared",
}


def assert_consistent(cluster: Cluster, ranks: list[int] | None = None) -> list[str]:
    """Every (live) worker reports the same state for every page that is not quarantined,
    and it is the coordinator's view. Returns that common view."""
    coordinator = cluster.coordinator
    ranks = cluster.live_ranks() if ranks is None else ranks
    views = {rank: cluster.states(rank) for rank in ranks}
    common = views[ranks[0]]
    for page in range(NUM_PAGES):
        if coordinator.state(page) is PageState.QUARANTINED:
            continue
        seen = {rank: view[page] for rank, view in views.items()}
        assert len(set(seen.values())) == 1, f"page {page} differs across workers: {seen}"
        if coordinator.failed is None:
            assert common[page] == _WORKER_STATE[coordinator.state(page)], page
    return common


def unmap_all(cluster: Cluster) -> None:
    coordinator = cluster.coordinator
    mapped = [p for p in range(NUM_PAGES) if coordinator.state(p) is PageState.MAPPED]
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
        coordinator = cluster.coordinator
        ranks = list(range(topology.world_size))
        assert coordinator.num_pages == NUM_PAGES
        assert coordinator.worker_page_bytes == tuple(
            page_bytes_for(topology.layers(r)) for r in ranks
        )
        assert coordinator.page_bytes == max(coordinator.worker_page_bytes)
        assert len(set(coordinator.worker_pids)) == topology.world_size

        coordinator.map([0, 1, 2])  # several pages, one message per worker
        assert assert_consistent(cluster)[:4] == ["mapped"] * 3 + ["unbacked"]
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
        assert assert_consistent(cluster)[:3] == ["mapped", "mapped", "unbacked"]
        with pytest.raises(InvalidTransition):
            coordinator.commit_unmap([0])  # mapped, never prepared: refused, unchanged
        with pytest.raises(InvalidTransition):
            coordinator.map([0])

        coordinator.close()  # every worker unmaps and releases everything
        for rank in ranks:
            assert cluster.states(rank) == ["unbacked"] * NUM_PAGES
            assert cluster.listener(rank)[2]  # listener stopped
        assert not cluster.directory.path.exists()
        with pytest.raises(ChannelError, match="closed"):
            coordinator.map([3])


# ------------------------------------------------------------------------ faults, channel lives


@pytest.fixture(scope="module")
def tp2() -> Iterator[Cluster]:
    with Cluster(Topology(tp=2)) as cluster:
        yield cluster


def test_worker_error_on_map_is_rolled_back_everywhere(tp2: Cluster) -> None:
    coordinator = tp2.coordinator
    coordinator.map([0])
    tp2.write(0, 0, 5)
    tp2.fail(1, "map", nth=2)  # rank 1 maps page 3 then fails on page 4
    with pytest.raises(InjectedFault, match="rank 1"):
        coordinator.map([3, 4])
    view = assert_consistent(tp2)
    assert view[3:5] == ["unbacked", "unbacked"]  # rank 0's mapping of both was undone
    assert tp2.read(0, 0) == [5]  # untouched pages keep their bytes
    coordinator.map([3, 4])  # the channel goes on
    assert assert_consistent(tp2)[3:5] == ["mapped", "mapped"]
    unmap_all(tp2)


def test_out_of_device_memory_stays_a_miss(tp2: Cluster) -> None:
    tp2.trim(0)  # no pooled handle: the map must create one
    tp2.fail(0, "create")
    with pytest.raises(OutOfDeviceMemory, match="rank 0"):
        tp2.coordinator.map([2])
    assert assert_consistent(tp2)[2] == "unbacked"
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
    assert coordinator.state(7) is PageState.QUARANTINED
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
        assert assert_consistent(tp2)[6] == "unbacked"
        coordinator.map([6])  # the late reply was dropped; the stream is in step
        assert assert_consistent(tp2)[6] == "mapped"
        unmap_all(tp2)
    finally:
        coordinator.timeout = 20.0


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
    assert tp2.states(0)[0] == "unbacked"  # rank 0 was undone before the fail-stop


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
        assert cluster.states(1)[2:4] == ["unbacked", "unbacked"]
        with pytest.raises(PoolFailed):
            coordinator.map([4])
