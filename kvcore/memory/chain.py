"""The one builder of a KV cache's memory chain: backend -> cache -> mapper -> pages -> ledger.

Every owner of kvcore memory (vLLM's one-process memory and its TP x PP engine core and
workers, SGLang's KV pools, the per-slot state ranges of ``kvcore.memory.slots``) holds the
same chain of parts, each built on the one before:

``backend``
    the VMM backend (``kvcore.vmm``); opened by the builder from ``open_backend`` or given.
``geometry``
    how blocks sit on pages (``kvcore.memory.geometry.KVGeometry``); given, or planned from
    the backend (its granularity) once it is open.
``cache``, ``mapper``
    the ``VirtualKVCache`` reserving the ranges and its ``LocalPageMapper``; or, instead of
    both, a given ``PageMapper`` (an engine core's channel coordinator driving every rank).
``gate``
    the ``MemoryGate`` the page allocator charges (``kvcore.budget.gate``); given, or opened by
    the builder once the mapper exists, so a chain that cannot reserve its ranges never
    registers a ledger record.
``pages``, ``ledger``
    the ``PageAllocator`` over the mapper and the gate, and the ``BlockLedger`` an engine
    draws blocks from (made by the owner's ``ledger`` factory: the ledger class and its
    pinned blocks are the engine's). A chain without a gate stops at the mapper (a TP
    worker's: the engine core's allocator drives it over the channel); one without a
    ``ledger`` factory stops at the page allocator (slots take pages by id).

``MemoryChain.build`` builds them in that order. If a step raises, every part built so far,
and every part handed in that the chain owns (``owns_backend``, ``owns_mapper``,
``owns_gate``), is closed (each failure logged) and the step's exception is re-raised: a
failed build leaves nothing reserved, mapped or registered. ``MemoryChain.close`` releases
the parts users first (``parts()``): the page allocator, the mapper, the cache, then the gate
(its ledger record outlives every page it charged) and the backend, through
``kvcore.memory.teardown.close_parts``: every one even when an earlier one fails, then the
owner's error policy, once. The ledger has nothing of its own to close (its ``close`` is
the page allocator's).

Layering: this module knows nothing of engines; an adapter passes the gate (or a function
opening it) and the ledger factory in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcore.memory.blocks import BlockLedger
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator
from kvcore.memory.switch_interval import DEFAULT_BACKGROUND_SWITCH_S
from kvcore.memory.teardown import CloseOnce, OnError, PartFailure, close_parts
from kvcore.memory.virtual_cache import VirtualKVCache

if TYPE_CHECKING:
    from kvcore.budget.gate import MemoryGate
    from kvcore.memory.mapper import PageMapper
    from kvcore.vmm.base import VmmBackend

__all__ = ["GateOpener", "LedgerFactory", "MemoryChain", "block_ledger"]

LedgerFactory = Callable[[KVGeometry, PageAllocator], BlockLedger]
"""Makes the chain's block ledger over its geometry and page allocator."""
GateOpener = Callable[["VmmBackend | None", KVGeometry], "MemoryGate"]
"""Opens the chain's gate, given its backend (``None`` over a given mapper) and geometry."""


def block_ledger(
    pinned_blocks: Iterable[int] = (0,), *, array_stacks: bool = False
) -> LedgerFactory:
    """A plain ``BlockLedger`` with ``pinned_blocks`` taken for good (default block 0, the
    engines' null / padding block, whose page then stays backed); ``array_stacks`` as
    ``BlockLedger`` takes it (for a caller that moves ids through tensors)."""
    pinned = tuple(pinned_blocks)

    def make(geometry: KVGeometry, pages: PageAllocator) -> BlockLedger:
        return BlockLedger(geometry, pages, pinned_blocks=pinned, array_stacks=array_stacks)

    return make


@dataclass(eq=False)
class MemoryChain:
    """The parts of one KV cache's memory (module docstring). Build it with ``build``; an
    absent part is ``None``. ``label`` prefixes the parts' names in close logs."""

    geometry: KVGeometry
    backend: VmmBackend | None = None
    cache: VirtualKVCache | None = None
    mapper: PageMapper | None = None
    gate: MemoryGate | None = None
    pages: PageAllocator | None = None
    ledger: BlockLedger | None = None
    owns_backend: bool = True
    owns_mapper: bool = True
    owns_gate: bool = True
    label: str = ""
    _once: CloseOnce = field(default_factory=CloseOnce, repr=False)

    @classmethod
    def build(
        cls,
        geometry: KVGeometry | Callable[[VmmBackend | None], KVGeometry],
        *,
        backend: VmmBackend | None = None,
        open_backend: Callable[[], VmmBackend] | None = None,
        owns_backend: bool = True,
        mapper: PageMapper | None = None,
        owns_mapper: bool = True,
        gate: MemoryGate | None = None,
        open_gate: GateOpener | None = None,
        owns_gate: bool = True,
        ledger: LedgerFactory | None = None,
        sanity: bool = False,
        contiguous: bool = False,
        pool_pages: int | None = None,
        reserve_min: int = 0,
        reserve_max: int = 0,
        map_ahead: int = 0,
        switch_interval: float | None = DEFAULT_BACKGROUND_SWITCH_S,
        label: str = "",
    ) -> MemoryChain:
        """Build the chain (module docstring), step by step:

        1. the backend: ``backend``, or ``open_backend()`` (then owned); neither is allowed
           only with ``mapper``;
        2. the geometry: ``geometry``, or ``geometry(backend)`` (a plan from its granularity);
        3. over a backend without ``mapper``: ``VirtualKVCache(backend, geometry, sanity=,
           contiguous=)`` and ``LocalPageMapper(cache, pool_pages=)`` (``None``: the
           mapper's default idle handle pool, at most 256 MiB);
        4. the gate: ``gate``, or ``open_gate(backend, geometry)``; with neither the chain
           ends here (no allocator);
        5. ``PageAllocator(mapper, gate)`` with the reserve bounds and ``map_ahead`` clipped to
           the page count, and ``switch_interval`` (its background rounds');
        6. ``ledger(geometry, pages)`` when a factory is given.

        ``owns_*``: whether ``close`` (and a failed build) closes a part handed in; parts the
        builder makes are always its own. Returns the chain; raises what the failing step
        raises (``BackendUnavailable``/``VmmError``, ``GeometryError``, ``LedgerError``,
        ``PoolFailed`` when a pinned block's page cannot be mapped, ...) after closing
        everything it owns, and ``ValueError`` when neither a backend nor a mapper is
        given."""
        if backend is None and open_backend is None and mapper is None:
            raise ValueError("memory chain: needs a backend, a way to open one, or a mapper")
        cache: VirtualKVCache | None = None
        pages: PageAllocator | None = None
        try:
            if backend is None and open_backend is not None:
                backend, owns_backend = open_backend(), True
            plan = geometry if isinstance(geometry, KVGeometry) else geometry(backend)
            if mapper is None:
                assert backend is not None
                cache = VirtualKVCache(backend, plan, sanity=sanity, contiguous=contiguous)
                mapper = LocalPageMapper(cache, pool_pages=pool_pages)
                owns_mapper = True
            if gate is None and open_gate is not None:
                gate, owns_gate = open_gate(backend, plan), True
            made = None
            if gate is not None:
                pages = PageAllocator(
                    mapper,
                    gate,
                    reserve_min=min(reserve_min, plan.num_pages),
                    reserve_max=min(reserve_max, plan.num_pages),
                    map_ahead=min(map_ahead, plan.num_pages),
                    switch_interval=switch_interval,
                )
                if ledger is not None:
                    made = ledger(plan, pages)
        except BaseException:
            # the step's own error is what the caller sees; each close failure is logged
            close_parts(
                _named(
                    label,
                    pages=pages,
                    mapper=mapper if owns_mapper else None,
                    cache=cache,
                    gate=gate if owns_gate else None,
                    backend=backend if owns_backend else None,
                ),
                on_error="log",
            )
            raise
        return cls(
            plan,
            backend=backend,
            cache=cache,
            mapper=mapper,
            gate=gate,
            pages=pages,
            ledger=made,
            owns_backend=owns_backend,
            owns_mapper=owns_mapper,
            owns_gate=owns_gate,
            label=label,
        )

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        return self._once.closed

    def parts(self) -> list[tuple[str, object]]:
        """The parts ``close`` releases, in order, named for ``close_parts`` (an owner of
        several chains closes all of their parts in one ``close_parts`` call)."""
        return _named(
            self.label,
            pages=self.pages,
            mapper=self.mapper if self.owns_mapper else None,
            cache=self.cache,
            gate=self.gate if self.owns_gate else None,
            backend=self.backend if self.owns_backend else None,
        )

    def close(
        self, *, on_error: OnError = "raise", tolerate: tuple[type[Exception], ...] = ()
    ) -> list[PartFailure]:
        """Release every part (``parts()`` order), each even when an earlier one fails; the
        first call does the work, later ones return ``[]`` at once. ``on_error`` is the
        owner's policy (``close_parts``). ``tolerate``: exceptions that mean a part's memory
        is gone already (``PoolFailed`` after a fail-stop, whose memory goes with the
        processes that held it): logged at INFO, not failures. Returns the failures when it
        does not raise."""
        if not self._once.begin():
            return []
        return close_parts(self.parts(), on_error=on_error, tolerate=tolerate)


def _named(
    label: str,
    *,
    pages: PageAllocator | None,
    mapper: object,
    cache: VirtualKVCache | None,
    gate: object,
    backend: VmmBackend | None,
) -> list[tuple[str, object]]:
    """The closing order of a chain's parts (``None``: absent, or not the chain's to close)."""
    prefix = f"{label}'s " if label else ""
    parts: list[tuple[str, object]] = [
        (f"{prefix}page allocator", pages),
        (f"{prefix}mapper", mapper),
        (f"{prefix}virtual KV cache", cache),
        (f"{prefix}memory gate", gate),
    ]
    if backend is not None:
        parts.append((f"{backend.name} backend", backend))
    return parts
