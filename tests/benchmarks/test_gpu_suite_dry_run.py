"""The GPU suite's control flow, run on CPU (``python -m benchmarks.gpu_suite --dry-run``).

The suite is the one script the lead runs on the H200; a crash there costs scarce device
time. Here it runs end to end on the ``host`` backend with tiny sizes (no Triton, no raw
CUDA), and its pure helpers (pytest summary parsing, the layout decision, the Markdown
renderer) are checked on known inputs. The Triton kernel itself is checked against its torch
reference in Triton's CPU interpreter where Triton is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.gpu_suite.__main__ import main
from benchmarks.gpu_suite.bandwidth import decide_layout
from benchmarks.gpu_suite.common import Sizes, kv_geometry, size_text
from benchmarks.gpu_suite.gpu_tests import parse_pytest_summary
from benchmarks.render_results import render_markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu-suite")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_suite",
            "--dry-run",
            "--out",
            str(out),
            "--budget-s",
            "240",
            "--commit",
            "test",
            "--skip",
            "channel",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    results = json.loads((out / "results.json").read_text())
    failed = {k: v for k, v in results["steps"].items() if v["status"] != "ok"}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    return results, (out / "results.md").read_text(), proc.stdout


@pytest.mark.slow
def test_dry_run_runs_every_step_and_records_each_figure(dry_run: tuple[dict, str, str]) -> None:
    results, markdown, stdout = dry_run
    steps = results["steps"]
    for name in ("vmm", "mapper", "bandwidth", "handoff", "decode"):
        assert steps[name]["status"] == "ok", (name, steps[name])
    assert "pytest" not in steps  # the dry run leaves the nested test run out
    figures = results["figures"]
    by_letter = {f["figure"] for f in figures}
    assert by_letter == {"a", "b", "c", "d"}
    for f in figures:
        assert f["ours"] is not None and f["ours"] >= 0, f
    # (a) every operation at every size
    names = {f["name"] for f in figures if f["figure"] == "a"}
    for op in ("create", "map", "set_access", "unmap", "release", "cycle"):
        assert f"{op} 64 KiB" in names and f"{op} 1 MiB" in names
    # each next to its raw baseline (the bare host backend here, cuda.bindings on a GPU)
    assert all(
        f["baseline"] is not None and f["ratio"] is not None for f in figures if f["figure"] == "a"
    )
    handoff = [f for f in figures if f["figure"] == "c" and "pages" in f["name"]]
    assert handoff and all(f["baseline_label"] for f in handoff)
    # the mapper's driver calls were counted: compound maps one handle per page id
    calls = steps["mapper"]["details"]["compound"]["driver_calls"]["map"]
    assert calls.get("map") == 1 and calls.get("set_access") == 1
    per_layer = steps["mapper"]["details"]["per-layer"]
    assert per_layer["handles_per_page"] == 4
    assert per_layer["driver_calls"]["map"]["map"] == 4
    # (b) both layouts read the same sums as the plain tensor, and a layout was decided
    bw = steps["bandwidth"]["details"]
    assert set(bw["rel_error"]) >= {
        "plain",
        "kvcore per-layer, 64 KiB pages",
        "kvcore compound, 64 KiB pages",
    }
    assert all(err < 1e-3 for err in bw["rel_error"].values())
    assert results["decisions"]["default_layout_dry_run"]["layout"] in ("compound", "per-layer")
    # (c) the handoff went through the ledger at both handle sizes, B missed at least once
    per_size = steps["handoff"]["details"]["per_page_size"]
    assert set(per_size) == {"64 KiB", "1 MiB"}
    for rec in per_size.values():
        assert rec["median_ms"] > 0
        for rep in rec["reps"]:
            assert rep["b_mapped_ms"] <= rep["handoff_ms"]
    assert any(rep["b_misses"] > 0 for rec in per_size.values() for rep in rec["reps"])
    # (d) with a reserve the allocating thread made no driver call
    runs = steps["decode"]["details"]["runs"]
    assert runs["64 KiB pages, reserve"]["driver_calls_allocating_thread"] == 0
    assert runs["64 KiB pages, no reserve"]["driver_calls_allocating_thread"] > 0
    # the Markdown has a table per figure and the step list
    for title in ("(a) VMM", "(b) Paged-KV", "(c) Handoff", "(d) Steady-state", "## Steps"):
        assert title in markdown
    assert "not yet run" not in markdown
    assert "DECISION" in stdout


_FAKE_CHANNEL = """
import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--backend")
ap.add_argument("--json")
ap.add_argument("--workers")
args = ap.parse_args()
assert args.backend == "host" and args.workers == "1"
rows = [{"workers": 1, "map_ms": 0.2, "unmap_ms": 0.3, "map_ratio": 8.0, "unmap_ratio": 9.0}]
data = {"local": {"map_ms": 0.025, "unmap_ms": 0.033}, "channel": rows}
open(args.json, "w").write(json.dumps(data))
print("| 1 | 0.2 | 0.3 |")
"""


def test_channel_step_passes_listed_options_and_keeps_the_json(tmp_path: Path) -> None:
    script = tmp_path / "fake_channel.py"
    script.write_text(_FAKE_CHANNEL)
    out = tmp_path / "out"
    argv = [
        "--dry-run",
        "--out",
        str(out),
        "--only",
        "channel",
        "--channel-script",
        str(script),
        "--budget-s",
        "60",
        "--grace-s",
        "600",
    ]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    step = results["steps"]["channel"]
    assert step["status"] == "ok", step
    cmd = step["details"]["command"]
    # only the options the script's --help lists are passed
    assert "--json" in cmd and "--workers 1" in cmd and "--iters" not in cmd
    assert step["details"]["results"]["channel"][0]["map_ratio"] == 8.0
    assert "| 1 | 0.2 | 0.3 | 8 | 9 |" in (out / "results.md").read_text()


def test_pytest_summary_parsing() -> None:
    parse = parse_pytest_summary
    assert parse("....\n3 passed, 1 failed, 2 skipped in 4.2s\n") == {
        "passed": 3,
        "failed": 1,
        "skipped": 2,
    }
    assert parse("x\n1 failed, 1 error, 5 deselected, 2 warnings in 0.1s") == {
        "failed": 1,
        "errors": 1,
        "deselected": 5,
        "warnings": 2,
    }
    assert parse("no summary here") == {}


def test_layout_decision_prefers_compound_when_it_qualifies() -> None:
    mib2 = 2 << 20
    gbps = {"kvcore compound, 2 MiB pages": 98.0, "kvcore per-layer, 2 MiB pages": 100.0}
    dec = decide_layout(gbps, 100.0, mib2)
    assert dec["layout"] == "compound" and dec["met"]
    gbps["kvcore compound, 2 MiB pages"] = 90.0
    dec = decide_layout(gbps, 100.0, mib2)
    assert dec["layout"] == "per-layer" and dec["met"]
    gbps["kvcore per-layer, 2 MiB pages"] = 95.0
    dec = decide_layout(gbps, 100.0, mib2)
    assert dec["layout"] == "per-layer" and dec["met"] is False
    assert decide_layout({}, None, mib2)["layout"] is None


def test_render_marks_missing_figures_and_failed_goals() -> None:
    render = render_markdown
    results = {
        "meta": {"gpu": "NVIDIA H200", "commit": "abc", "command": "python x"},
        "figures": [
            {
                "figure": "a",
                "name": "map 2 MiB",
                "ours": 4.4,
                "baseline": 4.0,
                "ratio": 1.1,
                "units": "us",
                "goal": "<= 1.1x raw",
                "met": False,
                "baseline_label": "raw",
            },
        ],
        "steps": {
            "pytest": {
                "status": "ok",
                "seconds": 3,
                "details": {"counts": {"passed": 5, "failed": 1}},
            }
        },
        "decisions": {"default_layout_cuda": {"summary": "compound"}},
    }
    text = render(results)
    assert "| map 2 MiB | 4.4 | 4 (raw) | 1.1 | us | <= 1.1x raw | **no** |" in text
    assert text.count("not yet run") == 3  # b, c, d
    assert "5 passed, 1 failed" in text
    assert "NVIDIA H200" in text and "`abc`" in text


def test_triton_kernel_matches_reference_in_interpreter() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    code = """
import torch
from benchmarks.gpu_suite import kernels as g
assert g.HAVE_TRITON
torch.manual_seed(0)
L, nb, bs, H, D = 2, 24, 16, 2, 32
kv = torch.randn(nb, L, 2, bs, H, D).to(torch.bfloat16)  # compound strides
table = torch.randperm(nb)[:12].reshape(3, 4).to(torch.int32)
for layer in range(L):
    k, v = kv[:, layer, 0], kv[:, layer, 1]
    out = torch.full((3, H, 3), float("nan"))  # 3 programs per row of 4 blocks: 2, 2, 0
    g.paged_kv_read(k, v, table, out)
    ref = g.reference_read(k, v, table)
    err = ((out.sum(-1) - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_gpu_sizes_make_valid_geometries(mode: str) -> None:
    """Every shape the GPU run will build is a valid KV geometry on 2 MiB granularity (a
    GeometryError there would cost a device call)."""
    sz = Sizes.for_mode(mode)
    gpu = SimpleNamespace(granularity=lambda: 2 << 20)
    shape = sz.shape
    assert all(size % (2 << 20) == 0 for size in sz.vmm_sizes)
    assert sz.bw_blocks % sz.bw_seqs == 0
    for layout, page_bytes in sz.bw_variants:
        geo = kv_geometry(gpu, shape, sz.bw_blocks, page_bytes, layout)
        assert geo.num_pages * geo.blocks_per_page == sz.bw_blocks  # no partial page
    for page_bytes in sz.handoff_pages:
        rows = sz.handoff_bytes // shape.compound_row_bytes
        geo = kv_geometry(gpu, shape, rows, page_bytes, "compound")
        assert geo.num_pages * geo.page_device_bytes == sz.handoff_bytes
    capacity = sz.decode_seqs * -(-sz.decode_max_len // shape.block_size) + sz.decode_seqs
    for _, page_bytes, reserve in sz.decode_configs:
        geo = kv_geometry(gpu, shape, capacity, page_bytes, "compound")
        assert reserve <= geo.num_pages
    decided = {f"kvcore {lay}, {size_text(pb)} pages" for lay, pb in sz.bw_variants}
    for layout in ("compound", "per-layer"):  # decide_layout finds both default-size variants
        assert f"kvcore {layout}, {size_text(sz.page_unit)} pages" in decided


def test_vmm_python_overhead_runs_on_the_stub_driver() -> None:
    """The CPU microbenchmark of the VMM hot path's Python overhead (a subprocess: it
    installs a stub ``cuda.bindings.driver`` into its own ``sys.modules``)."""
    args = ["--reps", "3", "--inner", "20", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vmm_python_overhead", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ops = json.loads(proc.stdout)["ops"]
    assert {"map", "set_access", "unmap", "create+release"} <= set(ops)
    assert any(name.startswith("mapper map+unmap cycle (per-layer") for name in ops)
    for fig in ops.values():
        assert fig["kvcore_ns"] > 0 and fig["raw_ns"] > 0
