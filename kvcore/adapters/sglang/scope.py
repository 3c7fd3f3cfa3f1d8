"""The elastic scope: what the patched SGLang calls while it builds one rank's KV pools.

The patch series adds three seams to SGLang and this module is what they call:

* ``KVCacheConfigurator.configure`` (kv_cache_configurator.py) opens
  ``ElasticScope(config, device_index=...)`` around ``_init_pools`` when ``--kvcore-elastic``
  is on, and passes the allocator it built through ``scope.allocator(...)``;
* while the scope is open, ``memory_pool.KV_BUFFER_HOOK`` is ``scope.create_buffers``, which
  ``MHATokenToKVPool._create_buffers`` and ``MLATokenToKVPool._create_buffers`` call instead
  of ``torch.zeros``: the pool's buffers become kvcore virtual-tensor views, and the pool
  gets a ``kvcore_manager`` attribute;
* the scheduler's leak check reads ``conservation_available_size()`` from the allocator.
* where the series has it, ``memory_pool.MAMBA_STATE_HOOK`` is the scope:
  ``mamba_buffers`` / ``mamba_allocator`` give a ``MambaPool`` its conv/SSM state and slot
  allocator from kvcore (``kvcore.adapters.sglang.mamba``).

Everything here runs in the process of one TP rank and touches only that rank's memory:
no page operation crosses ranks. With a physical budget at TP > 1 the ranks' allocation
outcomes and physical room are agreed over the attention-TP CPU group
(``kvcore.parallel.agreement``: ``AgreedLedger`` for the token and paged allocators,
``agree`` of the hybrid SWA allocator and of the Mamba slot allocator; one ``Agreement``
per rank, so all of them go over one group and refresh together), so their schedulers stay
in step. A budget at PP > 1 is refused (``_check_ranks_agree`` says why).
Unsupported pool configurations raise ``UnsupportedConfiguration`` naming the setting.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
from typing import Any

import torch

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.sglang import eviction
from kvcore.adapters.sglang.allocators import elastic_token_allocator, is_elastic
from kvcore.adapters.sglang.eviction import eviction_asks_allocator
from kvcore.adapters.sglang.mamba import build_mamba_state, elastic_mamba_allocator
from kvcore.adapters.sglang.manager import ElasticKVManager
from kvcore.budget.shared_gate import SharedGate
from kvcore.errors import UnsupportedConfiguration
from kvcore.memory.slots import SlotStates
from kvcore.parallel.agreement import AgreedLedger, Agreement, RankAgreement, TorchGroupAgreement

__all__ = ["ElasticScope", "elastic_allocator"]

_SCOPES = itertools.count()

log = logging.getLogger(__name__)


class ElasticScope:
    """Context manager installing kvcore's buffer hook into SGLang's ``memory_pool``.

    ``config`` is the ``--kvcore-config`` value (dict, JSON or ``None``) or an
    ``ElasticConfig``. Managers created inside stay alive after the scope closes (the pools
    use them) and are closed by ``close()`` or at interpreter exit. ``agreement``: how this
    rank agrees allocation outcomes with its peers (``kvcore.parallel.agreement``); by default the
    attention-TP CPU group when a physical budget is set at TP > 1, else none. Raises
    ``UnsupportedConfiguration`` for ``reclaim`` ``"preempt"``: SGLang's scheduler has no
    seam to preempt for a neighbour, so its pages drain.
    """

    def __init__(
        self,
        config: ElasticConfig | dict[str, Any] | str | None,
        *,
        device_index: int = 0,
        agreement: RankAgreement | None = None,
    ) -> None:
        self.config = config if isinstance(config, ElasticConfig) else ElasticConfig.parse(config)
        if self.config.reclaim == "preempt":
            raise UnsupportedConfiguration(
                '--kvcore-config reclaim="preempt": SGLang\'s scheduler has no seam to '
                "preempt the requests an elastic pool names",
                hint='drop "reclaim" (pages then drain as their requests finish) or set "drain"',
            )
        self.device_index = device_index
        self.agreement = agreement
        self._agreed: Agreement | None = None
        self._agreed_known = False
        self.managers: list[ElasticKVManager] = []
        self.mamba_states: list[SlotStates] = []
        # one budget for every pool of this rank (hybrid SWA sub-pools, KV + Mamba state)
        self.gate = SharedGate()
        self._serial = next(_SCOPES)  # this rank's instance name in the per-GPU ledger
        self._previous: Any = None
        self._memory_pool: Any = None
        # before the scheduler builds its tree cache: the tree core radix eviction can wrap
        self._tree_core_set = eviction.choose_tree_core(self.config)
        atexit.register(self.close)

    def __enter__(self) -> ElasticScope:
        from sglang.srt.mem_cache import memory_pool

        if memory_pool.KV_BUFFER_HOOK is not None:
            raise UnsupportedConfiguration(
                "a kvcore elastic scope is already open in this process",
                hint="build one rank's pools at a time",
            )
        self._memory_pool = memory_pool
        memory_pool.KV_BUFFER_HOOK = self.create_buffers
        if hasattr(memory_pool, "MAMBA_STATE_HOOK"):  # the series' Mamba seam
            memory_pool.MAMBA_STATE_HOOK = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._memory_pool is not None:
            self._memory_pool.KV_BUFFER_HOOK = None
            if hasattr(self._memory_pool, "MAMBA_STATE_HOOK"):
                self._memory_pool.MAMBA_STATE_HOOK = None
            self._memory_pool = None

    # -- seams ---------------------------------------------------------------------------

    def create_buffers(self, pool: Any) -> None:
        """Give ``pool`` (an ``MHATokenToKVPool`` or ``MLATokenToKVPool`` being built) kvcore
        buffers instead of ``torch.zeros`` ones. Raises ``UnsupportedConfiguration`` for any
        other pool class or layout."""
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        kind = type(pool)
        if kind is MHATokenToKVPool:
            self._check_mha(pool)
            rows = pool.size + pool.page_size
            k_row = (pool.head_num, pool.head_dim)
            v_row = (pool.head_num, pool.v_head_dim)
            if k_row != v_row:
                raise UnsupportedConfiguration(
                    f"kvcore elastic KV needs equal K and V head dims, got {pool.head_dim} "
                    f"and {pool.v_head_dim}"
                )
            manager = self._manager(pool, kv_buffers=2, row=k_row, rows=rows)
            dt = pool.store_dtype
            pool.k_buffer = [manager.buffer(layer, 0, dt, k_row) for layer in range(pool.layer_num)]
            pool.v_buffer = [manager.buffer(layer, 1, dt, v_row) for layer in range(pool.layer_num)]
        elif kind is MLATokenToKVPool:
            self._check_common(pool)
            rows = pool.size + pool.page_size
            row = (1, pool.kv_cache_dim)
            manager = self._manager(pool, kv_buffers=1, row=row, rows=rows)
            dt = pool.store_dtype
            pool.kv_buffer = [manager.buffer(layer, 0, dt, row) for layer in range(pool.layer_num)]
        else:
            raise UnsupportedConfiguration(
                f"kvcore elastic KV does not support SGLang's {kind.__name__}",
                hint="supported pools: MHATokenToKVPool and MLATokenToKVPool (unquantized, "
                "NHD layout); start without --kvcore-elastic",
            )
        pool.kvcore_manager = manager

    def allocator(self, upstream: Any) -> Any:
        """The elastic equivalent of the allocator SGLang built over a kvcore pool
        (``elastic_allocator``); with an agreement (see the
        class), its ledgers are wrapped in ``AgreedLedger``, or the hybrid SWA allocator
        agrees its pairs (a collective: every rank calls this at the same point)."""
        alloc = elastic_allocator(upstream)
        if self.config.max_cached_tokens is not None and not (
            hasattr(alloc, "kvcore_step") or eviction_asks_allocator()
        ):
            raise UnsupportedConfiguration(
                f"--kvcore-config max_cached_tokens with SGLang's {type(upstream).__name__} "
                "on this SGLang: neither the scheduler's kvcore_step nor its pre-allocation "
                "eviction reaches the allocator, so the bound would not hold",
                hint="drop max_cached_tokens from --kvcore-config, or use SGLang >= 0.5.23",
            )
        agreement = self._agreement()
        if agreement is not None:
            if hasattr(alloc, "agree"):  # the hybrid SWA allocator: one decision per pair
                alloc.agree(agreement)
            else:
                alloc.ledger = AgreedLedger(alloc.ledger, agreement)
        return alloc

    def mamba_buffers(self, pool: Any, **shapes: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``MambaPool``'s conv states and temporal state from kvcore (the series'
        ``MAMBA_STATE_HOOK`` seam; ``shapes``: ``layers``, ``conv_shapes``, ``conv_dtype``,
        ``temporal_shape``, ``temporal_dtype``, ``slots``). See
        ``kvcore.adapters.sglang.mamba``; raises ``UnsupportedConfiguration`` naming what it
        cannot back."""
        self._check_ranks_agree()
        state = build_mamba_state(
            pool,
            self.config,
            gate=self.gate,
            device_index=self.device_index,
            name=f"sglang-{os.getpid()}-{self._serial}",
            **shapes,
        )
        self.mamba_states.append(state)
        *conv, temporal = state.tensors
        return conv, temporal

    def mamba_allocator(self, mamba_pool: Any, upstream: Any) -> Any:
        """The elastic slot allocator for a ``MambaPool`` built through ``mamba_buffers``
        (``kvcore.adapters.sglang.mamba.elastic_mamba_allocator``); with an agreement (see
        the class) its slot allocations are agreed (a collective, as ``allocator``)."""
        alloc = elastic_mamba_allocator(mamba_pool, upstream)
        agreement = self._agreement()
        if agreement is not None:
            alloc.agree(agreement)
        return alloc

    def close(self) -> None:
        """Close every manager this scope created (unmaps pages, frees ranges)."""
        managers, self.managers = self.managers, []
        for manager in managers:
            manager.close()
        states, self.mamba_states = self.mamba_states, []
        for state in states:
            state.close()
        if self._tree_core_set:
            self._tree_core_set = False
            eviction.forget_tree_core()

    # -- helpers -------------------------------------------------------------------------

    def _agreement(self) -> Agreement | None:
        """This rank's one ``Agreement`` (every allocator's room on one group, refreshed
        together), made on first use; ``None`` without a budget or with one attention-TP
        rank."""
        if not self._agreed_known:
            ranks = self.agreement if self.agreement is not None else _tp_agreement(self.config)
            self._agreed = None if ranks is None else Agreement(ranks)
            self._agreed_known = True
        return self._agreed

    def _manager(
        self, pool: Any, *, kv_buffers: int, row: tuple[int, ...], rows: int
    ) -> ElasticKVManager:
        self._check_ranks_agree()
        row_bytes = pool.store_dtype.itemsize
        for d in row:
            row_bytes *= d
        manager = ElasticKVManager(
            self.config,
            num_layers=pool.layer_num,
            kv_buffers=kv_buffers,
            row_bytes=row_bytes,
            page_size=pool.page_size,
            num_rows=rows,
            device_index=self.device_index,
            name=f"sglang-{os.getpid()}-{self._serial}",
            gate=self.gate,
        )
        self.managers.append(manager)
        return manager

    def _check_ranks_agree(self) -> None:
        """Refuse a physical budget at PP > 1 (``UnsupportedConfiguration``).

        TP ranks run the same scheduler on the same inputs, so with a budget they agree each
        allocation and their room (``allocator``, ``mamba_allocator``); without one every
        rank's capacity is the same logical count. SGLang's pipeline stages each schedule
        their own micro-batches from their own allocator, running skewed; agreeing them would
        take a cross-stage collective at every allocation, ordered against the stages'
        point-to-point transfers, so a budget at PP > 1 is refused."""
        budget = self.config.budgeted
        tp, pp = _parallel_sizes()
        if budget and pp > 1:
            raise UnsupportedConfiguration(
                f"kvcore elastic KV with a physical budget (limit_bytes / gpu_ledger) at "
                f"TP {tp} x PP {pp}: every pipeline stage schedules its own micro-batches "
                "(SGLang's event_loop_pp) from its own budget, and agreeing them would need a "
                "collective across stages at every allocation, ordered against the stages' "
                "point-to-point proxy and output transfers; kvcore does not agree stages",
                hint="drop limit_bytes and gpu_ledger from --kvcore-config (without a budget "
                "every stage plans with the same logical capacity), or run without pipeline "
                "parallelism",
            )

    @staticmethod
    def _check_common(pool: Any) -> None:
        unsupported = {
            "enable_memory_saver (torch_memory_saver)": bool(
                getattr(pool.memory_saver_adapter, "enabled", False)
            ),
            "a custom CUDA memory pool": bool(getattr(pool, "custom_mem_pool", None)),
            "a pool size that is not a whole number of pages": pool.size % pool.page_size != 0,
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise UnsupportedConfiguration(
                f"kvcore elastic KV does not support {', '.join(bad)} ({type(pool).__name__})",
                hint="turn the named option off or start without --kvcore-elastic",
            )

    @classmethod
    def _check_mha(cls, pool: Any) -> None:
        cls._check_common(pool)
        unsupported = {
            "a quantized KV cache (--kv-cache-dtype fp4/mxfp8 recipes)": pool.is_quantized_kv_cache,
            "post-capture KV backing (SGLang's own CUDA VMM arena)": pool.post_capture_active,
            "the HND KV layout (SGLANG_USE_HND_KVCACHE)": pool.use_hnd,
            f"the {pool.kv_cache_layout!r} KV layout": pool.kv_cache_layout != "nhd",
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise UnsupportedConfiguration(
                f"kvcore elastic KV does not support {', '.join(bad)}",
                hint="turn the named option off or start without --kvcore-elastic",
            )


def elastic_allocator(upstream: Any) -> Any:
    """The elastic equivalent of SGLang's freshly built allocator ``upstream``: the hybrid
    ``SWATokenToKVPoolAllocator`` becomes ``kvcore.adapters.sglang.swa``'s elastic SWA
    allocator, a token or paged one ``kvcore.adapters.sglang.allocators``'. Raises
    ``UnsupportedConfiguration`` naming the allocator class for any other (HiSparse,
    page-interleave sharding, NPU, DSV4, unified pools) and for one that is elastic already
    (speculative decoding)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    from kvcore.adapters.sglang.swa import elastic_swa_allocator

    if isinstance(upstream, SWATokenToKVPoolAllocator) and not is_elastic(
        getattr(upstream, "full_attn_allocator", None)
    ):
        return elastic_swa_allocator(upstream)
    return elastic_token_allocator(upstream)


def _tp_agreement(config: ElasticConfig) -> RankAgreement | None:
    """The attention-TP CPU group's agreement when a physical budget is set at attention-TP
    > 1; ``None`` without a budget (capacity is logical) or with one rank. Raises
    ``UnsupportedConfiguration`` when TP > 1 but SGLang built no such group here."""
    if not config.budgeted:
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        size = int(parallel.attn_tp_size)
    except (RuntimeError, ValueError, AttributeError):  # nothing published: one rank
        return None
    if size <= 1:
        return None
    try:
        group = parallel.attn_tp_group
    except (RuntimeError, ValueError, AttributeError, AssertionError):  # 0.5.20 asserts
        group = None
    if group is None:
        raise UnsupportedConfiguration(
            f"kvcore elastic KV with a physical budget at attention-TP {size} needs SGLang's "
            "attention-TP CPU group to agree allocations, and this process has none",
            hint="build the pools after SGLang's distributed initialisation, or drop "
            "limit_bytes and gpu_ledger from --kvcore-config",
        )
    return TorchGroupAgreement(group.cpu_group)


def _parallel_sizes() -> tuple[int, int]:
    """This engine's (TP, PP) sizes; (1, 1) where SGLang's parallel context is not published
    (tests and tools building pools directly)."""
    from sglang.srt.runtime_context import get_parallel

    sizes = []
    for name in ("tp_size", "pp_size"):
        try:
            sizes.append(int(getattr(get_parallel(), name)))
        except (RuntimeError, ValueError, AttributeError):
            sizes.append(1)
    return sizes[0], sizes[1]
