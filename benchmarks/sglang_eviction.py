"""SGLang radix eviction: what page-aware order returns, and what SGLang's tree cores cost.

Two figures of issue 7, both on SGLang's real trees over kvcore's elastic allocator (``host``
backend at the GPU's 2 MiB granularity: one physical page holds 1024 tokens here), side by
side in one CPU run. Needs the kvcore fork of SGLang (``nox -s test-sglang-0.5.23`` builds
such a venv under ``.nox/``)::

    PYTHONPATH=tests/engines/sglang/shim .nox/test-sglang-0-5-23/bin/python \\
        -m benchmarks.sglang_eviction [--seeds 5] [--ops 600] [--json F]

**Pages returned** (``RadixCache`` and ``UnifiedRadixCache`` on its Python core). A serving
workload builds the tree: 8 shared prefixes (system prompts of 256-1024 tokens, Zipf-like
popularity), requests of a prefix plus a private 64-768-token part, 24 running at a time; a
request that finishes is cached whole (SGLang's ``cache_finished_req``: insert, free the
duplicate tokens of the part already cached) and the next one starts, so cached leaves and
running requests share physical pages. From that state (built twice, identically, per seed)
each policy evicts, SGLang's own (LRU) and kvcore's page-aware one (the order of the
evictions kvcore asks for to give memory back, ``eviction.giving_back``):

* ``target``: one ``evict`` of 10 %, 25 % and 50 % of the evictable tokens; physical pages
  returned, and pages per 1k tokens evicted;
* ``to free``: tokens that must be evicted (one 64-token ``evict`` call at a time) before 4,
  16 pages come back: what a budgeted allocation pays for room.

**Tree-core cost** (``UnifiedRadixCache``, full attention only): the Python core, the Python
core with the page-aware key installed, evicting as kvcore does to give memory back
(``+page-aware``) and as SGLang does before its own allocations (``+installed``: the key
ranks as upstream there), and SGLang's Rust core where its extension loads; ``insert`` of
``--ops`` requests (a shared prefix + a 64-token private part), ``match_prefix`` of each,
then ``evict`` of one leaf at a time; every op timed alone, medians in microseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks._provenance import commit, now
from harness.sglang_kv import Engine, build

PAGE = 16  # SGLang page (tokens)
SIZE = 1 << 17  # tokens in the pool
HEADS, HEAD_DIM, LAYERS = 8, 128, 1  # 2 KiB per token per buffer: 1024 tokens per 2 MiB
KVCORE = {"backend_options": {"device_bytes": 8 << 30, "granularity": 2 << 20}}
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
PREFIXES = 8
RUNNING = 24
TARGETS = (0.10, 0.25, 0.50)
PAGE_GOALS = (4, 16)


def _stack() -> Engine:
    return build(
        "on", size=SIZE, page_size=PAGE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, **KVCORE
    )


def _tree(kind: str, allocator: Any) -> Any:
    """``radix`` (``RadixCache``) or ``UnifiedRadixCache`` on tree core ``python``/``rust``
    (the trees kvcore's eviction tests build)."""
    from harness.sglang_kv import radix, unified_radix

    if kind == "radix":
        return radix(allocator, PAGE)
    saved = os.environ.get(TREE_CORE_ENV)
    os.environ[TREE_CORE_ENV] = kind
    try:
        return unified_radix(allocator, PAGE)
    finally:
        if saved is None:
            os.environ.pop(TREE_CORE_ENV, None)
        else:
            os.environ[TREE_CORE_ENV] = saved


def _key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(token_ids=array("q", tokens))


def _matched_kv(tree: Any, m: Any) -> torch.Tensor:
    """The device KV indices of a ``match_prefix`` result (0.5.20 returns them; later
    releases return the length and the node)."""
    if hasattr(m, "device_indices"):
        return m.device_indices  # type: ignore[no-any-return]
    return tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]  # type: ignore[no-any-return]


def _pages(t: int) -> int:
    return -(-t // PAGE) * PAGE


def _serve(e: Engine, tree: Any, seed: int, requests: int) -> None:
    """The serving workload of the module docstring, ``requests`` requests long."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    rng = random.Random(seed)
    a = e.allocator
    prefixes = [
        [10_000_000 * (i + 1) + t for t in range(_pages(rng.randint(256, 1024)))]
        for i in range(PREFIXES)
    ]
    weights = [1 / (i + 1) for i in range(PREFIXES)]
    running: list[tuple[list[int], torch.Tensor, int, Any]] = []
    unified = hasattr(tree, "tree_core")
    serial = 0

    def start() -> None:
        nonlocal serial
        serial += 1
        prefix = rng.choices(prefixes, weights)[0]
        private = [serial * 100_000 + t for t in range(_pages(rng.randint(64, 768)))]
        tokens = prefix + private
        m = tree.match_prefix(MatchPrefixParams(key=_key(tokens)))
        cached = _matched_kv(tree, m)
        lock = (m.last_device_node, tree.inc_lock_ref(m.last_device_node).to_dec_params())
        new = a.alloc(len(tokens) - len(cached))
        assert new is not None, "pool too small for the workload"
        running.append((tokens, torch.cat([cached, new]), len(cached), lock))

    def finish(i: int) -> None:
        # SGLang's cache_finished_req: cache the whole request and free the tokens it
        # computed that the tree held already (another request cached the prefix meanwhile);
        # UnifiedRadixCache frees those itself, past prev_prefix_len
        tokens, kv, matched, (node, receipt) = running.pop(i)
        if unified:
            tree.insert(InsertParams(key=_key(tokens), value=kv, prev_prefix_len=matched))
        else:
            held = tree.insert(InsertParams(key=_key(tokens), value=kv)).prefix_len
            if held > matched:
                a.free(kv[matched:held])
        tree.dec_lock_ref(node, receipt)

    for _ in range(RUNNING):
        start()
    for _ in range(requests):
        finish(rng.randrange(len(running)))
        start()


def _build(kind: str, seed: int, requests: int, page_aware: bool) -> tuple[Engine, Any]:
    from kvcore.adapters.sglang import eviction

    e = _stack()
    tree = _tree(kind, e.allocator)
    _serve(e, tree, seed, requests)
    if page_aware:
        assert eviction.install(tree, e.allocator)
    return e, tree


def _in_use(e: Engine) -> int:
    return int(e.pages().in_use)


def pages_returned(kind: str, seeds: int, requests: int) -> list[dict[str, Any]]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kvcore.adapters.sglang import eviction

    rows: list[dict[str, Any]] = []
    for policy in ("sglang", "page-aware"):
        per_target: dict[str, list[float]] = {}
        for seed in range(seeds):
            for frac in TARGETS:
                e, tree = _build(kind, seed, requests, policy == "page-aware")
                want = int(tree.evictable_size() * frac)
                before = _in_use(e)
                with eviction.giving_back(tree):  # a no-op for SGLang's policy
                    got = tree.evict(EvictParams(num_tokens=want)).num_tokens_evicted
                freed = before - _in_use(e)
                per_target.setdefault(f"pages@{frac:.0%}", []).append(freed)
                per_target.setdefault(f"per1k@{frac:.0%}", []).append(1000 * freed / max(got, 1))
                e.scope.close()
            e, tree = _build(kind, seed, requests, policy == "page-aware")
            base, evicted = _in_use(e), 0
            for goal in PAGE_GOALS:
                while base - _in_use(e) < goal and tree.evictable_size():
                    with eviction.giving_back(tree):
                        evicted += tree.evict(EvictParams(num_tokens=64)).num_tokens_evicted
                per_target.setdefault(f"tokens for {goal} pages", []).append(evicted)
            e.scope.close()
        rows.append(
            {"tree": kind, "policy": policy}
            | {k: statistics.median(v) for k, v in per_target.items()}
        )
    return rows


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1000


def core_cost(variant: str, ops: int) -> dict[str, Any] | None:
    """Per-op medians (us) of insert, match_prefix and one-leaf evict on one tree core."""
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )

    from kvcore.adapters.sglang import eviction

    kind = "rust" if variant == "rust" else "python"
    e = _stack()
    a = e.allocator
    try:
        tree = _tree(kind, a)
    except (ImportError, OSError, RuntimeError) as exc:
        print(f"{variant}: tree core unavailable ({exc})", file=sys.stderr)
        e.scope.close()
        return None
    core = type(tree.tree_core).__name__
    if variant == "rust" and "Rust" not in core:
        print(f"rust: SGLang resolved the core to {core}", file=sys.stderr)
        e.scope.close()
        return None
    if variant in ("python+page-aware", "python+installed"):
        assert eviction.install(tree, a)
    giving_back = variant == "python+page-aware"
    rng = random.Random(0)
    prefixes = [[7_000_000 * (i + 1) + t for t in range(512)] for i in range(PREFIXES)]
    prefix_kv: dict[int, torch.Tensor] = {}
    keys: list[list[int]] = []
    insert_us: list[float] = []
    for n in range(ops):
        i = rng.randrange(PREFIXES)
        tokens = prefixes[i] + [(n + 1) * 100_000 + t for t in range(64)]
        matched = 512 if i in prefix_kv else 0  # the request matched its cached prefix
        if not matched:
            prefix_kv[i] = a.alloc(512)
        kv = torch.cat([prefix_kv[i], a.alloc(64)])
        keys.append(tokens)
        params = InsertParams(key=_key(tokens), value=kv, prev_prefix_len=matched)
        insert_us.append(_timed(lambda p=params: tree.insert(p)))
    match_us = []
    for tokens in keys:
        key = _key(tokens)
        match_us.append(_timed(lambda k=key: tree.match_prefix(MatchPrefixParams(key=k))))
    evict_us = []
    while tree.evictable_size() > 8 * 512:  # the private leaves, one at a time
        with eviction.giving_back(tree) if giving_back else contextlib.nullcontext():
            evict_us.append(_timed(lambda: tree.evict(EvictParams(num_tokens=64))))
    e.scope.close()
    return {
        "core": variant,
        "class": core,
        "insert_us": statistics.median(insert_us),
        "match_us": statistics.median(match_us),
        "evict_us": statistics.median(evict_us),
        "evicts": len(evict_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--ops", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3, help="tree-core runs (alternating)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import sglang

    torch.set_num_threads(1)
    out: dict[str, Any] = {"sglang": sglang.__version__}

    rows = [r for k in ("radix", "python") for r in pages_returned(k, args.seeds, args.requests)]
    metrics = [k for k in rows[0] if k not in ("tree", "policy")]
    table = Table(
        title=f"SGLang {sglang.__version__}: physical pages returned by radix eviction "
        f"(1024 tokens/page), medians of {args.seeds} seeds, {args.requests} requests"
    )
    table.add_column("metric")
    for r in rows:
        table.add_column(f"{r['tree']}\n{r['policy']}", justify="right")
    for m in metrics:
        table.add_row(m, *(f"{r[m]:.1f}" for r in rows))
    Console().print(table)
    out["pages_returned"] = rows

    variants = ("python", "python+page-aware", "python+installed", "rust")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            r = core_cost(v, args.ops)
            if r is not None:
                runs[v].append(r)
    cost = []
    for v in variants:
        if runs[v]:
            cost.append(
                {"core": v, "class": runs[v][0]["class"]}
                | {
                    op: statistics.median(r[op] for r in runs[v])
                    for op in ("insert_us", "match_us", "evict_us")
                }
            )
    table = Table(
        title=f"UnifiedRadixCache tree cores: per-op medians (us), {args.ops} inserts, "
        f"median of {args.repeats} runs"
    )
    for c in ("core", "class", "insert", "match_prefix", "evict (one leaf)"):
        table.add_column(c, justify="right")
    for r in cost:
        table.add_row(
            r["core"],
            r["class"],
            f"{r['insert_us']:.1f}",
            f"{r['match_us']:.1f}",
            f"{r['evict_us']:.1f}",
        )
    Console().print(table)
    out["tree_core_cost"] = cost
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                out
                | {
                    "commit": commit("kvcore", "harness", "benchmarks/sglang_eviction.py"),
                    "date": now(),
                    "args": vars(args),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
