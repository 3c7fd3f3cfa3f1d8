"""``kvcore.budget.rank_gates``: one per-GPU ledger record per TP x PP rank, charged by
the engine core, all-or-nothing across the ranks' GPUs (no vLLM needed: the device files are
what a worker publishes, from real host-backend devices)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.rank_gates import RankLedgerGates, device_file, publish_device
from kvcore.errors import ChannelError
from kvcore.vmm import open_backend

MiB = 1 << 20


def _publish(channel: Path, devices: list[int]) -> list[str]:
    uuids = []
    for rank, index in enumerate(devices):
        backend = open_backend("host", index, granularity=4096, device_bytes=64 * MiB)
        try:
            publish_device(channel, rank, backend)
            uuids.append(backend.device_uuid())
        finally:
            backend.close()
    return uuids


def _mapped(ledger_dir: Path, uuid: str) -> dict[str, int]:
    with GpuLedger.open(uuid, directory=ledger_dir) as ledger:
        return {r.name: r.mapped for r in ledger.snapshot().records}


def test_every_rank_is_charged_on_its_own_gpu(tmp_path: Path) -> None:
    uuids = _publish(tmp_path, [0, 1])
    assert uuids[0] != uuids[1]
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    gates = RankLedgerGates.open(tmp_path, 2, name="e", engine="vllm", directory=ledgers)
    try:
        assert gates.try_acquire(4 * MiB)
        assert [_mapped(ledgers, u) for u in uuids] == [{"e-rank0": 4 * MiB}, {"e-rank1": 4 * MiB}]
        gates.release(MiB)
        assert [_mapped(ledgers, u) for u in uuids] == [{"e-rank0": 3 * MiB}, {"e-rank1": 3 * MiB}]
    finally:
        gates.close()
    assert [_mapped(ledgers, u) for u in uuids] == [{}, {}]


def test_a_refusal_on_one_gpu_releases_the_others(tmp_path: Path) -> None:
    uuids = _publish(tmp_path, [0, 1])
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    gates = RankLedgerGates.open(tmp_path, 2, name="e", engine="vllm", directory=ledgers)
    try:
        with GpuLedger.open(uuids[1], directory=ledgers) as ledger:
            ledger.set_budget(2 * MiB)  # rank 1's GPU is nearly full
        assert gates.try_acquire(MiB)
        assert not gates.try_acquire(2 * MiB)  # rank 0 admitted it, rank 1 did not
        assert [_mapped(ledgers, u) for u in uuids] == [{"e-rank0": MiB}, {"e-rank1": MiB}]
        assert gates.reserve_target(8 * MiB) == MiB  # the fullest GPU decides
    finally:
        gates.close()


def test_ranks_on_one_gpu_are_two_records_there(tmp_path: Path) -> None:
    (uuid, _) = _publish(tmp_path, [0, 0])
    gates = RankLedgerGates.open(tmp_path, 2, name="e", engine="vllm", directory=tmp_path)
    try:
        assert gates.try_acquire(MiB)
        assert _mapped(tmp_path, uuid) == {"e-rank0": MiB, "e-rank1": MiB}
    finally:
        gates.close()


def test_missing_or_malformed_device_file_is_refused_and_nothing_stays(tmp_path: Path) -> None:
    (uuid,) = _publish(tmp_path, [0])
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    with pytest.raises(ChannelError, match="rank 1"):
        RankLedgerGates.open(tmp_path, 2, name="e", engine="vllm", directory=ledgers)
    assert _mapped(ledgers, uuid) == {}  # rank 0's record was removed again
    device_file(tmp_path, 1).write_text('{"uuid": "", "device": 0, "total": 1}')
    with pytest.raises(ChannelError, match="malformed"):
        RankLedgerGates.open(tmp_path, 2, name="e", engine="vllm", directory=ledgers)
    assert device_file(tmp_path, 0).stat().st_mode & 0o777 == 0o600
