"""``benchmarks/sglang_alloc.py``'s ``--profile`` (the operator tables it writes per side)
and ``--ledger-calls`` (the ledger's calls per cycle and their cost).

The benchmark's figures are read on the GPU machine; here its CPU run checks that a profile
names each side's calls for the cycles it ran, and that the ledger's calls are counted as
the workload makes them, which is what the GPU run relies on to say where the elastic
side's extra time goes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import sglang_alloc

from .harness import requires_fork

pytestmark = requires_fork


def _run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["sglang_alloc", *argv])
    # main() sets the reserve in the module's settings and torch's thread count: both are
    # put back for the tests that follow
    monkeypatch.setattr(sglang_alloc, "KVCORE", dict(sglang_alloc.KVCORE))
    threads = torch.get_num_threads()
    try:
        sglang_alloc.main()
    finally:
        torch.set_num_threads(threads)


def test_profile_writes_each_sides_operator_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "prof"
    argv = ["--workloads", "token", "--repeats", "1", "--iters", "3", "--reserve", "0", "0"]
    _run([*argv, "--profile", str(out), "--json", str(tmp_path / "r.json")], monkeypatch)

    assert sorted(p.name for p in out.iterdir()) == ["token-elastic.txt", "token-upstream.txt"]
    for side in ("elastic", "upstream"):
        text = (out / f"token-{side}.txt").read_text()
        assert text.startswith("3 cycles on cpu\n")
        assert "aten::" in text and "# of Calls" in text
    # the timed rows are written as before, beside the profiles
    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert row["workload"] == "token" and row["cycles"] == 3


def test_ledger_calls_counts_the_workloads_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the token cycle is one alloc(64) and one free of those 64 ids: on the CPU the free
    # reaches the ledger at once, as one tensor of fewer ids than the ledger sorts in numpy
    # (so free_tensor hands them to free)
    argv = ["--workloads", "token", "--repeats", "1", "--iters", "4", "--reserve", "0", "0"]
    _run([*argv, "--ledger-calls", "--json", str(tmp_path / "r.json")], monkeypatch)

    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    timed = row["elastic_ledger_calls"]
    assert timed["cycle_us"] > 0
    calls = timed["calls"]
    for method in ("alloc_split", "free_tensor", "free"):
        assert calls[method]["calls_per_cycle"] == 1.0
        assert calls[method]["us_per_call"] > 0
    assert "free_range" not in calls  # never called: not reported


def test_ledger_calls_puts_the_ledgers_methods_back() -> None:
    engine = sglang_alloc._stack(elastic=True, page_size=1)
    try:
        ledger = engine.allocator.ledger
        sglang_alloc._ledger_calls(engine.allocator, sglang_alloc._token_cycle, 2)
        for method in sglang_alloc.LEDGER_CALLS:
            assert method not in vars(ledger)  # the class's method again, no timer left
    finally:
        if engine.scope is not None:
            engine.scope.close()
