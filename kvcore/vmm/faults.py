"""Fault injection at the backend seam, and a count of the driver calls each thread makes.

``FaultInjector(inner)`` is a ``VmmBackend`` that forwards every call to ``inner`` and can be
told to fail the N-th call of a kind::

    vmm = FaultInjector(open_backend("host", device_bytes=64 << 20))
    vmm.fail("map", nth=2)          # the 2nd map from now raises InjectedFault
    vmm.fail("create")              # the next create raises OutOfDeviceMemory
    vmm.fail("unmap", after=True)   # the next unmap happens, then raises anyway

By default the failing call does *not* reach the inner backend (the driver refused; nothing
changed), which is the backend contract. ``after=True`` forwards the call first and then
raises: the driver did the work but reported failure, the "uncertain state" a mapper must
not trust.

It also keeps what tests need to prove that nothing leaked: ``live_handles`` (created and
not released through this wrapper), ``mapped_ranges()``, and per-thread call counts
(``calls(kind, thread=...)``), which the page allocator's tests use to show the allocating
thread makes no driver call while the reserve (the allocator's idle mapped pages) covers
demand.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvcore.errors import InjectedFault, OutOfDeviceMemory
from kvcore.vmm.base import Handle, MemInfo, VmmBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

_T = TypeVar("_T")

KINDS: tuple[str, ...] = (
    "granularity",
    "device_uuid",
    "mem_info",
    "reserve",
    "free_reservation",
    "create",
    "release",
    "map",
    "set_access",
    "unmap",
    "synchronize",
    "as_tensor",
)
"""Every call kind that can be counted and failed."""

DRIVER_KINDS: frozenset[str] = frozenset(
    {"mem_info", "reserve", "free_reservation", "create", "release", "map", "set_access",
     "unmap", "synchronize"}
)  # fmt: skip
"""Kinds that reach the driver on every call (``granularity`` and ``device_uuid`` are
facts a backend caches; ``as_tensor`` only wraps an address)."""


@dataclass
class _Rule:
    kind: str
    nth: int
    times: int
    exc: BaseException | None
    after: bool
    seen: int = 0

    def hit(self) -> bool:
        """Count one call of ``kind``; True when this call must fail."""
        self.seen += 1
        return self.nth <= self.seen < self.nth + self.times

    @property
    def spent(self) -> bool:
        return self.seen >= self.nth + self.times - 1


class FaultInjector(VmmBackend):
    """Wraps ``inner``; see the module docstring. Thread-safe."""

    def __init__(self, inner: VmmBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.device = inner.device
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._counts: Counter[tuple[int, str]] = Counter()
        self.live_handles: set[Handle] = set()
        """Handles created through this wrapper and not yet released."""
        self._mapped: dict[int, tuple[int, Handle]] = {}
        self.injected = 0
        """How many failures were raised so far."""

    # -- configuring ---------------------------------------------------------------------

    def fail(
        self,
        kind: str,
        nth: int = 1,
        *,
        times: int = 1,
        exc: BaseException | None = None,
        after: bool = False,
    ) -> None:
        """Make calls ``nth .. nth+times-1`` of ``kind`` (counted from now, on any thread)
        raise ``exc`` (default: ``OutOfDeviceMemory`` for ``create``, ``InjectedFault``
        otherwise). With ``after=True`` the inner call is made first, then the error raised.
        Several rules may be armed at once, for the same or different kinds."""
        if kind not in KINDS:
            raise ValueError(f"unknown call kind {kind!r}; known: {', '.join(KINDS)}")
        if nth < 1 or times < 1:
            raise ValueError("nth and times start at 1")
        with self._lock:
            self._rules.append(_Rule(kind, nth, times, exc, after))

    def clear(self) -> None:
        """Disarm every rule (counts are kept)."""
        with self._lock:
            self._rules.clear()

    @property
    def armed(self) -> int:
        """Rules that still have failures to raise."""
        with self._lock:
            return sum(1 for r in self._rules if not r.spent)

    # -- counting ------------------------------------------------------------------------

    def calls(self, kind: str | None = None, *, thread: int | None = None) -> int:
        """Calls made so far of ``kind`` (``None``: every kind in ``DRIVER_KINDS``), on the
        thread whose ``threading.get_ident()`` is ``thread`` (``None``: every thread).
        Failed calls count too."""
        with self._lock:
            return sum(
                n
                for (tid, k), n in self._counts.items()
                if (kind == k if kind is not None else k in DRIVER_KINDS)
                and (thread is None or thread == tid)
            )

    def reset_counts(self) -> None:
        """Zero every call count."""
        with self._lock:
            self._counts.clear()

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """``(va, size)`` of every mapping made through this wrapper and not unmapped."""
        with self._lock:
            return sorted((va, size) for va, (size, _) in self._mapped.items())

    def mappings(self) -> dict[int, tuple[int, Handle]]:
        """``va -> (size, handle)`` of every mapping made through this wrapper and not
        unmapped."""
        with self._lock:
            return dict(self._mapped)

    # -- the seam ------------------------------------------------------------------------

    def granularity(self) -> int:
        return self._call("granularity", {}, self.inner.granularity)

    def device_uuid(self) -> str:
        return self._call("device_uuid", {}, self.inner.device_uuid)

    def mem_info(self) -> MemInfo:
        return self._call("mem_info", {}, self.inner.mem_info)

    def reserve(self, size: int) -> int:
        return self._call("reserve", {"size": size}, lambda: self.inner.reserve(size))

    def free_reservation(self, va: int, size: int) -> None:
        self._call(
            "free_reservation",
            {"va": va, "size": size},
            lambda: self.inner.free_reservation(va, size),
        )

    def create(self, size: int) -> Handle:
        return self._call(
            "create",
            {"size": size},
            lambda: self.inner.create(size),
            on_done=self.live_handles.add,  # also when after=True raises: the handle exists
        )

    def release(self, handle: Handle) -> None:
        self._call(
            "release",
            {"handle": int(handle)},
            lambda: self.inner.release(handle),
            on_done=lambda _: self.live_handles.discard(handle),
        )

    def map(self, va: int, size: int, handle: Handle) -> None:
        self._call(
            "map",
            {"va": va, "size": size, "handle": int(handle)},
            lambda: self.inner.map(va, size, handle),
            on_done=lambda _: self._mapped.__setitem__(va, (size, handle)),
        )

    def set_access(self, va: int, size: int, *, writable: bool = True) -> None:
        self._call(
            "set_access",
            {"va": va, "size": size, "writable": writable},
            lambda: self.inner.set_access(va, size, writable=writable),
        )

    def unmap(self, va: int, size: int) -> None:
        def forget(_: None) -> None:
            for start in [s for s in self._mapped if va <= s < va + size]:
                del self._mapped[start]

        self._call(
            "unmap", {"va": va, "size": size}, lambda: self.inner.unmap(va, size), on_done=forget
        )

    def synchronize(self) -> None:
        self._call("synchronize", {}, self.inner.synchronize)

    def as_tensor(self, va: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        return self._call(
            "as_tensor",
            {"va": va, "size": size, "dtype": str(dtype)},
            lambda: self.inner.as_tensor(va, size, dtype),
        )

    def close(self) -> None:
        self.inner.close()
        with self._lock:
            self.live_handles.clear()
            self._mapped.clear()

    # -- internals -----------------------------------------------------------------------

    def _call(
        self,
        kind: str,
        args: dict[str, object],
        forward: Callable[[], _T],
        on_done: Callable[[_T], object] | None = None,
    ) -> _T:
        with self._lock:
            self._counts[(threading.get_ident(), kind)] += 1
            rule = None
            for r in self._rules:  # every rule of this kind counts the call
                if r.kind == kind and r.hit() and rule is None:
                    rule = r
        if rule is not None and not rule.after:
            self._raise(rule, args)
        result = forward()
        if on_done is not None:
            with self._lock:
                on_done(result)
        if rule is not None:
            self._raise(rule, args)
        return result

    def _raise(self, rule: _Rule, args: dict[str, object]) -> None:
        with self._lock:
            self.injected += 1
        if rule.exc is not None:
            raise rule.exc
        if rule.kind == "create":
            raise OutOfDeviceMemory(
                "create", args, "injected out of memory", hint="raised by FaultInjector"
            )
        raise InjectedFault(rule.kind, args, "injected fault", hint="raised by FaultInjector")
