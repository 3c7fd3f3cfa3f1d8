"""SGLang allocator cost, elastic (kvcore ledger) vs upstream, side by side in one CPU run.

Issue 7's figure: alloc/free cost of SGLang's own ``PagedTokenToKVPoolAllocator`` and
``TokenToKVPoolAllocator`` against kvcore's elastic subclasses (goal: elastic <= 1.1x
upstream). Both run in the same process on the same pool shape; the elastic one sits on the
real kvcore stack (``host`` backend at the GPU's 2 MiB granularity, ``VirtualKVCache``,
``LocalPageMapper``, ``PageAllocator`` with a warm reserve of 8 to 32 pages unless
``--reserve`` says otherwise, ``BlockLedger``); each row also counts the elastic side's
mapper calls in the timed cycles, on the calling thread and in background rounds. Needs the
kvcore fork of SGLang installed (``nox -s test-sglang-0.5.23`` builds such a venv under
``.nox/``)::

    PYTHONPATH=tests/engines/sglang/shim .nox/test-sglang-0-5-23/bin/python \\
        -m benchmarks.sglang_alloc [--repeats 31] [--iters 100] [--json F] [--device cuda] \\
        [--reserve MIN MAX] [--map-ahead N] [--switch-us US] [--profile DIR]

``--device cuda`` (the GPU machine, through ``benchmarks/sglang_device.sh run``) runs the same
cycles on a CUDA pool: SGLang's Triton index kernels on both sides, kvcore on its ``cuda``
backend; each timed run ends with a device synchronize, so a side's queued GPU work counts.

``--profile DIR`` then runs ``--iters`` more cycles of each side under ``torch.profiler`` and
writes ``DIR/<workload>-<side>.txt``: torch's table of the operators and, on CUDA, the CUDA
runtime calls (``cudaMemcpyAsync``, ``cudaEventRecord``, ``cudaHostAlloc``, ...) those cycles
made, by self CPU time, with call counts; dividing by ``--iters`` gives a cycle's calls.
Where the two sides' tables differ is what the elastic side pays per cycle that upstream does
not (the profiler adds its own cost per call: compare counts and the tables' ranks, not
these times with the timed runs').

Workloads, each one cycle per iteration:

``extend``  one prefill batch (8 requests x 300 new tokens) through ``alloc_extend``, then
            ``free`` of every request's tokens;
``extend-wide``  the same with 256 requests x 20 new tokens (more requests than the
            adapter counts new pages for in Python: SGLang's own count, as upstream);
``decode``  32 running requests, 16 decode steps through ``alloc_decode`` (each request
            crosses a page boundary once), then ``free``;
``token``   ``page_size=1``: ``alloc(64)`` then ``free``;
``saturated``  ``page_size=1`` at saturation, one scheduler iteration per cycle: a prefill
            batch of new requests (64-1,900 tokens, up to 4,096 in all) while room is left,
            one decode token for each running request, finished requests (16-128 tokens out)
            kept as cached, and the least recently finished evicted (their ids freed as one
            tensor, as SGLang's radix cache frees a leaf) whenever an allocation needs room.
            The pool stays full and its free ids scattered, as under SGLang's serving load;
            both sides run the same seeded trace.

The stacks are built by ``harness.sglang_kv.build`` (the conformance tests' builder), at
this pool shape. Numbers are medians over ``--repeats`` timed runs of ``--iters`` cycles,
after a warm-up; the two sides alternate run by run, on one torch thread. Each run is timed
on the wall clock and on the thread's CPU clock (``thread_time``: blind to time the machine
gave other processes); the ratio is the median of the per-repeat ratios of adjacent runs
(both sides under the same load). On CPU both sides' cost is mostly
SGLang's own index arithmetic (its torch fallback of the Triton kernel) and
``torch.unique`` on every free, plus, for upstream, ``torch.cat`` of the whole free list;
kvcore's share is the ledger calls and the list<->tensor conversions. Both sides count the
batch's new pages once per allocation (upstream after its kernel, kvcore before taking
blocks): SGLang's ``get_num_new_pages`` (eight torch calls) upstream, Python ints from the
same CPU lengths in kvcore's adapter up to 128 requests, SGLang's function above.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks._provenance import commit, now
from harness.sglang_kv import Engine, build

PAGE = 16
SIZE = 1 << 16  # tokens
HEADS, HEAD_DIM, LAYERS = 8, 128, 4
# the GPU's 2 MiB granularity (not the tests' 64 KiB), a warm reserve (``--reserve``)
KVCORE = {
    "backend_options": {"device_bytes": 8 << 30, "granularity": 2 << 20},
    "reserve_min": 8,
    "reserve_max": 32,
}


DEVICE = "cpu"
"""Where the pools live (``--device``)."""


def _stack(elastic: bool, page_size: int) -> Engine:
    kvcore = (
        KVCORE if DEVICE == "cpu" else {k: v for k, v in KVCORE.items() if k != "backend_options"}
    )
    return build(
        "on" if elastic else "off",
        size=SIZE,
        page_size=page_size,
        layers=LAYERS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        device=DEVICE,
        **kvcore,
    )


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """SGLang takes lengths and last locations on the pool's device and lengths on the host."""
    return t if DEVICE == "cpu" else t.to(DEVICE)


def _extend(a: Any, n: int, new: int) -> None:
    z = torch.zeros(n, dtype=torch.int64)
    s = torch.full((n,), new, dtype=torch.int64)
    last = _on_device(torch.full((n,), -1, dtype=torch.int64))
    out = a.alloc_extend(_on_device(z), z, _on_device(s), s, last, n * new)
    a.free(out)


def _extend_cycle(a: Any) -> None:
    _extend(a, 8, 300)


def _wide_extend_cycle(a: Any) -> None:
    _extend(a, 256, 20)


def _decode_cycle(a: Any) -> None:
    n = 32
    z = torch.zeros(n, dtype=torch.int64)
    seq = torch.full((n,), 8, dtype=torch.int64)
    minus = _on_device(torch.full((n,), -1, dtype=torch.int64))
    first = a.alloc_extend(_on_device(z), z, _on_device(seq), seq, minus, n * 8)
    rows = [first]
    last = first.view(n, 8)[:, -1].clone()
    for _ in range(PAGE):
        seq = seq + 1
        out = a.alloc_decode(_on_device(seq), seq, last)
        rows.append(out)
        last = out
    a.free(torch.cat(rows))


def _token_cycle(a: Any) -> None:
    a.free(a.alloc(64))


class _Serving:
    """The ``saturated`` workload's state for one allocator: running requests (their id
    tensors, tokens decoded, tokens to decode) and finished ones, least recent first."""

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.running: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        self.cached: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.next = 0

    def room(self, a: Any, n: int) -> bool:
        """Evict finished requests until ``n`` tokens are free; whether they are."""
        while a.available_size() < n and self.cached:
            a.free(self.cached.popitem(last=False)[1])
        return bool(a.available_size() >= n)


_SERVING: dict[Any, _Serving] = {}


def _saturated_cycle(a: Any) -> None:
    s = _SERVING.get(a) or _SERVING.setdefault(a, _Serving())  # built once per allocator
    rng, running = s.rng, s.running
    batch: list[int] = []
    while len(running) + len(batch) < 256:
        n = rng.randint(64, 1900)
        if sum(batch) + n > 4096:
            break
        batch.append(n)
    # room for the batch and for every running request's remaining decode tokens
    if batch and s.room(a, sum(batch) + 128 * (len(running) + len(batch))):
        ids = a.alloc(sum(batch))
        for n in batch:
            running[s.next] = ([ids[:n]], [0, rng.randint(16, 128)])
            ids = ids[n:]
            s.next += 1
    if running and s.room(a, len(running)):
        ids = a.alloc(len(running))
        for i, (rid, (parts, count)) in enumerate(list(running.items())):
            parts.append(ids[i : i + 1])
            count[0] += 1
            if count[0] == count[1]:
                s.cached[rid] = torch.cat(parts)
                del running[rid]


WORKLOADS: dict[str, tuple[int, Callable[[Any], None]]] = {
    "extend": (PAGE, _extend_cycle),
    "extend-wide": (PAGE, _wide_extend_cycle),
    "decode": (PAGE, _decode_cycle),
    "token": (1, _token_cycle),
    "saturated": (1, _saturated_cycle),
}


def _time(a: Any, cycle: Callable[[Any], None], iters: int) -> tuple[float, float]:
    """Wall and thread-CPU seconds per cycle."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        cycle(a)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return (time.perf_counter() - wall) / iters, (time.thread_time() - cpu) / iters


def _profile(a: Any, cycle: Callable[[Any], None], iters: int, out: Path) -> None:
    """``iters`` cycles of ``a`` under ``torch.profiler``; its operator table to ``out``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if DEVICE != "cpu":
        activities.append(ProfilerActivity.CUDA)  # the CUDA runtime calls, by name
    with profile(activities=activities) as prof:
        for _ in range(iters):
            cycle(a)
        if DEVICE != "cpu":
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{iters} cycles on {DEVICE}\n{table}\n")


LEDGER_CALLS = ("alloc_split", "free_tensor", "free", "free_range")
"""The ``BlockLedger`` methods ``--ledger-calls`` times: every way the adapters take ids
from the ledger and give them back."""


def _ledger_calls(a: Any, cycle: Callable[[Any], None], iters: int) -> dict[str, Any]:
    """``iters`` cycles of the elastic allocator ``a`` with ``LEDGER_CALLS`` timed: the
    cycle's us (``cycle_us``) and, per method called (``calls``), calls per cycle and us
    per call."""
    ledger = a.ledger
    seconds = dict.fromkeys(LEDGER_CALLS, 0.0)
    calls = dict.fromkeys(LEDGER_CALLS, 0)

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                calls[name] += 1

        return call

    for name in LEDGER_CALLS:  # instance attributes shadow the class's methods
        setattr(ledger, name, timed(name, getattr(ledger, name)))
    try:
        cycle_s = _time(a, cycle, iters)[0]
    finally:
        for name in LEDGER_CALLS:
            delattr(ledger, name)
    per_method = {
        name: {
            "calls_per_cycle": round(calls[name] / iters, 3),
            "us_per_call": round(seconds[name] / calls[name] * 1e6, 2),
        }
        for name in LEDGER_CALLS
        if calls[name]
    }
    return {"cycle_us": round(cycle_s * 1e6, 2), "calls": per_method}


def measure(name: str, page_size: int, cycle: Callable[[Any], None], args: Any) -> dict[str, Any]:
    """One workload, both sides in turn: medians (us per cycle) and paired ratios."""
    engines = {mode: _stack(mode == "elastic", page_size) for mode in ("upstream", "elastic")}
    runs: dict[str, list[tuple[float, float]]] = {"upstream": [], "elastic": []}
    try:
        for e in engines.values():
            _time(e.allocator, cycle, max(args.iters // 4, 1))  # warm-up (and the reserve fill)
        before = engines["elastic"].manager.stats()
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            for mode, e in engines.items():
                runs[mode].append(_time(e.allocator, cycle, args.iters))
        after = engines["elastic"].manager.stats()
        if args.profile:
            for mode, e in engines.items():
                _profile(e.allocator, cycle, args.iters, Path(args.profile) / f"{name}-{mode}.txt")
        ledger_calls = (
            _ledger_calls(engines["elastic"].allocator, cycle, args.iters)
            if args.ledger_calls
            else None
        )
    finally:
        for e in engines.values():
            if e.scope is not None:
                e.scope.close()
    # the mapper calls (each maps or unmaps pages: driver calls per slot) of the elastic
    # side in the timed cycles: on the calling (scheduler) thread, and in background rounds
    # (the reserve's refill and the unmaps)
    row: dict[str, Any] = {
        "workload": name,
        "cycles": args.repeats * args.iters,
        "elastic_caller_mapper_calls": after.caller_mapper_calls - before.caller_mapper_calls,
        "elastic_background_mapper_calls": after.refill_mapper_calls - before.refill_mapper_calls,
    }
    if ledger_calls is not None:
        row["elastic_ledger_calls"] = ledger_calls
    for i, clock in enumerate(("wall", "cpu")):
        up = [r[i] for r in runs["upstream"]]
        el = [r[i] for r in runs["elastic"]]
        row[f"upstream_us_{clock}"] = round(statistics.median(up) * 1e6, 2)
        row[f"elastic_us_{clock}"] = round(statistics.median(el) * 1e6, 2)
        row[f"ratio_{clock}"] = round(
            statistics.median(e / u for e, u in zip(el, up, strict=True)), 3
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS)
    )
    parser.add_argument(
        "--reserve",
        nargs=2,
        type=int,
        metavar=("MIN", "MAX"),
        default=[KVCORE["reserve_min"], KVCORE["reserve_max"]],
        help="the elastic side's reserve_min and reserve_max, in pages (0 0: the engines' "
        "default, every emptied page unmapped and every new one mapped on the calling thread)",
    )
    parser.add_argument(
        "--map-ahead",
        type=int,
        default=0,
        metavar="N",
        help="the elastic side's map_ahead, in pages (0, the engines' default: none)",
    )
    parser.add_argument(
        "--switch-us",
        type=int,
        default=None,
        metavar="US",
        help="the elastic side's background_switch_us (kvcore.memory.switch_interval; 0: "
        "the interpreter's own interval; default: kvcore's)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed runs, profile --iters cycles of each side into "
        "DIR/<workload>-<side>.txt",
    )
    parser.add_argument(
        "--ledger-calls",
        action="store_true",
        help="after the timed runs, time the elastic side's ledger calls over --iters cycles",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    KVCORE["reserve_min"], KVCORE["reserve_max"] = args.reserve
    KVCORE["map_ahead"] = args.map_ahead
    if args.switch_us is not None:
        KVCORE["background_switch_us"] = args.switch_us

    import sglang

    torch.set_num_threads(1)  # the scheduler thread's view; no intra-op thread contention
    rows = [measure(name, *WORKLOADS[name], args) for name in args.workloads]

    table = Table(
        title=f"SGLang {sglang.__version__} allocator on {DEVICE}, elastic vs upstream: medians of "
        f"{args.repeats} x {args.iters} cycles, wall | thread CPU"
    )
    for col in ("workload", "upstream us", "elastic us", "elastic / upstream",
                "mapper calls / 1k cycles, caller | background"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        per_k = 1000 / r["cycles"]
        table.add_row(
            r["workload"],
            f"{r['upstream_us_wall']:.1f} | {r['upstream_us_cpu']:.1f}",
            f"{r['elastic_us_wall']:.1f} | {r['elastic_us_cpu']:.1f}",
            f"{r['ratio_wall']:.3f}x | {r['ratio_cpu']:.3f}x",
            f"{r['elastic_caller_mapper_calls'] * per_k:.1f} | "
            f"{r['elastic_background_mapper_calls'] * per_k:.1f}",
        )
    console = Console()
    console.print(table)
    for r in rows:
        timed = r.get("elastic_ledger_calls")
        if timed is None:
            continue
        for method, got in timed["calls"].items():
            console.print(
                f"{r['workload']}: ledger.{method} {got['calls_per_cycle']:.2f} calls a cycle, "
                f"{got['us_per_call']:.1f} us a call (cycle {timed['cycle_us']:.1f} us)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "sglang": sglang.__version__,
                    "device": DEVICE,
                    "commit": commit("kvcore", "harness", "benchmarks/sglang_alloc.py"),
                    "date": now(),
                    "repeats": args.repeats,
                    "iters": args.iters,
                    "reserve": args.reserve,
                    "map_ahead": args.map_ahead,
                    "background_switch_us": KVCORE.get("background_switch_us"),
                    "results": rows,
                },
                f,
                indent=2,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
