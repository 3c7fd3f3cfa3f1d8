"""The memory gate an engine's ``--kvcore-config`` asks for: the one place it is chosen.

Every engine adapter opens its gate through ``open_gate`` (vLLM's one-process memory, vLLM's
TP x PP engine core, SGLang's KV pools and Mamba state), so the same options give the same
kind of gate everywhere:

* ``gpu_ledger``: a record in the per-GPU ledger (``limit_bytes`` is the instance limit, 0
  none; ``share_bytes`` its share, none: an equal part of the budget), on ``backend``'s
  device (``LedgerGate``), or, for an engine core driving TP x PP ranks over a channel,
  one record per rank on each rank's own device (``RankLedgerGates``);
* else ``limit_bytes``: a fixed byte budget of this process (``BudgetGate``);
* else no limit but the device's (``UnlimitedGate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.budget.gate import BudgetGate, MemoryGate, UnlimitedGate

if TYPE_CHECKING:
    from kvcore.adapters.config import ElasticConfig
    from kvcore.vmm.base import VmmBackend

__all__ = ["open_gate"]


def open_gate(
    config: ElasticConfig,
    *,
    name: str,
    engine: str,
    engine_version: str,
    backend: VmmBackend | None = None,
    channel_dir: str | Path | None = None,
    world_size: int = 1,
    give_back: str = "all",
) -> MemoryGate:
    """The gate ``config`` asks for (module docstring), for instance ``name`` of ``engine``.

    With ``gpu_ledger`` the ledger record(s) are registered now: on ``backend``'s device, or,
    when ``channel_dir`` is given, for each of ``world_size`` ranks on the device that rank
    published there (``kvcore.budget.rank_gates.publish_device``); ``give_back``: what a
    ledger gate asks back for a waiting neighbour (``LedgerGate``: ``"all"`` above the share
    for an engine that drains, ``"asked"`` for one that preempts). The caller owns the gate
    and closes it (removing the records). Raises ``LedgerError`` when a ledger cannot be
    opened or refuses the record, ``ChannelError`` when a rank's device file is missing, and
    ``ValueError`` when ``gpu_ledger`` is set but neither ``backend`` nor ``channel_dir``
    names a device."""
    if not config.gpu_ledger:
        return BudgetGate(config.limit_bytes) if config.limit_bytes is not None else UnlimitedGate()
    limit = config.limit_bytes or 0
    share = config.share_bytes or 0
    directory = Path(config.ledger_dir) if config.ledger_dir else None
    if channel_dir is not None:
        from kvcore.budget.rank_gates import RankLedgerGates

        return RankLedgerGates.open(
            channel_dir,
            world_size,
            name=name,
            engine=engine,
            engine_version=engine_version,
            limit=limit,
            share=share,
            give_back=give_back,
            directory=directory,
        )
    if backend is None:
        raise ValueError("open_gate: gpu_ledger needs a backend or a channel directory")
    from kvcore.budget.ledger_gate import LedgerGate

    return LedgerGate.from_backend(
        backend,
        name=name,
        engine=engine,
        engine_version=engine_version,
        limit=limit,
        share=share,
        give_back=give_back,
        directory=directory,
    )
