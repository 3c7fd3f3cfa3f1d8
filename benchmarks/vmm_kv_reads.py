"""What the device pays to read KV blocks through VMM-mapped pages, by page size and layout.

Elastic KV backs its cache with physical pages mapped one at a time into a reserved range;
upstream vLLM reads one ``cudaMalloc`` block. This measures, on one GPU and in one process,
a decode-like read of KV blocks scattered over a cache of ``--cache-gib``:

* memory: ``torch`` (one caching-allocator block, i.e. ``cudaMalloc``), ``vmm-<n>m``
  (kvcore's ``cuda`` backend: one range reserved, one physical handle of ``n`` MiB created
  and mapped per page, access set per page, as ``LocalPageMapper`` maps pages) and
  ``vmm-whole`` (one handle for the whole cache, mapped once);
* layout: ``layer-outer`` (vLLM's default LBNHC: each layer's blocks in its own contiguous
  range) or ``block-outer`` (BLNHC: a block's layers side by side, so one layer's blocks are
  spread over the whole cache);
* used: the fraction of the cache's blocks the batch reads (random blocks, random order),
  every layer in turn, each layer's cells gathered with ``index_select`` (``--cell-kib`` per
  cell: K and V of one block of one layer).

Figures: median milliseconds per pass over all layers and the effective read bandwidth, from
CUDA events, ``--repeats`` passes after two warm-up passes, the memory kinds interleaved per
repeat. Needs a CUDA GPU, torch and cuda-python.

    python -m benchmarks.vmm_kv_reads --cache-gib 20 --out vmm-kv-reads.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks._provenance import commit, now
from kvcore.vmm import open_backend

MiB = 1 << 20


class _Vmm:
    """``size`` bytes of one reserved range backed by handles of ``page`` bytes."""

    def __init__(self, backend: Any, size: int, page: int) -> None:
        self.backend, self.size, self.page = backend, size, page
        self.va = backend.reserve(size)
        self.handles: list[Any] = []
        for off in range(0, size, page):
            handle = backend.create(page)
            self.handles.append(handle)
            backend.map(self.va + off, page, handle)
            backend.set_access(self.va + off, page)
        self.tensor = backend.as_tensor(self.va, size, torch.bfloat16)

    def close(self) -> None:
        del self.tensor
        torch.cuda.synchronize()
        for i, handle in enumerate(self.handles):
            self.backend.unmap(self.va + i * self.page, self.page)
            self.backend.release(handle)
        self.backend.free_reservation(self.va, self.size)


def _rows(layout: str, layers: int, blocks: int, chosen: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the cell indices (in a ``[layers * blocks, cell]`` view) of ``chosen``."""
    if layout == "layer-outer":
        return [chosen + layer * blocks for layer in range(layers)]
    return [chosen * layers + layer for layer in range(layers)]


def _pass(view: torch.Tensor, rows: list[torch.Tensor], out: torch.Tensor) -> None:
    for idx in rows:
        torch.index_select(view, 0, idx, out=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-gib", type=float, default=20.0)
    parser.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B: 28")
    parser.add_argument("--cell-kib", type=int, default=64, help="K+V of 16 tokens x 8 x 128")
    parser.add_argument("--pages-mib", type=int, nargs="+", default=[2, 16, 128])
    parser.add_argument("--used", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    cell = args.cell_kib << 10
    row = cell * args.layers
    blocks = int(args.cache_gib * (1 << 30)) // row
    size = blocks * row
    backend = open_backend("cuda", torch.cuda.current_device())
    gran = backend.granularity()
    unit = math.lcm(gran, *(mib * MiB for mib in args.pages_mib))  # every page size tiles it
    size = -(-size // unit) * unit
    memories: dict[str, Any] = {
        "torch": torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
    }
    vmms: list[_Vmm] = []
    for mib in args.pages_mib:
        vmm = _Vmm(backend, size, max(gran, mib * MiB))
        vmms.append(vmm)
        memories[f"vmm-{mib}m"] = vmm.tensor
    whole = _Vmm(backend, size, size)
    vmms.append(whole)
    memories["vmm-whole"] = whole.tensor
    for t in memories.values():
        t.zero_()

    gen = torch.Generator().manual_seed(args.seed)
    results: list[dict[str, Any]] = []
    elems = cell // 2
    for used in args.used:
        n = max(1, int(blocks * used))
        chosen = torch.randperm(blocks, generator=gen)[:n].cuda()
        out = torch.empty(n, elems, dtype=torch.bfloat16, device="cuda")
        for layout in ("layer-outer", "block-outer"):
            rows = _rows(layout, args.layers, blocks, chosen)
            times: dict[str, list[float]] = {name: [] for name in memories}
            views = {
                name: t[: blocks * args.layers * elems].view(blocks * args.layers, elems)
                for name, t in memories.items()
            }
            for view in views.values():
                for _ in range(2):
                    _pass(view, rows, out)
            for rep in range(args.repeats):
                names = list(views)
                names = names[rep % len(names) :] + names[: rep % len(names)]
                for name in names:
                    start = torch.cuda.Event(enable_timing=True)
                    stop = torch.cuda.Event(enable_timing=True)
                    start.record()
                    _pass(views[name], rows, out)
                    stop.record()
                    stop.synchronize()
                    times[name].append(start.elapsed_time(stop))
            for name, ms in times.items():
                med = statistics.median(ms)
                read = n * cell * args.layers
                results.append(
                    {
                        "memory": name,
                        "layout": layout,
                        "used": used,
                        "bytes_read": read,
                        "ms_median": med,
                        "ms_min": min(ms),
                        "ms_max": max(ms),
                        "gb_s": read / med / 1e6,
                    }
                )
                print(
                    f"used {used:4.2f} {layout:11s} {name:10s} {med:8.3f} ms "
                    f"{read / med / 1e6:8.1f} GB/s",
                    flush=True,
                )
        del out
    report = {
        "benchmark": "vmm_kv_reads",
        "commit": commit("benchmarks/vmm_kv_reads.py", "kvcore/vmm"),
        "date": now(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "granularity": gran,
        "cache_bytes": size,
        "layers": args.layers,
        "cell_bytes": cell,
        "blocks": blocks,
        "repeats": args.repeats,
        "results": results,
    }
    memories.clear()
    views = {}
    for vmm in vmms:
        vmm.close()
    backend.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
