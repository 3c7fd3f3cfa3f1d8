"""One vLLM engine on a GPU, greedy over a fixed prompt mix; prints a JSON report last.

Run as a subprocess by ``test_gpu_serving.py`` (one engine per process, so each run starts
on a clean GPU and its shutdown is observable from outside). The prompt mix is seeded token
ids: short and long prompts, and a shared prefix whose later requests hit the prefix cache
(a second wave, submitted once the first finished). While the engine serves, the driver's
free memory is sampled every step (``torch.cuda.mem_get_info``: device-wide, so it sees the
engine core process's mappings), and once the queue has drained. With ``--lower-limit``, the
idle engine's limit is then lowered with ``kvctl limit`` (its cached blocks still mapped), and
a third wave (the second's prompts) runs under it before the limit is lifted.

    python tests/engines/vllm/gpu_generate.py --model DIR [--elastic] [--kvcore-config JSON]
        [--enforce-eager] [--attention-backend TRITON_ATTN] [--max-num-seqs N] ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from typing import Any


def prompt_mix(seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of token-id prompts: the first mixes 12 short (8-64 tokens), 4 long
    (1000-3000) and 4 that share a 600-token prefix; the second repeats that prefix with
    new suffixes and two first-wave prompts whole (prefix-cache hits)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    prefix = ids(600)
    first = [ids(rng.randrange(8, 65)) for _ in range(12)]
    first += [ids(rng.randrange(1000, 3001)) for _ in range(4)]
    first += [prefix + ids(rng.randrange(4, 40)) for _ in range(4)]
    second = [prefix + ids(rng.randrange(4, 40)) for _ in range(6)] + [first[0], first[13]]
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--kvcore-config", default=None, help="JSON for --kvcore-config")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ledger-peers",
        type=int,
        default=0,
        help="after the first wave, wait until the gpu_ledger of --kvcore-config lists this "
        "many live instances holding memory, and report them",
    )
    parser.add_argument(
        "--lower-limit",
        type=float,
        default=0.0,
        help="after the second wave, kvctl-limit this (only) instance of the gpu_ledger of "
        "--kvcore-config to this fraction of what it maps while idle, report how its memory "
        "follows, serve the second wave again under the limit, then lift it",
    )
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=args.model,
        load_format="dummy",
        seed=args.seed,
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if args.kv_cache_memory_bytes:  # a fixed KV size: vLLM skips its memory profiling
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if args.no_async_scheduling:
        kwargs["async_scheduling"] = False
    if args.elastic:
        kwargs["kvcore_elastic"] = True
        if args.kvcore_config:
            kwargs["kvcore_config"] = json.loads(args.kvcore_config)

    def free() -> int:
        return int(torch.cuda.mem_get_info()[0])

    t0 = time.monotonic()
    before_start = free()
    llm = LLM(**kwargs)
    started = time.monotonic() - t0
    engine = llm.llm_engine
    vocab = engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    samples: list[tuple[float, str, int]] = [(0.0, "idle", free())]
    outputs: dict[str, list[int]] = {}
    order: list[str] = []

    def run_wave(prompts: list[list[int]], tag: str) -> None:
        for i, p in enumerate(prompts):
            rid = f"{tag}-{i}"
            order.append(rid)
            engine.add_request(rid, {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            samples.append((time.monotonic() - t0, tag, free()))

    first, second = prompt_mix(args.seed, vocab)
    run_wave(first, "a")
    peers = _wait_for_peers(args) if args.ledger_peers else []
    time.sleep(1.0)  # freed pages unmap on kvcore's page thread
    samples.append((time.monotonic() - t0, "drained", free()))
    run_wave(second, "b")
    time.sleep(1.0)
    samples.append((time.monotonic() - t0, "drained", free()))
    steer = _steer(args, lambda: run_wave(second, "c"), free) if args.lower_limit else {}
    metrics = {}
    try:
        for m in llm.get_metrics():
            if "prefix_cache" in m.name or "preemptions" in m.name:
                metrics[m.name] = getattr(m, "value", None)
    except Exception as exc:  # metrics are informative only
        metrics["error"] = repr(exc)
    report = {
        "elastic": args.elastic,
        "kvcore_config": args.kvcore_config,
        "enforce_eager": args.enforce_eager,
        "attention_backend": args.attention_backend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0"),
        "start_s": started,
        "free_before_start": before_start,
        "samples": samples,
        "metrics": metrics,
        "peers": peers,
        "steer": steer,
        "tokens": [outputs[r] for r in order],
    }
    print("KVCORE-REPORT " + json.dumps(report))


def _wait_for_peers(args: argparse.Namespace, timeout: float = 300.0) -> list[tuple[str, int]]:
    """``(name, mapped bytes)`` of the live records of the ledger(s) in ``--kvcore-config``'s
    ``ledger_dir`` once ``--ledger-peers`` of them hold memory (or at the timeout)."""
    from pathlib import Path

    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_file import list_ledgers

    directory = Path(json.loads(args.kvcore_config)["ledger_dir"])
    deadline = time.monotonic() + timeout
    seen: list[tuple[str, int]] = []
    while time.monotonic() < deadline:
        seen = []
        for path in list_ledgers(directory):
            ledger = GpuLedger.open_path(path)
            try:
                seen += [(r.name, r.mapped) for r in ledger.snapshot().records if r.mapped > 0]
            finally:
                ledger.close()
        if len(seen) >= args.ledger_peers:
            break
        time.sleep(0.5)
    return seen


def _steer(args: argparse.Namespace, serve: Any, free: Any, timeout: float = 30.0) -> dict:
    """Lower the limit of the one instance in the ledger of ``--kvcore-config`` to
    ``--lower-limit`` of what it maps, with ``kvctl limit`` as a user would, while the engine
    is idle; sample ``(seconds, mapped bytes, free device bytes)`` until it is within the
    limit (or ``timeout``); then ``serve`` under the limit, sampling the peak, and lift it."""
    from pathlib import Path

    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_file import list_ledgers
    from kvcore.cli import kvctl

    directory = Path(json.loads(args.kvcore_config)["ledger_dir"])
    (path,) = list_ledgers(directory)
    ledger = GpuLedger.open_path(path)
    try:
        (record,) = ledger.snapshot().records

        def mapped() -> int:
            found = ledger.snapshot().find(record.name)
            return found.mapped if found is not None else -1

        before = mapped()
        limit = int(before * args.lower_limit)
        ctl = ["--dir", str(directory), "limit", record.name]
        t0 = time.monotonic()
        rc = kvctl.main([*ctl, str(limit)])
        shed: list[tuple[float, int, int]] = [(0.0, before, free())]
        while time.monotonic() - t0 < timeout:
            time.sleep(0.1)
            shed.append((time.monotonic() - t0, mapped(), free()))
            if 0 <= shed[-1][1] <= limit:
                break
        peak = [mapped()]
        serve_done = threading.Event()

        def sample() -> None:
            while not serve_done.wait(0.02):
                peak.append(mapped())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            serve()
        finally:
            serve_done.set()
            sampler.join()
        lifted = kvctl.main([*ctl, "none"])
        return {"rc": rc, "lifted_rc": lifted, "before": before, "limit": limit,
                "shed": shed, "peak_under_limit": max(peak)}  # fmt: skip
    finally:
        ledger.close()


if __name__ == "__main__":
    main()
