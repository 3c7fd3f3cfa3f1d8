"""Where the time of giving KV memory back goes: the release path, call by call.

An instance that finishes a burst gives its pages back on the page allocator's background
thread: ``LocalPageMapper.prepare_unmap`` (wait for the device, then per handle: unmap it,
map the zero page there, make that read-only) and ``commit_unmap`` (release each handle),
then the memory gate is told. The live handoff (``benchmarks/vllm_colocate.py --workload
handoff``) measures that path end to end in a serving engine; this script takes it apart on
the bare driver, for ``--gib`` of handles of each ``--page-mib`` laid out as an engine's
per-layer cache lays them (``--ranges`` virtual ranges, the released handles one contiguous
run in each):

* ``raw, per handle``: kvcore's call sequence made straight through ``cuda.bindings``
  (``RawCuda``), every call timed and summed by kind;
* ``raw, per run``: the same, with the unmaps and the read-only grants made once per
  contiguous run (a ``cuMemUnmap`` / ``cuMemSetAccess`` may span several mappings that
  tile the range exactly); the zero-page maps and the releases stay one per handle;
* ``kvcore``: ``LocalPageMapper.prepare_unmap`` + ``commit_unmap`` (no handle pool) over
  the same sizes, its backend wrapped to count and time each call by kind;
* ``allocator``: ``PageAllocator.release`` of every page id at once, as an engine whose
  requests all ended makes it, to the gate's ``release`` calls on the background thread:
  when the first bytes are given back (``first_ms``: what another instance waits for
  before it can map any of them) and when all of them are (``all_ms``);
* ``map``: what the receiving side pays per handle (take the zero page down, create, map,
  grant read-write), from the set-up of the raw runs.

Medians of ``--repeats``; milliseconds for the whole release, microseconds per handle.

    python3 -m benchmarks.vmm_release --gib 10 --page-mib 2 32 --commit <sha> \
        --json $OUT/release.json
    python3 -m benchmarks.vmm_release --backend host --gib 0.25   # CPU: the code runs

On the host backend (no GPU) the figures only say that the code works.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks import _provenance

MiB = 1 << 20
GiB = 1 << 30

PHASES = ("synchronize", "unmap", "map_zero", "set_access_ro", "release")
"""The release path's driver calls by kind, in the order they are made."""


class _Timer:
    """Sums wall time and counts per kind of call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - t0
            self.calls[kind] += 1


def _open_raw(backend: str) -> Any:
    from benchmarks.gpu_suite.common import HostRaw, RawCuda

    if backend == "cuda":
        return RawCuda(0)
    from kvcore.vmm import open_backend

    return HostRaw(open_backend("host", 0, device_bytes=4 * GiB))


class _RawCache:
    """``ranges`` reserved ranges of ``per_range`` handles of ``page`` bytes each, a zero
    handle of ``page`` bytes, built and torn down with raw driver calls."""

    def __init__(self, raw: Any, page: int, ranges: int, per_range: int) -> None:
        self.raw, self.page, self.per_range = raw, page, per_range
        self.size = page * per_range
        self.vas = [raw.reserve(self.size) for _ in range(ranges)]
        self.zero = raw.create(page)
        self.handles: list[Any] = []
        for va in self.vas:  # unbacked: the zero page everywhere, read-only
            for i in range(per_range):
                raw.map(va + i * page, page, self.zero)
            raw.set_access(va, self.size, read_only=True)

    def back(self, timer: _Timer) -> None:
        """The receiving side's path per handle: take the zero page down, create, map,
        grant read-write."""
        raw, page = self.raw, self.page
        self.handles = []
        for va in self.vas:
            for i in range(self.per_range):
                with timer.timed("unmap_zero"):
                    raw.unmap(va + i * page, page)
                with timer.timed("create"):
                    h = raw.create(page)
                self.handles.append(h)
                with timer.timed("map"):
                    raw.map(va + i * page, page, h)
                with timer.timed("set_access_rw"):
                    raw.set_access(va + i * page, page)

    def release_per_handle(self, timer: _Timer) -> None:
        raw, page = self.raw, self.page
        with timer.timed("synchronize"):
            raw.synchronize()
        for va in self.vas:
            for i in range(self.per_range):
                at = va + i * page
                with timer.timed("unmap"):
                    raw.unmap(at, page)
                with timer.timed("map_zero"):
                    raw.map(at, page, self.zero)
                with timer.timed("set_access_ro"):
                    raw.set_access(at, page, read_only=True)
        self._release(timer)

    def release_per_run(self, timer: _Timer) -> None:
        raw, page = self.raw, self.page
        with timer.timed("synchronize"):
            raw.synchronize()
        for va in self.vas:
            with timer.timed("unmap"):
                raw.unmap(va, self.size)
            for i in range(self.per_range):
                with timer.timed("map_zero"):
                    raw.map(va + i * page, page, self.zero)
            with timer.timed("set_access_ro"):
                raw.set_access(va, self.size, read_only=True)
        self._release(timer)

    def _release(self, timer: _Timer) -> None:
        for h in self.handles:
            with timer.timed("release"):
                self.raw.release(h)
        self.handles = []

    def close(self) -> None:
        """Take the zero mappings down one by one (they are the only ones left)."""
        raw, page = self.raw, self.page
        for va in self.vas:
            for i in range(self.per_range):
                raw.unmap(va + i * page, page)
            raw.free_reservation(va, self.size)
        raw.release(self.zero)


class _TimedBackend:
    """A ``VmmBackend`` proxy timing the calls the release path makes, by kind."""

    def __init__(self, inner: Any, timer: _Timer) -> None:
        self._inner, self.timer = inner, timer
        self.on = False
        self._zero: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _call(self, kind: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if not self.on:
            return fn(*args, **kw)
        with self.timer.timed(kind):
            return fn(*args, **kw)

    def synchronize(self) -> None:
        self._call("synchronize", self._inner.synchronize)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap", self._inner.unmap, va, size)

    def map(self, va: int, size: int, handle: Any) -> None:
        self._call("map_zero", self._inner.map, va, size, handle)

    def set_access(self, va: int, size: int, *, writable: bool = True) -> None:
        kind = "set_access_rw" if writable else "set_access_ro"
        self._call(kind, self._inner.set_access, va, size, writable=writable)

    def release(self, handle: Any) -> None:
        self._call("release", self._inner.release, handle)


class _GateClock:
    """An unlimited memory gate that notes when each ``release`` comes, in seconds of
    ``time.perf_counter``."""

    def __init__(self) -> None:
        from kvcore.budget.gate import UnlimitedGate

        self._gate = UnlimitedGate()
        self.released: list[tuple[float, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gate, name)

    def release(self, nbytes: int) -> None:
        self.released.append((time.perf_counter(), nbytes))
        self._gate.release(nbytes)


def _per_layer_cache(backend_name: str, page: int, ranges: int, per_range: int, timer: _Timer):
    from kvcore.memory.geometry import KVGeometry
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm import open_backend

    options = {"device_bytes": 4 * GiB} if backend_name == "host" else {}
    inner = open_backend(backend_name, 0, **options)
    backend = _TimedBackend(inner, timer)
    geo = KVGeometry(
        num_layers=ranges // 2 if ranges % 2 == 0 else ranges,
        kv_buffers=2 if ranges % 2 == 0 else 1,
        block_bytes=page,
        num_blocks=per_range,
        page_bytes=page,
        granularity=inner.granularity(),
        layout="per-layer",
    )
    return inner, backend, VirtualKVCache(backend, geo)  # type: ignore[arg-type]


def _kvcore_release(backend_name: str, page: int, ranges: int, per_range: int) -> _Timer:
    """``LocalPageMapper`` over a per-layer cache of ``ranges`` ranges: map ``per_range``
    page ids, then time ``prepare_unmap`` + ``commit_unmap`` of all of them."""
    from kvcore.memory.local_mapper import LocalPageMapper

    timer = _Timer()
    inner, backend, cache = _per_layer_cache(backend_name, page, ranges, per_range, timer)
    mapper = LocalPageMapper(cache, pool_pages=0)
    try:
        ids = list(range(per_range))
        mapper.map(ids)
        backend.on = True
        t0 = time.perf_counter()
        with timer.timed("prepare_unmap"):
            mapper.prepare_unmap(ids)
        with timer.timed("commit_unmap"):
            mapper.commit_unmap(ids)
        timer.seconds["total"] = time.perf_counter() - t0
        backend.on = False
    finally:
        mapper.close()
        cache.close()
        inner.close()
    return timer


def _allocator_release(
    backend_name: str, page: int, ranges: int, per_range: int
) -> dict[str, float]:
    """``PageAllocator`` (background thread, no reserve, no handle pool) over the same
    cache: acquire every page id, release them all in one call, wait until the gate has
    every byte back."""
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.pages import PageAllocator

    inner, _, cache = _per_layer_cache(backend_name, page, ranges, per_range, _Timer())
    mapper = LocalPageMapper(cache, pool_pages=0)
    gate = _GateClock()
    pages = PageAllocator(mapper, gate, charge_fixed_bytes=False)  # type: ignore[arg-type]
    try:
        ids = pages.acquire(per_range)
        assert ids is not None, "the unlimited gate refused nothing"
        freed = per_range * mapper.page_bytes
        t0 = time.perf_counter()
        pages.release(ids)
        deadline = t0 + 120.0
        while sum(n for _, n in gate.released) < freed and time.perf_counter() < deadline:
            time.sleep(0.0005)
        if sum(n for _, n in gate.released) < freed:
            raise RuntimeError("the allocator did not give every byte back within 120 s")
        return {
            "first_ms": (gate.released[0][0] - t0) * 1e3,
            "all_ms": (gate.released[-1][0] - t0) * 1e3,
            "gate_releases": len(gate.released),
        }
    finally:
        pages.close()
        mapper.close()
        cache.close()
        inner.close()


def _summary(timers: list[_Timer], handles: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds:
        secs = [t.seconds.get(kind, 0.0) for t in timers]
        ms = statistics.median(secs) * 1e3
        out[kind] = {
            "ms": round(ms, 3),
            "us_per_handle": round(ms * 1e3 / handles, 3),
            "calls": timers[0].calls.get(kind, 0),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    raw = _open_raw(args.backend)
    results: list[dict[str, Any]] = []
    try:
        for page_mib in args.page_mib:
            page = int(page_mib * MiB)
            handles = int(args.gib * GiB) // page
            ranges = min(args.ranges, handles)
            per_range = handles // ranges
            handles = per_range * ranges
            back, per_handle, per_run, kv, alloc = [], [], [], [], []
            run_error = None
            for _ in range(args.repeats):
                cache = _RawCache(raw, page, ranges, per_range)
                try:
                    t_back = _Timer()
                    cache.back(t_back)
                    back.append(t_back)
                    t = _Timer()
                    cache.release_per_handle(t)
                    t.seconds["total"] = sum(t.seconds[k] for k in PHASES)
                    per_handle.append(t)
                    if run_error is None:
                        cache.back(_Timer())
                        t = _Timer()
                        try:
                            cache.release_per_run(t)
                            t.seconds["total"] = sum(t.seconds[k] for k in PHASES)
                            per_run.append(t)
                        except Exception as exc:  # the driver refused a spanning call
                            run_error = f"{type(exc).__name__}: {exc}"
                            cache.release_per_handle(_Timer())
                finally:
                    cache.close()
                kv.append(_kvcore_release(args.backend, page, ranges, per_range))
                alloc.append(_allocator_release(args.backend, page, ranges, per_range))
            kinds = (*PHASES, "total")
            row = {
                "page_bytes": page,
                "handles": handles,
                "ranges": ranges,
                "raw_per_handle": _summary(per_handle, handles, kinds),
                "raw_per_run": _summary(per_run, handles, kinds) if per_run else None,
                "raw_per_run_error": run_error,
                "kvcore": _summary(kv, handles, (*kinds, "prepare_unmap", "commit_unmap")),
                "allocator": {
                    k: round(statistics.median(a[k] for a in alloc), 3) for k in alloc[0]
                },
                "map": _summary(back, handles, ("unmap_zero", "create", "map", "set_access_rw")),
            }
            results.append(row)
            _print_row(row)
    finally:
        raw.close()
    return {
        "benchmark": "vmm_release",
        "commit": args.commit or _provenance.commit("kvcore", "benchmarks/vmm_release.py"),
        "date": _provenance.now(),
        "backend": args.backend,
        "gib": args.gib,
        "repeats": args.repeats,
        "results": results,
    }


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['handles']} handles of {row['page_bytes'] // MiB} MiB in {row['ranges']} ranges",
        flush=True,
    )
    for name in ("raw_per_handle", "raw_per_run", "kvcore", "map"):
        fig = row[name]
        if fig is None:
            print(f"  {name:15s} failed: {row['raw_per_run_error']}")
            continue
        parts = ", ".join(
            f"{k} {v['ms']:.1f} ms ({v['us_per_handle']:.1f} us/h, {v['calls']} calls)"
            for k, v in fig.items()
        )
        print(f"  {name:15s} {parts}", flush=True)
    a = row["allocator"]
    print(
        f"  {'allocator':15s} first bytes back {a['first_ms']:.1f} ms, all {a['all_ms']:.1f} ms "
        f"({a['gate_releases']:.0f} gate releases)",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.vmm_release",
        description="Time the release path of KV pages call by call (module docstring).",
    )
    p.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    p.add_argument("--gib", type=float, default=10.0, help="memory released (default 10)")
    p.add_argument(
        "--page-mib", type=float, nargs="+", default=[2.0], help="handle sizes (default 2)"
    )
    p.add_argument(
        "--ranges",
        type=int,
        default=32,
        help="virtual ranges the handles are spread over (a per-layer cache's layers x "
        "buffers; default 32)",
    )
    p.add_argument("--repeats", type=int, default=3)
    _provenance.add_output_options(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _provenance.write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
