"""The interpreter's switch interval, shortened while kvcore's page thread calls the driver.

Why. Each driver call the page allocator's background thread makes (cuda-python's bindings
on a GPU, ``ctypes`` on the ``host`` backend) lets go of the GIL for the call and must take
it back afterwards. When another thread of the engine process is running Python meanwhile
(the scheduler building a batch; SGLang's scheduler polling for requests while idle), that
thread keeps the GIL until CPython asks it to drop it, which happens only after the
waiting thread has waited one *switch interval* (``sys.getswitchinterval()``, 5 ms by
default). So each driver call of the background thread costs up to a switch interval
instead of microseconds: the convoy effect. A page of a 28-layer model spans 56 handles,
each mapped or unmapped in three to five driver calls, so one page can take a second
beside a busy scheduler, and giving back a pool of gigabytes takes tens of seconds.

The same holds the other way round: a page the engine's thread maps itself gives up the
GIL at each driver call too, to whichever other thread runs Python (vLLM's output thread,
the page thread's own bookkeeping).

What. ``shortened(interval)`` lowers the process's switch interval to ``interval`` seconds
for the duration of a ``with`` block (the background thread wraps each round in it, the
page allocator each map on a caller's thread, a TP worker each request it applies) and
puts back the interval it found once the last such block in the process has ended. The
engine's thread gives the GIL up once per driver call either way; the shorter interval
only stops it from holding on for up to 5 ms first. While no other thread wants the GIL,
the interval changes nothing (CPython never asks anyone to drop it), so an idle background
thread costs the engine nothing.

Invariants. Blocks may overlap, on any threads: the interval stays at the lowest one asked
for until the last block ends. An interval at or below the one asked for is left as it is,
and one that somebody else changed while a block ran is not put back.
``benchmarks/background_convoy.py`` measures the effect on the ``host`` backend.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DEFAULT_BACKGROUND_SWITCH_S", "shortened"]

DEFAULT_BACKGROUND_SWITCH_S = 50e-6
"""The switch interval during a background round unless configured otherwise
(``ElasticConfig.background_switch_us``)."""

_lock = threading.Lock()
_active = 0  # blocks running now, on every thread
_found: float | None = None  # the interval before the first of them
_ours: float | None = None  # the interval the blocks set (None: they set none)


@contextmanager
def shortened(interval: float | None) -> Iterator[None]:
    """Run the block with the switch interval at most ``interval`` seconds (module
    docstring). ``None`` or ``0`` leaves the interval alone. Raises ``ValueError`` for a
    negative interval."""
    if not interval:
        yield
        return
    if interval < 0:
        raise ValueError(f"switch interval must be positive, got {interval}")
    _enter(interval)
    try:
        yield
    finally:
        _leave()


def _enter(interval: float) -> None:
    global _active, _found, _ours
    with _lock:
        now = sys.getswitchinterval()
        if _active == 0:
            _found, _ours = now, None
        _active += 1
        if interval < now:
            sys.setswitchinterval(interval)
            _ours = sys.getswitchinterval()  # as the interpreter rounds it


def _leave() -> None:
    global _active, _found, _ours
    with _lock:
        _active -= 1
        if _active:
            return
        if _ours is not None and _found is not None and sys.getswitchinterval() == _ours:
            sys.setswitchinterval(_found)
        _found = _ours = None
