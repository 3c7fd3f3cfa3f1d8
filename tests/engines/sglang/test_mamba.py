"""Elastic Mamba state (``MambaPool`` + ``MambaSlotAllocator``) against the real SGLang
classes.

``kv_mode`` tests check SGLang's slot contract both ways (its own pool and allocator vs
kvcore's); the others check what kvcore adds (pages per slot, partial tail, one gate with
the KV pools, refusals). The series' Mamba seam (``memory_pool.MAMBA_STATE_HOOK``, written up
for the series owner) is not in the forked wheel yet, so ``seamed_pool`` does what its hunks
do, no more: the pool's state tensors come from ``ElasticScope.mamba_buffers`` instead of
``torch.zeros``, and the slot allocator from ``ElasticScope.mamba_allocator``. Everything else
is SGLang's own code (``clear_slots``, ``copy_from``, ``get_cpu_copy``, group allocation).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache import memory_pool
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

from kvcore.errors import InvalidTransition, UnsupportedConfiguration

from .harness import HOST, requires_cpu_paged_kernels, requires_fork

LAYERS = [1, 3, 5]
SIZE = 40  # slots 1..40; slot 0 is SGLang's dummy
# per slot and layer: conv (conv_dim 32 + 2 x 32 = 96, kernel 4 -> 3) bf16 = 576 B; SSM 2 x 16
# x 32 f32 = 4 KiB. 64 KiB host pages: conv rows tile lcm(576, 64K) = 576 KiB exactly (1024
# slots: one page per layer holds all 41); SSM 16 slots per page: slots 0-15, 16-31 and 32-40
# (+ 7 tail rows) in every layer
SSM_PER_PAGE = 16


def cache_params() -> Mamba2CacheParams:
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=32,
        n_groups=1,
        num_heads=2,
        head_dim=16,
        state_size=32,
        conv_kernel=4,
    )
    return Mamba2CacheParams(
        shape=shape,
        layers=LAYERS,
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )


def upstream_pool() -> Any:
    return memory_pool.MambaPool(
        size=SIZE,
        spec_state_size=4,
        cache_params=cache_params(),
        mamba_layer_ids=LAYERS,
        device="cpu",
    )


def seamed_pool(scope: Any) -> tuple[Any, Any]:
    """A ``MambaPool`` and slot allocator as the patched SGLang builds them in the scope."""
    pool = upstream_pool()
    params = cache_params()
    with scope:
        conv, temporal = scope.mamba_buffers(
            pool,
            layers=len(LAYERS),
            conv_shapes=params.shape.conv,
            conv_dtype=params.dtype.conv,
            temporal_shape=params.shape.temporal,
            temporal_dtype=params.dtype.temporal,
            slots=SIZE + 1,
        )
        pool.mamba_cache = pool.State(conv=conv, temporal=temporal)  # hunk 2's assignment
        alloc = scope.mamba_allocator(pool, MambaSlotAllocator(size=SIZE, device="cpu"))
    return pool, alloc


def hybrid_stack(scope: Any, size: int = 256) -> tuple[Any, Any, Any, Any]:
    """A hybrid Mamba model's two pools in ``scope``, as the patched SGLang builds them: the
    Mamba state and its slot allocator, then ``HybridLinearKVPool`` (its full-attention
    sub-pool kvcore's) of ``size`` tokens with SGLang's paged allocator. Returns
    ``(mamba pool, slot allocator, KV pool, KV allocator)``."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    pool, slots = seamed_pool(scope)
    with scope:
        kv = memory_pool.HybridLinearKVPool(
            size=size,
            dtype=torch.bfloat16,
            page_size=16,
            head_num=2,
            head_dim=64,
            full_attention_layer_ids=[0, 2, 4],
            device="cpu",
            mamba_pool=pool,
        )
        alloc = scope.allocator(
            PagedTokenToKVPoolAllocator(size, 16, torch.bfloat16, "cpu", kv, False)
        )
    return pool, slots, kv, alloc


@pytest.fixture
def scopes() -> Any:
    from kvcore.adapters.sglang import ElasticScope

    built: list[Any] = []

    def make(agreement: Any = None, **kvcore: Any) -> Any:
        s = ElasticScope({**HOST, **kvcore}, agreement=agreement)
        built.append(s)
        return s

    yield make
    for s in built:
        s.close()


def stack(mode: str, scopes: Any) -> tuple[Any, Any]:
    """SGLang's own pool and slot allocator (``off``) or the elastic ones (``on``)."""
    if mode == "off":
        return upstream_pool(), MambaSlotAllocator(size=SIZE, device="cpu")
    return seamed_pool(scopes())


# -- the contract, elastic off and on ---------------------------------------------------------


def test_slots_are_unique_never_zero_and_none_when_short(kv_mode: str, scopes: Any) -> None:
    _, alloc = stack(kv_mode, scopes)
    got = alloc.alloc(SIZE)
    assert got is not None and sorted(got.tolist()) == list(range(1, SIZE + 1))
    assert alloc.available_size() == 0 and alloc.alloc(1) is None
    alloc.free(got[:5])
    again = alloc.alloc(5)
    assert again is not None and sorted(again.tolist()) == sorted(got[:5].tolist())
    alloc.free(torch.cat([again, got[5:]]))
    assert alloc.available_size() == SIZE


def test_slot_ops_copy_clear_and_cpu_copy(kv_mode: str, scopes: Any) -> None:
    pool, alloc = stack(kv_mode, scopes)
    a, b = alloc.alloc(1), alloc.alloc(1)
    assert a is not None and b is not None
    cache = pool.mamba_cache
    cache.temporal[:, a] = torch.randn(len(LAYERS), 1, 2, 16, 32)
    cache.conv[0][:, a] = torch.randn(len(LAYERS), 1, *cache.conv[0].shape[2:]).bfloat16()
    pool.copy_from(a, b)  # SGLang's copy-on-write of a cached state
    assert torch.equal(cache.temporal[:, b], cache.temporal[:, a])
    assert torch.equal(cache.conv[0][:, b], cache.conv[0][:, a])
    conv_cpu, temporal_cpu = pool.get_cpu_copy(b)
    assert torch.equal(temporal_cpu, cache.temporal[:, a])
    assert torch.equal(conv_cpu[0], cache.conv[0][:, a])
    pool.clear_slots(a)
    assert not cache.temporal[:, a].any() and cache.temporal[:, b].any()


def test_group_alloc_returns_unused_slots(kv_mode: str, scopes: Any) -> None:
    _, alloc = stack(kv_mode, scopes)
    alloc.alloc_group_begin(4)
    first = alloc.alloc(1)
    alloc.alloc_group_end()
    assert first is not None and alloc.available_size() == SIZE - 1
    assert set(alloc.free_slots.tolist()) == set(range(1, SIZE + 1)) - set(first.tolist())


# -- what kvcore adds ---------------------------------------------------------------------------


@requires_fork
def test_state_tensors_have_sglang_shapes_and_alias_kvcore(scopes: Any) -> None:
    ref = upstream_pool()
    pool, _ = seamed_pool(scopes())
    state = pool.kvcore_mamba
    ours, theirs = pool.mamba_cache, ref.mamba_cache
    assert ours.temporal.shape == theirs.temporal.shape == (len(LAYERS), SIZE + 1, 2, 16, 32)
    assert [c.shape for c in ours.conv] == [c.shape for c in theirs.conv]
    for t in (*ours.conv, ours.temporal):
        assert t[0].is_contiguous()  # a layer's slots: SGLang's per-layer layout
    assert state.tensors[-1].data_ptr() == ours.temporal.data_ptr()


@requires_fork
def test_slots_map_pages_on_alloc_and_unmap_on_free(scopes: Any) -> None:
    pool, alloc = seamed_pool(scopes())
    state = pool.kvcore_mamba
    assert state.mapped_pages() == [len(LAYERS), len(LAYERS)]  # slot 0's pages
    slots = alloc.alloc(20)
    assert slots is not None and slots.tolist() == list(range(1, 21))  # lowest first
    assert state.mapped_pages() == [len(LAYERS), 2 * len(LAYERS)]  # SSM pages 0 and 1
    alloc.free(slots[15:])  # slots 16..20: SSM page 1 empties
    assert state.mapped_pages() == [len(LAYERS), len(LAYERS)]
    assert alloc.available_size() == SIZE - 15
    with pytest.raises(InvalidTransition):
        alloc.free(slots[15:16])  # a double free names the slot, nothing changes
    alloc.free(slots[:15])
    assert alloc.available_size() == SIZE


@requires_fork
def test_partial_tail_slots_are_usable_and_never_beyond(scopes: Any) -> None:
    pool, alloc = seamed_pool(scopes())
    slots = alloc.alloc(SIZE)
    assert slots is not None and slots.max().item() == SIZE
    assert alloc.alloc(1) is None  # the 7 tail rows of the last SSM page are not slots
    temporal = pool.mamba_cache.temporal
    temporal[:, SIZE] = 7.0  # the last slot: on the last (partial) page of every layer
    assert bool((temporal[:, SIZE] == 7.0).all())
    alloc.free(slots)


@requires_fork
def test_state_and_kv_pages_charge_one_gate_and_a_tight_budget_yields_none(scopes: Any) -> None:
    probe = scopes(reserve_min=0, reserve_max=0)
    seamed_pool(probe)
    start = probe.gate.gate.held  # slot 0's pages and the caches' zero pages
    ssm_page = len(LAYERS) * (64 << 10)  # one per-layer SSM page in every layer
    scope = scopes(limit_bytes=start + ssm_page, reserve_min=0, reserve_max=0)
    with scope:  # a KV pool in the same scope draws on the same gate
        kv = memory_pool.MHATokenToKVPool(
            size=64,
            page_size=16,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=8,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
    _, alloc = seamed_pool(scope)
    assert kv.kvcore_manager.gate is not None and scope.gate.gate.held > start
    assert alloc.schedulable_available_size() == SSM_PER_PAGE - 1  # admission sees it
    assert alloc.available_size() == SIZE  # the leak check conserves logical slots
    got = alloc.alloc(SSM_PER_PAGE - 1)  # fits slot 0's pages
    assert got is not None
    # a second SSM page would fit the budget but for the KV pool's pages on the same gate
    assert alloc.alloc(1) is None
    assert alloc.available_size() == SIZE - (SSM_PER_PAGE - 1)  # nothing was taken
    assert alloc.schedulable_available_size() == 0
    alloc.free(got)


@requires_fork
def test_unsupported_mamba_configurations_are_named(scopes: Any) -> None:
    scope = scopes()
    plain = upstream_pool()  # built without the seam: kvcore did not make its state
    with pytest.raises(UnsupportedConfiguration, match="MambaPool"):
        scope.mamba_allocator(plain, MambaSlotAllocator(size=SIZE, device="cpu"))

    class Other(MambaSlotAllocator):
        pass

    pool, _ = seamed_pool(scope)
    with pytest.raises(UnsupportedConfiguration, match="Other"):
        scope.mamba_allocator(pool, Other(size=SIZE, device="cpu"))


@requires_fork
@pytest.mark.skipif(
    not hasattr(memory_pool, "MAMBA_STATE_HOOK"), reason="the series has no Mamba seam yet"
)
def test_the_series_seam_builds_elastic_state(scopes: Any) -> None:
    scope = scopes()
    with scope:
        req = memory_pool.HybridReqToTokenPool(
            size=8,
            mamba_size=SIZE,
            mamba_spec_state_size=32,
            max_context_len=64,
            device="cpu",
            enable_memory_saver=False,
            cache_params=cache_params(),
            mamba_layer_ids=LAYERS,
            enable_mamba_extra_buffer=False,
        )
    assert req.mamba_pool.kvcore_mamba is not None
    slot = req.mamba_allocator.alloc(1)
    assert slot is not None and slot.tolist() == [1]


@requires_fork
@requires_cpu_paged_kernels
def test_hybrid_linear_kv_pool_and_mamba_state_are_elastic_together(scopes: Any) -> None:
    """A hybrid Mamba model's two pools in one scope: ``HybridLinearKVPool`` (its full-
    attention sub-pool is kvcore's) with SGLang's paged allocator, and the Mamba state."""
    scope = scopes()
    pool, slots, kv, alloc = hybrid_stack(scope)
    manager = kv.full_kv_pool.kvcore_manager
    assert alloc.kvcore is manager
    t = torch.tensor
    out = alloc.alloc_extend(t([0]), t([0]), t([40]), t([40]), t([-1]), 40)
    assert out is not None and out.numel() == 40
    slot = slots.alloc(1)
    assert slot is not None
    gate = scope.gate.gate
    manager.pages.flush()
    charged = manager.stats().charged_bytes + sum(
        p.pages.stats().charged_bytes for p in pool.kvcore_mamba._parts
    )
    assert gate.held == charged  # the KV pool and the Mamba state: one gate
    alloc.free(out)
    slots.free(slot)


@requires_fork
def test_a_state_row_without_an_exact_page_is_refused_by_name(scopes: Any) -> None:
    scope = scopes()
    pool = upstream_pool()  # built outside the scope: the series' seam would back it
    with scope, pytest.raises(UnsupportedConfiguration, match=r"temporal \(7, 1001\)"):
        scope.mamba_buffers(
            pool,
            layers=2,
            conv_shapes=[(96, 3)],
            conv_dtype=torch.bfloat16,
            temporal_shape=(7, 1001),  # 28028 B: an exact 64 KiB-granular page is 438 MiB
            temporal_dtype=torch.float32,
            slots=SIZE + 1,
        )
    assert scope.mamba_states == []


# -- TP agreement (a scripted peer rank; two real ranks: test_tp_agreement.py) ----------------


@requires_fork
@requires_cpu_paged_kernels
def test_agreed_slot_allocation_rolls_back_and_refreshes_with_the_kv_room(scopes: Any) -> None:
    """Under an agreement every slot allocation is one decision: when the peer rank missed,
    the slots and the SSM pages they mapped here go back. The schedulable count is the
    agreed one plus the slots freed since (no collective); a group pre-allocation is one
    decision however many slots it hands out; and the scheduler's one ``kvcore_step``
    refreshes the slot room and the KV room in a single collective."""
    from tests.parallel.test_agreement import ScriptedPeer

    peer = ScriptedPeer()
    peer.script = [None, [10]]  # the slot room as this rank has it; 10 KV blocks at the peer
    scope = scopes(agreement=peer, limit_bytes=1 << 30, reserve_min=0, reserve_max=0)
    pool, slots, _, kv_alloc = hybrid_stack(scope)
    assert [len(c) for c in peer.calls] == [1, 1]  # slot room, then the KV ledger's room
    state = pool.kvcore_mamba
    got = slots.alloc(SSM_PER_PAGE - 1)  # fits slot 0's pages
    assert got is not None
    books = (state.mapped_pages(), slots.available_size(), state.free_slots())
    peer.script = [[0, 99], [2]]  # the peer missed; then 2 schedulable slots there
    assert slots.alloc(5) is None  # would map SSM page 1 here
    assert (state.mapped_pages(), slots.available_size(), state.free_slots()) == books
    assert slots.schedulable_available_size() == 2
    slots.free(got[:3])
    assert slots.schedulable_available_size() == 5
    calls = len(peer.calls)
    peer.script = [[1, 6]]  # the peer got the group too, with 6 schedulable slots left
    slots.alloc_group_begin(4)  # SGLang's pre-allocation for match_prefix
    drained = [slots.alloc(1) for _ in range(4)]
    slots.alloc_group_end()
    assert len(peer.calls) == calls + 1  # one decision for the group
    assert all(d is not None for d in drained)
    assert slots.schedulable_available_size() == 6
    peer.script = [[7, 12]]  # both rooms bind: refreshed together
    kv_alloc.kvcore_step()
    assert len(peer.calls) == calls + 2 and len(peer.calls[-1]) == 2
    assert slots.schedulable_available_size() == 7
    assert kv_alloc.available_size() == 12 * 16


@requires_fork
def test_a_failed_slot_collective_gives_the_slots_back(scopes: Any) -> None:
    from kvcore.errors import AgreementError
    from tests.parallel.test_agreement import ScriptedPeer

    peer = ScriptedPeer()
    pool, slots = seamed_pool(scopes(agreement=peer, limit_bytes=1 << 30))
    state = pool.kvcore_mamba
    books = (state.mapped_pages(), slots.available_size())
    peer.fail = True
    with pytest.raises(AgreementError):
        slots.alloc(SIZE)
    assert (state.mapped_pages(), slots.available_size()) == books


@requires_fork
@pytest.mark.parametrize("budget", [{"limit_bytes": 1 << 30}, {"gpu_ledger": True}])
def test_a_budget_at_pp_above_one_is_refused_for_mamba_state(
    scopes: Any, budget: dict[str, Any]
) -> None:
    """Pipeline stages schedule on their own (SGLang's ``event_loop_pp``) and are not agreed:
    the Mamba state's seam refuses a budget there by name, before anything is built."""
    from sglang.srt.runtime_context import get_parallel

    scope = scopes(**budget)
    with get_parallel().override(pp_size=2), pytest.raises(UnsupportedConfiguration, match="PP 2"):
        seamed_pool(scope)
    assert scope.mamba_states == []
