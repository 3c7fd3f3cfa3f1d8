"""Python overhead of kvcore's VMM hot path, measured on CPU against a no-op CUDA driver.

The GPU suite's figure (a) compares kvcore's ``cuda`` backend and ``LocalPageMapper`` with
the same driver calls made raw through ``cuda.bindings`` (goal: <= 1.1x). On a GPU the
driver's own time dominates and hides what the Python layers add; here every driver
function is a stub that returns ``CUDA_SUCCESS`` at once, so each figure is *only* the
Python work around the call: kvcore's path and the raw path (the suite's ``RawCuda`` and
``RawPageMirror`` call sequence) timed side by side in one run, medians of interleaved
repetitions, in nanoseconds per operation. ``extra_ns`` (kvcore minus raw) is what kvcore
adds per call; divide by the GPU's raw time per call (suite figure (a)) for the ratio it
costs there.

    python -m benchmarks.vmm_python_overhead            # prints a table, --json for JSON

Without cuda-python installed the stub stands in for ``cuda.bindings.driver``; with it
installed the stub is still used (this script never touches a GPU).
"""

from __future__ import annotations

import argparse
import enum
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

MiB = 1 << 20


# --------------------------------------------------------------------------- the stub driver


def stub_driver() -> types.ModuleType:
    """A ``cuda.bindings.driver`` look-alike: the names kvcore's backend and the raw
    baseline use, every call a no-op returning ``(CUDA_SUCCESS, *values)`` (also the
    CPU tests' stand-in for the driver: ``tests/vmm/test_cuda_stub.py``)."""
    drv = types.ModuleType("cuda.bindings.driver")

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_NOT_SUPPORTED = 801

    class _Struct:
        def __init__(self) -> None:
            self.location = types.SimpleNamespace(type=0, id=0)

    class CUmemGenericAllocationHandle(int):
        pass

    ok = CUresult.CUDA_SUCCESS
    counter = iter(range(1, 1 << 62))
    names = {
        "CUmemLocationType": ["CU_MEM_LOCATION_TYPE_DEVICE"],
        "CUmemAllocationType": ["CU_MEM_ALLOCATION_TYPE_PINNED"],
        "CUdevice_attribute": ["CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"],
        "CUmemAllocationHandleType": [
            "CU_MEM_HANDLE_TYPE_NONE",
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
        ],
        "CUmemAllocationGranularity_flags": [
            "CU_MEM_ALLOC_GRANULARITY_MINIMUM",
            "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED",
        ],
        "CUmemAccess_flags": [
            "CU_MEM_ACCESS_FLAGS_PROT_READ",
            "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
        ],
    }
    for name, members in names.items():
        setattr(drv, name, enum.IntEnum(name, members))
    drv.CUresult = CUresult  # type: ignore[attr-defined]
    drv.CUmemLocation = lambda: types.SimpleNamespace(type=0, id=0)  # type: ignore[attr-defined]
    drv.CUmemAllocationProp = _Struct  # type: ignore[attr-defined]
    drv.CUmemAccessDesc = _Struct  # type: ignore[attr-defined]
    drv.cuInit = lambda flags: (ok,)  # type: ignore[attr-defined]
    drv.cuDeviceGet = lambda ordinal: (ok, ordinal)  # type: ignore[attr-defined]
    drv.cuDevicePrimaryCtxRetain = lambda dev: (ok, object())  # type: ignore[attr-defined]
    drv.cuDevicePrimaryCtxRelease = lambda dev: (ok,)  # type: ignore[attr-defined]
    drv.cuCtxSetCurrent = lambda ctx: (ok,)  # type: ignore[attr-defined]
    drv.cuCtxSynchronize = lambda: (ok,)  # type: ignore[attr-defined]
    drv.cuDeviceGetAttribute = lambda attr, dev: (ok, 1)  # type: ignore[attr-defined]
    drv.cuMemGetAllocationGranularity = lambda prop, flag: (ok, 2 * MiB)  # type: ignore[attr-defined]
    drv.cuDeviceGetUuid = lambda dev: (ok, types.SimpleNamespace(bytes=bytes(16)))  # type: ignore[attr-defined]
    drv.cuMemGetInfo = lambda: (ok, 1 << 40, 1 << 40)  # type: ignore[attr-defined]
    drv.cuMemAddressReserve = lambda size, align, addr, flags: (ok, next(counter) << 40)  # type: ignore[attr-defined]
    drv.cuMemAddressFree = lambda va, size: (ok,)  # type: ignore[attr-defined]
    drv.cuMemCreate = lambda size, prop, flags: (  # type: ignore[attr-defined]
        ok,
        CUmemGenericAllocationHandle(next(counter)),
    )
    drv.cuMemRelease = lambda handle: (ok,)  # type: ignore[attr-defined]
    drv.cuMemMap = lambda va, size, offset, handle, flags: (ok,)  # type: ignore[attr-defined]
    drv.cuMemSetAccess = lambda va, size, desc, count: (ok,)  # type: ignore[attr-defined]
    drv.cuMemUnmap = lambda va, size: (ok,)  # type: ignore[attr-defined]
    return drv


def _install_stub() -> types.ModuleType:
    drv = stub_driver()
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = drv  # type: ignore[attr-defined]
    cuda.bindings = bindings  # type: ignore[attr-defined]
    sys.modules.update({"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.driver": drv})
    sys.modules.pop("kvcore.vmm.cuda", None)
    return drv


# --------------------------------------------------------------------------- measurement


def _median_ns(fn: Callable[[], None], reps: int, inner: int) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(inner):
            fn()
        samples.append((clock() - t0) / inner)
    return statistics.median(samples)


def _pair(kv: Callable[[], None], raw: Callable[[], None], reps: int, inner: int) -> dict:
    """Interleaved medians of both (ns per call)."""
    k: list[float] = []
    r: list[float] = []
    for i in range(reps):
        first, second = (kv, raw) if i % 2 == 0 else (raw, kv)
        a = _median_ns(first, 1, inner)
        b = _median_ns(second, 1, inner)
        (k if first is kv else r).append(a)
        (r if first is kv else k).append(b)
    kn, rn = statistics.median(k), statistics.median(r)
    return {"kvcore_ns": round(kn), "raw_ns": round(rn), "extra_ns": round(kn - rn)}


def run(reps: int = 31, inner: int = 2000) -> dict[str, Any]:
    drv = _install_stub()
    import torch

    # the suite's raw baselines, imported from it so both sides are what the GPU run times
    from benchmarks.gpu_suite.common import RawCuda
    from benchmarks.gpu_suite.mapper import RawPageMirror
    from kvcore.memory.geometry import KVGeometry
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm.cuda import CudaBackend

    backend = CudaBackend(0)
    # the stub has no memory behind its addresses: tensors over them are CPU scratch
    backend.as_tensor = lambda va, size, dtype: torch.zeros(size, dtype=torch.uint8).view(dtype)  # type: ignore[method-assign]
    raw = RawCuda(0)
    pb = 2 * MiB
    out: dict[str, Any] = {"driver": "stub (no-op)", "ops": {}}
    hk, hr = backend.create(pb), raw.create(pb)
    va = 1 << 44
    ops = {
        "create+release": (
            lambda: backend.release(backend.create(pb)),
            lambda: raw.release(raw.create(pb)),
        ),
        "map": (lambda: backend.map(va, pb, hk), lambda: raw.map(va, pb, hr)),
        "set_access": (
            lambda: backend.set_access(va, pb, writable=True),
            lambda: raw.set_access(va, pb),
        ),
        "unmap": (lambda: backend.unmap(va, pb), lambda: raw.unmap(va, pb)),
    }
    for name, (kv, rw) in ops.items():
        out["ops"][name] = _pair(kv, rw, reps, inner)

    for layout, layers in (("compound", 8), ("per-layer", 8)):
        rows = layers * 2 if layout == "compound" else 1
        geo = KVGeometry(
            num_layers=layers,
            kv_buffers=2,
            block_bytes=pb // (16 * rows),
            num_blocks=16 * 8,
            page_bytes=pb,
            granularity=pb,
            layout=layout,  # type: ignore[arg-type]
        )
        cache = VirtualKVCache(backend, geo)
        mapper = LocalPageMapper(cache)
        mirror = RawPageMirror(raw, geo.handles_per_page, pb, cache.zero_page_bytes, geo.num_pages)
        mapper.map([0])
        mapper.prepare_unmap([0])
        mapper.commit_unmap([0])

        def kv_cycle(mapper: Any = mapper) -> None:
            mapper.map([1])
            mapper.prepare_unmap([1])
            mapper.commit_unmap([1])

        def raw_cycle(mirror: Any = mirror) -> None:
            mirror.map_page(1)
            mirror.unmap_page(1)

        fig = _pair(kv_cycle, raw_cycle, reps, max(inner // (10 * geo.handles_per_page), 20))
        fig["handles_per_page"] = geo.handles_per_page
        out["ops"][f"mapper map+unmap cycle ({layout}, {geo.handles_per_page} slots)"] = fig
        mapper.close()
        cache.close()
        mirror.close()
    del drv
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--inner", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(args.reps, args.inner)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{'operation':<52} {'kvcore ns':>10} {'raw ns':>8} {'extra ns':>9}")
    for name, f in res["ops"].items():
        print(f"{name:<52} {f['kvcore_ns']:>10} {f['raw_ns']:>8} {f['extra_ns']:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
