"""Elastic Mamba / linear-attention state for SGLang: ``MambaPool`` and its slot allocator.

SGLang keeps a hybrid Mamba model's recurrent state in ``MambaPool``: per conv state shape
one ``conv`` tensor and one ``temporal`` (SSM) tensor, each ``(layers, size + 1, *shape)``
(layer-major; slot 0 is SGLang's dummy slot), and a ``MambaSlotAllocator`` in the
``HybridReqToTokenPool`` hands one slot to each request. A slot's *cell* is its conv and SSM
state in every Mamba layer.

``build_mamba_state`` gives the pool those tensors from kvcore: a ``kvcore.memory.slots.SlotStates``
over the pool's conv and temporal shapes (one virtual range per state, SGLang's layer-major
layout with each layer's slots padded to whole pages; ``plan_rows(pad=False)`` pages; a
slot's pages mapped while it is taken; the partial tail never handed out), drawing on the
rank's one gate (``SharedGate``) with the KV pools. Slot 0, SGLang's dummy slot, stays
mapped.

``ElasticMambaSlotAllocator`` is SGLang's ``MambaSlotAllocator`` over that state: the lowest
free slots first (so slots share pages), ``None`` when slots or pages are short. Its
``available_size()`` is the logical free count (pool stats, the idle leak check) and
``schedulable_available_size()`` (SGLang's own split for byte-coordinated allocators, read
by ``ensure_mamba_capacity`` and the prefill budget) counts under a budget only the slots
whose pages the headroom pays for, so SGLang evicts or waits before an allocation misses.
At attention-TP > 1 under a budget the scope calls ``agree``: every slot allocation
(``_do_alloc``, which SGLang's group pre-allocation also goes through) is one
``kvcore.parallel.agreement`` decision (a MIN all-reduce of ``(ok, schedulable slots)`` over the
attention-TP CPU group; the slots go back on the ranks that got them when a peer missed),
and ``schedulable_available_size()`` is the agreed count plus the slots freed since. The
agreed room is refreshed with the KV allocator's in its per-iteration ``kvcore_step``.

Seam. SGLang 0.5.23 allocates the state with ``torch.zeros`` inside ``MambaPool.__init__``
and builds the slot allocator in ``HybridReqToTokenPool._init_mamba_pool``; the patch series
calls ``memory_pool.MAMBA_STATE_HOOK.mamba_buffers(pool, ...)`` and
``.mamba_allocator(pool, upstream)`` there (``ElasticScope`` is the hook).

Refused at start-up, naming the setting: the page-major envelope layout
(``--enable-page-major-kv-layout``; kvcore's envelope views are proven in
``test_families_sglang.py`` but not wired), NPU/AMX conv layouts, a memory saver or custom
memory pool, and a slot row whose exact page exceeds ``max_page_bytes``. Side buffers
(speculative intermediates, ReplaySSM rings, PLE pools) stay SGLang's static allocations.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sglang
import torch
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

from kvcore.adapters.gates import open_gate
from kvcore.errors import GeometryError, UnsupportedConfiguration
from kvcore.memory.slots import SlotStates, StateTensor
from kvcore.parallel.agreement import AgreedRoom, Agreement
from kvcore.vmm import open_backend

if TYPE_CHECKING:
    from kvcore.adapters.config import ElasticConfig
    from kvcore.budget.shared_gate import SharedGate

__all__ = [
    "ElasticMambaSlotAllocator",
    "build_mamba_state",
    "check_mamba_pool",
    "elastic_mamba_allocator",
]


class ElasticMambaSlotAllocator(MambaSlotAllocator):  # type: ignore[misc]
    """SGLang's ``MambaSlotAllocator`` over a ``SlotStates`` (module docstring)."""

    def __init__(self, state: SlotStates, size: int, device: str) -> None:
        self.state = state
        self._room: AgreedRoom | None = None
        super().__init__(size, device)

    def agree(self, agreement: Agreement) -> None:
        """Agree every slot allocation and the schedulable slot count with the peer ranks
        (``kvcore.parallel.agreement``; the scope calls this under a physical budget at TP > 1, on
        every rank at the same point: it is a collective)."""
        state = self.state
        self._room = agreement.room(lambda: [state.available()], lambda: [state.free_count()])

    @property
    def free_slots(self) -> torch.Tensor:  # read by SGLang's leak check
        return torch.tensor(self.state.free_slots(), dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        """Free slots (logical): what SGLang's pool stats and idle leak check conserve."""
        return self.state.free_count()

    def schedulable_available_size(self) -> int:
        """SGLang's planner-facing count (``ensure_mamba_capacity``, the prefill budget):
        under a budget only the free slots whose pages the headroom pays for, so SGLang
        evicts cached states or holds requests back before ``alloc`` would miss; with an
        agreement the agreed count (the same on every rank, no collective)."""
        if self._room is not None:
            return self._room.available()
        return self.state.available()

    def _do_alloc(self, need_size: int) -> torch.Tensor | None:
        state = self.state
        if self._room is None:
            slots = state.take(need_size)
        else:  # one agreed decision: every rank takes its slots, or none does
            slots = self._room.decide(lambda: state.take(need_size), state.give)
        if slots is None:
            return None
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self._give(free_index.tolist())

    def clear(self) -> None:
        held = self.state.held_slots()
        if held:
            self._give(held)

    def _give(self, slots: list[int]) -> None:
        self.state.give(slots)
        if self._room is not None:
            self._room.freed(len(slots))


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
) -> SlotStates:
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
    backend = open_backend(config.backend, device_index, **dict(config.backend_options))
    try:
        make = functools.partial(
            open_gate,
            config,
            name=name,
            engine="sglang",
            engine_version=str(sglang.__version__),
            backend=backend,
        )
        share = make() if gate is None else gate.join(make)
    except BaseException:
        backend.close()
        raise
    try:  # the state takes the share and the backend over: closed with it, or if it fails
        state = SlotStates(
            backend,
            share,
            layers=layers,
            states=states,
            slots=slots,
            sanity=config.sanity,
            owns_backend=True,
        )
    except GeometryError as exc:
        shapes = ", ".join(f"{s.role} {s.shape} {s.dtype}" for s in states)
        raise UnsupportedConfiguration(
            f"kvcore elastic Mamba state: a per-slot row of this model ({shapes}) tiles no "
            f"page of SGLang's layer-major state tensors exactly: {exc}",
            hint="start without --kvcore-elastic for this model (or raise the largest page)",
        ) from exc
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
