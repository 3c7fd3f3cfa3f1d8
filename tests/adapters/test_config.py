"""``--kvcore-config`` options: parsing and the memory gate they ask for (engine-agnostic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.adapters.config import ElasticConfig
from kvcore.budget.gate import BudgetGate, UnlimitedGate
from kvcore.budget.ledger import GpuLedger, LedgerGate
from kvcore.errors import UnsupportedConfiguration
from kvcore.vmm import open_backend


def test_unknown_key_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfiguration, match="limit_gb"):
        ElasticConfig.parse({"limit_gb": 8})


def test_gate_without_ledger_is_a_budget_or_unlimited() -> None:
    backend = open_backend("host", device_bytes=64 << 20)
    try:
        capped = ElasticConfig.parse({"limit_bytes": 8 << 20}).make_gate(
            backend, name="a", engine="test", engine_version="0"
        )
        assert isinstance(capped, BudgetGate)
        assert capped.try_acquire(8 << 20) and not capped.try_acquire(1)
        free = ElasticConfig.parse(None).make_gate(
            backend, name="a", engine="test", engine_version="0"
        )
        assert isinstance(free, UnlimitedGate)
    finally:
        backend.close()


def test_gate_with_ledger_registers_the_instance_with_its_limit(tmp_path: Path) -> None:
    backend = open_backend("host", device_bytes=64 << 20)
    config = ElasticConfig.parse(
        {"gpu_ledger": True, "ledger_dir": str(tmp_path), "limit_bytes": 4 << 20}
    )
    gate = config.make_gate(backend, name="llama", engine="test", engine_version="1.2")
    try:
        assert isinstance(gate, LedgerGate)
        assert gate.try_acquire(4 << 20) and not gate.try_acquire(1)
        ledger = GpuLedger.open(backend.device_uuid(), directory=tmp_path)
        try:
            record = ledger.snapshot().find("llama")
        finally:
            ledger.close()
        assert record is not None
        assert (record.engine, record.engine_version, record.limit) == ("test", "1.2", 4 << 20)
    finally:
        gate.close()
        backend.close()


@pytest.mark.parametrize("key", ["limit_bytes", "page_bytes", "reserve_max"])
def test_sizes_beyond_any_device_are_refused_by_name(key: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=rf"{key} must be an integer in 0 \.\. 2"):
        ElasticConfig.parse({key: 1 << 64})


def test_deeply_nested_or_odd_backend_options_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfiguration, match="not valid JSON"):
        ElasticConfig.parse('{"backend_options": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UnsupportedConfiguration, match=r"backend_options\.device_bytes"):
        ElasticConfig.parse({"backend_options": {"device_bytes": {"nested": [1]}}})
    with pytest.raises(UnsupportedConfiguration, match=r"backend_options\.granularity"):
        ElasticConfig.parse({"backend_options": {"granularity": 1 << 70}})
