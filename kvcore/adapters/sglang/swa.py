"""Elastic hybrid sliding-window KV for SGLang: ``SWAKVPool`` and its allocator.

SGLang keeps a hybrid (full + sliding-window attention) model's KV in an ``SWAKVPool`` that
composes two ``MHATokenToKVPool`` sub-pools, one per layer kind, each with its own token
index space and size. ``SWATokenToKVPoolAllocator`` composes one token (``page_size == 1``)
or paged allocator per sub-pool and keeps ``full_to_swa_index_mapping``: full token index
-> SWA token index, read by the attention kernels and by every SWA free.

In elastic mode each sub-pool is built inside the scope like any MHA pool, so each gets
its own ``ElasticKVManager`` (its own per-layer geometry: the SWA side may have other head
counts and is usually much smaller) and all of them share the rank's one memory gate
(``SharedGate``): the instance's budget covers both. ``ElasticSWATokenToKVPoolAllocator``
is SGLang's own class with its two inner allocators replaced by kvcore's elastic ones, so
token demand becomes block demand per sub-pool, block ids expand to token indices through
SGLang's kernels, the index mapping is SGLang's, and every SWA free or eviction
(``free_swa``, ``free_page_ids`` of a window slide, a radix eviction) hands the sub-pool's
blocks back to its ledger, which unmaps emptied pages.

Under one budget the two sides compete for pages: the full side may get its pages and the
SWA side then miss. Upstream asserts the second allocation succeeds (its free lists are
static); here every composite allocation is all or nothing: a miss on either side gives
back what the other side took for this call and returns ``None``, which the scheduler
handles as upstream's "out of memory" (retract / retry). Under a budget each side's
``*_available_size()`` counts the shared headroom once, at the joint cost of a token on both
sides (``_joint_blocks``), so SGLang's admission and decode checks see the joint room
before they allocate.

At attention-TP > 1 under a budget the scope calls ``agree``: each composite allocation
(the all-or-nothing pair over both sub-ledgers) is one ``kvcore.parallel.agreement`` decision, one
MIN all-reduce of ``(ok, full room, SWA room)`` over the attention-TP CPU group with
rollback of both sides on the ranks that succeeded, and ``full_available_size`` /
``swa_available_size`` are the agreed joint figures plus the blocks freed since: the same
on every rank without a collective. ``kvcore_step`` (patch 0006) refreshes them while the
budget binds.

Refused with ``UnsupportedConfiguration`` at start-up: the per-request SWA ring
(``swa_req_ring_size``), the all-SWA ``PureSWATokenToKVPoolAllocator``, SGLang's unified
hybrid SWA allocator, and SWA pools whose sub-pools kvcore did not build (MLA/DSA, page-major,
quantized sub-pools are named by the scope's own checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

from kvcore.adapters.sglang.allocators import elastic_token_allocator
from kvcore.adapters.sglang.eviction import eviction_asks_allocator
from kvcore.errors import UnsupportedConfiguration
from kvcore.parallel.agreement import AgreedRoom, Agreement, RoomLedger

__all__ = ["ElasticSWATokenToKVPoolAllocator", "elastic_swa_allocator"]


class ElasticSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):  # type: ignore[misc]
    """``SWATokenToKVPoolAllocator`` whose full and SWA allocators are kvcore's (module
    docstring). Build it with ``elastic_swa_allocator(upstream)``."""

    full_attn_allocator: Any
    swa_attn_allocator: Any
    _agreement: Agreement | None
    _room: AgreedRoom | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._agreement = None
        self._room = None
        super().__init__(*args, **kwargs)
        if self._swa_req_ring:
            raise UnsupportedConfiguration(
                "kvcore elastic KV does not support SGLang's per-request SWA ring "
                "(swa_req_ring_size): its SWA rows are owned by request slots, not pages",
                hint="run the hybrid SWA model without the per-request ring, or without "
                "--kvcore-elastic",
            )
        self.full_attn_allocator = elastic_token_allocator(self.full_attn_allocator)
        self.swa_attn_allocator = elastic_token_allocator(self.swa_attn_allocator)
        if self.full_attn_allocator.max_cached_tokens is not None and not (
            eviction_asks_allocator()
        ):
            raise UnsupportedConfiguration(
                "--kvcore-config max_cached_tokens with the hybrid SWA allocator needs SGLang "
                ">= 0.5.23: older SGLang builds an SWARadixCache whose evictable size is a "
                "(full, SWA) pair, which the cache bound does not handle",
                hint="drop max_cached_tokens from --kvcore-config on this SGLang version",
            )
        self.clear()

    # -- all-or-nothing composite allocation ---------------------------------------------

    def agree(self, agreement: Agreement) -> None:
        """Agree every composite allocation and both sides' room with the peer ranks
        (``kvcore.parallel.agreement``; the scope calls this under a physical budget at TP > 1, on
        every rank at the same point: it is a collective). Each allocation below is then
        one ``AgreedRoom.decide`` over the pair; each side's ledger becomes a ``RoomLedger``
        (frees count toward the agreed room), and ``full_available_size`` /
        ``swa_available_size`` are the agreed joint figures."""
        sides = (self.full_attn_allocator, self.swa_attn_allocator)
        raw = [_raw(a.ledger) for a in sides]
        room = agreement.room(
            lambda: [_joint_blocks(sides[0], sides[1]), _joint_blocks(sides[1], sides[0])],
            lambda: [ledger.geometry.num_blocks - ledger.used() for ledger in raw],
        )
        for i, (side, ledger) in enumerate(zip(sides, raw, strict=True)):
            side.ledger = RoomLedger(ledger, room, i)
        self._agreement = agreement
        self._room = room

    def kvcore_step(self, tree_cache: Any = None) -> None:
        """Called by the patched scheduler (patch 0006) once per iteration with its tree
        cache, on every rank in lockstep, before the iteration allocates: the prefix cache
        is evicted down to ``max_cached_tokens`` (full-side tokens, as in
        ``evict_to_free_tokens``), then, with an agreement, the rank's agreed rooms are
        refreshed while a budget binds (``Agreement.step``)."""
        if tree_cache is not None:
            self.full_attn_allocator.enforce_cache_bound(tree_cache)
        if self._agreement is not None:
            self._agreement.step()

    def _decide(self, attempt: Callable[[], _Pair | None]) -> _Pair | None:
        """The pair ``attempt`` allocated, agreed with the peer ranks when there are any."""
        if self._room is None:
            return attempt()
        return self._room.decide(attempt, self._undo)

    def _undo(self, pair: _Pair) -> None:
        """Give back what an allocation of both sides took (a peer missed)."""
        _give_back(self.full_attn_allocator, pair.full, pair.full_last_loc)
        if pair.swa is not None:
            _give_back(self.swa_attn_allocator, pair.swa, pair.swa_last_loc)

    def _pair(
        self,
        full_alloc: Callable[[], torch.Tensor | None],
        swa_alloc: Callable[[], torch.Tensor | None],
        last_loc: torch.Tensor | None,
        swa_last_loc: torch.Tensor | None,
    ) -> _Pair | None:
        """Allocate the full side, then the SWA side; a SWA miss gives the full side's
        blocks back (on this rank)."""
        full = full_alloc()
        if full is None:
            return None
        swa = swa_alloc()
        if swa is None:
            _give_back(self.full_attn_allocator, full, last_loc)
            return None
        return _Pair(full, last_loc, swa, swa_last_loc)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert self.page_size == 1
        full_side, swa_side = self.full_attn_allocator, self.swa_attn_allocator
        pair = self._decide(
            lambda: self._pair(
                lambda: full_side.alloc(need_size), lambda: swa_side.alloc(need_size), None, None
            )
        )
        if pair is None:
            return None
        self.set_full_to_swa_mapping(pair.full, pair.swa)
        return pair.full

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        assert self.page_size > 1
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        lens = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu)
        pair = self._decide(
            lambda: self._pair(
                lambda: self.full_attn_allocator.alloc_extend(*lens, last_loc, extend_num_tokens),
                lambda: self.swa_attn_allocator.alloc_extend(
                    *lens, swa_last_loc, extend_num_tokens
                ),
                last_loc,
                swa_last_loc,
            )
        )
        if pair is None:
            return None
        self.set_full_to_swa_mapping(pair.full, pair.swa)
        return pair.full

    def alloc_extend_swa_tail(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        swa_tail_len: int,
    ) -> torch.Tensor | None:
        assert self.page_size > 1
        if len(seq_lens_cpu) != 1 or not 0 <= swa_tail_len <= extend_num_tokens:
            raise ValueError(
                f"SWA tail allocation takes one request and 0 <= swa_tail_len <= "
                f"{extend_num_tokens}, got {len(seq_lens_cpu)} requests, tail {swa_tail_len}"
            )
        full_side = self.full_attn_allocator
        lens = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu)
        # the SWA side holds only the tail, as a fresh sequence (no prefix, no last page)
        dev = self.device
        zero = torch.zeros((1,), dtype=torch.int64)
        tail = torch.tensor([swa_tail_len], dtype=torch.int64)
        fresh = torch.full((1,), -1, dtype=torch.int64, device=dev)

        def attempt() -> _Pair | None:
            if swa_tail_len == 0:
                full = full_side.alloc_extend(*lens, last_loc, extend_num_tokens)
                return None if full is None else _Pair(full, last_loc, None, None)
            return self._pair(
                lambda: full_side.alloc_extend(*lens, last_loc, extend_num_tokens),
                lambda: self.swa_attn_allocator.alloc_extend(
                    zero.to(dev),
                    zero,
                    tail.to(dev),
                    tail,
                    fresh,
                    swa_tail_len,
                    num_new_pages=-(-swa_tail_len // self.page_size),
                ),
                last_loc,
                fresh,
            )

        pair = self._decide(attempt)
        if pair is None:
            return None
        if pair.swa is not None:
            self.set_full_to_swa_mapping(pair.full[-swa_tail_len:], pair.swa)
            if swa_tail_len < extend_num_tokens:
                self.clear_full_to_swa_mapping(pair.full[:-swa_tail_len])
        return pair.full

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        assert self.page_size > 1
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        pair = self._decide(
            lambda: self._pair(
                lambda: self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc),
                lambda: self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last_loc),
                last_loc,
                swa_last_loc,
            )
        )
        if pair is None:
            return None
        self.full_to_swa_index_mapping[pair.full] = pair.swa
        return pair.full

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        """SGLang's pre-allocation eviction (both sides), after first evicting the prefix
        cache down to ``max_cached_tokens`` (``--kvcore-config``; full-side tokens)."""
        self.full_attn_allocator.enforce_cache_bound(tree_cache)
        super().evict_to_free_tokens(tree_cache, num_tokens)

    # -- accounting ------------------------------------------------------------------------

    def full_available_size(self) -> int:
        if self._room is not None:
            return self._room.available(0) * int(self.page_size)
        return self._joint_available(self.full_attn_allocator, self.swa_attn_allocator)

    def swa_available_size(self) -> int:
        if self._room is not None:
            return self._room.available(1) * int(self.page_size)
        return self._joint_available(self.swa_attn_allocator, self.full_attn_allocator)

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    @staticmethod
    def _joint_available(side: Any, other: Any) -> int:
        """Tokens ``side`` can take while the other side grows in step (one token each, as
        SGLang pages them). Without a budget: the side's own figure; under one, the joint
        figure of ``_joint_blocks``. With an agreement the agreed figures are read instead
        (``agree``)."""
        if not side._budgeted:
            return int(side.available_size())
        return _joint_blocks(side, other) * int(side.page_size)

    def conservation_available_size(self) -> int:
        """The full side's logical free tokens (the scheduler's leak check in elastic mode;
        see ``_ElasticMixin.conservation_available_size``)."""
        return int(self.full_attn_allocator.conservation_available_size())

    def swa_capacity_and_available(
        self, *, full_capacity: int, swa_capacity: int
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """The pool-stats view (usage figures and the idle leak check): each side's logical
        free tokens, so a physical shortage under a budget is not counted as used."""
        return (
            (full_capacity, self.conservation_available_size()),
            (swa_capacity, int(self.swa_attn_allocator.conservation_available_size())),
        )


def elastic_swa_allocator(upstream: SWATokenToKVPoolAllocator) -> ElasticSWATokenToKVPoolAllocator:
    """The elastic equivalent of the ``SWATokenToKVPoolAllocator`` SGLang built over a
    kvcore ``SWAKVPool`` (same sizes, page size, device and request pool). Raises
    ``UnsupportedConfiguration`` for the variants kvcore does not support (module docstring)
    and, through the inner allocators, for sub-pools kvcore did not build."""
    if type(upstream) is not SWATokenToKVPoolAllocator:
        raise UnsupportedConfiguration(
            f"kvcore elastic KV does not support SGLang's {type(upstream).__name__}",
            hint="supported hybrid SWA allocator: SWATokenToKVPoolAllocator (full + sliding-"
            "window layers, no unified pool); start without --kvcore-elastic",
        )
    return ElasticSWATokenToKVPoolAllocator(
        upstream.size_full,
        upstream._size_swa,
        upstream.page_size,
        upstream.dtype,
        upstream.device,
        upstream.get_kvcache(),
        upstream.need_sort,
        req_to_token_pool=upstream._req_to_token_pool,
    )


class _Pair(NamedTuple):
    """One composite allocation: each side's token indices and the ``last_loc`` they were
    allocated after (``None``: token granular, every index a fresh block)."""

    full: torch.Tensor
    full_last_loc: torch.Tensor | None
    swa: torch.Tensor | None
    swa_last_loc: torch.Tensor | None


def _raw(ledger: Any) -> Any:
    """The rank-local ``BlockLedger`` under an agreement wrapper (or ``ledger`` itself)."""
    return getattr(ledger, "inner", ledger)


def _joint_blocks(side: Any, other: Any) -> int:
    """Blocks ``side``'s own ledger can take while the other side grows in step, on this
    rank. Under the one shared budget each side's own figure counts the whole gate headroom;
    here it is counted once, at the joint byte cost of a block on both sides, on top of the
    blocks free on the side's mapped pages (conservative: the other side's free blocks on its
    mapped pages would need no new page either). Frees still on their way from the device
    count as free blocks on mapped pages (``PendingFrees``)."""
    ledger = _raw(side.ledger)
    pending: int = side._pending.count
    own = int(ledger.available()) + pending
    room = side.kvcore.gate.headroom()
    if room is None:
        return own
    cost = sum(
        a.kvcore.geometry.page_device_bytes / a.kvcore.geometry.blocks_per_page
        for a in (side, other)
    )
    return max(0, min(own, int(ledger.held_free()) + pending + int(room // cost)))


def _give_back(allocator: Any, token_ids: torch.Tensor, last_loc: torch.Tensor | None) -> None:
    """Return the blocks an allocation of this call took straight to the rank-local ledger
    (not through a pending free group, not counted as a free of the agreed room): every
    token's block at ``page_size`` 1 (``last_loc`` ``None``), else the pages of
    ``token_ids`` other than the requests' prefix pages (``last_loc``'s, which the first
    new tokens of a request may fill up)."""
    ledger = _raw(allocator.ledger)
    if last_loc is None:
        if token_ids.numel():
            ledger.free(token_ids.tolist())
        return
    ps = allocator.page_size
    pages = torch.unique(token_ids // ps)
    prefix = last_loc[last_loc >= 0] // ps
    new = pages[~torch.isin(pages, prefix)]
    if new.numel():
        ledger.free(new.tolist())
