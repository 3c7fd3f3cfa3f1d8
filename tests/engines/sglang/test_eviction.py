"""Page-aware radix eviction inside SGLang's real trees: ``RadixCache`` and
``UnifiedRadixCache`` on its Python core (and on the Rust core where its extension loads),
on both pinned releases, through the scheduler's per-iteration seam (patch 0006's
``kvcore_step(tree_cache)``) and SGLang's pre-allocation eviction. The page-aware key
applies to the evictions kvcore asks for to give memory back (the cache bound, a lowered
limit's shed); SGLang's own evictions, which make room for its next allocation, keep its
order and leave their blocks to that allocation.

MHA, 2 layers x K/V, 2 heads x 64 dims, bf16, SGLang pages of 16 tokens: a 64 KiB host
page holds 256 tokens. Physical page 0 holds block 0 (SGLang's padded page) and 240 tokens
of a running request; page 1 holds cached prefix A (older) and 128 tokens of a running
request; page 2 holds cached prefix B (newer) alone. LRU evicts A first, which returns no
page; page-aware eviction evicts B first, which returns page 2.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from harness.sglang_kv import radix, unified_radix
from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.sglang import eviction
from kvcore.errors import UnsupportedConfiguration

from .harness import matched, requires_fork

pytestmark = requires_fork


def _requires_allocator_eviction() -> Any:
    from kvcore.adapters.sglang.eviction import eviction_asks_allocator

    return pytest.mark.skipif(
        not eviction_asks_allocator(),
        reason="this SGLang's pre-allocation eviction does not go through the allocator "
        "(evict_to_free_tokens, 0.5.23+); the scheduler's step covers every release (below)",
    )


PAGE = 4 * (64 << 10)  # device bytes of one page id: 4 handles of 64 KiB


def _key(base: int, n: int) -> RadixKey:
    return RadixKey(token_ids=array("q", range(base, base + n)))


def _python_unified(allocator: Any, page_size: int) -> Any:
    os.environ[eviction.TREE_CORE_ENV] = "python"
    return unified_radix(allocator, page_size)


TREES = {"radix": radix, "unified-python": _python_unified}


@pytest.fixture(autouse=True)
def _tree_core_env() -> Iterator[None]:
    """Each test starts with SGLang's tree-core variable unset and leaves it as it was."""
    saved = os.environ.pop(eviction.TREE_CORE_ENV, None)
    yield
    os.environ.pop(eviction.TREE_CORE_ENV, None)
    if saved is not None:
        os.environ[eviction.TREE_CORE_ENV] = saved


def _setup(
    make: Any, tree_of: Callable[[Any, int], Any] = radix, **kvcore: Any
) -> tuple[Any, Any, Any]:
    e = make("on", size=2048, page_size=16, **kvcore)
    a = e.allocator
    tree = tree_of(a, 16)
    a.alloc(240)  # a running request: page 0 (with block 0) is full
    kv_a = a.alloc(128)  # page 1, first half
    a.alloc(128)  # a running request: page 1, second half
    kv_b = a.alloc(256)  # page 2, alone
    tree.insert(InsertParams(key=_key(0, 128), value=kv_a))
    tree.insert(InsertParams(key=_key(10_000, 256), value=kv_b))
    assert e.pages().in_use == 3
    return e, a, tree


def _cached(tree: Any, base: int, n: int) -> int:
    return matched(tree.match_prefix(MatchPrefixParams(key=_key(base, n))))


def test_sglang_lru_alone_evicts_the_older_leaf_and_returns_no_page(make: Any) -> None:
    """The baseline: SGLang's own strategy, as the tree is built (nothing installed)."""
    e, _, tree = _setup(make)
    assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    assert _cached(tree, 0, 128) == 0 and _cached(tree, 10_000, 256) == 256
    assert e.pages().in_use == 3  # A's tokens share page 1 with a running request


def test_page_aware_eviction_returns_a_whole_page_first(make: Any) -> None:
    e, a, tree = _setup(make)
    assert eviction.install(tree, a) is True
    assert eviction.install(tree, a) is True  # idempotent: wrapped once
    assert isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
    assert not isinstance(tree.eviction_strategy.base, eviction.PageAwareEviction)
    with eviction.giving_back(tree):
        assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 256
        assert _cached(tree, 0, 128) == 128 and _cached(tree, 10_000, 256) == 0
        assert e.pages().in_use == 2  # page 2 went back
        # then upstream's order among the rest: A goes next
        assert tree.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 128
    assert tree.eviction_strategy.active is False


def test_outside_giving_back_the_installed_order_is_sglangs(make: Any) -> None:
    """An eviction kvcore did not ask for (SGLang making room for an allocation) ranks
    leaves as upstream does, without reading their pages: A (older) goes, B stays."""
    e, a, tree = _setup(make)
    assert eviction.install(tree, a) is True
    read = []
    strategy = tree.eviction_strategy
    empties = strategy.empties_a_page
    strategy.empties_a_page = lambda node: read.append(node) or empties(node)
    assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    assert _cached(tree, 0, 128) == 0 and _cached(tree, 10_000, 256) == 256
    assert read == [] and e.pages().in_use == 3


@_requires_allocator_eviction()
def test_sglangs_allocation_path_installs_it_and_keeps_its_order(make: Any) -> None:
    """``evict_from_tree_cache`` (what SGLang runs before every allocation) under a budget
    of the three mapped pages installs the page-aware key, but its own eviction keeps
    SGLang's order: A goes, and its blocks on page 1 take the allocation with no new page
    (evicting B would unmap page 2 only to map another)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    e, a, tree = _setup(make, limit_bytes=3 * PAGE + (64 << 10))
    assert a.available_size() < 128
    evict_from_tree_cache(tree, 128)
    assert isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
    assert _cached(tree, 10_000, 256) == 256 and _cached(tree, 0, 128) == 0
    assert a.available_size() >= 128
    assert a.alloc(128) is not None and e.pages().in_use == 3


@_requires_allocator_eviction()
def test_the_cached_token_bound_evicts_page_aware(make: Any) -> None:
    """``max_cached_tokens=128`` with memory to spare: only the bound evicts (256 of the 384
    cached tokens). LRU would take A and then B (384 tokens, no page from A); page-aware
    eviction takes B alone, returns its page and keeps A cached."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    e, _, tree = _setup(make, max_cached_tokens=128)
    evict_from_tree_cache(tree, 16)
    assert tree.evictable_size() == 128
    assert _cached(tree, 0, 128) == 128 and _cached(tree, 10_000, 256) == 0
    assert e.pages().in_use == 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_empties_a_page_reads_the_ledger(make: Any, page_size: int) -> None:
    e = make("on", size=2048, page_size=page_size)
    a = e.allocator
    tokens_per_page = 256
    first = a.alloc(tokens_per_page - page_size)  # page 0 minus block 0
    second = a.alloc(tokens_per_page)  # page 1 whole
    strategy = eviction.PageAwareEviction(None, a.ledger, page_size, lambda v: v)
    assert strategy.empties_a_page(second)
    assert not strategy.empties_a_page(first)  # page 0 keeps reserved block 0: never returned
    assert not strategy.empties_a_page(second[: tokens_per_page // 2])
    assert not strategy.empties_a_page(second[:0])


def test_a_tree_without_a_python_strategy_is_left_alone(make: Any) -> None:
    """What the Rust ``TreeCore`` looks like to ``install``: a ``tree_core`` without an
    ``eviction_strategy``; nothing is changed and ``False`` says so."""
    from types import SimpleNamespace

    e = make("on", size=512, page_size=16)
    native = SimpleNamespace(tree_core=SimpleNamespace())
    assert eviction.install(native, e.allocator) is False
    assert vars(native.tree_core) == {}


def _strategy(tree: Any) -> Any:
    """The eviction strategy object a Python tree ranks leaves with."""
    core = getattr(tree, "tree_core", None)
    return core.eviction_strategy if core is not None else tree.eviction_strategy


# -- the scheduler's seam (patch 0006: kvcore_step(tree_cache), both releases) ---------------


@pytest.mark.parametrize("tree_of", TREES.values(), ids=TREES.keys())
def test_the_scheduler_step_attaches_page_aware_order(make: Any, tree_of: Any) -> None:
    """The scheduler's first iteration hands its tree to the allocator (no allocator-side
    eviction call needed, so this holds on 0.5.20 too): kvcore's evictions are page-aware
    from then on (B alone goes, its page returns), SGLang's pre-allocation eviction keeps
    its order (A goes next)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    e, a, tree = _setup(make, tree_of, limit_bytes=3 * PAGE + (64 << 10))
    base = _strategy(tree)
    a.kvcore_step(tree)
    assert isinstance(_strategy(tree), eviction.PageAwareEviction)
    assert _strategy(tree).base is base
    a.kvcore_step(tree)  # later iterations: wrapped once
    assert _strategy(tree).base is base
    assert a._evict(tree, 128) == 256
    assert _cached(tree, 10_000, 256) == 0 and _cached(tree, 0, 128) == 128
    assert e.pages().in_use == 2
    evict_from_tree_cache(tree, a.available_size() + 128)
    assert _cached(tree, 0, 128) == 0
    assert a.alloc(128) is not None


@pytest.mark.parametrize("tree_of", TREES.values(), ids=TREES.keys())
def test_the_cached_token_bound_holds_at_every_iteration(make: Any, tree_of: Any) -> None:
    """``max_cached_tokens`` on every release: the scheduler's per-iteration step evicts
    down to the bound, page-aware (B alone goes; LRU would take A and then B)."""
    e, a, tree = _setup(make, tree_of, max_cached_tokens=128)
    a.kvcore_step(tree)
    assert tree.evictable_size() == 128
    assert _cached(tree, 0, 128) == 128 and _cached(tree, 10_000, 256) == 0
    assert e.pages().in_use == 2
    kv = a.alloc(256)  # a request finishes and is cached: over the bound again
    tree.insert(InsertParams(key=_key(20_000, 256), value=kv))
    assert tree.evictable_size() == 384
    a.kvcore_step(tree)  # the next iteration
    assert tree.evictable_size() <= 128


@pytest.mark.parametrize("tree_of", TREES.values(), ids=TREES.keys())
def test_a_lowered_limit_sheds_page_aware_once_and_a_lifted_one_grows(
    make: Any, tree_of: Any
) -> None:
    """A limit lowered below use while serving (``kvctl limit``; here the instance's gate
    is lowered in place): the scheduler's next iteration evicts B, the leaf that returns a
    page, and nothing more at the iterations after it; lifting the limit admits growth at
    once (kvcached's issue #498 is the opposite)."""
    e, a, tree = _setup(make, tree_of, limit_bytes=1 << 30)
    pages = e.manager.pages
    gate = e.scope.gate.gate  # the instance's one gate (limit_bytes: a BudgetGate)
    zero = gate.held - 3 * PAGE  # the zero page's charge
    gate.limit = zero + 2 * PAGE
    assert pages.flush() and pages.shed_wanted() == 1
    a.kvcore_step(tree)
    assert _cached(tree, 10_000, 256) == 0 and _cached(tree, 0, 128) == 128
    # in use within the limit (a handle the mapper pools is idle memory, like a reserve:
    # the per-GPU ledger's gate cuts it; this fixed-cap gate leaves it)
    assert e.pages().in_use == 2 and gate.held - gate.reserve <= gate.limit
    for _ in range(3):  # later iterations: answered once, nothing more goes
        a.kvcore_step(tree)
    assert _cached(tree, 0, 128) == 128 and pages.shed_wanted() == 0
    assert a.alloc(512) is None, "no growth over the limit"
    gate.limit = 1 << 30
    assert a.alloc(512) is not None and e.pages().in_use == 4


def test_the_engine_policy_keeps_sglangs_order(make: Any) -> None:
    e, a, tree = _setup(make, eviction="engine")
    a.kvcore_step(tree)
    assert not isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
    assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    assert _cached(tree, 0, 128) == 0  # LRU: A, no page returned
    assert e.pages().in_use == 3


# -- the tree core: kvcore's default and explicit choices ----------------------------------


def test_an_unset_tree_core_becomes_python_until_the_scope_closes(make: Any) -> None:
    """SGLang's serving tree built after the scope opened (as the scheduler builds it after
    ``configure``) is on the Python core whatever the release's default, so the order
    applies; closing the scope unsets the variable again."""
    e = make("on", size=2048, page_size=16)
    assert os.environ.get(eviction.TREE_CORE_ENV) == "python"
    tree = unified_radix(e.allocator, 16)
    assert type(tree.tree_core).__name__ == "UnifiedTreeCore"
    e.allocator.kvcore_step(tree)
    assert isinstance(tree.tree_core.eviction_strategy, eviction.PageAwareEviction)
    e.scope.close()
    assert eviction.TREE_CORE_ENV not in os.environ


def test_an_explicit_tree_core_is_kept(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    os.environ[eviction.TREE_CORE_ENV] = "rust"
    with caplog.at_level(logging.INFO, logger=eviction.__name__):
        eviction._logged.clear()
        e = make("on", size=2048, page_size=16)
        make("on", size=2048, page_size=16)
    assert os.environ[eviction.TREE_CORE_ENV] == "rust"
    kept = [r for r in caplog.records if "set explicitly" in r.getMessage()]
    assert len(kept) == 1  # logged once per process
    e.scope.close()
    assert os.environ[eviction.TREE_CORE_ENV] == "rust"  # not kvcore's to unset


def test_explicit_rust_and_explicit_page_aware_fail_at_start_up() -> None:
    os.environ[eviction.TREE_CORE_ENV] = "rust"
    config = ElasticConfig.parse({"eviction": "page-aware"})
    with pytest.raises(UnsupportedConfiguration) as err:
        eviction.choose_tree_core(config)
    assert eviction.TREE_CORE_ENV in str(err.value) and '"page-aware"' in str(err.value)
    assert err.value.hint
    assert eviction.choose_tree_core(ElasticConfig.parse({"eviction": "engine"})) is False


def test_the_engine_policy_leaves_the_tree_core_alone() -> None:
    assert eviction.choose_tree_core(ElasticConfig.parse({"eviction": "engine"})) is False
    assert eviction.TREE_CORE_ENV not in os.environ


def test_eviction_is_validated() -> None:
    with pytest.raises(UnsupportedConfiguration, match="eviction"):
        ElasticConfig.parse({"eviction": "lru"})


def _rust_unified(allocator: Any) -> Any:
    os.environ[eviction.TREE_CORE_ENV] = "rust"
    try:
        tree = unified_radix(allocator, 16)
    except (ImportError, OSError, RuntimeError) as exc:  # no extension for this build
        pytest.skip(f"SGLang's Rust TreeCore does not load here: {exc}")
    if not hasattr(tree.tree_core, "eviction_strategy") and "Rust" in type(tree.tree_core).__name__:
        return tree
    pytest.skip(f"this SGLang resolved the Rust core to {type(tree.tree_core).__name__}")


def test_the_rust_tree_core_keeps_sglangs_order(make: Any) -> None:
    """With an explicit ``rust`` (default policy) the tree is SGLang's native core: nothing
    is wrapped, eviction is SGLang's LRU, and the ledger still frees pages it empties."""
    e = make("on", size=2048, page_size=16)
    a = e.allocator
    tree = _rust_unified(a)
    a.alloc(240)
    kv_a = a.alloc(128)
    a.alloc(128)
    kv_b = a.alloc(256)
    tree.insert(InsertParams(key=_key(0, 128), value=kv_a))
    tree.insert(InsertParams(key=_key(10_000, 256), value=kv_b))
    a.kvcore_step(tree)
    assert eviction.install(tree, a) is False
    assert tree.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    assert _cached(tree, 0, 128) == 0 and _cached(tree, 10_000, 256) == 256
    assert e.pages().in_use == 3


# -- TP > 1: the ranks' page layouts differ, so their trees must keep SGLang's order --------


def _diverging_rank(make: Any, reserve_max: int) -> tuple[Any, Any, dict[str, Any]]:
    """One rank's stack after the same calls every rank makes. The ranks differ only in
    where a released page waits (``reserve_max`` here; in serving the gate's reserve target,
    which reads the GPU's ledger, and the background unmap's timing): rank A keeps page 1
    in its reserve, rank B queues both pages for unmapping. The next allocations land on
    different pages, and when one free touches two equally filled pages the ledger refills
    the lower id first, so request R ends up beside X on one rank and beside Y on the other.
    """
    e = make("on", size=2048, page_size=16, reserve_min=0, reserve_max=reserve_max)
    a = e.allocator
    tree = radix(a, 16)
    a.alloc(240)  # page 0 (with block 0) full
    t1, t2 = a.alloc(256), a.alloc(256)
    a.free(t1)
    a.free(t2)
    e.pages()  # unmaps settled (either way the ranks differ)
    x, px = a.alloc(128), a.alloc(128)
    y, py = a.alloc(128), a.alloc(128)
    tree.insert(InsertParams(key=_key(0, 128), value=x))  # X, older
    tree.insert(InsertParams(key=_key(10_000, 128), value=y))  # Y, newer
    a.free(torch.cat([px, py]))
    r = a.alloc(128)  # a running request
    pages = {name: set((t // 256).tolist()) for name, t in (("X", x), ("Y", y), ("R", r))}
    return a, tree, pages


def test_page_layouts_differ_between_ranks_so_page_aware_order_diverges(make: Any) -> None:
    """The hazard, with two real ledgers fed the same calls: page-aware eviction picks a
    different leaf on each rank; SGLang's LRU picks the same one."""
    a_rank, a_tree, a_pages = _diverging_rank(make, reserve_max=1)
    b_rank, b_tree, b_pages = _diverging_rank(make, reserve_max=0)
    assert (a_pages["R"] == a_pages["Y"]) != (b_pages["R"] == b_pages["Y"])
    for rank, tree in ((a_rank, a_tree), (b_rank, b_tree)):
        assert eviction.install(tree, rank) is True
        with eviction.giving_back(tree):
            tree.evict(EvictParams(num_tokens=128))
    a_kept = (_cached(a_tree, 0, 128), _cached(a_tree, 10_000, 128))
    b_kept = (_cached(b_tree, 0, 128), _cached(b_tree, 10_000, 128))
    assert a_kept != b_kept  # the ranks' trees diverged: X went on one, Y on the other


@pytest.fixture
def attention_tp_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's parallel context of one attention-TP rank of two (what the scheduler
    process publishes before the pools are built)."""
    from sglang.srt import runtime_context

    ctx = SimpleNamespace(tp_size=2, attn_tp_size=2, attn_cp_size=1, pp_size=1)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: ctx)


@pytest.mark.usefixtures("attention_tp_2")
def test_at_attention_tp_2_every_rank_keeps_sglangs_order(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The guard: the same two diverging ranks at attention-TP 2 evict the same leaf (X,
    LRU) through the scheduler's step; the default does not switch the tree core and says
    so once."""
    eviction._logged.clear()
    kept = []
    with caplog.at_level(logging.INFO, logger=eviction.__name__):
        for reserve_max in (1, 0):
            rank, tree, _ = _diverging_rank(make, reserve_max)
            assert eviction.TREE_CORE_ENV not in os.environ
            rank.kvcore_step(tree)
            assert not isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
            tree.evict(EvictParams(num_tokens=128))
            kept.append((_cached(tree, 0, 128), _cached(tree, 10_000, 128)))
    assert kept == [(0, 128), (0, 128)]
    assert sum("attention-TP 2" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.usefixtures("attention_tp_2")
def test_explicit_page_aware_at_attention_tp_2_fails_at_start_up(make: Any) -> None:
    with pytest.raises(UnsupportedConfiguration, match="attention-TP 2") as err:
        make("on", size=2048, page_size=16, eviction="page-aware")
    assert "eviction" in str(err.value) and err.value.hint


def test_an_agreed_ledger_keeps_sglangs_order(make: Any) -> None:
    """Ranks agreeing allocations (``AgreedLedger``; its rollback also leaves layouts that
    differ) keep SGLang's order even where no parallel context is published."""
    from kvcore.parallel.agreement import AgreedLedger

    class _Alone:  # a one-rank agreement: the minimum of one vector is itself
        size = 1

        def min(self, values: Any) -> list[int]:
            return list(values)

    _, a, tree = _setup(make)
    a.ledger = AgreedLedger(a.ledger, _Alone())
    a.kvcore_step(tree)
    assert not isinstance(tree.eviction_strategy, eviction.PageAwareEviction)
    assert eviction.attach(tree, a) is False


def test_a_bound_no_seam_reaches_is_refused(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where neither SGLang's pre-allocation eviction (< 0.5.23) nor the scheduler's step
    (an allocator without ``kvcore_step``, e.g. the hybrid SWA one) reaches kvcore, the
    cached-token bound is refused at start-up rather than silently not held."""
    from kvcore.adapters.sglang import scope as scope_module

    e = make("on", size=512, page_size=16, max_cached_tokens=128)
    upstream = e.allocator
    monkeypatch.setattr(scope_module, "eviction_asks_allocator", lambda: False)
    monkeypatch.setattr(scope_module, "elastic_allocator", lambda up: SimpleNamespace())
    with pytest.raises(UnsupportedConfiguration, match="max_cached_tokens"):
        e.scope.allocator(upstream)
    monkeypatch.setattr(scope_module, "elastic_allocator", lambda up: up)
    assert e.scope.allocator(upstream) is upstream  # a stepped allocator: accepted


def test_the_forked_scheduler_steps_the_allocator_with_its_tree() -> None:
    """Patch 0006 as installed: ``get_next_batch_to_run`` passes the scheduler's tree to
    ``kvcore_step`` first thing, before the iteration can allocate. (The scheduler module
    needs packages this CPU environment lacks, so its source is read, not imported.)"""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "srt" / "managers" / "scheduler.py").read_text()
    method = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "get_next_batch_to_run"
    )
    first = ast.unparse(method.body[0])
    assert "self.token_to_kv_pool_allocator.kvcore_step(self.tree_cache)" in first
    assert first.startswith("if hasattr(self.token_to_kv_pool_allocator, 'kvcore_step')")
