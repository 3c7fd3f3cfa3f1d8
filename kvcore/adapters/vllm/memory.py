"""The kvcore object chain behind one vLLM KV cache in one process.

``ElasticKVMemory(config, kv_cache_config)`` (``config``: the parsed ``--kvcore-config``,
``kvcore.adapters.config.ElasticConfig``) owns, for one process, the VMM backend, a
``VirtualKVCache`` on the model-family layout of vLLM's ``KVCacheConfig``
(``groups.family_layout``: in a block-outermost layout block ``b`` of every layer of every
group is row ``b``, as wide as vLLM's block stride; in a layer-outermost one each layer is a
range of its own, the ranges back to back as vLLM's layer regions are), its
``LocalPageMapper``, a ``PageAllocator`` gated by ``limit_bytes`` (or, with ``gpu_ledger``,
by this instance's record in the per-GPU ledger, which is how two engines share one GPU's
budget; or by a ``MemoryGate`` the embedding process passes as ``gate=``) and the
``BlockLedger`` the elastic block pool draws from. Block 0 is
vLLM's null block: reserved, its page stays backed. The ledger is a ``FencedBlockLedger``:
with overlapping batches (``release_fence``) its ``fence`` keeps a page emptied behind a batch
in flight mapped until that batch is done (``kvcore.adapters.vllm.fence``).

``close()`` is the clean shutdown: every page unmapped, the range freed, the gate closed (with
``gpu_ledger``: this instance's record removed from the per-GPU ledger). A step that fails
does not stop the rest; the first failure is raised at the end.

``KVMemory`` is what the elastic block pool and the runtime see of a vLLM KV memory, whatever
holds its pages: this module's ``ElasticKVMemory`` (one process) and
``kvcore.adapters.vllm.parallel.ChannelKVMemory`` (every TP x PP rank over a channel) both
derive from it. Both build their parts with ``kvcore.memory.chain.MemoryChain``, as SGLang's
adapter does.

``engine_options`` reads ``KVCacheConfig.kvcore`` back into the ``ElasticConfig`` and the
``RELEASE_FENCE`` flag the engine core adds beside the options; the one-process and the
TP x PP side both read it here.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.gates import open_gate
from kvcore.adapters.vllm.checks import resolved_reclaim
from kvcore.adapters.vllm.fence import FencedBlockLedger, StepFence, fenced_ledger
from kvcore.adapters.vllm.groups import family_layout
from kvcore.budget.gate import MemoryGate
from kvcore.errors import KvcoreError
from kvcore.memory.chain import MemoryChain
from kvcore.memory.families import FamilyLayout
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.pages import PageAllocator, PageStats
from kvcore.memory.teardown import CloseOnce, PartFailure
from kvcore.vmm import open_backend
from kvcore.vmm.base import VmmBackend

__all__ = [
    "RELEASE_FENCE",
    "ElasticKVMemory",
    "KVMemory",
    "engine_options",
    "give_back_for",
    "settings_dict",
]

log = logging.getLogger(__name__)

RELEASE_FENCE = "release_fence"
"""The ``KVCacheConfig.kvcore`` key (vLLM-side, not an ``ElasticConfig`` option) saying the
engine runs overlapping batches, so freed pages wait behind ``fence.StepFence``."""


def settings_dict(config: ElasticConfig) -> dict[str, Any]:
    """``config`` as plain JSON-able data (it travels inside ``KVCacheConfig``)."""
    out = asdict(config)
    out["backend_options"] = dict(config.backend_options)
    return out


def engine_options(settings: Mapping[str, Any] | None) -> tuple[ElasticConfig, bool]:
    """``KVCacheConfig.kvcore`` (without the TP x PP entry) as the ``ElasticConfig`` and the
    ``RELEASE_FENCE`` flag. Raises ``UnsupportedConfiguration`` for any other unknown key."""
    options = dict(settings or {})
    release_fence = bool(options.pop(RELEASE_FENCE, False))
    return ElasticConfig.parse(options), release_fence


class KVMemory:
    """The seams a vLLM KV memory offers its block pool and the runtime (module docstring):
    ``stats()``, ``closed`` and ``on_close``. A subclass sets ``pages`` once its page
    allocator exists, and its ``close()`` releases its parts only when ``self._once.begin()``
    returns ``True`` (``kvcore.memory.teardown.CloseOnce``: once, after the ``on_close``
    callbacks)."""

    def __init__(self) -> None:
        self.pages: PageAllocator | None = None
        self._once = CloseOnce()

    def stats(self) -> PageStats:
        """The page allocator's snapshot (pages mapped, in use, reserved, misses, ...)."""
        assert self.pages is not None
        return self.pages.stats()

    @property
    def closed(self) -> bool:
        """``close()`` was called: nothing may use this memory any more."""
        return self._once.closed

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, when ``close()`` starts (a registry forgetting this
        memory; a failing callback is logged); at once if it is closed already."""
        self._once.on_close(callback)

    def close(self) -> None:
        """Release every part (the subclass's); idempotent."""
        raise NotImplementedError


class ElasticKVMemory(KVMemory):
    """kvcore memory behind one vLLM KV cache in this process (module docstring).

    Raises ``BackendUnavailable``/``VmmError`` when the backend cannot be opened or cannot
    reserve the range, ``UnsupportedConfiguration`` for a KV cache kvcore has no layout for,
    ``GeometryError`` when a page cannot hold whole rows (its hint names sizes that work; a
    config with tensors is never padded here: ``groups.pad_for_pages`` did that in the engine
    core), ``PoolFailed`` when the null block's page cannot be mapped; nothing is
    left reserved or mapped on failure.

    ``layout``: the ``kvcore.memory.families.FamilyLayout`` the memory is built on (its
    ``geometry``; ``layout.view(memory.cache, layer, role)`` is one layer's state, aliasing
    the views vLLM builds over ``buffer()``).

    ``gate``: the memory gate to charge instead of the one ``config`` describes
    (``limit_bytes`` / ``gpu_ledger``), for a process that owns the budget policy itself
    (a harness running several engines, a custom release policy through ``reserve_target``).
    The memory takes it over: ``close()`` closes it (if it has ``close``), also on a failed
    start. ``backend``: an open VMM backend to use instead of opening ``config.backend``
    (fault injection; a harness sharing one host device), taken over and closed the same
    way. ``release_fence``: enable the ledger's step fence (vLLM runs overlapping batches).
    """

    def __init__(
        self,
        config: ElasticConfig,
        kv_cache_config: Any,
        *,
        device_index: int = 0,
        gate: MemoryGate | None = None,
        backend: VmmBackend | None = None,
        release_fence: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.layout: FamilyLayout

        def plan(backend: VmmBackend | None) -> KVGeometry:
            assert backend is not None
            self.layout = family_layout(
                kv_cache_config,
                backend.granularity(),
                page_bytes=config.page_bytes,
                pad=not kv_cache_config.kv_cache_tensors,  # nothing views kvcore's rows
            )
            return self.layout.geometry

        self.chain = MemoryChain.build(
            plan,
            backend=backend,
            open_backend=functools.partial(
                open_backend, config.backend, device_index, **dict(config.backend_options)
            ),
            gate=gate,
            open_gate=functools.partial(_open_gate, config),
            ledger=fenced_ledger(release_fence=release_fence),
            sanity=config.sanity,
            contiguous=True,  # per-layer: vLLM views one buffer, a region per layer
            reserve_min=config.reserve_min,
            reserve_max=config.reserve_max,
            map_ahead=config.map_ahead,
            switch_interval=config.background_switch_s,
        )
        chain = self.chain
        assert chain.backend is not None and chain.gate is not None
        assert isinstance(chain.ledger, FencedBlockLedger)
        self.backend: VmmBackend = chain.backend
        self.geometry = chain.geometry
        self.cache = chain.cache
        self.mapper = chain.mapper
        self.gate: MemoryGate = chain.gate
        self.pages = chain.pages
        self.ledger: FencedBlockLedger = chain.ledger
        self.fence: StepFence = chain.ledger.fence
        g = self.geometry
        num_blocks, block_bytes = g.num_blocks, g.block_bytes * g.num_layers * g.kv_buffers
        log.info(
            "kvcore: elastic KV cache of %d blocks (%d bytes each; logical capacity %d bytes) "
            "on %d pages of %d bytes, %s layout (%s backend, physical limit %s, gpu_ledger %s)",
            num_blocks,
            block_bytes,
            num_blocks * block_bytes,
            self.geometry.num_pages,
            self.geometry.page_device_bytes,
            self.geometry.layout,
            self.backend.name,
            "none" if config.limit_bytes is None else config.limit_bytes,
            config.gpu_ledger,
        )

    def buffer(self) -> torch.Tensor:
        """The flat ``int8`` tensor vLLM's ``allocate_kv_cache`` views, at a stable address
        (unbacked blocks read as zeros): ``num_blocks`` rows (compound), or one region of
        ``num_blocks`` cells per layer (per-layer), ``num_blocks * block_bytes`` bytes each."""
        assert self.cache is not None
        g = self.geometry
        return self.cache.flat(torch.int8)[: g.num_layers * g.num_blocks * g.block_bytes]

    def close(self) -> None:
        """The clean shutdown. Releases, in order: the page allocator (every page unmapped,
        the gate's charge settled), the mapper's handles, the virtual range, the gate (with
        ``gpu_ledger``: this instance's record removed from the per-GPU ledger), the backend.
        Idempotent; buffers must not be used after.

        A step that fails is logged and the rest still runs, so one failed unmap never keeps
        the ledger record or the other pages; then ``KvcoreError`` is raised naming the steps
        that failed (the first failure as its cause). The memory is closed either way."""
        if self._once.begin():
            self._log_page_work()
            self.chain.close(on_error=_shutdown_error)

    def _log_page_work(self) -> None:
        """What the page allocator did over the engine's life, at INFO: how the mapping work
        split between the scheduler's thread and the background one, and the misses."""
        if self.pages is None:
            return
        stats = self.pages.stats()
        log.info(
            "kvcore: page allocator at shutdown: %d of %d pages mapped, mapper calls %d on "
            "the scheduler's thread and %d in the background, %d misses",
            stats.mapped,
            stats.num_pages,
            stats.caller_mapper_calls,
            stats.refill_mapper_calls,
            stats.misses,
        )


def _open_gate(
    config: ElasticConfig, backend: VmmBackend | None, geometry: KVGeometry
) -> MemoryGate:
    """The gate ``config`` describes, for this process's instance (named after its pid and
    logical capacity)."""
    import vllm

    g = geometry
    capacity = g.num_blocks * g.block_bytes * g.num_layers * g.kv_buffers
    return open_gate(
        config,
        name=f"vllm-{os.getpid()}-{capacity}",
        engine="vllm",
        engine_version=str(vllm.__version__),
        backend=backend,
        give_back=give_back_for(config),
    )


def give_back_for(config: ElasticConfig) -> str:
    """What this instance's ledger gate asks back for a waiting neighbour: a scheduler that
    preempts to empty pages gives back what is asked, as it is taken; one that drains must
    start emptying every page above its share at once (``LedgerGate``)."""
    return "asked" if resolved_reclaim(config) == "preempt" else "all"


def _shutdown_error(failed: Sequence[PartFailure]) -> KvcoreError:
    what = ", ".join(f.part for f in failed)
    return KvcoreError(
        f"elastic KV: shutdown could not release everything ({what} failed); "
        "everything else was released",
        hint="the log has each failure; memory the driver still holds goes with the "
        "process (kvctl shows any ledger record left behind)",
    )
