"""The release fence for vLLM's overlapping batches (async scheduling, PP's batch queue).

With more than one batch in flight, vLLM's scheduler frees a request's blocks while a batch
it scheduled earlier may still read or write them on the device (a request that finished at
step ``k`` was already scheduled into step ``k+1``; a preempted request may be in the batch
still running). Reusing such a block in a later batch is safe (device work is ordered), but
unmapping its page is not. ``StepFence`` keeps every page emptied behind an in-flight step
mapped until that step's output has been processed:

* the patched ``Scheduler.schedule()`` calls ``ElasticBlockPool.step_scheduled(nonempty)``
  as it returns a batch, and ``Scheduler.update_from_output()`` calls
  ``ElasticBlockPool.step_done(nonempty)`` first thing: vLLM processes outputs once per
  scheduled step in FIFO order (its own deferred-free fence counts the same way), so the
  ``n``-th non-empty ``step_done`` means the ``n``-th non-empty batch has finished;
* ``FencedBlockLedger.free`` releases emptied pages behind fence ``scheduled`` (the last
  batch that could touch them), and ``step_done`` calls ``PageAllocator.retire(done)``:
  a page released behind step ``n`` stays ``FENCED`` (mapped, not reusable) until batch ``n``
  is done, then goes to the reserve or the unmap queue like any released page.

With one batch at a time (``done == scheduled`` whenever blocks are freed) a fence has passed
already and pages are released at once, so synchronous scheduling behaves as without it.
A disabled fence (``StepFence(pages, enabled=False)``, what a configuration without
overlapping batches gets) passes no fence at all.

Cost: a page emptied behind a batch in flight cannot be handed out again until that batch is
done (``PageAllocator`` re-acquires reserved and unmap-queued pages, not fenced ones), so
with overlapping batches up to one step's emptied pages are briefly unavailable.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvcore.memory.blocks import BlockLedger
from kvcore.memory.chain import LedgerFactory
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.pages import PageAllocator

__all__ = ["FencedBlockLedger", "StepFence", "fenced_ledger"]


class StepFence:
    """Counts the non-empty steps a vLLM scheduler handed out and finished (module
    docstring) and retires ``pages``' fences as steps finish. Thread-safe."""

    def __init__(self, pages: PageAllocator, *, enabled: bool) -> None:
        self.pages = pages
        self.enabled = enabled
        self.scheduled = 0
        """Non-empty batches handed to the executor so far."""
        self.done = 0
        """Non-empty batches whose output has been processed so far."""
        self._lock = threading.Lock()
        if enabled:
            pages.retire(0)  # fence 0 (nothing in flight yet) has passed

    def current(self) -> int | None:
        """The fence a page emptied now must wait for: the last batch handed out (``None``
        when disabled)."""
        return self.scheduled if self.enabled else None

    def step_scheduled(self, nonempty: bool) -> None:
        """The scheduler handed out a batch (``nonempty``: it schedules any token)."""
        if self.enabled and nonempty:
            with self._lock:
                self.scheduled += 1

    def step_done(self, nonempty: bool) -> int:
        """The output of the oldest batch in flight is being processed: its device work has
        finished. Returns the pages this released (0 when disabled or nothing waited)."""
        if not (self.enabled and nonempty):
            return 0
        with self._lock:
            if self.done >= self.scheduled:  # more outputs than batches: a caller bug
                return 0
            self.done += 1
            upto = self.done
        return self.pages.retire(upto)

    def in_flight(self) -> int:
        """Non-empty batches handed out whose output has not been processed yet."""
        with self._lock:
            return self.scheduled - self.done


class FencedBlockLedger(BlockLedger):
    """A ``BlockLedger`` whose ``free`` without an explicit fence releases emptied pages
    behind ``fence.current()`` (the last batch in flight). Everything else is
    ``BlockLedger``'s. Raises ``ValueError`` when ``fence`` retires another allocator."""

    def __init__(
        self,
        geometry: KVGeometry,
        pages: PageAllocator,
        fence: StepFence,
        pinned_blocks: Iterable[int] = (),
    ) -> None:
        if fence.pages is not pages:
            raise ValueError("fenced block ledger: the fence retires another page allocator")
        super().__init__(geometry, pages, pinned_blocks)
        self.fence = fence

    def free(self, block_ids: Sequence[int], fence: int | None = None) -> None:
        super().free(block_ids, self.fence.current() if fence is None else fence)


def fenced_ledger(*, release_fence: bool) -> LedgerFactory:
    """The ledger factory of an elastic vLLM block pool's ``MemoryChain``
    (``kvcore.memory.chain``), over a local mapper or the channel coordinator driving every
    TP x PP rank: a ``FencedBlockLedger`` with vLLM's null block 0 reserved, whose
    ``StepFence`` (``ledger.fence``) is enabled with ``release_fence`` (overlapping
    batches). Raises what ``BlockLedger`` raises (``PoolFailed`` when block 0's page cannot
    be mapped)."""

    def make(geometry: KVGeometry, pages: PageAllocator) -> FencedBlockLedger:
        fence = StepFence(pages, enabled=release_fence)
        return FencedBlockLedger(geometry, pages, fence, pinned_blocks=(0,))

    return make
