"""``kvcore.memory.slots.SlotStates`` (per-slot Mamba-style state backed on demand) and
``kvcore.budget.shared_gate.SharedGate``, on the host backend and (``gpu``) on CUDA.

The CUDA runs write and read the views with device kernels (torch indexing on the GPU): a
Mamba state's conv and SSM views, and two per-layer KV caches of different geometry (the
full and sliding-window sub-pools of SGLang's hybrid SWA pool, as its adapter builds them)
on one shared gate.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore.budget.gate import BudgetGate, UnlimitedGate
from kvcore.budget.shared_gate import SharedGate
from kvcore.errors import GeometryError, InvalidTransition, KvcoreError, PoolFailed
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator
from kvcore.memory.slots import SlotStates, StateTensor
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.vmm.faults import FaultInjector
from tests.vmm_backends import BACKEND_PARAMS, make_backend

LAYERS = 2
SLOTS = 41  # slot 0 reserved, 40 usable
# SSM row 4 x 32 x 32 f32 = 16 KiB: 4 slots per 64 KiB host page, 128 per 2 MiB CUDA page
SSM = StateTensor("temporal", (4, 32, 32), torch.float32)
CONV = StateTensor("conv0", (96, 3), torch.bfloat16)  # 576 B: one page per layer holds all
HOST: dict[str, Any] = {"device_bytes": 256 << 20, "granularity": 64 << 10}


def device_of(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def open_states(backend: str, gate: Any = None, **kw: Any) -> SlotStates:
    b = make_backend(backend, **HOST if backend == "host" else {})
    return SlotStates(
        b,
        gate if gate is not None else UnlimitedGate(),
        layers=LAYERS,
        states=[CONV, SSM],
        slots=kw.pop("slots", SLOTS),
        owns_backend=True,
        **kw,
    )


def ssm_per_page(s: SlotStates) -> int:
    return s._parts[1].per_page


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_views_have_the_engine_layout_and_read_back_writes(backend: str) -> None:
    s = open_states(backend)
    try:
        conv, ssm = s.tensors
        assert conv.shape == (LAYERS, SLOTS, 96, 3) and ssm.shape == (LAYERS, SLOTS, 4, 32, 32)
        assert conv[0].is_contiguous() and ssm[1].is_contiguous()
        dev = device_of(backend)
        assert ssm.device.type == dev
        got = s.take(3)
        assert got == [1, 2, 3]
        idx = torch.tensor(got, device=dev)
        vals = torch.randn(LAYERS, 3, 4, 32, 32, device=dev)
        ssm[:, idx] = vals  # a scatter kernel on the device
        conv_vals = torch.randn(LAYERS, 3, 96, 3, device=dev).to(torch.bfloat16)
        conv[:, idx] = conv_vals
        assert torch.equal(ssm[:, idx], vals)
        assert torch.equal(conv[:, idx], conv_vals)
        s.give(got)
        far = SLOTS - 1
        if far // ssm_per_page(s) != 0:  # on an SSM page never mapped: reads as zeros
            assert not ssm[:, far].any()
    finally:
        s.close()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_pages_follow_slots_and_the_partial_tail_is_never_handed_out(backend: str) -> None:
    s = open_states(backend)
    try:
        n = ssm_per_page(s)
        assert s.mapped_pages() == [LAYERS, LAYERS]  # slot 0's page in every layer
        if n >= SLOTS:  # one SSM page holds every slot (CUDA's 2 MiB pages)
            got = s.take(SLOTS - 1)
            assert got is not None and s.mapped_pages() == [LAYERS, LAYERS]
        else:
            got = s.take(n)  # slots 1..n: spills onto the second SSM page
            assert got is not None and s.mapped_pages() == [LAYERS, 2 * LAYERS]
            s.give(got[-1:])
            assert s.mapped_pages() == [LAYERS, LAYERS]
            rest = s.take(SLOTS - n)
            assert rest is not None and max(rest) == SLOTS - 1
            got = got[:-1] + rest
        assert s.take(1) is None  # rows past SLOTS on the last page are not slots
        s.tensors[1][:, SLOTS - 1] = 5.0  # the last slot, on the partial last page
        assert bool((s.tensors[1][:, SLOTS - 1] == 5.0).all())
        s.give(got)
        assert s.mapped_pages() == [LAYERS, LAYERS] and s.free_count() == SLOTS - 1
        with pytest.raises(InvalidTransition):
            s.give([0])  # the reserved slot
        with pytest.raises(InvalidTransition):
            s.give([1])  # already free
    finally:
        s.close()


def test_take_is_all_or_nothing_across_states() -> None:
    probe = open_states("host")
    fixed = probe.gate.held  # type: ignore[attr-defined]
    ssm_page = LAYERS * probe._parts[1].geometry.page_bytes
    probe.close()
    # room for the reserved pages only: a second SSM page is refused
    gate = BudgetGate(fixed + ssm_page - 1)
    s = open_states("host", gate)
    try:
        n = ssm_per_page(s)
        first = s.take(n - 1)  # fits slot 0's pages
        assert first is not None
        held = gate.held
        assert s.available() == 0  # every free slot needs a page the budget cannot pay
        assert s.take(2) is None  # slot n is on page 1: refused
        assert gate.held == held and s.free_count() == SLOTS - n
        s.give(first)
    finally:
        s.close()
    assert gate.held == 0


def test_a_row_that_tiles_no_page_exactly_is_refused_by_name() -> None:
    b = make_backend("host", granularity=64 << 10)
    odd = StateTensor("temporal", (7, 1001), torch.float32)  # 28028 B: lcm is ~27 GiB
    with pytest.raises(GeometryError, match="28028-byte"):
        SlotStates(b, UnlimitedGate(), layers=1, states=[odd], slots=8)
    b.close()


def test_shared_gate_sums_reserves_and_closes_with_the_last_share() -> None:
    opened: list[BudgetGate] = []

    class Closing(BudgetGate):
        closed = False

        def close(self) -> None:
            self.closed = True

    def make() -> BudgetGate:
        g = Closing(1 << 20)
        opened.append(g)
        return g

    shared = SharedGate()
    a, b = shared.join(make), shared.join(make)
    assert len(opened) == 1  # one gate for both
    assert a.try_acquire(600 << 10) and not b.try_acquire(600 << 10)
    assert a.headroom() == b.headroom() == (1 << 20) - (600 << 10)
    a.report_reserve(100)
    b.report_reserve(50)
    assert opened[0].reserve == 150
    a.release(600 << 10)
    a.close()
    assert opened[0].reserve == 50 and not opened[0].closed  # type: ignore[attr-defined]
    b.close()
    b.close()  # idempotent
    assert opened[0].closed  # type: ignore[attr-defined]
    assert shared.gate is None
    with pytest.raises(KvcoreError, match="after the shared gate closed"):
        a.try_acquire(1)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_two_per_layer_kv_caches_on_one_gate_write_and_read(backend: str) -> None:
    """SGLang's hybrid SWA pool in elastic mode: a full-attention and a sliding-window
    per-layer KV cache (different layer counts and sizes), one ``GateShare`` each."""
    b = make_backend(backend, **HOST if backend == "host" else {})
    gran = b.granularity()
    shared = SharedGate()
    limit = 64 * gran
    made: list[Any] = []
    try:
        views = []
        for layers, tokens in ((1, 16384), (3, 8192)):  # full side, SWA side
            block = 16 * 8 * 128 * 2  # 16 tokens x 8 heads x 128 x bf16 = 32 KiB
            geo = KVGeometry(
                num_layers=layers,
                kv_buffers=2,
                block_bytes=block,
                num_blocks=tokens // 16,
                page_bytes=max(gran, block),
                granularity=gran,
                layout="per-layer",
            )
            cache = VirtualKVCache(b, geo)
            mapper = LocalPageMapper(cache)
            pages = PageAllocator(mapper, shared.join(lambda: BudgetGate(limit)))
            made.append((pages, mapper, cache))
            assert pages.acquire_ids([0, 1])
            k = cache.view(layers - 1, 0, torch.bfloat16, block_shape=(16, 8, 128))
            views.append(k.reshape(-1, 8, 128))
        gate = shared.gate
        assert isinstance(gate, BudgetGate)
        assert gate.held == sum(p.stats().charged_bytes for p, _, _ in made) > 0
        dev = device_of(backend)
        rows_per_page = max(gran, 16 * 8 * 128 * 2) // (8 * 128 * 2)
        idx = torch.arange(3, 2 * rows_per_page, 7, device=dev)
        for i, v in enumerate(views):
            data = torch.full((idx.numel(), 8, 128), float(i + 1), device=dev).to(torch.bfloat16)
            v[idx] = data
            assert torch.equal(v[idx], data)
    finally:
        for objs in made:
            for obj in objs:
                obj.close()
        b.close()


def test_available_counts_the_slots_the_headroom_pays_for() -> None:
    probe = open_states("host")
    fixed = probe.gate.held  # type: ignore[attr-defined]
    ssm_page = LAYERS * probe._parts[1].geometry.page_bytes
    probe.close()
    s = open_states("host", BudgetGate(fixed + 2 * ssm_page))
    try:
        n = ssm_per_page(s)
        # slot 0's page holds n - 1 free slots; the headroom pays two more SSM pages
        assert s.available() == (n - 1) + 2 * n
        got = s.take(s.available())
        assert got is not None and s.available() == 0 and s.take(1) is None
        s.give(got)
    finally:
        s.close()
    unlimited = open_states("host")
    try:
        assert unlimited.available() == SLOTS - 1  # no headroom figure: the free count
    finally:
        unlimited.close()


def faulty_states(vmm: FaultInjector) -> SlotStates:
    # both states 16 KiB per slot and layer: 4 slots per 64 KiB page, so slot 4 needs a new
    # page in each state
    return SlotStates(
        vmm,
        UnlimitedGate(),
        layers=LAYERS,
        states=[StateTensor("conv0", (8192,), torch.bfloat16), SSM],
        slots=SLOTS,
    )


def test_a_miss_in_a_later_state_gives_back_the_earlier_states_pages() -> None:
    vmm = FaultInjector(make_backend("host", **HOST))
    s = faulty_states(vmm)
    try:
        first = s.take(3)  # slots 1..3: slot 0's pages
        assert first is not None and s.mapped_pages() == [LAYERS, LAYERS]
        vmm.fail("create", nth=LAYERS + 1)  # the SSM state's first new page: out of memory
        assert s.take(1) is None
        assert s.mapped_pages() == [LAYERS, LAYERS]  # conv's new pages were given back
        assert s.free_count() == SLOTS - 4
        slot = s.take(1)  # the device recovered: the same slot, pages in both states
        assert slot == [4] and s.mapped_pages() == [2 * LAYERS, 2 * LAYERS]
        s.give(first + slot)
    finally:
        s.close()
    assert not vmm.live_handles and not vmm.mapped_ranges()
    vmm.close()


def test_a_failed_start_leaves_nothing_mapped_or_reserved() -> None:
    vmm = FaultInjector(make_backend("host", **HOST))
    vmm.fail("create", nth=LAYERS + 1)  # slot 0's SSM pages cannot be created
    with pytest.raises(PoolFailed, match="reserved slots"):
        faulty_states(vmm)
    assert not vmm.live_handles and not vmm.mapped_ranges()
    vmm.close()
