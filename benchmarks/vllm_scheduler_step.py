"""vLLM scheduler step time with elastic KV on vs upstream's block pool, on CPU.

Issue 6's figure: the real vLLM ``Scheduler`` (kvcore-patched release installed) runs the
same workload twice per repeat, once with vLLM's own ``BlockPool`` and once with kvcore's
``ElasticBlockPool`` on the ``host`` backend (2 MiB pages, real mmap map/unmap on the
scheduler thread when the reserve is empty). One step is ``schedule()`` plus
``update_from_output()`` with a fake model output (one token per scheduled request). Goal:
elastic-on median step time <= 1.1x upstream.

Workload: ``--requests`` requests of ``--prompt`` tokens (half share a 50% prefix, so prefix
caching hits and evicts) generating ``--tokens`` tokens each, at most 32 running;
``--blocks`` KV blocks of 64 KiB (16 tokens, 8 KV heads x 128, fp16, one layer).

    python benchmarks/vllm_scheduler_step.py [--repeats 5] [--json F]

Run it in the ``test-vllm-0.33`` nox venv (needs the forked vLLM wheel). Reports the median
over repeats of each mode's median step time, and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engines" / "vllm"))
_HUB = Path(tempfile.mkdtemp(prefix="kvcore-bench-hub-"))
os.environ.update(
    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", HF_HUB_CACHE=str(_HUB)
)

from hf_configs import write_hub_cache  # noqa: E402

write_hub_cache(_HUB)

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.float16)


def _scheduler(num_blocks: int, elastic: bool) -> Scheduler:
    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0, max_model_len=2048)
    sched = SchedulerConfig(
        max_num_seqs=32,
        max_num_batched_tokens=4096,
        max_model_len=2048,
        enable_chunked_prefill=True,
        async_scheduling=False,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache)
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], SPEC)],
    )
    if elastic:
        kv.kvcore = {"backend": "host", "backend_options": {"device_bytes": 8 << 30}}
    cache.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(config)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=BLOCK,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
    )


def _requests(n: int, prompt: int, tokens: int) -> list[Request]:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    shared = list(range(10_000, 10_000 + prompt // 2))
    out = []
    for i in range(n):
        unique = [i * 7 + 1] * (prompt - len(shared)) if i % 2 else [i * 7 + 1] * prompt
        ids = [*shared, *unique] if i % 2 else unique
        out.append(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=ids[:prompt],
                sampling_params=SamplingParams(max_tokens=tokens, ignore_eos=True),
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    return out


def run_once(args: argparse.Namespace, elastic: bool) -> dict[str, Any]:
    scheduler = _scheduler(args.blocks, elastic)
    for r in _requests(args.requests, args.prompt, args.tokens):
        scheduler.add_request(r)
    times: list[float] = []
    clock = time.perf_counter
    while scheduler.has_unfinished_requests():
        t0 = clock()
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(out, runner)
        times.append(clock() - t0)
    pool = scheduler.kv_cache_manager.block_pool
    del scheduler
    gc.collect()
    return {
        "steps": len(times),
        "median_us": statistics.median(times) * 1e6,
        "pool": type(pool).__name__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run_once(args, False)  # warm-up (imports, caches)
    run_once(args, True)
    results: dict[str, list[dict[str, Any]]] = {"upstream": [], "elastic": []}
    for _ in range(args.repeats):  # interleaved, so drift hits both modes alike
        results["upstream"].append(run_once(args, False))
        results["elastic"].append(run_once(args, True))
    up = statistics.median(r["median_us"] for r in results["upstream"])
    el = statistics.median(r["median_us"] for r in results["elastic"])
    steps = results["upstream"][0]["steps"], results["elastic"][0]["steps"]
    print(
        f"vLLM scheduler step (schedule + update_from_output), {args.repeats} repeats, "
        f"steps per run upstream/elastic: {steps[0]}/{steps[1]}"
    )
    print(f"  upstream BlockPool       median step {up:9.1f} us")
    print(f"  kvcore ElasticBlockPool  median step {el:9.1f} us")
    print(f"  ratio elastic/upstream   {el / up:.3f}  (goal <= 1.10)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "upstream_us": up,
                    "elastic_us": el,
                    "ratio": el / up,
                    "runs": results,
                    "args": vars(args) | {"json": None},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
