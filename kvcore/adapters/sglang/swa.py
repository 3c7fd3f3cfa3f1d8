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
sides (``_joint_available``), so SGLang's admission and decode checks see the joint room
before they allocate.

Refused with ``UnsupportedConfiguration`` at start-up: the per-request SWA ring
(``swa_req_ring_size``), the all-SWA ``PureSWATokenToKVPoolAllocator``, SGLang's unified
hybrid SWA allocator, and SWA pools whose sub-pools kvcore did not build (MLA/DSA, page-major,
quantized sub-pools are named by the scope's own checks).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

from kvcore.adapters.sglang.allocators import elastic_allocator
from kvcore.errors import UnsupportedConfiguration

__all__ = ["ElasticSWATokenToKVPoolAllocator", "elastic_swa_allocator"]


class ElasticSWATokenToKVPoolAllocator(SWATokenToKVPoolAllocator):  # type: ignore[misc]
    """``SWATokenToKVPoolAllocator`` whose full and SWA allocators are kvcore's (module
    docstring). Build it with ``elastic_swa_allocator(upstream)``."""

    full_attn_allocator: Any
    swa_attn_allocator: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._swa_req_ring:
            raise UnsupportedConfiguration(
                "kvcore elastic KV does not support SGLang's per-request SWA ring "
                "(swa_req_ring_size): its SWA rows are owned by request slots, not pages",
                hint="run the hybrid SWA model without the per-request ring, or without "
                "--kvcore-elastic",
            )
        self.full_attn_allocator = elastic_allocator(self.full_attn_allocator)
        self.swa_attn_allocator = elastic_allocator(self.swa_attn_allocator)
        self.clear()

    # -- all-or-nothing composite allocation ---------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert self.page_size == 1
        full = self.full_attn_allocator.alloc(need_size)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc(need_size)
        if swa is None:
            _give_back(self.full_attn_allocator, full)
            return None
        self.set_full_to_swa_mapping(full, swa)
        return full

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
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, swa_last_loc, extend_num_tokens
        )
        if swa is None:
            _give_back_new_pages(self.full_attn_allocator, full, last_loc)
            return None
        self.set_full_to_swa_mapping(full, swa)
        return full

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
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        if full is None or swa_tail_len == 0:
            return full
        # the SWA side holds only the tail, as a fresh sequence (no prefix, no last page)
        dev = self.device
        zero = torch.zeros((1,), dtype=torch.int64)
        tail = torch.tensor([swa_tail_len], dtype=torch.int64)
        swa = self.swa_attn_allocator.alloc_extend(
            zero.to(dev),
            zero,
            tail.to(dev),
            tail,
            torch.full((1,), -1, dtype=torch.int64, device=dev),
            swa_tail_len,
            num_new_pages=-(-swa_tail_len // self.page_size),
        )
        if swa is None:
            _give_back_new_pages(self.full_attn_allocator, full, last_loc)
            return None
        self.set_full_to_swa_mapping(full[-swa_tail_len:], swa)
        if swa_tail_len < extend_num_tokens:
            self.clear_full_to_swa_mapping(full[:-swa_tail_len])
        return full

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        assert self.page_size > 1
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last_loc)
        if swa is None:
            _give_back_new_pages(self.full_attn_allocator, full, last_loc)
            return None
        self.full_to_swa_index_mapping[full] = swa
        return full

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        """SGLang's pre-allocation eviction (both sides), after first evicting the prefix
        cache down to ``max_cached_tokens`` (``--kvcore-config``; full-side tokens)."""
        self.full_attn_allocator.enforce_cache_bound(tree_cache)
        super().evict_to_free_tokens(tree_cache, num_tokens)

    # -- accounting ------------------------------------------------------------------------

    def full_available_size(self) -> int:
        return self._joint_available(self.full_attn_allocator, self.swa_attn_allocator)

    def swa_available_size(self) -> int:
        return self._joint_available(self.swa_attn_allocator, self.full_attn_allocator)

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def _joint_available(self, side: Any, other: Any) -> int:
        """Tokens ``side`` can take while the other side grows in step (one token each, as
        SGLang pages them). Without a budget: the side's own figure. Under the one shared
        budget each side's own figure counts the whole gate headroom; here it is counted
        once, at the joint byte cost of a token on both sides, on top of the tokens free on
        the side's mapped pages (conservative: the other side's free tokens on its mapped
        pages would need no new page either)."""
        own = int(side.available_size())
        if not side._budgeted:
            return own
        room = side.kvcore.gate.headroom()
        if room is None:
            return own
        cost = sum(
            a.kvcore.geometry.page_device_bytes / (a.kvcore.geometry.blocks_per_page * a.page_size)
            for a in (side, other)
        )
        held = side.ledger.held_free() * side.page_size
        return max(0, min(own, int(held) + int(room // cost)))

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


def _give_back(allocator: Any, token_ids: torch.Tensor) -> None:
    """Return the blocks of a token allocation this call made (page_size 1: token = block)
    straight to the ledger (not through a pending free group)."""
    if token_ids.numel():
        allocator.ledger.free(token_ids.tolist())


def _give_back_new_pages(allocator: Any, token_ids: torch.Tensor, last_loc: torch.Tensor) -> None:
    """Return the pages a paged ``alloc_extend``/``alloc_decode`` took for this call: the
    pages of ``token_ids`` other than the requests' prefix pages (``last_loc``'s, which the
    first new tokens of a request may fill up)."""
    ps = allocator.page_size
    pages = torch.unique(token_ids // ps)
    prefix = last_loc[last_loc >= 0] // ps
    new = pages[~torch.isin(pages, prefix)]
    if new.numel():
        allocator.ledger.free(new.tolist())
