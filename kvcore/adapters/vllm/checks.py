"""Start-up validation of a vLLM configuration for elastic KV.

``check_vllm_config(vllm_config, kv_cache_config)`` raises ``UnsupportedConfiguration``
naming the first setting elastic mode does not support yet, with what to change. It runs in
the engine core before any KV memory is allocated, so an unsupported engine never starts
half elastic: an unsupported setting fails at start-up, never falls back silently.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.vllm.groups import (
    engine_layout,
    engine_row_bytes,
    family_layout,
    kvcore_groups,
)
from kvcore.errors import UnsupportedConfiguration

__all__ = [
    "check_elastic_config",
    "check_kv_cache_config",
    "check_vllm_config",
    "resolved_reclaim",
    "scheduler_preempts_to_reclaim",
]


def check_vllm_config(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ``UnsupportedConfiguration`` for what elastic KV cannot run (see module doc)."""
    parallel = vllm_config.parallel_config
    # TP x PP > 1 runs through kvcore's worker channel (parallel.py); DP and PCP do not yet
    for name in ("data_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: {name}={size} is not supported yet (one scheduler "
                "drives one TP x PP group of workers)",
                hint=f"run with {name}=1, or without --kvcore-elastic",
            )
    ranks = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    executor = getattr(parallel, "distributed_executor_backend", None)
    if ranks > 1 and (executor != "mp" or int(getattr(parallel, "nnodes", 1) or 1) != 1):
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: TP x PP = {ranks} needs vLLM's multiprocessing executor on "
            f"one host (got distributed_executor_backend={executor!r}, "
            f"nnodes={getattr(parallel, 'nnodes', 1)}): kvcore's worker channel is local",
            hint="add --distributed-executor-backend mp on a single node",
        )
    if ranks > 1 and engine_layout(kv_cache_config) == "per-layer":
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: TP x PP = {ranks} with a layer-outermost KV cache layout: "
            "kvcore's worker channel serves block-outermost rows only",
            hint="unset VLLM_KV_CACHE_LAYOUT (elastic KV then resolves BLNHC) or set BLNHC",
        )
    # async scheduling is supported: freed pages wait behind fence.StepFence
    if vllm_config.kv_transfer_config is not None:
        raise UnsupportedConfiguration(
            "--kvcore-elastic: KV transfer / offloading (kv_transfer_config) is not "
            "supported: connectors move blocks behind the block pool's back",
            hint="drop --kv-transfer-config / --kv-offloading-size, or --kvcore-elastic",
        )
    check_kv_cache_config(kv_cache_config)


@functools.cache
def scheduler_preempts_to_reclaim() -> bool:
    """Whether this vLLM's ``Scheduler.schedule`` preempts the requests an elastic pool's
    ``requests_to_reclaim`` names (patch 0011, in every pinned release's series); without
    it, pages a neighbour's share or a lowered limit wants back drain as their requests
    finish. Read from the installed scheduler's source, once; ``False`` when it has none."""
    from vllm.v1.core.sched.scheduler import Scheduler

    try:
        return "requests_to_reclaim" in inspect.getsource(Scheduler.schedule)
    except (OSError, TypeError):
        return False


def resolved_reclaim(config: ElasticConfig) -> str:
    """``config.reclaim`` as this engine applies it: ``None`` becomes ``"preempt"`` where the
    scheduler has the seam (``scheduler_preempts_to_reclaim``), else ``"drain"``."""
    if config.reclaim is not None:
        return config.reclaim
    return "preempt" if scheduler_preempts_to_reclaim() else "drain"


def check_elastic_config(config: ElasticConfig) -> None:
    """Raise ``UnsupportedConfiguration`` for ``--kvcore-config`` keys this vLLM cannot
    apply: ``reclaim`` ``"preempt"`` on a release whose series has no preemption seam."""
    if config.reclaim == "preempt" and not scheduler_preempts_to_reclaim():
        raise UnsupportedConfiguration(
            '--kvcore-config reclaim="preempt": this vLLM\'s scheduler has no seam to '
            "preempt requests an elastic pool names (kvcore's patch 0011)",
            hint='drop "reclaim" (pages then drain as their requests finish) or set "drain"',
        )


def check_kv_cache_config(kv_cache_config: Any) -> None:
    """The part of ``check_vllm_config`` that reads only the ``KVCacheConfig``: every group
    has a kvcore layout (``groups.SUPPORTED_SPECS``: full attention, sliding window, MLA,
    Mamba, any mix of them) and the tensors place each layer where kvcore's layout puts it
    (one block-outermost row per block id, or one region per layer: ``groups.engine_layout``).
    Page sizes are not checked here (they depend on the worker's backend;
    ``runtime.elastic_settings`` pads the row when needed)."""
    kvcore_groups(kv_cache_config.kv_cache_groups)  # first: names a spec without a layout
    if engine_layout(kv_cache_config) == "per-layer":  # kvcore's row is one layer's cell
        row = int(kv_cache_config.kv_cache_tensors[0].block_stride)
    else:
        row = engine_row_bytes(kv_cache_config)
    # layouts and placements only: pages are planned per backend later (granularity = row)
    family_layout(kv_cache_config, granularity=row, pad=True, max_page_bytes=row)
