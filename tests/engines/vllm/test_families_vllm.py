"""kvcore's model-family layouts built from vLLM 0.33.0's real KV-cache specs and planner.

Runs in the ``test-vllm-*`` nox session (vLLM installed, no GPU); skips elsewhere. The specs
(``FullAttentionSpec``, ``SlidingWindowSpec``, ``MLAAttentionSpec``, ``MambaSpec``) are built
directly, Mamba state shapes come from vLLM's own ``MambaStateShapeCalculator``, and groups and
tensor placement from vLLM's real planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``, block-outermost ``BLHNC``). The tests prove:

* every spec's ``page_size_bytes`` is kvcore's cell stride (unpadded: the packed cell);
* kvcore's row and per-layer offsets are exactly vLLM's ``KVCacheTensor`` strides and offsets;
* vLLM's own ``create_kv_cache_views`` over kvcore's virtual buffer alias kvcore's views
  (written through one, read through the other), on the host backend's real mappings;
* a padded kvcore row stride reaches vLLM through the spec's ``block_stride_alignment``.

The translation itself is the adapter's (``kvcore.adapters.vllm.groups``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvcore.errors import UnsupportedConfiguration
from kvcore.memory.families import FamilyLayout
from tests.family_stack import HOST_GRANULARITY, MiB, Stack, open_stack, pattern

iface = pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="vLLM is not installed here: the test-vllm-* nox sessions run these tests",
)
try:
    from vllm.v1.core import kv_cache_planning as planning
except ImportError:  # vLLM 0.30.0 keeps the planner in kv_cache_utils
    planning = pytest.importorskip("vllm.v1.core.kv_cache_utils")
mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")

from kvcore.adapters.vllm.groups import kvcore_groups  # noqa: E402  (imports vLLM)

BF16 = torch.bfloat16
LAYOUT = "BLHNC"  # block-outermost: one block id is one row of every layer's page


# -- vLLM's planner --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config() -> Any:
    from vllm.config import DeviceConfig, VllmConfig

    # the planner never touches a device; naming one skips vLLM's platform detection
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.cache_config.kv_cache_layout = LAYOUT
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # the hybrid allocator
    return config


def plan(config: Any, specs: dict[str, Any], memory: int) -> Any:
    """vLLM's own ``KVCacheConfig`` for ``specs`` in ``memory`` bytes."""
    groups = planning.get_kv_cache_groups(config, specs)
    return planning.get_kv_cache_config_from_groups(config, groups, memory)


def assert_same_placement(fam: FamilyLayout, kv_config: Any) -> None:
    """kvcore's row and offsets are vLLM's block stride and tensor offsets."""
    strides = {t.block_stride for t in kv_config.kv_cache_tensors}
    assert strides == {fam.plan.row_stride}
    for tensor in kv_config.kv_cache_tensors:
        for i, layer in enumerate(tensor.layers):
            first = fam.place(layer, fam.groups[fam.group_of(layer)].cell[0].role)
            assert (first.part, first.offset) == (0, tensor.offset + i * tensor.layer_stride)


def vllm_views(s: Stack, kv_config: Any) -> dict[str, torch.Tensor]:
    """vLLM's own per-layer views over kvcore's virtual buffer (the flat ``int8`` buffer the
    adapter hands ``allocate_kv_cache``)."""
    g = s.layout.geometry
    return views_over(s.cache.view(0, 0, torch.int8, (g.block_bytes,)).reshape(-1), kv_config)


def views_over(raw: torch.Tensor, kv_config: Any) -> dict[str, torch.Tensor]:
    """What ``allocate_kv_cache`` builds over the flat buffer ``raw``: vLLM's own
    ``create_kv_cache_views`` for every tensor of ``kv_config``."""
    layout = iface.KVCacheLayout[LAYOUT]
    out: dict[str, torch.Tensor] = {}
    specs = {
        name: grp.kv_cache_spec for grp in kv_config.kv_cache_groups for name in grp.layer_names
    }
    for tensor in kv_config.kv_cache_tensors:
        spec = specs[tensor.layers[0]]
        if isinstance(spec, iface.UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        views = iface.create_kv_cache_views(raw, spec, kv_config.num_blocks, layout, tensor)
        out.update(zip(tensor.layers, views, strict=True))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def cross_check(s: Stack, kv_config: Any, blocks: Sequence[int]) -> None:
    """Write every state of every layer through kvcore's views for ``blocks``; vLLM's views of
    the same layer read the same bytes at the same addresses."""
    theirs = vllm_views(s, kv_config)
    fam = s.layout
    for salt, p in enumerate(fam.placements):
        view = fam.view(s.cache, p.layer, p.role)
        their = theirs[p.layer]
        assert their.shape[0] == view.shape[0] == kv_config.num_blocks
        start = p.offset - fam.place(p.layer, fam.groups[p.group].cell[0].role).offset
        nbytes = math.prod(p.shape) * view.element_size()
        for b in blocks:
            view[b] = pattern(view, b, salt)
            assert torch.equal(as_bytes(their[b])[start : start + nbytes], as_bytes(view[b]))
            addr = their[b].data_ptr() + start
            assert addr == view[b].data_ptr()


# -- specs: page sizes agree -----------------------------------------------------------------


def mamba2_spec(block_size: int = 16) -> Any:
    calc = mamba_utils.MambaStateShapeCalculator
    shapes = calc.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=256,
        n_groups=1,
        num_heads=8,
        head_dim=32,
        state_size=16,
        conv_kernel=4,
    )
    return iface.MambaSpec(block_size=block_size, shapes=shapes, dtypes=(BF16, torch.float32))


def gdn_spec() -> Any:
    calc = mamba_utils.MambaStateShapeCalculator
    shapes = calc.gated_delta_net_state_shape(1, 4, 8, 32, 32, 4)
    return iface.MambaSpec(
        block_size=64,
        shapes=shapes,
        dtypes=(BF16, torch.float32),
        mamba_type=iface.MambaAttentionBackendEnum.GDN_ATTN,
    )


SPECS = {
    "full": lambda: iface.FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=BF16
    ),
    "full-windowed": lambda: iface.FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=BF16, sliding_window=1024
    ),
    "sliding": lambda: iface.SlidingWindowSpec(
        block_size=32, num_kv_heads=4, head_size=256, dtype=BF16, sliding_window=4096
    ),
    "mla-deepseek": lambda: iface.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=512 + 64, dtype=BF16
    ),
    "mla-aligned": lambda: iface.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=BF16, alignment=1 << 17
    ),
    "mamba2": mamba2_spec,
    "gdn": gdn_spec,
    # --kv-cache-dtype fp8: dense fp8 K/V, the scales are per-layer tensors outside the page
    "fp8-per-tensor": lambda: iface.FullAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.uint8,
        kv_quant_mode=iface.KVQuantMode.FP8_PER_TENSOR,
    ),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_spec_page_size_is_the_kvcore_cell(name: str) -> None:
    spec = SPECS[name]()
    (group,) = kvcore_groups([iface.KVCacheGroupSpec(["layer.0"], spec)])
    assert group.cell_bytes == spec.real_page_size_bytes
    assert group.stride == spec.page_size_bytes
    if name == "mla-deepseek":
        assert group.kind == "mla" and group.cell[0].shape == (64, 1, 576)
        assert spec.page_size_bytes == 64 * 576 * 2
    if name == "mla-aligned":
        assert group.stride == 1 << 17 > group.cell_bytes  # vLLM's padded page, kept
    if name == "sliding":
        assert group.kind == "sliding_window" and group.sliding_window == 4096
    if name == "full-windowed":
        assert group.kind == "attention" and group.sliding_window is None


@pytest.mark.parametrize(
    "spec",
    [
        lambda: iface.CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16),
        lambda: iface.ChunkedLocalAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, attention_chunk_size=256
        ),
        lambda: iface.FullAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.uint8,
            kv_quant_mode=iface.KVQuantMode.INT8_PER_TOKEN_HEAD,
        ),
    ],
    ids=["cross-attention", "chunked-local", "int8-per-token-head"],
)
def test_unsupported_specs_are_named(spec: Any) -> None:
    built = spec()
    with pytest.raises(UnsupportedConfiguration, match=type(built).__name__):
        kvcore_groups([iface.KVCacheGroupSpec(["layer.0"], built)])


# -- real planner, real views ----------------------------------------------------------------


def test_gemma_hybrid_matches_vllm_and_its_views_alias_ours(vllm_config: Any) -> None:
    full = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    window = iface.SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=512
    )
    specs = {f"model.layers.{i}.attn": full if i % 3 == 2 else window for i in range(6)}
    kv_config = plan(vllm_config, specs, 2 * MiB)
    assert len(kv_config.kv_cache_groups) == 3  # (sw, sw), (sw, sw), (full, full)
    groups = kvcore_groups(kv_config.kv_cache_groups)
    assert [g.kind for g in groups].count("sliding_window") == 2
    fam = FamilyLayout(groups, num_blocks=kv_config.num_blocks, granularity=HOST_GRANULARITY)
    assert fam.plan.padding == 0
    assert_same_placement(fam, kv_config)
    with open_stack("host", fam) as s:
        blocks = [s.ledger.alloc(3) for _ in groups]  # one ledger, every group draws from it
        assert all(b is not None for b in blocks)
        cross_check(s, kv_config, [b for got in blocks for b in got or []])


def test_attention_mamba_hybrid_matches_vllm(vllm_config: Any) -> None:
    full = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    specs = {"l0.attn": full, "l1.mixer": mamba2_spec(), "l2.mixer": mamba2_spec(), "l3.attn": full}
    kv_config = plan(vllm_config, specs, 2 * MiB)
    groups = kvcore_groups(kv_config.kv_cache_groups)
    assert sorted(g.kind for g in groups) == ["attention", "mamba", "mamba"]
    fam = FamilyLayout(groups, num_blocks=kv_config.num_blocks, granularity=HOST_GRANULARITY)
    assert_same_placement(fam, kv_config)
    # the Mamba cell (conv + SSM, one per slot) is the largest page: it sets the row
    assert fam.plan.row_bytes == mamba2_spec().page_size_bytes
    with open_stack("host", fam) as s:
        slots = s.ledger.alloc(kv_config.num_blocks)  # every slot, the last page's tail too
        assert slots is not None and s.ledger.alloc(1) is None
        cross_check(s, kv_config, [0, kv_config.num_blocks // 2, kv_config.num_blocks - 1])


@pytest.mark.skipif(
    "block_stride_alignment" not in iface.KVCacheSpec.__dataclass_fields__,
    reason="this vLLM's specs have no block_stride_alignment (0.30.0)",
)
def test_deepseek_mla_padded_row_reaches_vllm_through_block_stride_alignment(
    vllm_config: Any,
) -> None:
    mla = iface.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=BF16)
    specs = {f"model.layers.{i}.self_attn": mla for i in range(61)}
    kv_config = plan(vllm_config, specs, 40 * MiB)
    (tensor,) = kv_config.kv_cache_tensors
    assert tensor.block_stride == 61 * 64 * 1152  # vLLM's dense row: 4497408 bytes
    fam = FamilyLayout(
        kvcore_groups(kv_config.kv_cache_groups),
        num_blocks=kv_config.num_blocks,
        granularity=2 * MiB,
    )
    assert (fam.plan.row_stride, fam.plan.page_bytes) == (4718592, 18 * MiB)
    # the adapter's seam: tell vLLM the stride through every spec's block_stride_alignment
    padded = [
        dataclasses.replace(
            g,
            kv_cache_spec=dataclasses.replace(
                g.kv_cache_spec, block_stride_alignment=fam.plan.row_stride
            ),
        )
        for g in kv_config.kv_cache_groups
    ]
    kv_padded = planning.get_kv_cache_config_from_groups(vllm_config, padded, 40 * MiB)
    assert kv_padded.num_blocks == 40 * MiB // 4718592
    fam = FamilyLayout(
        kvcore_groups(kv_padded.kv_cache_groups),
        num_blocks=kv_padded.num_blocks,
        granularity=2 * MiB,
    )
    assert_same_placement(fam, kv_padded)
    with open_stack("host", fam) as s:
        block = s.ledger.alloc(1)
        assert block is not None
        cross_check(s, kv_padded, block)
        view = fam.view(s.cache, "model.layers.60.self_attn", "latent")
        assert view.shape == (kv_padded.num_blocks, 64, 1, 576) and view.stride(0) == 4718592 // 2


def test_vllm_keys_prefix_cache_entries_by_group() -> None:
    """What the module doc of ``kvcore.memory.families`` relies on: vLLM's prefix cache tells groups
    apart itself (the group id is part of every key), so kvcore's ledger needs no group id."""
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    digest = utils.BlockHash(bytes(32))
    keys = {utils.make_block_hash_with_group_id(digest, gid) for gid in range(3)}
    assert len(keys) == 3
    assert sorted(utils.get_group_id(k) for k in keys) == [0, 1, 2]
    assert {utils.get_block_hash(k) for k in keys} == {digest}


# -- the adapter's memory, per family, on each backend ----------------------------------------


def _gemma() -> tuple[dict[str, Any], int]:
    full = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    window = iface.SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=512
    )
    return {f"model.layers.{i}.attn": full if i % 3 == 2 else window for i in range(6)}, 8 * MiB


def _mamba_hybrid() -> tuple[dict[str, Any], int]:
    full = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    mamba = mamba2_spec()
    return {"l0.attn": full, "l1.mixer": mamba, "l2.mixer": mamba, "l3.attn": full}, 8 * MiB


def _deepseek_mla() -> tuple[dict[str, Any], int]:
    mla = iface.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=BF16)
    return {f"model.layers.{i}.self_attn": mla for i in range(61)}, 96 * MiB


FAMILY_MODELS = {
    "gemma-hybrid": _gemma,
    "mamba-hybrid": _mamba_hybrid,
    "deepseek-mla": _deepseek_mla,
}


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_adapter_memory_backs_each_family_and_vllm_views_alias_it(
    vllm_config: Any, family: str, backend: str
) -> None:
    """The vLLM adapter's ``ElasticKVMemory`` on a real planner config of each family: rows
    padded where a page needs it (as the engine core does), blocks from its ledger map pages,
    bytes written through vLLM's views (device kernels on ``cuda``) read back through kvcore's
    layout views at the same addresses, and the pages go back when the blocks are freed."""
    from kvcore.adapters.config import ElasticConfig
    from kvcore.adapters.vllm.groups import pad_for_pages
    from kvcore.adapters.vllm.memory import ElasticKVMemory
    from kvcore.vmm import open_backend

    specs, memory_bytes = FAMILY_MODELS[family]()
    kv = plan(vllm_config, specs, memory_bytes)
    options: dict[str, Any] = {}
    if backend == "host":
        options = {"granularity": 2 * MiB, "device_bytes": 256 * MiB}
    probe = open_backend(backend, 0, **options)
    gran = probe.granularity()
    probe.close()
    dense = kv.kv_cache_tensors[0].block_stride
    stride = pad_for_pages(kv, gran)  # what elastic_settings does in the engine core
    if family == "deepseek-mla":
        assert stride is not None and stride > dense  # 61 x 64 x 1152 tiles no 2 MiB page
    config = ElasticConfig.parse({"backend": backend, "backend_options": options})
    memory = ElasticKVMemory(config, kv)
    try:
        layout = memory.layout
        assert layout.geometry.block_bytes == kv.kv_cache_tensors[0].block_stride
        theirs = views_over(memory.buffer(), kv)
        assert memory.stats().in_use == 1  # the null block's page
        blocks = memory.ledger.alloc(min(kv.num_blocks - 1, 4 * layout.geometry.blocks_per_page))
        assert blocks is not None
        assert memory.stats().in_use == len({layout.geometry.page_of(b) for b in [0, *blocks]})
        picked = blocks[:2] + blocks[-2:]
        for salt, p in enumerate(layout.placements):
            their = theirs[p.layer]
            first = layout.groups[p.group].cell[0].role
            start = p.offset - layout.place(p.layer, first).offset
            ours = layout.view(memory.cache, p.layer, p.role)
            nbytes = ours[0].numel() * ours.element_size()
            for b in picked:
                raw = their[b].view(torch.uint8).reshape(-1)[start : start + nbytes]
                assert raw.data_ptr() == ours[b].data_ptr()
                values = torch.arange(nbytes, device=raw.device, dtype=torch.int32)
                raw.copy_(((values * 7 + b * 13 + salt) % 251).to(torch.uint8))
                got = ours[b].contiguous().view(torch.uint8).reshape(-1)
                assert torch.equal(got.cpu(), raw.cpu())
        memory.ledger.free(blocks)
        assert memory.pages is not None and memory.pages.flush()
        assert memory.stats().in_use == 1  # every page but the null block's went back
    finally:
        memory.close()
