"""Per-GPU ledger accounting for a TP x PP engine: one ledger record per rank, on that rank's
GPU, charged by the engine core.

The engine core's page allocator decides for every rank, but each rank's pages live on its own
GPU, and another engine sharing that GPU reads that GPU's ledger (``kvcore.budget.ledger``). So
``--kvcore-config '{"gpu_ledger": true}'`` with TP x PP > 1 registers one record per rank, named
``<instance>-rank<r>``, in the ledger of the rank's device, and charges each of them what the
rank holds. Ranks hold the same bytes per page (``kvcore.adapters.vllm.parallel`` refuses ranks
whose pages differ), so a charge of ``n`` bytes is ``n`` on every rank's record; ranks sharing
one GPU are two records in the same ledger, which then counts both.

* ``publish_device(channel_dir, rank, backend)``: a worker writes ``rank-<r>.device.json``
  (its device's UUID, index and total bytes; 0600, atomically) into the engine's 0700 channel
  directory before it serves its socket (the channel's handshake carries no device id).
* ``RankLedgerGates.open(channel_dir, world_size, ...)``: the engine core reads every rank's
  file and registers the records; a ``MemoryGate`` that admits ``n`` bytes only when every
  rank's record admits them (the ones already charged are released on a refusal).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.errors import ChannelError, KvcoreError

if TYPE_CHECKING:
    from kvcore.vmm.base import VmmBackend

__all__ = ["RankLedgerGates", "device_file", "publish_device"]


def device_file(channel_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` publishes its device in ``channel_dir``."""
    return Path(channel_dir) / f"rank-{rank}.device.json"


def publish_device(channel_dir: Path | str, rank: int, backend: VmmBackend) -> None:
    """Write this rank's device (UUID, index, total bytes) for the engine core. Raises
    ``OSError`` when the channel directory is not writable."""
    info = backend.mem_info()
    body = json.dumps(
        {"uuid": backend.device_uuid(), "device": int(backend.device), "total": int(info.total)}
    )
    path = device_file(channel_dir, rank)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(body)
    os.replace(tmp, path)


def _read_device(channel_dir: Path | str, rank: int) -> tuple[str, int, int]:
    path = device_file(channel_dir, rank)
    try:
        data: Any = json.loads(path.read_text())
        uuid, device, total = data["uuid"], data["device"], data["total"]
        if not (isinstance(uuid, str) and uuid and isinstance(device, int)):
            raise TypeError("uuid must be a string, device an integer")
        if not isinstance(total, int) or total <= 0:
            raise TypeError("total must be a positive integer")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChannelError(
            f"rank {rank}: its device file {path} is missing or malformed ({exc})",
            hint="the worker publishes it before serving its socket; is it kvcore's worker?",
        ) from None
    return uuid, device, total


class RankLedgerGates:
    """``MemoryGate`` over one ``LedgerGate`` per rank (module docstring). Close with
    ``close`` (removes every record)."""

    def __init__(self, gates: list[LedgerGate], ledgers: list[GpuLedger]) -> None:
        self.gates = gates
        self._ledgers = ledgers

    @classmethod
    def open(
        cls,
        channel_dir: Path | str,
        world_size: int,
        *,
        name: str,
        engine: str,
        engine_version: str = "",
        limit: int = 0,
        share: int = 0,
        give_back: str = "all",
        directory: Path | None = None,
    ) -> RankLedgerGates:
        """Register ``<name>-rank<r>`` for every rank in the ledger of its device (created
        when absent), each with instance limit ``limit`` bytes (0: none), share ``share``
        bytes (0: an equal part of its GPU's budget) and ``give_back`` (``LedgerGate``).
        Raises
        ``ChannelError`` for a missing or malformed device file, ``LedgerError`` as
        ``LedgerGate``; what was registered is removed again on failure."""
        gates: list[LedgerGate] = []
        ledgers: list[GpuLedger] = []
        try:
            for rank in range(world_size):
                uuid, device, total = _read_device(channel_dir, rank)
                ledger = GpuLedger.open(uuid, device_total=total, directory=directory)
                ledgers.append(ledger)
                gates.append(
                    LedgerGate(
                        ledger,
                        name=f"{name}-rank{rank}",
                        engine=engine,
                        engine_version=engine_version,
                        device=device,
                        limit=limit,
                        share=share,
                        give_back=give_back,
                    )
                )
        except BaseException:
            cls(gates, ledgers).close()
            raise
        return cls(gates, ledgers)

    def try_acquire(self, nbytes: int) -> bool:
        """Claim ``nbytes`` on every rank's record, or on none: ``False`` when one refuses
        (the ranks charged before it are released again). Raises as
        ``LedgerGate.try_acquire``."""
        taken: list[LedgerGate] = []
        try:
            for gate in self.gates:
                if not gate.try_acquire(nbytes):
                    break
                taken.append(gate)
            else:
                return True
        except BaseException:
            self._release(taken, nbytes)
            raise
        self._release(taken, nbytes)
        return False

    @staticmethod
    def _release(gates: list[LedgerGate], nbytes: int) -> None:
        for gate in gates:
            gate.release(nbytes)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` on every rank's record. Raises as ``LedgerGate.release``."""
        self._release(self.gates, nbytes)

    def report_reserve(self, nbytes: int) -> None:
        """Record ``nbytes`` of idle reserve on every rank's record."""
        for gate in self.gates:
            gate.report_reserve(nbytes)

    def reserve_target(self, wanted: int) -> int:
        """The least reserve any rank's record allows (at most ``wanted``)."""
        return min((gate.reserve_target(wanted) for gate in self.gates), default=wanted)

    def overage(self) -> int:
        """The most any rank's record uses beyond its limit (every rank holds the same
        pages, so shedding for the worst rank brings every rank under its limit)."""
        return max((gate.overage() for gate in self.gates), default=0)

    def held_back(self) -> bool:
        """Whether any rank's record holds more than it may (``LedgerGate.held_back``)."""
        return any(gate.held_back() for gate in self.gates)

    def note_wanted(self, nbytes: int) -> None:
        """Tell every rank's record the engine was short of ``nbytes`` (each marks itself
        waiting where its GPU's budget is what is short, ``LedgerGate.note_wanted``)."""
        for gate in self.gates:
            gate.note_wanted(nbytes)

    def close(self) -> None:
        """Remove every rank's record and close the ledgers. Idempotent; raises the first
        ``KvcoreError`` after closing the rest."""
        first: KvcoreError | None = None
        for closer in [g.close for g in self.gates] + [led.close for led in self._ledgers]:
            try:
                closer()
            except KvcoreError as exc:
                first = first or exc
        self.gates, self._ledgers = [], []
        if first is not None:
            raise first
