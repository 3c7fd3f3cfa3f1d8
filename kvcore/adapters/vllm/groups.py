"""vLLM's ``KVCacheConfig`` as a kvcore model-family layout (``kvcore.memory.families``).

vLLM 0.33.0 plans one backing allocation for every KV cache group: groups *overlay* each
other from byte 0 (a block id belongs to one group at a time; one ``BlockPool`` serves them
all). In a block-outermost layout (``BLNHC``, ``BLHNC``) block ``b`` of every layer is one
row of ``block_stride`` bytes: kvcore's ``compound`` family layout. In a layer-outermost
layout (``LBNHC``, vLLM's default for FLASH_ATTN and TRITON_ATTN; ``LBHNC``) layer ``i`` of
every group is a region of its own at ``i * layer_stride``, ``num_blocks`` cells of
``block_stride`` bytes: kvcore's ``per-layer`` layout (one handle per layer and page id),
whose regions are one contiguous reservation (``VirtualKVCache(contiguous=True)``). This
module translates

* each ``KVCacheGroupSpec`` into a ``kvcore.memory.families.CacheGroup`` (``kvcore_groups``):
  ``FullAttentionSpec`` (a window without the hybrid manager keeps every block) and
  ``SlidingWindowSpec`` into attention groups, ``MLAAttentionSpec`` into an MLA group (one
  latent buffer per layer), ``MambaSpec`` into a Mamba group (its states packed into one
  cell per slot, padded to ``page_size_padded``); every cell stride is the spec's
  ``page_size_bytes``;
* the config into a ``FamilyLayout`` whose row is vLLM's block stride (``family_layout``),
  after checking that vLLM placed every layer where kvcore's layout says it is;
* the row alignment decision into the config (``pad_for_pages``): when vLLM's row tiles no
  page of at most ``max_page_bytes`` exactly (61 DeepSeek MLA layers x 64 tokens x 1152
  bytes = 4497408 bytes would need a 1.07 GiB page), the engine core re-strides the tensors
  to kvcore's padded stride before any worker allocates, as vLLM's own
  ``block_stride_alignment`` would; in a layer-outermost layout it trims ``num_blocks`` to
  whole pages instead, so that each layer's region ends where kvcore's next one begins.

Everything vLLM's hybrid allocator needs beyond bytes stays vLLM's: prefix-cache keys carry
the group id (``BlockHashWithGroupId``), each group's ``SingleTypeKVCacheManager`` decides
which of its blocks it drops (sliding window, Mamba's ``mamba_cache_mode``), and all of them
allocate and free through the one elastic block pool.

Every function raises ``UnsupportedConfiguration`` naming the group, spec or tensor kvcore
cannot lay out and what to do instead; they run in the engine core at start-up
(``checks.check_kv_cache_config``) and again where memory is built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from kvcore.errors import UnsupportedConfiguration
from kvcore.memory.families import (
    DEFAULT_MAX_PAGE_BYTES,
    CacheGroup,
    FamilyLayout,
    attention_group,
    mamba_group,
    mla_group,
    plan_rows,
)
from kvcore.memory.geometry import Layout

__all__ = [
    "SUPPORTED_SPECS",
    "engine_layout",
    "engine_row_bytes",
    "family_layout",
    "kvcore_groups",
    "pad_for_pages",
]

SUPPORTED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec")
"""vLLM spec classes (exactly these, not subclasses) kvcore has a layout for."""

_DROP = "serve the model without --kvcore-elastic"
_BLOCK_OUTERMOST = (
    "unset VLLM_KV_CACHE_LAYOUT (elastic KV resolves a block-outermost layout itself) or set "
    "it to a block-outermost one (BLNHC, BLHNC)"
)


def kvcore_groups(kv_cache_groups: Sequence[Any]) -> list[CacheGroup]:
    """kvcore ``CacheGroup`` s for vLLM's ``KVCacheGroupSpec`` list, in vLLM's group order
    (the index is the group id vLLM puts into its prefix-cache keys).

    Raises ``UnsupportedConfiguration`` naming the group and spec for a spec class outside
    ``SUPPORTED_SPECS``, a quantized or packed page, a host-resident group or a group whose
    layers have different specs (vLLM's mixed-page packing)."""
    return [_group(gid, g) for gid, g in enumerate(kv_cache_groups)]


def _group(gid: int, group: Any) -> CacheGroup:
    from vllm.v1 import kv_cache_interface as iface

    layers = tuple(group.layer_names)
    spec = group.kv_cache_spec
    where = f"KV cache group {gid} ({len(layers)} layers, first {layers[:1]})"
    if not layers:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: KV cache group {gid} ({type(spec).__name__}) has no layers",
            hint=_DROP,
        )
    if getattr(group, "host_resident", False):
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: {where} is host-resident (HiSparse): its blocks do not live "
            "in the device KV buffer kvcore backs",
            hint=f"disable HiSparse, or {_DROP}",
        )
    if isinstance(spec, iface.UniformTypeKVCacheSpecs):
        inner = set(spec.kv_cache_specs.values())
        if len(inner) != 1:
            kinds = sorted({type(s).__name__ for s in inner})
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: {where} packs layers of {len(inner)} different specs "
                f"({', '.join(kinds)}) side by side in one block; kvcore's layouts give each "
                "group one cell per layer",
                hint=f"{_DROP} (vLLM packs mixed page sizes this way only for such models)",
            )
        spec = inner.pop()
    kind = type(spec)
    if kind.__name__ not in SUPPORTED_SPECS or kind.__module__ != iface.__name__:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: {where} uses vLLM KV cache spec {kind.__name__}, which has no "
            "kvcore layout",
            hint=f"elastic KV serves {', '.join(SUPPORTED_SPECS)} groups; {_DROP}",
        )
    try:
        int(spec.page_size_bytes)
    except Exception as exc:  # a spec vLLM itself could not allocate either
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: {where}: {kind.__name__} has no page size ({exc!r})",
            hint="fix the spec's shapes and dtypes",
        ) from exc
    if kind is iface.MambaSpec:
        roles: tuple[str, ...] = ("conv", "ssm") if len(spec.shapes) == 2 else ()
        roles = roles or tuple(f"state{i}" for i in range(len(spec.shapes)))
        states = zip(roles, spec.shapes, spec.dtypes, strict=True)
        return mamba_group(
            layers, states=states, block_size=spec.block_size, cell_stride=spec.page_size_bytes
        )
    # fp8 per tensor (--kv-cache-dtype fp8) keeps dense K/V pages: its scales are per-layer
    # tensors outside the KV buffer. Other modes pack scales or several tokens into a page.
    dense_modes = (iface.KVQuantMode.NONE, iface.KVQuantMode.FP8_PER_TENSOR)
    if (
        spec.kv_quant_mode not in dense_modes
        or spec.num_head_slots is not None
        or spec.state_content_bytes is not None
        or spec.tokens_per_state != 1
    ):
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: {where}: {kind.__name__} with a packed or quantized page "
            f"(kv_quant_mode={spec.kv_quant_mode.name}, tokens_per_state="
            f"{spec.tokens_per_state})",
            hint=f"use --kv-cache-dtype auto or fp8, or {_DROP}",
        )
    common = {"block_size": spec.block_size, "dtype": spec.dtype}
    if kind is iface.MLAAttentionSpec:
        if spec.num_kv_heads != 1:
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: {where}: MLAAttentionSpec with {spec.num_kv_heads} KV "
                "heads; an MLA latent has one",
                hint=_DROP,
            )
        return mla_group(
            layers, latent_dim=spec.head_size, cell_stride=spec.page_size_bytes, **common
        )
    return attention_group(
        layers,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
        # a FullAttentionSpec with a window (hybrid manager off) keeps every block
        sliding_window=spec.sliding_window if kind is iface.SlidingWindowSpec else None,
        cell_stride=spec.page_size_bytes,
        **common,
    )


def engine_layout(kv_cache_config: Any) -> Layout:
    """Which kvcore layout backs ``kv_cache_config``'s tensors: ``compound`` for a
    block-outermost layout (every tensor's layers end inside one block stride) and for a
    config without tensors (a scheduler-only process), ``per-layer`` for a layer-outermost
    one (every tensor at offset 0, its layers ``num_blocks * block_stride`` apart: the
    regions kvcore's per-layer ranges are).

    Raises ``UnsupportedConfiguration`` for tensors of both kinds, tensors of different block
    strides, and layer-outermost tensors placed otherwise."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        return "compound"
    strides = {int(t.block_stride) for t in tensors}
    if len(strides) > 1:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: KV cache tensors with block strides {sorted(strides)}; "
            "groups overlay one row of one stride",
            hint=_BLOCK_OUTERMOST,
        )
    stride = strides.pop()
    outer = {int(t.offset) + len(t.layers) * int(t.layer_stride) > stride for t in tensors}
    if outer == {False}:
        return "compound"
    region = int(kv_cache_config.num_blocks) * stride
    for t in tensors:
        if int(t.offset) != 0 or int(t.layer_stride) != region:
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: KV cache tensor of layers {t.layers[:2]} is neither "
                f"block-outermost nor layer-outermost with layers {region} bytes apart "
                f"(offset {t.offset}, layer stride {t.layer_stride}, block stride {stride})",
                hint=_BLOCK_OUTERMOST,
            )
    return "per-layer"


def engine_row_bytes(kv_cache_config: Any) -> int:
    """Bytes one block id spans in vLLM's KV buffer, over every layer: the block stride of
    its block-outermost tensors, or the most layers a tensor holds times the cell stride of
    layer-outermost ones (``engine_layout``); for a config without tensors (a scheduler-only
    process, vLLM's own scheduler tests) what vLLM's planner would make of the groups: the
    widest group's pages, rounded up to every spec's ``block_stride_alignment``.

    Raises ``UnsupportedConfiguration`` as ``engine_layout`` does."""
    tensors = kv_cache_config.kv_cache_tensors
    if tensors:
        layout = engine_layout(kv_cache_config)
        stride = int(tensors[0].block_stride)
        return stride * max(len(t.layers) for t in tensors) if layout == "per-layer" else stride
    row = 0
    align = 1
    for group in kv_cache_config.kv_cache_groups:
        specs = _layer_specs(group)
        row = max(row, sum(int(s.page_size_bytes) for s in specs))
        for s in specs:  # vLLM 0.30.0's specs have no block_stride_alignment
            alignment = getattr(s, "get_block_stride_alignment", lambda: 1)
            align = math.lcm(align, int(alignment()))
    return max(-(-row // align) * align, 1)


def _layer_specs(group: Any) -> list[Any]:
    inner = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if inner is not None:
        return [inner[name] for name in group.layer_names]
    return [group.kv_cache_spec] * len(group.layer_names)


def family_layout(
    kv_cache_config: Any,
    granularity: int,
    *,
    page_bytes: int | None = None,
    pad: bool = False,
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
) -> FamilyLayout:
    """The ``FamilyLayout`` of ``kv_cache_config`` on pages of ``granularity``, in the kind
    ``engine_layout`` names: compound (one row per block id, ``engine_row_bytes`` wide) or
    per-layer (one range per layer, a row is one cell), every group's layer ``i`` at the
    byte vLLM placed it (checked against ``kv_cache_tensors``).

    ``pad=False`` (a config whose tensors vLLM's workers view) raises ``GeometryError`` when
    the row tiles no page of at most ``max_page_bytes`` exactly; its hint names the padded
    stride (``pad_for_pages`` applies it in the engine core). ``pad=True`` lets kvcore pad
    (a config without tensors: nothing views the rows). Raises ``UnsupportedConfiguration``
    from ``kvcore_groups``/``engine_row_bytes``, for a config without groups, and where
    vLLM's placement of a layer is not kvcore's."""
    groups = kvcore_groups(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedConfiguration(
            "--kvcore-elastic: the model has no KV cache groups (attention-free): there is "
            "no KV memory to make elastic",
            hint=_DROP,
        )
    layout_kind = engine_layout(kv_cache_config)
    tensors = kv_cache_config.kv_cache_tensors
    if layout_kind == "per-layer":
        row = int(tensors[0].block_stride)  # one layer's cell: kvcore's per-layer row
        need = max(g.stride for g in groups)
    else:
        row = engine_row_bytes(kv_cache_config)
        need = max(g.row_offsets()[0] for g in groups)
    if row < need:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: vLLM's block row is {row} bytes, the groups' pages need "
            f"{need}: the KV cache tensors do not hold these specs",
            hint=f"plan the KV cache with vLLM's planner (block-outermost), or {_DROP}",
        )
    layout = FamilyLayout(
        groups,
        num_blocks=int(kv_cache_config.num_blocks),
        granularity=granularity,
        layout=layout_kind,
        pad=pad,
        max_page_bytes=max_page_bytes,
        page_bytes=page_bytes,
        row_bytes=row,
    )
    part_bytes = layout.geometry.range_bytes  # per-layer: part i's range begins at i * this
    for t in tensors:
        for i, name in enumerate(t.layers):
            first = layout.place(name, layout.groups[layout.group_of(name)].cell[0].role)
            ours = first.part * part_bytes + first.offset
            theirs = int(t.offset) + i * int(t.layer_stride)
            if ours != theirs:
                raise UnsupportedConfiguration(
                    f"--kvcore-elastic: vLLM places layer {name!r} at byte {theirs} of its "
                    f"block row, kvcore's layout at {ours}",
                    hint=f"{_BLOCK_OUTERMOST}, or {_DROP}",
                )
    return layout


def pad_for_pages(
    kv_cache_config: Any,
    granularity: int,
    *,
    page_bytes: int | None = None,
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
) -> int | None:
    """Re-stride ``kv_cache_config`` in place when its block row tiles no page of at most
    ``max_page_bytes`` exactly (``kvcore.memory.families.plan_rows``: least-padded stride). The
    tensors get the padded ``block_stride`` (their layer strides and offsets stay, as with a
    spec's ``block_stride_alignment``), ``num_blocks`` shrinks so the buffer keeps its size.
    Returns the new stride, or ``None`` when no padding is needed (nothing changed).

    Call in the engine core before any worker allocates and before the scheduler's config is
    derived. Raises ``GeometryError`` when no page can hold a row (its hint says what to
    change)."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        return None
    if engine_layout(kv_cache_config) == "per-layer":
        _whole_pages_per_layer(kv_cache_config, granularity, page_bytes, max_page_bytes)
        return None
    row = engine_row_bytes(kv_cache_config)
    plan = plan_rows(row, granularity, max_page_bytes=max_page_bytes, page_bytes=page_bytes)
    if plan.row_stride == row:
        return None
    size = int(kv_cache_config.num_blocks) * row
    num_blocks = size // plan.row_stride
    kv_cache_config.kv_cache_tensors = [
        dataclasses.replace(t, block_stride=plan.row_stride, size=num_blocks * plan.row_stride)
        for t in tensors
    ]
    kv_cache_config.num_blocks = num_blocks
    return plan.row_stride


def _whole_pages_per_layer(
    kv_cache_config: Any, granularity: int, page_bytes: int | None, max_page_bytes: int
) -> None:
    """A layer-outermost config: trim ``num_blocks`` in place to whole pages, so that each
    layer's region (``num_blocks`` cells) is exactly kvcore's per-layer range and layer
    ``i + 1`` begins where kvcore's range ``i + 1`` does. A cell that tiles no page would
    need a padded block stride inside every layer region; that is refused."""
    tensors = kv_cache_config.kv_cache_tensors
    cell = int(tensors[0].block_stride)
    plan = plan_rows(cell, granularity, max_page_bytes=max_page_bytes, page_bytes=page_bytes)
    if plan.row_stride != cell:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: a {cell}-byte KV cache block tiles no page of at most "
            f"{max_page_bytes} bytes in a layer-outermost layout",
            hint="set VLLM_KV_CACHE_LAYOUT=BLNHC (kvcore pads a block-outermost row instead)",
        )
    per_page = plan.page_bytes // cell
    num_blocks = int(kv_cache_config.num_blocks) // per_page * per_page
    if num_blocks == int(kv_cache_config.num_blocks):
        return
    if num_blocks == 0:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: {kv_cache_config.num_blocks} KV cache blocks are less than "
            f"one {plan.page_bytes}-byte page per layer",
            hint="give the KV cache more memory (--gpu-memory-utilization or "
            "--kv-cache-memory-bytes)",
        )
    region = num_blocks * cell
    kv_cache_config.kv_cache_tensors = [
        dataclasses.replace(t, layer_stride=region, size=len(t.layers) * region) for t in tensors
    ]
    kv_cache_config.num_blocks = num_blocks
