"""The hardening soak's hostile peers and workers (``benchmarks/hardening_soak.py``), each
run once against the real channel in this process: every hostile peer is refused the way
the soak expects while a real coordinator keeps its session and maps, every hostile worker
makes its coordinator raise the expected error, and the counts the soak derives from its
processes' reports flag what they should."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks import hardening_soak
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.parallel.channel import ChannelCoordinator, ChannelDirectory, WorkerListener
from kvcore.vmm import open_backend

GRAN = 64 << 10
DEADLINE = 2.0  # the listener's handshake deadline in these tests, seconds: room for a loaded CI


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return hardening_soak


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvs"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def served(base: Path) -> Iterator[tuple[WorkerListener, ChannelCoordinator]]:
    """Rank 0 of a one-rank channel (a host-backed mapper behind a listener) and the real
    coordinator holding its session."""
    backend = open_backend("host", device_bytes=16 << 20, granularity=GRAN)
    geometry = KVGeometry(
        num_layers=1, kv_buffers=1, block_bytes=GRAN // 4, num_blocks=32,
        page_bytes=GRAN, granularity=GRAN,
    )  # fmt: skip
    cache = VirtualKVCache(backend, geometry)
    mapper = LocalPageMapper(cache)
    directory = ChannelDirectory.create(base)
    listener = WorkerListener(
        mapper, rank=0, channel_dir=directory.path, handshake_timeout=DEADLINE
    ).start()
    coordinator = ChannelCoordinator(directory, world_size=1, timeout=10, connect_timeout=10)
    yield listener, coordinator
    coordinator.close()
    listener.close()
    mapper.close()
    cache.close()
    backend.close()


@pytest.mark.parametrize(
    "kind", ["garbage", "deep_json", "oversized", "wrong_version", "bad_count", "no_hello",
             "wrong_rank", "second_session", "trickle", "silent", "flood", "truncated",
             "vanish"],
)  # fmt: skip
def test_each_hostile_peer_is_refused_and_the_session_goes_on(
    soak: ModuleType, served: tuple[WorkerListener, ChannelCoordinator], kind: str
) -> None:
    assert kind in soak.PEER_KINDS
    listener, coordinator = served
    refused = listener.refused
    outcomes = soak.hostile_peer(listener.path, kind, rank=0, deadline=DEADLINE)
    assert outcomes and set(outcomes) <= soak.PEER_EXPECTED[kind], outcomes
    if "vanished" not in outcomes:  # a refusal is counted before it is sent
        assert listener.refused == refused + len(outcomes)
        assert all(reason.startswith("PeerRejected") or kind != "flood"
                   for reason in listener.rejected)  # fmt: skip
    if kind == "flood":
        kinds = {soak.refusal_kind(r) for r in listener.rejected}
        assert kinds == {"MAX_HANDSHAKES", "handshake deadline"}
    assert listener.sessions == 1 and not listener.closed
    coordinator.map([1])  # the real session is untouched
    coordinator.prepare_unmap([1])
    coordinator.commit_unmap([1])


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("PeerRejected: rank 0: too many handshakes at once (MAX_HANDSHAKES = 8)",
         "MAX_HANDSHAKES"),
        ("PeerRejected: rank 1: no complete Hello within the 2.0s handshake deadline",
         "handshake deadline"),
        ("PeerRejected: Hello for rank 2 reached rank 1", "wrong rank"),
        ("PeerRejected: rank 0 already serves a coordinator session", "second session"),
        ("OversizedMessage: channel frame announces 1073741824 bytes", "OversizedMessage"),
    ],
)  # fmt: skip
def test_refusal_kind_names_each_documented_refusal(
    soak: ModuleType, reason: str, kind: str
) -> None:
    assert soak.refusal_kind(reason) == kind


@pytest.mark.parametrize(
    "kind", ["garbage_welcome", "deep_welcome", "wrong_rank_welcome", "huge_num_pages",
             "disagreeing_num_pages", "silent", "garbage_reply", "oversized_reply", "no_reply"],
)  # fmt: skip
def test_each_hostile_worker_gets_its_documented_coordinator_error(
    soak: ModuleType, base: Path, kind: str
) -> None:
    before = set(threading.enumerate())  # earlier tests' threads may end meanwhile
    assert soak.hostile_worker(base, kind, deadline=DEADLINE) == soak.WORKER_EXPECTED[kind]
    assert list(base.iterdir()) == []  # its channel directory is gone
    left = [t.name for t in set(threading.enumerate()) - before]
    assert left == []  # every stand-in thread this call started was joined


def _reports(soak: ModuleType) -> tuple[dict[str, object], dict[str, object]]:
    worker = {"sessions": 1, "refused": 3, "pages_left": 0, "handles_left": 0,
              "threads_left": [], "fds_left": 0,
              "refusals": {"MalformedMessage": 1, "handshake deadline": 2}}  # fmt: skip
    engine = {"map_times": [1.0, 2.0, 5.0], "map_errors": {}, "held_bytes_at_close": 0,
              "threads_left": [], "fds_left": 0, "workers": [worker, dict(worker)]}  # fmt: skip
    attacks = {"act_ends": [1.5, 4.0], "threads_left": [], "fds_left": 0, "dirs_left": 0,
               "peers": {"garbage": {"MalformedMessage": 2}, "trickle": {"PeerRejected": 4}},
               "workers": {"silent": {"WorkerLost": 1}}}  # fmt: skip
    return engine, attacks


def test_channel_counts_of_a_clean_run_pass(soak: ModuleType) -> None:
    engine, attacks = _reports(soak)
    counts = soak.channel_counts(engine, attacks)
    assert counts["channel_maps"] == 3 and counts["channel_max_map_gap_s"] == 3.0
    assert counts["hostile_connections"] == 6 and counts["unaccounted_connections"] == 0
    assert counts["worker_refusals"] == {"MalformedMessage": 2, "handshake deadline": 4}
    assert not soak.channel_failed(counts)


@pytest.mark.parametrize(
    "spoil",
    ["late_act", "unexpected_peer", "unexpected_worker", "leaked_page", "uncounted",
     "map_error", "no_engine_report"],
)  # fmt: skip
def test_channel_counts_flag_each_failed_check(soak: ModuleType, spoil: str) -> None:
    engine, attacks = _reports(soak)
    workers = engine["workers"]
    assert isinstance(workers, list)
    if spoil == "late_act":  # an act after the last map: the coordinator stopped serving
        attacks["act_ends"] = [1.5, 6.0]
    elif spoil == "unexpected_peer":
        attacks["peers"] = {"trickle": {"held": 1}}
    elif spoil == "unexpected_worker":
        attacks["workers"] = {"silent": {"served": 1}}
    elif spoil == "leaked_page":
        workers[0] = dict(workers[0], pages_left=1)
    elif spoil == "uncounted":  # a connection the workers never refused
        workers[0] = dict(workers[0], refused=2)
    elif spoil == "map_error":
        engine["map_errors"] = {"ChannelError": 1}
    counts = soak.channel_counts(None if spoil == "no_engine_report" else engine, attacks)
    assert soak.channel_failed(counts)
