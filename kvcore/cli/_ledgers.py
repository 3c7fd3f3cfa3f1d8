"""Finding and opening the per-GPU ledgers for ``kvctl`` and ``kvtop`` (private)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import DIR_ENV, InstanceRecord, ledger_dir, list_ledgers
from kvcore.errors import LedgerError, LedgerNotFound


@dataclass
class Opened:
    """The ledgers that opened, the stale records reclaimed on the way, and the errors of
    the files that did not open (foreign, other version, no permission)."""

    ledgers: list[GpuLedger] = field(default_factory=list)
    reclaimed: list[tuple[str, InstanceRecord]] = field(default_factory=list)
    errors: list[LedgerError] = field(default_factory=list)

    def close(self) -> None:
        for ledger in self.ledgers:
            ledger.close()


def open_ledgers(directory: Path | None, device: str | None) -> Opened:
    """Open every ledger in ``directory`` (default: ``ledger_dir()``), or only the one
    whose device uuid starts with ``device``; reclaim their stale records. Raises
    ``LedgerNotFound`` (with how a ledger comes to exist) when none matches."""
    base = directory or ledger_dir()
    opened = Opened()
    for path in list_ledgers(base):
        try:
            ledger = GpuLedger.open_path(path)
        except LedgerError as exc:
            opened.errors.append(exc)
            continue
        if device and not ledger.device_uuid.startswith(device):
            ledger.close()
            continue
        try:
            opened.reclaimed += [(ledger.device_uuid, r) for r in ledger.reclaim_stale()]
        except LedgerError as exc:
            ledger.close()
            opened.errors.append(exc)
            continue
        opened.ledgers.append(ledger)
    if not opened.ledgers and not opened.errors:
        what = f"for a device starting with {device!r} " if device else ""
        raise LedgerNotFound(
            f"no kvcore ledger {what}in {base}",
            hint="a GPU's ledger is created when the first kvcore instance starts on it "
            f"(an engine with elastic KV on); set {DIR_ENV} if the instances use another "
            "directory",
        )
    return opened
