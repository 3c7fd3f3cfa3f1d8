"""Elastic versions of SGLang's token and paged token-to-KV allocators.

They are subclasses of SGLang's own ``TokenToKVPoolAllocator`` and
``PagedTokenToKVPoolAllocator`` (imported from the installed SGLang), so the scheduler,
radix cache and kernels see the same interface and the same index arithmetic. What changes
is *which* ids are free: kvcore's ``BlockLedger`` is the free list. Token demand becomes block
demand (one block per SGLang page; one per token at ``page_size == 1``), the ledger picks the
blocks page-aware and maps physical pages on demand, and SGLang's own extend/decode index
computation expands the block ids to token indices. Freeing hands ids back to the ledger,
which unmaps (or parks in the reserve) every page whose blocks are all free.

A physical miss (budget or device exhausted) makes ``alloc*`` return ``None``, exactly what
upstream returns when its free list is short. Under a budget (``limit_bytes``,
``gpu_ledger``) ``available_size()`` reports the physical room (the gate's headroom), so
SGLang's admission and decode-retraction checks see the shortage before they allocate;
without one it reports the ledger's logical free count, identical on every TP rank.

``max_cached_tokens`` (``--kvcore-config``) bounds the prefix cache: the scheduler's
per-iteration ``kvcore_step`` (patch 0006, every version) and every allocation's eviction
pass (``evict_to_free_tokens``, which SGLang 0.5.23+ calls before each allocation) first
evict down to the bound.
``conservation_available_size()`` is what the scheduler's idle leak check adds to evictable
+ protected tokens to get the pool's total in elastic mode.

``elastic_token_allocator`` turns the two stock classes into these and refuses any other
allocator (HiSparse, page-interleave, NPU, unified pools) with ``UnsupportedConfiguration``;
``kvcore.adapters.sglang.swa`` builds the hybrid SWA allocator over two of them, and the
scope's ``elastic_allocator`` picks between the two.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import torch
from sglang.kernels.ops.memory.allocator import alloc_decode_kernel, alloc_extend_kernel
from sglang.srt.mem_cache.allocator import paged as _paged
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.utils import next_power_of_2

from kvcore.adapters.sglang import eviction
from kvcore.adapters.sglang.release import PendingFrees
from kvcore.adapters.sglang.staging import PinnedStaging
from kvcore.errors import UnsupportedConfiguration
from kvcore.parallel.agreement import RoomLedger

# SGLang 0.5.23+ ships torch fallbacks of both index kernels (older ones only Triton)
_NAIVE_KERNELS = hasattr(_paged, "alloc_extend_naive") and hasattr(_paged, "alloc_decode_naive")

if TYPE_CHECKING:
    from kvcore.adapters.sglang.manager import ElasticKVManager
    from kvcore.memory.blocks import BlockLedger

__all__ = [
    "ElasticPagedTokenToKVPoolAllocator",
    "ElasticTokenToKVPoolAllocator",
    "elastic_token_allocator",
    "is_elastic",
]


class _ElasticMixin:
    """What both elastic allocators share: the ledger, the cache bound, conservation."""

    page_size: int
    device: Any
    kvcore: ElasticKVManager
    ledger: BlockLedger
    max_cached_tokens: int | None
    _budgeted: bool
    _block_ids: torch.Tensor
    """Every block id in order, on the allocator's device: runs of fresh ids are its views."""

    def _bind(self, kvcache: Any) -> None:
        manager = getattr(kvcache, "kvcore_manager", None)
        if manager is None and _is_hybrid_linear(kvcache):
            # a hybrid Mamba model: token KV lives in the full-attention sub-pool
            manager = getattr(kvcache.full_kv_pool, "kvcore_manager", None)
        if manager is None:
            raise UnsupportedConfiguration(
                f"elastic allocator over a {type(kvcache).__name__} whose buffers kvcore did "
                "not create (quantized KV caches and pool subclasses such as FP4, MXFP8 or "
                "page-major pools are not supported)",
                hint="build the KV pool inside the kvcore elastic scope (the patched "
                "KVCacheConfigurator does this when --kvcore-elastic is on)",
            )
        self.kvcore = manager
        self.ledger = manager.ledger
        self.max_cached_tokens = manager.config.max_cached_tokens
        self._budgeted = manager.config.budgeted
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._on_cpu = self._empty.device.type == "cpu"  # read once: .device builds an object
        # host-to-device copies of the ledger's ids go through one pinned buffer
        self._staging = PinnedStaging(self.device) if self._empty.is_cuda else None
        # frees of device id tensors reach the ledger without waiting for the device
        self._pending = PendingFrees(self._release_block_ids, on_device=not self._on_cpu)
        # every block id in order (the size of upstream's free list): a run of fresh ids is
        # a view of it (``_fresh_ids``)
        self._block_ids = torch.arange(
            self.ledger.geometry.num_blocks, dtype=torch.int64, device=self.device
        )

    def _as_tensor(self, ids: array[int]) -> torch.Tensor:
        """The ledger's ids (``array('q')``, as ``BlockLedger.alloc_split`` lists them) as an
        int64 tensor on the allocator's device: the array's memory as it is, no per-id
        conversion. To a GPU through pinned memory (``PinnedStaging``), without waiting: a
        copy from pageable memory would wait for the work queued on the stream (the
        overlapped batch)."""
        if not ids:
            return self._empty
        if self._staging is not None:
            return self._staging.to_device(ids)
        t = torch.frombuffer(ids, dtype=torch.int64)
        return t if self._on_cpu else t.to(self.device)

    def _free_device_ids(self, ids: torch.Tensor) -> None:
        """Free the distinct block ids of device tensor ``ids`` (not empty): through
        ``PendingFrees``, without waiting for the device, where this rank decides alone; at
        once where ranks agree their room (``RoomLedger``: TP > 1 under a budget), whose
        figures must count a free at the same point on every rank, which the arrival of a
        copy from the device is not."""
        if isinstance(self.ledger, RoomLedger):
            self._release_block_ids(ids.cpu())
        else:
            self._pending.add(ids)

    def _release_block_ids(self, ids: torch.Tensor) -> None:
        """Free the distinct block ids of CPU tensor ``ids`` in the ledger
        (``BlockLedger.free_tensor``: tensor operations, no per-id check in Python)."""
        self.ledger.free_tensor(ids)

    def _fresh_ids(self, n: int) -> torch.Tensor | None:
        """``n`` fresh ledger blocks as an int64 tensor on the allocator's device (token ids
        at ``page_size == 1``, the page tensor SGLang's index kernels read otherwise), or
        ``None`` on a miss. The ledger hands fresh pages over as runs
        (``BlockLedger.alloc_split``): one run is a view of ``_block_ids`` (no per-id work;
        on a GPU no host-to-device copy), a few are concatenated views; ids from partly used
        pages come as an int64 array, copied as it is (and joined to the runs' views), as
        do many runs. A view is only
        read, as upstream's token ``alloc`` hands out a view of its free list. Frees whose
        copies from the device have arrived reach the ledger first. Then the ledger's free
        blocks on the pages it holds go first, the frees still in flight next (taken on the
        device, without waiting: ``PendingFrees.take``), and only what both lack comes from
        pages the ledger must acquire: ids in flight sit on pages already mapped, so taking
        them keeps the page allocator (a map, or a wait for a background unmap) off the
        scheduler's thread, as upstream reuses a freed slot rather than a new one."""
        pending = self._pending
        if pending:
            pending.settle()
        k = min(n - self.ledger.held_free(), pending.count)
        if k <= 0:
            return self._take_fresh(n)
        if k == n:
            return pending.take(n)
        head = self._take_fresh(n - k)
        if head is None:
            return None  # short by more than is in flight: a miss
        return torch.cat([head, pending.take(k)])

    def _take_fresh(self, n: int) -> torch.Tensor | None:
        """``_fresh_ids``' one attempt at the ledger."""
        got = self.ledger.alloc_split(n)
        if got is None:
            ledger = self.ledger
            if not self._budgeted and ledger.geometry.num_blocks - ledger.used() >= n:
                self.kvcore.report_unbudgeted_miss(n)  # the free count promised them
            return None
        ids, runs = got
        if not runs:
            return self._as_tensor(ids)
        if len(runs) <= _RUNS_AS_VIEWS:
            parts = [self._block_ids[a : a + k] for a, k in runs]
            if ids:
                parts.insert(0, self._as_tensor(ids))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        for first, count in runs:
            ids.extend(range(first, first + count))
        return self._as_tensor(ids)

    def _free_all(self) -> None:
        """``clear()``'s work (SGLang's ``/flush_cache``, and start-up): every block freed;
        the page work since the last report is logged first (``log_page_work``)."""
        self.kvcore.log_page_work("cache cleared")
        self._pending.settle(wait=True)
        ledger = self.ledger
        held = [b for b in range(1, ledger.geometry.num_blocks) if ledger.is_allocated(b)]
        if held:
            ledger.free(held)

    def _free_ids(self) -> torch.Tensor:
        self._pending.settle(wait=True)
        ledger = self.ledger
        free = [b for b in range(1, ledger.geometry.num_blocks) if not ledger.is_allocated(b)]
        return torch.tensor(free, dtype=torch.int64, device=self.device)

    def _available_blocks(self) -> int:
        """Blocks SGLang may plan with: the physical room under a budget, else the logical
        free count (the same on every TP rank, whatever the background refill is doing).
        Either counts the frees still on their way from the device (``PendingFrees``), as
        upstream counts a free at once."""
        if self._budgeted:
            return self.ledger.available() + self._pending.count
        return self._logical_free_blocks()

    def _logical_free_blocks(self) -> int:
        """Blocks free in the ledger or on their way there from the device."""
        ledger = self.ledger
        return ledger.geometry.num_blocks - ledger.used() + self._pending.count

    def kvcore_step(self, tree_cache: Any = None) -> None:
        """Called by the patched scheduler (patch 0006) once per iteration with its tree
        cache, on every rank in lockstep, before the iteration allocates: the first call for
        a tree attaches kvcore's eviction policy to it (``_attach_tree``); then the tree is
        evicted down to ``max_cached_tokens`` (``enforce_cache_bound``: on SGLang < 0.5.23,
        whose pre-allocation eviction never reaches the allocator, the bound holds at every
        iteration start) and by what a lowered limit asks back (``shed``); last, where the
        ranks agree a physical budget (``kvcore.parallel.agreement.AgreedLedger``), the agreed
        room is refreshed while the budget binds (after the evictions, so it counts the pages
        that freed). Frees whose copies from the device have completed reach the ledger
        first."""
        if self._pending:
            self._pending.settle()
        if tree_cache is not None:
            if tree_cache is not getattr(self, "_kvcore_tree", None):
                self._attach_tree(tree_cache)
            self.enforce_cache_bound(tree_cache)
            self.shed(tree_cache)
        step = getattr(self.ledger, "step", None)
        if step is not None:
            step()

    def _attach_tree(self, tree_cache: Any) -> None:
        """Remember ``tree_cache`` and give it kvcore's eviction order where the policy allows
        (``kvcore.adapters.sglang.eviction.attach``)."""
        self._kvcore_tree = tree_cache
        eviction.attach(tree_cache, self)

    def conservation_available_size(self) -> int:
        """Tokens the ledger holds free (logical, not capped by the physical budget): the
        ``available`` term of the scheduler's "available + evictable + protected = total"
        leak check in elastic mode."""
        return self._logical_free_blocks() * self.page_size

    def enforce_cache_bound(self, tree_cache: Any) -> int:
        """Evict the prefix cache down to ``max_cached_tokens`` evictable tokens; returns the
        tokens evicted (0 without a bound or a sharing cache)."""
        bound = self.max_cached_tokens
        if bound is None or not _shares_prefixes(tree_cache):
            return 0
        return self._evict(tree_cache, tree_cache.evictable_size() - bound)

    def shed(self, tree_cache: Any) -> int:
        """Evict the prefix cache by what the memory gate asks back (a limit lowered below
        use, ``kvctl limit``): ``PageAllocator.take_shed()`` pages' worth of tokens, once per
        allocator round, in kvcore's page-aware order (leaves that empty a page first);
        returns the tokens evicted. Only a rank that decides alone sheds: ranks that agree a
        budget (TP > 1) must evict alike and their asks differ, so there a lowered limit
        stops growth only. SGLang's scheduler iterates while idle too, so an idle instance
        sheds as well."""
        if getattr(self.ledger, "step", None) is not None or not _shares_prefixes(tree_cache):
            return 0
        pages = self.ledger.pages
        if not pages.shed_wanted():
            return 0
        tokens = pages.take_shed() * self.ledger.geometry.blocks_per_page * self.page_size
        return self._evict(tree_cache, min(tokens, tree_cache.evictable_size()))

    def _evict(self, tree_cache: Any, num_tokens: int) -> int:
        """``tree_cache.evict`` of ``num_tokens`` (0: nothing) to give memory back, in
        page-aware order where it applies (``eviction.giving_back``); the tokens evicted."""
        if num_tokens <= 0:
            return 0
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        with eviction.giving_back(tree_cache):
            evicted = tree_cache.evict(EvictParams(num_tokens=num_tokens))
        return int(evicted.num_tokens_evicted)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None:
        """SGLang's pre-allocation eviction (0.5.23+), after first enforcing the cache bound.
        A tree ``kvcore_step`` has not attached yet (a caller outside the scheduler loop) is
        attached here first."""
        if tree_cache is not None and tree_cache is not getattr(self, "_kvcore_tree", None):
            self._attach_tree(tree_cache)
        self.enforce_cache_bound(tree_cache)
        return super().evict_to_free_tokens(tree_cache, num_tokens)  # type: ignore[misc,no-any-return]


class ElasticTokenToKVPoolAllocator(_ElasticMixin, TokenToKVPoolAllocator):  # type: ignore[misc]
    """``TokenToKVPoolAllocator`` (``page_size == 1``) over kvcore's ledger: block = token."""

    def __init__(
        self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        self.ledger = None  # type: ignore[assignment]  # clear() runs inside super().__init__
        super().__init__(size, dtype, device, kvcache, need_sort)
        self._bind(kvcache)
        self.clear()

    def clear(self) -> None:
        self.free_group = None
        if self.ledger is None:
            return
        self._free_all()
        self.free_pages = self._empty
        self.release_pages = self._empty

    def available_size(self) -> int:
        return self._available_blocks()

    def get_all_free_pages(self) -> torch.Tensor:
        return self._free_ids()

    def merge_and_sort_free(self) -> None:
        return None

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._fresh_ids(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self._free_device_ids(free_index)  # token ids are block ids here


class ElasticPagedTokenToKVPoolAllocator(_ElasticMixin, PagedTokenToKVPoolAllocator):  # type: ignore[misc]
    """``PagedTokenToKVPoolAllocator`` over kvcore's ledger: block = SGLang page.

    ``alloc_extend``/``alloc_decode`` count the new pages exactly, take that many block ids
    from the ledger and let SGLang's own index kernel lay the request tokens onto them.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
        need_sort: bool,
    ) -> None:
        self.ledger = None  # type: ignore[assignment]  # clear() runs inside super().__init__
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        self._bind(kvcache)
        if self.ledger.geometry.num_blocks != self.num_pages + 1:
            raise UnsupportedConfiguration(
                f"elastic paged allocator: {self.num_pages} SGLang pages but the KV pool has "
                f"{self.ledger.geometry.num_blocks - 1} kvcore blocks",
                hint="give the allocator and the pool the same size and page size",
            )
        self.clear()

    def clear(self) -> None:
        self.free_group = None
        self.free_page_ids_group: list[torch.Tensor] = []
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0
        if self.ledger is None:
            return
        self._free_all()
        self.free_pages = self._empty

    def available_size(self) -> int:
        return self._available_blocks() * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        return self._free_ids()

    def merge_and_sort_free(self) -> None:
        return None

    def _take(self, num_pages: int) -> bool:
        """Stage ``num_pages`` fresh ledger blocks as ``free_pages`` for SGLang's kernel."""
        pages = self._fresh_ids(num_pages)
        if pages is None:
            return False
        self.free_pages = pages
        return True

    def alloc(self, need_size: int) -> torch.Tensor | None:
        ps = self.page_size
        if not self._take(need_size // ps):
            return None
        out = (self.free_pages[:, None] * ps + torch.arange(ps, device=self.device)).reshape(-1)
        self.free_pages = self._empty
        return out

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        if num_new_pages is None:
            num_new_pages = _extend_new_pages(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        if _NAIVE_KERNELS:  # 0.5.23+: upstream's alloc_extend minus its free-list bookkeeping
            pages = self._fresh_ids(num_new_pages)
            if pages is None:
                return None
            return self._extend_kernel(prefix_lens, seq_lens, last_loc, pages, extend_num_tokens)
        if not self._take(num_new_pages):
            return None
        return self._run_upstream(
            super().alloc_extend,
            prefix_lens,
            prefix_lens_cpu,
            seq_lens,
            seq_lens_cpu,
            last_loc,
            extend_num_tokens,
            num_new_pages=num_new_pages,
        )

    def _extend_kernel(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        pages: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor:
        """SGLang's extend index kernel (Triton, or its torch fallback) over the ledger's
        fresh blocks ``pages``; on an error they go back to the ledger."""
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        try:
            if self.use_triton_kernels:
                bs = len(prefix_lens)
                alloc_extend_kernel[(bs,)](
                    prefix_lens, seq_lens, last_loc, pages, out, next_power_of_2(bs), self.page_size
                )
            else:
                _paged.alloc_extend_naive(
                    prefix_lens, seq_lens, last_loc, pages, out, self.page_size, self.device
                )
        except BaseException:
            self._release_page_ids(pages)
            raise
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        num_new_pages = _decode_new_pages(seq_lens_cpu, self.page_size)
        if not self._take(num_new_pages):
            return None
        if not _NAIVE_KERNELS:  # SGLang < 0.5.23: the Triton kernel is the only decode path
            return self._run_upstream(super().alloc_decode, seq_lens, seq_lens_cpu, last_loc)
        # upstream's alloc_decode minus its free-list bookkeeping, so the new-page count is
        # computed once, not twice
        pages, self.free_pages = self.free_pages, self._empty
        bs = len(seq_lens)
        out = torch.empty((bs,), dtype=torch.int64, device=self.device)
        try:
            if self.use_triton_kernels:
                alloc_decode_kernel[(bs,)](
                    seq_lens, last_loc, pages, out, next_power_of_2(bs), self.page_size
                )
            else:
                _paged.alloc_decode_naive(
                    seq_lens, last_loc, pages, out, self.page_size, num_new_pages
                )
        except BaseException:
            self._release_page_ids(pages)
            raise
        return out

    def _run_upstream(self, method: Any, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """Run upstream's ``method`` over the staged ``free_pages``; on an error the staged
        pages go back to the ledger."""
        try:
            out: torch.Tensor | None = method(*args, **kwargs)
        except BaseException:
            self._release_page_ids(self.free_pages)
            raise
        finally:
            self.free_pages = self._empty
        return out

    def free(self, free_index: torch.Tensor) -> None:
        """Upstream's ``free``: the deduplicated page ids of ``free_index`` go to the ledger
        (``_release_block_ids``; ``torch.unique`` waits for the device here, as upstream's
        does)."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self._release_block_ids(torch.unique(free_index // self.page_size).cpu())
        if self.debug_mode:
            self._debug_check_no_duplicate_pages()

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # every other upstream free path (free_segment, free_page_ids, free_group_end) ends here
        ids = page_ids[0] if len(page_ids) == 1 else torch.cat(page_ids)
        if ids.numel():
            self._free_device_ids(ids)


# ``_fresh_ids`` on a GPU concatenates views of the id table for up to this many runs (a
# few tensor calls each); more runs are expanded to ids and copied in one tensor
_RUNS_AS_VIEWS = 8

# Batches of up to this many requests count their new pages in Python ints from the CPU
# lengths (one ``tolist`` each); larger ones in numpy over the same tensors' memory (no copy;
# four array operations whose cost hardly grows with the batch, where the Python count grows
# per request). Both give SGLang's ``get_num_new_pages`` (eight or more torch calls) exactly;
# ``benchmarks/sglang_alloc.py`` times the three.
_COUNT_IN_PYTHON = 40


def _extend_new_pages(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, ps: int) -> int:
    """Pages an extend batch needs beyond its requests' partial last pages: the sum over
    requests of ``ceil(seq_len / ps) - ceil(prefix_len / ps)``, SGLang's
    ``get_num_new_pages`` (``ceil(n / ps) == (n - 1) // ps + 1`` for ``n >= 0``, floor
    division, so the ``+ 1`` cancels between the two sums in numpy)."""
    if seq_lens_cpu.numel() > _COUNT_IN_PYTHON:
        seq = seq_lens_cpu.numpy()
        prefix = prefix_lens_cpu.numpy()
        return int(((seq - 1) // ps).sum() - ((prefix - 1) // ps).sum())
    seq_l: list[int] = seq_lens_cpu.tolist()
    prefix_l: list[int] = prefix_lens_cpu.tolist()
    return sum(-(-n // ps) for n in seq_l) - sum(-(-n // ps) for n in prefix_l)  # ceil divisions


def _decode_new_pages(seq_lens_cpu: torch.Tensor, ps: int) -> int:
    """Pages a decode step needs: requests whose new token (the ``seq_len``-th) starts a
    page, ``seq_len % ps == 1``, SGLang's ``get_num_new_pages(decode=True)``."""
    if seq_lens_cpu.numel() > _COUNT_IN_PYTHON:
        return int((seq_lens_cpu.numpy() % ps == 1).sum())
    seq: list[int] = seq_lens_cpu.tolist()
    return sum(n % ps == 1 for n in seq)


def _shares_prefixes(tree_cache: Any) -> bool:
    """Whether ``tree_cache`` is a prefix cache whose evictable tokens ``evict`` can free
    (not a chunk cache, and not absent)."""
    if tree_cache is None:
        return False
    sharing = getattr(tree_cache, "supports_prefix_sharing", None)  # 0.5.23+
    return bool(sharing() if sharing is not None else not tree_cache.is_chunk_cache())


def _is_hybrid_linear(kvcache: Any) -> bool:
    """Whether ``kvcache`` is SGLang's ``HybridLinearKVPool`` (full attention + Mamba)."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    return type(kvcache) is HybridLinearKVPool


_ELASTIC = {
    TokenToKVPoolAllocator: ElasticTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator: ElasticPagedTokenToKVPoolAllocator,
}


def is_elastic(allocator: Any) -> bool:
    """Whether ``allocator`` is one of this module's elastic allocators."""
    return isinstance(allocator, _ElasticMixin)


def elastic_token_allocator(upstream: Any) -> Any:
    """The elastic equivalent of SGLang's freshly built token or paged allocator ``upstream``
    (same size, page size, dtype, device, KV pool and sort mode); ``upstream`` is discarded.
    Raises ``UnsupportedConfiguration`` naming the allocator class for any other (HiSparse,
    page-interleave sharding, NPU, DSV4, unified pools), and for an allocator that is elastic
    already (a draft worker's pool sharing the target's: speculative decoding). The hybrid
    SWA allocator is ``kvcore.adapters.sglang.swa``'s, over two of these."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    if isinstance(upstream, (_ElasticMixin, SWATokenToKVPoolAllocator)):
        raise UnsupportedConfiguration(
            "kvcore elastic KV does not support speculative decoding (a draft worker's KV "
            "pool sharing the target's elastic allocator)",
            hint="start without --speculative-algorithm or without --kvcore-elastic",
        )
    cls = _ELASTIC.get(type(upstream))
    if cls is None:
        raise UnsupportedConfiguration(
            f"kvcore elastic KV does not support SGLang's {type(upstream).__name__}",
            hint="supported: TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator and the "
            "hybrid SWATokenToKVPoolAllocator (MHA/MLA and full + sliding-window models "
            "without HiSparse, KV sharding or DCP); start without --kvcore-elastic",
        )
    kvcache = upstream.get_kvcache()
    if cls is ElasticTokenToKVPoolAllocator:
        return cls(upstream.size, upstream.dtype, upstream.device, kvcache, upstream.need_sort)
    return cls(
        upstream.size,
        upstream.page_size,
        upstream.dtype,
        upstream.device,
        kvcache,
        upstream.need_sort,
    )
