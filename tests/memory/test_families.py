"""Model-family KV layouts (MLA, hybrid groups, Mamba cells) on the real memory stack.

Every view test writes through the family views, reads the raw bytes of the virtual range
back at the addresses the layout promises, and follows the page states as blocks (slots)
are allocated and freed through one ``BlockLedger``. They run on ``host`` and, marked
``gpu``, on ``cuda`` (torch ops on the device tensors: the GPU check of the views).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.budget.gate import BudgetGate
from kvcore.errors import GeometryError, UnsupportedConfiguration
from kvcore.memory.families import (
    CacheGroup,
    FamilyLayout,
    StateSpec,
    attention_group,
    mamba_group,
    mla_group,
    plan_rows,
)
from tests.family_stack import (
    HOST_GRANULARITY,
    MiB,
    granularity,
    open_stack,
    pattern,
    write_and_check,
)
from tests.memstack import BACKENDS

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- plan_rows: the alignment policy ----------------------------------------------------------


def test_deepseek_latent_row_takes_an_exact_18mib_page() -> None:
    plan = plan_rows(576 * 2, 2 * MiB)  # one token of one layer, SGLang's MLA pool row
    assert (plan.row_stride, plan.page_bytes, plan.rows_per_page) == (1152, 18 * MiB, 16384)
    assert plan.padding == 0
    block = plan_rows(64 * 576 * 2, 2 * MiB)  # a 64-token vLLM block of one layer
    assert (block.row_stride, block.page_bytes, block.rows_per_page) == (73728, 18 * MiB, 256)


def test_a_row_without_a_small_exact_page_is_padded_least_first() -> None:
    row = 61 * 64 * 1152  # DeepSeek-V3 compound row: 61 layers of a 64-token block
    assert math.lcm(row, 2 * MiB) > 1 << 30
    plan = plan_rows(row, 2 * MiB)
    assert (plan.row_stride, plan.page_bytes, plan.rows_per_page) == (4718592, 18 * MiB, 4)
    assert plan.padding == pytest.approx(0.0469, abs=1e-4)


def test_pad_false_refuses_and_names_the_plan_that_works() -> None:
    with pytest.raises(GeometryError) as err:
        plan_rows(61 * 64 * 1152, 2 * MiB, pad=False)
    assert "4718592" in err.value.hint and "18874368" in err.value.hint


def test_a_row_larger_than_any_page_is_refused() -> None:
    with pytest.raises(GeometryError) as err:
        plan_rows(5 * MiB, 2 * MiB, max_page_bytes=4 * MiB)
    assert str(6 * MiB) in err.value.hint


def test_a_fixed_page_is_tiled_exactly_or_padded() -> None:
    assert plan_rows(1152, 2 * MiB, page_bytes=18 * MiB).row_stride == 1152
    plan = plan_rows(1152, 2 * MiB, page_bytes=2 * MiB)
    assert plan.page_bytes == 2 * MiB and plan.row_stride == 2048  # 256-aligned divisor
    with pytest.raises(GeometryError):
        plan_rows(1152, 2 * MiB, page_bytes=3 * MiB // 2)


@settings(max_examples=150, deadline=None)
@given(
    row=st.integers(1, 40_000),
    gran_k=st.integers(0, 3),
    max_pages=st.integers(1, 12),
    align_k=st.integers(0, 6),
)
def test_plan_is_valid_and_minimal(row: int, gran_k: int, max_pages: int, align_k: int) -> None:
    gran, align = 4096 << gran_k, 1 << align_k
    pages = range(gran, max_pages * gran + 1, gran)

    def strides(page: int) -> list[int]:  # every aligned stride >= row tiling ``page``
        found = {d for q in range(1, math.isqrt(page) + 1) if page % q == 0 for d in (q, page // q)}
        return sorted(d for d in found if d >= row and d % align == 0)

    try:
        plan = plan_rows(row, gran, max_page_bytes=max_pages * gran, stride_alignment=align)
    except GeometryError:
        assert not any(strides(p) for p in pages)  # no page up to the limit takes a row
        return
    assert plan.row_stride >= row and plan.page_bytes % plan.row_stride == 0
    assert plan.page_bytes % gran == 0 and plan.page_bytes <= max_pages * gran
    if plan.row_stride == row:
        return
    assert plan.row_stride % align == 0
    assert math.lcm(row, gran) > max_pages * gran  # exact was impossible
    assert plan.row_stride == min(min(strides(p), default=1 << 62) for p in pages)  # least pad


# -- MLA ------------------------------------------------------------------------------------


def deepseek_mla(layers: int, block_size: int) -> CacheGroup:
    return mla_group(
        [f"model.layers.{i}.self_attn" for i in range(layers)],
        block_size=block_size,
        latent_dim=512 + 64,
        dtype=BF16,
    )


@pytest.mark.parametrize("layout", ["compound", "per-layer"])
def test_mla_views_are_one_latent_per_layer(backend: str, layout: str) -> None:
    group = deepseek_mla(layers=3, block_size=16)
    fam = FamilyLayout([group], num_blocks=40, granularity=granularity(backend), layout=layout)  # type: ignore[arg-type]
    g = fam.geometry
    assert g.kv_buffers == 1 and fam.plan.padding == 0
    assert g.num_layers == (1 if layout == "compound" else 3)
    assert g.block_bytes == (3 if layout == "compound" else 1) * 16 * 1152
    with open_stack(backend, fam) as s:
        views = [fam.view(s.cache, layer, "latent") for layer in group.layers]
        assert all(v.shape == (40, 16, 1, 576) and v.dtype == BF16 for v in views)
        pointers = [v.data_ptr() for v in views]
        blocks = s.ledger.alloc(6)
        assert blocks is not None
        write_and_check(s, [(layer, "latent") for layer in group.layers], blocks)
        s.ledger.free(blocks)
        assert s.mapped() == set()
        assert [v.data_ptr() for v in views] == pointers  # stable across map and unmap
        assert all(
            fam.view(s.cache, ly, "latent").data_ptr() == p
            for ly, p in zip(group.layers, pointers, strict=True)
        )


def test_mla_padded_row_leaves_the_padding_untouched() -> None:
    group = deepseek_mla(layers=3, block_size=16)  # a 55296-byte compound row
    fam = FamilyLayout(
        [group], num_blocks=10, granularity=HOST_GRANULARITY, max_page_bytes=HOST_GRANULARITY
    )
    assert (fam.plan.row_bytes, fam.plan.row_stride) == (55296, 65536)
    with open_stack("host", fam) as s:
        blocks = s.ledger.alloc(3)
        assert blocks is not None
        for layer in group.layers:
            fam.view(s.cache, layer, "latent")[blocks] = 1.0
        raw = s.raw()
        for b in blocks:
            row = raw[b * 65536 : (b + 1) * 65536]
            assert bool((row[:55296].view(BF16) == 1.0).all())
            assert not bool(row[55296:].any())  # padding is never written


def test_mla_with_two_buffers_is_refused() -> None:
    latent = StateSpec("latent", (16, 1, 576), BF16)
    with pytest.raises(UnsupportedConfiguration, match="one latent buffer per layer"):
        CacheGroup("mla", ("l0",), (latent, StateSpec("v", (16, 1, 512), BF16)), 16)


# -- hybrid: full + sliding window ----------------------------------------------------------


def gemma_groups(block_size: int = 16) -> list[CacheGroup]:
    """1 full : 2 sliding-window layers, grouped the way vLLM's uniform-page-size planner
    does: (full.0, full.1), (sw.0, sw.2), (sw.1, sw.3)."""
    common = {"block_size": block_size, "num_kv_heads": 2, "head_size": 64, "dtype": BF16}
    return [
        attention_group(["full.0", "full.1"], **common),  # type: ignore[arg-type]
        attention_group(["sw.0", "sw.2"], sliding_window=512, **common),  # type: ignore[arg-type]
        attention_group(["sw.1", "sw.3"], sliding_window=512, **common),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("layout", ["compound", "per-layer"])
def test_hybrid_groups_overlay_one_block_row_and_share_one_ledger(
    backend: str, layout: str
) -> None:
    groups = gemma_groups()
    cell = 2 * 16 * 128 * 2
    fam = FamilyLayout(groups, num_blocks=48, granularity=granularity(backend), layout=layout)  # type: ignore[arg-type]
    assert fam.parts == 2 and fam.plan.row_bytes == (2 * cell if layout == "compound" else cell)
    assert fam.group_of("sw.2") == 1 and fam.group_of("full.1") == 0
    # layer i of every group sits at the same bytes: the groups overlay each other
    for i in range(2):
        spots = {
            (fam.place(g.layers[i], "kv").part, fam.place(g.layers[i], "kv").offset) for g in groups
        }
        assert len(spots) == 1
    with open_stack(backend, fam) as s:
        per_group = [s.ledger.alloc(5) for _ in groups]  # one ledger serves every group
        assert all(b is not None for b in per_group)
        owned = [set(b or []) for b in per_group]
        assert not (owned[0] & owned[1]) and not (owned[1] & owned[2])
        for group, blocks in zip(groups, per_group, strict=True):
            assert blocks is not None
            write_and_check(s, [(layer, "kv") for layer in group.layers], blocks)
        # writes of groups 1 and 2 did not touch group 0's blocks
        for salt, layer in enumerate(groups[0].layers):
            view = fam.view(s.cache, layer, "kv")
            for b in per_group[0] or []:
                assert torch.equal(view[b].cpu(), pattern(view, b, salt).cpu())
        # a page stays mapped while any group still holds a block on it
        shared = {s.ledger.page_of(b) for b in owned[0]} & {s.ledger.page_of(b) for b in owned[1]}
        s.ledger.free(per_group[0] or [])
        assert shared <= s.mapped()
        s.ledger.free(per_group[1] or [])
        s.ledger.free(per_group[2] or [])
        assert s.mapped() == set()


def test_hybrid_mixed_cells_fit_compound_but_not_per_layer() -> None:
    full = attention_group(["f0"], block_size=16, num_kv_heads=4, head_size=128, dtype=BF16)
    sw = attention_group(
        ["s0", "s1"], block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=64
    )
    fam = FamilyLayout([full, sw], num_blocks=8, granularity=HOST_GRANULARITY)
    assert fam.plan.row_bytes == max(full.stride, 2 * sw.stride) == 32768
    with pytest.raises(UnsupportedConfiguration, match="mixed cell strides"):
        FamilyLayout([full, sw], num_blocks=8, granularity=HOST_GRANULARITY, layout="per-layer")


def test_an_engine_row_wider_than_the_groups_is_planned_and_a_narrower_one_refused() -> None:
    full = attention_group(["f0"], block_size=16, num_kv_heads=4, head_size=128, dtype=BF16)
    aligned = full.stride + 4096  # e.g. vLLM rounding its block stride to an alignment
    fam = FamilyLayout([full], num_blocks=8, granularity=HOST_GRANULARITY, row_bytes=aligned)
    assert fam.plan.row_bytes == fam.geometry.block_bytes == aligned
    assert fam.place("f0", "kv").offset == 0  # the cell stays where it was; the tail is padding
    with pytest.raises(GeometryError, match="narrower than the groups"):
        FamilyLayout([full], num_blocks=8, granularity=HOST_GRANULARITY, row_bytes=full.stride - 2)


def test_a_layer_in_two_groups_is_refused() -> None:
    a = attention_group(["l0"], block_size=16, num_kv_heads=1, head_size=64, dtype=BF16)
    with pytest.raises(UnsupportedConfiguration, match="'l0' is in KV cache groups 0 and 1"):
        FamilyLayout([a, a], num_blocks=8, granularity=HOST_GRANULARITY)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"kind": "cross_attention"}, UnsupportedConfiguration),
        ({"kind": "attention", "sliding_window": 128}, UnsupportedConfiguration),
        ({"kind": "sliding_window"}, UnsupportedConfiguration),
        ({"kind": "sliding_window", "sliding_window": 0}, GeometryError),
        ({"kind": "attention", "block_size": 0}, GeometryError),
        ({"kind": "attention", "cell_stride": 100}, GeometryError),
        ({"kind": "attention", "layers": ()}, GeometryError),
    ],
)
def test_group_validation_names_the_problem(kwargs: dict[str, object], error: type) -> None:
    args: dict[str, object] = {
        "layers": ("l0",),
        "cell": (StateSpec("kv", (1, 16, 128), BF16),),
        "block_size": 16,
    }
    args.update(kwargs)
    with pytest.raises(error):
        CacheGroup(**args)  # type: ignore[arg-type]


def test_views_refuse_a_cache_of_another_geometry() -> None:
    fam = FamilyLayout(gemma_groups(), num_blocks=16, granularity=HOST_GRANULARITY)
    other = FamilyLayout(gemma_groups(), num_blocks=32, granularity=HOST_GRANULARITY)
    with open_stack("host", other) as s:
        with pytest.raises(GeometryError, match=r"FamilyLayout\.geometry"):
            fam.view(s.cache, "full.0", "kv")
        with pytest.raises(KeyError, match="has: \\['kv'\\]"):
            other.view(s.cache, "full.0", "latent")


# -- Mamba: conv + SSM state cells, one per slot ----------------------------------------------


def mamba(layers: int = 2) -> CacheGroup:
    return mamba_group(
        [f"mamba.{i}" for i in range(layers)],
        states=[("conv", (96, 3), BF16), ("ssm", (4, 16, 24), F32)],  # 576 + 6144 bytes
    )


@pytest.mark.parametrize("layout", ["compound", "per-layer"])
def test_mamba_cells_fill_and_drain_pages_with_a_partial_tail(backend: str, layout: str) -> None:
    group = mamba()
    assert group.offsets == (0, 576) and group.cell_bytes == 6720
    gran = granularity(backend)
    fam = FamilyLayout(
        [group],
        num_blocks=1,
        granularity=gran,
        layout=layout,  # type: ignore[arg-type]
    )
    rpp = fam.plan.rows_per_page
    slots = 2 * rpp + rpp // 3 + 1  # the last page is partly beyond capacity
    fam = FamilyLayout([group], num_blocks=slots, granularity=gran, layout=layout)  # type: ignore[arg-type]
    g = fam.geometry
    assert g.num_pages == 3 and len(g.blocks_of(2)) < g.blocks_per_page
    # a cell never straddles a page
    for p in fam.placements:
        for slot in (0, rpp - 1, rpp, slots - 1):
            start = slot * g.block_bytes + p.offset
            end = start + math.prod(p.shape) * torch.empty(0, dtype=p.dtype).element_size()
            assert start // g.page_bytes == (end - 1) // g.page_bytes
    with open_stack(backend, fam) as s:
        conv = fam.view(s.cache, "mamba.1", "conv")
        ssm = fam.view(s.cache, "mamba.1", "ssm")
        assert conv.shape == (slots, 96, 3) and ssm.shape == (slots, 4, 16, 24)
        assert not bool(ssm[slots - 1].any())  # unbacked slots read as zeros
        first = s.ledger.alloc(rpp)
        assert first is not None and len(s.mapped()) == 1
        rest = s.ledger.alloc(slots - rpp)
        assert rest is not None and s.mapped() == {0, 1, 2}
        assert s.ledger.alloc(1) is None and s.ledger.available() == 0  # capacity is slots
        tail = [slots - 1, slots - 2, rpp]
        keys = [(layer, role) for layer in group.layers for role in ("conv", "ssm")]
        write_and_check(s, keys, tail)
        # bytes of the last page beyond the last slot stay untouched (no view reaches them)
        for part in range(len(s.cache.ranges)):
            assert not bool(s.raw(part)[slots * g.block_bytes :].any())
        s.ledger.free(first)
        assert s.mapped() == {1, 2}
        s.ledger.free(rest)
        assert s.mapped() == set()


def test_states_are_aligned_to_their_dtype() -> None:
    group = mamba_group(
        ["m0"], states=[("conv", (5, 3), BF16), ("ssm", (3,), torch.float64)]
    )  # 30 bytes of conv, then f64 at 32
    assert group.offsets == (0, 32) and group.cell_bytes == 56 and group.alignment == 8
    fam = FamilyLayout([group], num_blocks=4, granularity=HOST_GRANULARITY)
    assert fam.plan.row_stride % 8 == 0


def test_hybrid_attention_and_mamba_share_a_padded_cell() -> None:
    attn = attention_group(["a0", "a1"], block_size=32, num_kv_heads=2, head_size=64, dtype=BF16)
    mam = mamba(layers=2)
    padded = mamba_group(
        mam.layers,
        states=[(s.role, s.shape, s.dtype) for s in mam.cell],
        cell_stride=attn.stride,  # the engine pads Mamba pages to the attention page
    )
    fam = FamilyLayout(
        [attn, padded], num_blocks=20, granularity=HOST_GRANULARITY, layout="per-layer"
    )
    assert fam.plan.row_bytes == attn.stride == 16384
    with open_stack("host", fam) as s:
        a_blocks, m_slots = s.ledger.alloc(3), s.ledger.alloc(2)
        assert a_blocks is not None and m_slots is not None
        write_and_check(s, [("a0", "kv"), ("a1", "kv")], a_blocks)
        write_and_check(s, [("mamba.0", "conv"), ("mamba.1", "ssm")], m_slots)


def test_state_major_mamba_rows_group_each_state_across_layers(backend: str) -> None:
    group = mamba_group(
        ["m0", "m1", "m2"],
        states=[("conv", (5, 3), BF16), ("ssm", (4, 16, 24), F32)],  # 30 + 6144 bytes
        state_major=True,
    )
    used, offsets = group.row_offsets()
    # [conv x 3][ssm x 3]: the ssm region starts at the first 4-byte boundary after 90 bytes
    assert [offsets[i, "conv"] for i in range(3)] == [0, 30, 60]
    assert [offsets[i, "ssm"] for i in range(3)] == [92, 92 + 6144, 92 + 2 * 6144]
    assert used == 92 + 3 * 6144
    fam = FamilyLayout([group], num_blocks=19, granularity=granularity(backend))
    with open_stack(backend, fam) as s:
        slots = s.ledger.alloc(19)
        assert slots is not None
        write_and_check(s, [(ly, r) for ly in group.layers for r in ("conv", "ssm")], [0, 9, 18])


def test_state_major_with_a_padded_cell_is_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match="state-major"):
        mamba_group(["m0"], states=[("ssm", (4,), F32)], cell_stride=64, state_major=True)


def test_separate_pools_share_one_gate() -> None:
    """Engines that keep groups in pools of their own (SGLang's hybrid SWA: a full pool and a
    smaller window pool) get one layout and ledger per pool, admitted by one gate."""
    full = attention_group(["f0", "f1"], block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    window = attention_group(
        ["s0", "s1", "s2"], block_size=16, num_kv_heads=2, head_size=64, dtype=BF16,
        sliding_window=256,
    )  # fmt: skip
    layouts = [
        FamilyLayout([full], num_blocks=64, granularity=HOST_GRANULARITY, layout="per-layer"),
        FamilyLayout([window], num_blocks=16, granularity=HOST_GRANULARITY, layout="per-layer"),
    ]
    page = layouts[0].geometry.page_device_bytes
    assert layouts[1].geometry.page_device_bytes == 3 * page // 2
    zero = HOST_GRANULARITY  # each pool's zero page (one granule), charged while it is open
    gate = BudgetGate(limit=4 * page + 2 * zero)
    with open_stack("host", layouts[0], gate) as f, open_stack("host", layouts[1], gate) as w:
        assert f.mem.cache.zero_page_bytes == w.mem.cache.zero_page_bytes == zero
        per_page = layouts[0].geometry.blocks_per_page
        held = f.ledger.alloc(3 * per_page)  # 3 of the 4 pages' worth
        assert held is not None
        assert w.ledger.alloc(1) is None  # the window pool's page (1.5 pages) does not fit
        f.ledger.free(held[:per_page])
        assert len(f.mapped()) == 2  # flushed: the emptied page went back to the driver
        got = w.ledger.alloc(1)
        assert got is not None and gate.held == 2 * page + 3 * page // 2 + 2 * zero
