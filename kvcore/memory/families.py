"""KV layouts of model families beyond MHA/GQA: MLA latents, hybrid attention groups and
Mamba state cells.

``KVGeometry`` places fixed-size blocks on pages. This module decides what one block *holds*
when a model is not plain MHA/GQA, builds the matching geometry, and carves the per-layer
tensors an engine needs out of a ``VirtualKVCache`` built on it.

Vocabulary
    *state*: one per-block tensor of one layer (``StateSpec``: role, shape, dtype).
    *cell*: what one layer stores for one block id: its states packed in order, each at an
    offset aligned to its dtype, optionally padded to ``cell_stride`` (the engine's padded
    per-layer page, vLLM's ``page_size_padded``).
    *group*: ``CacheGroup``, layers of one kind sharing one block size and one block table
    (vLLM's ``KVCacheGroupSpec``).
    *part*: the i-th layer of every group. Groups *overlay* each other: layer i of every
    group lives in part i, at the same bytes. That is sound because a block id belongs to
    one group at a time (vLLM 0.33.0: one ``BlockPool`` shared by every group's
    ``SingleTypeKVCacheManager``; ``KVCacheTensor`` documents the aliasing).
    *row*: one block id's bytes in one virtual range.

Families
    MLA (``mla_group``): one latent state per layer (``kv_buffers = 1``), per-block shape
    ``(block_size, 1, kv_lora_rank + rope_dim)``; a DeepSeek row is 576 x 2 bytes per token.
    Hybrid (``attention_group`` with and without ``sliding_window``, plus any other group):
    several groups, one physical block size; each group gets views of its own cells.
    Mamba / linear attention (``mamba_group``): conv and SSM state of one sequence slot packed
    into one cell; one slot is one block id.

Layouts (``layout=``)
    ``compound``: one virtual range; a row holds parts 0..n-1 back to back, layer i of group
    g at ``i * g.stride`` (vLLM's block-outermost layouts such as ``BLHNC``, exactly as
    ``get_kv_cache_config_from_groups`` places them). Geometry: ``KVGeometry(num_layers=1,
    kv_buffers=1, block_bytes=row_stride, layout="compound")``: one handle per page id. A
    ``state_major`` group instead lays each state out for all its layers together (SGLang
    0.5.23's Mamba slot envelope: ``[conv x layers][ssm x layers]`` per slot).
    ``per-layer``: one virtual range per part, a row is one cell (SGLang's per-layer pools,
    vLLM's layer-outermost layouts). Geometry: ``KVGeometry(num_layers=parts, kv_buffers=1,
    block_bytes=row_stride, layout="per-layer")``. Every group must then have the same cell
    stride (vLLM refuses mixed page sizes in a layer-outermost layout too).

Alignment policy (``plan_rows``). A block never straddles a page, so a page must hold whole
rows. kvcore first tries an *exact* page: ``lcm(row, granularity)`` when that is at most
``max_page_bytes`` (64 MiB by default: a map's driver cost does not grow with the handle's
size, so a larger exact page is preferred to a padded stride). A DeepSeek MLA token row of
1152 bytes takes an 18 MiB page (9 granules, 16384 rows) with no padding. When no exact page
is small enough (61 layers x 64 tokens x 1152 bytes = 4497408 bytes per compound row would
need a 1.07 GiB page) the row *stride* is padded to the
smallest multiple of ``stride_alignment`` that divides a page of at most ``max_page_bytes``,
least padding first (that row: stride 4718592, 4 rows per 18 MiB page, 4.7% padding). The
engine must then address blocks with the padded stride (vLLM: ``block_stride_alignment`` or
``page_size_padded`` on the spec). ``pad=False`` refuses instead, for engines whose tensor
shapes cannot take a padded stride; the ``GeometryError`` names the stride and page that
would work. Padding is never silent: ``RowPlan.padding`` says how much.

Partial tail. ``num_blocks`` need not fill the last page: its rows past ``num_blocks`` are
mapped with the page but no view reaches them, and the block ledger never hands them out.

Block ownership. One ``BlockLedger`` over ``FamilyLayout.geometry`` serves every group (vLLM's
hybrid coordinator draws every group's blocks from its one ``BlockPool``); there is one
``PageAllocator`` and one gate per instance. A page returns to the driver only when no block
on it is allocated, whichever group allocated it.

Prefix caching is the engine's business: vLLM 0.33.0 keys its cache by
``BlockHashWithGroupId`` (``make_block_hash_with_group_id`` appends the group id as 4
big-endian bytes to the block hash), so equal tokens in two groups are two entries with two
block ids, and kvcore sees only the block ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from kvcore.errors import GeometryError, UnsupportedConfiguration
from kvcore.memory.geometry import KVGeometry, Layout

if TYPE_CHECKING:
    from kvcore.memory.virtual_cache import VirtualKVCache

__all__ = [
    "DEFAULT_MAX_PAGE_BYTES",
    "DEFAULT_STRIDE_ALIGNMENT",
    "FAMILIES",
    "CacheGroup",
    "Family",
    "FamilyLayout",
    "Placement",
    "RowPlan",
    "StateSpec",
    "attention_group",
    "mamba_group",
    "mla_group",
    "plan_rows",
]

Family = Literal["attention", "sliding_window", "mla", "mamba"]
FAMILIES: tuple[Family, ...] = ("attention", "sliding_window", "mla", "mamba")

DEFAULT_MAX_PAGE_BYTES = 64 << 20
"""Largest page ``plan_rows`` picks (per handle)."""
DEFAULT_STRIDE_ALIGNMENT = 256
"""A padded row stride is a multiple of this (and of every state's item size)."""


@dataclass(frozen=True)
class StateSpec:
    """One per-block tensor of one layer: ``shape`` elements of ``dtype``."""

    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape or any(d <= 0 for d in shape):
            raise GeometryError(f"state {self.role!r}: shape {shape} must be non-empty, positive")

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the state for one block."""
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class CacheGroup:
    """Layers of one family sharing a block size and a block table.

    ``cell`` is what each layer stores per block id. ``block_size`` is tokens per block
    (Mamba: tokens one state cell stands for; informational). ``cell_stride`` is the
    engine's padded per-layer page (default: the packed cell). ``state_major`` (compound
    rows only) lays out each state for all layers together, ``[conv x layers][ssm x
    layers]`` (SGLang 0.5.23's Mamba slot envelope, ``build_mamba_entry_views``), instead of
    each layer's whole cell together (vLLM). Raises
    ``UnsupportedConfiguration`` for a kind kvcore has no layout for, an MLA group with more
    than one state or a sliding window on another kind; ``GeometryError`` for sizes.
    """

    kind: Family
    layers: tuple[str, ...]
    cell: tuple[StateSpec, ...]
    block_size: int
    sliding_window: int | None = None
    cell_stride: int | None = None
    state_major: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "cell", tuple(self.cell))
        if self.kind not in FAMILIES:
            raise UnsupportedConfiguration(
                f"KV cache group of kind {self.kind!r}: kvcore has layouts for {FAMILIES}",
                hint="serve the model without elastic KV, or add a layout for this family",
            )
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise GeometryError(f"{self.kind} group: layers {self.layers} must be unique, >= 1")
        roles = [s.role for s in self.cell]
        if not roles or len(set(roles)) != len(roles):
            raise GeometryError(f"{self.kind} group: cell roles {roles} must be unique, >= 1")
        if self.block_size <= 0:
            raise GeometryError(f"{self.kind} group: block_size={self.block_size} <= 0")
        if self.kind == "mla" and len(self.cell) != 1:
            raise UnsupportedConfiguration(
                f"MLA group with {len(self.cell)} states {roles}: kvcore's MLA layout holds "
                "one latent buffer per layer (kv_buffers = 1)",
                hint="describe the latent (kv_lora_rank + rope dims) as one state",
            )
        if (self.sliding_window is not None) != (self.kind == "sliding_window"):
            raise UnsupportedConfiguration(
                f"{self.kind} group with sliding_window={self.sliding_window}: a window "
                "belongs to (and is required by) a 'sliding_window' group",
                hint="use kind='sliding_window' with a positive window",
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise GeometryError(f"sliding_window={self.sliding_window} must be positive")
        if self.state_major and self.cell_stride is not None:
            raise UnsupportedConfiguration(
                f"{self.kind} group: a padded cell_stride={self.cell_stride} with a "
                "state-major row (states are not grouped by layer, so no cell is padded)",
                hint="drop cell_stride or state_major",
            )
        packed = self.cell_bytes
        if self.cell_stride is not None and (
            self.cell_stride < packed or self.cell_stride % self.alignment
        ):
            raise GeometryError(
                f"{self.kind} group: cell_stride={self.cell_stride} is smaller than the "
                f"{packed}-byte cell or not a multiple of {self.alignment}",
                hint=f"use cell_stride >= {_round_up(packed, self.alignment)}",
            )

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each state in the cell (each aligned to its item size)."""
        out: list[int] = []
        end = 0
        for s in self.cell:
            off = _round_up(end, s.itemsize)
            out.append(off)
            end = off + s.nbytes
        return tuple(out)

    @property
    def cell_bytes(self) -> int:
        """Packed bytes of one cell (no trailing padding)."""
        return self.offsets[-1] + self.cell[-1].nbytes

    @property
    def alignment(self) -> int:
        """The largest item size of the cell's states."""
        return max(s.itemsize for s in self.cell)

    @property
    def stride(self) -> int:
        """Bytes one layer's cell occupies in a row (``cell_stride`` or the packed cell)."""
        return self.cell_stride if self.cell_stride is not None else self.cell_bytes

    def row_offsets(self) -> tuple[int, dict[tuple[int, str], int]]:
        """In a compound row: the bytes this group uses and the offset of each
        ``(layer index, role)``. Layer-major: layer i's cell at ``i * stride``; state-major:
        state k of every layer back to back, each region aligned to its item size."""
        n = len(self.layers)
        if not self.state_major:
            out = {
                (i, st.role): i * self.stride + off
                for i in range(n)
                for st, off in zip(self.cell, self.offsets, strict=True)
            }
            return n * self.stride, out
        out = {}
        end = 0
        for st in self.cell:
            base = _round_up(end, st.itemsize)
            for i in range(n):
                out[i, st.role] = base + i * st.nbytes
            end = base + n * st.nbytes
        return end, out


def attention_group(
    layers: Sequence[str],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    head_size_v: int | None = None,
    sliding_window: int | None = None,
    cell_stride: int | None = None,
) -> CacheGroup:
    """An MHA/GQA group (``sliding_window`` set: a sliding-window group). Its one state
    ``kv`` has vLLM's logical page shape ``(num_kv_heads, block_size, head_size +
    head_size_v)`` (K then V of each token, as in the ``BLHNC`` layout)."""
    hv = head_size if head_size_v is None else head_size_v
    state = StateSpec("kv", (num_kv_heads, block_size, head_size + hv), dtype)
    kind: Family = "attention" if sliding_window is None else "sliding_window"
    return CacheGroup(kind, tuple(layers), (state,), block_size, sliding_window, cell_stride)


def mla_group(
    layers: Sequence[str],
    *,
    block_size: int,
    latent_dim: int,
    dtype: torch.dtype,
    cell_stride: int | None = None,
) -> CacheGroup:
    """An MLA group: one ``latent`` state of shape ``(block_size, 1, latent_dim)`` per layer
    (DeepSeek: ``latent_dim = kv_lora_rank + qk_rope_head_dim = 512 + 64``)."""
    state = StateSpec("latent", (block_size, 1, latent_dim), dtype)
    return CacheGroup("mla", tuple(layers), (state,), block_size, None, cell_stride)


def mamba_group(
    layers: Sequence[str],
    *,
    states: Iterable[tuple[str, Sequence[int], torch.dtype]],
    block_size: int = 1,
    cell_stride: int | None = None,
    state_major: bool = False,
) -> CacheGroup:
    """A Mamba / linear-attention group: ``states`` (e.g. ``("conv", (conv_dim, k - 1),
    bf16), ("ssm", (heads, head_dim, d_state), f32)``) packed into one cell per slot
    (``state_major``: see ``CacheGroup``)."""
    cell = tuple(StateSpec(role, tuple(shape), dtype) for role, shape, dtype in states)
    return CacheGroup("mamba", tuple(layers), cell, block_size, None, cell_stride, state_major)


# -- rows on pages --------------------------------------------------------------------------


@dataclass(frozen=True)
class RowPlan:
    """How rows of ``row_bytes`` sit on pages: ``row_stride`` bytes apart (``>= row_bytes``),
    ``page_bytes`` per handle, a whole number of rows per page."""

    row_bytes: int
    row_stride: int
    page_bytes: int

    @property
    def rows_per_page(self) -> int:
        """Rows (block ids) one page holds."""
        return self.page_bytes // self.row_stride

    @property
    def padding(self) -> float:
        """Fraction of each row stride that is padding."""
        return (self.row_stride - self.row_bytes) / self.row_stride


def plan_rows(
    row_bytes: int,
    granularity: int,
    *,
    pad: bool = True,
    max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
    stride_alignment: int = DEFAULT_STRIDE_ALIGNMENT,
    page_bytes: int | None = None,
) -> RowPlan:
    """Pick the row stride and page size for rows of ``row_bytes`` (module doc: exact page
    first, else the least-padded stride; ``page_bytes`` fixes the page).

    Raises ``GeometryError`` when no page of at most ``max_page_bytes`` holds one row, or
    when ``pad=False`` and no exact page fits; the hint names a plan that works."""
    if row_bytes <= 0 or granularity <= 0:
        raise GeometryError(f"row_bytes={row_bytes} and granularity={granularity} must be > 0")
    if page_bytes is not None:
        if page_bytes <= 0 or page_bytes % granularity:
            raise GeometryError(
                f"page_bytes={page_bytes} is not a positive multiple of the granularity "
                f"{granularity}",
                hint=f"use page_bytes={_round_up(max(page_bytes, 1), granularity)}",
            )
        pages = [page_bytes]
    else:
        pages = list(range(granularity, max(max_page_bytes, granularity) + 1, granularity))
    exact = math.lcm(row_bytes, granularity)
    if page_bytes is None and exact <= pages[-1]:
        return RowPlan(row_bytes, row_bytes, exact)
    if page_bytes is not None and page_bytes % row_bytes == 0:
        return RowPlan(row_bytes, row_bytes, page_bytes)
    best = _least_padded(row_bytes, pages, stride_alignment)
    if best is None:
        largest = pages[-1]
        raise GeometryError(
            f"a {row_bytes}-byte KV row does not fit a page of at most {largest} bytes",
            hint=f"allow pages of {_round_up(row_bytes, granularity)} bytes (max_page_bytes), "
            "or fewer layers per row (layout='per-layer')",
        )
    if not pad:
        raise GeometryError(
            f"a {row_bytes}-byte KV row tiles no page of at most {pages[-1]} bytes exactly "
            f"(an exact page would be {exact} bytes)",
            hint=f"pad the engine's block stride to {best.row_stride} bytes ({best.rows_per_page}"
            f" rows per {best.page_bytes}-byte page, {best.padding:.1%} padding) and pass "
            "pad=True, or allow max_page_bytes >= " + str(exact),
        )
    return best


def _least_padded(row: int, pages: Sequence[int], alignment: int) -> RowPlan | None:
    """The stride ``>= row``, a multiple of ``alignment``, dividing one of ``pages``, with the
    least padding (ties: the smaller page)."""
    best: RowPlan | None = None
    for page in pages:
        stride = min(
            (d for d in _divisors(page) if d >= row and d % alignment == 0),
            default=None,
        )
        if stride is not None and (best is None or stride < best.row_stride):
            best = RowPlan(row, stride, page)
    return best


def _divisors(n: int) -> list[int]:
    small: list[int] = []
    large: list[int] = []
    d = 1
    # pages are k * granularity: strip the power of two first so the loop stays short
    twos = (n & -n).bit_length() - 1
    odd = n >> twos
    while d * d <= odd:
        if odd % d == 0:
            small.append(d)
            if d * d != odd:
                large.append(odd // d)
        d += 1
    return sorted(o << t for o in small + large for t in range(twos + 1))


# -- the layout -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one layer's state sits: range ``part`` (always 0 for compound), ``offset`` bytes
    into each row."""

    group: int
    layer: str
    role: str
    part: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class FamilyLayout:
    """The rows, geometry and placements of a model's KV cache groups (module doc).

    ``groups`` in the engine's group order (their index is the group id). ``num_blocks`` is
    the engine's block (or slot) count; ``granularity`` the backend's. ``pad``,
    ``max_page_bytes``, ``stride_alignment`` and ``page_bytes`` go to ``plan_rows``.
    ``row_bytes``: the engine's own row when it is wider than the groups' (vLLM rounds its
    block stride up to every spec's ``block_stride_alignment``); ``plan_rows`` starts from it.
    Raises ``UnsupportedConfiguration`` for a layer in two groups or a per-layer layout with
    mixed cell strides; ``GeometryError`` when no page can hold a row or ``row_bytes`` is
    narrower than the groups' row.
    """

    def __init__(
        self,
        groups: Sequence[CacheGroup],
        *,
        num_blocks: int,
        granularity: int,
        layout: Layout = "compound",
        pad: bool = True,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        stride_alignment: int = DEFAULT_STRIDE_ALIGNMENT,
        page_bytes: int | None = None,
        row_bytes: int | None = None,
    ) -> None:
        self.groups = tuple(groups)
        if not self.groups:
            raise GeometryError("a KV layout needs at least one cache group")
        seen: dict[str, int] = {}
        for gid, group in enumerate(self.groups):
            for layer in group.layers:
                if layer in seen:
                    raise UnsupportedConfiguration(
                        f"layer {layer!r} is in KV cache groups {seen[layer]} and {gid}",
                        hint="each layer belongs to exactly one group",
                    )
                seen[layer] = gid
        self._group_of = seen
        self.layout: Layout = layout
        self.parts = max(len(g.layers) for g in self.groups)
        strides = {g.stride for g in self.groups}
        if layout == "per-layer" and len(strides) > 1:
            shown = ", ".join(f"group {i} ({g.kind}): {g.stride}" for i, g in enumerate(groups))
            raise UnsupportedConfiguration(
                f"per-layer KV layout with mixed cell strides ({shown}): groups overlay each "
                "other part by part and need one cell stride",
                hint="use layout='compound' (vLLM: a block-outermost layout such as BLHNC), "
                "or pad every group's cell to the largest stride",
            )
        rows = [g.row_offsets() for g in self.groups]
        row = max(strides) if layout == "per-layer" else max(used for used, _ in rows)
        if row_bytes is not None:
            if row_bytes < row:
                raise GeometryError(
                    f"row_bytes={row_bytes} is narrower than the groups' {row}-byte row",
                    hint=f"pass row_bytes >= {row} (the engine's block stride)",
                )
            row = row_bytes
        align = math.lcm(stride_alignment, *(g.alignment for g in self.groups))
        self.plan = plan_rows(
            row,
            granularity,
            pad=pad,
            max_page_bytes=max_page_bytes,
            stride_alignment=align,
            page_bytes=page_bytes,
        )
        self.geometry = KVGeometry(
            num_layers=1 if layout == "compound" else self.parts,
            kv_buffers=1,
            block_bytes=self.plan.row_stride,
            num_blocks=num_blocks,
            page_bytes=self.plan.page_bytes,
            granularity=granularity,
            layout=layout,
        )
        self._placements: dict[tuple[str, str], Placement] = {}
        for gid, (group, (_, in_row)) in enumerate(zip(self.groups, rows, strict=True)):
            for i, layer in enumerate(group.layers):
                for state, off in zip(group.cell, group.offsets, strict=True):
                    self._placements[layer, state.role] = Placement(
                        group=gid,
                        layer=layer,
                        role=state.role,
                        part=i if layout == "per-layer" else 0,
                        offset=off if layout == "per-layer" else in_row[i, state.role],
                        shape=state.shape,
                        dtype=state.dtype,
                    )

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Every (layer, state) placement, group by group, layer by layer."""
        return tuple(self._placements.values())

    def group_of(self, layer: str) -> int:
        """The group id of ``layer`` (``KeyError`` if unknown)."""
        return self._group_of[layer]

    def place(self, layer: str, role: str) -> Placement:
        """Where ``role`` of ``layer`` sits; ``KeyError`` names the known roles."""
        try:
            return self._placements[layer, role]
        except KeyError:
            roles = sorted(r for (ly, r) in self._placements if ly == layer)
            raise KeyError(f"no state {role!r} for layer {layer!r} (has: {roles})") from None

    def view(self, cache: VirtualKVCache, layer: str, role: str) -> torch.Tensor:
        """The ``(num_blocks, *shape)`` tensor of ``role`` of ``layer`` in ``cache`` (built
        on ``self.geometry``). A view of the cache's stable base: its data pointer never
        changes while the cache lives; unbacked blocks read as zeros."""
        if cache.geometry != self.geometry:
            raise GeometryError(
                f"the cache's geometry {cache.geometry} is not this layout's {self.geometry}",
                hint="build the VirtualKVCache from FamilyLayout.geometry",
            )
        p = self.place(layer, role)
        nbytes = math.prod(p.shape) * _itemsize(p.dtype)
        rows = cache.view(p.part, 0, torch.uint8)  # (num_blocks, row_stride), stable base
        cut = rows[:, p.offset : p.offset + nbytes]
        return cut.view(p.dtype).unflatten(1, p.shape)

    def views(self, cache: VirtualKVCache) -> dict[tuple[str, str], torch.Tensor]:
        """``view`` of every placement, keyed by ``(layer, role)``."""
        return {key: self.view(cache, *key) for key in self._placements}


def _itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty(0, dtype=dtype).element_size())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
