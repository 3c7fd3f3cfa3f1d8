"""What the elastic pool tells SGLang is free can be allocated then (issue 18), in the real
SGLang token and paged allocators (the kvcore fork, host backend).

The page allocator's background thread is held inside its unmap (``tests.memstack``'s
``PageThreadHold`` in front of the memory's mapper) right after the whole pool was freed:
upstream's allocator serves the same allocation at once, and SGLang's scheduler treats a
refusal after admission as "Prefill out of memory".
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.memstack import PageThreadHold, holding_mappers

from .harness import requires_fork

pytestmark = requires_fork


RESERVE = {"reserve_min": 1, "reserve_max": 4}
MAP_AHEAD = {"map_ahead": 4}  # the background maps ahead while allocations come


@pytest.fixture
def holds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PageThreadHold]]:
    """Every kvcore memory built in the test drives its mapper through a hold."""
    from kvcore.memory import chain  # builds every adapter's mapper

    with holding_mappers(monkeypatch, chain) as made:
        yield made


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_freed_pool_is_allocatable_while_its_pages_unmap(
    make: Any, holds: list[PageThreadHold], page_size: int
) -> None:
    e = make("on", size=2048, page_size=page_size)
    a = e.allocator
    (hold,) = holds
    n = a.available_size()
    idx = a.alloc(n)
    assert idx is not None and a.available_size() == 0
    hold.armed = True
    a.free(idx)
    assert hold.entered.wait(10.0)  # the page thread is unmapping what was freed
    assert a.available_size() == n
    got = hold.call_past(lambda: a.alloc(n))
    assert got is not None and got.numel() == n  # as upstream: the pool is all free
    assert e.manager.pages.stats().misses == 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "reserve", [{}, RESERVE, MAP_AHEAD], ids=["no-reserve", "reserve", "map-ahead"]
)
@pytest.mark.parametrize("granularity", [1 << 16, 1 << 17], ids=["64k", "128k"])
@pytest.mark.parametrize(
    ("page_size", "size"),
    [(1, 2048), (1, 1792), (16, 2048), (16, 1008)],
    ids=["token-2048", "token-1792", "paged-2048", "paged-1008"],
)
def test_lockstep_with_upstream_without_a_budget(
    make: Any, page_size: int, size: int, granularity: int, reserve: dict[str, int], seed: int
) -> None:
    """Seeded random allocations and frees, some of them freeing everything and allocating
    it straight back, on upstream's allocator and the elastic one side by side, with the
    page thread running free: every allocation succeeds on one exactly when it does on the
    other, and both report the same room at every step. Every size but the paged 1008
    leaves a short last page at both granularities."""
    up = make("off", size=size, page_size=page_size)
    el = make("on", size=size, page_size=page_size, **reserve)
    rng = random.Random(seed)
    live: list[tuple[Any, Any]] = []
    pages = size // page_size
    for step in range(250):
        assert el.allocator.available_size() == up.allocator.available_size(), step
        roll = rng.random()
        if roll < 0.05:  # everything back, then all of it at once
            for u, e in live:
                up.allocator.free(u)
                el.allocator.free(e)
            live.clear()
            n = up.allocator.available_size()
        elif live and roll < 0.5:
            u, e = live.pop(rng.randrange(len(live)))
            up.allocator.free(u)
            el.allocator.free(e)
            continue
        else:
            n = page_size * rng.randrange(1, max(2, pages // 3))
        u, e = up.allocator.alloc(n), el.allocator.alloc(n)
        assert (u is None) == (e is None), f"step {step}: alloc({n}) upstream {u is not None}"
        if u is not None:
            live.append((u, e))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("page_size", "size"), [(1, 2048), (16, 2048)], ids=["token", "paged"])
def test_the_room_reported_under_a_budget_is_always_allocatable(
    make: Any, page_size: int, size: int, seed: int
) -> None:
    """A budget that moves (as ``kvctl limit`` moves it) between a few physical pages and
    all of them, a short last page, a reserve: at random moments of a seeded random load,
    ``available_size()`` tokens are allocated at once and must be granted (what SGLang
    admits a prefill on)."""
    page = 4 * (1 << 16)  # one physical page: 64 KiB per (layer, K/V) range, 2 layers x K/V
    zero = 1 << 16  # the zero page, charged to the gate
    el = make("on", size=size, page_size=page_size, limit_bytes=9 * page + zero, reserve_max=2)
    gate = el.manager.pages._gate  # a BudgetGate: moved here as kvctl would move the limit
    a = el.allocator
    rng = random.Random(seed)
    live: list[Any] = []
    for _ in range(300):
        roll = rng.random()
        if roll < 0.1:
            gate.limit = rng.randrange(3, 10) * page + zero
        elif roll < 0.3:
            room = a.available_size()
            if room:
                got = a.alloc(room)
                assert got is not None, f"{room} tokens reported free, not granted"
                live.append(got)
        elif live and roll < 0.6:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            n = page_size * rng.randrange(1, 24)
            got = a.alloc(n)
            if got is not None:
                live.append(got)
