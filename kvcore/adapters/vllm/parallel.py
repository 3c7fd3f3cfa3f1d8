"""Elastic KV for vLLM with tensor and pipeline parallelism (TP x PP > 1).

With TP x PP > 1 vLLM's ``MultiprocExecutor`` runs one worker process per rank and the
engine core process runs the scheduler. Each worker owns its KV buffer (a kvcore virtual
tensor on its GPU); the scheduler's block pool decides every page transition. kvcore's
worker channel (``kvcore.parallel.channel``, docs/channel.md) carries each transition to every rank
as one transaction, so a page is mapped on every worker or on none. No extra upstream seam is
needed: the three call sites of the series are enough.

* Engine core, ``elastic_settings`` (before any worker allocates): ``channel_settings``
  creates this engine's channel directory (one per engine core process) and returns the
  ``"parallel"`` entry of ``KVCacheConfig.kvcore``: the directory, ``world_size`` and
  ``tensor_parallel_size``. The settings travel to the workers inside ``KVCacheConfig``.
* Worker, ``elastic_kv_buffer`` (``allocate_kv_cache``): ``worker_buffer`` builds this
  rank's ``VirtualKVCache`` + ``LocalPageMapper`` (no page allocator, no gate: the engine
  decides) and starts a ``WorkerListener`` on it, then returns the buffer. The rank is
  vLLM's own: ``pp_rank * tp_size + tp_rank`` from its model-parallel groups.
* Engine core, ``elastic_block_pool_class`` (the scheduler): ``engine_memory`` waits for
  every rank's socket (``WorkersMissing`` naming the ranks that never came), connects a
  ``ChannelCoordinator`` (a ``PageMapper``) and builds the ``PageAllocator``, ``StepFence``
  and ``FencedBlockLedger`` on it, exactly as for one local GPU.

Pages. Every rank must cover the same blocks per page id: each rank lays out its buffer as a
single-GPU worker does (``groups.family_layout``), so ranks must hold the same bytes per block
(TP ranks always do; PP stages do when the layers split evenly); uneven PP stages are refused
at start-up, and the engine checks the pages every rank reports before it maps any.

Memory accounting (decided here). Each rank runs on its own GPU, so the page allocator's
charge is per GPU: what one rank holds (``ChannelCoordinator.held_bytes``: pages not unmapped
x the largest rank's page bytes, plus its zero page), never the sum over ranks. With
``limit_bytes`` alone it is a per-GPU budget (``BudgetGate``; ranks sharing one GPU use
``world_size`` times what it sees). With ``gpu_ledger`` every rank gets its own record in the
ledger of its own GPU, each charged that per-GPU figure (``rank_gates.RankLedgerGates``; each
worker publishes its device for it), so other engines on any of those GPUs see exactly what
this engine holds there, ranks sharing a GPU included.

Failure. A worker that dies or breaks its connection fails the channel: the next page
transition raises ``PoolFailed`` out of the scheduler (fail-stop, never a page mapped on some
ranks only); see docs/channel.md for every outcome.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.gates import open_gate
from kvcore.adapters.vllm.fence import FencedBlockLedger, StepFence, fenced_ledger
from kvcore.adapters.vllm.groups import engine_row_bytes, family_layout
from kvcore.adapters.vllm.memory import KVMemory, engine_options, give_back_for
from kvcore.budget.gate import MemoryGate
from kvcore.budget.rank_gates import publish_device
from kvcore.errors import ChannelError, PoolFailed, UnsupportedConfiguration, WorkersMissing
from kvcore.memory.chain import MemoryChain
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.teardown import close_parts
from kvcore.parallel.channel import (
    ChannelCoordinator,
    ChannelDirectory,
    WorkerListener,
    socket_path,
)
from kvcore.vmm import open_backend
from kvcore.vmm.base import VmmBackend

__all__ = [
    "PARALLEL_KEY",
    "ChannelKVMemory",
    "ParallelSettings",
    "WorkerKVMemory",
    "channel_settings",
    "engine_memory",
    "parallel_settings",
    "release_worker_memory",
    "worker_buffer",
    "worker_memory",
]

log = logging.getLogger(__name__)

PARALLEL_KEY = "parallel"
"""The entry of ``KVCacheConfig.kvcore`` that marks a TP x PP > 1 engine."""
CONNECT_TIMEOUT = 60.0
"""Seconds the engine waits for every rank's channel socket once the workers allocated."""


@dataclass(frozen=True)
class ParallelSettings:
    """The ``"parallel"`` entry of ``KVCacheConfig.kvcore``."""

    channel_dir: str
    world_size: int
    tensor_parallel_size: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "channel_dir": self.channel_dir,
            "world_size": self.world_size,
            "tensor_parallel_size": self.tensor_parallel_size,
        }


def parallel_settings(settings: Mapping[str, Any] | None) -> ParallelSettings | None:
    """The ``ParallelSettings`` in ``KVCacheConfig.kvcore``, or ``None`` for one GPU worker.
    Raises ``UnsupportedConfiguration`` when the entry is malformed."""
    entry = (settings or {}).get(PARALLEL_KEY)
    if entry is None:
        return None
    try:
        parsed = ParallelSettings(
            channel_dir=str(entry["channel_dir"]),
            world_size=int(entry["world_size"]),
            tensor_parallel_size=int(entry["tensor_parallel_size"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedConfiguration(
            f"KVCacheConfig.kvcore[{PARALLEL_KEY!r}] is malformed: {entry!r} ({exc})",
            hint="the engine core writes this entry; do not set it by hand",
        ) from None
    tp = parsed.tensor_parallel_size
    if parsed.world_size < 2 or tp < 1 or parsed.world_size % tp:
        raise UnsupportedConfiguration(
            f"KVCacheConfig.kvcore[{PARALLEL_KEY!r}]: world_size={parsed.world_size} is not "
            f"a multiple (>= 2) of tensor_parallel_size={tp}",
            hint="the engine core writes this entry; do not set it by hand",
        )
    return parsed


def _options(settings: Mapping[str, Any] | None) -> tuple[ElasticConfig, bool]:
    """``KVCacheConfig.kvcore`` as the ``ElasticConfig`` and the release-fence flag (the
    entries the engine core adds beside the options)."""
    return engine_options({k: v for k, v in (settings or {}).items() if k != PARALLEL_KEY})


# ---------------------------------------------------------------------------- engine core


@dataclass
class _EngineChannel:
    directory: ChannelDirectory
    owner: int  # id() of the VllmConfig it serves
    block_bytes: int


_lock = threading.Lock()
_engine_channel: _EngineChannel | None = None


def channel_settings(
    vllm_config: Any, config: ElasticConfig, *, block_bytes: int
) -> dict[str, Any] | None:
    """The ``"parallel"`` entry for one worker's ``KVCacheConfig``, or ``None`` when the
    engine runs one rank (TP x PP = 1).

    Called by ``elastic_settings`` in the engine core, once per worker's config, before any
    worker allocates. The first call for a ``vllm_config`` creates this engine's channel
    directory (``ChannelDirectory.create``; removed when the coordinator closes or at exit).
    Raises ``UnsupportedConfiguration`` for ranks whose bytes per block differ (uneven PP
    stages); ``ChannelError`` when the directory cannot be created."""
    global _engine_channel
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    world = tp * int(parallel.pipeline_parallel_size)
    if world == 1:
        return None
    with _lock:
        channel = _engine_channel
        if channel is None or channel.owner != id(vllm_config) or _removed(channel):
            if channel is not None:
                channel.directory.remove()
            channel = _engine_channel = _EngineChannel(
                ChannelDirectory.create(), id(vllm_config), block_bytes
            )
        elif channel.block_bytes != block_bytes:
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: pipeline stages hold different bytes per KV block "
                f"({channel.block_bytes} and {block_bytes}): elastic KV needs every rank to "
                "cover the same blocks per page",
                hint="choose a pipeline parallel size that divides the layer count evenly",
            )
        path = channel.directory.path
    return ParallelSettings(str(path), world, tp).as_dict()


def _removed(channel: _EngineChannel) -> bool:
    return not channel.directory.path.is_dir()


class ChannelKVMemory(KVMemory):
    """The engine core's side of one TP x PP KV cache: a ``ChannelCoordinator`` over every
    rank, the ``PageAllocator`` gated as ``config`` says (``limit_bytes``: per GPU), its
    ``StepFence`` (``release_fence``: overlapping batches, which PP always has) and the
    ``FencedBlockLedger`` the elastic block pool draws from (block 0, vLLM's null block,
    reserved: its page stays mapped on every rank).

    Raises ``WorkersMissing`` naming the ranks whose socket did not appear within
    ``connect_timeout`` seconds, ``ChannelError`` (or a subclass) when a worker refuses the
    handshake or the ranks' pages disagree with ``block_bytes``, ``PoolFailed`` when the
    null block's page cannot be mapped; everything opened is closed again on failure.
    ``timeout`` bounds each page transaction (``ChannelCoordinator``'s default if
    ``None``). ``gate`` replaces the gate ``config`` describes and is closed with the
    memory."""

    def __init__(
        self,
        config: ElasticConfig,
        parallel: ParallelSettings,
        *,
        num_blocks: int,
        block_bytes: int,
        release_fence: bool = False,
        connect_timeout: float = CONNECT_TIMEOUT,
        timeout: float | None = None,
        gate: MemoryGate | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        try:
            coordinator = self.coordinator = _connect(parallel, connect_timeout, timeout)
        except BaseException:  # nothing else is open yet: only a gate handed in
            close_parts([("memory gate", gate)], on_error="log")
            raise
        self.chain = MemoryChain.build(
            lambda _: _engine_geometry(coordinator, num_blocks, block_bytes),
            mapper=coordinator,
            gate=gate,
            open_gate=functools.partial(_open_gate, config, parallel, num_blocks * block_bytes),
            ledger=fenced_ledger(release_fence=release_fence),
            reserve_min=config.reserve_min,
            reserve_max=config.reserve_max,
            map_ahead=config.map_ahead,
            switch_interval=config.background_switch_s,
            label="channel",
        )
        chain = self.chain
        assert chain.gate is not None and isinstance(chain.ledger, FencedBlockLedger)
        self.geometry = chain.geometry
        self.gate: MemoryGate = chain.gate
        self.pages = chain.pages
        self.ledger: FencedBlockLedger = chain.ledger
        self.fence: StepFence = chain.ledger.fence
        log.info(
            "kvcore: elastic KV cache of %d blocks on %d pages over %d ranks (worker pids %s)",
            num_blocks,
            self.geometry.num_pages,
            parallel.world_size,
            coordinator.worker_pids,
        )

    def close(self) -> None:
        """Unmap every page on every rank, close the channel (the workers release their
        mappers) and remove its directory. Idempotent; never raises (failures are logged).
        After a fail-stop only this side is closed: the workers' memory goes with their
        processes (the page allocator's ``PoolFailed`` is logged at INFO)."""
        if self._once.begin():
            self.chain.close(on_error="log", tolerate=(PoolFailed,))


def _open_gate(
    config: ElasticConfig,
    parallel: ParallelSettings,
    capacity: int,
    _backend: VmmBackend | None,
    _geometry: KVGeometry,
) -> MemoryGate:
    """The gate ``config`` asks for (module docstring: per GPU, one ledger record per rank)."""
    version = ""
    if config.gpu_ledger:  # only a ledger record names the engine's version
        import vllm

        version = str(vllm.__version__)
    return open_gate(
        config,
        name=f"vllm-{os.getpid()}-{capacity}",
        engine="vllm",
        engine_version=version,
        channel_dir=parallel.channel_dir,
        world_size=parallel.world_size,
        give_back=give_back_for(config),
    )


def _connect(
    parallel: ParallelSettings, connect_timeout: float, timeout: float | None
) -> ChannelCoordinator:
    """Wait for every rank's socket, then connect (module docstring)."""
    path = Path(parallel.channel_dir)
    deadline = time.monotonic() + connect_timeout
    ranks = range(parallel.world_size)
    while True:
        missing = [r for r in ranks if not socket_path(path, r).exists()]
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise WorkersMissing(
                f"elastic KV: rank(s) {missing} of {parallel.world_size} never opened their "
                f"channel socket in {path} within {connect_timeout:g} s",
                ranks=missing,
                hint="those workers failed before allocating their KV cache (see their "
                "logs), or run on another host (the channel is local to one host)",
            )
        time.sleep(0.02)
    directory = _owned_directory(path)
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    return ChannelCoordinator(
        directory if directory is not None else path,
        world_size=parallel.world_size,
        connect_timeout=max(deadline - time.monotonic(), 1.0),
        **kwargs,
    )


def _owned_directory(path: Path) -> ChannelDirectory | None:
    """This process's ``ChannelDirectory`` for ``path`` (the coordinator then removes it)."""
    with _lock:
        channel = _engine_channel
        if channel is not None and channel.directory.path == path:
            return channel.directory
    return None


def _engine_geometry(
    coordinator: ChannelCoordinator, num_blocks: int, block_bytes: int
) -> KVGeometry:
    """The block -> page map every rank uses, checked against what the ranks report."""
    sizes = set(coordinator.worker_page_bytes)
    page_bytes = max(sizes)
    if len(sizes) != 1 or page_bytes % block_bytes:
        raise ChannelError(
            "elastic KV: the ranks' pages disagree with the scheduler's "
            f"{block_bytes}-byte blocks: page bytes per rank {coordinator.worker_page_bytes}",
            hint="every rank needs the same bytes per block and the same page_bytes",
        )
    geometry = KVGeometry(
        num_layers=1,
        kv_buffers=1,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        page_bytes=page_bytes,
        granularity=page_bytes,  # the workers checked the device's own granularity
        layout="compound",
    )
    if geometry.num_pages != coordinator.num_pages:
        raise ChannelError(
            f"elastic KV: the scheduler's {num_blocks} blocks make {geometry.num_pages} pages, "
            f"the ranks report {coordinator.num_pages}",
            hint="every rank must plan the same num_blocks (vLLM's planner does)",
        )
    return geometry


def engine_memory(kv_cache_config: Any) -> ChannelKVMemory:
    """The engine core's ``ChannelKVMemory`` for the scheduler's ``kv_cache_config``
    (``KVCacheConfig.kvcore`` with a ``"parallel"`` entry), connected to every rank; the
    caller (the block pool) closes it. Raises as ``ChannelKVMemory``."""
    parallel = parallel_settings(kv_cache_config.kvcore)
    if parallel is None:
        raise UnsupportedConfiguration("elastic KV: these settings name no TP x PP channel")
    config, release_fence = _options(kv_cache_config.kvcore)
    return ChannelKVMemory(
        config,
        parallel,
        num_blocks=int(kv_cache_config.num_blocks),
        block_bytes=engine_row_bytes(kv_cache_config),
        release_fence=release_fence,
    )


# ---------------------------------------------------------------------------- workers


class _NullPageFirst:
    """The ``PageMapper`` a rank's listener serves: its ``LocalPageMapper`` with the null
    block's page mapped from the start.

    vLLM writes block 0 (its null block) before the scheduler exists: the dummy runs of
    profiling, warm-up and CUDA graph capture scatter their tokens through a zero-filled slot
    mapping. So each rank backs that page itself when it makes its buffer, and the engine's
    first ``map`` naming it (the ledger reserves block 0 when the pool is built) adopts it on
    every rank instead of mapping it again; from then on it is an ordinary page. Everything
    else is the inner mapper's."""

    def __init__(self, inner: LocalPageMapper, page: int) -> None:
        self.inner = inner
        inner.map([page])
        self._premapped: set[int] = {page}

    @property
    def num_pages(self) -> int:
        return self.inner.num_pages

    @property
    def page_bytes(self) -> int:
        return self.inner.page_bytes

    @property
    def fixed_bytes(self) -> int:
        return self.inner.fixed_bytes

    @property
    def held_bytes(self) -> int:
        return self.inner.held_bytes

    @property
    def pooled_pages(self) -> int:
        return self.inner.pooled_pages

    def map(self, page_ids: Sequence[int]) -> None:
        adopted = self._premapped.intersection(page_ids)
        self.inner.map([p for p in page_ids if p not in adopted])  # all-or-nothing
        self._premapped -= adopted

    def prepare_unmap(self, page_ids: Sequence[int], *, synchronize: bool = True) -> None:
        self.inner.prepare_unmap(page_ids, synchronize=synchronize)

    def commit_unmap(self, page_ids: Sequence[int]) -> None:
        self.inner.commit_unmap(page_ids)

    def abort_unmap(self, page_ids: Sequence[int]) -> None:
        self.inner.abort_unmap(page_ids)

    def trim_pool(self) -> None:
        self.inner.trim_pool()

    def close(self) -> None:
        self.inner.close()


class WorkerKVMemory:
    """One rank's KV buffer: a ``VirtualKVCache`` on this worker's device whose pages only
    the engine's channel maps (a ``WorkerListener`` on its ``LocalPageMapper``), except the
    null block's page, backed from the start for vLLM's warm-up (``_NullPageFirst``).

    Raises ``BackendUnavailable``/``VmmError`` when the backend cannot be opened or reserve
    the range, ``GeometryError`` when a page cannot hold whole blocks, ``ChannelError`` when
    this rank's socket is served by another live listener; nothing is left open on failure.
    """

    def __init__(
        self,
        config: ElasticConfig,
        parallel: ParallelSettings,
        kv_cache_config: Any,
        *,
        rank: int,
        device_index: int = 0,
    ) -> None:
        self.rank = rank
        self._closed = False
        # the layout a single-GPU worker uses (ElasticKVMemory): the same rows and pages
        self.chain = MemoryChain.build(
            lambda backend: (
                family_layout(
                    kv_cache_config, _granularity(backend), page_bytes=config.page_bytes
                ).geometry
            ),
            open_backend=functools.partial(
                open_backend, config.backend, device_index, **dict(config.backend_options)
            ),
            sanity=config.sanity,
        )  # no gate: the engine core's page allocator decides every page
        chain = self.chain
        assert chain.backend is not None and isinstance(chain.mapper, LocalPageMapper)
        self.backend: VmmBackend = chain.backend
        self.geometry = chain.geometry
        self.cache = chain.cache
        self.mapper: LocalPageMapper = chain.mapper
        self.listener: WorkerListener | None = None
        try:
            served = _NullPageFirst(self.mapper, self.geometry.page_of(0))
            publish_device(parallel.channel_dir, rank, self.backend)  # for per-rank ledgers
            self.listener = WorkerListener(
                served,
                rank=rank,
                channel_dir=parallel.channel_dir,
                switch_interval=config.background_switch_s,
            ).start()
        except BaseException:
            self._teardown()
            raise

    def buffer(self) -> torch.Tensor:
        """The flat ``int8`` tensor of ``num_blocks * block_bytes`` bytes at a stable address
        (unbacked blocks read as zeros)."""
        assert self.cache is not None
        g = self.geometry
        view = self.cache.view(0, 0, torch.int8, block_shape=(g.block_bytes,))
        return view.reshape(-1)[: g.num_blocks * g.block_bytes]

    def close(self) -> None:
        """Stop serving the channel, unmap every page and free the range. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        """Stop the listener, then the chain (mapper, range, backend); failures are logged."""
        close_parts([("channel listener", self.listener), *self.chain.parts()], on_error="log")


def _granularity(backend: VmmBackend | None) -> int:
    assert backend is not None
    return backend.granularity()


_workers: dict[tuple[int, int], WorkerKVMemory] = {}


def worker_buffer(kv_cache_config: Any, *, device_index: int = 0) -> torch.Tensor:
    """This rank's KV buffer for ``allocate_kv_cache`` (``WorkerKVMemory.buffer``), serving
    the engine's channel from now on; made once per cache and closed at interpreter exit.
    The rank comes from vLLM's model-parallel groups. Raises ``UnsupportedConfiguration``
    when those disagree with the settings, and as ``WorkerKVMemory``."""
    parallel = parallel_settings(kv_cache_config.kvcore)
    if parallel is None:
        raise UnsupportedConfiguration("elastic KV: these settings name no TP x PP channel")
    key = (int(kv_cache_config.num_blocks), engine_row_bytes(kv_cache_config))
    with _lock:
        memory = _workers.get(key)
        if memory is None:
            memory = _workers[key] = WorkerKVMemory(
                _options(kv_cache_config.kvcore)[0],
                parallel,
                kv_cache_config,
                rank=vllm_rank(parallel),
                device_index=device_index,
            )
    return memory.buffer()


def worker_memory(kv_cache_config: Any) -> WorkerKVMemory | None:
    """This process's ``WorkerKVMemory`` for ``kv_cache_config``, if ``worker_buffer`` made
    one (inspection: its ``mapper`` holds this rank's page states)."""
    key = (int(kv_cache_config.num_blocks), engine_row_bytes(kv_cache_config))
    with _lock:
        return _workers.get(key)


def vllm_rank(parallel: ParallelSettings) -> int:
    """This worker's global rank ``pp_rank * tp_size + tp_rank`` from vLLM's model-parallel
    groups (set up before any worker allocates its KV cache). Raises
    ``UnsupportedConfiguration`` when they are not initialized or disagree with
    ``parallel``."""
    from vllm.distributed import parallel_state

    try:
        tp = parallel_state.get_tp_group()
        pp = parallel_state.get_pp_group()
    except AssertionError as exc:
        raise UnsupportedConfiguration(
            f"elastic KV with TP x PP: vLLM's model-parallel groups are not initialized in "
            f"this worker ({exc})",
            hint="allocate the KV cache after init_worker_distributed_environment",
        ) from None
    if tp.world_size != parallel.tensor_parallel_size or (
        tp.world_size * pp.world_size != parallel.world_size
    ):
        raise UnsupportedConfiguration(
            f"elastic KV: this worker's groups (TP {tp.world_size} x PP {pp.world_size}) "
            f"differ from the engine's (world {parallel.world_size}, TP "
            f"{parallel.tensor_parallel_size})",
            hint="prefill context parallelism and data parallelism are not supported",
        )
    return int(pp.rank_in_group) * int(tp.world_size) + int(tp.rank_in_group)


@atexit.register
def release_worker_memory() -> None:
    """Close every ``WorkerKVMemory`` of this process: stop serving the channel, unmap and
    release every page, free the range. Called by ``runtime.release_kv_memory`` (the patched
    ``Worker.shutdown``) and at interpreter exit; never raises (failures are logged)."""
    with _lock:
        memories = list(_workers.values())
        _workers.clear()
    for memory in memories:
        memory.close()  # WorkerKVMemory.close logs and goes on
