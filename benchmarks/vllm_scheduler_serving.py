"""vLLM's scheduler under a serving-shaped load, elastic KV against upstream, in lockstep, on CPU.

What a CPU-bound engine core pays for elastic KV per step (a small model at saturation, where
the scheduler's thread bounds the step): vLLM 0.33.0's real ``AsyncScheduler`` (two batches
in flight, kvcore's release fence on) with prefix caching, ``--max-num-seqs`` running and
``--max-batched`` tokens a step, over one KV group of 64 KiB blocks (the Qwen3-0.6B shape's
block of one layer) on kvcore's ``host`` backend (2 MiB pages: 32 blocks a page).
``--requests`` random prompts of ``--prompt`` tokens, ``--tokens`` generated each, all
submitted at once: the first pass fills the prefix cache (every later allocation evicts a
cached block, as in a warm server; some requests are preempted), then ``--passes`` measured
passes of new prompts.

Two schedulers, upstream's ``BlockPool`` and kvcore's ``ElasticBlockPool``, run in one
process over identical requests and are stepped alternately (which goes first flips every
step), each step's thread CPU time recorded: drift of the machine's speed hits both alike.
One step is ``schedule()`` of the next batch plus ``update_from_output()`` of the oldest one
in flight, with a stand-in model output (one token per request past its prefill).

``--gates`` picks what the elastic side runs under, one lockstep run each:

* ``none``: kvcore's defaults, logical capacity = physical (``--blocks``);
* ``limit``: twice the logical capacity, ``limit_bytes`` = the pages of ``--blocks``
  (a budget below the planned capacity, as when several instances share a GPU);
* ``ledger``: the same under the per-GPU ledger (``gpu_ledger``, a private ``ledger_dir``),
  whose gate reads a shared file.

Reported per gate and pass: the elastic / upstream ratio of the pass's total thread CPU and
of the median step, and the median over the measured passes.

    .nox/test-vllm-0-33/bin/python -m benchmarks.vllm_scheduler_serving [--json F]

Run it in the ``test-vllm-0.33`` nox venv (the forked vLLM wheel, CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._provenance import commit, now
from harness.vllm import write_hub
from harness.vllm.scheduler import SPEC_64K, make_request, make_scheduler, model_output

PAGE = 2 << 20
BLOCKS_PER_PAGE = PAGE // (64 << 10)
GATES = ("none", "limit", "ledger")


def _scheduler(args: argparse.Namespace, kvcore: dict[str, Any] | None, blocks: int) -> Any:
    return make_scheduler(
        blocks,
        caching=True,
        max_num_seqs=args.max_num_seqs,
        max_batched=args.max_batched,
        kvcore=kvcore,
        elastic=kvcore is not None,
        spec=SPEC_64K,
        async_scheduling=True,
    )


def _elastic(args: argparse.Namespace, gate: str, ledger_dir: str) -> Any:
    settings: dict[str, Any] = {
        "backend": "host",
        "backend_options": {"device_bytes": 8 << 30},
        "release_fence": True,
    }
    blocks = args.blocks
    if gate != "none":  # twice the plan, the physical pages of --blocks (the null's page too)
        blocks = 2 * args.blocks
        settings["limit_bytes"] = (-(-args.blocks // BLOCKS_PER_PAGE) + 1) * PAGE
    if gate == "ledger":
        settings.update(gpu_ledger=True, ledger_dir=ledger_dir)
    return _scheduler(args, settings, blocks)


class _Driver:
    """One scheduler with vLLM's batch queue of two: the next batch is scheduled before the
    oldest one's output is processed (async scheduling)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.pending: Any = None
        self.times: list[float] = []

    def busy(self) -> bool:
        return self.pending is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> None:
        s = self.scheduler
        c0 = time.thread_time()
        new = s.schedule() if s.has_unfinished_requests() else None
        if new is not None:
            chunks = {r for r in new.num_scheduled_tokens if s.requests[r].is_prefill_chunk}
            new = (new, chunks)
        if self.pending is not None:  # no token for a request still in its prefill
            out, chunks = self.pending
            s.update_from_output(out, model_output(out, lambda r: [] if r in chunks else [7]))
        self.pending = new
        self.times.append(time.thread_time() - c0)


def _requests(args: argparse.Namespace, seed: int, tag: str) -> list[Any]:
    rng = random.Random(seed)
    return [
        make_request(
            f"{tag}{i}", [rng.randrange(1, 50_000) for _ in range(args.prompt)], args.tokens
        )
        for i in range(args.requests)
    ]


def run_gate(args: argparse.Namespace, gate: str) -> list[dict[str, Any]]:
    """The passes of one lockstep run; per pass the two sides' step counts and times."""
    with tempfile.TemporaryDirectory(prefix="kvcore-bench-ledger-") as ledger_dir:
        upstream = _Driver(_scheduler(args, None, args.blocks))
        elastic = _Driver(_elastic(args, gate, ledger_dir))
        passes = []
        try:
            for p in range(args.passes + 1):  # pass 0 fills the prefix cache
                for d in (upstream, elastic):
                    for r in _requests(args, 1000 + p, f"p{p}-"):
                        d.scheduler.add_request(r)
                    d.times = []
                gc.collect()
                i = 0
                while upstream.busy() or elastic.busy():
                    pair = (upstream, elastic) if i % 2 == 0 else (elastic, upstream)
                    for d in pair:
                        if d.busy():
                            d.step()
                    i += 1
                up, el = upstream.times, elastic.times
                passes.append(
                    {
                        "pass": p,
                        "steps": [len(up), len(el)],
                        "total_s": [sum(up), sum(el)],
                        "median_us": [statistics.median(up) * 1e6, statistics.median(el) * 1e6],
                        "total_ratio": sum(el) / sum(up),
                        "median_ratio": statistics.median(el) / statistics.median(up),
                    }
                )
                print(
                    f"  {gate:6s} pass {p}{' (fill)' if p == 0 else '       '}: steps "
                    f"{len(up)}/{len(el)}, median step upstream {statistics.median(up) * 1e6:6.0f}"
                    f" us, elastic/upstream total {passes[-1]['total_ratio']:.3f}, median "
                    f"step {passes[-1]['median_ratio']:.3f}",
                    flush=True,
                )
        finally:
            for d in (upstream, elastic):
                d.scheduler.shutdown()
    return passes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gates", nargs="+", default=list(GATES), choices=GATES)
    parser.add_argument("--passes", type=int, default=3, help="measured, after the fill")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched", type=int, default=8192)
    parser.add_argument(
        "--blocks", type=int, default=11_712, help="20 GiB of the Qwen3-0.6B shape, per layer"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    write_hub()
    results = {}
    for gate in args.gates:
        passes = run_gate(args, gate)
        measured = passes[1:]
        results[gate] = {
            "passes": passes,
            "total_ratio": statistics.median(p["total_ratio"] for p in measured),
            "median_ratio": statistics.median(p["median_ratio"] for p in measured),
        }
        print(
            f"{gate:6s}: elastic/upstream thread CPU per pass {results[gate]['total_ratio']:.3f},"
            f" median step {results[gate]['median_ratio']:.3f} (medians of {len(measured)})"
        )
    if args.json:
        doc = {
            "commit": commit("kvcore", "harness", "benchmarks/vllm_scheduler_serving.py"),
            "date": now(),
            "args": vars(args) | {"json": None},
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
