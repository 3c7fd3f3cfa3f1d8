"""The memory gate: who may take more physical memory, and how much is held.

A page allocator calls its ``MemoryGate`` *before* it maps pages (``try_acquire``) and after
it gives pages back (``release``), and reports its reserve. ``LedgerGate``
(``kvcore.budget.ledger_gate``, on the per-GPU shared ledger) implements the gate for
instances sharing one GPU: the instance limit, the GPU-wide budget and the bytes other
instances hold. ``UnlimitedGate`` is the gate of a lone process with no ledger,
``BudgetGate`` the gate of one with a fixed cap.

Gate calls are made off the scheduler's hot path where possible (the reserve refill thread);
``try_acquire`` must be cheap and must never block for long.

Methods optional beyond the protocol (the page allocator looks for them): ``headroom()``,
the bytes ``try_acquire`` would still admit; ``overage()``, the bytes in use beyond a limit
lowered below them (``kvctl limit``): what the engine is asked to give back by dropping
cached KV; ``held_back()``, whether the instance maps more than it may hold now, so that
idle pages it keeps mapped must not go back in use (never while ``headroom()`` is positive:
the page allocator asks only a gate with no room); ``note_wanted(n)``, the engine was
``n`` bytes short (the per-GPU ledger's shares, ``kvcore.budget.shares``).
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class MemoryGate(Protocol):
    """Admission control for physical memory, in bytes."""

    def try_acquire(self, nbytes: int) -> bool:
        """Claim ``nbytes`` more mapped memory. ``False`` (nothing claimed) when a limit or
        the budget would be exceeded: the caller treats that as an allocation miss."""
        ...

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` claimed earlier (pages unmapped)."""
        ...

    def report_reserve(self, nbytes: int) -> None:
        """Record how many of the claimed bytes are idle in the pre-mapped reserve."""
        ...

    def reserve_target(self, wanted: int) -> int:
        """How many reserve bytes the allocator may keep now (a lowered limit trims the
        reserve first). Returns at most ``wanted``."""
        ...


class UnlimitedGate:
    """The gate of a process without a shared ledger: admits everything, tracks the total."""

    def __init__(self) -> None:
        self.held = 0
        self.reserve = 0
        self._lock = threading.Lock()

    def try_acquire(self, nbytes: int) -> bool:
        with self._lock:
            self.held += nbytes
        return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def report_reserve(self, nbytes: int) -> None:
        self.reserve = nbytes

    def reserve_target(self, wanted: int) -> int:
        return wanted

    def headroom(self) -> int | None:
        """Bytes ``try_acquire`` would still admit; ``None``: no limit. Optional beyond the
        ``MemoryGate`` protocol: ``PageAllocator.available()`` uses it where a gate has it."""
        return None

    def overage(self) -> int:
        """Bytes in use (held, less the idle reserve) beyond the limit: 0 here (no limit).
        Optional beyond the ``MemoryGate`` protocol: the page allocator asks the engine to
        shed that much cached KV (``PageAllocator.shed_wanted``)."""
        return 0

    def held_back(self) -> bool:
        """Whether more is held than the gate allows now: never here. Optional beyond the
        ``MemoryGate`` protocol: the page allocator then puts no idle page back in use."""
        return False


class BudgetGate(UnlimitedGate):
    """A fixed byte budget for one process (tests, benchmarks, a lone engine with a cap)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def headroom(self) -> int | None:
        with self._lock:
            return max(self.limit - self.held, 0)

    def overage(self) -> int:
        """Bytes in use beyond ``limit`` (a caller may lower ``limit`` below what is held)."""
        with self._lock:
            return max(self.held - self.reserve - self.limit, 0)

    def held_back(self) -> bool:
        """Whether more is held than ``limit`` (a caller may lower it below what is held)."""
        with self._lock:
            return self.held > self.limit

    def try_acquire(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self.limit:
                return False
            self.held += nbytes
        return True
