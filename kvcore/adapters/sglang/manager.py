"""One SGLang KV pool's elastic memory on one TP rank: backend, virtual tensor, pages, ledger.

``ElasticKVManager`` owns the whole kvcore object chain for one pool (DESIGN.md section 3):
the VMM backend, a per-layer ``VirtualKVCache`` whose views become the pool's K/V (or MLA
latent) buffers, a ``LocalPageMapper``, a ``PageAllocator`` gated by the rank's budget and
the ``BlockLedger`` the elastic allocators draw from. Each TP rank builds its own manager in
its own process: page operations are local and never sent to peers.

Block ids are SGLang page ids (token ids when ``page_size == 1``): block ``b`` holds token
rows ``b * page_size .. (b + 1) * page_size - 1`` of every layer. Block 0 is SGLang's padded
page (dummy writes of padded tokens land there), so it is reserved and stays backed.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from kvcore.budget.gate import MemoryGate
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.families import plan_rows
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator, PageStats
from kvcore.memory.teardown import CloseOnce, close_parts
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.vmm import open_backend

if TYPE_CHECKING:
    from kvcore.adapters.config import ElasticConfig
    from kvcore.budget.shared_gate import SharedGate
    from kvcore.vmm.base import VmmBackend

__all__ = ["ElasticKVManager"]

log = logging.getLogger(__name__)


class ElasticKVManager:
    """kvcore memory behind one SGLang KV pool (module docstring).

    ``num_rows`` token rows of ``row_bytes`` bytes in each of ``num_layers x kv_buffers``
    buffers, handed out in blocks of ``page_size`` rows. ``name`` is this rank's instance
    name in the per-GPU ledger (with ``config.gpu_ledger``). ``gate``: the rank's
    ``SharedGate`` when several pools share one budget (the manager takes a share and leaves
    it on close); ``None`` opens a gate of its own. Raises ``GeometryError`` when the
    physical page cannot hold whole blocks, ``BackendUnavailable``/``VmmError`` when the
    backend cannot be opened or reserve the ranges, ``PoolFailed`` when block 0's page
    cannot be mapped; nothing is left reserved or mapped on failure.
    """

    def __init__(
        self,
        config: ElasticConfig,
        *,
        num_layers: int,
        kv_buffers: int,
        row_bytes: int,
        page_size: int,
        num_rows: int,
        device_index: int = 0,
        backend: VmmBackend | None = None,
        name: str = "sglang",
        gate: SharedGate | None = None,
    ) -> None:
        self.config = config
        self.page_size = page_size
        self.num_rows = num_rows
        self._once = CloseOnce()
        self.backend = backend or open_backend(
            config.backend, device_index, **dict(config.backend_options)
        )
        self._owns_backend = backend is None
        self.cache: VirtualKVCache | None = None
        self.mapper: LocalPageMapper | None = None
        try:
            gran = self.backend.granularity()
            block_bytes = page_size * row_bytes
            # SGLang indexes token rows with one uniform stride: no padded block stride
            plan = plan_rows(block_bytes, gran, pad=False, page_bytes=config.page_bytes)
            self.geometry = KVGeometry(
                num_layers=num_layers,
                kv_buffers=kv_buffers,
                block_bytes=block_bytes,
                num_blocks=math.ceil(num_rows / page_size),
                page_bytes=plan.page_bytes,
                granularity=gran,
                layout="per-layer",  # SGLang indexes token rows with one uniform stride
            )
            self.cache = VirtualKVCache(self.backend, self.geometry, sanity=config.sanity)
            self.mapper = LocalPageMapper(self.cache)
            self.gate: MemoryGate = (
                self._gate(config, name)
                if gate is None
                else gate.join(lambda: self._gate(config, name))
            )
            self.pages = PageAllocator(
                self.mapper,
                self.gate,
                reserve_min=min(config.reserve_min, self.geometry.num_pages),
                reserve_max=min(config.reserve_max, self.geometry.num_pages),
            )
            self.ledger = BlockLedger(self.geometry, self.pages, reserved_blocks=(0,))
        except BaseException:
            self._teardown()
            raise
        log.info(
            "kvcore: elastic KV pool of %d blocks (%d tokens each) on %d pages of %d bytes "
            "(%s backend, limit %s)",
            self.geometry.num_blocks,
            page_size,
            self.geometry.num_pages,
            self.geometry.page_device_bytes,
            self.backend.name,
            config.limit_bytes,
        )

    @property
    def num_blocks(self) -> int:
        """Block ids ``0 .. num_blocks - 1`` (block 0 reserved)."""
        return self.geometry.num_blocks

    def buffer(
        self, layer: int, buffer: int, dtype: torch.dtype, row_shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The ``(num_rows, *row_shape)`` tensor of ``(layer, buffer)`` at a stable address:
        token row ``t`` lives in block ``t // page_size``. Unbacked rows read as zeros."""
        assert self.cache is not None
        view = self.cache.view(layer, buffer, dtype, block_shape=(self.page_size, *row_shape))
        return view.reshape(-1, *row_shape)[: self.num_rows]

    def _gate(self, config: ElasticConfig, name: str) -> MemoryGate:
        import sglang

        return config.make_gate(
            self.backend, name=name, engine="sglang", engine_version=str(sglang.__version__)
        )

    def stats(self) -> PageStats:
        """The page allocator's snapshot (mapped, in use, reserved, misses, ...)."""
        return self.pages.stats()

    def close(self) -> None:
        """Unmap every page and free the virtual ranges (the engine is going away), then
        leave the gate (and close the backend when this manager opened it). Idempotent;
        buffers handed out must not be used afterwards. Every part is released even when an
        earlier one fails; the first failure is raised after."""
        if self._once.begin():
            self._teardown()

    def _teardown(self) -> None:
        parts: list[tuple[str, object]] = [
            ("block ledger", getattr(self, "ledger", None)),
            ("page allocator", getattr(self, "pages", None)),
            ("mapper", self.mapper),
            ("virtual KV cache", self.cache),
            ("memory gate", getattr(self, "gate", None)),
        ]
        if self._owns_backend:
            parts.append((f"{self.backend.name} backend", self.backend))
        close_parts(parts, on_error="raise")
