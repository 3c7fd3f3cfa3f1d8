"""``kvcore.memory.switch_interval``: the interval is shortened for a block, across threads,
and put back as found; and the page thread runs its rounds under it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from kvcore.memory.switch_interval import shortened
from tests.memstack import WAIT_TIMEOUT, build_stack

FOUND = 0.005  # CPython's default, set for every test here


@pytest.fixture(autouse=True)
def interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(FOUND)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_a_block_runs_shortened_and_the_interval_found_comes_back() -> None:
    with shortened(50e-6):
        assert sys.getswitchinterval() == pytest.approx(50e-6)
    assert sys.getswitchinterval() == FOUND


@pytest.mark.parametrize("off", [None, 0])
def test_none_or_zero_leaves_the_interval_alone(off: float | None) -> None:
    with shortened(off):
        assert sys.getswitchinterval() == FOUND
    assert sys.getswitchinterval() == FOUND


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"), shortened(-1.0):
        pass
    assert sys.getswitchinterval() == FOUND


def test_overlapping_blocks_keep_the_lowest_until_the_last_ends() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with shortened(20e-6):
            inside.set()
            assert leave.wait(WAIT_TIMEOUT)

    with shortened(50e-6):
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(WAIT_TIMEOUT)
        assert sys.getswitchinterval() == pytest.approx(20e-6)
        leave.set()
        thread.join(WAIT_TIMEOUT)
        assert sys.getswitchinterval() == pytest.approx(20e-6)  # this block is still running
    assert sys.getswitchinterval() == FOUND


def test_an_interval_already_shorter_is_kept() -> None:
    sys.setswitchinterval(10e-6)
    with shortened(50e-6):
        assert sys.getswitchinterval() == pytest.approx(10e-6)
    assert sys.getswitchinterval() == pytest.approx(10e-6)


def test_an_interval_changed_by_someone_else_meanwhile_is_not_undone() -> None:
    with shortened(50e-6):
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


@pytest.mark.parametrize("configured", [50e-6, None], ids=["shortened", "left-alone"])
def test_the_page_thread_unmaps_under_the_configured_interval(configured: float | None) -> None:
    stack = build_stack(hold_page_thread=True, switch_interval=configured)
    hold = stack.hold
    assert hold is not None
    try:
        assert stack.pages.switch_interval == configured
        ids = stack.pages.acquire(2)  # mapped on this thread: no round, no hold
        assert ids is not None
        assert sys.getswitchinterval() == FOUND
        hold.armed = True
        stack.pages.release(ids)  # no reserve: the page thread unmaps them
        assert hold.entered.wait(WAIT_TIMEOUT)
        during = sys.getswitchinterval()  # the page thread is held inside its round
        hold.release()
        assert stack.pages.flush()
        assert during == pytest.approx(configured if configured else FOUND)
        assert sys.getswitchinterval() == FOUND
    finally:
        stack.close()


def test_a_map_on_the_callers_thread_runs_under_the_configured_interval() -> None:
    stack = build_stack(switch_interval=50e-6)
    seen: list[float] = []
    real_map = stack.mapper.map

    def map_noting(page_ids: list[int]) -> None:
        seen.append(sys.getswitchinterval())
        real_map(page_ids)

    stack.mapper.map = map_noting  # type: ignore[method-assign]
    try:
        ids = stack.pages.acquire(1)  # no reserve: mapped on this thread
        assert ids is not None
        assert seen == [pytest.approx(50e-6)]
        assert sys.getswitchinterval() == FOUND
        stack.pages.release(ids)
        assert stack.pages.flush()
    finally:
        del stack.mapper.map
        stack.close()
