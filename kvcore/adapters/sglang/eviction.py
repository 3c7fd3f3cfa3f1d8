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

The key is taken when the eviction walk pushes a leaf (as upstream's), so a leaf that
starts to empty a page because a sibling was evicted in the same walk keeps its earlier
rank until the next walk. Cost: one pass over the leaf's token indices per leaf pushed
(upstream's key reads one attribute).

``UnifiedRadixCache`` on the Rust ``TreeCore`` (0.5.23's default wherever its extension
loads, CPU included) orders eviction in native code with no Python strategy object:
``install`` leaves it alone and says so (``False``); SGLang's order is kept there and the
ledger still places every freed block page-aware.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["PageAwareEviction", "install"]

log = logging.getLogger(__name__)

_SENTINEL = -1  # never an allocated block: eviction_order puts it in the second group


class PageAwareEviction:
    """An SGLang ``EvictionStrategy`` over ``base`` (module docstring). ``ledger`` maps
    blocks to pages (``eviction_order``); a token index ``t`` is block ``t // page_size``;
    ``value_of(node)`` is the node's device token indices (a tensor) or ``None``."""

    def __init__(self, base: Any, ledger: Any, page_size: int, value_of: Any) -> None:
        self.base = base
        self._ledger = ledger
        self._page_size = page_size
        self._value_of = value_of

    def get_priority(self, node: Any) -> tuple[int, Any]:
        return (0 if self.empties_a_page(node) else 1, self.base.get_priority(node))

    def empties_a_page(self, node: Any) -> bool:
        """Whether freeing ``node``'s tokens would leave at least one physical page with no
        allocated block."""
        value = self._value_of(node)
        if value is None or value.numel() == 0:
            return False
        ids = value.tolist()
        ps = self._page_size
        blocks = dict.fromkeys(ids if ps == 1 else (t // ps for t in ids))
        return bool(self._ledger.eviction_order([_SENTINEL, *blocks])[0] != _SENTINEL)

    def __getattr__(self, name: str) -> Any:  # other strategy attributes (TLRU's, ...)
        return getattr(self.base, name)


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
        log.info(
            "kvcore: %s orders radix eviction natively; SGLang's order is kept",
            type(core).__name__,
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
