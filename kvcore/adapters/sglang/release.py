"""Block ids SGLang frees on the GPU, handed to kvcore's host ledger without waiting for it.

SGLang frees KV as a device tensor of token (or page) ids: a finished request's row of
``req_to_token``, an evicted radix leaf's value. Upstream's token allocator appends that
tensor to its device free list, queued behind the work already on the stream, and never
waits. kvcore's ledger lives on the host, so the ids must come to the host; reading them at
once (``tolist``) waits for everything queued before them, which under SGLang's overlap
scheduler is the next batch's forward pass: the scheduler thread stops overlapping and
spins in the wait.

``PendingFrees`` instead copies each freed tensor into pinned host memory with a
non-blocking copy queued on the current stream (after the kernels that produced it, as
upstream's append), records an event behind it, and hands the ids to the ledger once the
event has completed (``settle``: the allocators call it before each allocation and at each
scheduler iteration). Until then the ids are neither free nor reusable, but counted
(``count``) so that the allocators' ``available_size`` reports them as upstream would. A
miss with frees in flight waits for them (``settle(wait=True)``) before it is a miss.

On the CPU there is nothing to overlap: ``add`` frees at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["PendingFrees"]


class Done(Protocol):
    """What marks a copy complete: ``torch.cuda.Event``'s two methods."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def _copy_to_host(ids: torch.Tensor) -> tuple[Done, torch.Tensor]:
    """Queue a copy of device tensor ``ids`` into pinned host memory on the current stream;
    the event behind it and the host tensor (valid once the event has completed)."""
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    return done, host


class PendingFrees:
    """Freed block ids on their way from the device to ``release`` (module docstring).

    ``release(ids)`` takes a list of distinct block ids (the ledger's free); ``on_device``
    says whether the freed tensors live on a GPU (else ``add`` releases at once);
    ``transfer`` starts one copy (tests give their own to hold a copy in flight)."""

    def __init__(
        self,
        release: Callable[[list[int]], None],
        on_device: bool,
        transfer: Callable[[torch.Tensor], tuple[Done, torch.Tensor]] = _copy_to_host,
    ) -> None:
        self._release = release
        self._on_device = on_device
        self._transfer = transfer
        self._queue: deque[tuple[Done, torch.Tensor]] = deque()
        self.count = 0
        """Block ids added and not yet released."""

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, ids: torch.Tensor) -> None:
        """Free the distinct block ids in ``ids`` (a 1-D integer tensor, not empty): at once
        on the CPU, else once the copy queued now has completed."""
        if not self._on_device:
            self._release(ids.tolist())
            return
        self._queue.append(self._transfer(ids))
        self.count += ids.numel()

    def settle(self, wait: bool = False) -> int:
        """Release every freed tensor whose copy has completed, oldest first, stopping at the
        first still in flight; with ``wait``, wait for all. Returns the ids released."""
        released = 0
        queue = self._queue
        while queue:
            done, host = queue[0]
            if wait:
                done.synchronize()
            elif not done.query():
                break
            queue.popleft()
            n = host.numel()
            self.count -= n
            released += n
            self._release(host.tolist())
        return released
