"""The VMM primitives, through ``as_tensor``, on every backend."""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import OutOfDeviceMemory, VmmError
from kvcore.vmm import VmmBackend


def test_reserve_is_aligned_and_distinct(backend: VmmBackend) -> None:
    g = backend.granularity()
    a = backend.reserve(4 * g)
    b = backend.reserve(4 * g)
    assert a % g == 0 and b % g == 0
    assert a + 4 * g <= b or b + 4 * g <= a
    backend.free_reservation(a, 4 * g)
    backend.free_reservation(b, 4 * g)


def test_map_write_unmap_remap_round_trip(backend: VmmBackend) -> None:
    g = backend.granularity()
    va = backend.reserve(4 * g)
    h = backend.create(g)
    backend.map(va + g, g, h)
    backend.set_access(va + g, g)
    t = backend.as_tensor(va + g, g, torch.int32)
    assert t.data_ptr() == va + g
    assert t.numel() == g // 4
    t.copy_(torch.arange(t.numel(), dtype=torch.int32, device=t.device))
    backend.synchronize()
    backend.unmap(va + g, g)
    # the same handle, at another address: its contents came along
    backend.map(va + 3 * g, g, h)
    backend.set_access(va + 3 * g, g)
    again = backend.as_tensor(va + 3 * g, g, torch.int32)
    assert torch.equal(again.cpu(), torch.arange(g // 4, dtype=torch.int32))
    backend.unmap(va + 3 * g, g)
    backend.release(h)
    backend.free_reservation(va, 4 * g)


def test_one_handle_mapped_at_several_addresses(backend: VmmBackend) -> None:
    g = backend.granularity()
    va = backend.reserve(2 * g)
    h = backend.create(g)
    backend.map(va, g, h)
    backend.map(va + g, g, h)
    backend.set_access(va, 2 * g)
    backend.as_tensor(va, g, torch.uint8).fill_(7)
    backend.synchronize()
    assert int(backend.as_tensor(va + g, g, torch.uint8).cpu()[123]) == 7
    backend.unmap(va, 2 * g)  # one unmap over two whole mappings
    backend.release(h)
    backend.free_reservation(va, 2 * g)


def test_read_only_mapping_reads(backend: VmmBackend) -> None:
    g = backend.granularity()
    va = backend.reserve(g)
    h = backend.create(g)
    backend.map(va, g, h)
    backend.set_access(va, g)
    backend.as_tensor(va, g, torch.uint8).fill_(3)
    backend.synchronize()
    backend.set_access(va, g, writable=False)
    assert int(backend.as_tensor(va, g, torch.uint8).sum().item()) == 3 * g
    backend.unmap(va, g)
    backend.release(h)
    backend.free_reservation(va, g)


def test_memory_returns_only_after_release_and_last_unmap(backend: VmmBackend) -> None:
    g = backend.granularity()
    before = backend.mem_info().free
    va = backend.reserve(g)
    h = backend.create(16 * g)
    assert backend.mem_info().free <= before - 16 * g
    if backend.name != "host":
        return  # the driver's free memory moves with other processes too
    big = backend.reserve(16 * g)
    backend.map(big, 16 * g, h)
    backend.release(h)
    assert backend.mem_info().free == before - 16 * g  # still mapped: still held
    backend.unmap(big, 16 * g)
    assert backend.mem_info().free == before
    backend.free_reservation(big, 16 * g)
    backend.free_reservation(va, g)


def test_misuse_raises_vmm_error_naming_the_call(backend: VmmBackend) -> None:
    g = backend.granularity()
    va = backend.reserve(2 * g)
    h = backend.create(g)
    with pytest.raises(VmmError) as err:
        backend.set_access(va, g)  # nothing mapped there
    assert err.value.call
    backend.map(va, g, h)
    with pytest.raises(VmmError):
        backend.map(va, g, h)  # already mapped
    backend.unmap(va, g)
    backend.release(h)
    with pytest.raises(VmmError):
        backend.map(va, g, h)  # released handle
    backend.free_reservation(va, 2 * g)


def test_device_exhaustion_raises_out_of_device_memory(backend: VmmBackend) -> None:
    g = backend.granularity()
    total = backend.mem_info().total
    if backend.name != "host":
        # one handle larger than the whole device
        with pytest.raises(OutOfDeviceMemory):
            backend.create((total // g + 1) * g)
        return
    handles = []
    with pytest.raises(OutOfDeviceMemory) as err:
        while True:
            handles.append(backend.create(g))
    assert err.value.call == "create"
    assert len(handles) * g == total
    assert backend.mem_info().free == 0
    backend.release(handles.pop())
    handles.append(backend.create(g))  # room again after a release
    for h in handles:
        backend.release(h)
    assert backend.mem_info().free == total
