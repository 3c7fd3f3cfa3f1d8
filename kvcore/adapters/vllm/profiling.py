"""Available-memory profiling for vLLM in elastic mode: logical vs physical KV capacity.

Upstream, a worker's ``init_device`` calls ``request_memory(init_snapshot, cache_config)``:
it plans with ``ceil(total * gpu_memory_utilization)`` bytes (less weights held outside the
process) and refuses to start unless that much is *free* now. ``determine_available_memory``
then gives the KV cache what the plan leaves after the profiled non-KV memory (or
``kv_cache_memory_bytes``). With a static KV cache both numbers are physical, so a second
engine on a GPU the first already fills cannot start.

With elastic KV they split:

* the **logical** capacity (how many blocks vLLM plans, the virtual range kvcore reserves)
  comes from the configuration exactly as upstream computes it: the same
  ``ceil(total * gpu_memory_utilization)`` (or ``kv_cache_memory_bytes``), independent of
  what other processes hold now;
* the **physical** capacity (what this instance may map) is decided page by page by the
  per-GPU ledger (``gpu_ledger``: the GPU budget less what the other instances hold) or
  ``limit_bytes``, at run time, through the memory gate. A page that cannot be backed is an
  allocation miss (the request waits), not an OOM.

So the patched ``init_device`` calls ``elastic_request_memory`` instead: it returns the
logical figure without upstream's "free >= requested" check and logs the physical picture
(``ElasticMemoryPlan``). The instance's own non-KV memory (weights, activations, graphs) must
still fit physically: loading or the profile run fails with the driver's out-of-memory error
when it does not, as upstream.

Known limit: vLLM's profile run asserts that free memory did not *grow* while it ran; another
elastic instance returning pages in exactly that window trips the assertion (restart the
instance; ``kvctl trim`` before starting a new one avoids it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcore.adapters.config import ElasticConfig
from kvcore.errors import UnsupportedConfiguration
from kvcore.vmm import open_backend
from kvcore.vmm.base import VmmBackend

__all__ = ["ElasticMemoryPlan", "elastic_request_memory", "plan_memory"]

log = logging.getLogger(__name__)

_GIB = float(1 << 30)


@dataclass(frozen=True)
class ElasticMemoryPlan:
    """What an elastic vLLM instance plans with (``logical``) and could back now."""

    total: int
    """The device's bytes (``VmmBackend.mem_info().total``)."""
    free: int
    """The device's free bytes now, as the driver reports them."""
    logical: int
    """Bytes vLLM plans with: ``ceil(total * gpu_memory_utilization)`` less weights held
    outside the process, as upstream's ``request_memory`` computes them."""
    budget: int | None
    """The per-GPU ledger's budget (``None`` without ``gpu_ledger``)."""
    held_by_others: int
    """KV bytes the other live instances in the ledger hold mapped (0 without it)."""
    physical: int
    """KV bytes this instance could map now: the device's free bytes, within the ledger's
    budget less ``held_by_others`` and within ``limit_bytes``."""


def plan_memory(
    cache_config: Any,
    *,
    device_index: int = 0,
    external_weight_memory: int = 0,
    backend: VmmBackend | None = None,
) -> ElasticMemoryPlan:
    """The logical and physical figures for an instance with vLLM's ``cache_config``
    (``gpu_memory_utilization``, ``kvcore_config``), read from kvcore's backend (``backend``,
    else the configured one opened and closed here) and the per-GPU ledger. Raises
    ``UnsupportedConfiguration`` when weights held outside the process exceed the logical
    budget (upstream raises ``ValueError`` there), what ``ElasticConfig.parse`` /
    ``open_backend`` raise, and ``LedgerError`` when the ledger cannot be read."""
    config = ElasticConfig.parse(getattr(cache_config, "kvcore_config", None))
    own = backend is None
    if backend is None:
        backend = open_backend(config.backend, device_index, **dict(config.backend_options))
    try:
        info = backend.mem_info()
        budget, held = _ledger_figures(config, backend, info.total)
    finally:
        if own:
            backend.close()
    utilization = float(cache_config.gpu_memory_utilization)
    logical = math.ceil(info.total * utilization) - max(int(external_weight_memory), 0)
    if logical <= 0:
        raise UnsupportedConfiguration(
            f"--kvcore-elastic: weights held outside this process "
            f"({external_weight_memory / _GIB:.2f} GiB) exceed gpu_memory_utilization="
            f"{utilization} of {info.total / _GIB:.2f} GiB",
            hint="raise --gpu-memory-utilization",
        )
    physical = info.free
    if budget is not None:
        physical = min(physical, max(budget - held, 0))
    if config.limit_bytes is not None:
        physical = min(physical, config.limit_bytes)
    return ElasticMemoryPlan(
        total=info.total,
        free=info.free,
        logical=logical,
        budget=budget,
        held_by_others=held,
        physical=physical,
    )


def elastic_request_memory(
    init_snapshot: Any, cache_config: Any, external_weight_memory: int = 0
) -> int:
    """Elastic mode's ``request_memory`` (the patched worker ``init_device`` calls it with
    upstream's arguments): the logical bytes vLLM plans with (``plan_memory``), without
    upstream's check that they are free now; the physical picture is logged, with a warning
    when nothing could be mapped now. Raises as ``plan_memory``."""
    device = getattr(init_snapshot, "device_", None)
    index = getattr(device, "index", None) or 0
    plan = plan_memory(
        cache_config, device_index=index, external_weight_memory=external_weight_memory
    )
    log.info(
        "kvcore: elastic KV plans with %.2f GiB (gpu_memory_utilization of %.2f GiB; "
        "logical); %.2f GiB free on the device, %s; %.2f GiB can be mapped now (physical)",
        plan.logical / _GIB,
        plan.total / _GIB,
        plan.free / _GIB,
        "no per-GPU ledger"
        if plan.budget is None
        else f"ledger budget {plan.budget / _GIB:.2f} GiB, {plan.held_by_others / _GIB:.2f} "
        "GiB held by other instances",
        plan.physical / _GIB,
    )
    if plan.physical <= 0:
        log.warning(
            "kvcore: no KV memory can be mapped now (the device or the ledger budget is "
            "full); requests wait until other instances release pages"
        )
    return plan.logical


def _ledger_figures(
    config: ElasticConfig, backend: VmmBackend, total: int
) -> tuple[int | None, int]:
    """(budget, bytes the live instances hold mapped) from the per-GPU ledger, or
    ``(None, 0)`` without ``gpu_ledger``. This instance has not registered yet, so every
    record is another instance's."""
    if not config.gpu_ledger:
        return None, 0
    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_file import Liveness

    directory = Path(config.ledger_dir) if config.ledger_dir else None
    with GpuLedger.open(backend.device_uuid(), device_total=total, directory=directory) as led:
        snap = led.snapshot()
    held = sum(r.mapped for r in snap.records if r.liveness is not Liveness.STALE)
    return snap.budget, held
