"""KV-cache geometry: how blocks, layers and buffers sit on physical pages.

One *page id* backs the same blocks in every layer and buffer. Two layouts place those
bytes differently:

``per-layer``
    Each (layer, buffer) pair has its own contiguous virtual range; a block's bytes in one
    range are ``block_bytes`` long and consecutive blocks are adjacent. Page ``p`` is the
    ``p``-th ``page_bytes`` chunk of *every* range, so mapping one page id maps
    ``layers x kv_buffers`` handles of ``page_bytes`` each. Cheap for attention (dense
    per-layer blocks), costly to map.
``compound``
    One virtual range, block-major: block ``b`` of layer ``l``, buffer ``k`` lives at
    ``b * block_stride + (l * kv_buffers + k) * block_bytes`` with
    ``block_stride = layers * kv_buffers * block_bytes``. Page ``p`` is one handle of
    ``page_bytes`` covering ``blocks_per_page`` consecutive blocks of all layers: one map call
    per page id; each per-layer view has a ``layers x kv_buffers`` times larger block stride.

In both layouts a block never straddles a page boundary; ``KVGeometry`` refuses shapes where
it would, naming sizes that work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvcore.errors import GeometryError

Layout = Literal["per-layer", "compound"]
LAYOUTS: tuple[Layout, ...] = ("per-layer", "compound")


@dataclass(frozen=True)
class KVGeometry:
    """The byte geometry of one engine's KV cache.

    ``layout`` defaults to ``compound``: a paged read through its strided views is as fast
    as through plain tensors (the bandwidth comparison in ``docs/benchmarks.md``), so the
    one-handle layout costs attention nothing while a page id maps one handle instead of
    ``layers x kv_buffers``.

    ``block_bytes`` is one block of one layer in one buffer (vLLM: ``block_size`` tokens;
    SGLang: one page of token slots). ``page_bytes`` is the size of one physical handle
    (per (layer, buffer) range for ``per-layer``; spanning all layers for ``compound``) and
    must be a multiple of the backend's ``granularity``; a page id's device memory is
    ``page_device_bytes`` (what ``PageMapper.page_bytes`` reports). ``num_blocks`` is the
    engine's logical capacity; the virtual ranges are rounded up to whole pages.
    """

    num_layers: int
    kv_buffers: int
    block_bytes: int
    num_blocks: int
    page_bytes: int
    granularity: int
    layout: Layout = "compound"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_buffers", "block_bytes", "num_blocks", "page_bytes"):
            if getattr(self, name) <= 0:
                raise GeometryError(
                    f"KV geometry: {name} must be positive, got {getattr(self, name)}"
                )
        if self.layout not in LAYOUTS:
            raise GeometryError(f"KV geometry: layout {self.layout!r} is not one of {LAYOUTS}")
        if self.page_bytes % self.granularity:
            raise GeometryError(
                f"KV geometry: page_bytes={self.page_bytes} is not a multiple of the backend "
                f"granularity {self.granularity}",
                hint=f"use page_bytes={_round_up(self.page_bytes, self.granularity)}",
            )
        if self.page_bytes % self.page_block_bytes:
            raise GeometryError(
                f"KV geometry ({self.layout}): a {self.page_block_bytes}-byte block row would "
                f"straddle a {self.page_bytes}-byte page",
                hint=self._working_sizes_hint(),
            )

    @property
    def page_block_bytes(self) -> int:
        """Bytes one block occupies inside one handle: ``block_bytes`` for ``per-layer``,
        the block across all layers and buffers for ``compound``."""
        if self.layout == "per-layer":
            return self.block_bytes
        return self.block_bytes * self.num_layers * self.kv_buffers

    @property
    def blocks_per_page(self) -> int:
        """Blocks backed by one page id."""
        return self.page_bytes // self.page_block_bytes

    @property
    def num_pages(self) -> int:
        """Page ids needed to cover ``num_blocks`` (the last page may be partly beyond it)."""
        return -(-self.num_blocks // self.blocks_per_page)

    @property
    def handles_per_page(self) -> int:
        """Physical handles one page id maps (``layers x kv_buffers`` for per-layer, 1 for
        compound)."""
        return self.num_layers * self.kv_buffers if self.layout == "per-layer" else 1

    @property
    def page_device_bytes(self) -> int:
        """Device memory one mapped page id costs on one worker."""
        return self.page_bytes * self.handles_per_page

    @property
    def range_bytes(self) -> int:
        """Size of each virtual range (one per (layer, buffer) for per-layer, one in all for
        compound)."""
        return self.num_pages * self.page_bytes

    def page_of(self, block_id: int) -> int:
        """The page id backing ``block_id``."""
        return block_id // self.blocks_per_page

    def blocks_of(self, page_id: int) -> range:
        """The block ids a page id backs (clipped to ``num_blocks``)."""
        first = page_id * self.blocks_per_page
        return range(first, min(first + self.blocks_per_page, self.num_blocks))

    def _working_sizes_hint(self) -> str:
        row = self.page_block_bytes
        page = math.lcm(row, self.granularity)
        hint = f"use page_bytes={page} (a multiple of both the block row and the granularity)"
        per_block = row // self.block_bytes
        if self.page_bytes % per_block == 0:
            unit = self.page_bytes // per_block
            fits = max(_divisors_up_to(unit, self.block_bytes), default=0)
            if fits:
                hint += f", or block_bytes={fits} (tiles the {self.page_bytes}-byte page)"
        return hint


def _divisors_up_to(n: int, limit: int) -> list[int]:
    out: list[int] = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            out.extend(x for x in (d, n // d) if x <= limit)
        d += 1
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
