"""``kvcore.memory.teardown``: ``close_parts`` under each error policy and ``CloseOnce``; then
one of its owners (``SlotStates``, on the host backend) with a driver failure injected at
shutdown."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
import torch

from kvcore.budget.gate import UnlimitedGate
from kvcore.errors import KvcoreError, PoolFailed
from kvcore.memory.slots import SlotStates, StateTensor
from kvcore.memory.teardown import CloseOnce, PartFailure, close_parts
from kvcore.vmm.faults import FaultInjector
from tests.vmm_backends import make_backend


class Part:
    """A part that records its ``close()`` calls in ``closed`` and raises ``error`` if set."""

    def __init__(self, name: str, closed: list[str], error: Exception | None = None) -> None:
        self.name, self._closed, self.error = name, closed, error

    def close(self) -> None:
        self._closed.append(self.name)
        if self.error is not None:
            raise self.error


def chain(closed: list[str], **errors: Exception) -> list[tuple[str, object]]:
    """Parts a..d in order, ``None`` (never made) and an object without ``close`` between."""
    parts: list[tuple[str, object]] = [(n, Part(n, closed, errors.get(n))) for n in "abcd"]
    parts.insert(1, ("never made", None))
    parts.insert(3, ("no close", object()))
    return parts


@pytest.mark.parametrize("on_error", ["raise", "log"])
def test_every_part_closes_in_order_and_nothing_is_reported_when_none_fails(
    on_error: str, caplog: pytest.LogCaptureFixture
) -> None:
    closed: list[str] = []
    with caplog.at_level(logging.ERROR, logger="kvcore"):
        assert close_parts(chain(closed), on_error=on_error) == []  # type: ignore[arg-type]
    assert closed == ["a", "b", "c", "d"]
    assert caplog.records == []


def test_raise_closes_every_part_then_raises_the_first_failure_and_logs_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed: list[str] = []
    first, second = ValueError("unmap failed"), OSError("release failed")
    with caplog.at_level(logging.ERROR, logger="kvcore"), pytest.raises(ValueError) as err:
        close_parts(chain(closed, a=first, c=second), on_error="raise")
    assert err.value is first
    assert closed == ["a", "b", "c", "d"]  # b and d closed although a and c raised
    assert [r.getMessage() for r in caplog.records] == [
        "kvcore: closing the a failed: ValueError('unmap failed')",
        "kvcore: closing the c failed: OSError('release failed')",
    ]
    assert all(r.exc_info is not None for r in caplog.records)  # with their tracebacks


def test_log_closes_every_part_and_returns_the_failures_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed: list[str] = []
    first, second = ValueError("x"), RuntimeError("y")
    with caplog.at_level(logging.ERROR, logger="kvcore"):
        failed = close_parts(chain(closed, b=first, d=second), on_error="log")
    assert failed == [PartFailure("b", first), PartFailure("d", second)]
    assert closed == ["a", "b", "c", "d"]
    assert len(caplog.records) == 2


def test_an_error_factory_gets_every_failure_and_its_error_is_raised_from_the_first() -> None:
    closed: list[str] = []
    first, second = ValueError("x"), RuntimeError("y")
    seen: list[PartFailure] = []

    def summary(failed: Sequence[PartFailure]) -> KvcoreError:
        seen.extend(failed)
        return KvcoreError(f"{', '.join(f.part for f in failed)} failed", hint="see the log")

    with pytest.raises(KvcoreError, match=r"^a, c failed") as err:
        close_parts(chain(closed, a=first, c=second), on_error=summary)
    assert err.value.__cause__ is first
    assert seen == [PartFailure("a", first), PartFailure("c", second)]
    assert closed == ["a", "b", "c", "d"]


def test_an_interrupt_is_not_swallowed() -> None:
    closed: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        close_parts(chain(closed, b=KeyboardInterrupt()), on_error="log")  # type: ignore[arg-type]
    assert closed == ["a", "b"]


def test_close_once_begins_once_and_runs_the_callbacks_once_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    once = CloseOnce()
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("registry gone")

    once.on_close(lambda: calls.append("first"))
    once.on_close(broken)
    once.on_close(lambda: calls.append("last"))
    assert not once.closed
    with caplog.at_level(logging.ERROR, logger="kvcore"):
        assert once.begin() is True
    assert once.closed
    assert calls == ["first", "broken", "last"]  # a failing callback does not stop the rest
    assert "an on_close callback failed" in caplog.text
    assert once.begin() is False and once.begin() is False
    assert calls == ["first", "broken", "last"]  # never again
    once.on_close(lambda: calls.append("late"))  # registered after closing: runs at once
    assert calls[-1] == "late"


def test_close_once_lets_exactly_one_of_many_threads_close() -> None:
    once = CloseOnce()
    barrier = threading.Barrier(8)
    won: list[bool] = []

    def race() -> None:
        barrier.wait()
        won.append(once.begin())

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]


# ------------------------------------------------------------- an owner: SlotStates


def test_a_failed_unmap_at_slot_shutdown_still_releases_every_range_and_raises_it() -> None:
    vmm = FaultInjector(make_backend("host", device_bytes=64 << 20, granularity=64 << 10))
    gate = UnlimitedGate()
    gate_closed: list[bool] = []
    gate.close = lambda: gate_closed.append(True)  # type: ignore[attr-defined]
    states = SlotStates(
        vmm,
        gate,
        layers=2,
        states=[
            StateTensor("conv0", (8192,), torch.bfloat16),  # 16 KiB: 4 slots per 64 KiB page
            StateTensor("temporal", (4, 32, 32), torch.float32),
        ],
        slots=9,
        owns_backend=True,
    )
    assert states.take(5) is not None  # slots 1..5: two pages per layer in each state
    vmm.fail("unmap")  # the conv state's page allocator cannot unmap its first page
    with pytest.raises(PoolFailed, match="unmapping 4 pages at close failed"):
        states.close()  # the first failure itself, raised after every other part closed
    # the later parts closed all the same: the temporal state's pages, both ranges, the gate
    # and the backend (whose own close unmaps what the failed unmap left)
    reserved = vmm.calls("reserve")
    assert reserved > 0 and vmm.calls("free_reservation") == reserved
    assert gate_closed == [True]
    assert not vmm.live_handles and vmm.mapped_ranges() == []
    states.close()  # idempotent, silent
    assert vmm.calls("free_reservation") == reserved and gate_closed == [True]
