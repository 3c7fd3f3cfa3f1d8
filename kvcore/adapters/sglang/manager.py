"""One SGLang KV pool's elastic memory on one TP rank: backend, virtual tensor, pages, ledger.

``ElasticKVManager`` owns the whole kvcore object chain for one pool
(``kvcore.memory.chain.MemoryChain``): the VMM backend, a per-layer ``VirtualKVCache`` whose
views become the pool's K/V (or MLA latent) buffers, a ``LocalPageMapper``, a
``PageAllocator`` gated by the rank's budget and the ``BlockLedger`` the elastic allocators
draw from. Each TP rank builds its own manager in
its own process: page operations are local and never sent to peers.

Block ids are SGLang page ids (token ids when ``page_size == 1``): block ``b`` holds token
rows ``b * page_size .. (b + 1) * page_size - 1`` of every layer. Block 0 is SGLang's padded
page (dummy writes of padded tokens land there), so it is reserved and stays backed.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING

import torch

from kvcore.adapters.gates import open_gate
from kvcore.budget.gate import MemoryGate
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.chain import MemoryChain, block_ledger
from kvcore.memory.families import plan_rows
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.pages import PageAllocator, PageStats
from kvcore.memory.teardown import CloseOnce
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

        def plan(backend: VmmBackend | None) -> KVGeometry:
            assert backend is not None
            gran = backend.granularity()
            block_bytes = page_size * row_bytes
            # SGLang indexes token rows with one uniform stride: no padded block stride
            rows = plan_rows(block_bytes, gran, pad=False, page_bytes=config.page_bytes)
            return KVGeometry(
                num_layers=num_layers,
                kv_buffers=kv_buffers,
                block_bytes=block_bytes,
                num_blocks=math.ceil(num_rows / page_size),
                page_bytes=rows.page_bytes,
                granularity=gran,
                layout="per-layer",
            )

        def gate_of(backend: VmmBackend | None, _geometry: KVGeometry) -> MemoryGate:
            assert backend is not None
            make = functools.partial(_open_gate, config, backend, name)
            return make() if gate is None else gate.join(make)

        self.chain = MemoryChain.build(
            plan,
            backend=backend,
            open_backend=functools.partial(
                open_backend, config.backend, device_index, **dict(config.backend_options)
            ),
            owns_backend=backend is None,
            open_gate=gate_of,
            # the allocators move ids through tensors (alloc_split, free_tensor)
            ledger=block_ledger((0,), array_stacks=True),
            sanity=config.sanity,
            reserve_min=config.reserve_min,
            reserve_max=config.reserve_max,
            map_ahead=config.map_ahead,
            switch_interval=config.background_switch_s,
        )
        chain = self.chain
        assert chain.backend is not None and chain.gate is not None
        assert chain.pages is not None and chain.ledger is not None
        self.backend: VmmBackend = chain.backend
        self.geometry = chain.geometry
        self.cache = chain.cache
        self.mapper = chain.mapper
        self.gate: MemoryGate = chain.gate
        self.pages: PageAllocator = chain.pages
        self.ledger: BlockLedger = chain.ledger
        st = self.pages.stats()  # page work counts from here (the pinned page is mapped)
        self._page_work = (st.caller_mapper_calls, st.refill_mapper_calls, st.misses)
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
        """Block ids ``0 .. num_blocks - 1`` (block 0 pinned)."""
        return self.geometry.num_blocks

    def buffer(
        self, layer: int, buffer: int, dtype: torch.dtype, row_shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The ``(num_rows, *row_shape)`` tensor of ``(layer, buffer)`` at a stable address:
        token row ``t`` lives in block ``t // page_size``. Unbacked rows read as zeros."""
        assert self.cache is not None
        view = self.cache.view(layer, buffer, dtype, block_shape=(self.page_size, *row_shape))
        return view.reshape(-1, *row_shape)[: self.num_rows]

    def stats(self) -> PageStats:
        """The page allocator's snapshot (mapped, in use, reserved, misses, ...)."""
        return self.pages.stats()

    def log_page_work(self, moment: str) -> None:
        """Log at INFO what the page allocator did since the last such report (or start-up):
        mapper calls on the scheduler's thread and in background rounds, and misses; nothing
        when it did nothing. ``moment`` names the report's occasion (the allocator reports at
        each cache clear, SGLang's ``/flush_cache``; the manager at shutdown), so a serving
        run between two flushes has its own figures in the log."""
        st = self.pages.stats()
        now = (st.caller_mapper_calls, st.refill_mapper_calls, st.misses)
        caller, background, misses = (a - b for a, b in zip(now, self._page_work, strict=True))
        self._page_work = now
        if caller or background or misses:
            log.info(
                "kvcore: page work since the last report (%s): mapper calls %d on the "
                "scheduler's thread and %d in the background, %d misses; %d of %d pages mapped",
                moment,
                caller,
                background,
                misses,
                st.mapped,
                st.num_pages,
            )

    def report_unbudgeted_miss(self, asked: int) -> None:
        """Log at ERROR that an allocation of ``asked`` blocks missed on a pool without a
        budget. The allocators call it on such a miss: there ``available_size()`` reports the
        logical free count, so SGLang admitted work the device then had no memory for (or
        the driver refused a page), and SGLang fails the allocation with its own "Out of
        memory" error. The message says why and which setting prevents it."""
        st = self.pages.stats()
        log.error(
            "kvcore: the device refused this elastic pool a page (%d blocks asked; %d of %d "
            "pages mapped, %d misses so far): out of device memory, most likely taken by "
            "other processes on the GPU. No budget is set, so SGLang's free count did not "
            "see it coming and SGLang fails the allocation. Share one GPU between elastic "
            "servers with --kvcore-config gpu_ledger, or cap this pool beside other "
            "programs with limit_bytes: under a budget SGLang waits or retracts instead",
            asked,
            st.mapped,
            st.num_pages,
            st.misses,
        )

    def close(self) -> None:
        """Unmap every page and free the virtual ranges (the engine is going away), then
        leave the gate (and close the backend when this manager opened it). Idempotent;
        buffers handed out must not be used afterwards. Every part is released even when an
        earlier one fails; the first failure is raised after."""
        if self._once.begin():
            self.log_page_work("shutdown")
            self.chain.close(on_error="raise")


def _open_gate(config: ElasticConfig, backend: VmmBackend, name: str) -> MemoryGate:
    """The gate ``config`` describes for this rank's instance ``name``."""
    import sglang

    return open_gate(
        config,
        name=name,
        engine="sglang",
        engine_version=str(sglang.__version__),
        backend=backend,
    )
