"""The block ledger: which engine block ids are allocated, and on which pages they sit.

``BlockLedger`` is the KV cache manager an engine's allocator seam calls (vLLM's block pool,
SGLang's paged token allocator). It hands out block ids, places them page-aware so memory
stays dense, and gives a page back to its ``kvcore.memory.pages.PageAllocator`` as soon as every
block on it is free: that is when kvcore can return memory to the driver.

Meanings: a block id is *allocated* from ``alloc`` until ``free``; a *pinned* block (one of
``pinned_blocks``, e.g. vLLM's null block) is allocated for good at construction. An
engine must only ``free`` a block once no metadata references its contents (a prefix-cached
block stays allocated here until the engine evicts it), which is what makes invariant 1 of
``docs/architecture.md`` hold: a page is released only when none of its blocks is
allocated.

Placement. ``alloc`` fills partly used pages first, fullest first, so sparse pages drain and
can be unmapped; only then does it take fresh pages from the page allocator.
``eviction_order`` is the matching hint for the engine's eviction: among the cached blocks it
may evict, those whose eviction empties a whole page come first.

Cost. ``alloc(n)`` and ``free(ids)`` are O(n) plus O(pages touched), with no per-block
objects: per-page free stacks of ids (lists, or with ``array_stacks`` ``array('q')``s of
machine int64s, which a tensor is built from or read into with a memory copy, no Python int
per id), a ``bytearray`` of block states, and buckets of partly used pages indexed by their
free count (a bit mask finds the fullest in O(1)).
A page is *held* from the ``acquire`` that brought it in until the ``release`` once its
last block is freed; the free blocks on held pages are what ``alloc`` hands out first. The
per-id Python work is bounded by the pages touched, not the ids: ``alloc`` hands out a page
taken whole (and a run of consecutive fresh pages) with list and ``bytearray`` slice
operations; ``free`` of many ids sorts them and checks and writes each page's share at once
(a contiguous share with one ``bytearray.count`` and one slice write; a page it empties
with one slice write and no stack work); distinct ids forming one run (and ``free_range``,
for a caller that holds them as a run) are checked with one count for all. ``alloc_split``
hands fresh pages over as ``(first, count)`` runs and ``free_runs`` takes runs back, for a
caller that keeps ids as ranges (SGLang's adapter: a run is a slice of a table of every id):
no per-id int of a fresh page is made. ``free_tensor`` takes ids as a tensor and checks and
writes them with tensor operations (SGLang's token ids, freed on the device). ``alloc``
makes no page-allocator call while the partly used pages suffice.
``benchmarks/ledger_alloc.py`` and, in an engine's allocator, ``benchmarks/sglang_alloc.py``
exercise these paths.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from kvcore.errors import GeometryError, InvalidTransition, PoolFailed
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.pages import PageAllocator, PageState

__all__ = ["BlockLedger"]

if TYPE_CHECKING:
    from typing import TypeAlias

    _Stack: TypeAlias = list[int] | array[int]  # a page's free ids (see ``array_stacks``)

K = TypeVar("K", bound=Hashable)
_Out = TypeVar("_Out", list[int], "array[int]")

_FREE = 0
_ALLOCATED = 1
_PINNED = 2  # allocated for good at construction (``pinned_blocks``: vLLM's null block)
_NOT_HELD = -1  # a page this ledger does not hold (not acquired from the page allocator)
_ALLOCATED_BYTE = bytes((_ALLOCATED,))
# page states in which the page allocator hands a page out before its free pages (the
# reserve, the unmap queue, a map for the reserve in flight)
_IDLE_MAPPED = frozenset({PageState.RESERVED, PageState.UNMAP_QUEUED, PageState.MAPPING})
# free() of at least this many ids checks and writes them page by page (sorted, slices)
_BY_PAGE_MIN = 8
# free_tensor() of at least this many ids checks and writes them with numpy operations;
# fewer cost less as a list (the numpy path's fixed cost is about 200 list ids')
_TENSOR_FREE_MIN = 192


class BlockLedger:
    """Block ids ``0 .. geometry.num_blocks-1`` over the pages of ``pages``.

    ``pinned_blocks`` are *pinned*: allocated for good at construction (vLLM's null block
    0); their pages are acquired (mapped) at once and never released, and ``free`` refuses
    them. Raises ``GeometryError`` when ``pages`` covers fewer pages than ``geometry`` needs,
    ``InvalidTransition`` for a pinned id outside the geometry, ``PoolFailed`` when the
    pinned blocks' pages cannot be mapped. Thread-safe (one lock per call).

    ``array_stacks`` keeps each page's free ids as an ``array('q')`` instead of a list: for
    a caller that moves ids to and from tensors (SGLang's token allocator), whose
    ``alloc_split`` and ``free_tensor`` then copy machine ints instead of making a Python int
    per id; a caller that takes and gives lists (vLLM's block pool) is faster with lists.
    Either way ``alloc`` returns a list and ``alloc_split`` an array.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        pages: PageAllocator,
        pinned_blocks: Iterable[int] = (),
        *,
        array_stacks: bool = False,
    ) -> None:
        if pages.num_pages < geometry.num_pages:
            raise GeometryError(
                f"block ledger: the page allocator covers {pages.num_pages} pages, the "
                f"geometry needs {geometry.num_pages}",
                hint="build the mapper and the ledger from the same KVGeometry",
            )
        self._geometry = geometry
        self._pages = pages
        self._bpp = bpp = geometry.blocks_per_page
        self._num_blocks = nb = geometry.num_blocks
        num_pages = geometry.num_pages
        self._state = bytearray(nb)
        self._states = np.frombuffer(self._state, dtype=np.uint8)  # the same memory
        # free block ids of each page (empty for pages this ledger does not hold)
        self._new_stack: Callable[..., _Stack] = partial(array, "q") if array_stacks else list
        self._stacks: list[_Stack] = [self._new_stack() for _ in range(num_pages)]
        # with arrays, every id in order: a run of ids is a slice of it (a memory copy)
        self._all_ids = array("q", range(nb)) if array_stacks else None
        self._capacity = [len(geometry.blocks_of(p)) for p in range(num_pages)]
        # partly used pages by free count f (1 <= f < capacity); bit f of _nonempty is set
        # while _buckets[f] holds a page
        self._buckets: list[dict[int, None]] = [{} for _ in range(bpp + 1)]
        self._nonempty = 0
        # per page: _NOT_HELD, 0 (held, full) or its free count f (held, in bucket f)
        self._bucket_of = [_NOT_HELD] * num_pages
        # the geometry's last page when it holds fewer than bpp blocks (else -1: none)
        self._short_page = num_pages - 1 if self._capacity[-1] != bpp else -1
        self._held_free = 0  # free blocks on held pages
        self._used = 0  # allocated blocks, pinned ones included
        self._lock = threading.Lock()

        pinned = sorted(set(pinned_blocks))
        bad = [b for b in pinned if not 0 <= b < nb]
        if bad:
            raise InvalidTransition(
                f"block ledger: pinned blocks {bad} are outside 0..{nb - 1}",
                ids=bad,
            )
        held = sorted({b // bpp for b in pinned})
        if held and not pages.acquire_ids(held):
            raise PoolFailed(
                f"block ledger: cannot map pages {held} for the pinned blocks {pinned}",
                hint="free device memory or raise the instance's limit, then restart",
            )
        for b in pinned:
            self._state[b] = _PINNED
        # a page's row of block states once every block on it is allocated: the default, and
        # the rows that differ (the short last page, pages holding pinned blocks)
        self._full_row = _ALLOCATED_BYTE * bpp
        self._full_rows: dict[int, bytes] = {}
        if self._short_page >= 0:
            self._full_rows[num_pages - 1] = _ALLOCATED_BYTE * self._capacity[-1]
        for p in held:
            first = p * bpp
            row = bytearray(_ALLOCATED_BYTE * self._capacity[p])
            for b in geometry.blocks_of(p):
                if self._state[b] == _PINNED:
                    row[b - first] = _PINNED
            self._full_rows[p] = bytes(row)
        self._used = len(pinned)
        for p in held:
            stack = self._new_stack(
                b for b in reversed(geometry.blocks_of(p)) if self._state[b] == _FREE
            )
            self._stacks[p] = stack
            self._bucket_of[p] = 0
            self._held_free += len(stack)
            if stack:
                self._bucket_add(p, len(stack))

    # ------------------------------------------------------------------ public seam

    @property
    def geometry(self) -> KVGeometry:
        """The block and page geometry the ledger places blocks on."""
        return self._geometry

    @property
    def pages(self) -> PageAllocator:
        """The page allocator this ledger draws from."""
        return self._pages

    def alloc(self, n: int) -> list[int] | None:
        """Allocate ``n`` block ids, all or nothing.

        Fills partly used pages first (fullest first), then takes fresh pages from the page
        allocator. Returns ``None`` on a physical miss (the page allocator could not map
        enough pages), with nothing allocated. Raises ``PoolFailed`` once the page allocator
        has failed.
        """
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"block ledger: cannot allocate {n} blocks")
        with self._lock:
            return self._alloc(n, None, [])

    def alloc_split(self, n: int) -> tuple[array[int], list[tuple[int, int]]] | None:
        """``alloc(n)`` in two parts, for a caller that turns ids into a tensor (a run is a
        slice of a table of every block id; SGLang's adapter): the ids taken from partly
        used pages, as an ``array('q')`` in no particular order (``torch.frombuffer`` reads
        it without a per-id conversion), and the ids of fresh pages as
        ``(first, count)`` runs, ascending and not adjacent. Together the ``n`` ids
        ``alloc`` would have handed out (same placement, same all-or-nothing, ``None`` and
        ``PoolFailed`` alike). Partly used ids of at most one page's worth that form one
        range (a page filled from below, taken whole) join the runs; others stay a list:
        splitting scattered ids into runs costs more per id than the caller's copy of
        them. Fresh pages are never handed over as per-id ints."""
        if n <= 0:
            if n == 0:
                return array("q"), []
            raise ValueError(f"block ledger: cannot allocate {n} blocks")
        ids = array("q")
        with self._lock:
            runs: list[tuple[int, int]] = []
            if self._alloc(n, runs, ids) is None:
                return None
        if ids and len(ids) <= self._bpp:
            lo = min(ids)
            if max(ids) - lo == len(ids) - 1:  # distinct ids spanning as many values
                runs.append((lo, len(ids)))
                ids = array("q")
        return ids, (_merged(runs) if len(runs) > 1 else runs)

    def free(self, block_ids: Sequence[int], fence: int | None = None) -> None:
        """Free allocated block ids. A page whose blocks are now all free goes back to the
        page allocator (behind ``fence``, an engine step number, when given: it stays mapped
        until ``pages.retire(upto)`` with ``upto >= fence``). Raises ``InvalidTransition``
        naming the id, with nothing changed, for a double free, an id never allocated, a
        pinned id or one out of range."""
        with self._lock:
            if len(block_ids) >= _BY_PAGE_MIN and self._free_by_page(block_ids, fence):
                return
            self._free_each(block_ids, fence)

    def free_tensor(self, block_ids: torch.Tensor, fence: int | None = None) -> None:
        """``free`` of the ids in ``block_ids``, a 1-D integer tensor on the CPU, for a caller
        that holds them as one (SGLang's adapter: the ids the engine freed on the device,
        copied to the host). From ``_TENSOR_FREE_MIN`` ids on they are sorted, checked and
        written with a few numpy operations over the block states (a numpy operation's fixed
        cost is a fraction of a tensor operation's), and copied once into an int64 array (no
        Python int per id) for the pages' free stacks; fewer go to ``free``. Same checks,
        same all-or-nothing, same ``InvalidTransition`` as ``free``."""
        n = block_ids.numel()
        if n < _TENSOR_FREE_MIN:
            if n:
                self.free(block_ids.tolist(), fence)
            return
        # numpy's stable sort (a merge of runs) is the fastest here at every size: a
        # request's ids come in runs, and a tensor sort's fixed cost is larger
        ids = np.sort(block_ids.reshape(-1).to("cpu", torch.int64).numpy(), kind="stable")
        listed = array("q")
        listed.frombytes(ids.tobytes())
        with self._lock:
            in_range = listed[0] >= 0 and listed[-1] < self._num_blocks
            if not in_range or not self._free_sorted(ids, listed, fence):
                self._free_each(listed, fence)  # raises naming the id

    def free_range(self, first: int, count: int, fence: int | None = None) -> None:
        """``free(range(first, first + count), fence)`` without building or checking a list
        of ids: for a caller that holds its ids as one contiguous run (SGLang's sorted,
        deduplicated page ids of a request). One count checks the whole run and one slice
        write frees it. Raises ``InvalidTransition`` naming the first id that is not
        freeable, with nothing changed, like ``free``."""
        if count <= 0:
            if count == 0:
                return
            raise ValueError(f"block ledger: cannot free {count} blocks")
        with self._lock:
            if (
                first < 0
                or first + count > self._num_blocks
                or not self._free_run(first, count, fence)
            ):
                self._free_each(range(first, first + count), fence)

    def free_runs(self, runs: Sequence[tuple[int, int]], fence: int | None = None) -> None:
        """``free`` of the ids of ``runs`` (``(first, count)`` pairs, as ``alloc_split``
        returns them), all at once: one count checks each run and slice writes free it.
        Raises ``InvalidTransition`` naming the first id that is not freeable (runs that
        overlap name an id twice), with nothing changed, like ``free``; ``ValueError`` for
        a negative count."""
        if len(runs) == 1:
            self.free_range(*runs[0], fence=fence)
            return
        if any(count < 0 for _, count in runs):
            raise ValueError(f"block ledger: cannot free runs {list(runs)}")
        with self._lock:
            if not self._free_runs(runs, fence):
                self._free_each([b for a, k in runs for b in range(a, a + k)], fence)

    def available(self) -> int:
        """Blocks ``alloc`` could hand out now: free blocks on held pages plus the blocks of
        the pages the page allocator could still give (an upper bound when the device itself
        runs short). While the geometry's short last page is mapped but not held (in the
        reserve or the unmap queue, or being mapped for the reserve), the allocator hands it
        out before any free page, so it counts as one of those pages for the blocks it
        holds: under a budget that admits fewer pages than are left, the figure must not
        promise what ``alloc`` cannot back. Without a budget the figure is exact. A snapshot
        read without the lock, like ``PageAllocator.available`` (engines ask before every
        allocation)."""
        held_free = self._held_free
        unheld = self._num_blocks - self._used - held_free
        if unheld <= 0:
            return held_free
        room = self._pages.available() * self._bpp
        short = self._short_page
        # mapped and idle, the short page is handed out before any free page (a free one,
        # the highest id, comes last: then ``unheld`` below already counts it exactly)
        if (
            room
            and short >= 0
            and self._bucket_of[short] == _NOT_HELD
            and self._pages.state(short) in _IDLE_MAPPED
        ):
            room -= self._bpp - self._capacity[short]
        return held_free + min(room, unheld)

    def withheld(self) -> int:
        """Free blocks that new requests may not take now (what a new request may take is
        ``available()`` less these): while the memory gate wants pages in use back
        (``PageAllocator.shed_wanted()``: a limit lowered below use, or a share exceeded
        while a neighbour waits), the free blocks of that many pages (all of them when fewer
        are free). Requests already running keep growing into them
        (``available()`` counts them); new ones are not admitted into pages that should
        empty, so those pages drain as the running requests finish and their memory goes
        back. Taking them from running requests too (by preemption) thrashed between two
        instances on a GPU (docs/vllm.md, "Shares of a shared GPU"). 0 while nothing is
        wanted back. A plain read, no gate call."""
        shed = self._pages.shed_wanted()
        return min(self._held_free, shed * self._bpp) if shed else 0

    def note_shortage(self, n: int) -> None:
        """The engine needed ``n`` more blocks than ``available()`` offered. When the logical
        capacity still has them (blocks on pages this ledger does not hold), what is short
        is physical memory: the page allocator is told how many pages it lacks
        (``PageAllocator.note_wanted``). A shortage of capacity itself says nothing. Any
        thread; a snapshot read like ``available()``."""
        if n <= 0:
            return
        unheld = self._num_blocks - self._used - self._held_free
        if unheld <= 0:
            return
        self._pages.note_wanted(-(-min(n, unheld) // self._bpp))

    def used(self) -> int:
        """Allocated blocks, pinned ones included."""
        return self._used

    def held_free(self) -> int:
        """Free blocks on pages this ledger holds: what ``alloc`` can hand out without
        mapping a page (the part of ``available()`` that costs no memory gate charge)."""
        return self._held_free

    def page_of(self, block_id: int) -> int:
        """The page id backing ``block_id``."""
        return block_id // self._bpp

    def is_allocated(self, block_id: int) -> bool:
        """Whether ``block_id`` is allocated (pinned blocks are)."""
        return self._state[block_id] != _FREE

    def eviction_order(self, candidates: Iterable[int]) -> list[int]:
        """Reorder evictable block ids (allocated, cached, unreferenced, in the engine's LRU
        order) so blocks whose eviction empties a whole page come first; stable within both
        groups. A page empties when every allocated block on it is a candidate. Ids that are
        not allocated here go to the second group."""
        ordered = list(candidates)
        with self._lock:
            empties = self._emptied_pages_locked(ordered)
        if not empties:
            return ordered
        emptying = {b for ids in empties.values() for b in ids}
        first: list[int] = []
        rest: list[int] = []
        for b in ordered:
            (first if b in emptying else rest).append(b)
        return first + rest

    def blocks_emptying_pages(self, candidates: Iterable[int], pages: int) -> list[int]:
        """Of evictable block ids (as for ``eviction_order``: allocated, cached,
        unreferenced, in the engine's LRU order), those whose eviction empties up to
        ``pages`` whole pages, the page of the least recently used candidate first; each
        page's ids in candidate order. ``[]`` when no page would empty (every page has a
        block in use or pinned) or ``pages <= 0``. What an engine frees to shed memory
        (``PageAllocator.shed_wanted``): evicting cached blocks on a page still in use would
        lose them and give nothing back."""
        if pages <= 0:
            return []
        with self._lock:
            empties = self._emptied_pages_locked(list(candidates))
        out: list[int] = []
        for ids in list(empties.values())[:pages]:
            out += ids
        return out

    def owners_emptying_page(
        self, owners: Mapping[K, Iterable[int]], evictable: Iterable[int] = ()
    ) -> list[K]:
        """The owners to free to empty one held page, the cheapest such page: ``owners``
        maps whatever holds allocated blocks (an engine's running requests) to its block
        ids; a page qualifies when every allocated block on it belongs to a listed owner or
        is in ``evictable`` (cached, unreferenced blocks the engine evicts on its own), and
        it costs the blocks its owners hold in all (what freeing them throws away). Returns
        the chosen page's owners in ``owners``' order; ``[]`` when no page qualifies (each
        holds a pinned block or one nobody listed holds, or only evictable blocks). What an
        engine preempts to give back a page the memory gate wants (``reclaim``)."""
        with self._lock:
            state = self._state
            bpp = self._bpp
            nb = self._num_blocks
            covered: dict[int, set[int]] = {}
            held_by: dict[int, list[K]] = {}
            cost: dict[K, int] = {}
            for owner, ids in owners.items():
                mine = {b for b in ids if 0 <= b < nb and state[b] == _ALLOCATED}
                cost[owner] = len(mine)
                for p in {b // bpp for b in mine}:
                    held_by.setdefault(p, []).append(owner)
                for b in mine:
                    covered.setdefault(b // bpp, set()).add(b)
            for b in evictable:
                if 0 <= b < nb and state[b] == _ALLOCATED and b // bpp in held_by:
                    covered[b // bpp].add(b)
            best: tuple[int, int, int] | None = None
            for p, blocks in covered.items():
                if self._bucket_of[p] == _NOT_HELD or p not in held_by:
                    continue
                if len(blocks) != self._capacity[p] - len(self._stacks[p]):
                    continue  # a block here that nobody listed holds, or a pinned one
                key = (sum(cost[o] for o in held_by[p]), len(held_by[p]), p)
                if best is None or key < best:
                    best = key
        if best is None:
            return []
        chosen = set(held_by[best[2]])
        return [o for o in owners if o in chosen]

    def close(self) -> None:
        """Close the page allocator (unmaps every page). The ledger is unusable after."""
        self._pages.close()

    # ------------------------------------------------------------------ helpers

    def _emptied_pages_locked(self, ordered: list[int]) -> dict[int, list[int]]:
        """The held pages whose every allocated block is in ``ordered`` (in the order of
        their first candidate), each with its candidates (deduplicated, in order)."""
        state = self._state
        bpp = self._bpp
        nb = self._num_blocks
        by_page: dict[int, list[int]] = {}
        for b in dict.fromkeys(ordered):
            if 0 <= b < nb and state[b] == _ALLOCATED:
                by_page.setdefault(b // bpp, []).append(b)
        return {
            p: ids
            for p, ids in by_page.items()
            if self._bucket_of[p] != _NOT_HELD
            and len(ids) == self._capacity[p] - len(self._stacks[p])
        }

    def _alloc(self, n: int, runs: list[tuple[int, int]] | None, out: _Out) -> _Out | None:
        """``alloc(n)`` (``n > 0``) under ``_lock``: appends to ``out`` (returned) the ids
        taken from partly used pages, then, when ``runs`` is ``None``, those of fresh pages;
        else the fresh pages' ids go to ``runs`` as ``(first, count)`` ranges. ``None`` on a
        physical miss, with ``out`` unchanged."""
        held_free = self._held_free
        if n <= held_free:  # the partly used pages suffice: no page-allocator call
            self._take_partly_used(out, n)
            self._held_free = held_free - n
        else:
            fresh = self._acquire_pages(n - held_free)
            if fresh is None:
                return None
            if held_free:  # every partly used page, taken whole
                self._take_partly_used(out, held_free)
            self._held_free = 0
            self._take_fresh(out, n - held_free, fresh, runs)
        self._used += n
        return out

    def _acquire_pages(self, blocks: int) -> list[int] | None:
        """Fresh pages covering ``blocks`` more blocks (the last page of the geometry may
        hold fewer than ``blocks_per_page``) in ascending order, or ``None`` with nothing
        kept."""
        bpp = self._bpp
        got = self._pages.acquire(-(-blocks // bpp))
        if got is None:
            return None
        got.sort()  # ascending: consecutive pages make one run of block ids
        if got[-1] != self._short_page:  # every page whole: they cover ``blocks``
            return got
        capacity = self._capacity
        covered = sum(capacity[p] for p in got)
        while covered < blocks:  # the short last page came with them: ask for more
            more = self._pages.acquire(-(-(blocks - covered) // bpp))
            if more is None:
                self._pages.release(got)
                return None
            got += more
            covered += sum(capacity[p] for p in more)
        return got

    def _take_partly_used(self, out: list[int] | array[int], n: int) -> int:
        """Append up to ``n`` free blocks of partly used pages to ``out``, fullest page
        first; returns how many are still wanted. A page taken whole costs one slice write,
        whatever its size; only the last page, taken in part, is written id by id."""
        state = self._state
        stacks = self._stacks
        buckets = self._buckets
        bucket_of = self._bucket_of
        full_rows = self._full_rows
        full_row = self._full_row
        bpp = self._bpp
        while n and self._nonempty:
            mask = self._nonempty
            f = (mask & -mask).bit_length() - 1  # len(stacks[p]) of the pages in bucket f
            bucket = buckets[f]
            p = bucket.popitem()[0]
            if not bucket:
                self._nonempty = mask & ~(1 << f)
            stack = stacks[p]
            if f <= n:  # take the whole page: every block on it is now allocated
                out.extend(stack)
                stacks[p] = self._new_stack()
                bucket_of[p] = 0
                row = full_rows.get(p, full_row)
                first = p * bpp
                state[first : first + len(row)] = row
                n -= f
            else:
                keep = f - n
                got = stack[keep:]
                del stack[keep:]
                for b in got:
                    state[b] = _ALLOCATED
                out.extend(got)
                self._bucket_add(p, keep)
                n = 0
        return n

    def _take_fresh(
        self,
        out: list[int] | array[int],
        n: int,
        fresh: list[int],
        runs: list[tuple[int, int]] | None,
    ) -> None:
        """Append ``n`` blocks of the ``fresh`` pages (in their order) to ``out`` (to
        ``runs`` as disjoint ``(first, count)`` ranges in that order when given; the short
        last page may come first, so ``alloc_split`` sorts them) and give
        back the pages it did not need (a short last page over-covered). A run of
        consecutive pages taken whole costs one range and one slice write; a page taken in
        part keeps its upper blocks on its free stack. Caller holds ``_lock``."""
        state = self._state
        capacity = self._capacity
        bucket_of = self._bucket_of
        bpp = self._bpp
        count = len(fresh)
        i = 0
        while n:
            p = fresh[i]
            start = p * bpp
            cap = capacity[p]
            i += 1
            if n < cap:  # only part of page p: its lowest blocks now, the others on its stack
                if runs is None:
                    out.extend(range(start, start + n))
                elif runs and sum(runs[-1]) == start:  # continues the run before it
                    runs[-1] = (runs[-1][0], runs[-1][1] + n)
                else:
                    runs.append((start, n))
                state[start : start + n] = _ALLOCATED_BYTE * n
                self._stacks[p] = self._new_stack(self._id_run(start + n, start + cap)[::-1])
                self._held_free += cap - n
                self._bucket_add(p, cap - n)
                break
            bucket_of[p] = 0
            end = start + cap
            n -= cap
            while n and i < count:  # the next page continues the run and is taken whole
                q = fresh[i]
                cap = capacity[q]
                if q * bpp != end or n < cap:
                    break
                bucket_of[q] = 0
                end += cap
                n -= cap
                i += 1
            if runs is None:
                out.extend(range(start, end))
            else:
                runs.append((start, end - start))
            state[start:end] = _ALLOCATED_BYTE * (end - start)
        if i < count:
            self._pages.release(fresh[i:])

    def _id_run(self, lo: int, hi: int) -> Sequence[int]:
        """The ids ``lo .. hi-1`` as a stack extends fastest: a slice of ``_all_ids`` with
        array stacks (``array.extend`` of a ``range`` makes a Python int per id), else a
        ``range``."""
        if self._all_ids is None:
            return range(lo, hi)
        return self._all_ids[lo:hi]

    def _free_by_page(self, block_ids: Sequence[int], fence: int | None) -> bool:
        """``free`` for many ids at once, page by page: the ids are sorted, each page's share
        is checked (a contiguous share with one ``bytearray.count``) and written (a page
        that empties, or a contiguous share, with one slice write). Returns ``False`` with
        nothing changed when any id is not freeable: ``_free_each`` then names it. Caller
        holds ``_lock``."""
        ids = sorted(block_ids)
        n = len(ids)
        last = ids[-1]
        # distinct ids: a sorted share spanning as many ids as it names is then contiguous
        if ids[0] < 0 or last >= self._num_blocks or len(set(ids)) != n:
            return False
        state = self._state
        if last - ids[0] == n - 1:  # distinct and sorted: one contiguous run
            return self._free_run(ids[0], n, fence)
        bpp = self._bpp
        ends: list[int] = []  # page shares: ids[previous end : end] sit on one page
        i = 0
        while i < n:
            a = ids[i]
            top = (a // bpp + 1) * bpp  # the next page's first block
            j = n if last < top else bisect_left(ids, top, i)
            k = j - i
            if ids[j - 1] - a == k - 1:  # a contiguous share: one count
                if state.count(_ALLOCATED, a, a + k) != k:
                    return False
            else:
                for b in ids[i:j]:
                    if state[b] != _ALLOCATED:
                        return False
            ends.append(j)
            i = j
        i = 0
        for j in ends:
            a = ids[i]
            k = j - i
            if ids[j - 1] - a == k - 1:
                state[a : a + k] = bytes(k)
            else:
                for b in ids[i:j]:
                    state[b] = _FREE
            i = j
        self._return_shares(ids, ends, fence)
        return True

    def _free_sorted(self, ids: np.ndarray, listed: array[int], fence: int | None) -> bool:
        """``free_tensor`` of the ascending int64 ids ``ids`` (more than one, all in range),
        ``listed`` the same ids as an array: ids spanning as many values as they are many
        are one run (distinct, as they are sorted) and go to ``_free_run``; else one gather
        checks that every id is allocated, one comparison of neighbours that none is named
        twice, one scatter writes them, and ``_return_shares`` takes them page by page (a
        page's share ends where the page number of neighbours changes). ``False`` with
        nothing changed when an id is not freeable. Caller holds ``_lock``."""
        n = len(listed)
        first, last = listed[0], listed[-1]
        if last - first == n - 1:
            return self._free_run(first, n, fence)
        states = self._states
        if (states[ids] != _ALLOCATED).any() or (ids[1:] == ids[:-1]).any():
            return False
        states[ids] = _FREE
        pages = ids // self._bpp
        ends: list[int] = (np.flatnonzero(pages[1:] != pages[:-1]) + 1).tolist()
        ends.append(n)
        self._return_shares(listed, ends, fence)
        return True

    def _return_shares(self, ids: Sequence[int], ends: Iterable[int], fence: int | None) -> None:
        """The ascending ids ``ids`` were just freed (states written): page by page (each
        page's share is ``ids[previous end : end]``, ``ends`` ascending) push them on the
        page's free stack and rebucket it, or release it when it is now empty; count them
        off ``_used``. Caller holds ``_lock``."""
        bpp = self._bpp
        stacks = self._stacks
        held_free = self._held_free + len(ids)
        emptied: list[int] = []
        i = 0
        for j in ends:
            p = ids[i] // bpp
            now = len(stacks[p]) + j - i
            if self._rebucket(p, now):
                held_free -= now
                emptied.append(p)
            else:
                stacks[p].extend(ids[i:j])
            i = j
        self._used -= len(ids)
        self._held_free = held_free
        if emptied:
            self._pages.release(emptied, fence)

    def _free_run(self, first: int, n: int, fence: int | None) -> bool:
        """``_free_by_page`` for the distinct ids ``first .. first+n-1`` (a request's blocks,
        SGLang's sorted page ids): one count checks them all, then ``_clear_run``. ``False``
        with nothing changed when one is not allocated. Caller holds ``_lock``."""
        if self._state.count(_ALLOCATED, first, first + n) != n:
            return False
        emptied: list[int] = []
        self._clear_run(first, n, emptied)
        if emptied:
            self._pages.release(emptied, fence)
        return True

    def _free_runs(self, runs: Sequence[tuple[int, int]], fence: int | None) -> bool:
        """``free_runs`` when every run is in range, allocated and disjoint from the others
        (one count per run, checked before anything is written; then ``_clear_run`` each
        and one release of the pages they emptied); else ``False`` with nothing changed.
        Caller holds ``_lock``."""
        ordered = sorted(run for run in runs if run[1])
        end = 0
        state = self._state
        for first, count in ordered:
            if first < end or state.count(_ALLOCATED, first, first + count) != count:
                return False  # overlapping (or below 0), or an id not allocated
            end = first + count
        if end > self._num_blocks:
            return False
        emptied: list[int] = []
        for first, count in ordered:
            self._clear_run(first, count, emptied)
        if emptied:
            self._pages.release(emptied, fence)
        return True

    def _clear_run(self, first: int, n: int, emptied: list[int]) -> None:
        """Free the allocated ids ``first .. first+n-1`` (checked by the caller): one slice
        write, and the pages between the run's first and last, which it covers whole, are
        emptied with slice operations (no stack or bucket work); every page it empties is
        appended to ``emptied`` for the caller to release. Caller holds ``_lock``."""
        state = self._state
        end = first + n
        state[first:end] = bytes(n)
        self._used -= n
        self._held_free += n
        bpp = self._bpp
        head, tail = first // bpp, (end - 1) // bpp
        if self._share_freed(head, first, min((head + 1) * bpp, end)):
            emptied.append(head)
        if tail > head + 1:
            # every block of the pages in between was allocated (the count): each page was
            # full (bucket 0, empty stack) and is empty now
            inner = range(head + 1, tail)
            self._bucket_of[head + 1 : tail] = [_NOT_HELD] * len(inner)
            self._held_free -= len(inner) * bpp
            emptied += inner
        if tail > head and self._share_freed(tail, tail * bpp, end):
            emptied.append(tail)

    def _share_freed(self, page: int, lo: int, hi: int) -> bool:
        """Blocks ``lo .. hi-1`` of ``page`` were just freed (state written, counted in
        ``_held_free``): push them on its free stack and rebucket it, or, when no block is
        left on it, stop holding it, take its blocks off ``_held_free`` and return
        ``True`` (the caller releases it). Caller holds ``_lock``."""
        now = len(self._stacks[page]) + hi - lo
        if self._rebucket(page, now):
            self._held_free -= now
            return True
        self._stacks[page].extend(self._id_run(lo, hi))
        return False

    def _free_each(self, block_ids: Sequence[int], fence: int | None) -> None:
        """``free`` id by id (few ids, or one not freeable: raises naming it, after undoing
        what it changed)."""
        state = self._state
        stacks = self._stacks
        nb = self._num_blocks
        bpp = self._bpp
        touched: list[int] = []
        last = -1
        stack: _Stack = []
        for i, b in enumerate(block_ids):
            if not 0 <= b < nb or state[b] != _ALLOCATED:
                self._undo_free(block_ids, i)
                raise InvalidTransition(
                    f"block ledger: cannot free block {b}: {self._why_not_freeable(b)}",
                    ids=(b,),
                    hint="free only ids alloc() returned, once each",
                )
            state[b] = _FREE
            p = b // bpp
            if p != last:
                last = p
                stack = stacks[p]
                touched.append(p)
            stack.append(b)
        n = len(block_ids)
        self._used -= n
        self._held_free += n
        emptied: list[int] = []
        bucket_of = self._bucket_of
        for p in touched:
            was = bucket_of[p]
            now = len(stacks[p])
            if was in (now, _NOT_HELD):
                continue  # seen (or emptied) earlier in this loop
            if self._rebucket(p, now):
                self._held_free -= now
                emptied.append(p)
        if emptied:
            self._pages.release(emptied, fence)

    def _rebucket(self, page: int, free: int) -> bool:
        """A ``free`` left ``page`` with ``free`` free blocks: move it to that bucket, or,
        when no block is left on it (pinned ones never leave), stop holding it and return
        ``True``: the caller takes its blocks off ``_held_free`` and releases it. Caller
        holds ``_lock``."""
        was = self._bucket_of[page]
        if was:
            bucket = self._buckets[was]
            del bucket[page]
            if not bucket:
                self._nonempty &= ~(1 << was)
        if free == self._capacity[page]:
            self._stacks[page] = self._new_stack()
            self._bucket_of[page] = _NOT_HELD
            return True
        self._bucket_add(page, free)
        return False

    def _bucket_add(self, page: int, free: int) -> None:
        bucket = self._buckets[free]
        if not bucket:
            self._nonempty |= 1 << free
        bucket[page] = None
        self._bucket_of[page] = free

    def _undo_free(self, block_ids: Sequence[int], count: int) -> None:
        """Take back the first ``count`` blocks a failing ``free`` already put back (in
        reverse, so every page's stack pops what it got)."""
        bpp = self._bpp
        for b in reversed(block_ids[:count]):
            self._state[b] = _ALLOCATED
            self._stacks[b // bpp].pop()

    def _why_not_freeable(self, block: int) -> str:
        if not 0 <= block < self._num_blocks:
            return f"out of range 0..{self._num_blocks - 1}"
        if self._state[block] == _PINNED:
            return "it is pinned (one of pinned_blocks)"
        return "not allocated (a double free, or named twice in one call)"


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint ``runs`` sorted (in place) and returned with adjacent ones merged."""
    runs.sort()
    merged = [runs[0]]
    for first, count in runs[1:]:
        last, n = merged[-1]
        if last + n == first:
            merged[-1] = (last, n + count)
        else:
            merged.append((first, count))
    return merged
