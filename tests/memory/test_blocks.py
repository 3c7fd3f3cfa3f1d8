"""BlockLedger on the real host backend: placement, all-or-nothing, typed errors, eviction
hint, and invariants 1 and 4 under a randomized engine-like workload. The page allocator
runs without its thread (``background=False``): ``pages.flush()`` runs its rounds."""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import pairwise
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcore.budget.gate import BudgetGate
from kvcore.errors import GeometryError, InvalidTransition
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.pages import PageState
from tests.memstack import BACKENDS, MemStack, build_stack

BPP = 4  # blocks per page in these tests


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stack(backend: str) -> Iterator[MemStack]:
    s = build_stack(backend, num_blocks=32, blocks_per_page=BPP, background=False)
    yield s
    s.close()


def pages_of(ledger: BlockLedger, blocks: list[int]) -> set[int]:
    return {ledger.page_of(b) for b in blocks}


def test_alloc_fills_partly_used_pages_fullest_first(stack: MemStack) -> None:
    ledger = stack.ledger()
    ids = ledger.alloc(8)
    assert ids is not None and stack.pages.stats().in_use == 2  # two full pages
    p0, p1 = sorted(pages_of(ledger, ids))
    on = {p: [b for b in ids if ledger.page_of(b) == p] for p in (p0, p1)}
    ledger.free(on[p0][:1])  # p0: 1 free slot
    ledger.free(on[p1][:2])  # p1: 2 free slots
    one = ledger.alloc(1)
    assert one is not None and ledger.page_of(one[0]) == p0  # the fullest page first
    two = ledger.alloc(1)
    assert two is not None and ledger.page_of(two[0]) == p1
    three = ledger.alloc(2)  # p1's last slot, then a fresh page
    assert three is not None
    assert sorted(ledger.page_of(b) for b in three)[0] == p1
    assert stack.pages.stats().in_use == 3 and ledger.used() == 9
    kept = [b for b in ids if b not in on[p0][:1] + on[p1][:2]]
    assert len(set(kept + one + two + three)) == 9


def test_an_empty_page_goes_back_and_is_unmapped(stack: MemStack) -> None:
    ledger = stack.ledger()
    ids = ledger.alloc(6)
    assert ids is not None
    first_page = ledger.page_of(ids[0])
    on_first = [b for b in ids if ledger.page_of(b) == first_page]
    ledger.free(on_first[:-1])
    assert stack.pages.state(first_page) is PageState.IN_USE  # one block still lives there
    ledger.free(on_first[-1:])
    assert stack.pages.flush()
    assert stack.pages.state(first_page) is PageState.FREE
    assert first_page not in stack.mapped_pages()
    assert pages_of(ledger, [b for b in ids if b not in on_first]) <= stack.mapped_pages()


def test_alloc_is_all_or_nothing_on_a_physical_miss(backend: str) -> None:
    gate = BudgetGate(limit=0)
    stack = build_stack(backend, num_blocks=32, blocks_per_page=BPP, gate=gate, background=False)
    try:
        gate.limit = 2 * stack.pages.page_bytes
        ledger = stack.ledger()
        a = ledger.alloc(3)
        assert a is not None
        assert ledger.alloc(6) is None  # 1 free slot + 1 page (4) < 6
        assert ledger.used() == 3 and stack.pages.stats().in_use == 1
        assert ledger.available() == 5
        b = ledger.alloc(5)
        assert b is not None and ledger.available() == 0 and ledger.alloc(1) is None
        ledger.free(a + b)
        assert ledger.used() == 0 and ledger.available() == 8
    finally:
        stack.close()


def test_pages_the_gate_wants_back_admit_no_new_request(backend: str) -> None:
    """Over what the gate allows (a lowered limit here; a share exceeded while a neighbour
    waits works the same way), the free blocks of as many pages as it wants back are left
    out of what new requests may take; running requests may still use them."""
    gate = BudgetGate(limit=1 << 40)
    stack = build_stack(backend, num_blocks=32, blocks_per_page=BPP, gate=gate, background=False)
    try:
        ledger, pages, pb = stack.ledger(), stack.pages, stack.pages.page_bytes
        ids = ledger.alloc(3 * BPP)
        assert ids is not None
        ledger.free([ids[0], ids[BPP], ids[BPP + 1], ids[2 * BPP], ids[2 * BPP + 1]])
        assert ledger.held_free() == 5 and ledger.withheld() == 0
        gate.limit = 2 * pb  # one page in use too many
        pages.run_round()
        assert pages.shed_wanted() == 1
        assert ledger.available() == 5 and ledger.withheld() == BPP  # 5 - BPP left to admit
        gate.limit = pb  # two too many: nothing is left to admit
        pages.run_round()
        assert pages.shed_wanted() == 2
        assert ledger.available() == 5 and ledger.withheld() == 5
        gate.limit = 1 << 40  # lifted: every free block and new pages again
        pages.run_round()
        assert ledger.withheld() == 0 and ledger.available() == 32 - ledger.used()
    finally:
        stack.close()


def test_the_owners_to_free_for_a_page_are_those_of_the_cheapest_page_they_alone_fill(
    stack: MemStack,
) -> None:
    """Three pages: p0 held by requests a (2 blocks) and b (2 blocks, 2 more on p1), p1 by b
    and c (1 block) and one block nobody listed holds, p2 by d alone (4 blocks) and one
    cached block. Freeing a and b empties p0 (cost 6 blocks), d empties p2 (cost 4, its
    cached block evicted with it); p1 cannot be emptied by anyone listed."""
    ledger = stack.ledger()
    ids = ledger.alloc(3 * BPP)
    assert ids is not None
    p0, p1, p2 = (ids[i * BPP : (i + 1) * BPP] for i in range(3))
    assert all(len(pages_of(ledger, p)) == 1 for p in (p0, p1, p2))  # one page each
    ledger.free(p2[3:])  # p2: 3 allocated
    owners = {
        "a": p0[:2],
        "b": p0[2:] + p1[:2],
        "c": p1[2:3],  # p1[3] is held by nobody listed
        "d": p2[:2],
    }
    # p2's third block is cached: only evictable, so d's page qualifies with it
    assert ledger.owners_emptying_page(owners, evictable=p2[2:3]) == ["d"]
    # without the cached block, p2 holds a block nobody listed: p0 is next (a and b)
    assert ledger.owners_emptying_page(owners) == ["a", "b"]
    # ids freed, pinned or out of range are ignored; nobody listed: nothing
    assert ledger.owners_emptying_page({"x": [p2[3], -1, 10**6]}) == []
    assert ledger.owners_emptying_page({}) == []


def test_alloc_misses_when_the_device_runs_out_and_leaks_nothing(backend: str) -> None:
    stack = build_stack(
        backend, num_blocks=32, blocks_per_page=BPP, device_pages=2, background=False
    )
    try:
        ledger = stack.ledger()
        handles = set(stack.vmm.live_handles)
        assert ledger.alloc(9) is None
        assert ledger.used() == 0 and stack.vmm.live_handles == handles
        assert stack.mapped_pages() == set()
        assert ledger.alloc(8) is not None
    finally:
        stack.close()


def test_freeing_wrong_ids_raises_naming_the_id_and_changes_nothing(stack: MemStack) -> None:
    ledger = stack.ledger(pinned=(0,))
    ids = ledger.alloc(3)
    assert ids is not None
    a, b, c = ids
    never = next(x for x in range(32) if x not in ids and x != 0)
    cases = [
        ([a, never], f"block {never}: not allocated"),
        ([a, b, a], f"block {a}: not allocated \\(a double free, or named twice"),
        ([0], "block 0: it is pinned"),
        ([32], "block 32: out of range"),
        ([-1], "block -1: out of range"),
    ]
    for bad, message in cases:
        with pytest.raises(InvalidTransition, match=message) as err:
            ledger.free(bad)
        assert err.value.ids[0] in bad
        assert ledger.used() == 4 and all(ledger.is_allocated(x) for x in (a, b, c))
    ledger.free([a])
    with pytest.raises(InvalidTransition, match=f"block {a}: not allocated"):
        ledger.free([a])  # double free
    assert ledger.used() == 3


def test_a_large_free_checks_every_id_of_a_gapped_page_share(stack: MemStack) -> None:
    ledger = stack.ledger()
    ids = ledger.alloc(12)  # three full pages
    assert ids is not None
    first = min(ids)
    ledger.free([first + 3])
    # page `first`'s share has a gap (first+2 missing); its span holds only allocated blocks
    bad = [first, first + 1, first + 3, *[b for b in ids if b >= first + 4]]
    with pytest.raises(InvalidTransition, match=f"block {first + 3}: not allocated"):
        ledger.free(bad)
    assert ledger.used() == 11 and ledger.is_allocated(first + 2)
    ledger.free([b for b in bad if b != first + 3] + [first + 2])
    assert ledger.used() == 0 and stack.pages.stats().in_use == 0


def test_a_large_free_of_one_contiguous_run_checks_every_id(stack: MemStack) -> None:
    ledger = stack.ledger(pinned=(0,))
    ids = ledger.alloc(11)  # blocks 1..11: the rest of page 0 and two fresh pages
    assert ids is not None and sorted(ids) == list(range(1, 12))
    twice = [1, 2, 3, 4, 5, 5, 7, 8, 9, 10, 11]  # spans as many ids as it names: 6 left out
    with pytest.raises(InvalidTransition, match=r"block 5: not allocated .*named twice"):
        ledger.free(twice)
    assert ledger.used() == 12 and all(ledger.is_allocated(b) for b in range(12))
    ledger.free([6])
    for bad, shown in ((6, "not allocated"), (0, "it is pinned"), (12, "not allocated")):
        run = sorted({*range(1, 12), bad} - ({6} if bad != 6 else set()))
        with pytest.raises(InvalidTransition, match=f"block {bad}: {shown}"):
            ledger.free(run)  # one run across three pages, one id in it not freeable
        assert ledger.used() == 11 and all(ledger.is_allocated(b) for b in range(7, 12))
    ledger.free([b for b in range(1, 12) if b != 6])  # a run with a gap: page by page
    assert ledger.used() == 1 and stack.pages.stats().in_use == 1
    again = ledger.alloc(12)  # page 0's free blocks first, then fresh pages
    assert again is not None and sorted(again)[:3] == [1, 2, 3]
    ledger.free(sorted(again))  # one run: 1..12
    assert ledger.used() == 1 and stack.pages.stats().in_use == 1


def test_alloc_from_partly_used_pages_makes_no_page_call_and_a_refused_page_changes_nothing(
    backend: str,
) -> None:
    """alloc's fast path (the partly used pages suffice) neither acquires nor maps a page;
    when they do not suffice and the gate refuses the fresh page, the slow path misses with
    every partly used block still free, and the fast path then hands out exactly those."""
    gate = BudgetGate(limit=0)
    stack = build_stack(backend, num_blocks=32, blocks_per_page=BPP, gate=gate, background=False)
    try:
        gate.limit = 2 * stack.pages.page_bytes
        ledger = stack.ledger()
        ids = ledger.alloc(8)  # two full pages: the whole budget
        assert ids is not None
        p0, p1 = sorted(pages_of(ledger, ids))
        on = {p: sorted(b for b in ids if ledger.page_of(b) == p) for p in (p0, p1)}
        ledger.free(on[p0][:1] + on[p1][:2])  # p0: 1 free slot, p1: 2
        calls = stack.pages.stats().caller_mapper_calls
        assert ledger.alloc(4) is None  # 3 free slots + a fresh page the gate refuses
        assert ledger.used() == 5 and ledger.available() == 3
        assert stack.pages.stats().in_use == 2 and gate.held == 2 * stack.pages.page_bytes
        assert not any(ledger.is_allocated(b) for b in on[p0][:1] + on[p1][:2])
        calls = stack.pages.stats().caller_mapper_calls
        got = ledger.alloc(3)  # the fast path: p0's slot first (fullest), then p1's
        assert got is not None and got[0] == on[p0][0] and sorted(got[1:]) == on[p1][:2]
        assert stack.pages.stats().caller_mapper_calls == calls
        assert ledger.used() == 8 and ledger.available() == 0 and ledger.alloc(1) is None
        ledger.free(ids)
        assert ledger.used() == 0 and stack.pages.stats().in_use == 0
    finally:
        stack.close()


def test_free_range_frees_a_run_across_pages_like_free(stack: MemStack) -> None:
    ledger = stack.ledger(pinned=(0,))
    ids = ledger.alloc(14)  # blocks 1..14: the rest of page 0, pages 1 and 2, half of page 3
    assert ids is not None and sorted(ids) == list(range(1, 15))
    ledger.free_range(2, 9)  # 2..10: page 0 partly, page 1 whole, page 2 partly
    assert ledger.used() == 6
    assert [b for b in range(16) if ledger.is_allocated(b)] == [0, 1, 11, 12, 13, 14]
    assert stack.pages.state(1) is not PageState.IN_USE  # emptied: given back
    assert {stack.pages.state(p) for p in (0, 2, 3)} == {PageState.IN_USE}
    again = ledger.alloc(3)  # the freed slots of the partly used pages, fullest first
    assert again is not None and sorted(again) == [2, 3, 15]
    ledger.free_range(0, 0)  # an empty run: nothing
    ledger.free(again)
    ledger.free_range(11, 4)  # pages 2 and 3 empty
    ledger.free_range(1, 1)
    assert ledger.used() == 1 and stack.pages.stats().in_use == 1


def test_free_range_with_an_id_not_freeable_raises_naming_it_and_changes_nothing(
    stack: MemStack,
) -> None:
    ledger = stack.ledger(pinned=(0,))
    ids = ledger.alloc(11)
    assert ids is not None and sorted(ids) == list(range(1, 12))
    ledger.free([6])
    cases = [
        ((1, 11), "block 6: not allocated"),  # a freed id inside the run
        ((0, 4), "block 0: it is pinned"),
        ((9, 4), "block 12: not allocated"),  # runs past the allocated blocks
        ((32, 2), "block 32: out of range"),
        ((-1, 3), "block -1: out of range"),
    ]
    for (first, count), message in cases:
        with pytest.raises(InvalidTransition, match=message):
            ledger.free_range(first, count)
        assert ledger.used() == 11
        assert [b for b in range(12) if ledger.is_allocated(b)] == [b for b in range(12) if b != 6]
    with pytest.raises(ValueError):
        ledger.free_range(1, -1)
    ledger.free_range(7, 5)
    ledger.free_range(1, 5)
    assert ledger.used() == 1 and stack.pages.stats().in_use == 1


def test_pinned_blocks_keep_their_page_mapped_for_good(stack: MemStack) -> None:
    ledger = stack.ledger(pinned=(0,))
    assert stack.pages.state(0) is PageState.IN_USE and 0 in stack.mapped_pages()
    assert ledger.used() == 1 and ledger.is_allocated(0)
    ids = ledger.alloc(3)  # the three other slots of page 0 first
    assert ids is not None and pages_of(ledger, ids) == {0} and 0 not in ids
    ledger.free(ids)
    assert stack.pages.flush()
    assert stack.pages.state(0) is PageState.IN_USE and 0 in stack.mapped_pages()


def test_the_short_last_page_of_the_geometry_is_used_and_given_back(backend: str) -> None:
    stack = build_stack(
        backend, num_blocks=10, blocks_per_page=BPP, background=False
    )  # pages of 4, 4 and 2 blocks
    try:
        ledger = stack.ledger()
        everything = ledger.alloc(10)
        assert everything is not None and sorted(everything) == list(range(10))
        assert ledger.alloc(1) is None and ledger.available() == 0
        ledger.free(everything)
        assert stack.pages.stats().in_use == 0 and ledger.available() == 10
        for _ in range(3):  # a need met by the short page plus a full one gives back nothing
            got = ledger.alloc(5)
            assert got is not None
            assert stack.pages.stats().in_use == len(pages_of(ledger, got))
            ledger.free(got)
    finally:
        stack.close()


def test_eviction_order_puts_page_emptying_blocks_first_stably(stack: MemStack) -> None:
    ledger = stack.ledger()
    ids = ledger.alloc(8)  # two full pages
    assert ids is not None
    p1 = sorted(b for b in ids if ledger.page_of(b) == ledger.page_of(ids[0]))
    p2 = sorted(b for b in ids if b not in p1)
    # LRU order: half of page 1, then all of page 2, then the other half of page 1 missing
    lru = [p1[0], p2[3], p1[1], p2[0], p2[2], p2[1]]
    assert ledger.eviction_order(lru) == [p2[3], p2[0], p2[2], p2[1], p1[0], p1[1]]
    assert ledger.eviction_order(lru[:2]) == lru[:2]  # nothing empties a page: unchanged
    never = 30
    assert ledger.eviction_order([never, *p2]) == [*p2, never]
    ledger.free(ledger.eviction_order(lru)[:4])
    assert stack.pages.state(ledger.page_of(p2[0])) is not PageState.IN_USE


def test_blocks_emptying_pages_names_whole_pages_least_recently_used_first(
    stack: MemStack,
) -> None:
    ledger = stack.ledger()
    ids = ledger.alloc(12)  # three full pages
    assert ids is not None
    p1, p2, p3 = (
        sorted(b for b in ids if ledger.page_of(b) == page)
        for page in sorted(pages_of(ledger, ids))
    )
    # LRU order: page 3 whole (first seen), page 2 whole, half of page 1 (in use otherwise)
    lru = [p3[1], p2[0], p3[0], p1[0], p1[1], *p2[1:], p3[2], p3[3]]
    assert ledger.blocks_emptying_pages(lru, 1) == [p3[1], p3[0], p3[2], p3[3]]
    assert ledger.blocks_emptying_pages(lru, 5) == [p3[1], p3[0], p3[2], p3[3], *p2]
    assert ledger.blocks_emptying_pages(lru, 0) == []
    assert ledger.blocks_emptying_pages([p1[0], p1[1], 30], 3) == []  # page 1 stays in use
    ledger.free(ledger.blocks_emptying_pages(lru, 1))
    assert stack.pages.state(ledger.page_of(p3[0])) is not PageState.IN_USE


def test_a_fenced_free_keeps_the_page_mapped_until_retired(stack: MemStack) -> None:
    ledger = stack.ledger()
    ids = ledger.alloc(4)
    assert ids is not None
    page = ledger.page_of(ids[0])
    ledger.free(ids, fence=41)
    assert stack.pages.flush()
    assert stack.pages.state(page) is PageState.FENCED and page in stack.mapped_pages()
    assert stack.pages.retire(41) == 1
    assert stack.pages.flush()
    assert page not in stack.mapped_pages()


def test_the_ledger_refuses_an_allocator_smaller_than_its_geometry(backend: str) -> None:
    small = build_stack(backend, num_blocks=8, blocks_per_page=BPP, background=False)
    big = build_stack(backend, num_blocks=32, blocks_per_page=BPP, background=False)
    try:
        with pytest.raises(GeometryError, match="covers 2 pages"):
            BlockLedger(big.geometry, small.pages)
        with pytest.raises(InvalidTransition, match="pinned blocks"):
            BlockLedger(small.geometry, small.pages, pinned_blocks=(8,))
    finally:
        small.close()
        big.close()


def expand(runs: list[tuple[int, int]]) -> list[int]:
    return [b for first, count in runs for b in range(first, first + count)]


def split_listed(ledger: BlockLedger, n: int) -> tuple[list[int], list[tuple[int, int]]] | None:
    """``ledger.alloc_split(n)`` with its listed ids as a list, to compare."""
    got = ledger.alloc_split(n)
    return None if got is None else (list(got[0]), got[1])


def runs_of(ids: list[int]) -> list[tuple[int, int]]:
    """Distinct ``ids`` as ascending ``(first, count)`` runs."""
    runs: list[tuple[int, int]] = []
    for b in sorted(ids):
        if runs and sum(runs[-1]) == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


@pytest.mark.parametrize("array_stacks", [False, True], ids=["lists", "arrays"])
def test_alloc_split_hands_out_the_blocks_alloc_would(backend: str, array_stacks: bool) -> None:
    """Twin ledgers driven alike: ``alloc_split`` names the same blocks as ``alloc`` (fresh
    pages as whole runs, ascending and not adjacent; partly used pages' free blocks as a
    list, or joined to the runs when they are one range); ``free_runs`` in any order frees
    what ``free`` does."""
    stacks = [
        build_stack(backend, num_blocks=32, blocks_per_page=BPP, background=False) for _ in range(2)
    ]
    try:
        plain, by_split = (s.ledger(pinned=(0,), array_stacks=array_stacks) for s in stacks)
        for n, victims in [(13, [3, 4, 9, 12]), (6, [1, 2, 5, 6, 7, 8]), (9, []), (5, [])]:
            ids = plain.alloc(n)
            got = by_split.alloc_split(n)
            assert ids is not None and got is not None
            listed, runs = got
            assert listed.typecode == "q"  # int64s, read by torch.frombuffer as they are
            assert sorted(ids) == sorted([*listed, *expand(runs)]) and len(ids) == n
            assert all(a + k < b for (a, k), (b, _) in pairwise(runs))
            plain.free(victims)
            by_split.free_runs(runs_of(victims)[::-1])
            assert [plain.is_allocated(b) for b in range(32)] == [
                by_split.is_allocated(b) for b in range(32)
            ]
            assert stacks[0].pages.stats().in_use == stacks[1].pages.stats().in_use
        assert split_listed(by_split, 0) == ([], []) and by_split.alloc_split(32) is None  # a miss
        assert by_split.used() == plain.used()
        with pytest.raises(ValueError):
            by_split.alloc_split(-1)
    finally:
        for s in stacks:
            s.close()


def test_alloc_split_lists_scattered_ids_and_joins_a_range_to_the_runs(stack: MemStack) -> None:
    ledger = stack.ledger(pinned=(0,))
    assert split_listed(ledger, 15) == ([], [(1, 15)])  # the rest of page 0 and three pages
    ledger.free([2, 5, 7, 13])  # from pages 0, 1 and 3
    listed, runs = ledger.alloc_split(4 + BPP)  # four scattered ids, then a fresh page
    assert sorted(listed) == [2, 5, 7, 13] and runs == [(16, BPP)]
    ledger.free(list(range(17, 16 + BPP)))  # page 4 keeps 16: its upper blocks are free
    assert split_listed(ledger, BPP - 1) == ([], [(17, BPP - 1)])  # one range: a run


def test_free_runs_is_all_or_nothing_and_names_the_id(stack: MemStack) -> None:
    ledger = stack.ledger(pinned=(0,))
    assert split_listed(ledger, 15) == ([], [(1, 15)])  # the rest of page 0, three fresh pages
    ledger.free_runs([(6, 1)])
    cases = [
        ([(1, 3), (5, 3)], "block 6: not allocated"),  # a freed id inside a run
        ([(1, 3), (2, 2)], "block 2: not allocated .*named twice"),  # overlapping runs
        ([(8, 2), (0, 2)], "block 0: it is pinned"),
        ([(12, 2), (15, 2)], "block 16: not allocated"),
        ([(1, 2), (32, 2)], "block 32: out of range"),
        ([(-1, 2), (3, 1)], "block -1: out of range"),
    ]
    for runs, message in cases:
        with pytest.raises(InvalidTransition, match=message):
            ledger.free_runs(runs)
        assert ledger.used() == 15
        assert [b for b in range(16) if ledger.is_allocated(b)] == [b for b in range(16) if b != 6]
    with pytest.raises(ValueError):
        ledger.free_runs([(1, 2), (4, -1)])
    ledger.free_runs([(11, 5), (1, 5), (7, 0), (7, 4)])  # pages 1..3 empty: given back
    assert ledger.used() == 1 and stack.pages.stats().in_use == 1


# -- invariants 1 and 4 under a randomized engine-like workload ----------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "finish", "hit", "evict", "abort", "fence", "retire", "flush"]),
        st.integers(min_value=1, max_value=10),
    ),
    max_size=40,
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    reserve=st.sampled_from([(0, 0), (0, 2), (2, 4)]),
    layout=st.sampled_from(["compound", "per-layer"]),
)
def test_blocks_in_use_stay_mapped_and_keep_their_data(
    ops: list[tuple[str, int]], reserve: tuple[int, int], layout: str, backend: str
) -> None:
    """Invariant 1: a page is never unmapped while a block on it is allocated (live or
    cached); data written to a block survives every other page's unmap. Invariant 4: the
    views' data pointers never change."""
    gate = BudgetGate(limit=0)  # set below: 8 of the 10 pages, so misses happen too
    stack = build_stack(
        backend,
        num_blocks=40,
        blocks_per_page=BPP,
        layout="compound" if layout == "compound" else "per-layer",
        gate=gate,
        reserve_min=reserve[0],
        reserve_max=reserve[1],
        background=False,  # the "flush" op runs the background rounds
    )
    gate.limit = 8 * stack.pages.page_bytes
    try:
        ledger = stack.ledger(pinned=(0,))
        views = [stack.block_bytes_view(layer, buf) for layer in range(2) for buf in range(2)]
        pointers = [v.data_ptr() for v in views]
        live: list[int] = []
        cached: list[int] = []  # the engine's LRU of evictable, still allocated blocks
        fences: list[int] = []
        signature: dict[int, int] = {}
        generation = 0

        def write(blocks: list[int]) -> None:
            nonlocal generation
            for b in blocks:
                generation += 1
                signature[b] = generation % 250 + 1
                for i, v in enumerate(views):
                    v[b].fill_((signature[b] + i) % 256)

        for op, n in ops:
            if op == "alloc":
                got = ledger.alloc(n)
                if got is not None:
                    assert len(got) == n and not set(got) & set(live + cached)
                    write(got)
                    live += got
            elif op == "finish":  # a request ends; its blocks stay cached
                cached += live[:n]
                del live[:n]
            elif op == "hit":  # a prefix-cache hit takes cached blocks back
                live += cached[-n:]
                del cached[-n:]
            elif op == "evict":
                order = ledger.eviction_order(cached)
                assert sorted(order) == sorted(cached)
                victims = order[:n]
                ledger.free(victims)
                cached = [b for b in cached if b not in victims]
            elif op == "abort":
                ledger.free(live[:n])
                del live[:n]
            elif op == "fence":
                fences.append(len(fences))
                ledger.free(live[:n], fence=fences[-1])
                del live[:n]
            elif op == "retire" and fences:  # the engine finished steps up to fences[k-1]
                k = min(n, len(fences))
                stack.pages.retire(fences[k - 1])
                del fences[:k]
            elif op == "flush":
                assert stack.pages.flush()

            allocated = [*live, *cached]
            assert ledger.used() == len(allocated) + 1
            mapped = stack.mapped_pages()
            for b in [0, *allocated]:
                page = ledger.page_of(b)
                assert stack.pages.state(page) is PageState.IN_USE
                assert page in mapped
            for b in allocated:
                for i, v in enumerate(views):
                    assert bool(torch.all(v[b] == (signature[b] + i) % 256)), (op, b, i)
        assert [v.data_ptr() for v in views] == pointers
        assert stack.pages.flush()
        for p in range(stack.geometry.num_pages):  # unbacked pages read the zero page
            if stack.pages.state(p) is PageState.FREE:
                blocks = list(stack.geometry.blocks_of(p))
                assert all(not bool(v[blocks].any()) for v in views)
    finally:
        stack.close()


@pytest.mark.parametrize("array_stacks", [False, True], ids=["lists", "arrays"])
def test_free_tensor_frees_what_free_does_and_refuses_what_it_refuses(array_stacks: bool) -> None:
    """Twin ledgers, one freed by lists, one by tensors of the same ids (below and above
    ``free_tensor``'s threshold, scattered over pages, one run): the same blocks, the same
    pages released; a bad id among many raises naming it, with nothing changed."""
    from kvcore.memory.blocks import _TENSOR_FREE_MIN

    n = 16 * _TENSOR_FREE_MIN
    stacks = [build_stack("host", num_blocks=n, blocks_per_page=BPP, background=False)]
    stacks.append(build_stack("host", num_blocks=n, blocks_per_page=BPP, background=False))
    try:
        by_list, by_tensor = (s.ledger(pinned=(0,), array_stacks=array_stacks) for s in stacks)
        for ledger in (by_list, by_tensor):
            assert ledger.alloc(n - 1) is not None
        rnd = random.Random(7)
        scattered = rnd.sample(range(1, n // 2), 4 * _TENSOR_FREE_MIN)
        for ids in (scattered[:5], scattered[5:], list(range(n // 2, n - 3))):
            by_list.free(ids)
            by_tensor.free_tensor(torch.tensor(ids))
            assert [by_list.is_allocated(b) for b in range(n)] == [
                by_tensor.is_allocated(b) for b in range(n)
            ]
            assert stacks[0].pages.stats().in_use == stacks[1].pages.stats().in_use
        left = [b for b in range(1, n) if by_tensor.is_allocated(b)]
        never = scattered[0]
        for bad, shown in [(never, "not allocated"), (0, "pinned"), (n, "out of range"),
                           (left[-1], "named twice")]:  # fmt: skip
            ids = torch.tensor([*left, bad])[torch.randperm(len(left) + 1)]
            with pytest.raises(InvalidTransition, match=f"block {bad}: .*{shown}"):
                by_tensor.free_tensor(ids)
            assert [b for b in range(n) if by_tensor.is_allocated(b)] == [0, *left]
        by_tensor.free_tensor(torch.tensor(left))
        assert by_tensor.used() == 1 and stacks[1].pages.stats().in_use == 1
    finally:
        for s in stacks:
            s.close()


# -- many ids per call: alloc's whole-page and free's page-by-page paths -------------------

BIG_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "alloc",
                "alloc-split",
                "free",
                "free-sorted",
                "free-tensor",
                "free-bad",
                "free-range",
                "free-runs",
            ]
        ),
        st.integers(min_value=1, max_value=30),
        st.randoms(use_true_random=False),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=BIG_OPS, bpp=st.sampled_from([4, 8]), short=st.booleans(), arrays=st.booleans())
# the short last page handed out before a lower fresh page: runs must still come ascending
@example(
    ops=[("alloc", 23, random.Random(0)), ("alloc", 23, random.Random(0)),
         ("alloc-split", 3, random.Random(0))],
    bpp=4,
    short=True,
    arrays=True,
)  # fmt: skip
@patch("kvcore.memory.blocks._TENSOR_FREE_MIN", 2)
def test_large_alloc_and_free_keep_placement_checks_and_pages_exact(
    ops: list[tuple[str, int, random.Random]], bpp: int, short: bool, arrays: bool
) -> None:
    """Against a model (the set of allocated ids): alloc(n) of many ids (as a list, or as a
    list and ascending, non-adjacent runs) fills partly used pages before fresh ones,
    fullest first; free of many ids (shuffled, sorted, contiguous or not, as runs in any
    order, as a tensor) empties exactly the pages left without an allocated block; a bad id
    anywhere in a large free (double, never allocated, pinned, out of range, named twice;
    as ids, as runs or as a tensor) raises naming it with nothing changed. Pinned block 0
    and a short last page are in play. ``free_tensor``'s tensor path is taken from 2 ids on
    here (its threshold lowered), so these small frees exercise it; the pages' free ids are
    kept as lists or as arrays (``array_stacks``)."""
    num_blocks = 12 * bpp - (bpp // 2 if short else 0)
    stack = build_stack("host", num_blocks=num_blocks, blocks_per_page=bpp, background=False)
    try:
        ledger = stack.ledger(pinned=(0,), array_stacks=arrays)
        geometry = stack.geometry
        allocated: set[int] = set()

        def live_on(page: int) -> int:
            return sum(1 for b in geometry.blocks_of(page) if b in allocated or b == 0)

        for op, n, rnd in ops:
            held = {p for p in range(geometry.num_pages) if live_on(p)}
            if op in ("alloc", "alloc-split"):
                free_slots = {p: len(geometry.blocks_of(p)) - live_on(p) for p in held}
                if op == "alloc":
                    got = ledger.alloc(n)
                else:
                    split = ledger.alloc_split(n)
                    got = None if split is None else [*split[0], *expand(split[1])]
                    if split is not None:
                        assert all(k > 0 for _, k in split[1])
                        assert all(a + k < b for (a, k), (b, _) in pairwise(split[1]))
                if got is None:
                    assert n > num_blocks - 1 - len(allocated)
                    continue
                assert len(got) == n == len(set(got)) and not set(got) & (allocated | {0})
                allocated |= set(got)
                taken = {p: sum(1 for b in got if ledger.page_of(b) == p) for p in held}
                partly = {p for p in held if free_slots[p]}
                if n <= sum(free_slots.values()):  # no fresh page while room is left
                    assert {ledger.page_of(b) for b in got} <= partly
                else:
                    assert all(taken[p] == free_slots[p] for p in partly)
                emptied_first = [free_slots[p] for p in partly if taken[p] == free_slots[p]]
                untouched = [free_slots[p] for p in partly if not taken[p]]
                if emptied_first and untouched:  # fullest (fewest free slots) first
                    assert max(emptied_first) <= min(untouched)
                assert sum(1 for p in partly if 0 < taken[p] < free_slots[p]) <= 1
            elif op == "free-range":  # the longest allocated run from a random start, <= n
                if not allocated:
                    continue
                first = rnd.choice(sorted(allocated))
                count = 1
                while count < n and first + count in allocated:
                    count += 1
                ledger.free_range(first, count)
                allocated -= set(range(first, first + count))
            elif op == "free-runs":
                victims = rnd.sample(sorted(allocated), min(n, len(allocated)))
                runs = runs_of(victims)
                rnd.shuffle(runs)
                ledger.free_runs(runs)
                allocated -= set(victims)
            elif op in ("free", "free-sorted", "free-tensor"):
                victims = rnd.sample(sorted(allocated), min(n, len(allocated)))
                if op == "free-sorted":
                    victims.sort()
                if op == "free-tensor":
                    ledger.free_tensor(torch.tensor(victims, dtype=torch.int64))
                else:
                    ledger.free(victims)
                allocated -= set(victims)
            else:
                victims = rnd.sample(sorted(allocated), min(n, len(allocated)))
                never = [b for b in range(1, num_blocks) if b not in allocated]
                never = never and [rnd.choice(never)]
                bad = rnd.choice([0, num_blocks, -1, *never, *victims[:1]])  # victim: twice
                ids = [*victims, bad]
                rnd.shuffle(ids)
                if bad in victims:
                    shown = "named twice"
                    assert ids.count(bad) == 2
                else:
                    shown = "pinned" if bad == 0 else "range" if bad in (-1, num_blocks) else ""
                with pytest.raises(InvalidTransition, match=f"block {bad}: .*{shown}") as err:
                    way = rnd.random()
                    if way < 1 / 3:
                        ledger.free(ids)
                    elif way < 2 / 3:  # as runs of one id (a repeated id: overlapping runs)
                        ledger.free_runs([(b, 1) for b in ids])
                    else:
                        ledger.free_tensor(torch.tensor(ids, dtype=torch.int64))
                assert err.value.ids == (bad,)
            assert ledger.used() == len(allocated) + 1
            assert all(ledger.is_allocated(b) for b in allocated)
            assert not any(ledger.is_allocated(b) for b in set(range(1, num_blocks)) - allocated)
            in_use = {p for p in range(geometry.num_pages) if live_on(p)}
            states = {p: stack.pages.state(p) for p in range(geometry.num_pages)}
            assert {p for p, s in states.items() if s is PageState.IN_USE} == in_use
            assert stack.pages.flush()  # unmaps settled: every other block is available
            assert ledger.available() == num_blocks - 1 - len(allocated)
        ledger.free(sorted(allocated))
        assert ledger.used() == 1 and stack.pages.stats().in_use == 1
    finally:
        stack.close()


def test_available_under_a_budget_counts_the_short_last_page_for_what_it_holds() -> None:
    """Pages of 4 blocks, the last one holding 2. That short page sits mapped in the
    reserve while pages 1 and 2 are unmapped, and the budget admits one page more: an
    allocation gets the reserve's short page plus one mapped page, 6 blocks, not the 8 two
    whole pages would hold. ``available()`` must say 6, and 6 must be allocatable."""
    gate = BudgetGate(1 << 40)
    stack = build_stack(
        "host", num_blocks=14, blocks_per_page=4, reserve_max=1, gate=gate, background=False
    )
    try:
        ledger = stack.ledger()
        everything = ledger.alloc(14)
        assert everything is not None
        ledger.free([12, 13])  # page 3 (short) -> the reserve
        ledger.free(list(range(4, 12)))  # pages 1, 2 -> unmapped (the reserve is full)
        assert stack.pages.flush()
        assert stack.pages.state(3) is PageState.RESERVED
        assert stack.pages.state(1) is stack.pages.state(2) is PageState.FREE
        gate.limit = gate.held + stack.geometry.page_bytes  # one more page fits
        assert ledger.available() == 6
        assert ledger.alloc(7) is None  # the short page came first: no room to top it up
        got = ledger.alloc(6)
        assert got is not None and len(got) == 6
    finally:
        stack.close()


def test_available_without_a_budget_is_exact_with_a_short_last_page() -> None:
    stack = build_stack("host", num_blocks=14, blocks_per_page=4, background=False)
    try:
        ledger = stack.ledger(pinned=(0,))
        assert ledger.available() == 13
        assert ledger.alloc(13) is not None and ledger.available() == 0
    finally:
        stack.close()
