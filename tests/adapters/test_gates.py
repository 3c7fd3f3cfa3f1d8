"""``kvcore.adapters.gates.open_gate``: the one choice of memory gate for every engine adapter."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.gates import open_gate
from kvcore.budget.gate import BudgetGate, UnlimitedGate
from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.budget.rank_gates import RankLedgerGates, publish_device
from kvcore.vmm import open_backend

MiB = 1 << 20


def _open(config: ElasticConfig, **where: object) -> object:
    return open_gate(config, name="llama", engine="test", engine_version="1.2", **where)  # type: ignore[arg-type]


def _records(directory: Path, uuid: str) -> dict[str, tuple[str, str, int]]:
    with GpuLedger.open(uuid, directory=directory) as ledger:
        return {r.name: (r.engine, r.engine_version, r.limit) for r in ledger.snapshot().records}


def test_without_a_ledger_the_gate_is_a_budget_or_unlimited() -> None:
    capped = _open(ElasticConfig.parse({"limit_bytes": 8 * MiB}))
    assert isinstance(capped, BudgetGate)
    assert capped.try_acquire(8 * MiB) and not capped.try_acquire(1)
    assert isinstance(_open(ElasticConfig.parse(None)), UnlimitedGate)


def test_a_ledger_gate_registers_the_instance_with_its_limit(tmp_path: Path) -> None:
    backend = open_backend("host", device_bytes=64 * MiB)
    config = ElasticConfig.parse(
        {"gpu_ledger": True, "ledger_dir": str(tmp_path), "limit_bytes": 4 * MiB}
    )
    gate = _open(config, backend=backend)
    try:
        assert isinstance(gate, LedgerGate)
        assert gate.try_acquire(4 * MiB) and not gate.try_acquire(1)
        assert _records(tmp_path, backend.device_uuid()) == {"llama": ("test", "1.2", 4 * MiB)}
    finally:
        gate.close()
    assert _records(tmp_path, backend.device_uuid()) == {}
    backend.close()


def test_an_engine_core_over_a_channel_gets_one_record_per_rank(tmp_path: Path) -> None:
    channel, ledgers = tmp_path / "channel", tmp_path / "ledgers"
    channel.mkdir()
    ledgers.mkdir()
    uuids = []
    for rank in range(2):
        backend = open_backend("host", rank, granularity=4096, device_bytes=64 * MiB)
        publish_device(channel, rank, backend)
        uuids.append(backend.device_uuid())
        backend.close()
    config = ElasticConfig.parse({"gpu_ledger": True, "ledger_dir": str(ledgers)})
    gate = _open(config, channel_dir=channel, world_size=2)
    try:
        assert isinstance(gate, RankLedgerGates)
        assert [_records(ledgers, u) for u in uuids] == [
            {"llama-rank0": ("test", "1.2", 0)},
            {"llama-rank1": ("test", "1.2", 0)},
        ]
    finally:
        gate.close()


def test_a_ledger_gate_needs_a_device() -> None:
    with pytest.raises(ValueError, match="backend or a channel"):
        _open(ElasticConfig.parse({"gpu_ledger": True}))
