"""vLLM's ``BlockPool`` with its free block ids kept in a kvcore ``BlockLedger``.

``ElasticBlockPool`` subclasses vLLM's own ``vllm.v1.core.block_pool.BlockPool`` and keeps
everything vLLM builds on: the ``KVCacheBlock`` objects (one per block id, ``pool=self``),
the null block (id 0, reserved in the ledger so its page stays backed), the free queue, the
prefix-cache hash maps, the metrics collector hooks and the KV-cache events (``BlockStored``
/ ``BlockRemoved`` / ``AllBlocksCleared``). What changes is *where a free block lives*:

* a block vLLM may still read (ref count > 0, or ref count 0 but prefix-cached, or unpinned
  with a reuse watcher) is allocated in the ledger, so its page stays mapped (invariant 1);
  the ref-count-0 ones sit in vLLM's free queue in vLLM's LRU order, exactly as upstream;
* a block whose contents nobody can use any more (freed without a hash, evicted, reset) is
  freed to the ledger, which unmaps its page once every block on it is free.

Upstream pops its free queue front first, which holds uncached free blocks ahead of the
cached LRU tail. ``get_new_blocks`` keeps that policy: uncached capacity (the ledger, which
places blocks page-aware) first, then the cached blocks in LRU order, evicting their hashes
as upstream does. ``get_num_free_blocks`` is the ledger's ``available()`` (which includes the
physical headroom the memory gate admits) plus the queue: a physical shortage therefore shows
up where vLLM already looks, and ``KVCacheManager.allocate_slots`` returns ``None`` (the
request waits, or a running one is preempted) instead of failing (invariant 2).

``max_cached_blocks`` bounds the ref-count-0 cached blocks; past it, blocks are evicted in
``BlockLedger.eviction_order`` (whole pages first, otherwise LRU) and freed to the ledger.
``trim(n)`` evicts up to ``n`` cached blocks the same way. ``shed()`` answers a limit lowered
below use (``kvctl limit``; ``PageAllocator.shed_wanted``): it evicts the cached blocks of
whole pages, least recently used first, until the pages asked for are on their way back.
``step_done`` sheds every step; an idle engine core is woken to shed
(``kvcore.adapters.vllm.idle``). What cached blocks cannot give back, running requests hold:
the patched ``Scheduler.schedule`` asks ``requests_to_reclaim`` before each step and preempts
the requests it names (those alone on one such page), unless the ``reclaim`` option is
``"drain"``. When ``allocate_slots`` finds too few free blocks, the
patched manager calls ``note_shortage``: a shortage of the shared GPU budget marks the
instance as waiting (``kvcore.budget.shares``).

``get_num_free_blocks`` is an estimate (another process sharing the budget can take it before
the blocks are handed out). vLLM asks it before every request's allocation, a few hundred
times a step, and the ledger's figure reads the memory gate (under the per-GPU ledger, a
locked read of the shared file), so the pool reads the ledger once and keeps the figure
until the ledger changes through this pool or the next step begins: what other processes
do meanwhile shows one step later. The patched ``allocate_slots`` also calls ``claim_blocks(n)``
after its check: the blocks are backed (charged to the gate) before any is handed out, and a
refusal is the same ``None``. ``get_new_blocks`` raises ``ElasticMiss`` (a ``ValueError``,
as upstream raises for an over-ask) only when a caller skipped the claim and the budget ran
out under it.

The patched ``Scheduler`` also calls ``step_scheduled`` / ``step_done`` (the release fence for
overlapping batches, ``kvcore.adapters.vllm.fence``) and, from ``Scheduler.shutdown``,
``close`` (the kvcore memory behind the pool is released).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcore.adapters.vllm.fence import StepFence
from kvcore.errors import KvcoreError
from kvcore.memory.blocks import BlockLedger

__all__ = ["ElasticBlockPool", "ElasticMiss"]

log = logging.getLogger(__name__)


class _Request(Protocol):
    """What ``requests_to_reclaim`` reads of vLLM's ``Request``."""

    @property
    def request_id(self) -> str: ...


R = TypeVar("R", bound=_Request)


class ElasticMiss(KvcoreError, ValueError):
    """``get_new_blocks`` could not back blocks ``get_num_free_blocks`` had counted (another
    process took the shared budget in between)."""


class ElasticBlockPool(BlockPool):  # type: ignore[misc]
    """vLLM's ``BlockPool`` over a kvcore ``BlockLedger`` (module docstring).

    ``ledger`` must cover exactly ``num_gpu_blocks`` block ids with block 0 reserved (vLLM's
    null block). ``max_cached_blocks`` bounds the evictable prefix cache (``None``: only
    the capacity bounds it, as upstream). ``step_fence``: the ledger's step fence, which
    ``step_scheduled`` / ``step_done`` drive (``None``: they do nothing); ``on_close``: what
    ``close`` calls (release the kvcore memory behind the ledger);
    ``reclaim_by_preemption``: whether ``requests_to_reclaim`` names requests (the
    ``reclaim`` option, ``"preempt"``) or never does (``"drain"``). Other arguments are
    ``BlockPool``'s.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        *args: Any,
        ledger: BlockLedger,
        max_cached_blocks: int | None = None,
        step_fence: StepFence | None = None,
        on_close: Callable[[], None] | None = None,
        reclaim_by_preemption: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, *args, **kwargs)
        if ledger.geometry.num_blocks != num_gpu_blocks or not ledger.is_allocated(0):
            raise KvcoreError(
                f"elastic block pool: the ledger covers {ledger.geometry.num_blocks} blocks "
                f"(block 0 reserved: {ledger.is_allocated(0)}), vLLM plans {num_gpu_blocks}",
                hint="build the ledger from the KVCacheConfig with pinned_blocks=(0,)",
            )
        self.ledger = ledger
        self.max_cached_blocks = max_cached_blocks
        self.step_fence = step_fence
        self.reclaim_by_preemption = reclaim_by_preemption
        self._on_close = on_close
        self._logical_count = False  # get_num_free_blocks ignores the physical budget
        self._claimed: list[int] = []  # ledger blocks backed by claim_blocks, not yet handed out
        # ledger.available() as last read; None once the ledger changed or a step began
        self._available: int | None = None
        # Every non-null block starts free in the ledger, none in the queue: rebuild the
        # queue empty (the blocks' links are the queue's, so clear them first).
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])

    # ---------------------------------------------------------------- engine steps

    def step_scheduled(self, nonempty: bool) -> None:
        """``Scheduler.schedule`` handed a batch to the executor (``nonempty``: it schedules
        any token): pages emptied from now on wait for it (``StepFence``)."""
        if self.step_fence is not None:
            self.step_fence.step_scheduled(nonempty)
        self._available = None  # what other processes did since shows from this step on

    def step_done(self, nonempty: bool) -> None:
        """``Scheduler.update_from_output`` is processing the oldest batch in flight: its
        device work is done, so the pages emptied behind it may be unmapped. Then what the
        memory gate wants back is shed (``shed``; a plain read when nothing is asked)."""
        if self.step_fence is not None:
            self.step_fence.step_done(nonempty)
        self._available = None  # the fence's retired blocks, and other processes
        if self.ledger.pages.shed_wanted():
            self.shed()

    def close(self) -> None:
        """The engine shuts down: release the kvcore memory behind this pool (every page
        unmapped, the ledger record removed). Idempotent; the pool must not be used after.
        Raises what ``on_close`` raises (the runtime's logs a failure instead: vLLM's
        shutdown goes on)."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # ---------------------------------------------------------------- allocation

    def claim_blocks(self, num_blocks: int) -> bool:
        """Back ``num_blocks`` blocks now, before ``allocate_slots`` hands any out (the patched
        ``KVCacheManager.allocate_slots`` calls this after its free-block check). Parks
        ledger blocks until ``claimed + cached >= num_blocks``; ``False`` (a physical miss:
        the request waits or is preempted) when the memory gate refuses. Surplus parked by
        an earlier claim goes back first, so at most one allocation's worth stays parked."""
        queued = self.free_block_queue.num_free_blocks
        if self._claimed:
            surplus, self._claimed = self._claimed, []
            self._ledger_free(surplus)
        need = num_blocks - queued
        if need <= 0:
            return True
        ids = self._ledger_alloc(need)
        if ids is None:
            return False
        self._claimed = ids
        return True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks with ref count 1: ledger blocks first (page-aware), then
        cached blocks from the queue front (LRU) with their hashes evicted. Raises
        ``ValueError`` when fewer are free (as upstream), ``ElasticMiss`` when the ledger
        could not back what it had counted and no cached block is left to reuse."""
        queued = self.free_block_queue.num_free_blocks
        claimed = self._claimed
        covered = len(claimed) + queued  # what no gate read is needed for, then the ledger's
        if num_blocks > covered + self.ledger.held_free() and (
            num_blocks > covered + self._ledger_available()
        ):
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        if claimed:
            ids = claimed[-num_blocks:]
            del claimed[-num_blocks:]
            if len(ids) < num_blocks:
                ids = self._take_from_ledger(num_blocks - len(ids)) + ids
        else:
            ids = self._take_from_ledger(num_blocks)
        rest = num_blocks - len(ids)
        if rest > queued:
            if ids:
                self._ledger_free(ids)
            raise ElasticMiss(
                f"elastic block pool: {num_blocks} blocks were counted free but only "
                f"{len(ids) + queued} could be backed now",
                hint="another instance took the shared budget; raise this instance's limit",
            )
        blocks = self.blocks
        ret = [blocks[i] for i in reversed(ids)]  # ascending within a page, like upstream
        if rest:
            reused = self.free_block_queue.popleft_n(rest)
            if self._reuse_watchers:
                self._notify_reuse(reused)
            if self.enable_caching:
                for block in reused:
                    self._maybe_evict_cached_block(block)
            ret += reused
        collector = self.metrics_collector
        for block in ret:
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            if collector:
                collector.on_block_allocated(block)
        return ret

    def _take_from_ledger(self, num_blocks: int) -> list[int]:
        """As many of ``num_blocks`` as the ledger can back now (all-or-nothing calls,
        halving on a miss). Blocks on pages the ledger holds need no gate read."""
        if num_blocks <= self.ledger.held_free():
            ids = self._ledger_alloc(num_blocks)
            if ids is not None:
                return ids
        want = min(num_blocks, self._ledger_available())
        while want > 0:
            ids = self._ledger_alloc(want)
            if ids is not None:
                return ids
            want //= 2
        return []

    def _ledger_available(self) -> int:
        """``ledger.available()`` as last read (module docstring: kept until the ledger
        changes through this pool or a step begins), read now if not kept."""
        available = self._available
        if available is None:
            available = self._available = self.ledger.available()
        return available

    def _ledger_alloc(self, num_blocks: int) -> list[int] | None:
        """``ledger.alloc``; the kept ``available()`` figure is read again next time."""
        self._available = None
        return self.ledger.alloc(num_blocks)

    def _ledger_free(self, block_ids: list[int]) -> None:
        """``ledger.free``; the kept ``available()`` figure is read again next time."""
        self._available = None
        self.ledger.free(block_ids)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block. At ref count 0 a block with a hash (or a reuse
        watcher) joins the queue's LRU tail, as upstream; any other block goes back to the
        ledger at once. Then the cache bound is enforced."""
        cached: list[KVCacheBlock] = []
        dead: list[int] = []
        other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
        caching = self.enable_caching
        watchers = self._reuse_watchers
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if (caching and block.block_hash is not None) or block.block_id in watchers:
                    cached.append(block)
                else:
                    dead.append(block.block_id)
        if dead:
            # reversed: the ledger pops what it got last first, so the block vLLM
            # ranked first for reuse (the request's tail) is reused first, like upstream
            dead.reverse()
            self._ledger_free(dead)
        if cached:
            self.free_block_queue.append_n(cached)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)
        if self.max_cached_blocks is not None:
            excess = self.free_block_queue.num_free_blocks - self.max_cached_blocks
            if excess > 0:
                self.trim(excess)

    # ---------------------------------------------------------------- eviction

    def trim(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` ref-count-0 cached blocks, those emptying whole pages
        first (then LRU), and free them to the ledger. Returns how many were evicted."""
        if num_blocks <= 0:
            return 0
        return self._evict_queued(self.ledger.eviction_order(self._queued_ids())[:num_blocks])

    def shed(self) -> int:
        """Give back what the memory gate asks for (``PageAllocator.shed_wanted()`` pages:
        a limit lowered below use): evict the ref-count-0 cached blocks whose eviction
        empties that many whole pages, least recently used first, and free them to the
        ledger (their pages are unmapped once no batch in flight can touch them). Returns
        the blocks evicted: 0 when nothing is asked, or when every cached block shares its
        page with a block in use (those pages come back as their requests finish; vLLM
        allocates from the cached blocks meanwhile, since the gate admits no new page).
        Runs on the scheduler's thread: ``step_done``, or an idle engine core's wake-up."""
        pages = self.ledger.pages.shed_wanted()
        if pages <= 0 or not self.free_block_queue.num_free_blocks:
            return 0
        evicted = self._evict_queued(self.ledger.blocks_emptying_pages(self._queued_ids(), pages))
        if evicted:
            log.debug("kvcore: shed %d cached blocks (%d pages asked)", evicted, pages)
        return evicted

    def requests_to_reclaim(
        self, running: Sequence[R], block_ids_of: Callable[[str], tuple[list[int], ...]]
    ) -> list[R]:
        """The running requests to preempt now so that one page the memory gate wants back
        (``PageAllocator.shed_wanted``: a waiting neighbour's share, a lowered limit) empties:
        those whose blocks alone fill a page, the page whose requests hold the fewest
        blocks in all (``BlockLedger.owners_emptying_page``; cached blocks there are shed
        after). ``running``: the scheduler's running requests; ``block_ids_of``: the KV cache
        manager's ``get_block_ids``. ``[]`` when nothing is wanted back (a plain read, every
        step), with ``reclaim`` ``"drain"``, or when no page is held by running requests
        alone. The patched ``Scheduler.schedule`` calls it before it schedules anything and
        preempts what it returns (vLLM's own preemption: the requests wait at the queue's
        front and recompute): one page a step, so an instance gives back about what its
        neighbour asks for rather than all its overage at once, and never goes below its
        share or limit (``shed_wanted`` is 0 there)."""
        if not self.reclaim_by_preemption or not running or self.ledger.pages.shed_wanted() <= 0:
            return []
        owners = {
            i: [b for group in block_ids_of(r.request_id) for b in group]
            for i, r in enumerate(running)
        }
        chosen = self.ledger.owners_emptying_page(owners, evictable=self._queued_ids())
        if chosen:
            log.debug("kvcore: preempting %d requests to give a page back", len(chosen))
        return [running[i] for i in chosen]

    def _evict_queued(self, block_ids: list[int]) -> int:
        """Take the queued (ref-count-0, cached) blocks ``block_ids`` out of the queue, evict
        their hashes and free them to the ledger; returns how many."""
        victims = [self.blocks[i] for i in block_ids]
        for block in victims:
            self.free_block_queue.remove(block)
        self._release(victims)
        return len(victims)

    def _queued_ids(self) -> list[int]:
        """The ref-count-0 cached block ids in vLLM's LRU order (queue front first)."""
        queue = self.free_block_queue
        ids: list[int] = []
        node = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        while node is not None and node is not tail:
            ids.append(node.block_id)
            node = node.next_free_block
        return ids

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Upstream's hash eviction; a ref-count-0 block it uncaches leaves the queue for the
        ledger (nothing can read it any more)."""
        super().evict_blocks(block_ids)
        gone = [
            self.blocks[i]
            for i in sorted(block_ids)
            if (b := self.blocks[i]).ref_cnt == 0
            and not b.is_null
            and b.block_hash is None
            and b.block_id not in self._reuse_watchers
            and b.prev_free_block is not None
        ]
        for block in gone:
            self.free_block_queue.remove(block)
        if gone:
            self._ledger_free([b.block_id for b in gone])

    def reset_prefix_cache(self) -> bool:
        """Upstream's reset (its "every block is free" check counts blocks logically, not
        what the physical budget admits); then every queued block goes to the ledger."""
        self._logical_count = True
        try:
            if not super().reset_prefix_cache():
                return False
        finally:
            self._logical_count = False
        queued = self.free_block_queue.get_all_free_blocks()
        self.free_block_queue = FreeKVCacheBlockQueue([])
        for block in queued:
            block.prev_free_block = block.next_free_block = None
        if queued:
            self._ledger_free([b.block_id for b in queued])
        return True

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        """Evict the hashes of blocks already out of the queue and free them to the ledger."""
        if not blocks:
            return
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
        self._ledger_free([b.block_id for b in blocks])

    # ---------------------------------------------------------------- accounting

    def note_shortage(self, num_blocks: int) -> None:
        """The patched ``KVCacheManager.allocate_slots`` found ``num_blocks`` fewer free
        blocks than a request needed (it then returns ``None``: the request waits or a
        running one is preempted). Where the physical budget rather than the logical
        capacity is short, the instance is marked as waiting for memory, so instances
        sharing the GPU beyond their share give way (``BlockLedger.note_shortage``,
        ``kvcore.budget.shares``). Cheap: the gate renews its mark at most a few times a
        second."""
        self.ledger.note_shortage(num_blocks)

    def get_usage(self) -> float:
        """vLLM's KV cache usage (``vllm:kv_cache_usage_perc``): the blocks requests hold
        over the logical capacity, as upstream counts them. Not ``1 - get_num_free_blocks()
        / capacity``, upstream's formula, which here would also count as used the budget
        other instances hold."""
        total = int(self.num_gpu_blocks) - 1  # the null block is no capacity
        if total <= 0:
            return 0.0
        held = self.ledger.used() - 1 - len(self._claimed) - self.num_cached_free_blocks()
        return max(0, held) / total

    def get_num_free_blocks(self) -> int:
        """Blocks vLLM may allocate now: the ledger's (logical and physical headroom, as read
        at most once between two changes, module docstring) plus the ref-count-0 cached
        blocks it would evict."""
        if self._logical_count:
            free = int(self.num_gpu_blocks) - self.ledger.used() + len(self._claimed)
            return free + self.num_cached_free_blocks()
        queued: int = self.free_block_queue.num_free_blocks
        return self._ledger_available() + len(self._claimed) + queued

    def free_blocks_to_admit(self) -> int:
        """What a new request may take now (the patched admission check of
        ``KVCacheManager.allocate_slots`` asks this instead of ``get_num_free_blocks``): the
        same figure (read as seldom), less the free blocks on pages the memory gate wants
        back (``BlockLedger.withheld``). Running requests keep growing into those; the
        pages drain as they finish."""
        free = self.get_num_free_blocks()
        if self._logical_count:
            return free
        return max(0, free - self.ledger.withheld())

    def num_cached_free_blocks(self) -> int:
        """Ref-count-0 blocks held for the prefix cache (evictable, still backed)."""
        return int(self.free_block_queue.num_free_blocks)
