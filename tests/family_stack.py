"""The memory stack the model-family layout tests run on: backend -> ``VirtualKVCache`` on a
``FamilyLayout``'s geometry -> ``LocalPageMapper`` -> ``PageAllocator`` -> one
``BlockLedger`` for every cache group; plus write/read helpers that check views against the
raw bytes of the virtual ranges. Used by ``tests/memory/test_families.py`` and the vLLM spec tests
under ``tests/engines/vllm/``.

The allocator runs without its background thread (``background=False``, a ``FakeClock``):
``Stack.mapped()`` runs the pending rounds (``flush``) before it looks, so what is mapped
never depends on when a thread got to run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcore.budget.gate import MemoryGate
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.families import FamilyLayout
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.vmm import VmmBackend, open_backend
from kvcore.vmm.faults import FaultInjector
from kvcore.vmm.host import HostBackend
from tests.memstack import FakeClock, MemStack

MiB = 1 << 20
HOST_GRANULARITY = 64 << 10


@dataclass
class Stack:
    """A ``MemStack`` on a family layout's geometry, with the one ledger every group uses."""

    mem: MemStack
    layout: FamilyLayout
    ledger: BlockLedger

    @property
    def cache(self) -> VirtualKVCache:
        return self.mem.cache

    def raw(self, part: int = 0) -> torch.Tensor:
        """Every byte of virtual range ``part`` (whole pages, the tail included) on the CPU."""
        va, size = self.cache.ranges[part]
        self.mem.vmm.synchronize()
        return self.mem.vmm.as_tensor(va, size, torch.uint8).cpu()

    def mapped(self) -> set[int]:
        """The pages mapped once the pending background rounds have run."""
        assert self.mem.pages.flush()
        return self.mem.mapped_pages()

    def close(self) -> None:
        self.mem.close()  # also proves no handle or mapping is left

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def granularity(backend: str) -> int:
    return HOST_GRANULARITY if backend == "host" else 2 * MiB


def open_stack(backend: str, layout: FamilyLayout, gate: MemoryGate | None = None) -> Stack:
    """A fresh stack on ``layout.geometry``; ``gate`` admits its page memory (default: none)."""
    gran = layout.geometry.granularity
    inner: VmmBackend
    if backend == "host":
        handles = layout.geometry.num_pages * layout.geometry.handles_per_page + 1
        inner = HostBackend(device_bytes=handles * layout.geometry.page_bytes, granularity=gran)
    else:
        inner = open_backend(backend)
    vmm = FaultInjector(inner)
    cache = VirtualKVCache(vmm, layout.geometry)
    mapper = LocalPageMapper(cache, pool_pages=0)  # unmapped pages release their memory
    clock = FakeClock()
    pages = PageAllocator(mapper, gate, retry_interval=0.01, clock=clock, background=False)
    mem = MemStack(vmm, layout.geometry, cache, mapper, pages, clock=clock)
    return Stack(mem, layout, BlockLedger(layout.geometry, pages))


def pattern(view: torch.Tensor, block: int, salt: int) -> torch.Tensor:
    """Distinct values for ``view[block]`` (exact in bf16: small integers)."""
    n = math.prod(view.shape[1:])
    vals = (torch.arange(n, dtype=torch.int64) * 7 + block * 13 + salt * 101) % 251 + 1
    return vals.reshape(view.shape[1:]).to(view.dtype).to(view.device)


def raw_state(s: Stack, layer: str, role: str, block: int) -> torch.Tensor:
    """The bytes of ``role`` of ``layer`` in ``block``, read from the raw range at the address
    the layout promises, reinterpreted as the state's dtype and shape."""
    p = s.layout.place(layer, role)
    start = block * s.layout.geometry.block_bytes + p.offset
    nbytes = math.prod(p.shape) * torch.empty(0, dtype=p.dtype).element_size()
    return s.raw(p.part)[start : start + nbytes].view(p.dtype).reshape(p.shape)


def write_and_check(s: Stack, layers_roles: list[tuple[str, str]], blocks: list[int]) -> None:
    views = {key: s.layout.view(s.cache, *key) for key in layers_roles}
    for salt, view in enumerate(views.values()):
        for b in blocks:
            view[b] = pattern(view, b, salt)
    for salt, (key, view) in enumerate(views.items()):
        for b in blocks:
            expected = pattern(view, b, salt).cpu()
            assert torch.equal(view[b].cpu(), expected), (key, b)
            assert torch.equal(raw_state(s, *key, b), expected), (key, b)
