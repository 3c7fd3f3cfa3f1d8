"""vLLM scheduler step time with elastic KV on vs upstream's block pool, on CPU.

Issue 6's figure: the real vLLM ``Scheduler`` (kvcore-patched release installed) runs the
same workload once per repeat in each mode, with vLLM's own ``BlockPool`` and with kvcore's
``ElasticBlockPool`` on the ``host`` backend (2 MiB pages, real mmap map/unmap on the
scheduler thread when the reserve is empty). One step is ``schedule()`` plus
``update_from_output()`` with a fake model output (one token per scheduled request). Goal:
elastic-on median step time <= 1.1x upstream.

Workload: ``--requests`` requests of ``--prompt`` tokens (half share a 50% prefix, so prefix
caching hits and evicts) generating ``--tokens`` tokens each, at most 32 running;
``--blocks`` KV blocks of 64 KiB (16 tokens, 8 KV heads x 128, fp16, one layer).

    .nox/test-vllm-0-33/bin/python -m benchmarks.vllm_scheduler_step [--repeats 15] [--json F]

Run it in the ``test-vllm-0.33`` nox venv (needs the forked vLLM wheel). The scheduler,
requests and step are built by ``harness.vllm.scheduler``'s ``make_scheduler``,
``make_request`` and ``step`` (the builders of kvcore's scheduler tests). The modes alternate
repeat by repeat (which goes first alternates too); each run records every step's wall and
thread-CPU time. Reported: per mode the median over repeats of the run's median step time,
and the ratio as the median of the per-repeat ratios (adjacent runs, the same load).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks._provenance import commit, now
from harness.vllm import write_hub
from harness.vllm.scheduler import SPEC_64K, make_request, make_scheduler, step

if TYPE_CHECKING:
    from vllm.v1.request import Request

KVCORE = {"backend": "host", "backend_options": {"device_bytes": 8 << 30}}
MODES = ("upstream", "elastic")


def _requests(n: int, prompt: int, tokens: int) -> list[Request]:
    shared = list(range(10_000, 10_000 + prompt // 2))
    out = []
    for i in range(n):
        unique = [i * 7 + 1] * (prompt - len(shared)) if i % 2 else [i * 7 + 1] * prompt
        ids = [*shared, *unique] if i % 2 else unique
        out.append(make_request(f"r{i}", ids[:prompt], max_tokens=tokens))
    return out


def run_once(args: argparse.Namespace, elastic: bool) -> dict[str, Any]:
    """One full workload; every step's wall and thread-CPU time (us)."""
    scheduler = make_scheduler(
        args.blocks,
        caching=True,
        max_num_seqs=32,
        max_batched=4096,
        kvcore=KVCORE,
        elastic=elastic,
        spec=SPEC_64K,
    )
    for r in _requests(args.requests, args.prompt, args.tokens):
        scheduler.add_request(r)
    wall: list[float] = []
    cpu: list[float] = []
    clock, cpu_clock = time.perf_counter, time.thread_time
    while scheduler.has_unfinished_requests():
        t0, c0 = clock(), cpu_clock()
        step(scheduler)
        wall.append(clock() - t0)
        cpu.append(cpu_clock() - c0)
    pool = type(scheduler.kv_cache_manager.block_pool).__name__
    shutdown = getattr(scheduler, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del scheduler
    gc.collect()
    return {
        "steps": len(wall),
        "median_us_wall": statistics.median(wall) * 1e6,
        "median_us_cpu": statistics.median(cpu) * 1e6,
        "pool": pool,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    write_hub()
    for mode in MODES:  # warm-up (imports, caches)
        run_once(args, mode == "elastic")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(args.repeats):  # interleaved, so drift hits both modes alike
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            runs[mode].append(run_once(args, mode == "elastic"))
    summary: dict[str, Any] = {}
    for clock in ("wall", "cpu"):
        key = f"median_us_{clock}"
        up = [r[key] for r in runs["upstream"]]
        el = [r[key] for r in runs["elastic"]]
        summary[clock] = {
            "upstream_us": round(statistics.median(up), 1),
            "elastic_us": round(statistics.median(el), 1),
            "ratio": round(statistics.median(e / u for e, u in zip(el, up, strict=True)), 3),
        }
    steps = runs["upstream"][0]["steps"], runs["elastic"][0]["steps"]
    print(
        f"vLLM scheduler step (schedule + update_from_output), {args.repeats} repeats, "
        f"steps per run upstream/elastic: {steps[0]}/{steps[1]}"
    )
    for clock, s in summary.items():
        print(
            f"  {clock:4s} upstream BlockPool {s['upstream_us']:9.1f} us   kvcore "
            f"ElasticBlockPool {s['elastic_us']:9.1f} us   elastic/upstream {s['ratio']:.3f}"
            "  (goal <= 1.10)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "commit": commit("kvcore", "harness", "benchmarks/vllm_scheduler_step.py"),
                    "date": now(),
                    "summary": summary,
                    "runs": runs,
                    "args": vars(args) | {"json": None},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
