"""What the patched vLLM calls: settings check, KV buffer, block pool.

The patch series adds one carrier and three call sites (``patches/vllm/<version>/``):

* ``CacheConfig.kvcore_elastic`` / ``kvcore_config`` (``--kvcore-elastic``,
  ``--kvcore-config '{...}'``) and ``KVCacheConfig.kvcore``: the resolved settings, set by
  the engine core from ``elastic_settings(vllm_config, kv_cache_config)`` (validation at
  start-up) and read by both sides below; ``None`` means upstream behaviour, and nothing of
  kvcore is imported.
* ``allocate_kv_cache`` (``v1/worker/utils.py``) takes its one backing buffer from
  ``elastic_kv_buffer(kv_cache_config, device, nbytes)``: a flat ``int8`` view of a kvcore
  virtual tensor (stable address; unbacked blocks read as zeros).
* ``KVCacheCoordinator`` (``v1/core/kv_cache_coordinator.py``) builds its block pool with
  ``elastic_block_pool_class(kv_cache_config)``: an ``ElasticBlockPool`` over the ledger of the
  same process's buffer, or (a scheduler without a worker in its process, e.g. the engine's
  own scheduler tests) over a buffer it makes itself.

* Shutdown: the patched ``Worker.shutdown`` calls ``release_kv_memory()`` and the patched
  ``Scheduler.shutdown`` the pool's ``close()``: every page unmapped, the per-GPU ledger
  record removed, before vLLM's own teardown goes on (failures are logged, never raised
  into vLLM's shutdown).
* Release fence: with overlapping batches (async scheduling, PP's batch queue) the engine
  core's settings carry ``release_fence`` and the patched ``Scheduler`` reports each batch
  handed out and each output processed to the pool (``kvcore.adapters.vllm.fence``).

One ``ElasticKVMemory`` per KV buffer per process holds the whole object chain (backend,
virtual tensor, mapper, page allocator, ledger), found again by the KV cache's
``(num_blocks, bytes per block)`` in this process's ``MemoryRegistry``; closing it (shutdown,
or interpreter exit) removes it from the registry, so a closed memory is never handed out
again. A pool that had to make its own memory (a scheduler without a worker in its process,
the TP x PP engine core) closes it when the pool is closed or collected; the registry knows
those memories too, so ``close_all()`` (also run at interpreter exit) closes every memory of
the process at a known point, whatever the garbage collector has done.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.vllm.checks import (
    check_elastic_config,
    check_vllm_config,
    resolved_reclaim,
)
from kvcore.adapters.vllm.groups import engine_row_bytes, pad_for_pages
from kvcore.adapters.vllm.memory import (
    RELEASE_FENCE,
    ElasticKVMemory,
    KVMemory,
    engine_options,
    settings_dict,
)
from kvcore.adapters.vllm.parallel import (
    PARALLEL_KEY,
    ChannelKVMemory,
    channel_settings,
    engine_memory,
    parallel_settings,
    release_worker_memory,
    worker_buffer,
)
from kvcore.budget.gate import MemoryGate
from kvcore.errors import BackendUnavailable, KvcoreError, UnsupportedConfiguration
from kvcore.vmm import open_backend
from kvcore.vmm.base import VmmBackend

__all__ = [
    "RELEASE_FENCE",
    "MemoryRegistry",
    "close_all",
    "elastic_block_pool_class",
    "elastic_kv_buffer",
    "elastic_settings",
    "existing_memory",
    "memory_for",
    "registry",
    "release_kv_memory",
]

log = logging.getLogger(__name__)

Key = tuple[int, int]
"""A KV buffer's ``(num_blocks, bytes per block)``."""


class MemoryRegistry:
    """This process's vLLM KV memories (module docstring). Thread-safe.

    * shared memories, one per ``Key``: made by ``memory_for`` (the worker's buffer), each
      taken by at most one block pool (``claim``);
    * pool-owned memories (``adopt``): made by a block pool for itself, closed with it.

    A memory leaves the registry when it starts closing (its ``on_close``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[Key, ElasticKVMemory] = {}
        self._claimed: set[Key] = set()  # shared memories whose ledger a block pool took
        self._owned: dict[int, KVMemory] = {}  # id() -> a pool's own memory

    def live(self, key: Key) -> ElasticKVMemory | None:
        """The open shared memory for ``key``, or ``None``."""
        with self._lock:
            return self._live(key)

    def get_or_make(
        self, key: Key, make: Callable[[], ElasticKVMemory]
    ) -> tuple[ElasticKVMemory, bool]:
        """The open shared memory for ``key`` and ``False``, else ``make()``'s (registered
        now) and ``True``. ``make`` runs under the registry's lock."""
        with self._lock:
            memory = self._live(key)
            if memory is not None:
                return memory, False
            memory = self._shared[key] = make()
        memory.on_close(functools.partial(self._forget, key, memory))
        return memory, True

    def claim(self, key: Key) -> ElasticKVMemory | None:
        """The open shared memory for ``key`` if no block pool took it yet (it is taken now),
        else ``None``."""
        with self._lock:
            memory = self._live(key)
            if memory is None or key in self._claimed:
                return None
            self._claimed.add(key)
            return memory

    def adopt(self, memory: KVMemory) -> None:
        """Know a block pool's own ``memory`` until it closes (``close_all`` closes it)."""
        with self._lock:
            self._owned[id(memory)] = memory
        memory.on_close(functools.partial(self._disown, memory))

    def release_shared(self) -> None:
        """Close every shared memory (``release_kv_memory``); never raises."""
        with self._lock:
            memories = list(self._shared.values())
        for memory in memories:
            _close_quietly(memory)

    def close_all(self) -> None:
        """Close every memory of the registry, shared and pool-owned; never raises."""
        self.release_shared()
        with self._lock:
            owned = list(self._owned.values())
        for memory in owned:
            _close_quietly(memory)

    def _live(self, key: Key) -> ElasticKVMemory | None:
        """The registered memory for ``key``, dropping a closed one. Caller holds the lock."""
        memory = self._shared.get(key)
        if memory is not None and memory.closed:
            del self._shared[key]
            self._claimed.discard(key)
            return None
        return memory

    def _forget(self, key: Key, memory: ElasticKVMemory) -> None:
        """``memory`` is closing: it is no longer handed out."""
        with self._lock:
            if self._shared.get(key) is memory:
                del self._shared[key]
                self._claimed.discard(key)

    def _disown(self, memory: KVMemory) -> None:
        with self._lock:
            self._owned.pop(id(memory), None)


registry = MemoryRegistry()
"""This process's registry: the one the patched vLLM's seams use."""


def elastic_settings(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The ``KVCacheConfig.kvcore`` value for an engine started with ``--kvcore-elastic``.

    Called by the engine core once the KV cache configuration is known, before any worker
    allocates. Raises ``UnsupportedConfiguration`` naming the first setting elastic mode does
    not support (``checks.check_vllm_config``, ``checks.check_elastic_config``) or a
    malformed ``--kvcore-config``;
    ``GeometryError`` when no page can hold a block row. When vLLM's block row tiles no
    page exactly, ``kv_cache_config`` is re-strided in place to kvcore's padded row
    (``groups.pad_for_pages``: fewer blocks in the same bytes), which is why this must run
    before the scheduler's config is derived."""
    raw = getattr(vllm_config.cache_config, "kvcore_config", None)
    config = ElasticConfig.parse(raw)
    check_elastic_config(config)
    check_vllm_config(vllm_config, kv_cache_config)
    before = (kv_cache_config.num_blocks, engine_row_bytes(kv_cache_config))
    stride = pad_for_pages(
        kv_cache_config, _planning_granularity(config), page_bytes=config.page_bytes
    )
    if stride is not None:
        log.info(
            "kvcore: block row of %d bytes padded to %d (whole rows per page): %d -> %d blocks",
            before[1],
            stride,
            before[0],
            kv_cache_config.num_blocks,
        )
    elif kv_cache_config.num_blocks != before[0]:
        log.info(
            "kvcore: %d -> %d blocks (whole pages in every layer's region)",
            before[0],
            kv_cache_config.num_blocks,
        )
    if config.budgeted:
        log.info(
            "kvcore: pages a waiting neighbour or a lowered limit wants back: %s",
            "running requests alone on them are preempted"
            if resolved_reclaim(config) == "preempt"
            else "they drain as their requests finish",
        )
    settings = settings_dict(config)
    settings[RELEASE_FENCE] = _overlapping_batches(vllm_config)
    parallel = channel_settings(vllm_config, config, block_bytes=engine_row_bytes(kv_cache_config))
    if parallel is not None:  # TP x PP > 1: the workers serve kvcore's channel (parallel.py)
        settings[PARALLEL_KEY] = parallel
    return settings


def elastic_kv_buffer(kv_cache_config: Any, device: torch.device, nbytes: int) -> torch.Tensor:
    """The flat ``int8`` backing buffer of ``nbytes`` for ``allocate_kv_cache``.

    Its address never changes while the engine lives (invariant 4). Raises
    ``UnsupportedConfiguration`` when ``nbytes`` is not ``num_blocks`` whole blocks of the
    block-outermost layout, ``GeometryError`` when a physical page cannot hold whole blocks
    (its hint names page sizes that work)."""
    num_blocks = int(kv_cache_config.num_blocks)
    block_bytes = engine_row_bytes(kv_cache_config)
    if nbytes != num_blocks * block_bytes:
        raise UnsupportedConfiguration(
            f"elastic KV: the KV cache buffer is {nbytes} bytes, not {num_blocks} blocks of "
            f"{block_bytes} bytes",
            hint="elastic KV needs the KV cache tensors vLLM's planner makes (one buffer)",
        )
    if parallel_settings(kv_cache_config.kvcore) is not None:  # one rank of TP x PP
        return worker_buffer(kv_cache_config, device_index=_device_index(device))
    return memory_for(kv_cache_config, device_index=_device_index(device)).buffer()


def elastic_block_pool_class(kv_cache_config: Any) -> Any:
    """The block pool constructor for ``KVCacheCoordinator``: ``ElasticBlockPool`` (same
    arguments as vLLM's ``BlockPool``) over the ledger of this process's KV buffer for the
    same cache, or, where no worker allocated one here (a scheduler-only process, vLLM's
    own scheduler tests), over kvcore memory of its own that lives as long as the pool."""
    from kvcore.adapters.vllm.pool import ElasticBlockPool

    memory: ElasticKVMemory | ChannelKVMemory | None = registry.claim(_key(kv_cache_config))
    shared = memory is not None
    if memory is None:
        if parallel_settings(kv_cache_config.kvcore) is not None:
            memory = engine_memory(kv_cache_config)  # TP x PP: the ranks' workers hold the pages
        else:
            memory = _make(kv_cache_config, 0)
        registry.adopt(memory)
    bound = memory.config.max_cached_tokens
    max_cached = None if bound is None else max(bound // _block_size(kv_cache_config), 0)

    def build(*args: Any, **kwargs: Any) -> ElasticBlockPool:
        pool = ElasticBlockPool(
            *args,
            ledger=memory.ledger,
            max_cached_blocks=max_cached,
            step_fence=memory.fence,
            reclaim_by_preemption=resolved_reclaim(memory.config) == "preempt",
            on_close=functools.partial(_close_quietly, memory),
            **kwargs,
        )
        if not shared:  # the pool's own memory goes when the pool does
            weakref.finalize(pool, _close_quietly, memory)
        return pool

    return functools.wraps(ElasticBlockPool)(build)


def memory_for(
    kv_cache_config: Any,
    *,
    device_index: int = 0,
    gate: MemoryGate | None = None,
    backend: VmmBackend | None = None,
) -> ElasticKVMemory:
    """This process's kvcore memory for the KV buffer ``kv_cache_config`` describes, made on
    first use from ``kv_cache_config.kvcore`` (the worker side; a block pool built later in
    the same process takes its ledger, so call this before building the scheduler). A
    closed memory is never returned: the next call makes a new one.

    ``gate`` / ``backend``: a ``MemoryGate`` to charge instead of the one the settings
    describe, an open VMM backend to use instead of opening the configured one (see
    ``ElasticKVMemory``); the memory takes them over. Raises ``KvcoreError`` when either
    is given but the memory already exists (they cannot change any more)."""
    key = _key(kv_cache_config)
    memory, made = registry.get_or_make(
        key, functools.partial(_make, kv_cache_config, device_index, gate, backend)
    )
    if not made and (
        (gate is not None and memory.gate is not gate)
        or (backend is not None and memory.backend is not backend)
    ):
        raise KvcoreError(
            f"elastic KV: the memory of {key[0]} blocks of {key[1]} bytes already exists "
            "with its own memory gate and backend",
            hint="pass gate=/backend= on the first memory_for call, before the scheduler is built",
        )
    return memory


def existing_memory(kv_cache_config: Any) -> ElasticKVMemory | None:
    """This process's open kvcore memory for ``kv_cache_config``'s KV buffer, or ``None``
    when none was made here (or it was closed); never makes one (``memory_for`` does)."""
    return registry.live(_key(kv_cache_config))


def release_kv_memory() -> None:
    """Close every KV memory this process made through ``elastic_kv_buffer`` /
    ``memory_for``: every page unmapped, the range freed, the per-GPU ledger record removed
    (``ElasticKVMemory.close``). Called by the patched ``Worker.shutdown``; also runs at
    interpreter exit. A failure is logged with its hint and the next memory is still closed:
    this never raises, so vLLM's own teardown after it always runs."""
    registry.release_shared()
    release_worker_memory()  # a TP x PP rank's buffer (parallel.py)


def close_all() -> None:
    """Close every kvcore memory of this process: ``release_kv_memory``'s and those the
    block pools made for themselves (which otherwise close with their pool: its ``close``,
    or its collection). Runs at interpreter exit; a test closes everything with it at a
    known point instead of waiting for the garbage collector. Never raises."""
    registry.close_all()
    release_worker_memory()


def _close_quietly(memory: KVMemory) -> None:
    try:
        memory.close()
    except KvcoreError as exc:
        log.error("kvcore: %s (%s)", exc, getattr(exc, "hint", ""))
    except Exception:
        log.exception("kvcore: closing the elastic KV memory failed")


def _make(
    kv_cache_config: Any,
    device_index: int,
    gate: MemoryGate | None = None,
    backend: VmmBackend | None = None,
) -> ElasticKVMemory:
    config, release_fence = engine_options(kv_cache_config.kvcore)
    return ElasticKVMemory(
        config,
        kv_cache_config,
        device_index=device_index,
        gate=gate,
        backend=backend,
        release_fence=release_fence,
    )


atexit.register(close_all)


def _overlapping_batches(vllm_config: Any) -> bool:
    """Whether vLLM may free blocks a batch in flight still uses: async scheduling or more
    than one batch in the engine core's batch queue (PP)."""
    batches = getattr(vllm_config, "max_concurrent_batches", None)
    if isinstance(batches, int):
        return batches > 1
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)) or pp > 1


def _key(kv_cache_config: Any) -> tuple[int, int]:
    return int(kv_cache_config.num_blocks), engine_row_bytes(kv_cache_config)


def _planning_granularity(config: ElasticConfig) -> int:
    """The page granularity the workers' backend will have, for the engine core's padding
    decision: the backend's own, else (its driver is not loadable in this process) 2 MiB,
    the CUDA/HIP VMM granularity of every supported GPU; the worker re-checks its real
    granularity without padding (``ElasticKVMemory``), so a wrong guess fails there."""
    try:
        backend = open_backend(config.backend, 0, **dict(config.backend_options))
    except BackendUnavailable:
        return 2 << 20
    try:
        return int(backend.granularity())
    finally:
        backend.close()


def _block_size(kv_cache_config: Any) -> int:
    sizes = {int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups}
    return min(sizes) if sizes else 1


def _device_index(device: torch.device) -> int:
    return device.index or 0 if device.type != "cpu" else 0
