"""Block ids SGLang frees on the GPU, handed to kvcore's host ledger without waiting for it.

SGLang frees KV as a device tensor of token (or page) ids: a finished request's row of
``req_to_token``, an evicted radix leaf's value. Upstream's token allocator appends that
tensor to its device free list, queued behind the work already on the stream, and never
waits. kvcore's ledger lives on the host, so the ids must come to the host; reading them at
once (``tolist``) waits for everything queued before them, which under SGLang's overlap
scheduler is the next batch's forward pass: the scheduler thread stops overlapping and
spins in the wait.

``PendingFrees`` instead keeps each freed tensor on the device (an int64 copy, queued on the
current stream after the kernels that produced it, as upstream's append), copies it into
pinned host memory with a non-blocking copy behind that, records an event, and hands the
ids to the ledger once the event has completed (``settle``: the allocators call it before
each allocation and at each scheduler iteration). Until then the ids stay allocated in the
ledger but count as free (``count``), so that the allocators' ``available_size`` reports
them as upstream would; and an allocation the free blocks on the ledger's pages cannot meet
takes them on the device (``take``) before the ledger acquires a page, as upstream takes ids
from its device free list: SGLang's eviction before an allocation frees exactly the ids that
allocation needs, and waiting for them to reach the host would wait for the batch in flight.
Ids taken stay allocated in the ledger (they change owner, not state) and are not released
when their copy arrives.

On the CPU there is nothing to overlap: ``add`` frees at once. Ranks that agree their room
(TP > 1 under a budget) do not use it: the allocators free at once there, so that every
rank counts a free at the same point.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from kvcore.errors import InvalidTransition

__all__ = ["PendingFrees"]


class Done(Protocol):
    """What marks a copy complete: ``torch.cuda.Event``'s two methods."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def _copy_to_host(ids: torch.Tensor) -> tuple[Done, torch.Tensor]:
    """Queue a copy of device tensor ``ids`` into pinned host memory on the current stream;
    the event behind it and the host tensor (valid once the event has completed). One torch
    call allocates and copies: a non-blocking copy from a GPU to the CPU lands in pinned
    memory (torch's ``_to_copy``), so it does not wait for the stream."""
    host = ids.to("cpu", non_blocking=True)
    # torch's Event is untyped where torch is installed; pre-commit's mypy has no torch
    done = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
    done.record()
    return done, host


class _Freed:
    """One freed tensor in flight: its ids on the device (int64), the copy of them on the
    host (valid once ``done``), and how many of its leading ids ``take`` handed out."""

    __slots__ = ("device", "done", "host", "taken")

    def __init__(self, device: torch.Tensor, done: Done, host: torch.Tensor) -> None:
        self.device, self.done, self.host, self.taken = device, done, host, 0


class PendingFrees:
    """Freed block ids on their way from the device to ``release`` (module docstring).

    ``release(ids)`` takes distinct block ids as an int64 CPU tensor (the ledger's
    ``free_tensor``); ``on_device`` says whether the freed tensors live on a GPU (else
    ``add`` releases at once); ``transfer`` starts one copy (tests give their own to hold
    a copy in flight)."""

    def __init__(
        self,
        release: Callable[[torch.Tensor], None],
        on_device: bool,
        transfer: Callable[[torch.Tensor], tuple[Done, torch.Tensor]] = _copy_to_host,
    ) -> None:
        self._release = release
        self._on_device = on_device
        self._transfer = transfer
        self._queue: deque[_Freed] = deque()
        self.count = 0
        """Block ids added and neither released nor taken."""

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, ids: torch.Tensor) -> None:
        """Free the distinct block ids in ``ids`` (a 1-D integer tensor, not empty): at once
        on the CPU, else once the copy queued now has completed."""
        if not self._on_device:
            self._release(ids.to(torch.int64))
            return
        device = ids.to(torch.int64, copy=True)  # the caller may reuse its tensor
        self._queue.append(_Freed(device, *self._transfer(device)))
        self.count += device.numel()

    def take(self, n: int) -> torch.Tensor:
        """Hand out ``n`` ids in flight (``n <= count``), oldest first, as an int64 tensor on
        the device, without waiting for anything: they stay allocated in the ledger, for
        the allocation that takes them."""
        if not 0 < n <= self.count:
            raise ValueError(f"cannot take {n} of {self.count} frees in flight")
        self.count -= n
        parts = []
        queue = self._queue
        while n:
            freed = queue[0]
            k = min(n, freed.device.numel() - freed.taken)
            parts.append(freed.device[freed.taken : freed.taken + k])
            freed.taken += k
            n -= k
            if freed.taken == freed.device.numel():
                queue.popleft()  # all of it handed out: nothing to release
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def settle(self, wait: bool = False) -> int:
        """Release every freed tensor whose copy has completed, oldest first, stopping at the
        first still in flight; with ``wait``, wait for all. Ids ``take`` handed out are not
        released. What arrived goes to ``release`` in one call (one sort and one check in the
        ledger, not one per freed tensor). Returns the ids released. Raises what
        ``release`` raises for an id it cannot free (a double free: an engine bug), after
        every other arrived id is released."""
        released = 0
        arrived: list[torch.Tensor] = []
        queue = self._queue
        while queue:
            freed = queue[0]
            if wait:
                freed.done.synchronize()
            elif not freed.done.query():
                break
            queue.popleft()
            ids = freed.host[freed.taken :] if freed.taken else freed.host
            n = ids.numel()
            self.count -= n
            released += n
            if n:
                arrived.append(ids)
        if len(arrived) == 1:
            self._release(arrived[0])
        elif arrived:
            self._release_each_on_failure(arrived)
        return released

    def _release_each_on_failure(self, arrived: list[torch.Tensor]) -> None:
        """``release`` of the ids of ``arrived`` at once; when that fails (the ledger
        changes nothing then), tensor by tensor, so that only the bad one stays out, and
        the first failure is raised."""
        try:
            self._release(torch.cat(arrived))
            return
        except InvalidTransition as exc:
            combined = exc
        first: InvalidTransition | None = None
        for ids in arrived:
            try:
                self._release(ids)
            except InvalidTransition as each:
                first = first or each
        raise first or combined
