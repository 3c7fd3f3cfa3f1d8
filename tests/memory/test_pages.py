"""PageAllocator on the real host backend: states, reserve, gate, faults, fences, fail-stop.

Most tests build the allocator without its background thread (``background=False``): they
run its rounds themselves (``run_round``, ``flush``) and move a fake clock past back-offs
and demand windows. The tests about the thread itself (it maps and unmaps off the caller's
thread; a caller waits for the pages it has in flight) keep it and wait on events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore.budget import DIR_ENV, GROUP_ENV, BudgetGate, GpuLedger, LedgerGate, UnlimitedGate
from kvcore.errors import InvalidTransition, LedgerError, PoolFailed
from kvcore.memory.pages import BACKGROUND_THREAD_NAME, TRANSITIONS, PageAllocator, PageState
from tests.memstack import BACKENDS, WAIT_TIMEOUT, FakeClock, MemStack, build_stack

S = PageState


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stack(backend: str) -> Iterator[MemStack]:
    s = build_stack(backend, reserve_max=2, background=False)
    yield s
    s.close()


def clock_of(stack: MemStack) -> FakeClock:
    assert stack.clock is not None, "built with background=False"
    return stack.clock


def states(stack: MemStack, ids: list[int]) -> list[PageState]:
    return [stack.pages.state(p) for p in ids]


def test_acquire_maps_release_parks_up_to_the_reserve_and_unmaps_the_rest(
    stack: MemStack,
) -> None:
    ids = stack.pages.acquire(3)
    assert ids is not None and len(set(ids)) == 3
    assert states(stack, ids) == [S.IN_USE] * 3
    assert stack.mapped_pages() == set(ids)

    stack.pages.release(ids)
    assert stack.pages.flush()
    st = stack.pages.stats()
    assert (st.reserved, st.in_use, st.mapped, st.unmap_pending) == (2, 0, 2, 0)
    assert sorted(states(stack, ids)) == [S.FREE, S.RESERVED, S.RESERVED]
    assert stack.mapped_pages() == {p for p in ids if stack.pages.state(p) is S.RESERVED}


def test_reserved_pages_are_handed_out_again_without_a_mapper_call(stack: MemStack) -> None:
    ids = stack.pages.acquire(2)
    assert ids is not None
    stack.pages.release(ids)
    before = stack.pages.stats().caller_mapper_calls
    again = stack.pages.acquire(2)
    assert sorted(again or []) == sorted(ids)
    assert stack.pages.stats().caller_mapper_calls == before


def test_illegal_transitions_raise_naming_the_page_and_change_nothing(stack: MemStack) -> None:
    ids = stack.pages.acquire(2)
    assert ids is not None
    a, b = ids
    free_page = next(p for p in range(stack.pages.num_pages) if stack.pages.state(p) is S.FREE)
    with pytest.raises(InvalidTransition, match=f"page {free_page}: in state FREE") as err:
        stack.pages.release([a, free_page])
    assert err.value.ids == (free_page,)
    with pytest.raises(InvalidTransition, match="named twice"):
        stack.pages.release([a, b, a])
    with pytest.raises(InvalidTransition, match="out of range"):
        stack.pages.release([stack.pages.num_pages])
    assert states(stack, [a, b]) == [S.IN_USE, S.IN_USE]  # every failed call changed nothing

    stack.pages.release([a])
    with pytest.raises(InvalidTransition, match="RESERVED"):
        stack.pages.release([a])  # double release
    with pytest.raises(InvalidTransition, match="IN_USE"):
        stack.pages.acquire_ids([b])
    assert stack.pages.acquire_ids([a]) and stack.pages.state(a) is S.IN_USE
    assert stack.pages.acquire_ids([free_page]) and stack.pages.state(free_page) is S.IN_USE
    assert free_page in stack.mapped_pages()


def test_the_transition_table_is_the_design_state_machine() -> None:
    # free -> mapped (in use) -> in the reserve -> unmapped, plus quarantine
    assert (S.FREE, S.IN_USE) not in TRANSITIONS  # a page is mapped before it is in use
    assert (S.RESERVED, S.FREE) not in TRANSITIONS  # unmapping goes through UNMAPPING
    assert (S.IN_USE, S.FREE) not in TRANSITIONS
    assert not any(frm is S.QUARANTINED for frm, _ in TRANSITIONS)  # quarantine is final
    assert {to for frm, to in TRANSITIONS if frm is S.UNMAPPING} == {
        S.FREE,
        S.RESERVED,
        S.QUARANTINED,
    }


def test_background_thread_refills_and_the_allocating_thread_makes_no_driver_call(
    backend: str,
) -> None:
    stack = build_stack(backend, reserve_min=2, reserve_max=4)
    try:
        assert stack.pages.flush()
        assert stack.pages.stats().reserved == 2
        me = threading.get_ident()
        stack.vmm.reset_counts()
        for _ in range(300):
            ids = stack.pages.acquire(1)
            assert ids is not None
            stack.pages.release(ids)
        for _ in range(20):  # bursts deeper than reserve_min, still covered by the reserve
            ids = stack.pages.acquire(2)
            assert ids is not None
            stack.pages.release(ids)
            assert stack.pages.flush()
        st = stack.pages.stats()
        assert stack.vmm.calls(thread=me) == 0
        assert st.caller_mapper_calls == 0
        assert st.refill_mapper_calls > 0 and 2 <= st.reserved <= 4
    finally:
        stack.close()


def test_the_refill_target_follows_a_burst_then_decays(backend: str) -> None:
    """A burst of 3 raises the refill target to two bursts' worth (6, within reserve_max):
    the next burst of that size comes from the reserve, with no driver call on the caller.
    Once ``demand_window`` has passed without such a burst the target falls back."""
    stack = build_stack(backend, reserve_min=1, reserve_max=8, demand_window=60.0, background=False)
    try:
        assert stack.pages.flush() and stack.pages.stats().reserved == 1
        first = stack.pages.acquire(3)  # beyond the reserve: 2 mapped on this thread
        assert first is not None and stack.pages.stats().caller_mapper_calls == 1
        assert stack.pages.flush()
        assert stack.pages.stats().reserved == 6  # two bursts' worth, mapped ahead
        again = stack.pages.acquire(3)
        assert again is not None and stack.pages.stats().caller_mapper_calls == 1
        assert stack.pages.flush() and stack.pages.stats().reserved == 6
        clock_of(stack).advance(59.0)  # still inside the window: refilled to the target
        assert stack.pages.acquire(1) is not None
        assert stack.pages.flush() and stack.pages.stats().reserved == 6
        clock_of(stack).advance(2.0)  # the window passed: the demand halves (target 2)
        assert stack.pages.acquire(1) is not None
        assert stack.pages.flush() and stack.pages.stats().reserved == 5  # not refilled
    finally:
        stack.close()


def test_map_ahead_serves_a_growing_engine_and_lets_go_once_it_stops(backend: str) -> None:
    """``map_ahead`` without a reserve: nothing is mapped before the first acquire, which maps
    on this thread; the next pages of a growing engine come mapped from the background;
    acquires of the same size keep the demand alive; once it has decayed every idle page is
    unmapped, the released ones too."""
    stack = build_stack(backend, map_ahead=4, demand_window=2.0, background=False)
    pages = stack.pages
    try:
        assert pages.flush() and pages.stats().mapped == 0
        grown = pages.acquire(1)
        assert grown is not None and pages.stats().caller_mapper_calls == 1
        for _ in range(5):  # 1.5 s apart: each renews the demand before its window ends
            clock_of(stack).advance(1.5)
            assert pages.flush() and pages.stats().reserved == 2  # twice the demand, ahead
            ids = pages.acquire(1)
            assert ids is not None
            grown += ids
        assert pages.stats().caller_mapper_calls == 1
        pages.release(grown[:3])
        assert pages.flush()
        st = pages.stats()
        assert (st.in_use, st.reserved, st.mapped) == (3, 4, 7)  # kept up to map_ahead
        clock_of(stack).advance(2.5)  # a window without an acquire: the demand halves to 0
        assert pages.flush()
        st = pages.stats()
        assert (st.in_use, st.reserved, st.mapped, st.unmap_pending) == (3, 0, 3, 0)
        assert stack.mapped_pages() == set(grown[3:])
        again = pages.acquire(1)  # growth after a pause maps its first page on this thread
        assert again is not None and pages.stats().caller_mapper_calls == 2
    finally:
        stack.close()


def test_map_ahead_beside_a_reserve_keeps_the_reserve_once_demand_is_gone(backend: str) -> None:
    stack = build_stack(
        backend, reserve_min=1, reserve_max=2, map_ahead=6, demand_window=2.0, background=False
    )
    pages = stack.pages
    try:
        assert pages.flush() and pages.stats().reserved == 1  # reserve_min, before any demand
        ids = pages.acquire(3)  # 1 from the reserve, 2 mapped here
        assert ids is not None and pages.flush()
        assert pages.stats().reserved == 6  # twice the demand, within map_ahead
        pages.release(ids)
        assert pages.flush() and pages.stats().reserved == 6  # the released 3 beyond it queued
        for _ in range(2):  # 3 -> 1 -> 0
            clock_of(stack).advance(2.5)
            assert pages.flush()
        st = pages.stats()
        assert (st.reserved, st.mapped) == (2, 2)  # reserve_max: what it keeps without demand
    finally:
        stack.close()


def test_a_gate_that_grants_no_idle_memory_maps_nothing_ahead(backend: str) -> None:
    gate = BudgetGate(limit=1 << 40)
    gate.reserve_target = lambda wanted: 0  # type: ignore[method-assign]
    stack = build_stack(backend, gate=gate, map_ahead=4, background=False)
    pages = stack.pages
    try:
        assert pages.flush()
        assert pages.acquire(1) is not None and pages.flush()
        assert pages.stats().reserved == 0
        assert pages.acquire(1) is not None
        assert pages.stats().caller_mapper_calls == 2
    finally:
        stack.close()


def test_map_ahead_beyond_the_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="map_ahead"):
        build_stack("host", num_blocks=8, blocks_per_page=4, map_ahead=3)


def test_a_reserve_shortfall_maps_on_the_calling_thread(backend: str) -> None:
    stack = build_stack(backend, reserve_min=1, reserve_max=1, background=False)
    try:
        assert stack.pages.flush()
        ids = stack.pages.acquire(3)
        assert ids is not None and len(ids) == 3
        assert stack.pages.stats().caller_mapper_calls == 1
        assert set(ids) <= stack.mapped_pages()
    finally:
        stack.close()


def test_gate_refusal_is_a_miss_with_nothing_mapped(backend: str) -> None:
    gate = BudgetGate(limit=0)
    stack = build_stack(backend, gate=gate, background=False)
    try:
        gate.limit = 2 * stack.pages.page_bytes
        assert stack.pages.acquire(3) is None
        st = stack.pages.stats()
        assert (st.mapped, st.misses, gate.held) == (0, 1, 0)
        assert stack.mapped_pages() == set()
        ids = stack.pages.acquire(2)
        assert ids is not None and gate.held == 2 * stack.pages.page_bytes
        assert stack.pages.acquire(1) is None
    finally:
        stack.close()
    assert gate.held == 0


def test_a_limit_lowered_below_use_asks_for_pages_back_and_a_lifted_one_admits_again(
    backend: str,
) -> None:
    gate = BudgetGate(limit=1 << 40)
    stack = build_stack(backend, gate=gate, background=False)
    pages, pb = stack.pages, stack.pages.page_bytes
    woken: list[int] = []
    pages.set_shed_listener(lambda: woken.append(pages.shed_wanted()))
    try:
        ids = pages.acquire(6)
        assert ids is not None and pages.flush()
        assert pages.shed_wanted() == 0 and woken == []
        gate.limit = 2 * pb  # kvctl limit: 6 pages in use, 2 allowed
        pages.run_round()
        assert pages.shed_wanted() == 4 and woken == [4]  # the listener ran after the round
        assert pages.acquire(1) is None, "no growth over the limit: a miss, not an error"
        assert pages.take_shed() == 4 and pages.shed_wanted() == 0, "taken: no ask till a round"
        pages.run_round()
        assert pages.shed_wanted() == 4, "the next round asks again for what is still over"
        pages.release(ids[:1])  # a page leaving use lowers the ask before the next round
        assert pages.shed_wanted() == 3
        pages.release(ids[1:3])
        assert pages.flush()  # the rounds count the pages unmapped since
        assert pages.shed_wanted() == 1
        pages.release(ids[3:4])
        assert pages.flush()
        assert pages.shed_wanted() == 0 and gate.held == 2 * pb
        woken.clear()
        pages.run_round()
        assert woken == [], "nothing asked: no wake-up"
        gate.limit = 1 << 40  # lifted: growth comes back at once (kvcached #498)
        more = pages.acquire(4)
        assert more is not None and pages.flush()
        assert pages.stats().in_use == 6 and gate.held == 6 * pb and pages.shed_wanted() == 0
        gate.limit = pb
        pages.run_round()
        assert pages.shed_wanted() == 5
        pages.close()
        assert pages.shed_wanted() == pages.take_shed() == 0, "a closed allocator asks nothing"
    finally:
        stack.close()


def test_over_its_limit_an_allocator_keeps_no_pooled_handle(backend: str) -> None:
    gate = BudgetGate(limit=1 << 40)
    stack = build_stack(backend, gate=gate, pool_pages=4, background=False)
    pages, pb = stack.pages, stack.pages.page_bytes
    try:
        ids = pages.acquire(6)
        assert ids is not None and pages.flush()
        pages.release(ids[:2])
        assert pages.flush() and pages.stats().pooled > 0, "within the limit: handles pooled"
        gate.limit = 2 * pb
        pages.release(ids[2:5])
        pages.run_round()  # the round that unmaps them also drops what its unmaps pooled
        st = pages.stats()
        assert (st.in_use, st.pooled, gate.held) == (1, 0, pb)
    finally:
        stack.close()


def test_a_raising_shed_listener_is_logged_and_the_allocator_goes_on(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    gate = BudgetGate(limit=1 << 40)
    stack = build_stack(backend, gate=gate, background=False)
    pages = stack.pages

    def broken() -> None:
        raise RuntimeError("listener bug")

    pages.set_shed_listener(broken)
    try:
        ids = pages.acquire(2)
        assert ids is not None
        gate.limit = pages.page_bytes
        with caplog.at_level(logging.ERROR, logger="kvcore.memory.pages"):
            pages.run_round()
        assert "shed listener raised" in caplog.text
        pages.release(ids)
        assert pages.flush() and gate.held == 0 and not pages.stats().failed
    finally:
        stack.close()


def test_the_zero_page_is_charged_from_construction_to_close_by_default(backend: str) -> None:
    gate = UnlimitedGate()
    stack = build_stack(backend, gate=gate, charge_fixed_bytes=None, background=False)
    zero = stack.cache.zero_page_bytes
    try:
        assert zero > 0 and stack.mapper.fixed_bytes == zero
        assert gate.held == stack.pages.stats().charged_bytes == zero
        ids = stack.pages.acquire(2)
        assert ids is not None and gate.held == zero + 2 * stack.pages.page_bytes
        stack.pages.release(ids)
        assert stack.pages.flush() and gate.held == zero
        stack.pages.close()
        assert gate.held == 0
    finally:
        stack.close()


def test_a_gate_without_room_for_the_zero_page_refuses_the_allocator(backend: str) -> None:
    gate = BudgetGate(limit=0)
    with pytest.raises(PoolFailed, match="zero page"):
        build_stack(backend, gate=gate, charge_fixed_bytes=True, background=False)
    assert gate.held == 0
    stack = build_stack(backend, gate=gate, charge_fixed_bytes=False, background=False)
    try:
        assert gate.held == 0
    finally:
        stack.close()


def test_the_refill_maps_in_batches_and_each_joins_the_reserve(backend: str) -> None:
    stack = build_stack(backend, reserve_min=10, reserve_max=10, refill_batch=3, background=False)
    try:
        reserved = []
        for more in (True, True, True, False):  # 3 + 3 + 3 + 1 pages, one mapper call each
            assert stack.pages.run_round() is more
            reserved.append(stack.pages.stats().reserved)
        assert reserved == [3, 6, 9, 10]
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert st.reserved == 10
        assert st.refill_mapper_calls == 4
        assert len(stack.mapped_pages()) == 10
    finally:
        stack.close()


def test_refill_batch_must_be_positive(backend: str) -> None:
    stack = build_stack(backend, background=False)
    try:
        with pytest.raises(ValueError, match="refill_batch"):
            PageAllocator(stack.mapper, refill_batch=0, background=False)
    finally:
        stack.close()


def test_out_of_device_memory_is_a_miss_and_leaks_nothing(backend: str) -> None:
    stack = build_stack(backend, device_pages=3, background=False)
    try:
        handles = set(stack.vmm.live_handles)  # the zero page
        assert stack.pages.acquire(4) is None
        assert stack.vmm.live_handles == handles
        assert stack.mapped_pages() == set() and stack.pages.stats().mapped == 0
        ids = stack.pages.acquire(3)
        assert ids is not None and stack.mapped_pages() == set(ids)
        assert stack.pages.acquire(1) is None
    finally:
        stack.close()


def test_the_refill_backs_off_on_out_of_device_memory_then_maps_half(backend: str) -> None:
    stack = build_stack(
        backend, device_pages=2, reserve_min=4, reserve_max=4, retry_interval=1.0, background=False
    )
    try:
        assert stack.pages.flush()  # settled: the refill is blocked by its back-off
        st = stack.pages.stats()
        assert st.reserved == 0 and st.free == stack.pages.num_pages  # a batch of 4 missed
        assert st.refill_mapper_calls == 1
        clock_of(stack).advance(0.5)
        assert not stack.pages.run_round()  # within the back-off: no retry
        assert stack.pages.stats().refill_mapper_calls == 1
        clock_of(stack).advance(0.5)
        stack.pages.run_round()  # the retry asks for half: 2 pages, which fit
        st = stack.pages.stats()
        assert (st.reserved, st.refill_mapper_calls) == (2, 2)
        assert stack.pages.acquire(2) is not None  # from the reserve
        assert not stack.pages.stats().failed
    finally:
        stack.close()


def test_map_failing_mid_batch_is_a_miss_with_everything_rolled_back(stack: MemStack) -> None:
    handles = set(stack.vmm.live_handles)
    stack.vmm.fail("map", nth=2)  # the second page of the batch
    assert stack.pages.acquire(3) is None
    assert stack.vmm.live_handles == handles
    assert stack.mapped_pages() == set()
    st = stack.pages.stats()
    assert (st.mapped, st.quarantined, st.free) == (0, 0, stack.pages.num_pages)
    assert stack.pages.acquire(3) is not None


def test_a_failed_rollback_quarantines_the_page_and_capacity_shrinks(stack: MemStack) -> None:
    # page 2's map fails, then re-mapping its zero page fails too: its state is unknown
    stack.vmm.fail("map", nth=2, times=2)
    assert stack.pages.acquire(2) is None
    st = stack.pages.stats()
    assert st.quarantined == 1 and st.mapped == 0 and not st.failed
    bad = next(p for p in range(stack.pages.num_pages) if stack.pages.state(p) is S.QUARANTINED)
    rest = stack.pages.acquire(stack.pages.num_pages - 1)
    assert rest is not None and bad not in rest  # every other page is still usable
    assert stack.pages.acquire(1) is None  # the quarantined one is never handed out
    with pytest.raises(InvalidTransition):
        stack.pages.acquire_ids([bad])


def test_unmap_failing_keeps_the_page_mapped_and_a_later_round_unmaps_it(backend: str) -> None:
    stack = build_stack(backend, reserve_max=0, background=False)
    try:
        ids = stack.pages.acquire(1)
        assert ids is not None
        stack.vmm.fail("unmap")  # the background prepare_unmap fails and is rolled back
        stack.pages.release(ids)
        assert not stack.pages.flush()  # the retry waits for retry_interval
        assert stack.vmm.injected == 1
        assert stack.pages.state(ids[0]) is S.RESERVED and ids[0] in stack.mapped_pages()
        clock_of(stack).advance(0.01)
        assert stack.pages.flush()
        assert stack.pages.state(ids[0]) is S.FREE
        assert stack.mapped_pages() == set()
        st = stack.pages.stats()
        assert (st.quarantined, st.mapped, st.failed) == (0, 0, False)
    finally:
        stack.close()


def test_a_persistently_failing_unmap_is_retried_with_backoff_not_in_a_spin(backend: str) -> None:
    stack = build_stack(backend, reserve_max=0, background=False)
    clock = clock_of(stack)
    try:
        ids = stack.pages.acquire(1)
        assert ids is not None
        stack.vmm.fail("unmap", times=10_000)
        stack.vmm.reset_counts()
        stack.pages.release(ids)
        assert not stack.pages.flush()  # it cannot settle, and says so
        per_attempt = stack.vmm.calls("unmap")
        assert per_attempt > 0
        # retry_interval (10 ms) doubles per failure up to 20x: each retry waits that long
        for attempt, wait in enumerate((0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2), start=2):
            clock.advance(wait / 2)
            assert not stack.pages.run_round()  # within the back-off: not tried again
            assert stack.vmm.calls("unmap") == (attempt - 1) * per_attempt
            clock.advance(wait / 2 + 1e-6)
            assert not stack.pages.run_round()  # tried once more, and failed again
            assert stack.vmm.calls("unmap") == attempt * per_attempt
            assert stack.pages.state(ids[0]) is S.RESERVED
        stack.vmm.clear()
        clock.advance(0.2)
        assert stack.pages.flush()
        assert stack.pages.state(ids[0]) is S.FREE and stack.mapped_pages() == set()
    finally:
        stack.close()


def test_handle_release_failing_after_unmap_frees_the_page_and_leaks_nothing(backend: str) -> None:
    stack = build_stack(backend, reserve_max=0, background=False)
    try:
        ids = stack.pages.acquire(1)
        assert ids is not None
        stack.vmm.fail("release")  # commit_unmap's release fails; mapper retries at close
        stack.pages.release(ids)
        assert stack.pages.flush()
        assert stack.vmm.injected == 1
        assert stack.pages.state(ids[0]) is S.FREE and stack.mapped_pages() == set()
        assert stack.pages.acquire(1) is not None
    finally:
        stack.close()  # asserts no live handle is left


def test_an_unknown_mapper_state_fails_the_allocator_for_good(stack: MemStack) -> None:
    ids = stack.pages.acquire(1)
    assert ids is not None
    stack.vmm.fail("map", exc=RuntimeError("driver lost the context"))
    with pytest.raises(PoolFailed, match="driver lost the context"):
        stack.pages.acquire(2)
    assert stack.pages.stats().failed
    for call in (
        lambda: stack.pages.acquire(1),
        lambda: stack.pages.release(ids),
        lambda: stack.pages.retire(1),
        stack.pages.trim,
        stack.pages.available,
    ):
        with pytest.raises(PoolFailed):
            call()


def test_a_fenced_release_stays_mapped_until_its_fence_retires(stack: MemStack) -> None:
    ids = stack.pages.acquire(3)
    assert ids is not None
    stack.pages.release(ids[:2], fence=7)
    stack.pages.release(ids[2:], fence=8)
    assert stack.pages.flush()
    st = stack.pages.stats()
    assert (st.fenced, st.pending_fences, st.mapped) == (3, 2, 3)
    assert set(ids) == stack.mapped_pages()
    assert stack.pages.retire(6) == 0  # no fence at or below 6
    assert stack.pages.retire(7) == 2
    assert stack.pages.retire(7) == 0
    assert stack.pages.flush()
    st = stack.pages.stats()
    assert (st.fenced, st.pending_fences, st.reserved, st.mapped) == (1, 1, 2, 3)
    assert stack.pages.retire(8) == 1
    assert stack.pages.flush()
    assert stack.pages.stats().mapped == 2  # the reserve holds 2; the third was unmapped
    with pytest.raises(InvalidTransition, match=r"RESERVED|FREE"):
        stack.pages.release(ids[2:])


def test_retire_frees_every_fence_up_to_the_step_it_names(stack: MemStack) -> None:
    # engines fence with step numbers and retire the last finished step, skipping some
    ids = stack.pages.acquire(5)
    assert ids is not None
    for step, page in zip((3, 5, 4, 9, 5), ids, strict=True):  # not released in step order
        stack.pages.release([page], fence=step)
    assert stack.pages.stats().pending_fences == 4
    assert stack.pages.retire(5) == 4  # fences 3, 4 and both 5s at once
    st = stack.pages.stats()
    assert (st.fenced, st.pending_fences) == (1, 1)
    assert stack.pages.state(ids[3]) is S.FENCED
    assert stack.pages.retire(5) == 0 and stack.pages.retire(8) == 0
    assert stack.pages.state(ids[3]) is S.FENCED and ids[3] in stack.mapped_pages()
    assert stack.pages.retire(100) == 1
    assert stack.pages.stats().fenced == 0


def test_a_release_behind_a_fence_already_retired_is_not_held_back(stack: MemStack) -> None:
    ids = stack.pages.acquire(2)
    assert ids is not None
    assert stack.pages.retire(10) == 0
    stack.pages.release(ids[:1], fence=10)  # step 10 has finished: nothing can read it
    stack.pages.release(ids[1:], fence=11)
    assert stack.pages.state(ids[0]) is S.RESERVED
    assert stack.pages.state(ids[1]) is S.FENCED
    assert stack.pages.retire(11) == 1


def test_trim_drops_the_reserve_until_demand_returns(backend: str) -> None:
    gate = UnlimitedGate()
    stack = build_stack(backend, gate=gate, reserve_min=2, reserve_max=3, background=False)
    try:
        assert stack.pages.flush() and stack.pages.stats().reserved == 2
        assert stack.pages.trim() == 2
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert (st.reserved, st.mapped, gate.held, gate.reserve) == (0, 0, 0, 0)
        assert stack.mapped_pages() == set()
        assert stack.pages.acquire(1) is not None  # demand resumes the refill
        assert stack.pages.flush() and stack.pages.stats().reserved == 2
        assert gate.reserve == 2 * stack.pages.page_bytes
    finally:
        stack.close()


class _OnePageReserve(UnlimitedGate):
    def reserve_target(self, wanted: int) -> int:
        return min(wanted, self.page_bytes)

    page_bytes = 0


def test_the_gate_reserve_target_caps_the_reserve(backend: str) -> None:
    gate = _OnePageReserve()
    stack = build_stack(backend, gate=gate, reserve_max=4, background=False)
    try:
        gate.page_bytes = stack.pages.page_bytes
        ids = stack.pages.acquire(3)
        assert ids is not None
        assert stack.pages.flush()  # a round read the gate's target
        stack.pages.release(ids)
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert (st.reserved, st.mapped) == (1, 1)
        assert gate.held == gate.reserve == stack.pages.page_bytes
    finally:
        stack.close()


def test_available_counts_reserve_free_pages_and_gate_headroom(backend: str) -> None:
    stack = build_stack(backend, reserve_max=2, background=False)
    try:
        n = stack.pages.num_pages
        assert stack.pages.available() == n
        ids = stack.pages.acquire(3)
        assert ids is not None and stack.pages.available() == n - 3
        stack.pages.release(ids)
        assert stack.pages.available() == n
    finally:
        stack.close()


def test_close_unmaps_everything_and_returns_every_byte_to_the_gate(backend: str) -> None:
    gate = UnlimitedGate()
    stack = build_stack(backend, gate=gate, reserve_min=2, reserve_max=2, background=False)
    assert stack.pages.flush()
    ids = stack.pages.acquire(5)
    assert ids is not None
    stack.pages.release(ids[:1], fence=1)
    assert gate.held > 0
    stack.pages.close()
    assert stack.mapped_pages() == set() and gate.held == 0
    with pytest.raises(PoolFailed, match="closed"):
        stack.pages.acquire(1)
    stack.pages.close()  # idempotent
    stack.close()


def test_concurrent_acquire_and_release_keep_the_books_straight(backend: str) -> None:
    stack = build_stack(backend, num_blocks=128, reserve_min=2, reserve_max=6)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            held: list[int] = []
            for i in range(300):
                if i % 3 != 2:
                    got = stack.pages.acquire(1 + i % 2)
                    if got is not None:
                        held += got
                elif held:
                    stack.pages.release(held[: len(held) // 2 + 1])
                    del held[: len(held) // 2 + 1]
            stack.pages.release(held)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert (st.in_use, st.failed) == (0, False)
        assert st.mapped == st.reserved == len(stack.mapped_pages())
    finally:
        stack.close()


def test_bounds_are_checked(backend: str) -> None:
    stack = build_stack(backend, background=False)
    try:
        with pytest.raises(ValueError, match="reserve_min"):
            PageAllocator(stack.mapper, reserve_min=3, reserve_max=2, background=False)
        with pytest.raises(ValueError):
            stack.pages.acquire(-1)
        assert stack.pages.acquire(0) == []
    finally:
        stack.close()


class _BrokenTarget(UnlimitedGate):
    """A gate whose ``reserve_target`` raises (its books went away)."""

    broken = False

    def reserve_target(self, wanted: int) -> int:
        if self.broken:
            raise LedgerError("record removed under the gate")
        return wanted


def test_run_round_is_for_an_allocator_without_its_thread(backend: str) -> None:
    threaded = build_stack(backend)
    try:
        with pytest.raises(RuntimeError, match="background=False"):
            threaded.pages.run_round()
    finally:
        threaded.close()
    gate = _BrokenTarget()
    stack = build_stack(backend, gate=gate, reserve_min=1, reserve_max=1, background=False)
    try:
        assert stack.pages.stats().reserved == 0  # nothing runs until the test says so
        assert not stack.pages.run_round()
        assert stack.pages.stats().reserved == 1
        gate.broken = True
        with pytest.raises(PoolFailed, match="record removed") as err:
            stack.pages.run_round()  # a round that fails fails the allocator
        assert isinstance(err.value.__cause__, LedgerError)
        with pytest.raises(PoolFailed):
            stack.pages.acquire(1)
    finally:
        stack.close()
    closed = build_stack(backend, background=False)
    closed.close()
    with pytest.raises(PoolFailed, match="closed"):
        closed.pages.run_round()


# -- the gate is charged for exactly what the device holds ----------------------------------


def device_bytes(stack: MemStack) -> int:
    """Device memory the mapper's handles hold, from the backend's own books (every live
    handle but the cache's zero page)."""
    return (len(stack.vmm.live_handles) - 1) * stack.geometry.page_bytes


def test_pooled_handles_stay_charged_and_a_map_from_the_pool_charges_nothing(
    backend: str,
) -> None:
    gate = BudgetGate(limit=0)
    stack = build_stack(backend, gate=gate, pool_pages=2, background=False)
    pb = stack.pages.page_bytes
    gate.limit = 3 * pb
    try:
        ids = stack.pages.acquire(3)
        assert ids is not None and gate.held == device_bytes(stack) == 3 * pb
        stack.pages.release(ids)  # no reserve: all three are unmapped, two handles pooled
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert (st.mapped, st.pooled) == (0, 2)
        assert gate.held == device_bytes(stack) == st.charged_bytes == 2 * pb
        assert gate.reserve == 2 * pb  # pooled memory is idle memory
        again = stack.pages.acquire(3)  # two from the pool, one new: charged once
        assert again is not None and gate.held == device_bytes(stack) == 3 * pb
        stack.pages.release(again[:1])
        assert stack.pages.flush()
        assert gate.held == device_bytes(stack) == 3 * pb  # one mapped, pooled: still held
    finally:
        stack.close()
    assert gate.held == 0


def test_trim_releases_the_pool_and_its_charge(backend: str) -> None:
    gate = UnlimitedGate()
    stack = build_stack(
        backend, gate=gate, pool_pages=2, reserve_min=1, reserve_max=2, background=False
    )
    try:
        ids = stack.pages.acquire(4)
        assert ids is not None
        stack.pages.release(ids)
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert (st.reserved, st.pooled) == (2, 2) and gate.held == device_bytes(stack)
        stack.pages.trim()
        assert stack.pages.flush()
        st = stack.pages.stats()
        assert (st.reserved, st.mapped, st.pooled) == (0, 0, 0)
        assert gate.held == device_bytes(stack) == 0 and gate.reserve == 0
    finally:
        stack.close()


class _NoIdleMemory(UnlimitedGate):
    """A gate whose ``reserve_target`` can be lowered to nothing (a lowered limit)."""

    allow = True

    def reserve_target(self, wanted: int) -> int:
        return wanted if self.allow else 0


def test_a_lowered_reserve_target_drops_the_pool_too(backend: str) -> None:
    gate = _NoIdleMemory()
    stack = build_stack(backend, gate=gate, pool_pages=2, background=False)
    try:
        ids = stack.pages.acquire(2)
        assert ids is not None
        stack.pages.release(ids)
        assert stack.pages.flush() and stack.pages.stats().pooled == 2
        gate.allow = False
        assert stack.pages.flush()
        assert stack.pages.stats().pooled == 0
        assert gate.held == device_bytes(stack) == 0 and gate.reserve == 0
    finally:
        stack.close()


def test_a_handle_whose_release_failed_stays_charged_until_released(backend: str) -> None:
    gate = UnlimitedGate()
    stack = build_stack(backend, gate=gate, background=False)
    try:
        ids = stack.pages.acquire(1)
        assert ids is not None
        # the commit's release fails, and again on the commit's retry
        stack.vmm.fail("release", times=2)
        stack.pages.release(ids)
        assert stack.pages.flush()
        assert stack.mapper.stats()["pending_release"] == 1
        assert stack.mapped_pages() == set()
        assert gate.held == device_bytes(stack) == stack.pages.page_bytes
        stack.pages.trim()  # asks the mapper to retry it
        assert stack.pages.flush()
        assert stack.mapper.stats()["pending_release"] == 0
        assert gate.held == device_bytes(stack) == 0
    finally:
        stack.close()


def test_a_quarantined_page_stays_charged_for_the_memory_it_holds(backend: str) -> None:
    gate = UnlimitedGate()
    stack = build_stack(backend, gate=gate, pool_pages=1, background=False)
    try:
        stack.vmm.fail("map", nth=2, times=2)  # page 2's map and its rollback both fail
        assert stack.pages.acquire(2) is None
        st = stack.pages.stats()
        assert st.quarantined == 1 and st.mapped == 0
        assert gate.held == device_bytes(stack) == st.charged_bytes > 0
        ids = stack.pages.acquire(3)
        assert ids is not None and gate.held == device_bytes(stack)
    finally:
        stack.pages.close()
        assert gate.held == device_bytes(stack)  # the quarantined handle: held until
        stack.close()  # the mapper's close releases it


def test_two_instances_on_one_ledger_never_hold_more_than_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-GPU ledger must see pooled handles: instance a's pool is device memory that
    instance b cannot have."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.delenv(GROUP_ENV, raising=False)
    ledger = GpuLedger.open("GPU-pages-test", device_total=1 << 30)
    stacks: list[MemStack] = []
    try:
        gates = [LedgerGate(ledger, name=n, engine="test") for n in ("a", "b")]
        stacks = [build_stack("host", gate=g, pool_pages=2, background=False) for g in gates]
        a, b = stacks
        pb = a.pages.page_bytes
        ledger.set_budget(4 * pb)
        ids = a.pages.acquire(4)
        assert ids is not None
        a.pages.release(ids)
        assert a.pages.flush()
        assert device_bytes(a) == gates[0].record().mapped == 2 * pb  # the pool
        assert b.pages.acquire(3) is None  # only 2 pages are really free
        got = b.pages.acquire(2)
        assert got is not None
        assert sum(device_bytes(s) for s in stacks) == ledger.snapshot().total_mapped == 4 * pb
        a.pages.trim()  # the gate asks for memory back: the pool goes
        assert a.pages.flush() and device_bytes(a) == 0
        assert b.pages.acquire(2) is not None
        for g, s in zip(gates, stacks, strict=True):
            assert g.record().mapped == device_bytes(s)
    finally:
        for s in stacks:
            s.close()
        ledger.close()


class _BrokenGate(UnlimitedGate):
    """A gate whose books went away (e.g. the ledger record was reclaimed under it)."""

    broken = False

    def try_acquire(self, nbytes: int) -> bool:
        if self.broken:
            raise LedgerError("record removed under the gate")
        return super().try_acquire(nbytes)


def test_a_failing_gate_fails_the_allocator_and_strands_no_page(backend: str) -> None:
    gate = _BrokenGate()
    stack = build_stack(backend, gate=gate, background=False)
    try:
        ids = stack.pages.acquire(1)
        assert ids is not None
        gate.broken = True
        with pytest.raises(PoolFailed, match="record removed") as err:
            stack.pages.acquire(2)
        assert isinstance(err.value.__cause__, LedgerError)
        assert stack.pages.stats().failed
        with pytest.raises(PoolFailed):
            stack.pages.acquire_ids([ids[0] + 1])  # no page waits forever in MAPPING
        assert all(stack.pages.state(p) is not S.MAPPING for p in range(stack.pages.num_pages))
    finally:
        stack.close()  # unmaps everything; asserts no handle is left


# -- pages in flight on the background thread are capacity, not a miss --------------------


def _acquire_while_held(stack: MemStack, n: int) -> list[int] | None:
    """``acquire(n)`` on another thread while the background thread is held inside a mapper
    call; the hold is lifted once that acquire waits for it (or has returned without
    waiting), so an acquire that gives up on pages in flight is seen to return a miss."""
    assert stack.hold is not None and stack.hold.entered.wait(WAIT_TIMEOUT)
    result: list[int] | None = stack.hold.call_past(lambda: stack.pages.acquire(n))
    return result


def test_an_acquire_waits_for_pages_being_unmapped_instead_of_missing(backend: str) -> None:
    """No budget: every page was released a moment ago and the background thread is
    unmapping them; the pool still counts them and an acquire of all of them succeeds."""
    stack = build_stack(backend, num_blocks=16, hold_page_thread=True)
    try:
        n = stack.pages.num_pages
        ids = stack.pages.acquire(n)
        assert ids is not None
        assert stack.hold is not None
        stack.hold.armed = True
        stack.pages.release(ids)  # no reserve: all of them queue for the background unmap
        assert stack.hold.entered.wait(WAIT_TIMEOUT)
        assert stack.pages.state(ids[0]) is S.UNMAPPING
        assert stack.pages.available() == n
        again = _acquire_while_held(stack, n)
        assert again is not None and sorted(again) == sorted(ids)
        assert stack.pages.stats().misses == 0
    finally:
        stack.close()


def test_an_acquire_waits_for_the_refill_it_woke(backend: str) -> None:
    """``reserve_min=1``: an acquire wakes the refill, which takes a free page into its
    map; the next acquire needs that page too and gets it once the map lands."""
    stack = build_stack(backend, num_blocks=16, reserve_min=1, reserve_max=1, hold_page_thread=True)
    try:
        assert stack.pages.flush()  # the reserve holds one page
        assert stack.hold is not None
        stack.hold.armed = True
        first = stack.pages.acquire(2)  # the reserve's page + one mapped here
        assert first is not None
        assert stack.hold.entered.wait(WAIT_TIMEOUT)  # the refill maps one of the two left
        assert stack.pages.available() == 2
        second = _acquire_while_held(stack, 2)
        assert second is not None and not set(first) & set(second)
        assert stack.pages.stats().misses == 0
    finally:
        stack.close()


def test_an_acquire_still_misses_when_no_page_is_left(backend: str) -> None:
    stack = build_stack(backend, num_blocks=16, background=False)
    try:
        ids = stack.pages.acquire(stack.pages.num_pages)
        assert ids is not None
        assert stack.pages.acquire(1) is None  # nothing in flight to wait for
        assert stack.pages.stats().misses == 1
    finally:
        stack.close()


def test_a_stuck_ledger_lock_is_a_miss_never_a_failed_allocator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the per-GPU ledger's lock (a stopped ``kvctl``): allocations
    miss and releases wait, the allocator keeps working, and the books balance once the
    lock is free again."""
    import fcntl
    import os

    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.delenv(GROUP_ENV, raising=False)
    ledger = GpuLedger.open("GPU-stuck-lock-test", device_total=1 << 30)
    g = LedgerGate(ledger, name="a", engine="test")
    stack = build_stack("host", gate=g, background=False)
    try:
        held = stack.pages.acquire(2)
        assert held is not None
        fd = os.open(ledger.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert stack.pages.acquire(1) is None  # a miss, not PoolFailed
            stack.pages.release(held)  # unmapped by the next round; the gate defers it
            assert stack.pages.flush()
            assert not stack.pages.stats().failed
        finally:
            os.close(fd)
        again = stack.pages.acquire(1)
        assert again is not None
        assert g.record().mapped == stack.pages.stats().charged_bytes == stack.pages.page_bytes
    finally:
        stack.close()
        g.close()
        ledger.close()


class _HeldSync:
    """Stands in for a backend's ``synchronize`` that waits for a busy device: the page
    thread's call is held until ``go`` is set (``entered`` once it is waiting); any other
    thread's passes at once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self) -> None:
        if threading.current_thread().name == BACKGROUND_THREAD_NAME:
            self.entered.set()
            assert self.go.wait(WAIT_TIMEOUT), "the test never let the device sync finish"
        self.inner()


def test_a_map_on_the_engine_thread_does_not_wait_for_a_background_unmaps_device_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page thread unmapping a released page waits for the device; an acquire that maps
    another page meanwhile (the engine's thread, no reserve) goes ahead and maps it."""
    stack = build_stack(num_blocks=32, blocks_per_page=4)
    sync = _HeldSync(stack.vmm.synchronize)
    monkeypatch.setattr(stack.vmm, "synchronize", sync)
    try:
        first = stack.pages.acquire(1)
        assert first is not None
        stack.pages.release(first)  # no reserve: queued for the page thread's unmap
        assert sync.entered.wait(WAIT_TIMEOUT)
        got: list[Any] = []
        caller = threading.Thread(target=lambda: got.append(stack.pages.acquire(1)))
        caller.start()
        caller.join(WAIT_TIMEOUT)  # the held device sync must not hold this map back
        assert not caller.is_alive() and got[0] is not None
        assert got[0][0] in stack.mapped_pages() and first[0] in stack.mapped_pages()
    finally:
        sync.go.set()
    assert stack.pages.flush()
    assert first[0] not in stack.mapped_pages()  # the held unmap then went through
    stack.close()


class _ReleaseLog(UnlimitedGate):
    """An unlimited gate that lists the bytes of each ``release`` in order."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []

    def release(self, nbytes: int) -> None:
        self.released.append(nbytes)
        super().release(nbytes)


@pytest.fixture
def ten_in_use(backend: str) -> Iterator[tuple[MemStack, _ReleaseLog, list[int]]]:
    """A stack without a reserve whose gate logs releases, ten pages in use."""
    gate = _ReleaseLog()
    stack = build_stack(backend, gate=gate, reserve_max=0, background=False)
    try:
        ids = stack.pages.acquire(10)
        assert ids is not None
        yield stack, gate, ids
    finally:
        stack.close()


def test_a_round_gives_memory_back_chunk_by_chunk_and_waits_for_the_device_once(
    ten_in_use: tuple[MemStack, _ReleaseLog, list[int]],
) -> None:
    stack, gate, ids = ten_in_use
    stack.vmm.reset_counts()
    stack.pages.release(ids)
    assert stack.pages.flush()
    pb = stack.pages.page_bytes
    assert gate.released == [pb, 2 * pb, 4 * pb, 3 * pb]  # chunks double from one page
    assert stack.vmm.calls("synchronize") == 1
    assert stack.mapped_pages() == set() and gate.held == 0
    assert states(stack, ids) == [S.FREE] * 10


def test_a_chunk_that_fails_to_unmap_keeps_it_and_the_rest_mapped_until_the_retry(
    ten_in_use: tuple[MemStack, _ReleaseLog, list[int]],
) -> None:
    stack, gate, ids = ten_in_use
    pb = stack.pages.page_bytes
    per_page = stack.geometry.handles_per_page
    stack.vmm.fail("unmap", nth=per_page + 1)  # the second chunk's first unmap
    stack.pages.release(ids)
    assert not stack.pages.flush()  # the retry waits for retry_interval
    assert gate.released == [pb]  # the first chunk came back
    assert gate.held == 9 * pb and len(stack.mapped_pages()) == 9
    assert sorted(states(stack, ids)).count(S.RESERVED) == 9
    stack.vmm.reset_counts()
    clock_of(stack).advance(0.01)
    assert stack.pages.flush()
    assert sum(gate.released) == 10 * pb and gate.held == 0
    assert stack.mapped_pages() == set() and stack.vmm.calls("synchronize") == 1
    st = stack.pages.stats()
    assert (st.quarantined, st.mapped, st.failed) == (0, 0, False)


def test_an_acquire_under_a_full_budget_gets_the_first_chunk_before_the_round_ends(
    backend: str,
) -> None:
    """The budget is full and every page is being unmapped by one round: an ``acquire``
    succeeds with the first chunk's bytes while the next chunk is still in the mapper."""
    stack = build_stack(backend, reserve_max=0, hold_page_thread=True)
    hold = stack.hold
    assert hold is not None
    try:
        pb = stack.pages.page_bytes
        gate = BudgetGate(10 * pb)
        stack.pages.close()
        stack.pages = PageAllocator(hold, gate, charge_fixed_bytes=False)
        ids = stack.pages.acquire(10)
        assert ids is not None and stack.pages.acquire(1) is None  # the budget is full
        held = hold.prepare_unmap

        def prepare(page_ids: Any, *, synchronize: bool = True) -> None:
            if synchronize:  # the round's first chunk goes through; the next one is held
                hold.inner.prepare_unmap(page_ids)
            else:
                held(page_ids, synchronize=False)

        hold.prepare_unmap = prepare  # type: ignore[method-assign]
        hold.armed = True
        stack.pages.release(ids)
        assert hold.entered.wait(WAIT_TIMEOUT)
        got = stack.pages.acquire(1)
        assert got is not None and gate.held == 10 * pb
        hold.release()
        assert stack.pages.flush()
        assert gate.held == pb and stack.mapped_pages() == set(got)
    finally:
        stack.close()
