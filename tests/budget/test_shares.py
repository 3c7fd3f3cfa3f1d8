"""Shares of the GPU budget (``kvcore.budget.shares``): an instance below its share that the
budget refuses waits, and while it waits an instance over its share gets nothing beyond it,
keeps no idle reserve beyond it and is asked for its cached KV above it; nobody waiting, an
instance borrows the whole budget. Gates run on fake clocks (``FakeClock``): the waiting
marks expire when the test moves the wall clock, never on real time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.budget.shares import WANT_HOLD_S, WANT_REFRESH_S, share_of, yields
from kvcore.errors import UnknownInstance
from tests.memstack import FakeClock

MiB = 1 << 20
UNIT = 64 * MiB
UUID = "GPU-shares-0000"


@pytest.fixture
def wall() -> FakeClock:
    """The wall clock every gate of a test reads (marks are compared across gates)."""
    return FakeClock(time.time())


@pytest.fixture
def ledger() -> Iterator[GpuLedger]:
    led = GpuLedger.open(UUID, device_total=64 * UNIT)
    led.set_budget(8 * UNIT)  # two instances: an equal share is 4 units
    yield led
    led.close()


def gate(led: GpuLedger, name: str, wall: FakeClock, **options: Any) -> LedgerGate:
    """A gate on the test's clock; ``options``: ``limit``, ``share``, ``give_back``."""
    return LedgerGate(led, name=name, engine="test", clock=wall, wall_clock=wall, **options)


def take(g: LedgerGate, units: int) -> int:
    """Acquire one unit at a time until ``units`` or a refusal; returns how many."""
    for n in range(units):
        if not g.try_acquire(UNIT):
            return n
    return units


def test_nobody_waiting_an_instance_borrows_the_whole_budget(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall)
    assert take(a, 8) == 8, "b is idle: a borrows its share"
    assert a.headroom() == 0 and a.overage() == 0
    assert b.record().mapped == 0 and b.record().wanted_until == 0.0


def test_a_refused_instance_below_its_share_makes_the_borrower_yield(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall)
    assert take(a, 8) == 8
    assert not b.try_acquire(UNIT), "the budget is a's"
    assert b.record().wanted_until == wall() + WANT_HOLD_S, "b waits below its share"
    snap = ledger.snapshot()
    assert share_of(snap, snap.find("a")) == 4 * UNIT  # type: ignore[arg-type]
    assert yields(snap, snap.find("a"), now=wall())  # type: ignore[arg-type]
    assert not yields(snap, snap.find("b"), now=wall())  # type: ignore[arg-type]
    # a, over its share of 4, is asked for the 4 units above it and may not grow
    assert a.overage() == 4 * UNIT
    assert a.headroom() == 0
    assert a.reserve_target(8 * UNIT) == 0
    a.release(2 * UNIT)
    assert not a.try_acquire(UNIT), "what a frees is for b while b waits"
    assert a.record().yielding
    assert take(b, 2) == 2, "b, below its share, takes it"
    assert a.overage() == 2 * UNIT


def test_the_borrower_grows_again_once_the_mark_expires(ledger: GpuLedger, wall: FakeClock) -> None:
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall)
    assert take(a, 8) == 8
    assert not b.try_acquire(UNIT)
    a.release(UNIT)
    assert not a.try_acquire(UNIT)
    wall.advance(WANT_HOLD_S + 0.01)  # b asked for nothing since: no longer waiting
    assert a.headroom() == UNIT and a.overage() == 0
    assert a.try_acquire(UNIT)
    assert not a.record().yielding, "an admitted request clears the flag"


def test_an_instance_below_its_share_is_never_held_back(ledger: GpuLedger, wall: FakeClock) -> None:
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall)
    assert take(a, 2) == 2
    assert take(b, 6) == 6
    assert not a.try_acquire(UNIT), "the budget is full"
    assert a.record().wanted_until > wall(), "a waits below its share"
    assert b.headroom() == 0 and b.overage() == 2 * UNIT, "b, over its share, yields"
    b.release(3 * UNIT)
    assert take(a, 3) == 3, "a's own mark never holds a back: it borrows what is free"
    assert not b.try_acquire(UNIT)
    assert b.record().wanted_until > wall(), "now b waits below its share"
    assert a.overage() == UNIT and a.headroom() == 0


def test_an_instance_over_its_share_never_marks_itself_waiting(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall)
    assert take(a, 3) == 3
    assert take(b, 5) == 5
    assert not b.try_acquire(UNIT)
    assert b.record().wanted_until == 0.0, "b holds more than its share: no claim on a"
    a.release(UNIT)
    assert a.try_acquire(UNIT), "a is not held back by b's appetite"


def test_note_wanted_marks_only_a_budget_shortage_below_the_share(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall, limit=2 * UNIT)
    assert take(b, 2) == 2
    b.note_wanted(UNIT)
    assert b.record().wanted_until == 0.0, "b's own limit binds: nobody else can help"
    b.note_wanted(0)
    assert take(a, 5) == 5
    wall.advance(WANT_REFRESH_S)
    a.note_wanted(UNIT)
    assert a.record().wanted_until == 0.0, "the budget has room for it: not b's doing"
    assert take(a, 1) == 1  # the budget is full now: 6 + 2
    c = gate(ledger, "c", wall)  # three instances: equal shares of 8 / 3 units
    c.note_wanted(UNIT)
    assert c.record().wanted_until == wall() + WANT_HOLD_S
    first = c.record().wanted_until
    wall.advance(WANT_REFRESH_S / 2)
    c.note_wanted(UNIT)
    assert c.record().wanted_until == first, "renewed at most once per WANT_REFRESH_S"
    wall.advance(WANT_REFRESH_S / 2)
    c.note_wanted(UNIT)
    assert c.record().wanted_until == wall() + WANT_HOLD_S
    assert a.headroom() == 0 and not a.try_acquire(UNIT), "a is over its third: it yields"


def test_a_set_share_is_kept_instead_of_an_equal_one(ledger: GpuLedger, wall: FakeClock) -> None:
    a, b = gate(ledger, "a", wall, share=6 * UNIT), gate(ledger, "b", wall)
    assert take(b, 8) == 8
    assert not a.try_acquire(UNIT)
    assert a.record().wanted_until > wall(), "a waits below its share of 6"
    assert b.overage() == 4 * UNIT, "b keeps only its equal share of 4"
    b.release(4 * UNIT)
    assert take(a, 5) == 4
    before, after = ledger.set_share("a", 2 * UNIT)
    assert (before.share, after.share) == (6 * UNIT, 2 * UNIT)
    assert not a.try_acquire(UNIT), "a is now over its share of 2: it no longer marks"
    assert a.record().wanted_until <= wall() + WANT_HOLD_S
    with pytest.raises(UnknownInstance):
        ledger.set_share("nobody", UNIT)


def test_page_allocators_hand_a_borrowed_budget_to_the_one_that_waits(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    """Two page allocators (host backend) on one ledger: the first maps the budget, the
    second misses and waits; the first, asked for its pages above its share, unmaps what it
    frees instead of keeping it as reserve, and the second maps it."""
    from tests.memstack import build_stack

    ga, gb = gate(ledger, "a", wall), gate(ledger, "b", wall)
    sa = build_stack("host", num_blocks=64, blocks_per_page=4, gate=ga, reserve_max=4,
                     background=False)  # fmt: skip
    sb = build_stack("host", num_blocks=64, blocks_per_page=4, gate=gb, background=False)
    page = sa.pages.page_bytes
    ledger.set_budget(8 * page)
    try:
        held = sa.pages.acquire(8)
        assert held is not None
        assert sb.pages.acquire(1) is None, "a miss: the budget is a's"
        assert gb.record().wanted_until > wall()
        sa.pages.release(held[:2])  # into a's reserve: no round has seen b wait yet
        assert sa.pages.available() == 0, "a holds more than its share: nothing to hand out"
        assert sa.pages.acquire(1) is None, "not even its own idle pages back"
        assert sa.pages.flush()
        assert ga.record().mapped == 6 * page, "its idle pages were unmapped"
        assert sa.pages.shed_wanted() == 2, "a is asked for the 2 pages in use above its share"
        sa.pages.release(held[2:3])
        assert sa.pages.flush()
        assert ga.record().mapped == 5 * page, "released, unmapped: not kept as reserve"
        assert sb.pages.acquire(3) is not None, "b maps what a gave back"
        assert sb.pages.acquire(1) is None, "the budget is full again"
        wall.advance(WANT_HOLD_S + 0.01)  # b no longer asks: a may borrow again
        assert sa.pages.flush() and sa.pages.shed_wanted() == 0
        assert sa.pages.available() == 0, "nothing left in the budget, but a is not held back"
        assert not ga.held_back()
    finally:
        sa.close()
        sb.close()


def test_a_block_ledger_says_it_waits_only_for_physical_memory(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    from tests.memstack import build_stack

    ga, gb = gate(ledger, "a", wall), gate(ledger, "b", wall)
    sa = build_stack("host", num_blocks=64, blocks_per_page=4, gate=ga, background=False)
    sb = build_stack("host", num_blocks=8, blocks_per_page=4, gate=gb, background=False)
    page = sa.pages.page_bytes
    ledger.set_budget(8 * page)
    la, lb = sa.ledger(), sb.ledger()
    try:
        held = lb.alloc(8)
        assert held is not None, "b's whole capacity: 2 pages"
        lb.note_shortage(4)
        assert gb.record().wanted_until == 0.0, "b is out of capacity, not of memory"
        lb.free(held[:4])  # a page empties and is unmapped
        assert sb.pages.flush() and gb.record().mapped == page
        assert la.alloc(28) is not None, "a maps the 7 pages left: the budget is full"
        la.note_shortage(4)
        assert ga.record().wanted_until == 0.0, "a holds more than its share of 4 pages"
        assert lb.available() == 0, "b's capacity is there, the memory is not"
        lb.note_shortage(4)
        assert gb.record().wanted_until == wall() + WANT_HOLD_S, "b waits below its share"
        assert ga.headroom() == 0 and ga.overage() == 3 * page
    finally:
        sa.close()
        sb.close()


def test_a_waiting_instance_keeps_its_mark_while_it_releases(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    """Releasing is no sign that an instance waits for nothing: its finished requests free
    pages while its queue still wants more. The mark ends WANT_HOLD_S after the last
    refusal, not at a release, so the borrower does not take back what it just gave up."""
    a, b = gate(ledger, "a", wall), gate(ledger, "b", wall)
    assert take(a, 2) == 2 and take(b, 6) == 6
    assert not a.try_acquire(UNIT)
    marked = a.record().wanted_until
    assert b.headroom() == 0 and b.held_back(), "b yields to a"
    assert b.headroom_held_back() == (0, True) and a.headroom_held_back() == (0, False)
    a.release(UNIT)  # one of a's requests finished; its queue still waits
    assert a.record().wanted_until == marked, "a release leaves the mark"
    assert b.headroom_held_back() == (0, True), "b still may not grow into what a freed"
    assert not b.try_acquire(UNIT)
    b.release(2 * UNIT)  # b's pages above its share empty
    assert take(a, 3) == 3, "a takes what it freed and what b gave back"
    assert not a.try_acquire(UNIT), "the budget is full again"
    assert a.record().wanted_until == marked, "at its share a no longer renews the mark"
    wall.advance(WANT_HOLD_S + 0.01)
    a.release(UNIT)
    assert b.headroom_held_back() == (UNIT, False), "the mark expired: b borrows again"


def test_a_borrower_that_preempts_gives_back_what_is_asked(
    ledger: GpuLedger, wall: FakeClock
) -> None:
    """``give_back="asked"`` (an engine that preempts to empty pages): the borrower is asked
    for what the waiting instance was refused beyond the budget's free bytes, again as the
    waiting instance maps it and asks on, never for everything above its share; "all" asks
    for everything above it (an engine that drains)."""
    a = gate(ledger, "a", wall, give_back="asked")
    b = gate(ledger, "b", wall)
    assert take(a, 8) == 8
    assert not b.try_acquire(UNIT)
    assert b.record().wanted_bytes == UNIT
    assert a.overage() == UNIT, "what b asks for, not the 4 units above a's share"
    assert a.headroom() == 0 and a.reserve_target(8 * UNIT) == 0
    a.release(UNIT)
    assert a.overage() == 0, "the budget's free unit covers b's ask"
    assert not a.try_acquire(UNIT), "what a frees is for b while b waits"
    assert b.try_acquire(UNIT)
    assert a.overage() == UNIT, "b mapped it: its ask stands while its mark lasts"
    assert not b.try_acquire(2 * UNIT)
    assert b.record().wanted_bytes == 2 * UNIT, "the larger ask"
    assert a.overage() == 2 * UNIT
    assert not b.try_acquire(5 * UNIT)
    assert b.record().wanted_bytes == 3 * UNIT, "at most what takes b to its share"
    assert a.overage() == 3 * UNIT, "all a holds above its share"
    with pytest.raises(ValueError, match="give_back"):
        gate(ledger, "c", wall, give_back="some")
    assert ledger.snapshot().find("c") is None, "refused before it registered"


def test_borrowers_give_back_what_is_asked_split_by_how_far_over_they_are(
    wall: FakeClock,
) -> None:
    """Three instances, shares of 4 units: c, below its share, asks for 2 units more than
    the full budget has. The borrowers that preempt give back those 2 units between them, a
    (2 over) twice what b (1 over) gives, not everything above their shares; while they lie
    free nobody is asked for more, and nobody grows into them either."""
    led = GpuLedger.open("GPU-shares-three", device_total=64 * UNIT)
    led.set_budget(12 * UNIT)
    try:
        a, b = (gate(led, n, wall, give_back="asked") for n in "ab")
        c = gate(led, "c", wall)
        assert take(a, 6) == 6 and take(b, 5) == 5 and take(c, 1) == 1
        assert not c.try_acquire(2 * UNIT)
        give_a, give_b = a.overage(), b.overage()
        assert 2 * UNIT <= give_a + give_b <= 2 * UNIT + 2, "what c asked for, not 3 units"
        assert abs(give_a - 2 * give_b) <= 2, "in proportion to 2 and 1 units over"
        a.release(UNIT)
        b.release(UNIT)
        assert a.overage() == 0 and b.overage() == 0, "the free 2 units cover c's ask"
        assert not a.try_acquire(UNIT) and not b.try_acquire(UNIT), "held while c waits"
        assert not c.try_acquire(8 * UNIT)
        assert c.record().wanted_bytes == 3 * UNIT, "at most what takes c to its share"
        assert a.overage() + b.overage() >= UNIT, "c's 3 units less the 2 free"
    finally:
        led.close()
