"""``benchmarks/colocate_replot.py``: a saved run's KV plots drawn again from its JSON."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import colocate_replot
from benchmarks.vllm_colocate import GiB


def _document() -> dict[str, object]:
    """A two-mode run of one peak as the benchmark writes it, cut to what the plot reads;
    elastic held from the ledger, kvcached's from its segments."""

    def phase(mode: str, t0: float) -> dict[str, object]:
        return {"mode": mode, "peak": 16.0, "repeat": 0, "t_start": t0, "t_end": t0 + 10.0,
                "summary": {"instances": {"a": {}, "b": {}}}, "steer": []}  # fmt: skip

    ledger = [{"t": 1.0 + i, "instances": {"a": {"mapped": i * GiB}, "b": {"mapped": GiB}}}
              for i in range(5)]  # fmt: skip
    segments = [{"t": 21.0 + i, "instances": {n: {"mapped": GiB, "used": GiB // 2}
                                              for n in "ab"}} for i in range(5)]  # fmt: skip
    gauges = [{"t": 2.0, "mode": "elastic", "instance": "a", "vllm:kv_cache_usage_perc": 0.1}]
    servers = {f"{m}/{n}": {"kv_bytes": 4 * GiB} for m in ("elastic", "kvcached") for n in "ab"}
    return {
        "config": {"kv_total_bytes": 4 * GiB, "workload": "ramp"},
        "servers": servers,
        "phases": [phase("elastic", 0.0), phase("kvcached", 20.0),
                   {"mode": "static", "peak": 16.0, "repeat": 0}],  # skipped: no summary
        "ledger": ledger, "kvcached_segments": segments, "gauges": gauges,
    }  # fmt: skip


def test_replot_draws_each_peak_from_a_gzipped_document(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = tmp_path / "run-x.json.gz"
    with gzip.open(doc, "wt") as f:
        json.dump(_document(), f)
    assert colocate_replot.run_stem(doc) == "run-x"
    assert colocate_replot.main([str(doc), "--out-dir", str(tmp_path / "png")]) == 0
    png = tmp_path / "png" / "run-x-kv-ramp-peak16-r0.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [png.name]
