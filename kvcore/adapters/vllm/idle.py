"""Waking an idle vLLM engine core so that its elastic block pool can shed cached KV.

A limit lowered below what an instance uses (``kvctl limit``) is answered by the engine: the
pool evicts cached blocks that empty whole pages (``ElasticBlockPool.shed``), and it does so
from ``step_done``, once per engine step. vLLM's engine core only steps while it has
requests; idle, its busy loop blocks on its input queue, so an instance holding a prefix
cache would keep that memory until its next request, however long the other instances on
the GPU wait for it.

``attach_engine_core`` (called by the patched ``EngineCoreProc.__init__`` once the
scheduler exists) closes that gap with two mechanisms vLLM already has for its own idle
work: the engine core's idle-state callbacks (``_idle_state_callbacks``: run on the engine
core's thread, in the idle loop, before it blocks again) and the ``WAKEUP`` request type (a
no-op request that unblocks ``input_queue.get``). When a background round of the page
allocator leaves pages to shed (``PageAllocator.set_shed_listener``), the waker queues one
callback and one ``WAKEUP``; the callback runs ``shed`` on the engine core's thread, where
vLLM's block pool may be touched. At most one wake-up is outstanding; a busy engine core
runs the callback when it next goes idle and sheds from ``step_done`` meanwhile.

Only an ``EngineCoreProc`` (the engine core process every ``vllm serve`` and multiprocess
``LLM`` runs) has an input queue; an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``) sheds at its next step only.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvcore.adapters.vllm.pool import ElasticBlockPool

__all__ = ["IdleWaker", "attach_engine_core"]

log = logging.getLogger(__name__)


class IdleWaker:
    """Runs ``pool.shed()`` on an engine core's thread when the page allocator asks for it
    (module docstring). ``callbacks`` is the engine core's list of idle-state callbacks
    (each called once with the engine core, then dropped), ``wake`` unblocks its idle wait.
    Thread-safe: ``wake`` is called from the page allocator's background thread."""

    def __init__(
        self,
        pool: ElasticBlockPool,
        callbacks: list[Any],
        wake: Any,
    ) -> None:
        self._pool = pool
        self._callbacks = callbacks
        self._wake = wake
        self._lock = threading.Lock()
        self._pending = False
        self.wakeups = 0
        """Wake-ups posted so far."""
        self.shed_blocks = 0
        """Blocks the idle-time ``shed`` calls evicted so far."""

    def wake(self) -> None:
        """Post one idle-state callback and one wake-up, unless one is outstanding."""
        with self._lock:
            if self._pending:
                return
            self._pending = True
            self.wakeups += 1
        self._callbacks.append(self._on_idle)
        self._wake()

    def _on_idle(self, _engine_core: object) -> None:
        with self._lock:
            self._pending = False
        self.shed_blocks += self._pool.shed()


def attach_engine_core(engine_core: Any) -> IdleWaker | None:
    """Let ``engine_core``'s elastic pool shed while the engine core is idle (module
    docstring). Called once by the patched ``EngineCoreProc.__init__`` after its scheduler
    is built, only with elastic KV on. Returns the waker, or ``None`` where there is nothing
    to attach (no elastic pool: a KV-less model; an engine core without an input queue).
    Raises nothing of its own."""
    from vllm.v1.engine import EngineCoreRequestType

    manager = getattr(getattr(engine_core, "scheduler", None), "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    callbacks = getattr(engine_core, "_idle_state_callbacks", None)
    queue = getattr(engine_core, "input_queue", None)
    if not isinstance(pool, ElasticBlockPool) or callbacks is None or queue is None:
        return None
    wakeup = (EngineCoreRequestType.WAKEUP, None)
    waker = IdleWaker(pool, callbacks, lambda: queue.put_nowait(wakeup))
    pool.ledger.pages.set_shed_listener(waker.wake)
    log.debug("kvcore: an idle engine core is woken to shed cached KV")
    return waker
