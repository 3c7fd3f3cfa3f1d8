"""vLLM's real scheduler over kvcore's elastic pool (forked wheel, host backend), on CPU.

Everything vLLM-side is the release's own code: ``Scheduler``, ``KVCacheManager``, the
coordinator that builds the pool through the patch seam, ``Request`` and the block hasher.
Only the model runner is absent: ``step`` builds each step's ``ModelRunnerOutput`` (one
sampled token per scheduled request), which is what vLLM's own scheduler tests do. The
scheduler's ``ModelConfig`` names ``facebook/opt-125m``, read from the hub cache of
``harness.vllm`` (``write_hub()`` fills it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcore.adapters.vllm import memory_for
from kvcore.budget.gate import MemoryGate

BLOCK = 16  # tokens per block
GRAN = 4096  # host backend granularity: one page
# FullAttentionSpec(16 tokens, 1 head, head size 4, float32): 2*16*4*4 = 512 B per block
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32)
BLOCK_BYTES = 512
BPP = GRAN // BLOCK_BYTES  # 8 blocks per page
# the benchmarks' block: 16 tokens x 8 KV heads x head size 128, fp16 (a Llama-3-8B layer's),
# 2*16*8*128*2 = 64 KiB
SPEC_64K = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.float16)

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def host_settings(**options: Any) -> dict[str, Any]:
    """kvcore settings on the host backend with ``GRAN`` pages, updated with ``options``."""
    base: dict[str, Any] = {"backend": "host", "backend_options": {"granularity": GRAN}}
    base.update(options)
    return base


def vllm_config(
    *,
    caching: bool = False,
    max_num_seqs: int = 16,
    max_batched: int = 2048,
    async_scheduling: bool = False,
) -> VllmConfig:
    """The ``VllmConfig`` of the scheduler tests: a small OPT model config (dummy, offline),
    chunked prefill, ``BLOCK``-token blocks, prefix caching if ``caching``."""
    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=42, max_model_len=2048)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=caching)
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache)
    config.scheduler_config.async_scheduling = async_scheduling  # on CPU vLLM turns it off
    return config


def kv_cache_config(num_blocks: int, spec: FullAttentionSpec = SPEC) -> KVCacheConfig:
    """One KV group (layer ``"layer"``) of ``num_blocks`` blocks of ``spec``; no kvcore
    settings (set ``.kvcore`` for elastic KV)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def make_scheduler(
    num_blocks: int,
    *,
    caching: bool = False,
    max_num_seqs: int = 16,
    max_batched: int = 2048,
    kvcore: dict[str, Any] | None = None,
    elastic: bool = True,
    gate: MemoryGate | None = None,
    spec: FullAttentionSpec = SPEC,
    async_scheduling: bool = False,
) -> Scheduler:
    """The real vLLM scheduler over ``num_blocks`` blocks of ``spec`` (one KV group), with
    kvcore's elastic pool (``kvcore`` settings; default: ``host_settings()``) unless
    ``elastic=False``; vLLM's ``AsyncScheduler`` with ``async_scheduling`` (the caller then
    keeps two batches in flight, as the engine core does)."""
    config = vllm_config(
        caching=caching,
        max_num_seqs=max_num_seqs,
        max_batched=max_batched,
        async_scheduling=async_scheduling,
    )
    kv = kv_cache_config(num_blocks, spec)
    if elastic:
        kv.kvcore = kvcore if kvcore is not None else host_settings()
    config.cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(config)
    if gate is not None:  # the worker side first, as in an engine core: the pool shares it
        memory_for(kv, gate=gate)
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=BLOCK,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )


def make_request(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=_HASHER,
    )


def model_output(
    out: Any, sampled: Callable[[str], list[int]] = lambda _: [7]
) -> ModelRunnerOutput:
    """A stand-in model's output for the batch ``out`` (a ``SchedulerOutput``): the tokens
    ``sampled(request_id)`` for each scheduled request (default: token 7)."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[sampled(r) for r in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def step(scheduler: Scheduler) -> Any:
    """One scheduler step with a fake model output: one token per scheduled request."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(out))
    return out
