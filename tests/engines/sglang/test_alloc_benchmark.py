"""``benchmarks/sglang_alloc.py``'s ``--profile``: the operator tables it writes per side.

The benchmark's figures are read on the GPU machine; here its CPU run checks that a profile
names each side's calls for the cycles it ran, which is what the GPU run relies on to say
where the elastic side's extra time goes.
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


def test_profile_writes_each_sides_operator_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "prof"
    argv = ["sglang_alloc", "--workloads", "token", "--repeats", "1", "--iters", "3"]
    argv += ["--reserve", "0", "0", "--profile", str(out), "--json", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", argv)
    # main() sets the reserve in the module's settings and torch's thread count: both are
    # put back for the tests that follow
    monkeypatch.setattr(sglang_alloc, "KVCORE", dict(sglang_alloc.KVCORE))
    threads = torch.get_num_threads()
    try:
        sglang_alloc.main()
    finally:
        torch.set_num_threads(threads)

    assert sorted(p.name for p in out.iterdir()) == ["token-elastic.txt", "token-upstream.txt"]
    for side in ("elastic", "upstream"):
        text = (out / f"token-{side}.txt").read_text()
        assert text.startswith("3 cycles on cpu\n")
        assert "aten::" in text and "# of Calls" in text
    # the timed rows are written as before, beside the profiles
    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert row["workload"] == "token" and row["cycles"] == 3
