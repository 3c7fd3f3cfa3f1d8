"""The page-mapping seam: how a page id gets (and loses) physical backing.

A ``PageMapper`` owns the virtual KV tensors of one process (or, through the worker channel,
of every TP x PP worker of an engine) and applies page transitions to them. The page
allocator (``kvcore.memory.pages``) decides *which* page changes state and calls a mapper to do it:

* single process: ``kvcore.memory.local_mapper.LocalPageMapper`` maps into this process's
  tensors;
* vLLM with TP/PP: ``kvcore.parallel.channel``'s coordinator implements ``PageMapper`` by
  running the same transition on every worker as one transaction.

Page ids are ``0 .. num_pages-1``. One page id backs the same byte range of every layer's
K and V buffers, so mapping one page id costs ``page_bytes`` of device memory on each worker
(``KVGeometry.page_device_bytes``: every handle of the page, not one handle's
``KVGeometry.page_bytes``).

Transitions (the allocator's ``PageState`` diagram in ``kvcore.memory.pages`` drives them):

``map(ids)``
    unmapped -> mapped. All-or-nothing across every handle, layer and worker: on failure
    everything this call mapped is rolled back and the error is raised. Raises
    ``OutOfDeviceMemory`` when physical memory ran out (the caller treats it as a miss),
    ``PageQuarantined`` when a rollback itself failed (those pages are never handed out
    again), ``PoolFailed`` when the mapper can no longer vouch for its state.
``prepare_unmap(ids, synchronize=True)``
    mapped -> unmap prepared. Synchronises the device so no running kernel reads the pages,
    replaces their mappings with the read-only zero page, keeps the physical handles.
    ``synchronize=False`` lets the mapper skip the wait: the caller vouches that a
    synchronize made after these pages left use has already returned (the page allocator
    unmaps a round's pages in chunks and waits for the device once, in the first chunk's
    prepare); a mapper may wait anyway (the channel coordinator's workers do). The
    page allocator's background thread calls it while another thread may call ``map`` on
    other pages, so a mapper must accept that; ``LocalPageMapper`` waits for the device
    outside its lock, so such a ``map`` does not wait for the device (the channel
    coordinator still holds its lock through the workers' exchange).
``commit_unmap(ids)``
    unmap prepared -> unmapped. Releases (or pools) the handles. Idempotent.
``abort_unmap(ids)``
    unmap prepared -> mapped. Restores the original mappings from the kept handles.

Device memory held (what the memory gate must be charged for). A mapper may keep physical
memory beyond its mapped pages: handles pooled after ``commit_unmap`` for reuse, handles
whose release failed and waits for a retry, the handles of quarantined pages. It reports
them, so the page allocator charges its ``MemoryGate`` exactly what the device holds:

``held_bytes``
    device bytes held now, per worker: every physical handle created and not yet released
    (mapped and prepared pages, quarantined pages, pooled handles, failed releases). Over
    several workers, the largest worker's figure (each worker is on its own GPU; the gate
    stands for the fullest). Changes only inside this mapper's own calls.
``pooled_pages``
    how many pages a ``map`` can back from pooled handles without new device memory (over
    several workers, the smallest worker's figure): a map of ``n`` pages grows
    ``held_bytes`` by at most ``max(n - pooled_pages, 0) * page_bytes``.
``trim_pool()``
    releases every pooled handle (memory back to the driver) and retries failed releases.
    Raises the first ``VmmError`` after trying them all (what failed stays held).
``fixed_bytes`` (optional; not part of the protocol)
    device bytes held for the mapper's whole life whatever the page states, not counted in
    ``held_bytes``: ``LocalPageMapper`` reports its cache's shared zero page. The page
    allocator charges them to its gate from its construction to its ``close``; a mapper
    without the attribute holds none.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class MappingState(enum.Enum):
    """Where one page id stands in a ``PageMapper``: ``LocalPageMapper`` and the channel
    coordinator both keep one per page id, moved only by the transitions above."""

    UNMAPPED = "unmapped"
    """No physical backing: reads hit the zero page."""
    MAPPED = "mapped"
    PREPARED = "prepared"
    """Unmap prepared: zero page mapped, the physical handles kept for an abort."""
    QUARANTINED = "quarantined"
    """A rollback failed: never handed out again."""


@runtime_checkable
class PageMapper(Protocol):
    """Applies page transitions to virtual KV tensors. See the module docstring."""

    @property
    def num_pages(self) -> int:
        """Logical pages covered by the virtual tensors."""
        ...

    @property
    def page_bytes(self) -> int:
        """Device bytes one mapped page id costs on one worker (all layers and buffers)."""
        ...

    def map(self, page_ids: Sequence[int]) -> None:
        """Back ``page_ids`` with physical memory, all or nothing."""
        ...

    def prepare_unmap(self, page_ids: Sequence[int], *, synchronize: bool = True) -> None:
        """Phase one of unmap: wait for the device (unless ``synchronize=False``, module
        docstring), zero-page the mappings, keep the handles."""
        ...

    def commit_unmap(self, page_ids: Sequence[int]) -> None:
        """Phase two of unmap: release the kept handles. Idempotent."""
        ...

    def abort_unmap(self, page_ids: Sequence[int]) -> None:
        """Undo a prepared unmap: restore the mappings from the kept handles."""
        ...

    @property
    def held_bytes(self) -> int:
        """Device bytes held now (per worker; the largest worker's), pooled and
        quarantined memory included. See the module docstring."""
        ...

    @property
    def pooled_pages(self) -> int:
        """Pages a ``map`` can back from pooled handles, with no new device memory."""
        ...

    def trim_pool(self) -> None:
        """Release every pooled handle; retry failed releases."""
        ...

    def close(self) -> None:
        """Unmap and release everything; the tensors stay valid views of the zero page."""
        ...
