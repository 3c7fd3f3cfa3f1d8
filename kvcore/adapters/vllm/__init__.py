"""kvcore's vLLM adapter: the logic behind ``patches/vllm/<version>/``.

The patches are seams only (a flag, a settings carrier, the block pool's class, the KV
buffer's allocation); what they call is here:

* ``runtime`` — ``elastic_settings`` (start-up validation, the engine core),
  ``elastic_kv_buffer`` (the worker's KV buffer on a kvcore virtual tensor),
  ``elastic_block_pool_class`` (the scheduler's block pool);
* ``layouts`` — ``elastic_kv_cache_layouts`` (the engine core resolves a KV cache layout
  kvcore can back);
* ``warmup`` — ``warmup_blocks`` (the worker's start-up warm-up writes only backed blocks);
* ``idle`` — ``attach_engine_core`` (an idle engine core is woken to shed cached KV when a
  lowered limit asks for memory back);
* ``pool`` — ``ElasticBlockPool``, vLLM's own ``BlockPool`` over a kvcore ``BlockLedger``;
* ``checks`` — which vLLM configurations elastic KV supports.

Importing ``runtime`` does not import vLLM; ``pool`` does (it subclasses vLLM's class), and
``idle`` through it.
Importing this package routes kvcore's log records through vLLM's ``vllm`` logger
(``kvcore.adapters.engine_logging``), so they show in the engine's output.
"""

from kvcore.adapters.engine_logging import follow_engine_logger
from kvcore.adapters.vllm.layouts import elastic_kv_cache_layouts
from kvcore.adapters.vllm.runtime import (
    elastic_block_pool_class,
    elastic_kv_buffer,
    elastic_settings,
    memory_for,
)
from kvcore.adapters.vllm.warmup import warmup_blocks


def attach_engine_core(engine_core: object) -> object:
    """``kvcore.adapters.vllm.idle.attach_engine_core``, imported when called (it imports
    vLLM's block pool, which importing this package does not)."""
    from kvcore.adapters.vllm.idle import attach_engine_core as attach

    return attach(engine_core)


follow_engine_logger("vllm")

__all__ = [
    "attach_engine_core",
    "elastic_block_pool_class",
    "elastic_kv_buffer",
    "elastic_kv_cache_layouts",
    "elastic_settings",
    "memory_for",
    "warmup_blocks",
]
