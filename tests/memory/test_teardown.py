"""``kvcore.memory.teardown``: ``close_parts`` under each error policy and ``CloseOnce``; then
one of its owners (``SlotStates``, on the host backend) with a driver failure injected at
shutdown; then ``kvcore.memory.chain.MemoryChain``, the builder every owner uses, failing at
each step of its build."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
import torch

from kvcore.budget.gate import MemoryGate, UnlimitedGate
from kvcore.errors import GeometryError, InjectedFault, KvcoreError, LedgerError, PoolFailed
from kvcore.memory.chain import MemoryChain, block_ledger
from kvcore.memory.geometry import KVGeometry
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


# ------------------------------------------------------------- the builder: MemoryChain

GRAN = 64 << 10


class ClosingGate(UnlimitedGate):
    """An ``UnlimitedGate`` that records its ``close()`` in ``closed``."""

    def __init__(self, closed: list[str]) -> None:
        super().__init__()
        self._closed = closed

    def close(self) -> None:
        self._closed.append("gate")


def _backend(closed: list[str]) -> FaultInjector:
    vmm = FaultInjector(make_backend("host", device_bytes=64 << 20, granularity=GRAN))
    close = vmm.close

    def recorded() -> None:
        closed.append("backend")
        close()

    vmm.close = recorded  # type: ignore[method-assign]
    return vmm


def _geometry(backend: object = None) -> KVGeometry:
    return KVGeometry(
        num_layers=2,
        kv_buffers=2,
        block_bytes=16 << 10,
        num_blocks=16,
        page_bytes=GRAN,
        granularity=GRAN,
        layout="per-layer",
    )


def _nothing_left(vmm: FaultInjector, failed_reserves: int = 0) -> None:
    assert vmm.calls("free_reservation") == vmm.calls("reserve") - failed_reserves
    assert not vmm.live_handles and vmm.mapped_ranges() == []


def test_a_chain_builds_every_part_in_order_and_closes_them_in_reverse() -> None:
    closed: list[str] = []
    vmm = _backend(closed)
    chain = MemoryChain.build(
        _geometry,
        open_backend=lambda: vmm,
        open_gate=lambda b, g: ClosingGate(closed),
        ledger=block_ledger((0,)),
        reserve_max=99,
    )
    assert chain.backend is vmm and chain.geometry == _geometry()
    assert chain.cache is not None and chain.mapper is not None and chain.pages is not None
    assert chain.ledger is not None and chain.ledger.is_allocated(0)  # reserved: page 0 backed
    assert chain.pages.stats().mapped >= 1
    assert [name for name, part in chain.parts() if part is not None] == [
        "page allocator",
        "mapper",
        "virtual KV cache",
        "memory gate",
        "host backend",
    ]
    assert chain.close() == [] and chain.closed
    assert closed == ["gate", "backend"]
    _nothing_left(vmm)
    assert chain.close() == [] and closed == ["gate", "backend"]  # once only


def test_a_chain_without_a_gate_stops_at_the_mapper_and_keeps_what_it_does_not_own() -> None:
    closed: list[str] = []
    vmm = _backend(closed)
    gate = ClosingGate(closed)
    bare = MemoryChain.build(_geometry(), backend=vmm, owns_backend=False)
    assert bare.mapper is not None and bare.pages is None and bare.gate is None
    bare.close()
    shared = MemoryChain.build(
        _geometry(),
        backend=vmm,
        owns_backend=False,
        gate=gate,
        owns_gate=False,
        label="conv0 state",
    )
    assert shared.pages is not None and shared.ledger is None
    assert [n for n, _ in shared.parts()][:3] == [
        "conv0 state's page allocator",
        "conv0 state's mapper",
        "conv0 state's virtual KV cache",
    ]
    shared.close()
    assert closed == []  # neither the gate nor the backend was the chains' to close
    _nothing_left(vmm)
    vmm.close()


@pytest.mark.parametrize("step", ["geometry", "cache", "gate", "ledger"])
def test_a_failed_step_closes_everything_built_and_raises_its_own_error(
    step: str, caplog: pytest.LogCaptureFixture
) -> None:
    closed: list[str] = []
    vmm = _backend(closed)
    given = ClosingGate(closed)

    def geometry(backend: object) -> KVGeometry:
        if step == "geometry":
            raise GeometryError("no page holds a block")
        return _geometry()

    def open_gate(backend: object, geometry: KVGeometry) -> MemoryGate:
        raise LedgerError("the ledger is full")

    if step == "cache":
        vmm.fail("reserve")
    if step == "ledger":
        vmm.fail("create", nth=2)  # block 0's page (the first is the cache's zero page)
    expected = {"geometry": GeometryError, "cache": InjectedFault, "gate": LedgerError}
    with pytest.raises(expected.get(step, PoolFailed)):
        MemoryChain.build(
            geometry,
            open_backend=lambda: vmm,
            gate=None if step == "gate" else given,
            open_gate=open_gate,
            ledger=block_ledger((0,)),
        )
    assert closed == (["backend"] if step == "gate" else ["gate", "backend"])
    _nothing_left(vmm, failed_reserves=step == "cache")
    assert "failed" not in caplog.text  # every part closed cleanly


def test_a_part_that_fails_to_close_on_a_failed_build_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed: list[str] = []
    vmm = _backend(closed)
    gate = ClosingGate(closed)
    gate.close = lambda: (_ for _ in ()).throw(OSError("ledger gone"))  # type: ignore[method-assign]
    vmm.fail("create", nth=2)
    with caplog.at_level(logging.ERROR), pytest.raises(PoolFailed):
        MemoryChain.build(_geometry(), backend=vmm, gate=gate, ledger=block_ledger((0,)))
    assert "closing the memory gate failed: OSError('ledger gone')" in caplog.text
    assert closed == ["backend"]


def test_a_tolerated_error_at_close_is_no_failure(caplog: pytest.LogCaptureFixture) -> None:
    closed: list[str] = []
    vmm = _backend(closed)
    chain = MemoryChain.build(_geometry(), backend=vmm, gate=ClosingGate(closed))
    assert chain.pages is not None
    real = chain.pages.close

    def fail_stopped() -> None:
        real()
        raise PoolFailed("the workers are gone")

    chain.pages.close = fail_stopped  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        assert chain.close(tolerate=(PoolFailed,)) == []
    assert "closing the page allocator: the workers are gone" in caplog.text
    assert closed == ["gate", "backend"]


def test_a_chain_needs_a_backend_or_a_mapper() -> None:
    with pytest.raises(ValueError, match="backend"):
        MemoryChain.build(_geometry())
