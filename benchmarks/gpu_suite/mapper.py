"""Step ``mapper``, figure (a): one page id mapped and unmapped by ``LocalPageMapper`` vs the
same driver calls made raw."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from benchmarks.gpu_suite.common import (
    RawCuda,
    Suite,
    close_all,
    kv_cache,
    kv_geometry,
    kv_mapper,
    median,
    open_kv_backend,
    raw_api,
    size_text,
)


def _count_mapper_calls(suite: Suite, layout: str, page_bytes: int, num_blocks: int) -> dict:
    """Driver calls of one ``map([p])`` and one ``prepare_unmap + commit_unmap`` after a
    warm-up cycle (so the handle pool is primed, as in the timed loop), counted through
    ``FaultInjector`` on a separate cache so the timing stays clean."""
    from kvcore.vmm.faults import FaultInjector

    fi = FaultInjector(open_kv_backend(suite))
    cache = mapper = None
    try:
        cache = kv_cache(fi, kv_geometry(fi, suite.sizes.shape, num_blocks, page_bytes, layout))
        mapper = kv_mapper(cache)
        kinds = ("create", "map", "set_access", "unmap", "release", "synchronize")
        counts: dict[str, dict[str, int]] = {}
        for _ in range(2):
            fi.reset_counts()
            mapper.map([0])
            counts["map"] = {k: fi.calls(k) for k in kinds if fi.calls(k)}
            fi.reset_counts()
            mapper.prepare_unmap([0])
            mapper.commit_unmap([0])
            counts["unmap"] = {k: fi.calls(k) for k in kinds if fi.calls(k)}
        return counts
    finally:
        close_all(mapper, cache, fi)


class RawPageMirror:
    """Raw ``cuda.bindings`` calls doing what ``LocalPageMapper`` does, over the same address
    layout as kvcore's cache: ``slots`` reservations (one per virtual range: 1 compound,
    layers x buffers per-layer) of ``num_pages`` page slots each, a read-only zero page at
    every unbacked slot, a pool of reused handles. ``map_page(p)``: in every range unmap
    zero + map handle + set access rw; ``unmap_page(p)``: synchronize, then in every range
    unmap + map zero + set access ro (the handle goes back to the pool). The same layout
    matters on a GPU: the driver's cost depends on the mappings around an address, so a
    one-page mirror would time cheaper calls than kvcore's cache makes."""

    def __init__(
        self, raw: RawCuda, slots: int, page_bytes: int, zero_bytes: int, num_pages: int = 1
    ) -> None:
        self.raw, self.slots, self.pb = raw, slots, page_bytes
        self.gran = zero_bytes  # the size of kvcore's zero page (VirtualKVCache.zero_page_bytes)
        self.size = num_pages * page_bytes
        self.vas: list[int] = []
        self.zero = None
        self.pool: list[Any] = []
        try:
            self.vas = [raw.reserve(self.size) for _ in range(slots)]
            self.zero = raw.create(self.gran)
            self.pool = [raw.create(page_bytes) for _ in range(slots)]
            for base in self.vas:
                for p in range(num_pages):
                    self._map_zero(base + p * page_bytes)
        except BaseException:
            self.close()
            raise

    read_only = True
    """False once the driver refused read-only access (kvcore's backend then maps the zero
    page read-write too)."""

    def _map_zero(self, va: int) -> None:
        for off in range(0, self.pb, self.gran):
            self.raw.map(va + off, self.gran, self.zero)
        if self.read_only:
            try:
                self.raw.set_access(va, self.pb, read_only=True)
                return
            except RuntimeError:
                self.read_only = False
        self.raw.set_access(va, self.pb)

    def map_page(self, page: int = 0) -> None:
        raw, pb, pool = self.raw, self.pb, self.pool
        off = page * pb
        for j, base in enumerate(self.vas):
            va = base + off
            raw.unmap(va, pb)
            raw.map(va, pb, pool[j])
            raw.set_access(va, pb)

    def unmap_page(self, page: int = 0) -> None:
        raw, pb = self.raw, self.pb
        off = page * pb
        raw.synchronize()
        for base in self.vas:
            va = base + off
            raw.unmap(va, pb)
            self._map_zero(va)

    def close(self) -> None:
        raw = self.raw
        for base in self.vas:
            with contextlib.suppress(Exception):
                raw.unmap(base, self.size)
        for h in [*self.pool, self.zero]:
            if h is not None:
                with contextlib.suppress(Exception):
                    raw.release(h)
        for base in self.vas:
            with contextlib.suppress(Exception):
                raw.free_reservation(base, self.size)
        self.vas, self.pool, self.zero = [], [], None


def step_mapper(suite: Suite) -> dict[str, Any]:
    shape = suite.sizes.shape
    details: dict[str, Any] = {}
    raw = raw_api(suite)
    try:
        for layout in ("compound", "per-layer"):
            if suite.expired(20):
                break
            page_bytes = suite.sizes.page_unit
            backend = open_kv_backend(suite)
            cache = mapper = mirror = None
            try:
                geo = kv_geometry(backend, shape, 1, page_bytes, layout)
                num_blocks = geo.blocks_per_page * 8
                geo = kv_geometry(backend, shape, num_blocks, page_bytes, layout)
                hpp = geo.handles_per_page
                counts = _count_mapper_calls(suite, layout, page_bytes, num_blocks)
                cache = kv_cache(backend, geo)
                mapper = kv_mapper(cache)
                mirror = RawPageMirror(raw, hpp, page_bytes, cache.zero_page_bytes, geo.num_pages)
                t_map: list[int] = []
                t_unmap: list[int] = []
                r_map: list[int] = []
                r_unmap: list[int] = []
                clock = time.perf_counter_ns
                for i in range(3 + suite.sizes.mapper_reps):
                    p = i % geo.num_pages
                    for impl in ("kvcore", "raw") if i % 2 == 0 else ("raw", "kvcore"):
                        t0 = clock()
                        if impl == "kvcore":
                            mapper.map([p])
                            t1 = clock()
                            mapper.prepare_unmap([p])
                            mapper.commit_unmap([p])
                        else:
                            mirror.map_page(p)
                            t1 = clock()
                            mirror.unmap_page(p)
                        t2 = clock()
                        if i >= 3:
                            (t_map if impl == "kvcore" else r_map).append(t1 - t0)
                            (t_unmap if impl == "kvcore" else r_unmap).append(t2 - t1)
                    if suite.expired(10):
                        break
                what = f"{layout}, {size_text(page_bytes)} pages, {hpp} handle(s) per page id"
                for name, ours, base in (("map", t_map, r_map), ("unmap", t_unmap, r_unmap)):
                    suite.figure(
                        "a",
                        f"LocalPageMapper {name} of 1 page id ({layout})",
                        median(ours) / 1e3,
                        median(base) / 1e3 if base else None,
                        "us",
                        ours_label="LocalPageMapper",
                        baseline_label="the same driver calls, raw",
                        goal="<= 1.1x raw",
                        limit=1.1,
                        note=f"{what}; driver calls per {name} (FaultInjector): {counts[name]}; "
                        "raw mirrors the zero page, handle pool and address layout (the same "
                        "ranges and page ids in turn)",
                    )
                details[layout] = {"handles_per_page": hpp, "driver_calls": counts}
            finally:
                close_all(mapper, cache, mirror, backend)
    finally:
        close_all(raw)
    return details
