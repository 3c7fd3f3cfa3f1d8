"""Block-ledger allocation cost on CPU, and driver calls on the allocating thread.

Issue 3's must-show figures: ``BlockLedger.alloc(16)`` + ``free`` per block with the page
reserve warm (goal <= 2 us per block), and the number of driver calls the allocating thread
makes in a steady alloc/free loop (goal 0).

The stack is the real one: the ``host`` backend (memfd + mmap) wrapped in a
``FaultInjector`` that counts driver calls per thread, ``VirtualKVCache``,
``LocalPageMapper``, ``PageAllocator`` with a warm reserve, ``BlockLedger``. Side by side in
the same run, the same loop on a plain Python free list (the shape of an engine's static
block pool: pop 16 ids, push them back) gives the ratio, so the figure carries over between
machines. Each geometry is a different blocks-per-page count: 16 (one page per alloc(16)),
64 (a page every fourth call) and 4 (four pages per call; large compound-layout models).

    python -m benchmarks.ledger_alloc [--repeats 15] [--iters 2000] [--json F]

Numbers are medians over ``--repeats`` timed runs of ``--iters`` alloc(16)+free cycles each,
after a warm-up run. ``--batch N`` allocates and frees N blocks per call instead (an SGLang
prefill asks for ~150 at once): the bulk paths, whose per-id cost should fall as N grows.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvcore.memory.blocks import BlockLedger
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.vmm.faults import FaultInjector
from kvcore.vmm.host import HostBackend

GRANULARITY = 2 << 20
_MEASURED = (  # the files whose code this benchmark times ("+dirty" if any is modified)
    "benchmarks/ledger_alloc.py",
    "kvcore/memory/blocks.py",
    "kvcore/memory/pages.py",
    "kvcore/memory/virtual_cache.py",
    "kvcore/memory/geometry.py",
    "kvcore/budget/gate.py",
    "kvcore/vmm",
)
BATCH = 16


def _geometry(blocks_per_page: int, num_blocks: int) -> KVGeometry:
    # compound layout, 2 layers x K/V: a block row is 4 x block_bytes
    row = GRANULARITY // blocks_per_page
    return KVGeometry(
        num_layers=2,
        kv_buffers=2,
        block_bytes=row // 4,
        num_blocks=num_blocks,
        page_bytes=GRANULARITY,
        granularity=GRANULARITY,
        layout="compound",
    )


def _time_loop(
    alloc: Any, free: Any, iters: int, held: collections.deque[list[int]], batch: int = BATCH
) -> tuple[float, float]:
    """Wall and thread-CPU seconds for ``iters`` cycles of alloc(batch) + free. With
    allocations ``held`` (a rolling working set: partly used pages, pages emptied out of
    order) each cycle frees the oldest held allocation instead of its own."""
    wall, cpu = time.perf_counter(), time.thread_time()
    if held:
        for _ in range(iters):
            held.append(alloc(batch))
            free(held.popleft())
    else:
        for _ in range(iters):
            free(alloc(batch))
    return time.perf_counter() - wall, time.thread_time() - cpu


class _FreeList:
    """The baseline: an engine's static block pool reduced to its list operations."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    def alloc(self, n: int) -> list[int]:
        ids = self.free_ids[-n:]
        del self.free_ids[-n:]
        return ids

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)


def measure(
    blocks_per_page: int, window: int, repeats: int, iters: int, batch: int = BATCH
) -> dict[str, Any]:
    """One geometry and pattern: ledger and free-list medians (us per block allocated and
    freed) and driver/mapper-call counts of the timed runs."""
    pages_per_batch = -(-batch // blocks_per_page)
    num_blocks = blocks_per_page * max(64, (window + 2) * pages_per_batch)
    geometry = _geometry(blocks_per_page, num_blocks)
    # min = one batch, max = two: a steady loop never needs the driver at all
    reserve_min, reserve_max = pages_per_batch, 2 * pages_per_batch
    vmm = FaultInjector(
        HostBackend(device_bytes=(geometry.num_pages + 1) * GRANULARITY, granularity=GRANULARITY)
    )
    cache = VirtualKVCache(vmm, geometry)
    mapper = LocalPageMapper(cache)
    pages = PageAllocator(mapper, reserve_min=reserve_min, reserve_max=reserve_max)
    ledger = BlockLedger(geometry, pages)
    baseline = _FreeList(num_blocks)
    ours_held: collections.deque[list[int]] = collections.deque()
    plain_held: collections.deque[list[int]] = collections.deque()
    try:
        pages.flush()
        for _ in range(window):  # the rolling working set, set up outside the counts
            got = ledger.alloc(batch)
            assert got is not None
            ours_held.append(got)
            plain_held.append(baseline.alloc(batch))
        _time_loop(ledger.alloc, ledger.free, iters, ours_held, batch)  # warm-up
        _time_loop(baseline.alloc, baseline.free, iters, plain_held, batch)
        pages.flush()
        me = threading.get_ident()
        vmm.reset_counts()
        before = pages.stats()
        ours: list[tuple[float, float]] = []
        plain: list[tuple[float, float]] = []
        for _ in range(repeats):  # interleaved, so both see the same machine state
            ours.append(_time_loop(ledger.alloc, ledger.free, iters, ours_held, batch))
            plain.append(_time_loop(baseline.alloc, baseline.free, iters, plain_held, batch))
        after = pages.stats()
        driver_calls_here = vmm.calls(thread=me)
        driver_calls_total = vmm.calls()
    finally:
        pages.close()
        mapper.close()
        cache.close()
    per_block = 1e6 / (iters * batch)

    def med(runs: list[tuple[float, float]], i: int) -> float:
        return round(statistics.median(r[i] for r in runs) * per_block, 4)

    return {
        "blocks_per_page": blocks_per_page,
        "batch": batch,
        "pattern": f"window {window}" if window else "same blocks",
        "pages_per_alloc": pages_per_batch,
        "reserve_min_max": [reserve_min, reserve_max],
        "ledger_us_per_block_cpu": med(ours, 1),
        "ledger_us_per_block_wall": med(ours, 0),
        "free_list_us_per_block_cpu": med(plain, 1),
        "free_list_us_per_block_wall": med(plain, 0),
        "ratio_cpu": round(med(ours, 1) / max(med(plain, 1), 1e-9), 1),
        "cycles": repeats * iters,
        "driver_calls_allocating_thread": driver_calls_here,
        "driver_calls_all_threads": driver_calls_total,
        "mapper_calls_allocating_thread": after.caller_mapper_calls - before.caller_mapper_calls,
        "mapper_calls_refill_thread": after.refill_mapper_calls - before.refill_mapper_calls,
    }


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *_MEASURED], capture_output=True, text=True
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--blocks-per-page", type=int, nargs="+", default=[16, 64, 4])
    parser.add_argument(
        "--window", type=int, default=8, help="outstanding allocations of the rolling pattern"
    )
    parser.add_argument(
        "--batch", type=int, default=BATCH, help="blocks per alloc (and per free) call"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    rows = [
        measure(bpp, window, args.repeats, args.iters, args.batch)
        for bpp in args.blocks_per_page
        for window in (0, args.window)
    ]
    result = {
        "benchmark": "ledger_alloc",
        "command": "python -m benchmarks.ledger_alloc " + " ".join(argv or sys.argv[1:]),
        "commit": _commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()} "
        f"{os.cpu_count()} cpus, Python {platform.python_version()}",
        "load_average": os.getloadavg(),
        "goal_us_per_block": 2.0,
        "rows": rows,
    }
    table = Table(title=f"BlockLedger alloc({args.batch}) + free, reserve warm (medians, us/block)")
    for col in (
        "blocks /page",
        "pattern",
        "ledger cpu",
        "ledger wall",
        "free list cpu",
        "ratio cpu",
        "driver calls alloc thread",
        "driver calls all threads",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["blocks_per_page"]),
            r["pattern"],
            f"{r['ledger_us_per_block_cpu']:.3f}",
            f"{r['ledger_us_per_block_wall']:.3f}",
            f"{r['free_list_us_per_block_cpu']:.3f}",
            f"{r['ratio_cpu']:.0f}x",
            str(r["driver_calls_allocating_thread"]),
            str(r["driver_calls_all_threads"]),
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    worst = max(r["ledger_us_per_block_cpu"] for r in rows)
    calls = sum(r["driver_calls_allocating_thread"] for r in rows)
    print(f"worst {worst:.3f} us/block (goal <= 2); allocating-thread driver calls: {calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
