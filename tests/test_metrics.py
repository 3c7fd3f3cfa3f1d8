"""Prometheus metrics: off by default; per-instance gauges fed by the gate; the
whole-machine ledger collector; multiprocess-directory and HTTP-port modes in real
processes (both change process-global prometheus state, so they run in children)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import DIR_ENV
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.metrics import (
    MULTIPROC_ENV,
    PORT_ENV,
    InstanceMetrics,
    LedgerCollector,
    MetricsConfig,
    metrics_hook,
)
from tests.ledger_procs import ROOT

MiB = 1 << 20
LABELS = 'device="GPU-m",engine="vllm",instance="a"'


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "ledgers"))
    (tmp_path / "ledgers").mkdir()
    monkeypatch.delenv(PORT_ENV, raising=False)
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    return tmp_path


def value(text: str, name: str, labels: str = LABELS) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{{labels}}} not in:\n{text}")


def test_off_by_default() -> None:
    assert not MetricsConfig.from_env().enabled
    assert metrics_hook("GPU-m") is None


def test_bad_port_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_ENV, "ninety")
    with pytest.raises(ValueError, match="KVCORE_METRICS_PORT='ninety' is not a port number"):
        MetricsConfig.from_env()


def test_instance_gauges_follow_the_gate() -> None:
    registry = CollectorRegistry()
    led = GpuLedger.open("GPU-m", device_total=100 * MiB)
    metrics = InstanceMetrics("GPU-m", registry=registry)
    gate = LedgerGate(led, name="a", engine="vllm", limit=10 * MiB, on_change=metrics)
    assert gate.try_acquire(8 * MiB)
    gate.report_reserve(2 * MiB)
    assert not gate.try_acquire(4 * MiB)
    gate.release(MiB)
    text = generate_latest(registry).decode()
    assert value(text, "kvcore_mapped_bytes") == 7 * MiB
    assert value(text, "kvcore_reserve_bytes") == 2 * MiB
    assert value(text, "kvcore_limit_bytes") == 10 * MiB
    assert value(text, "kvcore_acquire_denied") == 1
    gate.close()
    text = generate_latest(registry).decode()
    assert value(text, "kvcore_mapped_bytes") == value(text, "kvcore_reserve_bytes") == 0
    led.close()


def test_ledger_collector_reads_every_gpu() -> None:
    a = GpuLedger.open("GPU-m", device_total=100 * MiB)
    b = GpuLedger.open("GPU-n", device_total=50 * MiB)
    b.set_budget(40 * MiB)
    ga = LedgerGate(a, name="a", engine="vllm")
    gb = LedgerGate(b, name="b", engine="sglang", limit=5 * MiB)
    assert ga.try_acquire(3 * MiB) and gb.try_acquire(4 * MiB)
    registry = CollectorRegistry()
    registry.register(LedgerCollector())
    text = generate_latest(registry).decode()
    assert value(text, "kvcore_mapped_bytes") == 3 * MiB
    b_labels = 'device="GPU-n",engine="sglang",instance="b"'
    assert value(text, "kvcore_limit_bytes", b_labels) == 5 * MiB
    assert value(text, "kvcore_gpu_budget_bytes", 'device="GPU-n"') == 40 * MiB
    assert value(text, "kvcore_gpu_budget_bytes", 'device="GPU-m"') == 100 * MiB
    assert value(text, "kvcore_gpu_mapped_bytes", 'device="GPU-n"') == 4 * MiB
    a.close()
    b.close()


_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_gate import LedgerGate
    from kvcore.metrics import metrics_hook
    led = GpuLedger.open("GPU-m", device_total=100 << 20)
    hook = metrics_hook("GPU-m")
    gate = LedgerGate(led, name="a", engine="vllm", on_change=hook)
    assert gate.try_acquire(6 << 20)
    gate.report_reserve(1 << 20)
    print(json.dumps({"hook": hook is not None}), flush=True)
    time.sleep(float(sys.argv[1]))
    """
)


def _child(env: dict[str, str], linger: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(linger)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"hook": True}
    return proc


def test_multiprocess_directory_mode(tmp_path: Path) -> None:
    from prometheus_client import multiprocess

    directory = tmp_path / "prom"
    proc = _child({MULTIPROC_ENV: str(directory)}, linger=0)
    assert proc.wait(30) == 0
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    text = generate_latest(registry).decode()
    assert value(text, "kvcore_mapped_bytes") == 6 * MiB
    assert value(text, "kvcore_reserve_bytes") == MiB


def test_the_port_listens_on_this_machine_only_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PORT_ENV, "9400")
    assert MetricsConfig.from_env().addr == "127.0.0.1"
    monkeypatch.setenv("KVCORE_METRICS_ADDR", "0.0.0.0")
    assert MetricsConfig.from_env().addr == "0.0.0.0"


def test_http_port_mode() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _child({PORT_ENV: str(port)}, linger=30)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert value(text, "kvcore_mapped_bytes") == 6 * MiB
    finally:
        proc.kill()
        proc.wait(5)
