"""Elastic Mamba / linear-attention state for SGLang: ``MambaPool`` and its slot allocator.

SGLang keeps a hybrid Mamba model's recurrent state in ``MambaPool``: per conv state shape
one ``conv`` tensor and one ``temporal`` (SSM) tensor, each ``(layers, size + 1, *shape)``
(layer-major; slot 0 is SGLang's dummy slot), and a ``MambaSlotAllocator`` in the
``HybridReqToTokenPool`` hands one slot to each request. A slot's *cell* is its conv and SSM
state in every Mamba layer (DESIGN.md section 7).

``ElasticMambaState`` gives the pool those tensors from kvcore: one virtual range per state
tensor, laid out exactly as SGLang's ``(layers, slots, *shape)`` except that each layer's
slot array is padded to whole pages (the layer stride; within a layer the slots are
contiguous, as SGLang's kernels index them). Pages are planned with
``kvcore.families.plan_rows(row, granularity, pad=False)`` per state: ``N`` slots of ``row``
bytes per page exactly (SGLang's per-layer tensors cannot take a padded slot stride), so a
Qwen3-Next-like SSM state of 2 MiB per slot and layer is one slot per 2 MiB page, and its
72 KiB conv state 256 slots per 18 MiB page. A slot's pages (page ``slot // N`` of every
layer, in every state) are mapped when a request takes the slot and unmapped when the last
slot on them is freed; the pages past ``size + 1`` slots on the last page (the partial
tail) are mapped with that page but never handed out. Every state's page allocator draws on
the rank's one gate (``SharedGate``), with the KV pool's.

``ElasticMambaSlotAllocator`` is SGLang's ``MambaSlotAllocator`` over that state: the lowest
free slots first (so slots share pages), ``None`` when slots or pages are short (a physical
miss under the budget looks like a full pool).

Seam. SGLang 0.5.23 allocates the state with ``torch.zeros`` inside ``MambaPool.__init__``
and builds the slot allocator in ``HybridReqToTokenPool._init_mamba_pool``; the patch series
calls ``memory_pool.MAMBA_STATE_HOOK.mamba_buffers(pool, ...)`` and
``.mamba_allocator(pool, upstream)`` there (``ElasticScope`` is the hook). Refused at
start-up, naming the setting: the page-major envelope layout (``--enable-page-major-kv-
layout``: kvcore's envelope views are proven in ``test_families_sglang.py``, not yet wired),
NPU/AMX conv layouts, a memory saver or custom memory pool, and a slot row whose exact page
would exceed ``max_page_bytes``. Side buffers (speculative intermediates, ReplaySSM rings,
PLE pools) stay SGLang's static allocations.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

from kvcore.errors import InvalidTransition, PoolFailed, UnsupportedConfiguration
from kvcore.families import plan_rows
from kvcore.geometry import KVGeometry
from kvcore.pages import PageAllocator
from kvcore.tensors import LocalPageMapper, VirtualKVCache
from kvcore.vmm import open_backend

if TYPE_CHECKING:
    from kvcore.accounting import MemoryGate
    from kvcore.adapters.config import ElasticConfig
    from kvcore.adapters.sglang.gate import SharedGate
    from kvcore.vmm.base import VmmBackend

__all__ = [
    "ElasticMambaSlotAllocator",
    "ElasticMambaState",
    "StateTensor",
    "build_mamba_state",
    "check_mamba_pool",
    "elastic_mamba_allocator",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateTensor:
    """One per-slot state of every Mamba layer: ``shape`` elements of ``dtype`` per slot."""

    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        item: int = torch.empty(0, dtype=self.dtype).element_size()
        return math.prod(self.shape) * item


class _StatePages:
    """One state tensor's virtual range, pages and per-layer page use counts."""

    def __init__(
        self,
        spec: StateTensor,
        *,
        layers: int,
        slots: int,
        backend: VmmBackend,
        gate: MemoryGate,
        sanity: bool,
    ) -> None:
        self.spec = spec
        self.layers = layers
        gran = backend.granularity()
        plan = plan_rows(spec.row_bytes, gran, pad=False)
        self.per_page = plan.rows_per_page  # slots of one layer on one page
        self.layer_pages = -(-slots // self.per_page)
        self.geometry = KVGeometry(
            num_layers=1,
            kv_buffers=1,
            block_bytes=spec.row_bytes,
            num_blocks=layers * self.layer_pages * self.per_page,
            page_bytes=plan.page_bytes,
            granularity=gran,
            layout="per-layer",
        )
        self.cache: VirtualKVCache | None = None
        self.mapper: LocalPageMapper | None = None
        self.pages: PageAllocator | None = None
        self.cache = VirtualKVCache(backend, self.geometry, sanity=sanity)
        self.mapper = LocalPageMapper(self.cache, pool_pages=0)
        # pages are taken by id (a slot's own pages): an idle reserve would not serve them
        self.pages = PageAllocator(self.mapper, gate)
        self.uses = [0] * self.layer_pages  # slots in use on page j of every layer
        view = self.cache.view(0, 0, spec.dtype, block_shape=spec.shape)
        self.tensor = view.view(layers, self.layer_pages * self.per_page, *spec.shape)[:, :slots]

    def page_ids(self, js: Sequence[int]) -> list[int]:
        """The page ids of per-layer page ``j`` in every layer."""
        lp = self.layer_pages
        return [layer * lp + j for j in js for layer in range(self.layers)]

    def close(self) -> None:
        for obj in (self.pages, self.mapper, self.cache):
            if obj is not None:
                obj.close()


class ElasticMambaState:
    """kvcore memory behind one ``MambaPool``'s conv and temporal state (module docstring).

    ``states``: the pool's state tensors in SGLang's order (conv states, then temporal);
    ``slots``: ``size + 1``. ``gate``: the rank's ``SharedGate`` (``None``: a gate of its
    own). Raises ``GeometryError`` when a state's exact page exceeds the largest page,
    ``BackendUnavailable``/``VmmError`` from the backend, ``PoolFailed`` when slot 0's pages
    cannot be mapped; nothing is left reserved or mapped on failure.
    """

    def __init__(
        self,
        config: ElasticConfig,
        *,
        layers: int,
        states: Sequence[StateTensor],
        slots: int,
        device_index: int = 0,
        backend: VmmBackend | None = None,
        gate: SharedGate | None = None,
        name: str = "sglang-mamba",
    ) -> None:
        self.config = config
        self.slots = slots
        self._lock = threading.Lock()
        self._closed = False
        self.backend = backend or open_backend(
            config.backend, device_index, **dict(config.backend_options)
        )
        self._owns_backend = backend is None
        self._parts: list[_StatePages] = []
        self.gate: Any = None
        try:
            self.gate = (
                config.make_gate(self.backend, name=name, engine="sglang", engine_version="")
                if gate is None
                else gate.join(
                    lambda: config.make_gate(
                        self.backend, name=name, engine="sglang", engine_version=""
                    )
                )
            )
            for spec in states:
                self._parts.append(
                    _StatePages(
                        spec,
                        layers=layers,
                        slots=slots,
                        backend=self.backend,
                        gate=self.gate,
                        sanity=config.sanity,
                    )
                )
            self._taken = bytearray(slots)
            self._free = list(range(1, slots))  # a heap: lowest slot first
            if not self._map_slots([0]):  # SGLang's dummy slot: padded writes land there
                raise PoolFailed(
                    "kvcore: cannot map the Mamba state pages of slot 0",
                    hint="free device memory or raise the instance's limit, then restart",
                )
            self._taken[0] = 1
        except BaseException:
            self._teardown()
            raise

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Each state's ``(layers, slots, *shape)`` tensor at a stable address, in order."""
        return [p.tensor for p in self._parts]

    def free_count(self) -> int:
        """Slots ``take`` may still hand out (logical; the budget may refuse their pages)."""
        return len(self._free)

    def free_slots(self) -> list[int]:
        """The free slot ids, ascending."""
        return sorted(self._free)

    def mapped_pages(self) -> list[int]:
        """Per state, the pages mapped now (after background unmaps settle)."""
        out = []
        for p in self._parts:
            assert p.pages is not None
            p.pages.flush()
            out.append(p.pages.stats().mapped)
        return out

    def take(self, n: int) -> list[int] | None:
        """``n`` free slots, lowest first, their pages mapped in every state; ``None`` (nothing
        taken) when fewer are free or a page cannot be mapped (budget or device)."""
        with self._lock:
            if n > len(self._free):
                return None
            slots = [heapq.heappop(self._free) for _ in range(n)]
            if not self._map_slots(slots):
                for s in slots:
                    heapq.heappush(self._free, s)
                return None
            for s in slots:
                self._taken[s] = 1
            return slots

    def give(self, slots: Sequence[int]) -> None:
        """Free ``slots``; a page whose slots are all free is unmapped. Raises
        ``InvalidTransition`` (nothing changed) for slot 0, a free slot or one named twice."""
        with self._lock:
            ids = list(slots)
            bad = [s for s in ids if not 0 < s < self.slots or not self._taken[s]]
            if bad or len(set(ids)) != len(ids):
                raise InvalidTransition(
                    f"Mamba slots {bad or ids}: not allocated (or named twice)",
                    ids=bad,
                    hint="free only slots the allocator handed out, once each",
                )
            for s in ids:
                self._taken[s] = 0
                heapq.heappush(self._free, s)
            for part in self._parts:
                emptied = []
                for s in ids:
                    j = s // part.per_page
                    part.uses[j] -= 1
                    if part.uses[j] == 0:
                        emptied.append(j)
                if emptied:
                    assert part.pages is not None
                    part.pages.release(part.page_ids(emptied))

    def _map_slots(self, slots: Sequence[int]) -> bool:
        done: list[tuple[_StatePages, list[int]]] = []
        for part in self._parts:
            per_page, uses = part.per_page, part.uses
            fresh = sorted({s // per_page for s in slots if uses[s // per_page] == 0})
            assert part.pages is not None
            if fresh and not part.pages.acquire_ids(part.page_ids(fresh)):
                for earlier, js in done:
                    assert earlier.pages is not None
                    earlier.pages.release(earlier.page_ids(js))
                return False
            done.append((part, fresh))
        for part in self._parts:
            for s in slots:
                part.uses[s // part.per_page] += 1
        return True

    def close(self) -> None:
        """Unmap every page and free the ranges (the engine is going away). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        errors: list[BaseException] = []
        for part in self._parts:
            try:
                part.close()
            except Exception as exc:
                errors.append(exc)
        for obj in (self.gate, self.backend if self._owns_backend else None):
            close = getattr(obj, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:
                    errors.append(exc)
        if errors:
            log.error("kvcore: elastic Mamba state shutdown left errors: %s", errors)
            raise errors[0]


class ElasticMambaSlotAllocator(MambaSlotAllocator):  # type: ignore[misc]
    """SGLang's ``MambaSlotAllocator`` over an ``ElasticMambaState`` (module docstring)."""

    def __init__(self, state: ElasticMambaState, size: int, device: str) -> None:
        self.state = state
        super().__init__(size, device)

    @property
    def free_slots(self) -> torch.Tensor:  # read by SGLang's leak check
        return torch.tensor(self.state.free_slots(), dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return self.state.free_count()

    def _do_alloc(self, need_size: int) -> torch.Tensor | None:
        slots = self.state.take(need_size)
        if slots is None:
            return None
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.state.give(free_index.tolist())

    def clear(self) -> None:
        held = [s for s in range(1, self.state.slots) if self.state._taken[s]]
        if held:
            self.state.give(held)


def check_mamba_pool(pool: Any, *, envelope: bool) -> None:
    """Refuse a ``MambaPool`` configuration the elastic state cannot back, naming it."""
    unsupported = {
        "the page-major Mamba envelope layout (--enable-page-major-kv-layout)": envelope,
        "enable_memory_saver (torch_memory_saver)": bool(
            getattr(pool.memory_saver_adapter, "enabled", False)
        ),
        "a custom CUDA memory pool": bool(getattr(pool, "custom_mem_pool", None)),
    }
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise UnsupportedConfiguration(
            f"kvcore elastic Mamba state does not support {', '.join(bad)}",
            hint="turn the named option off or start without --kvcore-elastic",
        )


def build_mamba_state(
    pool: Any,
    config: ElasticConfig,
    *,
    layers: int,
    conv_shapes: Sequence[Sequence[int]],
    conv_dtype: torch.dtype,
    temporal_shape: Sequence[int],
    temporal_dtype: torch.dtype,
    slots: int,
    gate: SharedGate | None,
    device_index: int,
    name: str,
) -> ElasticMambaState:
    """The elastic state behind ``pool`` (a ``MambaPool`` being built; the scope's
    ``mamba_buffers`` seam): checks the pool, builds the state, sets ``pool.kvcore_mamba``.
    Raises ``UnsupportedConfiguration`` naming a setting kvcore cannot back."""
    from sglang.srt.mem_cache import memory_pool

    check_mamba_pool(pool, envelope=False)
    npu = bool(getattr(memory_pool, "_is_npu", False))
    amx = bool(getattr(memory_pool, "_is_cpu", False)) and bool(
        getattr(memory_pool, "_cpu_has_amx_support", False)
    )
    if npu or amx:
        raise UnsupportedConfiguration(
            f"kvcore elastic Mamba state does not support the {'NPU' if npu else 'CPU AMX'} "
            "conv-state layout",
            hint="start without --kvcore-elastic on this device",
        )
    states = [StateTensor(f"conv{i}", tuple(s), conv_dtype) for i, s in enumerate(conv_shapes)]
    states.append(StateTensor("temporal", tuple(temporal_shape), temporal_dtype))
    state = ElasticMambaState(
        config,
        layers=layers,
        states=states,
        slots=slots,
        device_index=device_index,
        gate=gate,
        name=name,
    )
    pool.kvcore_mamba = state
    return state


def elastic_mamba_allocator(mamba_pool: Any, upstream: Any) -> ElasticMambaSlotAllocator:
    """The elastic equivalent of the ``MambaSlotAllocator`` SGLang built for ``mamba_pool``
    (the scope's ``mamba_allocator`` seam). Raises ``UnsupportedConfiguration`` when kvcore
    did not build the pool's state (the envelope layout, a pool subclass) or the allocator is
    not the stock one."""
    state = getattr(mamba_pool, "kvcore_mamba", None)
    if state is None:
        check_mamba_pool(mamba_pool, envelope=getattr(mamba_pool, "_raw", None) is not None)
        raise UnsupportedConfiguration(
            f"kvcore elastic KV does not support SGLang's {type(mamba_pool).__name__} "
            "(its state was not built by kvcore)",
            hint="supported: MambaPool in its default per-layer layout; start without "
            "--kvcore-elastic",
        )
    if type(upstream) is not MambaSlotAllocator:
        raise UnsupportedConfiguration(
            f"kvcore elastic KV does not support SGLang's {type(upstream).__name__}",
            hint="supported Mamba slot allocator: MambaSlotAllocator",
        )
    return ElasticMambaSlotAllocator(state, upstream.size, upstream.device)
