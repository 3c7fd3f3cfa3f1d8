"""Step ``vmm``, figure (a): per-operation cost of the five VMM calls, kvcore's backend vs raw."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from benchmarks.gpu_suite.common import (
    MiB,
    Suite,
    close_all,
    median,
    open_kv_backend,
    percentile,
    raw_api,
    raw_label,
    size_text,
)

VMM_OPS = ("create", "map", "set_access", "unmap", "release")


def _vmm_cycle(api: Any, va: int, size: int, kvcore: bool) -> dict[str, int]:
    """One create -> map -> set-access -> unmap -> release at ``va``; ns per operation."""
    clock = time.perf_counter_ns
    t0 = clock()
    h = api.create(size)
    t1 = clock()
    api.map(va, size, h)
    t2 = clock()
    if kvcore:
        api.set_access(va, size, writable=True)
    else:
        api.set_access(va, size)
    t3 = clock()
    api.unmap(va, size)
    t4 = clock()
    api.release(h)
    t5 = clock()
    return {
        "create": t1 - t0,
        "map": t2 - t1,
        "set_access": t3 - t2,
        "unmap": t4 - t3,
        "release": t5 - t4,
    }


def step_vmm(suite: Suite) -> dict[str, Any]:
    backend = open_kv_backend(suite)
    raw = raw_api(suite)
    details: dict[str, Any] = {"backend": backend.name, "raw": type(raw).__name__, "sizes": {}}
    try:
        for size in suite.sizes.vmm_sizes:
            if suite.expired(20):
                details["truncated"] = f"budget: stopped before {size_text(size)}"
                break
            reps = suite.sizes.vmm_reps(size)
            warm = max(3, reps // 10)
            va_k = backend.reserve(size)
            va_r = raw.reserve(size)
            samples: dict[str, dict[str, list[int]]] = {"kvcore": {}, "raw": {}}
            try:
                for i in range(warm + reps):
                    order = ("kvcore", "raw") if i % 2 == 0 else ("raw", "kvcore")
                    for impl in order:
                        if impl == "kvcore":
                            ns = _vmm_cycle(backend, va_k, size, kvcore=True)
                        else:
                            ns = _vmm_cycle(raw, va_r, size, kvcore=False)
                        if i >= warm:
                            for op, t in ns.items():
                                samples[impl].setdefault(op, []).append(t)
                    if suite.expired(10):
                        break
            finally:  # after a failed cycle a mapping may remain: keep the first error
                with contextlib.suppress(Exception):
                    backend.free_reservation(va_k, size)
                with contextlib.suppress(Exception):
                    raw.free_reservation(va_r, size)
            per = {}
            label = size_text(size)
            for op in (*VMM_OPS, "cycle"):
                if op == "cycle":
                    k = [
                        sum(v) for v in zip(*(samples["kvcore"][o] for o in VMM_OPS), strict=False)
                    ]
                    r = [
                        sum(v)
                        for v in zip(*(samples["raw"].get(o, []) for o in VMM_OPS), strict=False)
                    ]
                else:
                    k, r = samples["kvcore"][op], samples["raw"].get(op, [])
                ours = median(k) / 1e3
                base = median(r) / 1e3 if r else None
                rec = suite.figure(
                    "a",
                    f"{op} {label}",
                    ours,
                    base,
                    "us",
                    ours_label=f"kvcore {backend.name} backend",
                    baseline_label=raw_label(suite),
                    goal="<= 1.1x raw",
                    limit=1.1,
                    note=(
                        f"median of {len(k)}; p90 ours {percentile(k, 0.9) / 1e3:.1f} us"
                        + (f", raw {percentile(r, 0.9) / 1e3:.1f} us" if r else "")
                        + f"; per 2 MiB: {ours * 2 * MiB / size:.3g} us"
                    ),
                )
                per[op] = {"ours_us": rec["ours"], "raw_us": rec["baseline"], "n": len(k)}
            details["sizes"][label] = per
    finally:
        close_all(backend, raw)
    return details
