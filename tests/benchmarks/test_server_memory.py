"""``benchmarks.vllm_servers.wait_down_to``: how ``sglang_serve --flush-cache`` waits for a
flushed elastic pool to give its memory back, on a clock the test moves."""

from __future__ import annotations

from benchmarks.vllm_servers import wait_down_to


class _Clock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_it_returns_once_the_server_holds_no_more_than_asked() -> None:
    clock = _Clock()
    readings = iter([10, 10, 8, 5, 3, 3])
    got = wait_down_to(lambda: next(readings), 4, poll_s=0.5, clock=clock, sleep=clock.sleep)
    assert got == {"from": 10, "to": 3, "s": 2.0, "reached": True}


def test_it_gives_up_after_its_timeout_and_says_so() -> None:
    clock = _Clock()
    got = wait_down_to(lambda: 9, 4, timeout_s=1.0, poll_s=0.25, clock=clock, sleep=clock.sleep)
    assert got == {"from": 9, "to": 9, "s": 1.0, "reached": False}


def test_a_server_already_down_is_not_waited_for() -> None:
    clock = _Clock()
    got = wait_down_to(lambda: 2, 4, clock=clock, sleep=clock.sleep)
    assert got == {"from": 2, "to": 2, "s": 0.0, "reached": True}
