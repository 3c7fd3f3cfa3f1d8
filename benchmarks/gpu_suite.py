"""The one-call GPU validation and performance baseline of kvcore (issue 9).

Run on a machine with a CUDA GPU, straight from the checkout::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/gpu_suite.py --out $OUT --budget-s 480

Steps, in order; each is timed, recorded and written to ``<out>/results.json`` (and rendered
to ``<out>/results.md``) as soon as it ends, and an error in one is recorded and the next one
runs. Every figure is measured next to its baseline in the same run; numbers are medians of
repeats with warm-up excluded.

``pytest``   the ``gpu``-marked tests (subprocess, time-limited): pass/fail counts.
``vmm``      (a) per-operation cost of create / map / set-access / unmap / release at 2 MiB
             and larger handle sizes: kvcore's ``cuda`` backend vs raw ``cuda.bindings``
             calls, interleaved. Goal: kvcore <= 1.1x raw.
``mapper``   (a) mapping and unmapping one page id through ``LocalPageMapper`` vs the raw
             create + map + set-access (unmap + release) of the same handles.
``bandwidth`` (b) paged-KV read bandwidth: a Triton gather over a shuffled block table
             (``_gpu_kernels.py``) on kvcore views (per-layer and compound layouts) vs
             plain ``torch.empty`` tensors of the same shape; decides the default layout on
             CUDA by the rule "default layout >= 0.97x plain".
``handoff``  (c) two processes sharing a per-GPU ledger (private directory): A frees 10 GiB
             of KV, B, polling its allocator, then maps 10 GiB and writes it; time from A's
             free call until B's write is done, per handle size. Goal: <= 50 ms.
``decode``   (d) a decode-batch allocation loop (``BlockLedger`` + ``PageAllocator``) with
             and without the reserve vs a static free list: driver calls on the allocating
             thread and step-time overhead.
``channel``  ``benchmarks/channel_latency.py --backend cuda`` if that script exists.

``--dry-run`` runs the same control flow on the ``host`` backend with tiny sizes, without
Triton or raw CUDA (CPU machines, CI); ``--quick`` shrinks the GPU sizes; ``--only`` /
``--skip`` pick steps. ``render_results.py`` turns the JSON into the tables of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from render_results import render_markdown  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
STEPS = ("pytest", "vmm", "mapper", "bandwidth", "handoff", "decode", "channel")
VMM_OPS = ("create", "map", "set_access", "unmap", "release")
BW_SPLITS = 4  # programs per (sequence, KV head) in the read kernel, as in split-KV decode
DRY_GRANULARITY = 64 * KiB  # the host backend's granularity in --dry-run: more, smaller pages


def size_text(n: int) -> str:
    """``2 MiB``, ``64 KiB``, ``1 GiB``, ``10 GiB``."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n / MiB:.3g} MiB" if n >= MiB else f"{n} B"


@dataclass(frozen=True)
class KVShape:
    """One model's KV block shape (per layer, per K or V buffer)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int = 2  # bf16

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def compound_row_bytes(self) -> int:
        """One block across every layer and both buffers (the compound layout's stride)."""
        return self.block_bytes * self.num_layers * 2


LLAMA3_8B = KVShape("Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
TINY = KVShape("tiny", num_layers=2, num_kv_heads=2, head_dim=32, block_size=16)


@dataclass(frozen=True)
class Sizes:
    """Every size knob of the suite; ``for_mode`` picks the set."""

    shape: KVShape
    page_unit: int  # the default page size (the backend's granularity)
    vmm_sizes: tuple[int, ...]
    vmm_reps: Callable[[int], int]
    mapper_reps: int
    bw_blocks: int
    bw_seqs: int
    bw_variants: tuple[tuple[str, int], ...]
    bw_reps: int
    handoff_bytes: int
    handoff_pages: tuple[int, ...]
    handoff_reps: int
    decode_seqs: int
    decode_steps: int
    decode_warmup: int
    decode_max_len: int
    decode_gpu_ms: float
    decode_configs: tuple[tuple[str, int, int], ...]  # (label, page_bytes, reserve pages)

    @staticmethod
    def for_mode(mode: str) -> Sizes:
        if mode == "dry":
            return Sizes(
                shape=TINY,
                page_unit=DRY_GRANULARITY,
                vmm_sizes=(DRY_GRANULARITY, 16 * DRY_GRANULARITY),
                vmm_reps=lambda size: 10,
                mapper_reps=10,
                bw_blocks=512,
                bw_seqs=8,
                bw_variants=(("per-layer", DRY_GRANULARITY), ("compound", DRY_GRANULARITY)),
                bw_reps=3,
                handoff_bytes=8 * MiB,
                handoff_pages=(DRY_GRANULARITY, 16 * DRY_GRANULARITY),
                handoff_reps=2,
                decode_seqs=8,
                decode_steps=60,
                decode_warmup=20,
                decode_max_len=256,
                decode_gpu_ms=0.5,
                decode_configs=(
                    ("64 KiB pages, no reserve", DRY_GRANULARITY, 0),
                    ("64 KiB pages, reserve", DRY_GRANULARITY, 4),
                ),
            )
        quick = mode == "quick"
        return Sizes(
            shape=LLAMA3_8B,
            page_unit=2 * MiB,
            vmm_sizes=(2 * MiB, 32 * MiB) if quick else (2 * MiB, 32 * MiB, 128 * MiB, 512 * MiB),
            vmm_reps=lambda size: 50 if size <= 32 * MiB else 20,
            mapper_reps=30 if quick else 100,
            bw_blocks=512 if quick else 2048,  # 2 MiB of KV per block: 1 or 4 GiB
            bw_seqs=32 if quick else 64,
            bw_variants=(
                (("per-layer", 2 * MiB), ("compound", 2 * MiB))
                if quick
                else (
                    ("per-layer", 2 * MiB),
                    ("compound", 2 * MiB),
                    ("per-layer", 64 * MiB),
                    ("compound", 64 * MiB),
                )
            ),
            bw_reps=10 if quick else 50,
            handoff_bytes=2 * GiB if quick else 10 * GiB,
            handoff_pages=(
                (2 * MiB, 512 * MiB) if quick else (2 * MiB, 32 * MiB, 128 * MiB, 512 * MiB, GiB)
            ),
            handoff_reps=2 if quick else 3,
            decode_seqs=32 if quick else 64,
            decode_steps=200 if quick else 600,
            decode_warmup=50 if quick else 150,
            decode_max_len=1024 if quick else 2048,
            decode_gpu_ms=2.0,
            decode_configs=(
                ("2 MiB pages, no reserve", 2 * MiB, 0),
                ("2 MiB pages, reserve", 2 * MiB, 64),
                ("32 MiB pages, no reserve", 32 * MiB, 0),
                ("32 MiB pages, reserve", 32 * MiB, 8),
            ),
        )


# --------------------------------------------------------------------------- the harness


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))])


class Suite:
    """Results, the time budget and incremental writing."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = "dry" if args.dry_run else ("quick" if args.quick else "full")
        self.sizes = Sizes.for_mode(self.mode)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.backend_name = "host" if args.dry_run else "cuda"
        self.backend_options: dict[str, Any] = (
            {"granularity": DRY_GRANULARITY} if args.dry_run else {}
        )
        self.results: dict[str, Any] = {
            "schema": 1,
            "meta": _meta(args, self.mode),
            "steps": {},
            "figures": [],
            "decisions": {},
        }
        self.write()

        self.current: str | None = None

    def start_watchdog(self, grace_s: float) -> Any:
        """Past the budget plus ``grace_s``, record the step that overran, write the
        results and exit (status 3), so a hung step still leaves its numbers behind.
        Returns the timer; ``cancel()`` it when the suite ends."""
        import threading

        def fire() -> None:
            name = self.current or "suite"
            self.results["steps"][name] = {
                "status": "error",
                "error": f"watchdog: still running {grace_s:.0f} s past the budget; exited",
            }
            log(f"!! watchdog: {name} overran the budget; writing results and exiting")
            with contextlib.suppress(Exception):
                self.write()
            os._exit(3)

        timer = threading.Timer(max(1.0, self.remaining() + grace_s), fire)
        timer.daemon = True
        timer.start()
        return timer

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self, keep_s: float = 0.0) -> bool:
        """True once less than ``keep_s`` seconds of the budget are left."""
        return self.remaining() < keep_s

    def run(self, name: str, fn: Callable[[Suite], dict[str, Any] | None], min_s: float) -> None:
        """Run one step unless the budget is short, recording its outcome either way."""
        rec: dict[str, Any] = {"status": "skipped"}
        if self.remaining() < min_s:
            rec["reason"] = f"budget: {self.remaining():.0f} s left, step needs ~{min_s:.0f} s"
            log(f"-- {name}: skipped ({rec['reason']})")
        else:
            log(f"== {name} ({self.remaining():.0f} s of budget left)")
            self.current = name
            t0 = time.monotonic()
            try:
                details = fn(self) or {}
                rec = {"status": "ok", "details": details}
            except Exception as exc:  # one step's failure never stops the suite
                rec = {
                    "status": "error",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=12),
                }
                log(f"!! {name} failed: {rec['error']}")
            rec["seconds"] = round(time.monotonic() - t0, 2)
        self.current = None
        self.results["steps"][name] = rec
        self.write()

    def figure(
        self,
        figure: str,
        name: str,
        ours: float | None,
        baseline: float | None,
        units: str,
        *,
        ours_label: str,
        baseline_label: str,
        goal: str = "",
        higher_is_better: bool = False,
        limit: float | None = None,
        absolute: bool = False,
        note: str = "",
    ) -> dict[str, Any]:
        """Record one figure; ``ratio`` is ours / baseline. ``met`` compares the ratio to
        ``limit`` (or, with ``absolute``, ``ours`` itself): <= for costs, >= when
        ``higher_is_better``; ``None`` when there is nothing to compare."""
        ratio = None
        if ours is not None and baseline and not math.isnan(ours) and not math.isnan(baseline):
            ratio = ours / baseline
        met = None
        value = ours if absolute else ratio
        if value is not None and limit is not None and not math.isnan(value):
            met = value >= limit if higher_is_better else value <= limit
        rec = {
            "figure": figure,
            "name": name,
            "ours": _num(ours),
            "baseline": _num(baseline),
            "ratio": _num(ratio),
            "units": units,
            "ours_label": ours_label,
            "baseline_label": baseline_label,
            "goal": goal,
            "met": met,
            "note": note,
        }
        self.results["figures"].append(rec)
        shown = f"{_fmt(ours)} vs {_fmt(baseline)} {units}"
        log(f"   [{figure}] {name}: {shown}" + (f" ratio {ratio:.3f}" if ratio else ""))
        self.write()
        return rec

    def write(self) -> None:
        self.results["meta"]["elapsed_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out / "results.json")
        try:
            (self.out / "results.md").write_text(render_markdown(self.results))
        except Exception as exc:  # the JSON is the record; the table is a convenience
            (self.out / "results.md").write_text(f"render failed: {exc!r}\n")


def _num(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(x)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def _run_text(cmd: list[str], timeout: float = 10.0) -> str:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
        ).stdout.strip()
    except Exception:
        return ""


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _meta(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "mode": mode,
        "commit": args.commit
        or os.environ.get("KVCORE_COMMIT")
        or _run_text(["git", "rev-parse", "--short=12", "HEAD"])
        or "unknown",
        "python": platform.python_version(),
        "host": platform.node(),
        "budget_s": args.budget_s,
    }
    for dist in ("torch", "triton", "cuda-bindings", "cuda-python", "pytest"):
        meta[dist] = _version(dist)
    try:
        import torch

        meta["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available() and not args.dry_run:
            props = torch.cuda.get_device_properties(0)
            meta["gpu"] = props.name
            meta["gpu_count"] = torch.cuda.device_count()
            meta["gpu_memory_gib"] = round(props.total_memory / GiB, 1)
            meta["sm_count"] = props.multi_processor_count
    except Exception as exc:
        meta["torch_error"] = repr(exc)
    if not args.dry_run:
        smi = _run_text(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"])
        if smi:
            meta["driver"] = smi.splitlines()[0].split(",")[0].strip()
        try:
            from cuda.bindings import driver as drv

            _err, ver = drv.cuDriverGetVersion()
            meta["cuda_driver_api"] = f"{ver // 1000}.{ver % 1000 // 10}"
        except Exception as exc:
            meta["cuda_driver_api"] = f"unavailable: {exc!r}"
    return meta


# --------------------------------------------------------------------------- raw CUDA driver


class RawCuda:
    """The five VMM calls straight through ``cuda.bindings.driver`` (the baseline of (a)),
    on the primary context of ``device`` (the one torch and kvcore use)."""

    def __init__(self, device: int = 0) -> None:
        from cuda.bindings import driver as drv

        self.drv = drv
        self._ok = drv.CUresult.CUDA_SUCCESS
        self._check("cuInit", drv.cuInit(0))
        dev = self._check("cuDeviceGet", drv.cuDeviceGet(device))
        self.ctx = self._check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
        self._dev = dev
        self._check("cuCtxSetCurrent", drv.cuCtxSetCurrent(self.ctx))
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        # the allocation kvcore's cuda backend makes: a POSIX-fd-shareable handle where the
        # device supports it (so the comparison is like for like)
        fd_ok = self._check(
            "cuDeviceGetAttribute",
            drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                dev,
            ),
        )
        if fd_ok:
            prop.requestedHandleTypes = (
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        self.prop = prop
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.desc = [desc]
        ro = drv.CUmemAccessDesc()
        ro.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        ro.location.id = device
        ro.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self.desc_ro = [ro]
        self.granularity = int(
            self._check(
                "cuMemGetAllocationGranularity",
                drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )

    def _check(self, call: str, ret: Any) -> Any:
        err = ret[0] if isinstance(ret, tuple) else ret
        if err != self._ok:
            raise RuntimeError(f"{call} failed: {err}")
        if isinstance(ret, tuple):
            return ret[1] if len(ret) == 2 else ret[1:]
        return None

    def reserve(self, size: int) -> int:
        return int(self._check("cuMemAddressReserve", self.drv.cuMemAddressReserve(size, 0, 0, 0)))

    def free_reservation(self, va: int, size: int) -> None:
        self._check("cuMemAddressFree", self.drv.cuMemAddressFree(va, size))

    def create(self, size: int) -> Any:
        return self._check("cuMemCreate", self.drv.cuMemCreate(size, self.prop, 0))

    def map(self, va: int, size: int, handle: Any) -> None:
        self._check("cuMemMap", self.drv.cuMemMap(va, size, 0, handle, 0))

    def set_access(self, va: int, size: int, *, read_only: bool = False) -> None:
        desc = self.desc_ro if read_only else self.desc
        self._check("cuMemSetAccess", self.drv.cuMemSetAccess(va, size, desc, 1))

    def synchronize(self) -> None:
        self._check("cuCtxSynchronize", self.drv.cuCtxSynchronize())

    def unmap(self, va: int, size: int) -> None:
        self._check("cuMemUnmap", self.drv.cuMemUnmap(va, size))

    def release(self, handle: Any) -> None:
        self._check("cuMemRelease", self.drv.cuMemRelease(handle))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drv.cuDevicePrimaryCtxRelease(self._dev)


class HostRaw:
    """``--dry-run``'s stand-in for ``RawCuda``: the host backend's primitives under
    ``RawCuda``'s names, so the raw-baseline code paths run on CPU too (their numbers there
    only say that the code works)."""

    def __init__(self, backend: Any, *, owns: bool = True) -> None:
        self.backend = backend
        self.owns = owns
        self.granularity = backend.granularity()

    def reserve(self, size: int) -> int:
        return int(self.backend.reserve(size))

    def free_reservation(self, va: int, size: int) -> None:
        self.backend.free_reservation(va, size)

    def create(self, size: int) -> Any:
        return self.backend.create(size)

    def map(self, va: int, size: int, handle: Any) -> None:
        self.backend.map(va, size, handle)

    def set_access(self, va: int, size: int, *, read_only: bool = False) -> None:
        self.backend.set_access(va, size, writable=not read_only)

    def synchronize(self) -> None:
        self.backend.synchronize()

    def unmap(self, va: int, size: int) -> None:
        self.backend.unmap(va, size)

    def release(self, handle: Any) -> None:
        self.backend.release(handle)

    def close(self) -> None:
        if self.owns:
            self.backend.close()


def raw_label(suite: Suite) -> str:
    return "raw cuda.bindings" if suite.backend_name == "cuda" else "bare host backend"


def raw_api(suite: Suite) -> RawCuda | HostRaw:
    """The raw baseline: ``cuda.bindings`` on a GPU, the bare host backend in a dry run."""
    if suite.backend_name == "cuda":
        return RawCuda(0)
    return HostRaw(open_kv_backend(suite))


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


# --------------------------------------------------------------------------- kvcore adapters
# kvcore's tensors / blocks modules were written alongside this suite; these few functions
# are the only places that know their constructor and method names.


def open_kv_backend(suite: Suite, **options: Any) -> Any:
    from kvcore.vmm import open_backend

    options = {**suite.backend_options, **options}
    if suite.backend_name == "host":
        options.setdefault("device_bytes", 2 * GiB)
    return open_backend(suite.backend_name, 0, **options)


def kv_geometry(backend: Any, shape: KVShape, num_blocks: int, page_bytes: int, layout: str) -> Any:
    from kvcore.memory.geometry import KVGeometry

    return KVGeometry(
        num_layers=shape.num_layers,
        kv_buffers=2,
        block_bytes=shape.block_bytes,
        num_blocks=num_blocks,
        page_bytes=page_bytes,
        granularity=backend.granularity(),
        layout=layout,  # type: ignore[arg-type]
    )


def kv_cache(backend: Any, geometry: Any) -> Any:
    import torch

    from kvcore.memory.virtual_cache import VirtualKVCache

    return VirtualKVCache(backend, geometry, dtype=torch.bfloat16)


def kv_mapper(cache: Any, **options: Any) -> Any:
    from kvcore.memory.local_mapper import LocalPageMapper

    return LocalPageMapper(cache, **options)


def kv_view(cache: Any, shape: KVShape, layer: int, buffer: int) -> Any:
    import torch

    return cache.view(
        layer, buffer, torch.bfloat16, (shape.block_size, shape.num_kv_heads, shape.head_dim)
    )


def kv_fill_bytes(cache: Any, value: int) -> None:
    """Write every byte of the cache's virtual ranges (the "write its tensor" of figure c):
    one fill per range, so all of it must be mapped writable."""
    import torch

    for va, size in cache.ranges:
        cache.backend.as_tensor(va, size, torch.uint8).fill_(value)


def close_all(*objs: Any) -> None:
    for obj in objs:
        if obj is not None:
            with contextlib.suppress(Exception):
                obj.close()


def _sync(suite: Suite) -> None:
    if suite.backend_name == "cuda":
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------- step 0: pytest

_PYTEST_COUNT = re.compile(
    r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)"
)


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's closing line (``3 passed, 1 failed, 2 skipped in 1.2s``)."""
    counts: dict[str, int] = {}
    for line in reversed(text.strip().splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or "no tests ran" in line or "passed" in line):
            for n, word in found:
                key = {"error": "errors", "warning": "warnings"}.get(word, word)
                counts[key] = counts.get(key, 0) + int(n)
            break
    return counts


def gpu_test_files() -> list[str]:
    """Test files under ``tests/`` that use the ``gpu`` mark, directly or through a helper
    module that applies it (collecting only these keeps engine test trees, whose imports
    may not exist on the GPU machine, out of the run)."""
    texts: dict[Path, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            texts[path] = path.read_text()
    root_conftest = ROOT / "tests" / "conftest.py"
    helpers = [
        p.stem
        for p, t in texts.items()
        if "mark.gpu" in t and not _is_test(p) and p.name != "conftest.py"
    ]

    def marks(text: str) -> bool:
        return "mark.gpu" in text or any(h in text for h in helpers)

    # a conftest that applies the mark (through fixtures) covers its whole directory
    dirs = [
        p.parent
        for p, t in texts.items()
        if p.name == "conftest.py" and p != root_conftest and marks(t)
    ]
    return [
        str(p.relative_to(ROOT))
        for p, t in texts.items()
        if _is_test(p) and (marks(t) or any(d in p.parents for d in dirs))
    ]


def _is_test(path: Path) -> bool:
    return path.name.startswith("test_") or path.name.endswith("_test.py")


def step_pytest(suite: Suite) -> dict[str, Any]:
    limit = max(10.0, min(suite.args.pytest_timeout, suite.remaining() - 60))
    targets = suite.args.pytest_targets or gpu_test_files()
    if not targets:
        return {"ok": True, "counts": {}, "note": "no test file carries a gpu mark"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        *targets,
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    log(f"   {' '.join(cmd)} (limit {limit:.0f} s)")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
    (suite.out / "pytest-gpu.log").write_text(output)
    counts = parse_pytest_summary(output)
    tail = output.strip().splitlines()[-15:]
    for line in tail[-5:]:
        log(f"   | {line}")
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    return {
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 1),
        "counts": counts,
        "ok": not timed_out and failed == 0 and proc.returncode in (0, 5),
        "tail": tail,
    }


# --------------------------------------------------------------------------- (a) VMM ops


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


# --------------------------------------------------------------------------- (a) page mapper


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


class _RawPageMirror:
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
                mirror = _RawPageMirror(raw, hpp, page_bytes, cache.zero_page_bytes, geo.num_pages)
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


# --------------------------------------------------------------------------- (b) bandwidth


def step_bandwidth(suite: Suite) -> dict[str, Any]:
    import torch
    from _gpu_kernels import HAVE_TRITON, paged_kv_read, reference_read

    sz = suite.sizes
    shape = sz.shape
    dry = suite.args.dry_run
    device = "cpu" if dry else "cuda"
    use_triton = HAVE_TRITON and not dry
    if not dry and not use_triton:
        raise RuntimeError("Triton is not importable: figure (b) needs it on the GPU")
    L, nb = shape.num_layers, sz.bw_blocks
    seqs = sz.bw_seqs
    bps = nb // seqs
    blk = (shape.block_size, shape.num_kv_heads, shape.head_dim)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    table = torch.randperm(nb, generator=gen)[: seqs * bps].reshape(seqs, bps)
    table = table.to(torch.int32).to(device)
    bytes_per_step = L * seqs * bps * 2 * shape.block_bytes
    log(
        f"   {shape.name}: {nb} blocks ({nb * shape.compound_row_bytes / GiB:.2f} GiB of KV), "
        f"{seqs} seqs x {bps} blocks, {bytes_per_step / MiB:.0f} MiB read per step of {L} layers"
    )

    # plain baselines: per-layer contiguous (the engines' own layout) and the compound
    # layout's strides on a plain allocation (separates the stride from the VMM effect)
    plain = torch.empty((L, 2, nb, *blk), dtype=torch.bfloat16, device=device)
    plain.normal_(generator=None)
    plain_strided = torch.empty((nb, L, 2, *blk), dtype=torch.bfloat16, device=device)
    plain_strided.copy_(plain.permute(2, 0, 1, 3, 4, 5))
    sources: dict[str, list[tuple[Any, Any]]] = {
        "plain": [(plain[layer, 0], plain[layer, 1]) for layer in range(L)],
        "plain (again)": [(plain[layer, 0], plain[layer, 1]) for layer in range(L)],
        "plain, compound strides": [
            (plain_strided[:, layer, 0], plain_strided[:, layer, 1]) for layer in range(L)
        ],
    }
    kv_objs: list[Any] = []
    timers: dict[str, Callable[[], float]] = {}
    try:
        variant_setup: dict[str, Any] = {}
        for layout, page_bytes in sz.bw_variants:
            label = f"kvcore {layout}, {size_text(page_bytes)} pages"
            try:
                backend = open_kv_backend(suite)
                kv_objs.append(backend)
                geo = kv_geometry(backend, shape, nb, page_bytes, layout)
                cache = kv_cache(backend, geo)
                kv_objs.append(cache)
                mapper = kv_mapper(cache)
                kv_objs.append(mapper)
                t0 = time.perf_counter()
                mapper.map(list(range(geo.num_pages)))
                t_map = time.perf_counter() - t0
                views = []
                for layer in range(L):
                    k, v = kv_view(cache, shape, layer, 0), kv_view(cache, shape, layer, 1)
                    k.copy_(plain[layer, 0])
                    v.copy_(plain[layer, 1])
                    views.append((k, v))
                sources[label] = views
                variant_setup[label] = {
                    "layout": layout,
                    "page_bytes": page_bytes,
                    "num_pages": geo.num_pages,
                    "handles": geo.num_pages * geo.handles_per_page,
                    "map_all_s": round(t_map, 4),
                    "block_stride_bytes": views[0][0].stride(0) * 2,
                }
            except Exception as exc:
                variant_setup[label] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"   !! {label}: {exc}")
        _sync(suite)

        splits = BW_SPLITS
        outs = {
            name: torch.empty(
                (L, seqs, shape.num_kv_heads, splits), dtype=torch.float32, device=device
            )
            for name in sources
        }

        def read_all(name: str) -> None:
            for layer, (k, v) in enumerate(sources[name]):
                if use_triton:
                    paged_kv_read(k, v, table, outs[name][layer])
                else:  # the host has no Triton: the reference reads the same blocks
                    outs[name][layer].zero_()
                    outs[name][layer][..., 0].copy_(reference_read(k, v, table))

        # correctness: every source holds the same values, so the same kernel gives the same sums
        ref = torch.stack(
            [reference_read(plain[layer, 0], plain[layer, 1], table) for layer in range(L)]
        )
        check: dict[str, float] = {}
        for name in sources:
            outs[name].fill_(float("nan"))
            read_all(name)
            _sync(suite)
            err = ((outs[name].sum(-1) - ref).norm() / ref.norm()).item()
            check[name] = err
            if not err < 1e-3:
                raise AssertionError(f"{name}: kernel sums differ from the reference (rel {err})")

        # timing: a CUDA graph of the L per-layer launches (one decode step's KV reads), replays
        # timed with events, sources interleaved per round
        graph_mode = "none (host)"
        if not dry:
            graph_mode = "cuda graph"
            for name in sources:
                try:
                    timers[name] = _graph_timer(lambda n=name: read_all(n))
                except Exception as exc:
                    graph_mode = f"eager launches (graph capture failed: {exc!r})"
                    timers = {n: _event_timer(lambda n=n: read_all(n)) for n in sources}
                    break
        else:
            timers = {n: _host_timer(lambda n=n: read_all(n)) for n in sources}
        samples: dict[str, list[float]] = {n: [] for n in sources}
        for i in range(sz.bw_reps):
            names = list(sources)
            random.Random(i).shuffle(names)
            for name in names:
                samples[name].append(timers[name]())
            if suite.expired(15):
                break
        gbps = {n: bytes_per_step / (median(s) * 1e-3) / 1e9 for n, s in samples.items() if s}
        base = gbps.get("plain")
        ceiling = None if dry else _copy_gbps(plain)
        if ceiling and base:
            log(
                f"   device copy {ceiling:.0f} GB/s (read + write); plain gather {base:.0f} GB/s "
                f"= {base / ceiling:.0%} of it"
            )
        for name, value in gbps.items():
            if name == "plain":
                continue
            s = samples[name]
            suite.figure(
                "b",
                f"read bandwidth: {name}",
                value,
                base,
                "GB/s",
                ours_label=name,
                baseline_label="plain torch.empty, per-layer",
                goal=">= 0.97x plain" if name.startswith("kvcore") else "",
                higher_is_better=True,
                limit=0.97 if name.startswith("kvcore") else None,
                note=f"median step {median(s):.3f} ms (p10 {percentile(s, 0.1):.3f}, "
                f"p90 {percentile(s, 0.9):.3f}) over {len(s)} replays",
            )
        decision = decide_layout(gbps, base, sz.page_unit)
        if base and "plain (again)" in gbps:  # the same tensor timed twice: the noise floor
            decision["noise"] = round(gbps["plain (again)"] / base, 4)
            decision["summary"] += f"; plain timed twice: {decision['noise']:.3f}x"
        suite.results["decisions"][
            "default_layout_cuda" if not dry else "default_layout_dry_run"
        ] = decision
        log(f"   DECISION: {decision['summary']}")
    finally:
        timers.clear()  # the captured graphs read the kvcore ranges: drop them first
        close_all(*reversed(kv_objs))
        sources.clear()
        del plain, plain_strided
        if not dry:
            torch.cuda.empty_cache()
    return {
        "shape": shape.__dict__,
        "num_blocks": nb,
        "seqs": seqs,
        "blocks_per_seq": bps,
        "programs_per_layer": seqs * shape.num_kv_heads * splits,
        "bytes_per_step": bytes_per_step,
        "timing": graph_mode,
        "reader": "triton" if use_triton else "torch reference",
        "gbps": gbps,
        "copy_gbps_ceiling": ceiling,
        "rel_error": check,
        "variants": variant_setup,
        "decision": decision,
    }


def _copy_gbps(src: Any) -> float:
    """The device's copy bandwidth (bytes read + written per second, GB/s), median of 10:
    the ceiling the gather kernel is judged against."""
    import torch

    dst = torch.empty_like(src)
    timer = _event_timer(lambda: dst.copy_(src))
    ms = median([timer() for _ in range(10)])
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def decide_layout(gbps: dict[str, float], base: float | None, page_unit: int) -> dict[str, Any]:
    """The rule of issue 9: the default layout must read at >= 0.97x plain. Compound maps
    one handle per page id (layers x 2 fewer map calls), so it wins whenever it qualifies;
    else per-layer; judged on pages of ``page_unit`` (the default page size)."""
    if not base:
        return {"layout": None, "summary": "no decision: no plain baseline measured"}
    ratios = {}
    for layout in ("compound", "per-layer"):
        name = f"kvcore {layout}, {size_text(page_unit)} pages"
        if name in gbps:
            ratios[layout] = gbps[name] / base
    for layout in ("compound", "per-layer"):
        if layout in ratios and ratios[layout] >= 0.97:
            return {
                "layout": layout,
                "ratios": ratios,
                "met": True,
                "summary": f"default layout: {layout} ({ratios[layout]:.3f}x plain >= "
                f"0.97; ratios {_ratios_text(ratios)})",
            }
    if not ratios:
        return {"layout": None, "summary": "no decision: no kvcore variant measured"}
    best = max(ratios, key=lambda k: ratios[k])
    return {
        "layout": best,
        "ratios": ratios,
        "met": False,
        "summary": f"neither layout reaches 0.97x plain ({_ratios_text(ratios)}); "
        f"best is {best}: keep it as default and treat the gap as a bug",
    }


def _ratios_text(ratios: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())


def _graph_timer(fn: Callable[[], None]) -> Callable[[], float]:
    """Capture ``fn`` in a CUDA graph (after a warm-up on a side stream, as graph capture
    requires) and time its replays."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return _event_timer(graph.replay)


def _event_timer(run: Callable[[], None]) -> Callable[[], float]:
    """A function returning the ms ``run`` takes on the GPU (CUDA events); warmed once."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once() -> float:
        start.record()
        run()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    once()
    return once


def _host_timer(fn: Callable[[], None]) -> Callable[[], float]:
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return once


# --------------------------------------------------------------------------- (c) handoff


def _handoff_worker(conn: Any, spec: dict[str, Any]) -> None:
    """One engine of the handoff figure, a process driven by the parent over ``conn``.

    Commands ``(name, arg)``: ``setup`` (arg: page bytes) -> register in the ledger, reserve
    the cache, build the allocator; ``map_write`` -> acquire every page (polling on a miss),
    fill, synchronize; ``free`` -> release every page (the timed free call), then wait for
    the background unmap; ``teardown`` -> close all but the backend; ``exit``. Each reply is
    a dict of monotonic ns timestamps, or ``{"error": ...}``.
    """
    import torch

    from kvcore.budget.ledger import GpuLedger, LedgerGate
    from kvcore.memory.pages import PageAllocator
    from kvcore.vmm import open_backend

    if spec["backend"] == "cuda":
        torch.cuda.init()
        torch.cuda.set_device(0)
    backend = open_backend(spec["backend"], 0, **spec.get("backend_options", {}))
    shape = KVShape(**spec["shape"])
    directory = Path(spec["ledger_dir"])
    state: dict[str, Any] = {}

    def setup(page_bytes: int) -> dict[str, Any]:
        rows = spec["total_bytes"] // shape.compound_row_bytes
        geo = kv_geometry(backend, shape, rows, page_bytes, "compound")
        state["cache"] = cache = kv_cache(backend, geo)
        if spec.get("set_budget"):
            # the pages plus both engines' zero pages (the allocator charges each cache's
            # zero page to its gate for its whole life; A and B share one geometry)
            with contextlib.closing(
                GpuLedger.open(
                    backend.device_uuid(),
                    device_total=backend.mem_info().total,
                    directory=directory,
                )
            ) as ledger:
                ledger.set_budget(spec["set_budget"] + 2 * cache.zero_page_bytes)
        gate = LedgerGate.from_backend(
            backend, name=spec["name"], engine="gpu-suite", directory=directory
        )
        state["gate"] = gate
        # no handle pool: the gate is charged exactly what the mapper holds (pooled handles
        # included), so handles A pooled would stay charged to A and B could never get the
        # whole budget; a handoff returns memory to the driver, which a pool would not
        state["mapper"] = mapper = kv_mapper(cache, pool_pages=0)
        state["alloc"] = PageAllocator(mapper, gate, reserve_min=0, reserve_max=0)
        state["geo"] = geo
        return {"num_pages": geo.num_pages, "page_bytes": geo.page_device_bytes}

    def map_write(_: Any) -> dict[str, Any]:
        alloc, geo = state["alloc"], state["geo"]
        t_start = time.monotonic_ns()
        misses = 0
        give_up = time.monotonic() + spec.get("acquire_timeout_s", 60.0)
        while True:
            ids = alloc.acquire(geo.num_pages)
            if ids is not None:
                break
            misses += 1
            if time.monotonic() > give_up:
                raise TimeoutError(f"no memory after {misses} acquire attempts")
            time.sleep(0.0001)
        t_mapped = time.monotonic_ns()
        kv_fill_bytes(state["cache"], 0x5A)
        if spec["backend"] == "cuda":
            torch.cuda.synchronize()
        t_written = time.monotonic_ns()
        state["ids"] = ids
        return {"t_start": t_start, "t_mapped": t_mapped, "t_written": t_written, "misses": misses}

    def free(_: Any) -> dict[str, Any]:
        alloc = state["alloc"]
        t_free = time.monotonic_ns()
        alloc.release(state.pop("ids"))
        t_returned = time.monotonic_ns()
        alloc.flush(timeout=60.0)
        t_unmapped = time.monotonic_ns()
        return {"t_free": t_free, "t_returned": t_returned, "t_unmapped": t_unmapped}

    def teardown(_: Any = None) -> dict[str, Any]:
        state.pop("ids", None)
        state.pop("geo", None)
        for key in ("alloc", "mapper", "cache", "gate"):
            obj = state.pop(key, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        return {}

    # the baseline: the same handoff with bare driver calls (no ledger, cache, zero page or
    # allocator), coordinated by the parent over the pipes
    raw: dict[str, Any] = {}

    def raw_setup(page_bytes: int) -> dict[str, Any]:
        api = RawCuda(0) if spec["backend"] == "cuda" else HostRaw(backend, owns=False)
        total = spec["total_bytes"]
        raw.update(api=api, pb=page_bytes, total=total, va=api.reserve(total), handles=[])
        return {}

    def raw_take(_: Any) -> dict[str, Any]:
        api, pb, va = raw["api"], raw["pb"], raw["va"]
        t_start = time.monotonic_ns()
        for off in range(0, raw["total"], pb):
            h = api.create(pb)
            api.map(va + off, pb, h)
            raw["handles"].append(h)
        api.set_access(va, raw["total"])  # one call over the whole range
        t_mapped = time.monotonic_ns()
        backend.as_tensor(va, raw["total"], torch.uint8).fill_(0x5A)
        if spec["backend"] == "cuda":
            torch.cuda.synchronize()
        t_written = time.monotonic_ns()
        return {"t_start": t_start, "t_mapped": t_mapped, "t_written": t_written}

    def raw_free(_: Any) -> dict[str, Any]:
        api, va = raw["api"], raw["va"]
        t_free = time.monotonic_ns()
        if spec["backend"] == "cuda":
            torch.cuda.synchronize()
        pb = raw["pb"]
        for i, h in enumerate(raw["handles"]):
            api.unmap(va + i * pb, pb)
            api.release(h)
        raw["handles"] = []
        return {"t_free": t_free, "t_unmapped": time.monotonic_ns()}

    def raw_teardown(_: Any = None) -> dict[str, Any]:
        if raw:
            with contextlib.suppress(Exception):
                if raw["handles"]:
                    raw_free(None)
            with contextlib.suppress(Exception):
                raw["api"].free_reservation(raw["va"], raw["total"])
            close_all(raw["api"])
            raw.clear()
        return {}

    commands: dict[str, Callable[[Any], dict[str, Any]]] = {
        "setup": setup,
        "map_write": map_write,
        "free": free,
        "teardown": teardown,
        "raw_setup": raw_setup,
        "raw_take": raw_take,
        "raw_free": raw_free,
        "raw_teardown": raw_teardown,
    }
    conn.send({"ready": True})
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            break
        try:
            conn.send(commands[cmd](arg))
        except Exception as exc:
            conn.send(
                {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=8),
                }
            )
    teardown()
    raw_teardown()
    backend.close()
    conn.close()


class _Peer:
    """The parent's handle on one handoff worker process."""

    def __init__(self, ctx: Any, spec: dict[str, Any]) -> None:
        self.name = spec["name"]
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_handoff_worker, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self, timeout: float = 120.0) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no reply within {timeout:.0f} s")
        reply: dict[str, Any] = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def call(self, cmd: str, arg: Any = None, timeout: float = 120.0) -> dict[str, Any]:
        self.send(cmd, arg)
        return self.recv(timeout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("exit", None))
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def _handoff_rep(a: _Peer, b: _Peer) -> dict[str, float]:
    """A holds everything; B starts asking; A frees. Times relative to A's free call."""
    a.call("map_write")
    b.send("map_write")  # B polls its allocator: a miss until A's bytes are back
    time.sleep(0.05)
    a.send("free")
    rb = b.recv()
    ra = a.recv()
    t0 = ra["t_free"]
    rep = {
        "handoff_ms": (rb["t_written"] - t0) / 1e6,
        "a_release_call_ms": (ra["t_returned"] - t0) / 1e6,
        "a_unmapped_ms": (ra["t_unmapped"] - t0) / 1e6,
        "b_mapped_ms": (rb["t_mapped"] - t0) / 1e6,
        "b_write_ms": (rb["t_written"] - rb["t_mapped"]) / 1e6,
        "b_misses": rb["misses"],
    }
    b.call("free")
    return rep


def _raw_handoff_rep(a: _Peer, b: _Peer) -> dict[str, float]:
    """The baseline: A holds the bytes through bare driver calls and frees them; then (told
    by the parent) B creates, maps, sets access and writes. Times relative to A's free."""
    a.call("raw_take")
    ra = a.call("raw_free")
    rb = b.call("raw_take")
    t0 = ra["t_free"]
    rep = {
        "handoff_ms": (rb["t_written"] - t0) / 1e6,
        "a_unmapped_ms": (ra["t_unmapped"] - t0) / 1e6,
        "b_mapped_ms": (rb["t_mapped"] - t0) / 1e6,
        "b_write_ms": (rb["t_written"] - rb["t_mapped"]) / 1e6,
    }
    b.call("raw_free")
    return rep


def step_handoff(suite: Suite) -> dict[str, Any]:
    import multiprocessing as mp

    sz = suite.sizes
    total = sz.handoff_bytes
    details: dict[str, Any] = {
        "total_bytes": total,
        "coordination": "per-GPU ledger (LedgerGate; GPU budget = the handoff size plus both "
        "caches' zero pages, which each allocator charges for its life, so B's allocator "
        "misses until A's pages are unmapped and their bytes released); B polls acquire() "
        "every 0.1 ms",
        "ledger_dir": "a private temporary directory (the machine's /dev/shm ledger untouched)",
        "per_page_size": {},
    }
    backend_options = {"device_bytes": 4 * total} if suite.backend_name == "host" else {}
    ledger_dir = tempfile.mkdtemp(prefix="kvcore-handoff-")
    spec = {
        "backend": suite.backend_name,
        "backend_options": {**backend_options, **suite.backend_options},
        "shape": sz.shape.__dict__,
        "ledger_dir": ledger_dir,
        "total_bytes": total,
    }
    ctx = mp.get_context("spawn")
    a = _Peer(ctx, {**spec, "name": "handoff-A", "set_budget": total})
    b = _Peer(ctx, {**spec, "name": "handoff-B"})
    medians: dict[int, float] = {}
    raw_medians: dict[int, float] = {}
    try:
        a.recv(timeout=180)
        b.recv(timeout=180)
        for page_bytes in sz.handoff_pages:
            label = size_text(page_bytes)
            if suite.expired(25 if page_bytes == sz.page_unit else 10):
                details["truncated"] = f"budget: stopped before {label} pages"
                break
            try:
                a.call("setup", page_bytes, timeout=120)
                b.call("setup", page_bytes, timeout=120)
                reps = []
                for _ in range(sz.handoff_reps):
                    reps.append(_handoff_rep(a, b))
                    if suite.expired(10):
                        break
                med = median([r["handoff_ms"] for r in reps])
                medians[page_bytes] = med
                details["per_page_size"][label] = {
                    "reps": reps,
                    "median_ms": med,
                    "num_pages": total // page_bytes,
                }
                log(
                    f"   {label} pages: handoff median {med:.1f} ms over {len(reps)} (A "
                    f"unmapped at {median([r['a_unmapped_ms'] for r in reps]):.1f} ms, B "
                    f"mapped at {median([r['b_mapped_ms'] for r in reps]):.1f} ms, B wrote "
                    f"in {median([r['b_write_ms'] for r in reps]):.1f} ms)"
                )
                for peer in (b, a):
                    peer.call("teardown", timeout=60)
                raw_reps = []
                try:
                    a.call("raw_setup", page_bytes)
                    b.call("raw_setup", page_bytes)
                    for _ in range(sz.handoff_reps):
                        raw_reps.append(_raw_handoff_rep(a, b))
                        if suite.expired(10):
                            break
                    raw_medians[page_bytes] = median([r["handoff_ms"] for r in raw_reps])
                    details["per_page_size"][label]["raw_reps"] = raw_reps
                    details["per_page_size"][label]["raw_median_ms"] = raw_medians[page_bytes]
                    log(f"   {label} pages: bare driver calls {raw_medians[page_bytes]:.1f} ms")
                except Exception as exc:
                    details["per_page_size"][label]["raw_error"] = str(exc)
                    log(f"   !! {label} pages, bare driver baseline: {exc}")
                finally:
                    for peer in (b, a):
                        with contextlib.suppress(Exception):
                            peer.call("raw_teardown", timeout=60)
            except Exception as exc:
                details["per_page_size"][label] = {"error": str(exc)}
                log(f"   !! {label} pages: {exc}")
            finally:
                for peer in (b, a):
                    with contextlib.suppress(Exception):
                        peer.call("teardown", timeout=60)
    finally:
        b.stop()
        a.stop()
        shutil.rmtree(ledger_dir, ignore_errors=True)
    what = f"handoff {size_text(total)}"
    at_goal_size = total >= 10 * GiB
    goal = "<= 50 ms" if at_goal_size else "<= 50 ms at 10 GiB"
    for page_bytes, med in sorted(medians.items()):
        reps = details["per_page_size"][size_text(page_bytes)]["reps"]
        suite.figure(
            "c",
            f"{what}, {size_text(page_bytes)} pages",
            med,
            raw_medians.get(page_bytes),
            "ms",
            ours_label="kvcore: ledger + PageAllocator + LocalPageMapper",
            baseline_label="bare driver calls",
            goal=goal,
            limit=50.0 if at_goal_size else None,
            absolute=True,
            note=f"median of {len(reps)}; A free call -> B written; A unmapped at "
            f"{median([r['a_unmapped_ms'] for r in reps]):.1f} ms, B mapped at "
            f"{median([r['b_mapped_ms'] for r in reps]):.1f} ms, B wrote in "
            f"{median([r['b_write_ms'] for r in reps]):.1f} ms",
        )
    smallest = min(sz.handoff_pages)
    larger = {p: m for p, m in medians.items() if p != smallest}
    if larger:
        best = min(larger, key=lambda p: larger[p])
        suite.figure(
            "c",
            f"{what}, best handle size ({size_text(best)}) vs {size_text(smallest)}",
            larger[best],
            medians.get(smallest),
            "ms",
            ours_label=f"{size_text(best)} pages",
            baseline_label=f"{size_text(smallest)} pages",
            goal=goal,
            limit=50.0 if at_goal_size else None,
            absolute=True,
            note="kvcore at each size: "
            + ", ".join(f"{size_text(p)} {m:.1f} ms" for p, m in sorted(medians.items())),
        )
        details["best_page_bytes"] = best
    if not medians:
        raise RuntimeError("no handle size completed a handoff")
    return details


# --------------------------------------------------------------------------- (d) decode loop


class _StaticBlocks:
    """The baseline allocator of (d): every block pre-allocated, a plain free list (what an
    engine does without kvcore)."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = self._free[-n:]
        del self._free[-n:]
        return ids

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)

    def close(self) -> None:
        pass


@dataclass
class _DecodeRun:
    alloc_ns: list[int]
    step_ns: list[int]
    misses: int
    allocations: int
    frees: int


def _decode_loop(
    blocks: Any,
    sz: Sizes,
    gpu_work: Callable[[], None],
    on_measure: Callable[[], None] = lambda: None,
    on_end: Callable[[], None] = lambda: None,
) -> _DecodeRun:
    """A decode batch: every sequence gains one token per step, takes a block every
    ``block_size`` tokens, and when it reaches its length frees its blocks and is replaced by
    a new sequence with a prompt. The same seed gives every allocator the same requests."""
    rng = random.Random(7)
    bs = sz.shape.block_size
    seqs: list[list[Any]] = []  # [tokens, target, blocks]
    misses = allocations = frees = 0

    def new_seq() -> list[Any]:
        nonlocal misses, allocations
        prompt = rng.randint(bs, sz.decode_max_len // 4)
        target = rng.randint(prompt + 1, sz.decode_max_len)
        ids = blocks.alloc(-(-prompt // bs))
        if ids is None:
            misses += 1
            ids = []
            prompt = 0
        allocations += 1
        return [prompt, target, ids]

    for _ in range(sz.decode_seqs):
        seqs.append(new_seq())
    alloc_ns: list[int] = []
    step_ns: list[int] = []
    clock = time.perf_counter_ns
    for step in range(sz.decode_warmup + sz.decode_steps):
        if step == sz.decode_warmup:
            on_measure()
        t0 = clock()
        for i, seq in enumerate(seqs):
            if seq[0] % bs == 0:
                ids = blocks.alloc(1)
                if ids is None:  # a miss: the scheduler would preempt; this one restarts it
                    misses += 1
                    blocks.free(seq[2])
                    frees += 1
                    seqs[i] = new_seq()
                    continue
                allocations += 1
                seq[2].extend(ids)
            seq[0] += 1
            if seq[0] >= seq[1]:
                blocks.free(seq[2])
                frees += 1
                seqs[i] = new_seq()
        t1 = clock()
        gpu_work()
        t2 = clock()
        if step >= sz.decode_warmup:
            alloc_ns.append(t1 - t0)
            step_ns.append(t2 - t0)
    on_end()  # before the batch's blocks go back (counters read here cover the steps only)
    for seq in seqs:
        blocks.free(seq[2])
    return _DecodeRun(alloc_ns, step_ns, misses, allocations, frees)


def _gpu_work(suite: Suite) -> tuple[Callable[[], None], float]:
    """A fixed stand-in for the model's forward pass: the GPU spins ``decode_gpu_ms`` (the
    host backend sleeps instead), then the step synchronizes. Returns it and its measured
    duration in ms."""
    ms = suite.sizes.decode_gpu_ms
    if ms <= 0:
        return (lambda: None), 0.0
    if suite.backend_name != "cuda":

        def work() -> None:
            time.sleep(ms / 1e3)

    else:
        import torch

        probe_cycles = 1_000_000
        torch.cuda._sleep(probe_cycles)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe_cycles)
        end.record()
        end.synchronize()
        cycles = int(probe_cycles * ms / max(start.elapsed_time(end), 1e-3))

        def work() -> None:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()

    work()
    t0 = time.perf_counter()
    for _ in range(5):
        work()
    return work, (time.perf_counter() - t0) / 5 * 1e3


def kv_blocks(geometry: Any, pages: Any) -> Any:
    from kvcore.memory.blocks import BlockLedger

    return BlockLedger(geometry, pages)


def step_decode(suite: Suite) -> dict[str, Any]:
    import threading

    from kvcore.memory.pages import PageAllocator
    from kvcore.vmm.faults import FaultInjector

    sz = suite.sizes
    shape = sz.shape
    capacity = sz.decode_seqs * -(-sz.decode_max_len // shape.block_size) + sz.decode_seqs
    work, work_ms = _gpu_work(suite)
    details: dict[str, Any] = {"capacity_blocks": capacity, "gpu_work_ms": work_ms, "runs": {}}
    static = _decode_loop(_StaticBlocks(capacity), sz, work)
    base_alloc = median(static.alloc_ns) / 1e3
    base_step = median(static.step_ns) / 1e3
    details["runs"]["static"] = {
        "alloc_us_median": base_alloc,
        "alloc_us_p99": percentile(static.alloc_ns, 0.99) / 1e3,
        "step_us_median": base_step,
        "allocations": static.allocations,
        "misses": static.misses,
    }
    me = threading.get_ident()
    for label, page_bytes, reserve in sz.decode_configs:
        if suite.expired(20):
            details["truncated"] = f"budget: stopped before {label}"
            break
        fi = FaultInjector(open_kv_backend(suite))
        cache = mapper = pages = ledger = None
        try:
            num_blocks = capacity
            geo = kv_geometry(fi, shape, num_blocks, page_bytes, "compound")
            cache = kv_cache(fi, geo)
            mapper = kv_mapper(cache)
            # the refill keeps the whole reserve mapped (reserve_min = reserve_max): a new
            # sequence's prompt takes up to decode_max_len / 4 tokens of blocks at once, and
            # a reserve kept only half full let those bursts spill onto this thread
            pages = PageAllocator(mapper, reserve_min=reserve, reserve_max=reserve)
            ledger = kv_blocks(geo, pages)
            if reserve:
                pages.flush(timeout=30)
            marks: dict[str, Any] = {}

            fi.reset_counts()  # warm-up: from the first sequences' prompts on

            def on_measure(marks: dict[str, Any] = marks, pages: Any = pages, fi: Any = fi) -> None:
                marks["warmup_here"] = fi.calls(thread=me)
                marks["warmup_all"] = fi.calls()
                fi.reset_counts()
                marks["stats"] = pages.stats()

            def on_end(marks: dict[str, Any] = marks, pages: Any = pages, fi: Any = fi) -> None:
                marks["end"] = pages.stats()
                marks["here"] = fi.calls(thread=me)
                marks["all"] = fi.calls()
                marks["kinds"] = {
                    k: n
                    for k in ("map", "unmap", "set_access", "create", "release", "synchronize")
                    if (n := fi.calls(k, thread=me))
                }

            run = _decode_loop(ledger, sz, work, on_measure, on_end)
            st = marks["end"]
            calls_here, calls_all, kinds_here = marks["here"], marks["all"], marks["kinds"]
            steps = len(run.step_ns)
            ours_step = median(run.step_ns) / 1e3
            suite.figure(
                "d",
                f"decode step ({label})",
                ours_step,
                base_step,
                "us",
                ours_label="kvcore BlockLedger + PageAllocator",
                baseline_label="static free list",
                goal="overhead small vs step",
                note=f"{sz.decode_seqs} seqs, {steps} steps, GPU work {work_ms:.2f} ms/step; "
                f"overhead {ours_step - base_step:+.1f} us/step; "
                f"allocation part {median(run.alloc_ns) / 1e3:.1f} us median, "
                f"p99 {percentile(run.alloc_ns, 0.99) / 1e3:.1f} us (static "
                f"{base_alloc:.1f} us)",
            )
            suite.figure(
                "d",
                f"driver calls on the allocating thread per step ({label})",
                calls_here / max(steps, 1),
                None,
                "calls/step",
                ours_label="allocating thread",
                baseline_label="",
                goal="0 with the reserve" if reserve else "",
                limit=0.0 if reserve else None,
                absolute=True,
                note=f"steady state (after {sz.decode_warmup} warm-up steps): {calls_here} of "
                f"{calls_all} driver calls over {steps} steps on the allocating thread (rest: "
                f"refill thread); allocator misses {st.misses - marks['stats'].misses}; "
                f"counted through FaultInjector; by kind {kinds_here}",
            )
            suite.figure(
                "d",
                f"driver calls on the allocating thread per warm-up step ({label})",
                marks["warmup_here"] / max(sz.decode_warmup, 1),
                None,
                "calls/step",
                ours_label="allocating thread",
                baseline_label="",
                goal="",
                absolute=True,
                note=f"warm-up: the first {sz.decode_warmup} steps, from {sz.decode_seqs} "
                f"sequences' prompts arriving at once; {marks['warmup_here']} of "
                f"{marks['warmup_all']} driver calls on the allocating thread (not a goal: "
                "a burst beyond the reserve maps on the caller by design)",
            )
            details["runs"][label] = {
                "page_bytes": page_bytes,
                "reserve_pages": reserve,
                "alloc_us_median": median(run.alloc_ns) / 1e3,
                "alloc_us_p99": percentile(run.alloc_ns, 0.99) / 1e3,
                "step_us_median": ours_step,
                "step_us_p99": percentile(run.step_ns, 0.99) / 1e3,
                "driver_calls_allocating_thread": calls_here,
                "driver_calls_all_threads": calls_all,
                "warmup_steps": sz.decode_warmup,
                "warmup_driver_calls_allocating_thread": marks["warmup_here"],
                "warmup_driver_calls_all_threads": marks["warmup_all"],
                "driver_calls_allocating_thread_by_kind": kinds_here,
                "caller_mapper_calls": st.caller_mapper_calls - marks["stats"].caller_mapper_calls,
                "refill_mapper_calls": st.refill_mapper_calls - marks["stats"].refill_mapper_calls,
                "misses": run.misses,
                "allocations": run.allocations,
                "frees": run.frees,
            }
        finally:
            close_all(ledger, pages, mapper, cache, fi)
    return details


# --------------------------------------------------------------------------- channel


def step_channel(suite: Suite) -> dict[str, Any]:
    """Run the worker-channel latency benchmark (another script, optional) with the suite's
    backend; its options are passed only where its ``--help`` lists them."""
    script = Path(suite.args.channel_script)
    if not script.exists():
        return {"status": "absent", "note": f"{script} does not exist yet"}
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    help_text = _run_text([sys.executable, str(script), "--help"], timeout=60)
    cmd = [sys.executable, str(script), "--backend", suite.backend_name]
    json_path = suite.out / "channel.json"
    wanted = [("--json", str(json_path))]
    if suite.mode == "dry":
        wanted += [("--workers", "1"), ("--iters", "10"), ("--warmup", "2")]
    else:
        import torch

        wanted.append(("--devices", str(max(1, torch.cuda.device_count()))))
        if suite.mode == "quick":
            wanted += [("--workers", "1,2"), ("--iters", "50")]
    for opt, value in wanted:
        if opt in help_text:
            cmd += [opt, value]
    limit = max(10.0, min(240.0, suite.remaining() - 5))
    log(f"   {' '.join(cmd)} (limit {limit:.0f} s)")
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit, check=False
        )
        output, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout if isinstance(exc.stdout, str) else ""
        rc, timed_out = None, True
    (suite.out / "channel.log").write_text(output)
    tail = [
        ln
        for ln in output.strip().splitlines()
        if "Warning" not in ln and "_conversion_method_template" not in ln
    ][-15:]
    for line in tail[-8:]:
        log(f"   | {line}")
    data = None
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(json_path.read_text())
    if rc != 0 or timed_out:
        raise RuntimeError(f"channel_latency.py exited {rc} (timed out: {timed_out})")
    return {"command": " ".join(cmd), "returncode": rc, "tail": tail, "results": data}


# --------------------------------------------------------------------------- main

STEP_FUNCS: dict[str, tuple[Callable[[Suite], dict[str, Any] | None], float]] = {
    # name: (function, seconds of budget it needs to start)
    "pytest": (step_pytest, 20),
    "vmm": (step_vmm, 15),
    "mapper": (step_mapper, 15),
    "bandwidth": (step_bandwidth, 30),
    "handoff": (step_handoff, 40),
    "decode": (step_decode, 30),
    "channel": (step_channel, 20),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-suite-out",
        help="result directory (default: $OUT, else ./gpu-suite-out)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="global time budget; steps that would not fit are skipped",
    )
    ap.add_argument(
        "--grace-s",
        type=float,
        default=45.0,
        help="a watchdog exits this long after the budget, results written (default 45)",
    )
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="host backend, tiny sizes, no Triton or raw CUDA (CPU machines)",
    )
    ap.add_argument("--only", default="", help=f"comma-separated steps of {','.join(STEPS)}")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument(
        "--channel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run benchmarks/channel_latency.py if present (default on)",
    )
    ap.add_argument(
        "--channel-script",
        default=str(HERE / "channel_latency.py"),
        help="the worker-channel benchmark the channel step runs",
    )
    ap.add_argument(
        "--pytest-timeout",
        type=float,
        default=150.0,
        help="limit for the gpu-marked tests, seconds",
    )
    ap.add_argument(
        "--pytest-targets", nargs="*", default=None, help="paths given to pytest (default: tests)"
    )
    ap.add_argument("--commit", default="", help="commit to record (default: git, or unknown)")
    args = ap.parse_args(argv)
    for opt in ("only", "skip"):
        bad = [s for s in getattr(args, opt).split(",") if s and s not in STEPS]
        if bad:
            ap.error(f"--{opt}: unknown step(s) {bad}; known: {', '.join(STEPS)}")
    return args


def selected_steps(args: argparse.Namespace) -> list[str]:
    only = [s for s in args.only.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    if not args.channel:
        skip.add("channel")
    if args.dry_run and not only:
        skip.add("pytest")  # the CPU suite runs the tests itself; nested pytest is waste
    return [s for s in STEPS if (not only or s in only) and s not in skip]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    suite = Suite(args)
    watchdog = suite.start_watchdog(args.grace_s)
    try:
        return _run_suite(suite)
    finally:
        watchdog.cancel()


def _run_suite(suite: Suite) -> int:
    args = suite.args
    meta = suite.results["meta"]
    log(f"kvcore gpu suite: mode {suite.mode}, budget {args.budget_s:.0f} s, out {suite.out}")
    log(
        f"   gpu {meta.get('gpu')} driver {meta.get('driver')} torch {meta.get('torch')} "
        f"cuda-bindings {meta.get('cuda-bindings')} triton {meta.get('triton')} "
        f"commit {meta.get('commit')}"
    )
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            log("no CUDA GPU visible: nothing to measure (use --dry-run on CPU)")
            suite.results["steps"]["setup"] = {"status": "error", "error": "no CUDA GPU"}
            suite.write()
            return 2
        torch.cuda.init()
    for name in selected_steps(args):
        fn, min_s = STEP_FUNCS[name]
        suite.run(name, fn, min_s)
    suite.write()
    print(render_markdown(suite.results, notes=False), flush=True)
    statuses = [s["status"] for s in suite.results["steps"].values()]
    log(
        f"done in {time.monotonic() - suite.start:.0f} s: "
        + ", ".join(f"{n} {s['status']}" for n, s in suite.results["steps"].items())
    )
    return 1 if "error" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
