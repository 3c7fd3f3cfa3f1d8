"""``kvcore.parallel.agreement.AgreedLedger`` against a scripted peer (one process, real ledger).

The peer is a ``RankAgreement`` whose other rank is a script: it answers the element-wise
minimum of this rank's vector and the peer's next one, as a MIN all-reduce over two ranks
would. Two real processes run in ``tests/engines/sglang/test_tp_agreement.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from kvcore.budget.gate import BudgetGate
from kvcore.errors import AgreementError
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.parallel.agreement import AgreedLedger, Agreement, TorchGroupAgreement
from kvcore.vmm.host import HostBackend

GRAN = 64 << 10
BPP = 16  # blocks per page


class ScriptedPeer:
    """A two-rank MIN all-reduce whose other rank answers from ``script`` (a vector per
    call; ``None``: the peer agrees with anything, i.e. answers +inf)."""

    size = 2

    def __init__(self) -> None:
        self.script: list[Sequence[int] | None] = []
        self.calls: list[list[int]] = []
        self.fail = False

    def min(self, values: Sequence[int]) -> list[int]:
        self.calls.append(list(values))
        if self.fail:
            raise AgreementError("peer gone")
        peer = self.script.pop(0) if self.script else None
        if peer is None:
            return list(values)
        return [min(a, b) for a, b in zip(values, peer, strict=True)]


@pytest.fixture
def ledger() -> Iterator[BlockLedger]:
    backend = HostBackend(0, device_bytes=1 << 30, granularity=GRAN)
    geometry = KVGeometry(
        num_layers=1,
        kv_buffers=1,
        block_bytes=GRAN // BPP,
        num_blocks=8 * BPP,
        page_bytes=GRAN,
        granularity=GRAN,
        layout="per-layer",
    )
    cache = VirtualKVCache(backend, geometry)
    # a budget above the 8 pages: it binds only where a test's scripted peer says so
    # no background thread: _in_use's flush runs the rounds that unmap what was freed
    pages = PageAllocator(LocalPageMapper(cache), BudgetGate(16 * GRAN), background=False)
    led = BlockLedger(geometry, pages, pinned_blocks=(0,))
    yield led
    led.close()
    cache.close()
    backend.close()


def _in_use(led: BlockLedger) -> int:
    assert led.pages.flush()
    return led.pages.stats().in_use


def test_a_peer_miss_rolls_back_and_misses_here_too(ledger: BlockLedger) -> None:
    peer = ScriptedPeer()
    agreed = AgreedLedger(ledger, peer)
    assert agreed.alloc(2 * BPP) is not None  # peer agrees
    used, pages = ledger.used(), _in_use(ledger)
    peer.script = [[0, 9], [5]]  # the peer missed; then 5 blocks of room left there
    assert agreed.alloc(BPP) is None
    assert ledger.used() == used and _in_use(ledger) == pages  # rolled back, page returned
    assert agreed.available() == 5  # the agreed room after the miss (second collective)
    assert len(peer.calls) == 4  # wrap, alloc, alloc, room after the miss


def test_split_allocations_are_agreed_and_rolled_back_and_their_frees_counted(
    ledger: BlockLedger,
) -> None:
    """``alloc_split``/``free_tensor`` through the agreement: one decision per allocation,
    a peer's miss rolls back both the listed ids and the runs here, and freed tensors count
    toward the agreed room."""
    peer = ScriptedPeer()
    agreed = AgreedLedger(ledger, peer)
    got = agreed.alloc_split(2 * BPP)  # peer agrees
    assert got is not None
    every = [*got[0], *(b for a, k in got[1] for b in range(a, a + k))]
    assert len(every) == 2 * BPP
    agreed.free_tensor(torch.tensor(every[:3]))  # three blocks free on a held page
    used, pages = ledger.used(), _in_use(ledger)
    peer.script = [[0, 9], [5]]  # the peer missed; then 5 blocks of room left there
    calls = len(peer.calls)
    assert agreed.alloc_split(BPP + 3) is None  # would list the three, run a fresh page
    assert ledger.used() == used and _in_use(ledger) == pages  # rolled back, page returned
    assert len(peer.calls) == calls + 2 and agreed.available() == 5
    agreed.free_tensor(torch.tensor(every[3:]))
    assert agreed.available() == 5 + 2 * BPP - 3 and ledger.used() == used - 2 * BPP + 3
    listed, runs = agreed.alloc_split(0)
    assert (list(listed), runs) == ([], []) and len(peer.calls) == calls + 2  # n == 0: local


def test_available_is_the_agreed_room_plus_frees_without_a_collective(
    ledger: BlockLedger,
) -> None:
    peer = ScriptedPeer()
    agreed = AgreedLedger(ledger, peer)
    peer.script = [[1, 3]]
    ids = agreed.alloc(BPP)
    assert ids is not None
    calls = len(peer.calls)
    assert agreed.available() == 3
    agreed.free(ids[:4])
    assert agreed.available() == 7
    assert len(peer.calls) == calls  # reading it never calls the group
    run = sorted(ids[4:])
    first = next(b for b in run if all(b + k in run for k in range(4)))
    agreed.free_range(first, 4)
    assert agreed.available() == 11


def test_step_refreshes_only_while_the_budget_binds(ledger: BlockLedger) -> None:
    peer = ScriptedPeer()
    agreed = AgreedLedger(ledger, peer)
    assert agreed.step() is False  # room >= logical free: nothing to agree
    peer.script = [[1, 2]]
    assert agreed.alloc(1) is not None
    assert agreed.available() == 2
    peer.script = [[40]]  # the peer's budget was freed by another instance
    assert agreed.step() is True
    assert agreed.available() == 40


def test_a_failed_collective_gives_the_blocks_back(ledger: BlockLedger) -> None:
    peer = ScriptedPeer()
    agreed = AgreedLedger(ledger, peer)
    used = ledger.used()
    peer.fail = True
    with pytest.raises(AgreementError):
        agreed.alloc(BPP)
    assert ledger.used() == used


def test_torch_group_errors_are_typed() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        agreement = TorchGroupAgreement()
        assert agreement.size == 1
        assert agreement.min([3, 1]) == [3, 1]
    finally:
        dist.destroy_process_group()
    with pytest.raises(AgreementError, match="peer rank died"):
        agreement.min([1])


class Items:
    """A stand-in allocation that is not a ledger (the agreement takes any try/undo pair):
    ``take(n)`` hands out ``n`` of ``free`` items or ``None``; ``give`` returns them."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.undone: list[int] = []

    def take(self, n: int) -> int | None:
        if n > self.free:
            return None
        self.free -= n
        return n

    def give(self, n: int) -> None:
        self.undone.append(n)
        self.free += n


def test_decide_agrees_any_try_undo_operation_and_a_room_vector() -> None:
    peer = ScriptedPeer()
    items = Items(10)
    room = Agreement(peer).room(lambda: [items.free, 2 * items.free], lambda: [10, 20])
    assert room.decide(lambda: items.take(3), items.give) == 3  # the peer agreed
    assert (room.available(0), room.available(1)) == (7, 14)
    peer.script = [[0, 50, 50], [4, 6]]  # the peer missed; then (4, 6) of room there
    assert room.decide(lambda: items.take(2), items.give) is None
    assert items.undone == [2] and items.free == 7  # undone here, once
    assert (room.available(0), room.available(1)) == (4, 6)
    room.freed(3, 1)
    assert (room.available(0), room.available(1)) == (4, 9)
    assert room.decide(lambda: items.take(99), items.give) is None  # a local miss: no undo
    assert items.undone == [2]
    assert [len(c) for c in peer.calls] == [2, 3, 3, 2, 3, 2]


def test_one_step_refreshes_every_binding_room_in_one_collective(ledger: BlockLedger) -> None:
    peer = ScriptedPeer()
    agreement = Agreement(peer)
    agreed = AgreedLedger(ledger, agreement)
    items = Items(10)
    peer.script = [[4]]  # the slot-like room starts below its logical count: it binds
    slots = agreement.room(lambda: [items.free], lambda: [items.free])
    assert slots.binds() and not agreed.room.binds()
    calls = len(peer.calls)
    peer.script = [[6]]
    assert agreed.step() is True  # the ledger's step is the rank's: every room refreshes
    assert peer.calls[calls:] == [[10]]  # one collective, only the binding room's figure
    assert slots.available() == 6
    peer.script = [[1, 3]]  # the ledger's room now binds too
    assert agreed.alloc(1) is not None
    peer.script = [[5, 8]]
    assert agreement.step() is True
    # both rooms in one collective, in the order they were created (the same on every rank)
    assert peer.calls[-1] == [ledger.available(), items.free]
    assert (slots.available(), agreed.available()) == (8, 5)
