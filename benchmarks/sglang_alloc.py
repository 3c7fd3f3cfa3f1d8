"""SGLang allocator cost, elastic (kvcore ledger) vs upstream, side by side in one CPU run.

Issue 7's figure: alloc/free cost of SGLang's own ``PagedTokenToKVPoolAllocator`` and
``TokenToKVPoolAllocator`` against kvcore's elastic subclasses (goal: elastic <= 1.1x
upstream). Both run in the same process on the same pool shape; the elastic one sits on the
real kvcore stack (``host`` backend at the GPU's 2 MiB granularity, ``VirtualKVCache``,
``LocalPageMapper``, ``PageAllocator`` with a warm reserve, ``BlockLedger``). Needs the
kvcore fork of SGLang installed (``nox -s test-sglang-0.5.23`` builds such a venv under
``.nox/``)::

    PYTHONPATH=tests/engines/sglang/shim .nox/test-sglang-0-5-23/bin/python \\
        benchmarks/sglang_alloc.py [--repeats 15] [--iters 200] [--json F]

Workloads, each one cycle per iteration:

``extend``  one prefill batch (8 requests x 300 new tokens) through ``alloc_extend``, then
            ``free`` of every request's tokens;
``decode``  32 running requests, 16 decode steps through ``alloc_decode`` (each request
            crosses a page boundary once), then ``free``;
``token``   ``page_size=1``: ``alloc(64)`` then ``free``.

Numbers are medians over ``--repeats`` timed runs of ``--iters`` cycles, after a warm-up;
the two sides alternate run by run, on one torch thread. On CPU both sides' cost is mostly
SGLang's own index arithmetic (its torch fallback of the Triton kernel) and, for upstream,
``torch.cat`` of the whole free list on every free; kvcore's share is the ledger calls, one
exact new-page count per allocation and the list<->tensor conversions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

PAGE = 16
SIZE = 1 << 16  # tokens
HEADS, HEAD_DIM, LAYERS = 8, 128, 4
KVCORE = {"backend": "host", "reserve_min": 8, "reserve_max": 32}


def _stack(elastic: bool, page_size: int) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def pool() -> Any:
        return MHATokenToKVPool(
            size=SIZE,
            page_size=page_size,
            dtype=torch.bfloat16,
            head_num=HEADS,
            head_dim=HEAD_DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )

    def allocator(p: Any) -> Any:
        if page_size == 1:
            return TokenToKVPoolAllocator(SIZE, torch.bfloat16, "cpu", p, False)
        return PagedTokenToKVPoolAllocator(SIZE, page_size, torch.bfloat16, "cpu", p, False)

    if not elastic:
        p = pool()
        return allocator(p), None
    from kvcore.adapters.sglang import ElasticScope

    scope = ElasticScope(KVCORE)
    with scope:
        p = pool()
    return scope.allocator(allocator(p)), scope


def _extend_cycle(a: Any) -> None:
    n, new = 8, 300
    z = torch.zeros(n, dtype=torch.int64)
    s = torch.full((n,), new, dtype=torch.int64)
    out = a.alloc_extend(z, z, s, s, torch.full((n,), -1, dtype=torch.int64), n * new)
    a.free(out)


def _decode_cycle(a: Any) -> None:
    n = 32
    z = torch.zeros(n, dtype=torch.int64)
    seq = torch.full((n,), 8, dtype=torch.int64)
    first = a.alloc_extend(z, z, seq, seq, torch.full((n,), -1, dtype=torch.int64), n * 8)
    rows = [first]
    last = first.view(n, 8)[:, -1].clone()
    for _ in range(PAGE):
        seq = seq + 1
        out = a.alloc_decode(seq, seq, last)
        rows.append(out)
        last = out
    a.free(torch.cat(rows))


def _token_cycle(a: Any) -> None:
    a.free(a.alloc(64))


WORKLOADS: dict[str, tuple[int, Callable[[Any], None]]] = {
    "extend": (PAGE, _extend_cycle),
    "decode": (PAGE, _decode_cycle),
    "token": (1, _token_cycle),
}


def _time(a: Any, cycle: Callable[[Any], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        cycle(a)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import sglang

    torch.set_num_threads(1)  # the scheduler thread's view; no intra-op thread contention
    rows: list[dict[str, Any]] = []
    for name, (page_size, cycle) in WORKLOADS.items():
        stacks = {mode: _stack(mode == "elastic", page_size) for mode in ("upstream", "elastic")}
        times: dict[str, list[float]] = {"upstream": [], "elastic": []}
        for a, _ in stacks.values():
            _time(a, cycle, max(args.iters // 4, 1))  # warm-up (and the reserve fill)
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            for mode, (a, _) in stacks.items():
                times[mode].append(_time(a, cycle, args.iters))
        up, el = (statistics.median(times[m]) for m in ("upstream", "elastic"))
        rows.append(
            {"workload": name, "upstream_us": up * 1e6, "elastic_us": el * 1e6, "ratio": el / up}
        )
        for _, scope in stacks.values():
            if scope is not None:
                scope.close()

    table = Table(title=f"SGLang {sglang.__version__} allocator: elastic vs upstream (median)")
    for col in ("workload", "upstream us/cycle", "elastic us/cycle", "elastic / upstream"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["workload"], f"{r['upstream_us']:.1f}", f"{r['elastic_us']:.1f}", f"{r['ratio']:.2f}x"
        )
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sglang": sglang.__version__, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
