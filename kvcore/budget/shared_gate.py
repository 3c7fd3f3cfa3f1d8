"""One memory gate shared by several page allocators of one engine instance.

An engine whose KV state lives in several pools gets one kvcore object chain per pool, each
with its own ``PageAllocator`` (SGLang's hybrid SWA model: a full-attention and a
sliding-window sub-pool; a hybrid Mamba model: a KV pool and a Mamba state pool). The
instance's budget (``limit_bytes``, the per-GPU ledger's instance limit) must cover them all,
so they draw on one gate: ``SharedGate`` opens the real gate once (the first joiner's
``make``) and hands each allocator a ``GateShare``. A share forwards ``try_acquire`` /
``release`` / ``headroom`` / ``overage`` / ``reserve_target`` / ``note_wanted`` to the one gate;
``report_reserve`` is per share (a page allocator reports its own reserve) and the gate sees
the sum. The gate is
closed when the last share closes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvcore.budget.gate import MemoryGate
from kvcore.errors import KvcoreError

__all__ = ["GateShare", "SharedGate"]


class SharedGate:
    """Owner of the one gate of a rank's managers (module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._gate: MemoryGate | None = None
        self._reserves: dict[int, int] = {}
        self._open = 0
        self._next = 0
        self._lock = threading.Lock()

    @property
    def gate(self) -> MemoryGate | None:
        """The shared gate (``None`` before the first ``join`` or after the last close)."""
        return self._gate

    def join(self, make: Callable[[], MemoryGate]) -> GateShare:
        """A share of the gate; ``make`` opens it when no share is open yet (its errors, e.g.
        ``LedgerError``, propagate and nothing is joined)."""
        with self._lock:
            if self._gate is None:
                self._gate = make()
            key = self._next
            self._next += 1
            self._open += 1
            self._reserves[key] = 0
            return GateShare(self, key)

    def _report(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._reserves[key] = nbytes
            total = sum(self._reserves.values())
            gate = self._gate
        if gate is not None:
            gate.report_reserve(total)

    def _leave(self, key: int) -> None:
        with self._lock:
            if self._reserves.pop(key, None) is None:
                return
            self._open -= 1
            gate, last = self._gate, self._open == 0
            if last:
                self._gate = None
        if last and gate is not None:
            close = getattr(gate, "close", None)
            if callable(close):
                close()
        elif gate is not None:
            gate.report_reserve(sum(self._reserves.values()))


class GateShare:
    """One manager's view of a ``SharedGate`` (a ``MemoryGate``). ``try_acquire``,
    ``release``, ``reserve_target``, ``headroom`` and ``overage`` forward to the shared gate
    (raising what it raises) and raise ``KvcoreError`` once it closed; ``report_reserve``
    reports this share's reserve. ``close`` leaves the shared gate (idempotent); the last
    share to leave closes it."""

    def __init__(self, owner: SharedGate, key: int) -> None:
        self._owner = owner
        self._key = key

    def _gate(self) -> MemoryGate:
        gate = self._owner.gate
        if gate is None:
            raise KvcoreError(
                "kvcore: a gate share was used after the shared gate closed",
                hint="close page allocators before the managers that own their gate shares",
            )
        return gate

    def try_acquire(self, nbytes: int) -> bool:
        return self._gate().try_acquire(nbytes)

    def release(self, nbytes: int) -> None:
        self._gate().release(nbytes)

    def report_reserve(self, nbytes: int) -> None:
        self._owner._report(self._key, nbytes)

    def reserve_target(self, wanted: int) -> int:
        return self._gate().reserve_target(wanted)

    def headroom(self) -> int | None:
        """The shared gate's headroom (``None``: no limit, or the gate has no such figure)."""
        room = getattr(self._gate(), "headroom", None)
        value = room() if callable(room) else None
        return value if isinstance(value, int) else None

    def overage(self) -> int:
        """The shared gate's overage (0 where the gate has no such figure). Every share sees
        all of it: each pool sheds cached KV until the instance is under its limit."""
        over = getattr(self._gate(), "overage", None)
        value = over() if callable(over) else 0
        return value if isinstance(value, int) else 0

    def held_back(self) -> bool:
        """The shared gate's ``held_back`` (``False`` where the gate has no such figure)."""
        held = getattr(self._gate(), "held_back", None)
        return bool(held()) if callable(held) else False

    def note_wanted(self, nbytes: int) -> None:
        """Forwarded to the shared gate where it listens (``LedgerGate.note_wanted``)."""
        note = getattr(self._gate(), "note_wanted", None)
        if callable(note):
            note(nbytes)

    def close(self) -> None:
        self._owner._leave(self._key)
