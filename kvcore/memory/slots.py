"""Per-slot state tensors whose pages are mapped while slots are taken.

Recurrent models (Mamba, linear attention) keep one fixed-size *cell* per request slot:
conv and SSM state in every such layer. Engines hold it in layer-major tensors
``(layers, slots, *shape)``, one per state (SGLang's ``MambaPool``). ``SlotStates`` gives
them those tensors from kvcore: one virtual range per state, laid out as
``(layers, slots, *shape)`` except that each layer's slot array is padded to whole pages (the
layer stride; within a layer the slots are contiguous, as the engines' kernels index them).

Pages. Each state's page is ``kvcore.memory.families.plan_rows(row, granularity, pad=False)``: a
whole number ``N`` of slot rows exactly (a layer-major tensor cannot take a padded slot
stride). A Qwen3-Next-like SSM state of 2 MiB per slot and layer is one slot per 2 MiB
page; its 72 KiB conv state 256 slots per 18 MiB page. Page ``j`` of every layer holds slots
``j*N .. (j+1)*N - 1``; those ``layers`` pages are mapped together when the first of its
slots is taken (``take``) and unmapped when the last is freed (``give``), per state, all
through one gate. Slots past ``slots`` on the last page (the partial tail) are mapped with
that page and never handed out. ``take`` hands out the lowest free slots so slots share
pages; it is all or nothing across states (a miss gives back what it mapped and returns
``None``).
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcore.errors import InvalidTransition, PoolFailed
from kvcore.memory.chain import MemoryChain
from kvcore.memory.families import plan_rows
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.pages import PageAllocator
from kvcore.memory.teardown import CloseOnce, OnError, close_parts

if TYPE_CHECKING:
    from kvcore.budget.gate import MemoryGate
    from kvcore.vmm.base import VmmBackend

__all__ = ["SlotStates", "StateTensor"]


@dataclass(frozen=True)
class StateTensor:
    """One per-slot state of every layer: ``shape`` elements of ``dtype`` per slot and layer."""

    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        item: int = torch.empty(0, dtype=self.dtype).element_size()
        return math.prod(self.shape) * item


class _StatePages:
    """One state tensor's memory chain (virtual range, mapper, page allocator; no ledger:
    slots take their pages by id) and per-layer page use counts. The backend and the gate
    are the ``SlotStates``'s: it closes them once, after every state's chain."""

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
        geometry = KVGeometry(
            num_layers=1,
            kv_buffers=1,
            block_bytes=spec.row_bytes,
            num_blocks=layers * self.layer_pages * self.per_page,
            page_bytes=plan.page_bytes,
            granularity=gran,
            layout="per-layer",
        )
        self.chain = MemoryChain.build(
            geometry,
            backend=backend,
            owns_backend=False,
            gate=gate,
            owns_gate=False,
            sanity=sanity,
            pool_pages=0,  # pages are taken by id (a slot's own): an idle pool would not serve them
            label=f"{spec.role} state",
        )
        assert self.chain.pages is not None and self.chain.cache is not None
        self.geometry = geometry
        self.pages: PageAllocator = self.chain.pages
        self.uses = [0] * self.layer_pages  # slots in use on page j of every layer
        view = self.chain.cache.view(0, 0, spec.dtype, block_shape=spec.shape)
        self.tensor = view.view(layers, self.layer_pages * self.per_page, *spec.shape)[:, :slots]

    def page_ids(self, js: Sequence[int]) -> list[int]:
        """The page ids of per-layer page ``j`` in every layer."""
        lp = self.layer_pages
        return [layer * lp + j for j in js for layer in range(self.layers)]


class SlotStates:
    """Per-slot state tensors backed on demand (module docstring).

    ``states`` in the engine's order; ``slots`` slot ids ``0 .. slots - 1``, of which
    ``reserved_slots`` are taken for good (SGLang's dummy slot 0). ``gate`` admits every
    page (a ``GateShare`` of the instance's ``SharedGate``, or a gate of its own); it is
    closed with this object, and so is ``backend`` when ``owns_backend``. Raises
    ``GeometryError`` when a state's exact page exceeds the largest page, ``VmmError`` from
    the backend, ``PoolFailed`` when the reserved slots' pages cannot be mapped; nothing is
    left reserved or mapped on failure.
    """

    def __init__(
        self,
        backend: VmmBackend,
        gate: MemoryGate,
        *,
        layers: int,
        states: Sequence[StateTensor],
        slots: int,
        reserved_slots: Sequence[int] = (0,),
        sanity: bool = False,
        owns_backend: bool = False,
    ) -> None:
        self.slots = slots
        self.backend = backend
        self.gate = gate
        self._owns_backend = owns_backend
        self._lock = threading.Lock()
        self._once = CloseOnce()
        self._parts: list[_StatePages] = []
        self._pinned: frozenset[int] = frozenset()
        try:
            for spec in states:
                self._parts.append(
                    _StatePages(
                        spec, layers=layers, slots=slots, backend=backend, gate=gate, sanity=sanity
                    )
                )
            self._taken = bytearray(slots)
            reserved = sorted(set(reserved_slots))
            self._free = [s for s in range(slots) if s not in reserved]  # sorted: a heap
            if reserved and not self._map_slots(reserved):
                raise PoolFailed(
                    f"kvcore: cannot map the state pages of reserved slots {reserved}",
                    hint="free device memory or raise the instance's limit, then restart",
                )
            for s in reserved:
                self._taken[s] = 1
            self._pinned = frozenset(reserved)
        except BaseException:
            self._teardown(on_error="log")  # the error that stopped the start is raised
            raise

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Each state's ``(layers, slots, *shape)`` tensor at a stable address, in order."""
        return [p.tensor for p in self._parts]

    def free_count(self) -> int:
        """Slots ``take`` may still hand out (logical; the budget may refuse their pages)."""
        return len(self._free)

    def held_slots(self) -> list[int]:
        """The slots taken now (reserved ones excluded), ascending."""
        return [s for s in range(self.slots) if self._taken[s] and s not in self._pinned]

    def available(self) -> int:
        """Slots ``take`` could hand out now: the free count, or under a gate with a
        ``headroom()`` the free slots (lowest first, as ``take`` picks them) whose new pages
        that headroom pays for. Pages queued for unmap count as new (conservative)."""
        room_of = getattr(self.gate, "headroom", None)
        room = room_of() if callable(room_of) else None
        if not isinstance(room, int):
            return len(self._free)
        with self._lock:
            order = sorted(self._free)
        counted: list[set[int]] = [set() for _ in self._parts]
        n = 0
        for slot in order:
            cost = 0
            for part, seen in zip(self._parts, counted, strict=True):
                j = slot // part.per_page
                if part.uses[j] == 0 and j not in seen:
                    cost += part.layers * part.geometry.page_bytes
            if cost > room:
                break
            room -= cost
            for part, seen in zip(self._parts, counted, strict=True):
                j = slot // part.per_page
                if part.uses[j] == 0:
                    seen.add(j)
            n += 1
        return n

    def free_slots(self) -> list[int]:
        """The free slot ids, ascending."""
        return sorted(self._free)

    def mapped_pages(self) -> list[int]:
        """Per state, the pages mapped now (after background unmaps settle)."""
        out = []
        for p in self._parts:
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
        ``InvalidTransition`` (nothing changed) for a reserved or free slot or one named
        twice."""
        with self._lock:
            ids = list(slots)
            bad = [
                s for s in ids if not 0 <= s < self.slots or not self._taken[s] or s in self._pinned
            ]
            if bad or len(set(ids)) != len(ids):
                raise InvalidTransition(
                    f"slots {bad or ids}: not allocated, reserved, or named twice",
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
                    part.pages.release(part.page_ids(emptied))

    def _map_slots(self, slots: Sequence[int]) -> bool:
        done: list[tuple[_StatePages, list[int]]] = []
        for part in self._parts:
            per_page, uses = part.per_page, part.uses
            fresh = sorted({s // per_page for s in slots if uses[s // per_page] == 0})
            if fresh and not part.pages.acquire_ids(part.page_ids(fresh)):
                for earlier, js in done:
                    earlier.pages.release(earlier.page_ids(js))
                return False
            done.append((part, fresh))
        for part in self._parts:
            for s in slots:
                part.uses[s // part.per_page] += 1
        return True

    def close(self) -> None:
        """Unmap every page and free the ranges (the engine is going away), then close the
        gate (and the backend when owned). Idempotent. Every part is released even when an
        earlier one fails; the first failure is raised after."""
        if self._once.begin():
            self._teardown(on_error="raise")

    def _teardown(self, *, on_error: OnError) -> None:
        parts = [named for part in self._parts for named in part.chain.parts()]
        parts.append(("memory gate", self.gate))
        if self._owns_backend:
            parts.append((f"{self.backend.name} backend", self.backend))
        close_parts(parts, on_error=on_error)
