"""Closing an object chain: every part closed once, whatever fails on the way.

The objects that own a chain of kvcore parts (a VMM backend, a virtual range, its mapper,
a page allocator, a gate) close them in order when the engine goes away, and again when their
own constructor fails half way. One failed step must never keep the others open: a failed
unmap that stopped the shutdown would leave the gate's ledger record and every other page
behind. Two pieces serve every such owner:

* ``close_parts(parts, on_error=...)`` closes every part that exists, in order, logs each
  failure and then applies the owner's error policy: raise the first failure, raise one error
  of the owner's that names them all, or only log and hand the failures back.
* ``CloseOnce`` makes an owner's ``close()`` idempotent and thread-safe, and runs the
  callbacks registered with ``on_close`` (a registry forgetting the owner) when closing
  starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = ["CloseOnce", "OnError", "PartFailure", "close_parts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartFailure:
    """One part whose ``close()`` raised: its name (as given to ``close_parts``) and error."""

    part: str
    error: Exception


OnError: TypeAlias = Literal["raise", "log"] | Callable[[Sequence[PartFailure]], Exception]
"""What ``close_parts`` does once every part was tried and some failed (see there)."""


def close_parts(
    parts: Iterable[tuple[str, object]],
    *,
    on_error: OnError,
    tolerate: tuple[type[Exception], ...] = (),
) -> list[PartFailure]:
    """Close every part of ``parts``, in order, even when earlier ones raise.

    ``parts``: ``(name, obj)`` pairs; ``obj.close()`` is called when ``obj`` has a callable
    ``close`` (``None``, a part that was never made, and objects without ``close`` are
    skipped). An ``Exception`` from a part is logged at ERROR level with its traceback
    (``"kvcore: closing the <name> failed"``) and the next part is closed; a
    ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``) propagates at once.
    An exception of a ``tolerate`` type means the part's memory is gone already (a page
    allocator failed-stop, its memory goes with the processes that held it): it is logged at
    INFO and is no failure.

    Once every part was tried, ``on_error`` decides:

    * ``"raise"``: the first failure's exception is raised as it is (the others were logged);
    * ``"log"``: nothing is raised;
    * a callable: it gets every failure and returns the exception to raise, which is raised
      with the first failure's exception as its ``__cause__`` (an owner's typed error naming
      all failed parts).

    Returns the failures (empty when every part closed), when it does not raise."""
    failed: list[PartFailure] = []
    for name, obj in parts:
        close = getattr(obj, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except tolerate as exc:
            log.info("kvcore: closing the %s: %s (its memory is gone already)", name, exc)
        except Exception as exc:  # keep closing the rest
            log.error("kvcore: closing the %s failed: %r", name, exc, exc_info=exc)
            failed.append(PartFailure(name, exc))
    if failed and on_error != "log":
        if on_error == "raise":
            raise failed[0].error
        raise on_error(failed) from failed[0].error
    return failed


class CloseOnce:
    """The once-only start of an owner's ``close()``.

    The owner's ``close()`` starts with ``if not self._once.begin(): return``. Thread-safe:
    of concurrent or repeated calls exactly one ``begin()`` returns ``True``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def closed(self) -> bool:
        """``begin()`` was called: the owner is closed or closing."""
        return self._closed

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, when closing starts; at once (in this thread) if it has
        started already. Raises what ``callback`` raises only in that second case."""
        with self._lock:
            if not self._closed:
                self._callbacks.append(callback)
                return
        callback()

    def begin(self) -> bool:
        """Mark the owner closed. The first call runs the ``on_close`` callbacks in the order
        they were registered (a failing one is logged; the rest still run) and returns
        ``True``: the owner then closes its parts. Every later call returns ``False`` at once
        and does nothing. Never raises ``Exception``."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("kvcore: an on_close callback failed")
        return True
