"""FaultInjector: failing the N-th call of a kind, per-thread counts, leak bookkeeping."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvcore.errors import InjectedFault, OutOfDeviceMemory
from kvcore.vmm import open_backend
from kvcore.vmm.faults import FaultInjector


@pytest.fixture
def vmm() -> Iterator[FaultInjector]:
    inj = FaultInjector(open_backend("host", device_bytes=32 << 20))
    yield inj
    inj.close()


def test_nth_call_fails_before_reaching_the_backend(vmm: FaultInjector) -> None:
    g = vmm.granularity()
    va = vmm.reserve(4 * g)
    handles = [vmm.create(g) for _ in range(3)]
    vmm.fail("map", nth=2)
    vmm.map(va, g, handles[0])
    with pytest.raises(InjectedFault) as err:
        vmm.map(va + g, g, handles[1])
    assert err.value.call == "map" and err.value.args_["va"] == va + g
    vmm.map(va + 2 * g, g, handles[2])  # only the 2nd failed
    assert vmm.mapped_ranges() == [(va, g), (va + 2 * g, g)]
    vmm.map(va + g, g, handles[1])  # the failed call left the range free
    assert vmm.injected == 1 and vmm.armed == 0


def test_create_fails_with_out_of_device_memory_and_no_handle(vmm: FaultInjector) -> None:
    g = vmm.granularity()
    free = vmm.mem_info().free
    vmm.fail("create")
    with pytest.raises(OutOfDeviceMemory):
        vmm.create(g)
    assert vmm.live_handles == set()
    assert vmm.mem_info().free == free


def test_times_and_custom_exception(vmm: FaultInjector) -> None:
    g = vmm.granularity()
    vmm.fail("create", nth=1, times=2, exc=RuntimeError("boom"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            vmm.create(g)
    h = vmm.create(g)
    assert vmm.live_handles == {h}
    vmm.release(h)
    assert vmm.live_handles == set()


def test_after_forwards_then_raises(vmm: FaultInjector) -> None:
    g = vmm.granularity()
    va = vmm.reserve(g)
    h = vmm.create(g)
    vmm.map(va, g, h)
    vmm.fail("unmap", after=True)
    with pytest.raises(InjectedFault):
        vmm.unmap(va, g)
    assert vmm.mapped_ranges() == []  # the unmap did happen
    vmm.release(h)
    vmm.fail("create", after=True)
    with pytest.raises(OutOfDeviceMemory):
        vmm.create(g)
    assert len(vmm.live_handles) == 1  # the driver made one: it must be accounted for


def test_calls_are_counted_per_thread(vmm: FaultInjector) -> None:
    g = vmm.granularity()
    vmm.reset_counts()
    me = threading.get_ident()
    h = vmm.create(g)
    other: list[int] = []

    def work() -> None:
        other.append(threading.get_ident())
        vmm.release(h)
        vmm.synchronize()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert vmm.calls("create", thread=me) == 1
    assert vmm.calls(thread=me) == 1
    assert vmm.calls(thread=other[0]) == 2
    assert vmm.calls("release") == 1
    vmm.granularity()
    assert vmm.calls(thread=me) == 1  # granularity is not a driver call
    assert vmm.calls("granularity", thread=me) == 1


def test_unknown_kind_is_refused(vmm: FaultInjector) -> None:
    with pytest.raises(ValueError, match="known"):
        vmm.fail("mapp")
