"""The budget layer: who may take more physical memory, and how much each instance holds.

Bottom up:

* ``kvcore.budget.gate``         ``MemoryGate``, the protocol a page allocator asks before it
  maps memory; ``UnlimitedGate`` and ``BudgetGate`` for a process without a ledger.
* ``kvcore.budget.ledger_file``  the per-GPU ledger file: paths, layout, creation,
  validation, locking; ``InstanceRecord`` and ``LedgerSnapshot``, what readers get.
* ``kvcore.budget.ledger``       ``GpuLedger``, an open ledger: the control plane's API
  (limits, budget, trim, stale reclaim) and the instance side's (registration).
* ``kvcore.budget.ledger_gate``  ``LedgerGate``, the ``MemoryGate`` an instance charges.
* ``kvcore.budget.shared_gate``  ``SharedGate``/``GateShare``: one gate for several pools.
* ``kvcore.budget.rank_gates``   ``RankLedgerGates``: one ledger record per TP x PP rank.

``docs/ledger.md`` describes the ledger as operators meet it.
"""

from kvcore.budget.gate import BudgetGate, MemoryGate, UnlimitedGate
from kvcore.budget.ledger import GpuLedger, Registration
from kvcore.budget.ledger_file import (
    DIR_ENV,
    GROUP_ENV,
    InstanceRecord,
    LedgerSnapshot,
    Liveness,
    ledger_dir,
    ledger_path,
    list_ledgers,
)
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.budget.rank_gates import RankLedgerGates
from kvcore.budget.shared_gate import GateShare, SharedGate

__all__ = [
    "DIR_ENV",
    "GROUP_ENV",
    "BudgetGate",
    "GateShare",
    "GpuLedger",
    "InstanceRecord",
    "LedgerGate",
    "LedgerSnapshot",
    "Liveness",
    "MemoryGate",
    "RankLedgerGates",
    "Registration",
    "SharedGate",
    "UnlimitedGate",
    "ledger_dir",
    "ledger_path",
    "list_ledgers",
]
