"""vLLM's start-up warm-up on elastic KV: hand-built batches write only backed blocks.

Before the scheduler exists, ``Worker.compile_or_warm_up_model`` runs batches it builds by
hand through ``Worker.execute_model``: the V2 model runner's ``warmup_kernels`` and the
mixed prefill+decode step of ``kernel_warmup`` (``run_mixed_prefill_decode_warmup``). Their
requests carry block ids 1, 2, 3, ... that no block pool handed out. Upstream every block
is backed, so that is harmless; with elastic KV those blocks lie on pages nobody mapped
(kvcore's read-only zero page), and the first KV store faults: an illegal memory access in
the attention kernel.

The warm-up needs kernels compiled and tuned for its batch shapes, not distinct KV: nothing
reads its KV afterwards. So while the worker warms up, ``warmup_blocks`` folds every
non-null block id of those batches onto the blocks of the page that backs vLLM's null
block (block 0), which every elastic memory maps before the warm-up starts
(``ElasticKVMemory`` reserves block 0 in its ledger; a TP x PP rank maps that page itself).
Block tables keep their shapes, so the same kernels and CUDA graphs are exercised; no page
is mapped and nothing is charged to the memory gate, so a tight ``limit_bytes`` or a full
GPU budget cannot fail the start. Where that page holds only the null block, every id
folds onto block 0, which vLLM's own dummy runs already write.

Invariant kept: after the warm-up, the folded-onto blocks hold garbage and are free; a
request that is later handed one writes its KV before reading it (prefix-cache hits only
name blocks a request computed), as on upstream after its warm-up. The profiling and CUDA
graph dummy runs (``_dummy_run``) never pass through ``execute_model`` with block ids and
are left alone: their zero-filled slot mappings store into block 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["fold_scheduler_output", "fold_target", "warmup_blocks"]


def fold_target(blocks: Sequence[int]) -> Callable[[int], int]:
    """The block id map for a warm-up whose backed blocks are ``blocks`` (block 0 first,
    then the free blocks on its page): 0 stays 0; any other id lands on one of the free
    blocks, round robin, or on 0 when there is none. Raises ``ValueError`` when ``blocks``
    does not start with the null block."""
    if not blocks or blocks[0] != 0:
        raise ValueError(f"warm-up blocks must start with the null block 0, got {blocks!r}")
    spare = tuple(blocks[1:])
    if not spare:
        return lambda block_id: 0
    n = len(spare)
    return lambda block_id: 0 if block_id == 0 else spare[(block_id - 1) % n]


def fold_scheduler_output(scheduler_output: Any, fold: Callable[[int], int]) -> None:
    """Rewrite, in place, every block id a (hand-built) ``SchedulerOutput`` hands the model
    runner: the new requests' ``block_ids`` and the running requests' ``new_block_ids``,
    each a tuple of per-KV-cache-group id lists."""
    for req in scheduler_output.scheduled_new_reqs:
        req.block_ids = _fold_groups(req.block_ids, fold)
    cached = scheduler_output.scheduled_cached_reqs
    new_block_ids = getattr(cached, "new_block_ids", None)
    if new_block_ids:
        cached.new_block_ids = [
            None if groups is None else _fold_groups(groups, fold) for groups in new_block_ids
        ]


@contextlib.contextmanager
def warmup_blocks(worker: Any) -> Iterator[None]:
    """Scope of ``worker.compile_or_warm_up_model`` with elastic KV on: inside it,
    ``worker.execute_model`` folds each batch's block ids onto backed blocks
    (``fold_scheduler_output``) before calling vLLM's own ``execute_model``; on exit the
    worker's own method is back. Raises ``KvcoreError`` when this process holds no elastic
    KV memory for the worker's KV cache (the buffer was not made through kvcore)."""
    fold = fold_target(_null_page_blocks(worker.model_runner.kv_cache_config))
    execute_model = worker.execute_model

    def folded_execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        fold_scheduler_output(scheduler_output, fold)
        return execute_model(scheduler_output, *args, **kwargs)

    shadowed = vars(worker).get("execute_model", _NOTHING)  # a wrapper set on the instance
    worker.execute_model = folded_execute_model  # an instance attribute shadows the method
    try:
        yield
    finally:
        if shadowed is _NOTHING:
            del worker.execute_model
        else:
            worker.execute_model = shadowed


_NOTHING = object()


def _fold_groups(
    groups: Sequence[Sequence[int]], fold: Callable[[int], int]
) -> tuple[list[int], ...]:
    return tuple([fold(b) for b in ids] for ids in groups)


def _null_page_blocks(kv_cache_config: Any) -> list[int]:
    """Block 0 and the blocks on its page that no ledger of this process holds."""
    from kvcore.adapters.vllm.parallel import parallel_settings, worker_memory
    from kvcore.adapters.vllm.runtime import existing_memory
    from kvcore.errors import KvcoreError

    if parallel_settings(kv_cache_config.kvcore) is not None:
        memory: Any = worker_memory(kv_cache_config)
        ledger = None  # a rank's pages are the engine's: before its pool, only page 0
    else:
        memory = existing_memory(kv_cache_config)
        ledger = None if memory is None else memory.ledger
    if memory is None:
        raise KvcoreError(
            "elastic KV: the worker warms up a KV cache kvcore did not allocate",
            hint="the patched allocate_kv_cache must build the KV buffer before the warm-up",
        )
    geometry = memory.geometry
    page = geometry.page_of(0)
    spare = [
        b
        for b in geometry.blocks_of(page)
        if b != 0 and (ledger is None or not ledger.is_allocated(b))
    ]
    return [0, *spare]
