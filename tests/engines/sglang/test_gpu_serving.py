"""SGLang's real server on a CUDA GPU, elastic KV on and off, by HTTP (``gpu`` marker).

Each case runs ``benchmarks.sglang_smoke --together``: the forked SGLang's ``launch_server``
with ``--kvcore-elastic`` and without it, both up at once, on the same offline
Qwen3-0.6B-shaped model with seeded dummy weights; one greedy batch (short, long and
shared-prefix prompts) twice on each, the second hitting the radix cache. What must hold:

* both modes serve and give the same tokens, with the token allocator (page size 1, SGLang's
  default), the paged allocator (page size 16), CUDA graphs, and under a ``limit_bytes`` of
  512 MiB (about half of what the batch needs), so that requests wait for memory (both modes
  then run SGLang's deterministic inference: a different batch composition may not change a
  token);
* the servers give all their GPU memory back at exit.

The GPU machine's image has no SGLang and a torch that sglang-kernel's binaries were not
built for: the bundle of ``benchmarks/sglang_bundle.py`` carries SGLang there with the
stand-ins of ``benchmarks/sglang_compat`` (its README says what each replaces), hence the
backends below. Run there with ``bash benchmarks/sglang_device.sh run python3 -m pytest
-m gpu tests/engines/sglang/test_gpu_serving.py``; ``KVCORE_MODEL_DIR`` (set by that
script) names the model directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .harness import requires_fork

pytestmark = [pytest.mark.gpu, requires_fork]

ROOT = Path(__file__).resolve().parents[3]

GPU_MACHINE = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
               "--grammar-backend", "none"]  # fmt: skip
"""Backends the GPU machine's SGLang can run: no flashinfer, no FA3 ``flash_ops``."""
TOGETHER = ["--mem-fraction-static", "0.4", "--max-total-tokens", "65536"]
"""Both servers of a case run at once: each takes at most 0.4 of the GPU, and both size the
same pool (65,536 tokens, about six times what the batch needs), so that both schedule alike."""
NO_GRAPHS = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]

CASES = {
    "token-allocator": ([*NO_GRAPHS], None),
    "paged-16": (["--page-size", "16", *NO_GRAPHS], None),
    "cuda-graphs": (["--cuda-graph-backend-prefill", "disabled"], None),
    "tight-limit": (["--enable-deterministic-inference", *NO_GRAPHS], {"limit_bytes": 512 << 20}),
}
"""Case -> (server arguments beyond ``GPU_MACHINE``, the elastic server's --kvcore-config).
``cuda-graphs`` captures SGLang's decode graphs; its prefill graphs (0.5.23's breakable CUDA
graphs) fail to capture on the GPU machine's torch 2.11 in both modes (``assert graph is not
None`` at the end of a segment), so they stay off there."""
MIB_SLACK = 64
"""What may stay in use after the elastic server exits (another process's context)."""


@pytest.mark.parametrize("case", list(CASES))
def test_elastic_and_upstream_serve_the_same_tokens(case: str, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = os.environ.get("KVCORE_MODEL_DIR")
    if not model or not (Path(model) / "config.json").exists():
        pytest.skip("KVCORE_MODEL_DIR names no offline model (sglang_device.sh sets it)")
    extra, config = CASES[case]
    cmd = [sys.executable, "-m", "benchmarks.sglang_smoke", "--model", model,
           "--out", str(tmp_path), "--start-timeout-s", "300", "--together"]  # fmt: skip
    if config:
        cmd += ["--kvcore-config", json.dumps(config)]
    run = subprocess.run([*cmd, "--", *GPU_MACHINE, *TOGETHER, *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    report = json.loads((tmp_path / "smoke.json").read_text())
    on, off = report["runs"]
    for r in (on, off):
        assert "error" not in r, f"{r['mode']}: {r['error']}\n{run.stdout[-2000:]}"
        assert r["rounds_agree"], f"{r['mode']}: the radix-cache round decoded differently"
    assert report["agree"], run.stdout[-2000:]
    assert run.returncode == 0
    used = on["used_mib"]
    if used["before"] is not None:
        assert used["after_stop"] <= used["before"] + MIB_SLACK, used
