"""Start-up validation of a vLLM configuration for elastic KV.

``check_vllm_config(vllm_config, kv_cache_config)`` raises ``UnsupportedConfiguration``
naming the first setting elastic mode does not support yet, with what to change. It runs in
the engine core before any KV memory is allocated, so an unsupported engine never starts
half elastic (DESIGN.md section 8: no silent fallback).
"""

from __future__ import annotations

from typing import Any

from kvcore.errors import UnsupportedConfiguration

__all__ = ["check_kv_cache_config", "check_vllm_config"]

_FULL_ATTENTION = "FullAttentionSpec"


def check_vllm_config(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ``UnsupportedConfiguration`` for what elastic KV cannot run (see module doc)."""
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: {name}={size} is not supported yet (single GPU worker "
                "only until the worker channel carries page transitions)",
                hint=f"run with {name}=1, or without --kvcore-elastic",
            )
    # async scheduling is supported: freed pages wait behind fence.StepFence
    if vllm_config.kv_transfer_config is not None:
        raise UnsupportedConfiguration(
            "--kvcore-elastic: KV transfer / offloading (kv_transfer_config) is not "
            "supported: connectors move blocks behind the block pool's back",
            hint="drop --kv-transfer-config / --kv-offloading-size, or --kvcore-elastic",
        )
    check_kv_cache_config(kv_cache_config)


def check_kv_cache_config(kv_cache_config: Any) -> None:
    """The part of ``check_vllm_config`` that reads only the ``KVCacheConfig``: one
    full-attention group in one block-outermost tensor."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: {len(groups)} KV cache groups (hybrid, sliding-window or "
            "Mamba layers) are not supported yet; only one full-attention group",
            hint="serve a model with full attention in every layer, or drop --kvcore-elastic",
        )
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != _FULL_ATTENTION:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: KV cache spec {kind} is not supported yet (MLA, sliding "
            "window, Mamba and other non-MHA/GQA caches)",
            hint="serve an MHA/GQA model, or drop --kvcore-elastic",
        )
    tensors = kv_cache_config.kv_cache_tensors
    if len(tensors) > 1 or any(t.block_stride < t.layer_stride for t in tensors):
        raise UnsupportedConfiguration(
            "--kvcore-elastic: the KV cache layout is layer-outermost; elastic KV maps one "
            "page per run of whole blocks and needs a block-outermost layout",
            hint="set VLLM_KV_CACHE_LAYOUT to a block-outermost layout (e.g. BLHNC)",
        )
