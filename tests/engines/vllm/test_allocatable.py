"""What the elastic pool tells vLLM is free can be allocated then (issue 18), under the real
``Scheduler`` and ``KVCacheManager`` of the forked wheel (host backend, no GPU).

The page allocator's background thread is held inside its unmap (``tests.memstack``'s
``PageThreadHold`` in front of the memory's mapper): the pages the finished requests left
are in flight, exactly the moment at which a new request used to be refused although
upstream's pool would have served it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_layout", reason="the test-vllm-* nox sessions run these")
from test_elastic_families import BF16, Engine, MiB, _close_engines, _prompt
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcore.memory import chain
from kvcore.memory.pages import PageState
from tests.memstack import PageThreadHold, holding_mappers

__all__ = ["_close_engines"]  # the autouse fixture that closes the engines built here

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)


@pytest.fixture
def holds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[PageThreadHold]]:
    """Every ``ElasticKVMemory`` built in the test drives its mapper through a hold."""
    with holding_mappers(monkeypatch, chain) as made:
        yield made


def test_a_request_fits_while_the_pages_freed_for_it_are_still_unmapping(
    holds: list[PageThreadHold],
) -> None:
    eng = Engine({f"model.layers.{i}.attn": SPEC for i in range(2)}, 2 * MiB)
    (hold,) = holds
    total = eng.kv.num_blocks - 1  # all but the null block
    first = [eng.add(f"a{i}", _prompt(i, 16 * (total // 4) - 8), max_tokens=2) for i in range(4)]
    eng.run()
    assert all(r.is_finished() for r in first)
    # the pool is empty again; hold the background unmap of the pages the requests left
    hold.armed = True
    eng.add("b", _prompt(9, 16 * (total - 2)), max_tokens=1)

    def in_flight(out: list[Any]) -> None:
        assert hold.entered.wait(10.0) or out  # the unmap is in flight (or already done)

    stepped = hold.call_past(eng.step, started=in_flight)
    scheduled = [r.req_id for r in stepped.scheduled_new_reqs]
    assert scheduled == ["b"], "upstream's pool would have scheduled it in this step"
    pages = eng.memory.pages
    assert pages is not None and pages.stats().misses == 0
    eng.run()
    assert pages.state(0) is PageState.IN_USE  # the null block's page


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize(
    "options",
    [{}, {"reserve_min": 1, "reserve_max": 4}, {"map_ahead": 4}],
    ids=["no-reserve", "reserve", "map-ahead"],
)
@pytest.mark.parametrize("granularity", [64 << 10, 128 << 10], ids=["64k", "128k"])
def test_lockstep_with_upstream_without_a_budget(
    granularity: int, options: dict[str, int], caching: bool, seed: int
) -> None:
    """Seeded random arrivals (short and long prompts sharing prefixes) into upstream's
    ``BlockPool`` and the elastic one side by side, prefix caching off and on, the page
    thread running free, 64 KiB and 128 KiB pages over a block count that leaves a short
    last page: every step schedules the same requests for the same tokens, and the same
    ones finish."""
    specs = {f"model.layers.{i}.attn": SPEC for i in range(2)}
    memory = 301 * 2 * SPEC.page_size_bytes  # 301 blocks: the last page is short
    up = Engine(specs, memory, elastic=False, caching=caching)
    el = Engine(specs, memory, granularity=granularity, kvcore=options, caching=caching)
    assert el.memory.geometry.num_blocks % el.memory.geometry.blocks_per_page != 0
    rng = random.Random(seed)
    for step in range(160):
        for _ in range(rng.choice((0, 0, 1, 2))):
            rid, n = f"s{step}-{rng.randrange(10**6)}", rng.choice((24, 90, 300, 900))
            # a few prompt seeds: with the prefix cache on, later requests hit earlier ones
            tokens, max_tokens = _prompt(rng.randrange(6), n), rng.randrange(1, 40)
            up.add(rid, tokens, max_tokens)
            el.add(rid, tokens, max_tokens)
        a, b = up.step(), el.step()
        assert b.num_scheduled_tokens == a.num_scheduled_tokens, f"step {step}"
        assert b.finished_req_ids == a.finished_req_ids, f"step {step}"
