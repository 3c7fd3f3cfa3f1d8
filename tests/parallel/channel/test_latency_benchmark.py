"""``benchmarks/channel_latency.py`` runs end to end on the host backend (tiny counts), so
a GPU run of the same script does not fail on its control flow."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "channel_latency.py"

pytestmark = pytest.mark.slow


def test_benchmark_runs_and_reports_every_worker_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Imported by name from its directory so the spawned workers can import it too.
    monkeypatch.syspath_prepend(str(BENCH.parent))
    module = importlib.import_module("channel_latency")
    out = tmp_path / "result.json"
    args = ["--workers", "1,2", "--iters", "5", "--warmup", "1", "--batch", "2"]
    assert module.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["workers"] for row in result["channel"]] == [1, 2]
    assert all(row["map_ms"] > 0 and row["unmap_ms"] > 0 for row in result["channel"])
    assert result["local"]["map_ms"] > 0
    assert "| 2 |" in capsys.readouterr().out
