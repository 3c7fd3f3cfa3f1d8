"""The page thread beside a busy engine thread: the GIL convoy and the shortened interval.

The page allocator's background thread maps the reserve and unmaps what an engine gave back
with one driver call per handle and step (``kvcore.memory.switch_interval``); each call
lets go of the GIL and takes it back. Beside an engine thread running Python, taking it
back waits up to the interpreter's switch interval (5 ms by default). This script measures
that on a per-layer cache laid out as an engine's (``--layers`` x 2 ranges, one handle of
``--page-mib`` per range and page id), with the allocator's ``switch_interval`` set to each
of ``--switch-us`` (0: the interpreter's own interval, what kvcore did before), and for
each of two loads on another thread of the same process:

* ``idle``: nothing else runs (the floor);
* ``busy``: a thread runs a Python loop without pause, as SGLang's scheduler polls for
  requests while idle and as any scheduler runs while it builds a batch.

And for three pieces of work, two of the page thread's and one of the engine's:

* ``give back``: ``--pages`` page ids in use are released at once with no reserve (an
  engine's cache flushed, or every request ended): the time until every one is unmapped;
* ``map ahead``: a new allocator with a reserve of ``--pages`` pages: the time until the
  background thread has mapped them;
* ``map here``: ``acquire`` of ``--pages`` pages with no reserve, mapped on the calling
  thread, as a scheduler maps a page it needs (the busy thread is then another thread of
  the engine, e.g. vLLM's output thread).

Beside each time, the busy thread's loop count per second during the work, as a ratio of
its count in the 0.3 s just before (the page thread idle), and the time that ratio loses
over the work (``(1 - ratio) x busy time``): what the page thread's work costs the
engine's thread, at either interval. Medians of ``--repeats``. ``--json`` is rewritten
after each row (``complete`` false until the last), so a run its timeout stops keeps the
rows it finished.

    python3 -m benchmarks.background_convoy --backend cuda --json $OUT/convoy.json
    python3 -m benchmarks.background_convoy                    # host backend, CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks import _provenance

MiB = 1 << 20
WORKS = ("give back", "map ahead", "map here")
LOADS = ("idle", "busy")


class _Spinner:
    """Another thread running a Python loop without pause (the ``busy`` load): how many
    loops it makes per second, over a window the caller marks."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._spin, name="busy-engine", daemon=True)

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> _Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()

    @contextmanager
    def window(self, out: dict[str, float]) -> Iterator[None]:
        """Count the loops made inside the block into ``out["loops_per_s"]``."""
        c0, t0 = self.count, time.perf_counter()
        try:
            yield
        finally:
            out["loops_per_s"] = (self.count - c0) / max(time.perf_counter() - t0, 1e-9)


def _stack(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Backend, per-layer virtual cache and mapper (no handle pool: every unmap releases)."""
    from kvcore.memory.geometry import KVGeometry
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm import open_backend

    page = int(args.page_mib * MiB)
    ranges = 2 * args.layers
    options: dict[str, Any] = {}
    if args.backend == "host":  # lazy memory: nothing is touched but the zero page
        options = {"device_bytes": (args.pages * ranges + 64) * page, "granularity": page}
    backend = open_backend(args.backend, 0, **options)
    geo = KVGeometry(
        num_layers=args.layers,
        kv_buffers=2,
        block_bytes=page,
        num_blocks=args.pages,
        page_bytes=page,
        granularity=backend.granularity(),
        layout="per-layer",
    )
    cache = VirtualKVCache(backend, geo)
    return backend, cache, LocalPageMapper(cache, pool_pages=0)


def _give_back(mapper: Any, pages: int, switch_s: float | None, run: Callable[..., Any]) -> float:
    """Seconds from releasing ``pages`` page ids in use to the last one unmapped."""
    from kvcore.memory.pages import PageAllocator

    alloc = PageAllocator(mapper, switch_interval=switch_s)
    try:
        ids = alloc.acquire(pages)
        assert ids is not None and len(ids) == pages, "the pages could not be mapped"
        took = float(run(lambda: alloc.release(ids), lambda: alloc.flush(timeout=600.0)))
        if alloc.stats().mapped:
            raise RuntimeError(f"{alloc.stats().mapped} pages still mapped after the give-back")
        return took
    finally:
        alloc.close()


def _map_ahead(mapper: Any, pages: int, switch_s: float | None, run: Callable[..., Any]) -> float:
    """Seconds from an allocator asked to keep ``pages`` pages mapped to all of them mapped."""
    from kvcore.memory.pages import PageAllocator

    made: list[Any] = []

    def start() -> None:
        made.append(
            PageAllocator(
                mapper,
                reserve_min=pages,
                reserve_max=pages,
                refill_batch=pages,
                switch_interval=switch_s,
            )
        )

    try:
        took = float(run(start, lambda: made[0].flush(timeout=600.0)))
        if made[0].stats().reserved != pages:
            raise RuntimeError(f"{made[0].stats().reserved} of {pages} pages mapped ahead")
        return took
    finally:
        for alloc in made:
            alloc.close()


def _map_here(mapper: Any, pages: int, switch_s: float | None, run: Callable[..., Any]) -> float:
    """Seconds for ``acquire(pages)`` with no reserve: mapped on this thread, as an engine's
    scheduler maps a page it needs at once (the busy thread is then the other one)."""
    from kvcore.memory.pages import PageAllocator

    alloc = PageAllocator(mapper, switch_interval=switch_s)
    got: list[Any] = []
    try:
        took = float(run(lambda: got.append(alloc.acquire(pages)), lambda: True))
        if got[0] is None or len(got[0]) != pages:
            raise RuntimeError("the pages could not be mapped")
        return took
    finally:
        alloc.close()


def _measure(
    work: Callable[..., float], mapper: Any, args: argparse.Namespace, switch_s: float | None
) -> dict[str, float]:
    """One run of ``work`` per load; seconds, and the busy loop's rate during it."""
    out: dict[str, float] = {}

    def timed(start: Callable[[], None], wait: Callable[[], bool]) -> float:
        t0 = time.perf_counter()
        start()
        if not wait():
            raise RuntimeError("the page thread did not finish within 600 s")
        return time.perf_counter() - t0

    out["idle_s"] = work(mapper, args.pages, switch_s, timed)
    with _Spinner() as spinner:
        time.sleep(0.05)
        alone: dict[str, float] = {}
        with spinner.window(alone):  # its pace just before, with the page thread idle
            time.sleep(0.3)
        rate: dict[str, float] = {}
        with spinner.window(rate):
            out["busy_s"] = work(mapper, args.pages, switch_s, timed)
    out["busy_loop_ratio"] = rate["loops_per_s"] / alone["loops_per_s"]
    return out


def run(
    args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Every row of ``--switch-us`` x ``WORKS``; the results (``complete`` true). After each
    row, ``on_row`` gets the results so far (``complete`` false): a run cut short by a
    timeout keeps the rows it finished."""
    backend, cache, mapper = _stack(args)
    handles = args.pages * 2 * args.layers
    rows: list[dict[str, Any]] = []
    results = {
        "benchmark": "background_convoy",
        "commit": args.commit or _provenance.commit("kvcore", "benchmarks/background_convoy.py"),
        "date": _provenance.now(),
        "backend": args.backend,
        "layers": args.layers,
        "page_bytes": int(args.page_mib * MiB),
        "repeats": args.repeats,
        "default_switch_interval_s": sys.getswitchinterval(),
        "complete": False,
        "results": rows,
    }
    try:
        for us in args.switch_us:
            switch_s = us * 1e-6 if us else None
            for name, work in zip(WORKS, (_give_back, _map_ahead, _map_here), strict=True):
                runs = [_measure(work, mapper, args, switch_s) for _ in range(args.repeats)]
                row = {
                    "switch_us": us,
                    "work": name,
                    "pages": args.pages,
                    "handles": handles,
                    "idle_ms": 1e3 * statistics.median(r["idle_s"] for r in runs),
                    "busy_ms": 1e3 * statistics.median(r["busy_s"] for r in runs),
                    "busy_loop_ratio": statistics.median(r["busy_loop_ratio"] for r in runs),
                }
                row["busy_us_per_handle"] = row["busy_ms"] * 1e3 / handles
                row["busy_lost_ms"] = statistics.median(
                    1e3 * r["busy_s"] * max(0.0, 1 - r["busy_loop_ratio"]) for r in runs
                )
                rows.append(row)
                _print_row(row)
                if on_row is not None:
                    on_row(results)
    finally:
        mapper.close()
        cache.close()
        backend.close()
    results["complete"] = True
    return results


def _print_row(row: dict[str, Any]) -> None:
    interval = f"{row['switch_us']} us" if row["switch_us"] else "interpreter's"
    print(
        f"switch {interval:>13s}  {row['work']:9s}  {row['pages']} pages "
        f"({row['handles']} handles): idle {row['idle_ms']:8.1f} ms, beside a busy thread "
        f"{row['busy_ms']:8.1f} ms ({row['busy_us_per_handle']:.0f} us/handle), the busy "
        f"thread at {row['busy_loop_ratio']:.2f}x its pace alone ({row['busy_lost_ms']:.0f} "
        f"ms lost)",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.background_convoy",
        description="Time the page thread's driver work beside a thread running Python, "
        "with and without the shortened switch interval (module docstring).",
    )
    p.add_argument("--backend", choices=("cuda", "host"), default="host")
    p.add_argument(
        "--layers", type=int, default=28, help="layers of the cache (x 2 ranges; default 28)"
    )
    p.add_argument("--pages", type=int, default=16, help="page ids given back or mapped")
    p.add_argument("--page-mib", type=float, default=2.0, help="handle size (default 2)")
    p.add_argument(
        "--switch-us",
        type=int,
        nargs="+",
        default=[0, 50],
        help="the allocator's switch_interval in microseconds; 0: the interpreter's own "
        "(default: 0 50)",
    )
    p.add_argument("--repeats", type=int, default=3)
    _provenance.add_output_options(p)
    args = p.parse_args(argv)
    if args.layers < 1 or args.pages < 1 or args.repeats < 1:
        p.error("--layers, --pages and --repeats must be at least 1")
    if any(us < 0 for us in args.switch_us):
        p.error("--switch-us takes microseconds >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args, lambda so_far: _provenance.write_json(so_far, args.json, announce=False))
    _provenance.write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
