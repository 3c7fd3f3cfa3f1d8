"""Page-aware radix-cache eviction: leaves whose tokens empty whole physical pages go first.

kvcore returns memory to the driver a physical page at a time, and only once every block on
the page is free. SGLang evicts radix-cache leaves in its eviction policy's order (LRU by
default), which frees tokens scattered over many pages and returns none. SGLang's Python
trees rank leaves through one object, the tree's ``eviction_strategy`` (its
``get_priority(node)``, the heap key of every eviction walk): ``RadixCache`` and the Python
``UnifiedTreeCore`` (``UnifiedRadixCache`` with ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=
python``, or where the Rust core does not apply). ``PageAwareEviction`` wraps that strategy:
its key is ``(0 if evicting the leaf empties at least one physical page else 1, upstream's
key)``, so page-emptying leaves go first, each group in the upstream policy's order. Which
pages a leaf empties is the block ledger's ``eviction_order`` over the leaf's blocks (a
page empties when every allocated block on it belongs to the leaf).

The key applies only to the evictions kvcore asks for to give memory back: the cache bound
(``max_cached_tokens``) and a lowered limit's shed, inside ``giving_back``. SGLang's own
evictions, which free room for the allocation that follows them, keep its order: their
blocks go straight to that allocation (the ledger fills held pages first), so emptying a
page there would only unmap it and map another, and the key's cost (below) would be paid
at every allocation under memory pressure, on the scheduler's thread.

The key is taken when the eviction walk pushes a leaf (as upstream's), so a leaf that
starts to empty a page because a sibling was evicted in the same walk keeps its earlier
rank until the next walk. Cost: one pass over the leaf's block ids per leaf pushed, and on
a GPU a device-to-host read of the leaf's ids (upstream's key reads one attribute);
``benchmarks/sglang_eviction.py`` measures it.

``UnifiedRadixCache`` on the Rust ``TreeCore`` (0.5.23's default wherever its extension
loads, CPU included) orders eviction in native code with no Python strategy object:
``install`` leaves it alone and says so (``False``); SGLang's order is kept there and the
ledger still places every freed block page-aware.

Policy (``--kvcore-config`` ``eviction``; ``choose_tree_core`` at start-up, ``attach`` at
the scheduler's first iteration):

* ``"engine"``: SGLang's order and tree core, untouched.
* default (``None``): page-aware where it is safe. When SGLang's tree-core variable
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` is unset, ``choose_tree_core`` sets it to
  ``python`` in the scheduler process before the tree is built (as SGLang's own KV-sharding
  resolution does), so the order can be applied; an explicit choice is kept, and with an
  explicit ``rust`` SGLang's order stays (logged once).
* ``"page-aware"``: as the default, but a configuration where it cannot apply (an explicit
  non-Python tree core, peers below) fails at start-up naming both settings.

Peers. Ranks that must take identical radix-tree decisions (attention-TP or context-parallel
ranks of one scheduler, pipeline stages) cannot use the page-aware key: it reads the rank's
own page layout, and layouts differ between ranks. Which page ``PageAllocator.acquire``
hands out depends on whether a released page is still in the reserve, in the unmap queue or
back on the free list (background-thread timing and a gate's reserve target that reads the
GPU's ledger), and the ledger breaks ties among equally filled pages by the order their
frees were processed, which follows page ids; after an agreement rollback
(``kvcore.parallel.agreement``) the same holds. Two ranks would then evict different leaves, match
different prefixes and schedule different batches. With peers SGLang's order is kept (the
default, logged once) or start-up fails (explicit ``"page-aware"``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

from kvcore.errors import UnsupportedConfiguration

__all__ = [
    "TREE_CORE_ENV",
    "PageAwareEviction",
    "attach",
    "choose_tree_core",
    "eviction_asks_allocator",
    "giving_back",
    "install",
]

log = logging.getLogger(__name__)

TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
"""SGLang's variable choosing ``UnifiedRadixCache``'s tree core (``python`` or ``rust``)."""

_logged: set[str] = set()

_SENTINEL = -1  # never an allocated block: eviction_order puts it in the second group


class PageAwareEviction:
    """An SGLang ``EvictionStrategy`` over ``base`` (module docstring). ``ledger`` maps
    blocks to pages (``eviction_order``); a token index ``t`` is block ``t // page_size``;
    ``value_of(node)`` is the node's device token indices (a tensor) or ``None``. The key
    is page-aware only while ``giving_back`` holds (``active``); otherwise it ranks every
    leaf as upstream does."""

    def __init__(self, base: Any, ledger: Any, page_size: int, value_of: Any) -> None:
        self.base = base
        self._ledger = ledger
        self._page_size = page_size
        self._value_of = value_of
        self.active = False
        """Whether the walk in progress gives memory back (``giving_back``)."""

    def get_priority(self, node: Any) -> tuple[int, Any]:
        empties = self.active and self.empties_a_page(node)
        return (0 if empties else 1, self.base.get_priority(node))

    def empties_a_page(self, node: Any) -> bool:
        """Whether freeing ``node``'s tokens would leave at least one physical page with no
        allocated block."""
        value = self._value_of(node)
        if value is None:
            return False
        ids = value.tolist()  # one conversion: cheaper than any torch op on a few ids
        if not ids:
            return False
        ps = self._page_size
        # a paged tree's node values are whole SGLang pages: one token per page names it
        blocks = ids if ps == 1 else [t // ps for t in ids[::ps]]
        return bool(self._ledger.eviction_order([_SENTINEL, *blocks])[0] != _SENTINEL)

    def __getattr__(self, name: str) -> Any:  # other strategy attributes (TLRU's, ...)
        return getattr(self.base, name)


@contextlib.contextmanager
def giving_back(tree_cache: Any) -> Iterator[None]:
    """Within it, ``tree_cache``'s evictions are page-aware where ``install`` made its order
    so (elsewhere, and for a tree left in SGLang's order, nothing changes). For the
    evictions kvcore asks for to return memory (module docstring)."""
    core = getattr(tree_cache, "tree_core", tree_cache)
    strategy = getattr(core, "eviction_strategy", None)
    if not isinstance(strategy, PageAwareEviction):
        yield
        return
    strategy.active = True
    try:
        yield
    finally:
        strategy.active = False


def choose_tree_core(config: Any) -> bool:
    """Start-up half of the policy (module docstring), for ``ElasticConfig`` ``config``; called
    when kvcore's scope opens in a scheduler process (the patched ``configure``, which runs
    before the scheduler builds its tree cache). Sets ``TREE_CORE_ENV`` to ``python`` when it
    is unset and page-aware order can apply; returns whether it did (the scope undoes it at
    close with ``forget_tree_core``). Raises ``UnsupportedConfiguration`` naming both settings
    for an explicit ``"page-aware"`` that cannot apply (an explicit non-Python tree core,
    ranks that must decide alike)."""
    policy = config.eviction
    if policy == "engine":
        return False
    peers = decision_peers()
    if peers is not None:
        if policy == "page-aware":
            raise UnsupportedConfiguration(
                f'--kvcore-config eviction="page-aware" at {peers}: the page-aware key reads '
                "the rank's own page layout, which differs between ranks, so their radix "
                "trees would diverge",
                hint='drop "eviction" from --kvcore-config (SGLang\'s order is kept at '
                'TP > 1) or set it to "engine"',
            )
        _log_once(f"kvcore: {peers}: radix eviction keeps SGLang's order (page layouts differ)")
        return False
    chosen = os.environ.get(TREE_CORE_ENV)
    if chosen is None:
        os.environ[TREE_CORE_ENV] = "python"
        _log_once(f"kvcore: {TREE_CORE_ENV}=python (page-aware radix eviction)")
        return True
    if chosen != "python":
        if policy == "page-aware":
            raise UnsupportedConfiguration(
                f'--kvcore-config eviction="page-aware" with {TREE_CORE_ENV}={chosen}: that '
                "tree core orders eviction natively, with no Python policy kvcore can wrap",
                hint=f"unset {TREE_CORE_ENV} (kvcore then selects the Python core) or drop "
                '"eviction" from --kvcore-config to keep SGLang\'s order',
            )
        _log_once(
            f"kvcore: {TREE_CORE_ENV}={chosen} was set explicitly: SGLang's radix eviction "
            "order is kept"
        )
    return False


def forget_tree_core() -> None:
    """Undo ``choose_tree_core``'s default (the scope's close): unset ``TREE_CORE_ENV`` when it
    still holds what kvcore set."""
    if os.environ.get(TREE_CORE_ENV) == "python":
        del os.environ[TREE_CORE_ENV]


def attach(tree_cache: Any, allocator: Any) -> bool:
    """Iteration half of the policy: give ``tree_cache`` (the scheduler's tree, through the
    allocator's ``kvcore_step``) page-aware order over ``allocator``'s ledger where the
    policy allows it (module docstring). Returns whether the tree's order is now
    page-aware; a kept SGLang order is logged once."""
    if allocator.kvcore.config.eviction == "engine":
        return False
    from kvcore.parallel.agreement import AgreedLedger

    peers = decision_peers()
    if peers is None and isinstance(allocator.ledger, AgreedLedger):
        peers = "ranks agreeing allocations"
    if peers is not None:
        _log_once(f"kvcore: {peers}: radix eviction keeps SGLang's order (page layouts differ)")
        return False
    return install(tree_cache, allocator)


def decision_peers() -> str | None:
    """Why this rank's radix-tree decisions must match other ranks' (``"attention-TP 2"``,
    ...), or ``None`` for a rank that decides alone (also where SGLang published no
    parallel context: tests and tools building pools directly)."""
    from sglang.srt.runtime_context import get_parallel

    for name, label in (
        ("attn_tp_size", "attention-TP"),
        ("attn_cp_size", "attention-CP"),
        ("pp_size", "PP"),
    ):
        try:
            size = int(getattr(get_parallel(), name))
        except (RuntimeError, ValueError, AttributeError, AssertionError, TypeError):
            continue
        if size > 1:
            return f"{label} {size}"
    return None


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def install(tree_cache: Any, allocator: Any) -> bool:
    """Make ``tree_cache``'s eviction page-aware over ``allocator``'s ledger (idempotent).
    Returns ``True`` when the tree's order is now page-aware, ``False`` when the tree has no
    Python eviction strategy to wrap (the Rust ``TreeCore``, a disabled or custom cache)."""
    ledger = allocator.ledger
    page_size = allocator.page_size
    if hasattr(tree_cache, "tree_core"):
        return _install_unified(tree_cache, ledger, page_size)
    strategy = getattr(tree_cache, "eviction_strategy", None)
    if strategy is None or not hasattr(strategy, "get_priority"):
        return False
    if not isinstance(strategy, PageAwareEviction):
        tree_cache.eviction_strategy = PageAwareEviction(strategy, ledger, page_size, _radix_value)
    return True


def _install_unified(tree_cache: Any, ledger: Any, page_size: int) -> bool:
    """``UnifiedRadixCache``: wrap the Python ``UnifiedTreeCore``'s strategy (the FULL
    component's device walk reads it); the Rust core has none."""
    core = tree_cache.tree_core
    if not hasattr(core, "eviction_strategy"):
        _log_once(
            f"kvcore: {type(core).__name__} orders radix eviction natively; SGLang's order is kept"
        )
        return False
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    full = int(ComponentType.FULL)

    def value_of(node: Any) -> Any:
        return node.component_data[full].value

    strategy = core.eviction_strategy
    if not isinstance(strategy, PageAwareEviction):
        core.eviction_strategy = PageAwareEviction(strategy, ledger, page_size, value_of)
        # the FULL component binds the strategy's key at its first walk: rebind it
        for component in getattr(core, "components_by_type", {}).values():
            bound = getattr(component, "session_ref_eviction_strategy", None)
            if getattr(bound, "__self__", None) is strategy:
                component.session_ref_eviction_strategy = core.eviction_strategy.get_priority
    return True


def _radix_value(node: Any) -> Any:
    return node.value


@functools.cache
def eviction_asks_allocator() -> bool:
    """Whether SGLang's pre-allocation eviction (``common.evict_from_tree_cache``) goes through
    ``allocator.evict_to_free_tokens`` (0.5.23 and later), where the cache bound is applied."""
    from sglang.srt.mem_cache import common

    try:
        return "evict_to_free_tokens" in inspect.getsource(common.evict_from_tree_cache)
    except (OSError, TypeError):  # no source: assume the newer seam
        return True
