"""What every step of the GPU suite shares: the sizes of each mode, the ``Suite`` that
records results against the time budget, the raw driver baselines and the few functions
that build kvcore's objects."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.render_results import render_markdown

ROOT = Path(__file__).resolve().parents[2]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
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


# --------------------------------------------------------------------------- the suite


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


def run_text(cmd: list[str], timeout: float = 10.0) -> str:
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
        "command": " ".join([Path(sys.executable).name, "-m", __package__, *sys.argv[1:]]),
        "mode": mode,
        "commit": args.commit
        or os.environ.get("KVCORE_COMMIT")
        or run_text(["git", "rev-parse", "--short=12", "HEAD"])
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
        smi = run_text(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"])
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
