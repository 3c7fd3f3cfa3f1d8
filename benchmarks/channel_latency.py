"""Per-page map and unmap latency through the worker channel vs the local mapper.

For each worker count N it starts N real worker processes (each: a VMM backend, a
``VirtualKVCache`` of compound layout and a ``LocalPageMapper`` behind a
``WorkerListener``), drives them from this process with a ``ChannelCoordinator``, and times
``map([p])`` and ``prepare_unmap([p]) + commit_unmap([p])``, ``--batch`` pages per call.
In the same run, the same transitions are timed on a ``LocalPageMapper`` in this process
(the baseline). Figures are medians per page, in milliseconds, and the channel / local
ratio; plus the CPU time per page of one map + prepare + commit cycle spent by this
process and by the average worker (load-independent: on an oversubscribed machine the wall
figures are mostly scheduler wake-up delay). Goal: <= 0.5 ms per page for 4 workers
(kvcached's published anchor: 2.1 ms).

    python -m benchmarks.channel_latency                          # host backend, CPU
    python -m benchmarks.channel_latency --backend cuda           # workers share GPU 0
    python -m benchmarks.channel_latency --backend cuda --devices 2   # worker i -> GPU i % 2

Workers keep no handle pool (``WorkerListener`` trims its mapper's pool after each request
so the coordinator's ``held_bytes`` is exact): every channel map creates its handle and every
commit releases it. The baseline the ratios use is therefore a local mapper without a pool
(``pool_pages=0``), doing the same driver work; the local mapper with its default pool
(4 pages: no create/release after warm-up) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PAGE_PAGES = 64  # page ids per worker cache (virtual; only a few are ever mapped)


def _geometry(backend: Any) -> Any:
    from kvcore.memory.geometry import KVGeometry

    gran = backend.granularity()
    # One page id = one granularity-sized handle holding 4 blocks of 4 layers x (K, V).
    return KVGeometry(
        num_layers=4,
        kv_buffers=2,
        block_bytes=gran // 32,
        num_blocks=PAGE_PAGES * 4,
        page_bytes=gran,
        granularity=gran,
        layout="compound",
    )


def _open(backend_name: str, device: int) -> Any:
    from kvcore.vmm import open_backend

    options = {"device_bytes": 4 << 30} if backend_name == "host" else {}
    return open_backend(backend_name, device, **options)


def _worker(backend_name: str, device: int, rank: int, channel_dir: str, pipe: Connection) -> None:
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.parallel.channel import WorkerListener

    backend = _open(backend_name, device)
    cache = VirtualKVCache(backend, _geometry(backend))
    mapper = LocalPageMapper(cache)
    listener = WorkerListener(mapper, rank=rank, channel_dir=channel_dir).start()
    pipe.send("ready")
    cpu0 = time.process_time()
    listener.wait_closed()  # the coordinator's close() unmaps everything and stops it
    pipe.send(time.process_time() - cpu0)  # this worker's CPU seconds over the whole run
    listener.close()
    cache.close()
    backend.close()


def _time(mapper: Any, iters: int, warmup: int, batch: int) -> tuple[list[float], list[float]]:
    """Per-page seconds of each map call and each prepare+commit pair (timed cycles after
    ``warmup`` untimed ones)."""
    pages = list(range(batch))
    maps: list[float] = []
    unmaps: list[float] = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        mapper.map(pages)
        t1 = time.perf_counter()
        mapper.prepare_unmap(pages)
        mapper.commit_unmap(pages)
        t2 = time.perf_counter()
        if i >= warmup:
            maps.append((t1 - t0) / batch)
            unmaps.append((t2 - t1) / batch)
    return maps, unmaps


def _local(args: argparse.Namespace, pool_pages: int) -> tuple[float, float]:
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache

    backend = _open(args.backend, 0)
    cache = VirtualKVCache(backend, _geometry(backend))
    mapper = LocalPageMapper(cache, pool_pages=pool_pages)
    try:
        maps, unmaps = _time(mapper, args.iters, args.warmup, args.batch)
    finally:
        mapper.close()
        cache.close()
        backend.close()
    return statistics.median(maps), statistics.median(unmaps)


def _channel(args: argparse.Namespace, workers: int) -> tuple[float, float, float, float]:
    """Median per-page map and unmap seconds, and CPU seconds per page per cycle (map +
    prepare + commit) spent by this process and by the average worker."""
    from kvcore.parallel.channel import ChannelCoordinator, ChannelDirectory

    base = Path(tempfile.mkdtemp(prefix="kvcb"))
    directory = ChannelDirectory.create(base)
    ctx = mp.get_context("spawn")
    procs = []
    try:
        pipes = []
        for rank in range(workers):
            ours, theirs = ctx.Pipe()
            device = rank % args.devices
            proc = ctx.Process(
                target=_worker,
                args=(args.backend, device, rank, str(directory.path), theirs),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            pipes.append(ours)
        for pipe in pipes:
            if not pipe.poll(300) or pipe.recv() != "ready":
                raise RuntimeError("a worker did not start")
        coordinator = ChannelCoordinator(directory, world_size=workers)
        cpu0 = time.process_time()
        try:
            maps, unmaps = _time(coordinator, args.iters, args.warmup, args.batch)
        finally:
            coordinator.close()
        pages = (args.iters + args.warmup) * args.batch
        engine_cpu = (time.process_time() - cpu0) / pages
        worker_cpu = statistics.mean(p.recv() for p in pipes if p.poll(60)) / pages
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        directory.remove()
        shutil.rmtree(base, ignore_errors=True)
    return statistics.median(maps), statistics.median(unmaps), engine_cpu, worker_cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="host", choices=["host", "cuda", "hip"])
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    parser.add_argument(
        "--devices", type=int, default=1, help="GPUs to spread workers over (i -> i %% n)"
    )
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1, help="pages per map/unmap call")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]

    local_map, local_unmap = _local(args, pool_pages=0)
    pooled_map, pooled_unmap = _local(args, pool_pages=4)
    rows: list[dict[str, Any]] = []
    for n in counts:
        ch_map, ch_unmap, engine_cpu, worker_cpu = _channel(args, n)
        rows.append(
            {
                "workers": n,
                "map_ms": ch_map * 1e3,
                "unmap_ms": ch_unmap * 1e3,
                "map_ratio": ch_map / local_map,
                "unmap_ratio": ch_unmap / local_unmap,
                "engine_cpu_ms": engine_cpu * 1e3,
                "worker_cpu_ms": worker_cpu * 1e3,
            }
        )
    header = (
        f"backend={args.backend} devices={args.devices} batch={args.batch} "
        f"iters={args.iters} (medians per page)"
    )
    print(header)
    print(
        f"local mapper in-process, no pool (the baseline): map {local_map * 1e3:.3f} ms, "
        f"unmap {local_unmap * 1e3:.3f} ms; with its default pool: map "
        f"{pooled_map * 1e3:.3f} ms, unmap {pooled_unmap * 1e3:.3f} ms"
    )
    print(
        "| workers | map ms/page | unmap ms/page | map vs local | unmap vs local "
        "| engine CPU ms/page/cycle | worker CPU ms/page/cycle |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['map_ms']:.3f} | {r['unmap_ms']:.3f} | "
            f"{r['map_ratio']:.1f}x | {r['unmap_ratio']:.1f}x | "
            f"{r['engine_cpu_ms']:.3f} | {r['worker_cpu_ms']:.3f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "local": {"map_ms": local_map * 1e3, "unmap_ms": local_unmap * 1e3},
                    "local_pooled": {"map_ms": pooled_map * 1e3, "unmap_ms": pooled_unmap * 1e3},
                    "channel": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
