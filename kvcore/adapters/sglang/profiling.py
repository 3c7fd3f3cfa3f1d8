"""KV-cache memory profiling of one SGLang rank in elastic mode.

Upstream SGLang (``KVCacheConfigurator._profile_available_bytes``) sizes the KV pool from the
device memory that is *free* after the weights loaded, minus the runtime slack
``pre_model_load * (1 - mem_fraction_static)``. Memory another engine holds on the GPU at
that moment shrinks the pool, and a second instance started while the first holds its KV
cache would find almost nothing. In elastic mode the pool is a virtual range backed on
demand, so its size is a *logical* capacity and the physical memory is bounded separately:

* **logical capacity**: ``mem_fraction_static`` of the device's *total* memory minus this
  rank's own footprint (weights and whatever else it allocated while loading, measured as
  ``pre_model_load - available``), i.e. what upstream would give this rank alone on the GPU;
* **physical capacity**: what this rank may map at most: the per-GPU ledger's budget (with
  ``gpu_ledger``), the rank's ``limit_bytes``, and the device total, whichever is least;
* both are the minimum over the ranks of the group (SGLang's launch world: TP x PP), so every
  rank builds the same pool.

The patched ``_profile_available_bytes`` calls ``elastic_memory_gb`` and feeds the two
numbers it returns into upstream's own formula in place of the measured ones; everything
after (multimodal reservation, Mamba sizing, the "raise --mem-fraction-static" error) stays
upstream's. Device figures come from kvcore's VMM backend (``VmmBackend.mem_info``): on the
host backend they are its configured ``device_bytes``.

A pool without a budget that starts on a GPU where more than ``UNBUDGETED_SHARING_BYTES`` are
held outside it (another engine, most likely) is logged as a warning naming ``gpu_ledger``
and ``limit_bytes``: nothing coordinates its growth with the others, and SGLang fails an
allocation when the device runs out under it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.adapters.config import ElasticConfig
from kvcore.vmm import open_backend

if TYPE_CHECKING:
    from kvcore.vmm.base import VmmBackend

__all__ = ["ElasticProfile", "elastic_memory_gb", "profile"]

log = logging.getLogger(__name__)

_GIB = 1 << 30
_FROM_SGLANG: Any = object()

UNBUDGETED_SHARING_BYTES = 2 * _GIB
"""Device memory held outside a server without a budget (``limit_bytes``, ``gpu_ledger``)
beyond which ``elastic_memory_gb`` warns that it shares the GPU uncoordinated: above what
this process's own CUDA context and the driver's reservations take."""


@dataclass(frozen=True)
class ElasticProfile:
    """The profile of one rank (already the minimum over its group), in bytes."""

    device_total: int
    """The device's total memory (the least over the ranks)."""
    footprint: int
    """This rank's own use outside the KV cache (weights, ...): ``pre_model_load - available``."""
    logical: int
    """KV bytes the pool is sized for: ``total * mem_fraction_static - footprint`` (may be
    <= 0: upstream's formula then raises its "raise --mem-fraction-static" error)."""
    physical: int
    """Bytes this rank may map at most: min(ledger budget, ``limit_bytes``, device total)."""
    ranks: int
    """Ranks the minimum was taken over (1: no group)."""
    others: int = 0
    """Device memory held outside this rank's footprint when it was profiled (other
    processes, and this process's CUDA context): ``total - free - footprint``. This rank's
    own figure, not a minimum over the group."""


def profile(
    config: ElasticConfig,
    *,
    mem_fraction_static: float,
    pre_model_load_bytes: int,
    available_bytes: int,
    device_index: int = 0,
    backend: VmmBackend | None = None,
    group: Any = None,
) -> ElasticProfile:
    """Profile one rank (module docstring). ``pre_model_load_bytes`` and ``available_bytes``
    are SGLang's measurements (free memory before the weights loaded, and now);
    ``backend`` defaults to the one ``config`` names (opened and closed here); ``group`` is
    the ``torch.distributed`` (CPU) group to take the minimum over, ``None`` for one rank.
    Raises ``BackendUnavailable`` when the backend cannot be opened, ``LedgerError`` when the
    per-GPU ledger cannot be opened."""
    own = backend is None
    if backend is None:
        backend = open_backend(config.backend, device_index, **dict(config.backend_options))
    try:
        info = backend.mem_info()
        total = int(info.total)
        free = int(info.free)
        physical = min(total, config.limit_bytes if config.limit_bytes is not None else total)
        if config.gpu_ledger:
            physical = min(physical, _ledger_budget(config, backend, total))
    finally:
        if own:
            backend.close()
    footprint = max(0, int(pre_model_load_bytes) - int(available_bytes))
    logical = int(total * mem_fraction_static) - footprint
    others = max(0, total - free - footprint)
    ranks = 1
    if group is not None:
        import torch
        import torch.distributed as dist

        t = torch.tensor([total, logical, physical], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        total, logical, physical = (int(v) for v in t.tolist())
        ranks = int(dist.get_world_size(group))
    return ElasticProfile(total, footprint, logical, physical, ranks, others)


def elastic_memory_gb(
    config: ElasticConfig | dict[str, Any] | str | None,
    pre_model_load_gb: float,
    available_gb: float,
    device_index: int = 0,
    *,
    mem_fraction_static: float | None = None,
    cpu_group: Any = _FROM_SGLANG,
) -> tuple[float, float]:
    """The seam ``_profile_available_bytes`` calls in elastic mode: returns
    ``(available_gb, pre_model_load_gb)`` to use in upstream's formula
    ``available - pre_model_load * (1 - mem_fraction_static)``, which then yields the
    logical capacity ``total * mem_fraction_static - footprint`` (``profile``). Logs the
    logical and physical capacities. ``mem_fraction_static`` defaults to SGLang's
    (``get_schedule()``), ``cpu_group`` to SGLang's launch-world CPU group when it has more
    than one rank (the group upstream takes its minimum over). Raises as ``profile``."""
    if mem_fraction_static is None:
        from sglang.srt.runtime_context import get_schedule

        mem_fraction_static = float(get_schedule().mem_fraction_static)
    if cpu_group is _FROM_SGLANG:
        cpu_group = _launch_world_group()
    cfg = config if isinstance(config, ElasticConfig) else ElasticConfig.parse(config)
    p = profile(
        cfg,
        mem_fraction_static=mem_fraction_static,
        pre_model_load_bytes=int(pre_model_load_gb * _GIB),
        available_bytes=int(available_gb * _GIB),
        device_index=device_index,
        group=cpu_group,
    )
    log.info(
        "kvcore: elastic KV profile over %d rank(s): device %.2f GiB, footprint %.2f GiB, "
        "logical KV %.2f GiB (mem_fraction_static %.3f of the total), physical at most "
        "%.2f GiB (SGLang measured %.2f GiB available, %.2f GiB before the weights)",
        p.ranks,
        p.device_total / _GIB,
        p.footprint / _GIB,
        p.logical / _GIB,
        mem_fraction_static,
        p.physical / _GIB,
        available_gb,
        pre_model_load_gb,
    )
    if not cfg.budgeted and p.others > UNBUDGETED_SHARING_BYTES:
        log.warning(
            "kvcore: %.2f GiB of this GPU are held outside this server and its pool has no "
            "budget: the pool may grow to %.2f GiB of KV, and if the device runs out under "
            "it SGLang fails an allocation ('Out of memory'). Start every elastic server "
            "on this GPU with --kvcore-config '{\"gpu_ledger\": true}' (they then share one "
            "budget), or cap this one with limit_bytes",
            p.others / _GIB,
            p.logical / _GIB,
        )
    pre = p.device_total / _GIB
    return p.logical / _GIB + pre * (1 - mem_fraction_static), pre


def _launch_world_group() -> Any:
    """SGLang's launch-world CPU group when it spans several ranks, else ``None``."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        if int(parallel.launch_world_size) <= 1:
            return None
    except (RuntimeError, ValueError, AttributeError):  # nothing published: one rank
        return None
    return parallel.world_group.cpu_group


def _ledger_budget(config: ElasticConfig, backend: VmmBackend, total: int) -> int:
    """The per-GPU ledger's budget for this device (opened and closed here)."""
    from kvcore.budget.ledger import GpuLedger

    directory = Path(config.ledger_dir) if config.ledger_dir else None
    ledger = GpuLedger.open(backend.device_uuid(), device_total=total, directory=directory)
    try:
        return int(ledger.snapshot().budget)
    finally:
        ledger.close()
