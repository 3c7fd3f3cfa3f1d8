"""Frees that reach kvcore's ledger without waiting for the GPU (``PendingFrees``), inside
SGLang's real token and paged allocators (the kvcore fork only).

On a GPU each freed id tensor is copied to pinned host memory behind the work already
queued, and its ids reach the ledger once that copy has completed. Here, on the CPU, the
allocators are given a transfer whose completion the test controls (``Copies``), so a free
can be held in flight: it must count as free in ``available_size`` and the leak check's
``conservation_available_size`` (as upstream counts a free at once), must reach the ledger at
the next allocation or scheduler iteration once its copy is done (oldest first), and an
allocation that the free blocks on the ledger's pages cannot meet must take the ids in
flight on the device, without waiting (they stay allocated in the ledger and are not
released when their copy arrives), before the ledger acquires a page, returning ``None``
only when the ledger and the frees in flight together fall short.
``clear`` and ``get_all_free_pages`` wait for all. Ranks that agree their room free at once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore.adapters.sglang.release import PendingFrees

from .harness import requires_fork

pytestmark = requires_fork


class Copy:
    """One copy in flight: done when the test says so, or when waited for."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


class Copies:
    """A ``PendingFrees`` transfer that records each copy and completes none by itself."""

    def __init__(self) -> None:
        self.started: list[Copy] = []

    def __call__(self, ids: torch.Tensor) -> tuple[Copy, torch.Tensor]:
        self.started.append(Copy())
        return self.started[-1], ids.clone()  # a copy: the caller may reuse its tensor


def _in_flight(allocator: Any) -> Copies:
    """Give ``allocator`` a transfer the test completes by hand."""
    copies = Copies()
    allocator._pending = PendingFrees(allocator._release_block_ids, True, transfer=copies)
    return copies


@pytest.fixture
def token(make: Any) -> Any:
    """The elastic token allocator (``page_size`` 1) on 1,024 tokens."""
    return make("on", size=1024, page_size=1).allocator


def test_a_free_in_flight_counts_as_free_but_is_not_handed_out(token: Any) -> None:
    copies = _in_flight(token)
    ledger = token.ledger
    before = token.available_size()
    ids = token.alloc(64)
    assert ids is not None and token.available_size() == before - 64
    token.free(ids)
    assert len(copies.started) == 1
    assert token.available_size() == before  # as upstream, at once
    conserved = token.conservation_available_size()
    assert conserved == ledger.geometry.num_blocks - ledger.used() + 64
    assert all(ledger.is_allocated(b) for b in ids.tolist())  # not yet in the ledger
    again = token.alloc(64)
    assert again is not None and not set(again.tolist()) & set(ids.tolist())
    copies.started[0].done = True
    one = token.alloc(1)  # each allocation first takes in what has arrived
    assert one is not None and token._pending.count == 0
    still = [b for b in ids.tolist() if ledger.is_allocated(b)]
    assert still == [b for b in one.tolist() if b in ids.tolist()]  # at most the one reused
    assert token.available_size() == before - 64 - 1


def test_arrivals_are_taken_oldest_first_at_each_scheduler_iteration(token: Any) -> None:
    copies = _in_flight(token)
    ledger = token.ledger
    first, second = token.alloc(8), token.alloc(8)
    token.free(first)
    token.free(second)
    copies.started[1].done = True  # the younger one first: it waits behind the older
    token.kvcore_step()
    assert all(ledger.is_allocated(b) for b in first.tolist() + second.tolist())
    copies.started[0].done = True
    token.kvcore_step()
    assert not any(ledger.is_allocated(b) for b in first.tolist() + second.tolist())
    assert not any(c.waited for c in copies.started)  # an iteration never waits


def test_what_the_ledger_cannot_give_comes_from_the_frees_in_flight(token: Any) -> None:
    """SGLang's eviction before an allocation: the pool is full, the evicted ids are in
    flight, and the allocation takes them without waiting for their copies."""
    copies = _in_flight(token)
    ledger = token.ledger
    held = token.alloc(token.available_size())
    assert held is not None and token.alloc(1) is None  # full, nothing in flight: a miss
    token.free(held[:100])
    token.free(held[100:140])
    assert token.alloc(141) is None  # short by more than is in flight: still a miss
    got = token.alloc(120)  # all of the first free, 20 of the second
    assert got is not None and got.dtype == torch.int64
    assert sorted(got.tolist()) == sorted(held[:120].tolist())
    assert not any(c.waited for c in copies.started)
    assert token._pending.count == 20 and token.available_size() == 20
    for c in copies.started:
        c.done = True
    assert token._pending.settle() == 20  # the 20 not taken, none of those taken
    assert all(ledger.is_allocated(b) for b in held[:120].tolist())
    assert not any(ledger.is_allocated(b) for b in held[120:140].tolist())


def test_a_shortfall_takes_the_held_blocks_then_the_frees_in_flight(token: Any) -> None:
    """When the ledger's held pages cannot give the whole allocation, their free blocks go
    first, then the ids in flight (oldest first), and what is left stays in flight."""
    copies = _in_flight(token)
    ledger = token.ledger
    held = token.alloc(token.available_size() - 30)  # 30 left in the ledger
    assert held is not None
    on_pages = ledger.held_free()
    token.free(held[:50])
    got = token.alloc(60)
    taken = min(60 - on_pages, 50)
    assert got is not None and len(set(got.tolist())) == 60
    assert set(held[:taken].tolist()) <= set(got.tolist())
    assert not set(held[taken:50].tolist()) & set(got.tolist())
    assert token._pending.count == 50 - taken and token.available_size() == 20
    assert all(ledger.is_allocated(b) for b in got.tolist())
    copies.started[0].done = True
    assert token._pending.settle() == 50 - taken  # only what was not taken is released
    assert all(ledger.is_allocated(b) for b in held[:taken].tolist())
    assert not any(ledger.is_allocated(b) for b in held[taken:50].tolist())


def test_frees_in_flight_are_taken_before_the_ledger_acquires_a_page(token: Any) -> None:
    """Ids in flight sit on pages already mapped: an allocation they cover (with the free
    blocks on held pages) acquires no page, which would map one on the scheduler's thread
    or wait for a background unmap; beyond them, the ledger acquires as before."""
    _in_flight(token)
    ledger, pages = token.ledger, token.kvcore.pages
    first = token.alloc(100)
    assert first is not None
    if ledger.held_free():
        assert token.alloc(ledger.held_free()) is not None  # the held pages are now full
    assert ledger.held_free() == 0 and ledger.available() > 0  # unheld pages remain
    in_use = pages.stats().in_use
    token.free(first[:40])
    got = token.alloc(40)
    assert got is not None and sorted(got.tolist()) == sorted(first[:40].tolist())
    assert pages.stats().in_use == in_use
    more = token.alloc(50)  # nothing held, nothing in flight: a page is acquired
    assert more is not None and pages.stats().in_use > in_use


def test_clear_and_the_free_list_wait_for_every_free_in_flight(token: Any) -> None:
    copies = _in_flight(token)
    ids = token.alloc(32)
    token.free(ids)
    free = set(token.get_all_free_pages().tolist())
    assert copies.started[0].waited and set(ids.tolist()) <= free
    more = token.alloc(16)
    token.free(more)
    token.clear()
    assert copies.started[1].waited and token._pending.count == 0
    assert token.ledger.used() == 1  # block 0, SGLang's padding slot


def test_the_paged_allocators_segment_frees_go_the_same_way(make: Any) -> None:
    a = make("on", size=1024, page_size=16).allocator
    copies = _in_flight(a)
    ledger = a.ledger
    before = a.available_size()
    tokens = a.alloc(64)  # four pages
    assert tokens is not None
    a.free_segment(tokens, start_pos=0)  # upstream's sync-free path
    pages = sorted({t // 16 for t in tokens.tolist()})
    assert len(copies.started) == 1 and a.available_size() == before
    assert all(ledger.is_allocated(p) for p in pages)
    copies.started[0].done = True
    a.kvcore_step()
    assert not any(ledger.is_allocated(p) for p in pages)


def test_a_full_paged_pool_allocates_the_pages_just_evicted(make: Any) -> None:
    a = make("on", size=1024, page_size=16).allocator
    copies = _in_flight(a)
    held = a.alloc(a.available_size())
    assert held is not None and a.alloc(16) is None
    a.free_segment(held[:64], start_pos=0)  # a radix leaf of four pages evicted
    got = a.alloc(64)
    assert got is not None and sorted(got.tolist()) == sorted(held[:64].tolist())
    assert not copies.started[0].waited and a._pending.count == 0


def test_ranks_that_agree_their_room_free_at_once(token: Any) -> None:
    """Under an agreement (TP > 1 with a budget) every rank's figures must count a free at
    the same point, which a copy's arrival is not: frees go to the ledger at once."""
    from kvcore.parallel.agreement import AgreedLedger

    class _Alone:  # a one-rank agreement: the minimum of one vector is itself
        size = 1

        def min(self, values: Any) -> list[int]:
            return list(values)

    copies = _in_flight(token)
    token.ledger = AgreedLedger(token.ledger, _Alone())
    ids = token.alloc(16)
    token.free(ids)
    assert copies.started == [] and token._pending.count == 0
    assert not any(token.ledger.is_allocated(b) for b in ids.tolist())


def test_on_the_cpu_a_free_reaches_the_ledger_at_once(token: Any) -> None:
    ids = token.alloc(16)
    token.free(ids)
    assert token._pending.count == 0
    assert not any(token.ledger.is_allocated(b) for b in ids.tolist())


def test_what_arrived_by_an_allocation_reaches_the_ledger_in_one_call(token: Any) -> None:
    copies = _in_flight(token)
    calls: list[list[int]] = []
    release = token._pending._release

    def counted(ids: torch.Tensor) -> None:
        calls.append(ids.tolist())
        release(ids)

    token._pending._release = counted
    parts = [token.alloc(n) for n in (3, 600, 40)]  # each below and above the tensor path
    for ids in parts:
        token.free(ids)
    for copy in copies.started:
        copy.done = True
    token.kvcore_step()
    assert len(calls) == 1
    assert sorted(calls[0]) == sorted(b for ids in parts for b in ids.tolist())
    assert not any(token.ledger.is_allocated(b) for ids in parts for b in ids.tolist())
    assert token._pending.count == 0


def test_a_double_free_among_arrivals_frees_the_rest_and_names_the_id(token: Any) -> None:
    """Fault injection: SGLang frees a request's ids twice. The copies arrive together; the
    ledger refuses the whole batch, so each freed tensor goes again on its own: every good
    id is freed and the error names one of the twice-freed ids."""
    from kvcore.errors import InvalidTransition

    copies = _in_flight(token)
    ledger = token.ledger
    twice, other = token.alloc(8), token.alloc(700)
    token.free(twice)
    token.free(other)
    token.free(twice)
    for copy in copies.started:
        copy.done = True
    used = ledger.used()
    with pytest.raises(InvalidTransition) as err:
        token.kvcore_step()
    assert set(err.value.ids) <= set(twice.tolist())
    assert not any(ledger.is_allocated(b) for b in twice.tolist() + other.tolist())
    assert ledger.used() == used - 708
    assert token._pending.count == 0 and not token._pending
