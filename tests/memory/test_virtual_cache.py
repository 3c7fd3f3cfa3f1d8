"""Virtual KV tensors and the local page mapper, on every backend and both layouts.

Every backend call goes through ``FaultInjector`` so the tests can fail any call and then
prove what the mapper promises: the right error, every page in a known state (each slot
either wholly the zero page or wholly its own handle), no handle leaked.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
import torch

from kvcore.errors import (
    GeometryError,
    InjectedFault,
    InvalidTransition,
    OutOfDeviceMemory,
    PageQuarantined,
    PoolFailed,
    ZeroPageWritten,
)
from kvcore.memory.geometry import LAYOUTS, KVGeometry, Layout
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.mapper import MappingState, PageMapper
from kvcore.memory.virtual_cache import (
    ZERO_PAGE_MAX_BYTES,
    VirtualKVCache,
    default_zero_page_bytes,
)
from kvcore.vmm.faults import FaultInjector
from kvcore.vmm.host import HostBackend
from tests.vmm_backends import BACKEND_PARAMS, make_backend

LAYERS, BUFFERS = 2, 2


@pytest.fixture(params=BACKEND_PARAMS)
def vmm(request: pytest.FixtureRequest) -> Iterator[FaultInjector]:
    inj = FaultInjector(make_backend(request.param))
    yield inj
    inj.close()


def geometry(vmm: FaultInjector | int, layout: Layout, **kw: int) -> KVGeometry:
    """4 pages; per-layer: 8 blocks of 256 KiB per 2 MiB page; compound: 4 blocks. ``vmm``
    is a backend or its granularity."""
    g = vmm if isinstance(vmm, int) else vmm.granularity()
    row = g // 8 if layout == "per-layer" else g // (4 * LAYERS * BUFFERS)
    args = {
        "num_layers": LAYERS,
        "kv_buffers": BUFFERS,
        "block_bytes": row,
        "page_bytes": g,
        "granularity": g,
        "num_blocks": 4 * (g // (row if layout == "per-layer" else row * LAYERS * BUFFERS)) - 2,
    }
    args.update(kw)
    return KVGeometry(layout=layout, **args)  # type: ignore[arg-type]


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> Layout:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def cache(vmm: FaultInjector, layout: Layout) -> Iterator[VirtualKVCache]:
    c = VirtualKVCache(vmm, geometry(vmm, layout), dtype=torch.float32)
    yield c
    c.close()


@pytest.fixture
def mapper(cache: VirtualKVCache) -> Iterator[LocalPageMapper]:
    m = LocalPageMapper(cache)
    yield m
    m.close()


# -- helpers ---------------------------------------------------------------------------------


def slot_kinds(vmm: FaultInjector, cache: VirtualKVCache, page: int) -> list[str]:
    """What each slot of ``page`` holds right now, from the backend's point of view:
    ``zero`` (the zero page at every ``zero_page_bytes``), ``own`` (one whole non-zero
    handle) or ``broken`` (anything else: a hole, a partial mapping)."""
    maps = vmm.mappings()
    gran = cache.zero_page_bytes
    out = []
    for va, size in cache.slots(page):
        own = maps.get(va)
        if own is not None and own[0] == size and own[1] != cache.zero_handle:
            out.append("own")
        elif all(maps.get(va + o) == (gran, cache.zero_handle) for o in range(0, size, gran)):
            out.append("zero")
        else:
            out.append("broken")
    return out


def assert_consistent(vmm: FaultInjector, mapper: LocalPageMapper) -> None:
    """Every page's slots match its state; every live handle is accounted for."""
    cache = mapper.cache
    expected = 1 + mapper.stats()["pooled_handles"] + mapper.stats()["pending_release"]
    for p in range(mapper.num_pages):
        kinds = slot_kinds(vmm, cache, p)
        state = mapper.state(p)
        if state is MappingState.MAPPED:
            assert kinds == ["own"] * len(kinds), (p, state, kinds)
        elif state in (MappingState.UNMAPPED, MappingState.PREPARED):
            assert kinds == ["zero"] * len(kinds), (p, state, kinds)
        if state in (MappingState.MAPPED, MappingState.PREPARED, MappingState.QUARANTINED):
            expected += cache.geometry.handles_per_page
    assert len(vmm.live_handles) == expected
    if isinstance(vmm.inner, HostBackend):  # the backend's own count agrees
        assert vmm.inner.live_handles == expected
    # what the page allocator charges its gate: every live handle but the zero page
    assert mapper.held_bytes == (expected - 1) * cache.geometry.page_bytes
    assert mapper.pooled_pages == mapper.stats()["pooled_handles"] // (
        cache.geometry.handles_per_page
    )


def raw_bytes(vmm: FaultInjector, cache: VirtualKVCache, index: int) -> torch.Tensor:
    va, size = cache.ranges[index]
    return vmm.as_tensor(va, size, torch.uint8).cpu()


def fill_block(cache: VirtualKVCache, layer: int, buffer: int, block: int, value: float) -> None:
    cache.view(layer, buffer)[block].fill_(value)
    cache.backend.synchronize()


def block_sum(cache: VirtualKVCache, layer: int, buffer: int, block: int) -> float:
    return float(cache.view(layer, buffer)[block].sum().item())


# -- the cache and its views -----------------------------------------------------------------


def test_mapper_implements_the_protocol(mapper: LocalPageMapper) -> None:
    assert isinstance(mapper, PageMapper)
    g = mapper.geometry
    assert mapper.num_pages == g.num_pages == 4
    assert mapper.page_bytes == g.page_bytes * g.handles_per_page


def test_fresh_cache_reads_zeros_everywhere(cache: VirtualKVCache, vmm: FaultInjector) -> None:
    g = cache.geometry
    for layer in range(LAYERS):
        for buffer in range(BUFFERS):
            v = cache.view(layer, buffer)
            assert v.shape == (g.num_blocks, g.block_bytes // 4)
            assert float(v.abs().sum().item()) == 0.0
    # the whole reserved address space is the zero page, nothing else
    assert {vmm.mappings()[va][1] for va, _ in vmm.mapped_ranges()} == {cache.zero_handle}


def test_views_address_the_layout_bytes(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    cache = mapper.cache
    g = cache.geometry
    mapper.map(range(g.num_pages))
    for layer in range(LAYERS):
        for buffer in range(BUFFERS):
            v = cache.view(layer, buffer, dtype=torch.int32, block_shape=(4, g.block_bytes // 16))
            for block in (0, 5, g.num_blocks - 1):
                v[block].fill_(1000 * layer + 100 * buffer + block)
    vmm.synchronize()
    for layer in range(LAYERS):
        for buffer in range(BUFFERS):
            for block in (0, 5, g.num_blocks - 1):
                if g.layout == "per-layer":
                    index, start = layer * BUFFERS + buffer, block * g.block_bytes
                else:  # the formula of kvcore.memory.geometry's docstring
                    index = 0
                    start = (
                        block * LAYERS * BUFFERS * g.block_bytes
                        + (layer * BUFFERS + buffer) * g.block_bytes
                    )
                raw = raw_bytes(vmm, cache, index)[start : start + g.block_bytes]
                want = torch.full((g.block_bytes // 4,), 1000 * layer + 100 * buffer + block)
                assert torch.equal(raw.view(torch.int32), want.to(torch.int32))
                addr = cache.ranges[index][0] + start
                assert cache.block_address(layer, buffer, block) == addr


def test_compound_views_stride_over_the_layers(vmm: FaultInjector) -> None:
    c = VirtualKVCache(vmm, geometry(vmm, "compound"), dtype=torch.float16)
    try:
        g = c.geometry
        v = c.view(1, 0)
        assert v.stride(0) * 2 == LAYERS * BUFFERS * g.block_bytes
        assert v.data_ptr() == c.ranges[0][0] + (1 * BUFFERS + 0) * g.block_bytes
    finally:
        c.close()


def test_contiguous_per_layer_ranges_are_one_flat_buffer(vmm: FaultInjector) -> None:
    """``contiguous=True``: range ``i`` starts where range ``i - 1`` ends, and ``flat()`` is
    one tensor over all of them (how vLLM views a layer-outermost buffer); a block written
    through a layer's view is at ``i * range_bytes + block * block_bytes`` of it."""
    g = geometry(vmm, "per-layer")
    c = VirtualKVCache(vmm, g, dtype=torch.float32, contiguous=True)
    m = LocalPageMapper(c)
    try:
        starts = [va for va, _ in c.ranges]
        assert starts == [starts[0] + i * g.range_bytes for i in range(LAYERS * BUFFERS)]
        flat = c.flat(torch.uint8)
        assert flat.data_ptr() == starts[0] and flat.numel() == LAYERS * BUFFERS * g.range_bytes
        m.map([1])
        block = g.blocks_of(1)[2]
        fill_block(c, 1, 0, block, 3.0)
        start = (1 * BUFFERS + 0) * g.range_bytes + block * g.block_bytes
        got = flat[start : start + g.block_bytes].cpu().view(torch.float32)
        assert torch.equal(got, torch.full_like(got, 3.0))
        floats = c.flat(torch.float32).cpu()
        assert int(floats.count_nonzero()) == g.block_bytes // 4  # nowhere else
    finally:
        m.close()
        c.close()
    assert vmm.live_handles == set() and vmm.mapped_ranges() == []
    apart = VirtualKVCache(vmm, g)
    try:
        with pytest.raises(GeometryError, match="contiguous"):
            apart.flat()
    finally:
        apart.close()


def test_view_shape_must_cover_a_block(cache: VirtualKVCache) -> None:
    with pytest.raises(Exception, match="block_bytes"):
        cache.view(0, 0, dtype=torch.float32, block_shape=(3,))
    with pytest.raises(IndexError):
        cache.view(LAYERS, 0)


def test_data_pointers_never_change(mapper: LocalPageMapper) -> None:
    cache = mapper.cache
    views = {(ly, k): cache.view(ly, k) for ly in range(LAYERS) for k in range(BUFFERS)}
    ptrs = {key: v.data_ptr() for key, v in views.items()}
    for _ in range(3):
        mapper.map([0, 2])
        fill_block(cache, 1, 1, 0, 3.0)
        assert block_sum(cache, 1, 1, 0) > 0
        mapper.prepare_unmap([0, 2])
        assert block_sum(cache, 1, 1, 0) == 0.0  # the zero page again
        mapper.commit_unmap([0, 2])
    for key, v in views.items():
        assert v.data_ptr() == ptrs[key] == cache.view(*key).data_ptr()
        assert cache.view(*key).data_ptr() == ptrs[key]


# -- transitions -----------------------------------------------------------------------------


def test_two_phase_unmap_abort_restores_the_data(
    mapper: LocalPageMapper, vmm: FaultInjector
) -> None:
    cache = mapper.cache
    block = cache.geometry.blocks_of(1)[0]
    mapper.map([1])
    fill_block(cache, 0, 1, block, 7.0)
    mapper.prepare_unmap([1])
    assert mapper.state(1) is MappingState.PREPARED
    assert block_sum(cache, 0, 1, block) == 0.0
    mapper.abort_unmap([1])
    assert block_sum(cache, 0, 1, block) == 7.0 * cache.geometry.block_bytes / 4
    mapper.prepare_unmap([1])
    mapper.commit_unmap([1])
    mapper.commit_unmap([1])  # idempotent
    assert mapper.state(1) is MappingState.UNMAPPED
    assert_consistent(vmm, mapper)


def test_illegal_transitions_raise_and_change_nothing(mapper: LocalPageMapper) -> None:
    mapper.map([0])
    for call, ids in [
        (mapper.map, [0]),
        (mapper.map, [1, 1]),
        (mapper.map, [mapper.num_pages]),
        (mapper.prepare_unmap, [1]),
        (mapper.abort_unmap, [0]),
        (mapper.commit_unmap, [0]),
    ]:
        with pytest.raises(InvalidTransition):
            call(ids)
    assert [mapper.state(p) for p in range(3)] == [
        MappingState.MAPPED,
        MappingState.UNMAPPED,
        MappingState.UNMAPPED,
    ]


def test_handles_are_pooled_not_recreated(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    mapper.map([0, 1])
    mapper.prepare_unmap([0, 1])
    mapper.commit_unmap([0, 1])
    vmm.reset_counts()
    for _ in range(3):
        mapper.map([2, 3])
        mapper.prepare_unmap([2, 3])
        mapper.commit_unmap([2, 3])
    assert vmm.calls("create") == 0 and vmm.calls("release") == 0
    assert_consistent(vmm, mapper)
    assert mapper.pooled_pages == 2 and mapper.held_bytes == 2 * mapper.page_bytes
    mapper.trim_pool(keep_pages=1)
    assert mapper.pooled_pages == 1 and mapper.held_bytes == mapper.page_bytes
    mapper.trim_pool()
    assert mapper.stats()["pooled_handles"] == 0
    assert len(vmm.live_handles) == 1  # the zero page


def test_pool_is_bounded(cache: VirtualKVCache, vmm: FaultInjector) -> None:
    m = LocalPageMapper(cache, pool_pages=1)
    try:
        m.map([0, 1, 2])
        m.prepare_unmap([0, 1, 2])
        m.commit_unmap([0, 1, 2])
        assert m.stats()["pooled_handles"] == cache.geometry.handles_per_page
        assert_consistent(vmm, m)
    finally:
        m.close()


@pytest.mark.parametrize(("page_mib", "pool_pages"), [(1, 4), (32, 2), (128, 0)])
def test_the_default_pool_keeps_four_page_ids_and_never_more_than_256_mib(
    page_mib: int, pool_pages: int
) -> None:
    # per-layer, 2 layers x 2 buffers: a page id is 4 handles of page_mib
    backend = HostBackend(device_bytes=256 << 20, granularity=1 << 20)
    geo = KVGeometry(
        num_layers=LAYERS, kv_buffers=BUFFERS, block_bytes=page_mib << 20, num_blocks=2,
        page_bytes=page_mib << 20, granularity=1 << 20, layout="per-layer",
    )  # fmt: skip
    cache = VirtualKVCache(backend, geo)
    m = LocalPageMapper(cache)
    try:
        assert m.pool_max == pool_pages * geo.handles_per_page
    finally:
        m.close()
        cache.close()
        backend.close()


def test_close_releases_everything(cache: VirtualKVCache, vmm: FaultInjector) -> None:
    m = LocalPageMapper(cache)
    m.map([0, 1, 3])
    m.prepare_unmap([1])
    m.close()
    with pytest.raises(PoolFailed):
        m.map([2])
    assert len(vmm.live_handles) == 1  # the zero page, until the cache closes
    assert block_sum(cache, 0, 0, 0) == 0.0  # views stay valid: the zero page
    cache.close()
    assert vmm.live_handles == set()
    assert vmm.mapped_ranges() == []


def test_transitions_from_another_thread(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    """The refill thread maps and unmaps; the backend must work from any thread (CUDA: the
    primary context is made current there)."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            mapper.map([1, 2])
            mapper.prepare_unmap([2])
            mapper.commit_unmap([2])
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert errors == []
    fill_block(mapper.cache, 0, 0, mapper.geometry.blocks_of(1)[0], 2.0)
    assert [mapper.state(p) for p in (1, 2)] == [MappingState.MAPPED, MappingState.UNMAPPED]
    assert_consistent(vmm, mapper)


# -- failure paths ---------------------------------------------------------------------------


def test_create_out_of_memory_is_a_clean_miss(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    vmm.fail("create", nth=2)
    with pytest.raises(OutOfDeviceMemory):
        mapper.map([0, 1])
    assert mapper.state(0) is MappingState.UNMAPPED and mapper.state(1) is MappingState.UNMAPPED
    assert_consistent(vmm, mapper)
    mapper.map([0, 1])  # nothing was lost
    assert_consistent(vmm, mapper)


def test_device_exhaustion_then_recovery(layout: Layout) -> None:
    gran = 2 << 20
    geo = geometry(gran, layout)
    # room for the zero page and two and a half pages
    vmm = FaultInjector(make_backend("host", device_bytes=gran + 5 * geo.page_device_bytes // 2))
    cache = VirtualKVCache(vmm, geo, dtype=torch.float32)
    mapper = LocalPageMapper(cache, pool_pages=0)
    try:
        mapped = []
        with pytest.raises(OutOfDeviceMemory):
            for p in range(mapper.num_pages):
                mapper.map([p])
                mapped.append(p)
        assert_consistent(vmm, mapper)
        assert mapped == [0, 1]
        assert vmm.mem_info().free < mapper.page_bytes
        mapper.prepare_unmap(mapped[:1])
        mapper.commit_unmap(mapped[:1])
        mapper.map(mapped[:1])
        assert_consistent(vmm, mapper)
    finally:
        mapper.close()
        cache.close()
        assert vmm.live_handles == set()
        vmm.close()


def test_map_failing_mid_batch_rolls_back(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    vmm.fail("map", nth=2)  # the second handle of the call
    with pytest.raises(InjectedFault):
        mapper.map([0, 1])
    assert mapper.state(0) is MappingState.UNMAPPED and mapper.state(1) is MappingState.UNMAPPED
    assert_consistent(vmm, mapper)
    assert block_sum(mapper.cache, LAYERS - 1, BUFFERS - 1, 0) == 0.0
    mapper.map([0, 1])
    assert_consistent(vmm, mapper)


@pytest.mark.parametrize("which", ["first", "last"])
@pytest.mark.parametrize("ids", [[2, 3], [1, 3]], ids=["run", "apart"])
def test_set_access_failing_rolls_back(
    mapper: LocalPageMapper, vmm: FaultInjector, which: str, ids: list[int]
) -> None:
    """The first or the last access grant of the map fails: consecutive pages get one per
    slot index for the run, pages apart one per slot."""
    slots = len(mapper.cache.ranges)
    vmm.fail("set_access", nth=1 if which == "first" else slots * (1 if ids == [2, 3] else 2))
    with pytest.raises(InjectedFault):
        mapper.map(ids)
    assert all(mapper.state(p) is MappingState.UNMAPPED for p in ids)
    assert_consistent(vmm, mapper)
    mapper.map(ids)
    assert_consistent(vmm, mapper)


def test_unmap_failing_in_map_and_in_prepare(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    cache = mapper.cache
    vmm.fail("unmap", nth=1)  # taking the zero page off the first slot
    with pytest.raises(InjectedFault):
        mapper.map([0])
    assert mapper.state(0) is MappingState.UNMAPPED
    assert_consistent(vmm, mapper)
    mapper.map([0, 1])
    fill_block(cache, 1, 0, 1, 5.0)
    vmm.fail("unmap", nth=2)  # the second handle of the prepare
    with pytest.raises(InjectedFault):
        mapper.prepare_unmap([0, 1])
    assert mapper.state(0) is MappingState.MAPPED and mapper.state(1) is MappingState.MAPPED
    assert block_sum(cache, 1, 0, 1) == 5.0 * cache.geometry.block_bytes / 4  # data intact
    assert_consistent(vmm, mapper)


def test_release_failing_leaks_nothing(cache: VirtualKVCache, vmm: FaultInjector) -> None:
    m = LocalPageMapper(cache, pool_pages=0)
    m.map([0])
    m.prepare_unmap([0])
    vmm.fail("release")
    with pytest.raises(InjectedFault):
        m.commit_unmap([0])
    assert m.state(0) is MappingState.UNMAPPED
    assert m.stats()["pending_release"] == 1  # the handle waits for another release
    assert_consistent(vmm, m)
    m.commit_unmap([0])  # a retry is a no-op for the page and releases the handle
    assert m.stats()["pending_release"] == 0
    assert_consistent(vmm, m)
    m.map([0])
    m.prepare_unmap([0])
    vmm.fail("release")
    with pytest.raises(InjectedFault):
        m.commit_unmap([0])
    assert m.held_bytes == cache.geometry.page_bytes  # one unreleased handle: still held
    m.trim_pool()  # retries it too
    assert m.stats()["pending_release"] == 0 and m.held_bytes == 0
    assert_consistent(vmm, m)
    m.map([0])
    m.prepare_unmap([0])
    vmm.fail("release")
    with pytest.raises(InjectedFault):
        m.commit_unmap([0])
    m.close()
    cache.close()
    assert vmm.live_handles == set()


def test_failed_rollback_quarantines_the_page(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    ids = [0] if mapper.geometry.layout == "per-layer" else [0, 2]  # apart: page by page
    # the 2nd handle map fails; the rollback's unmap of the 1st handle fails too
    vmm.fail("map", nth=2)
    vmm.fail("unmap", nth=3)
    with pytest.raises(PageQuarantined) as err:
        mapper.map(ids)
    assert err.value.page_ids == (0,)
    assert isinstance(err.value.__cause__, InjectedFault)
    assert mapper.state(0) is MappingState.QUARANTINED
    assert all(mapper.state(p) is MappingState.UNMAPPED for p in ids[1:])
    with pytest.raises(InvalidTransition, match="quarantined"):
        mapper.map([0])
    mapper.map([2])  # the mapper carries on without the page
    assert mapper.stats()["quarantined"] == 1
    assert_consistent(vmm, mapper)


def test_a_driver_lying_about_a_failure_is_caught(
    mapper: LocalPageMapper, vmm: FaultInjector
) -> None:
    """The 2nd handle map is done by the driver but reported failed: the rollback then
    finds the slot occupied, so the page is quarantined rather than trusted."""
    per_layer = mapper.geometry.layout == "per-layer"
    ids, liar = ([0], 0) if per_layer else ([0, 1], 1)
    vmm.fail("map", nth=2, after=True)
    with pytest.raises(PageQuarantined) as err:
        mapper.map(ids)
    assert err.value.page_ids == (liar,)
    assert mapper.state(liar) is MappingState.QUARANTINED
    assert all(mapper.state(p) is MappingState.UNMAPPED for p in ids if p != liar)
    assert_consistent(vmm, mapper)
    mapper.close()
    assert len(vmm.live_handles) == 1  # even the quarantined page's handles are released


def test_consecutive_pages_are_mapped_with_one_unmap_and_one_grant_per_slot_index(
    mapper: LocalPageMapper, vmm: FaultInjector
) -> None:
    """A run of consecutive pages: per slot index one unmap of the zero page over the run,
    one map per handle and one access grant over the run; pages apart, one of each per
    handle. Both leave the same mappings and data."""
    slots = len(mapper.cache.ranges)
    vmm.reset_counts()
    mapper.map([0, 1, 2])
    assert (vmm.calls("unmap"), vmm.calls("map"), vmm.calls("set_access")) == (
        slots,
        3 * slots,
        slots,
    )
    assert_consistent(vmm, mapper)
    fill_block(mapper.cache, LAYERS - 1, BUFFERS - 1, mapper.geometry.blocks_of(2)[0], 3.0)
    vmm.reset_counts()
    mapper.map([3])
    assert (vmm.calls("unmap"), vmm.calls("map"), vmm.calls("set_access")) == (slots, slots, slots)
    assert_consistent(vmm, mapper)
    block = mapper.geometry.blocks_of(2)[0]
    assert block_sum(mapper.cache, LAYERS - 1, BUFFERS - 1, block) == (
        3.0 * mapper.geometry.block_bytes / 4
    )


@pytest.mark.parametrize("kind", ["unmap", "map", "set_access"])
def test_a_failing_run_call_whose_cleanup_fails_too_still_rolls_back(
    mapper: LocalPageMapper, vmm: FaultInjector, kind: str
) -> None:
    """In a run of three pages, a call fails on the last slot index and so does the unmap
    that would take the handles mapped there off again: the slots it leaves are suspect,
    and the rollback clears them piecewise and puts the zero page back, so every page is
    unmapped (none quarantined) and maps again."""
    slots = len(mapper.cache.ranges)
    ids = [0, 1, 2]
    if kind == "unmap":  # the zero page's unmap over the run, on the last slot index
        vmm.fail("unmap", nth=slots)
    else:
        vmm.fail(kind, nth=3 * slots - 1 if kind == "map" else slots)
        vmm.fail("unmap", nth=slots + 1)  # the cleanup of the handles mapped before it
    with pytest.raises(InjectedFault):
        mapper.map(ids)
    assert all(mapper.state(p) is MappingState.UNMAPPED for p in ids)
    assert mapper.stats()["quarantined"] == 0
    assert_consistent(vmm, mapper)
    mapper.map(ids)
    assert_consistent(vmm, mapper)


def test_abort_failing_keeps_the_page_prepared(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    mapper.map([3])
    mapper.prepare_unmap([3])
    vmm.fail("map", nth=1)
    with pytest.raises(InjectedFault):
        mapper.abort_unmap([3])
    assert mapper.state(3) is MappingState.PREPARED
    assert_consistent(vmm, mapper)
    mapper.abort_unmap([3])
    assert mapper.state(3) is MappingState.MAPPED


def test_unknown_error_fails_the_mapper(mapper: LocalPageMapper, vmm: FaultInjector) -> None:
    vmm.fail("map", exc=RuntimeError("driver confused"))
    with pytest.raises(PoolFailed) as err:
        mapper.map([0])
    assert isinstance(err.value.__cause__, RuntimeError)
    assert mapper.failed
    for call in (mapper.map, mapper.prepare_unmap, mapper.commit_unmap, mapper.abort_unmap):
        with pytest.raises(PoolFailed):
            call([1])
    mapper.close()  # still releases what it holds
    assert len(vmm.live_handles) == 1  # the zero page


def test_failed_cache_init_leaves_nothing(vmm: FaultInjector, layout: Layout) -> None:
    before = vmm.mem_info().free
    vmm.fail("map", nth=3)
    with pytest.raises(InjectedFault):
        VirtualKVCache(vmm, geometry(vmm, layout))
    assert vmm.live_handles == set()
    assert vmm.mapped_ranges() == []
    if vmm.name == "host":
        assert vmm.mem_info().free == before


# -- the zero page ---------------------------------------------------------------------------


def test_sanity_mode_reports_a_write_into_the_zero_page(vmm: FaultInjector, layout: Layout) -> None:
    cache = VirtualKVCache(vmm, geometry(vmm, layout), dtype=torch.float32, sanity=True)
    mapper = LocalPageMapper(cache)
    try:
        g = cache.geometry
        mapper.map([0])
        stray = g.blocks_of(2)[1]
        fill_block(cache, 1, 1, stray, 1.0)  # block on an unbacked page: a bug
        with pytest.raises(ZeroPageWritten) as err:
            mapper.map([1])
        assert (1, 1, stray) in err.value.candidates
        assert mapper.state(1) is MappingState.UNMAPPED  # refused before doing anything
        assert str(stray) in str(err.value)
        cache.check_zero_page()  # the report cleaned the zero page
        mapper.map([1])
    finally:
        mapper.close()
        cache.close()


def four_granule_pages(vmm: FaultInjector, layout: Layout) -> KVGeometry:
    """``geometry()``'s blocks on 4 pages of 4 granules each."""
    small = geometry(vmm, layout)
    page = 4 * small.page_bytes
    per_page = page // small.page_block_bytes
    return geometry(vmm, layout, page_bytes=page, num_blocks=4 * per_page)


def test_default_zero_page_is_the_largest_divisor_of_the_page_up_to_the_cap() -> None:
    mib = 1 << 20
    assert 128 * mib == ZERO_PAGE_MAX_BYTES
    assert default_zero_page_bytes(2 * mib, 2 * mib) == 2 * mib
    assert default_zero_page_bytes(32 * mib, 2 * mib) == 32 * mib
    assert default_zero_page_bytes(128 * mib, 2 * mib) == 128 * mib
    assert default_zero_page_bytes(1024 * mib, 2 * mib) == 128 * mib
    assert default_zero_page_bytes(192 * mib, 2 * mib) == 96 * mib  # 48 of 96 granules
    assert default_zero_page_bytes(134 * mib, 2 * mib) == 2 * mib  # 67 granules: a prime


@pytest.mark.parametrize("zero_granules", [None, 2, 1])
def test_zero_page_spans_the_slot_and_survives_map_cycles(
    vmm: FaultInjector, layout: Layout, zero_granules: int | None
) -> None:
    """A page of 4 granules: by default one zero mapping per slot (one map + one access
    call per slot transition instead of four); a smaller ``zero_page_bytes`` tiles it."""
    gran = vmm.granularity()
    geo = four_granule_pages(vmm, layout)
    zb = None if zero_granules is None else zero_granules * gran
    cache = VirtualKVCache(vmm, geo, dtype=torch.float32, zero_page_bytes=zb)
    mapper = LocalPageMapper(cache)
    try:
        assert cache.zero_page_bytes == (zb or 4 * gran)
        assert mapper.fixed_bytes == cache.zero_page_bytes  # charged by the page allocator
        per_slot = geo.page_bytes // cache.zero_page_bytes
        vmm.reset_counts()
        mapper.map([1])
        mapper.prepare_unmap([1])
        assert vmm.calls("map") == geo.handles_per_page * (1 + per_slot)  # own + zero tiles
        assert vmm.calls("set_access") == 2 * geo.handles_per_page
        mapper.commit_unmap([1])
        assert_consistent(vmm, mapper)
        mapper.map([2])  # the handles pooled by page 1's commit
        fill_block(cache, 1, 0, geo.blocks_of(2)[0], 3.0)
        assert block_sum(cache, 1, 0, geo.blocks_of(2)[0]) > 0.0
        assert block_sum(cache, 1, 0, geo.blocks_of(3)[0]) == 0.0  # unbacked: zeros
        assert_consistent(vmm, mapper)
    finally:
        mapper.close()
        cache.close()
    assert vmm.live_handles == set()


@pytest.mark.parametrize("bad", [3, 5, 0])
def test_zero_page_size_must_tile_the_page(vmm: FaultInjector, bad: int) -> None:
    gran = vmm.granularity()
    geo = four_granule_pages(vmm, "compound")
    with pytest.raises(GeometryError, match="zero_page_bytes"):
        VirtualKVCache(vmm, geo, zero_page_bytes=bad * gran)
    assert vmm.live_handles == set()


def test_sanity_mode_names_the_block_through_a_slot_sized_zero_page(vmm: FaultInjector) -> None:
    gran = vmm.granularity()
    geo = four_granule_pages(vmm, "per-layer")
    small = VirtualKVCache(vmm, geo, sanity=True)
    assert small.zero_page_bytes == gran  # sanity's default: cheap to scan
    small.close()
    cache = VirtualKVCache(vmm, geo, dtype=torch.float32, sanity=True, zero_page_bytes=4 * gran)
    mapper = LocalPageMapper(cache)
    try:
        assert cache.zero_page_bytes == 4 * gran
        stray = geo.blocks_of(1)[-1]  # the last block of the page: the zero page's far end
        fill_block(cache, 0, 1, stray, 1.0)
        with pytest.raises(ZeroPageWritten) as err:
            mapper.map([0])
        assert (0, 1, stray) in err.value.candidates
    finally:
        mapper.close()
        cache.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_write_to_an_unbacked_block_faults(layout: str) -> None:
    """The zero page is read-only: on ``host`` a stray write is a SIGSEGV (run in a child
    process so the test run survives it)."""
    code = textwrap.dedent(
        f"""
        import torch
        from kvcore.memory.geometry import KVGeometry
        from kvcore.memory.virtual_cache import VirtualKVCache
        from kvcore.vmm import open_backend
        b = open_backend("host", device_bytes=64 << 20)
        g = b.granularity()
        geo = KVGeometry(2, 2, g // 8, 16, g, g, layout={layout!r})
        c = VirtualKVCache(b, geo)
        assert int(c.view(1, 1)[3].sum()) == 0
        print("read ok", flush=True)
        c.view(1, 1)[3].fill_(1)
        print("write did not fault", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "read ok" in proc.stdout, proc.stderr
    assert "write did not fault" not in proc.stdout
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


def test_an_unmap_that_took_effect_but_reported_failure_is_not_trusted(
    mapper: LocalPageMapper, vmm: FaultInjector
) -> None:
    """The driver unmapped the slot and then reported an error: the mapper must not record
    the page as still mapped with nothing under it (the next write would fault). The
    rollback rebuilds the slot from its kept handle, data intact, or quarantines it."""
    cache = mapper.cache
    block = cache.geometry.blocks_of(1)[0]
    mapper.map([1])
    fill_block(cache, 0, 0, block, 2.0)
    vmm.fail("unmap", after=True)  # the next unmap happens, then raises anyway
    with pytest.raises((InjectedFault, PageQuarantined)):
        mapper.prepare_unmap([1])
    assert_consistent(vmm, mapper)  # every slot is what the page's state says
    assert mapper.state(1) in (MappingState.MAPPED, MappingState.QUARANTINED)
    if mapper.state(1) is MappingState.MAPPED:
        assert block_sum(cache, 0, 0, block) == 2.0 * cache.view(0, 0)[block].numel()
        fill_block(cache, 0, 0, block, 3.0)  # writable: no fault
