"""The elastic paged allocator's hot-path helpers against SGLang's own (the kvcore fork only).

``alloc_extend`` / ``alloc_decode`` count a batch's new pages themselves (Python ints from the
CPU lengths for small batches, SGLang's ``get_num_new_pages`` above that): the count must be
SGLang's exactly, on both paths. The ledger hands fresh blocks over as runs and the free
blocks of partly used pages as an int64 array (``BlockLedger.alloc_split``), which reach
SGLang's index kernel as a view of the allocator's id table (one run; on a GPU no
host-to-device copy), a concatenation of views (a few runs, the array's copy first) or a copy
(the array alone, or many runs): the tokens laid out must be the ledger's blocks on every
path, and a failing kernel must give every block back.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.utils import get_num_new_pages

from .harness import requires_cpu_paged_kernels, requires_fork
from .test_conformance import extend

pytestmark = requires_fork

LIMIT = 40  # kvcore.adapters.sglang.allocators._COUNT_IN_PYTHON, checked below

# (prefix_len, seq_len) pairs with prefix <= seq, in batches either side of the limit
BATCHES = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(0, 700)).map(lambda t: (t[0], t[0] + t[1])),
    min_size=1,
    max_size=2 * LIMIT,
)


@settings(max_examples=150, deadline=None)
@given(batch=BATCHES, page_size=st.sampled_from([1, 16, 64, 100]))
def test_new_page_counts_are_sglangs(batch: list[tuple[int, int]], page_size: int) -> None:
    from kvcore.adapters.sglang import allocators

    assert allocators._COUNT_IN_PYTHON == LIMIT
    prefix = torch.tensor([p for p, _ in batch], dtype=torch.int64)
    seq = torch.tensor([s for _, s in batch], dtype=torch.int64)
    want = get_num_new_pages(seq_lens=seq, page_size=page_size, prefix_lens=prefix)
    assert allocators._extend_new_pages(prefix, seq, page_size) == want
    seq = seq + 1  # decode lengths are >= 1
    want = get_num_new_pages(seq_lens=seq, page_size=page_size, decode=True)
    assert allocators._decode_new_pages(seq, page_size) == want


def test_fresh_pages_are_views_of_the_id_table_or_copies(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run of blocks is a view of the id table, a few runs a concatenation of views
    (after the copy of scattered free blocks of partly used pages, when there are some);
    those scattered blocks alone, or many runs, a copy. Always exactly the blocks the
    ledger allocated, in the ledger's order."""
    a = make("on", size=364 * 16, page_size=16).allocator
    ledger = a.ledger
    table = a._block_ids.untyped_storage().data_ptr()
    big = a._fresh_ids(300)  # the rest of page 0 and fresh pages: one run
    assert big is not None and big.untyped_storage().data_ptr() == table
    assert big.tolist() == list(range(1, 301)) and ledger.used() == 301
    small = a._fresh_ids(3)  # the lowest free blocks of the last page: one run too
    assert small is not None and small.untyped_storage().data_ptr() == table
    assert small.tolist() == [301, 302, 303] and ledger.used() == 304
    a._release_block_ids(torch.tensor([40, 5, 9]))
    holes = a._fresh_ids(3)
    assert holes is not None and holes.untyped_storage().data_ptr() != table
    assert sorted(holes.tolist()) == [5, 9, 40] and ledger.used() == 304
    assert all(ledger.is_allocated(b) for b in (5, 9, 40))

    a._on_cpu = False  # the device branch (no device-specific code in it)
    # the ledger's parts given, to see how each shape is laid out (alloc_split is tested in
    # tests/memory/test_blocks.py)
    for (listed, runs), want in [
        (([], [(3, 2), (10, 3)]), [3, 4, 10, 11, 12]),
        (([], [(2 * i + 1, 1) for i in range(9)]), [2 * i + 1 for i in range(9)]),
        (([7, 5], [(10, 2)]), [7, 5, 10, 11]),
        (([7, 5], [(2 * i + 20, 1) for i in range(9)]), [7, 5] + [2 * i + 20 for i in range(9)]),
        (([], []), []),
    ]:
        monkeypatch.setattr(
            ledger, "alloc_split", lambda k, listed=listed, runs=runs: (array("q", listed), runs)
        )
        got = a._fresh_ids(len(want))
        assert got is not None and got.tolist() == want


@requires_cpu_paged_kernels
def test_extend_lays_tokens_on_the_ledgers_runs_and_a_failure_gives_them_back(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the runs path, a run of fresh blocks reaches the index kernel as a view of
    ``_block_ids``, scattered blocks (many runs) as a copy, and either way the tokens land
    on exactly the blocks the ledger allocated; a kernel failing over several runs gives
    every block back."""
    from sglang.srt.mem_cache.allocator import paged

    seen: list[torch.Tensor] = []
    naive = paged.alloc_extend_naive

    def recorder(prefix: Any, seq: Any, last: Any, pages: Any, *rest: Any) -> None:
        seen.append(pages)
        naive(prefix, seq, last, pages, *rest)

    monkeypatch.setattr(paged, "alloc_extend_naive", recorder)
    e = make("on", size=2048, page_size=16)
    a, ledger = e.allocator, e.manager.ledger
    a._on_cpu = False  # the device branch: runs at any count (no device-specific code in it)
    table = a._block_ids.untyped_storage().data_ptr()

    out = extend(a, [0, 0], [300, 200], [-1, -1])  # 19 + 13 fresh blocks: one run
    pages = set((out // 16).tolist())
    assert len(pages) == 32 and seen[-1].untyped_storage().data_ptr() == table
    assert all(ledger.is_allocated(p) for p in pages) and ledger.used() == 33  # + block 0
    assert len(set(out.tolist())) == out.numel()

    keep = sorted(pages)[::2]  # free every other block: what is left free is scattered
    a.free(torch.tensor([t for t in out.tolist() if t // 16 not in keep]))
    out2 = extend(a, [0], [16 * 10], [-1])
    pages2 = set((out2 // 16).tolist())
    assert len(pages2) == 10 and not pages2 & set(keep)
    assert all(ledger.is_allocated(p) for p in pages2) and ledger.used() == 1 + 16 + 10
    assert max(pages2) - min(pages2) > 9  # the holes left: not a run, so copied
    assert seen[-1].untyped_storage().data_ptr() != table

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected: index kernel failed")

    monkeypatch.setattr(paged, "alloc_extend_naive", broken)
    used, in_use = ledger.used(), e.pages().in_use
    with pytest.raises(RuntimeError, match="injected"):
        extend(a, [0], [16 * 12], [-1])  # the 6 holes left and 6 fresh blocks: many runs
    assert ledger.used() == used and e.pages().in_use == in_use
    assert all(ledger.is_allocated(p) for p in pages2 | set(keep))


@requires_cpu_paged_kernels
def test_free_of_many_pages_as_a_run_or_not_frees_exactly_them(make: Any) -> None:
    """Many freed pages, one run or not (``BlockLedger.free_tensor``'s tensor path), free
    exactly those pages."""
    n = 300
    e = make("on", size=(2 * n + 64) * 16, page_size=16)
    a, ledger = e.allocator, e.manager.ledger
    out = extend(a, [0, 0], [16 * n, 16 * n], [-1, -1])
    by_page: dict[int, list[int]] = {}
    for t in out.tolist():
        by_page.setdefault(t // 16, []).append(t)
    pages = sorted(by_page)
    assert len(pages) == 2 * n and ledger.used() == 2 * n + 1
    hole = pages[len(pages) // 4]
    first = [p for p in pages[: n + 1] if p != hole]  # n pages, not one run
    a.free(torch.tensor([t for p in first for t in by_page[p]]))
    assert ledger.used() == n + 1
    assert all(ledger.is_allocated(p) == (p not in first) for p in pages)
    a.free(torch.tensor(by_page[hole]))
    rest = pages[n + 1 :]  # n - 1 pages: one run
    assert rest == list(range(rest[0], rest[0] + n - 1))
    a.free(torch.tensor([t for p in rest for t in by_page[p]]))
    assert ledger.used() == 1 and e.pages().in_use == 1  # page 0: the reserved block
