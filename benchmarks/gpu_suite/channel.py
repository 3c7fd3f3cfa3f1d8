"""Step ``channel``: the worker-channel latency benchmark, run with the suite's backend."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu_suite.common import ROOT, Suite, log, run_text


def step_channel(suite: Suite) -> dict[str, Any]:
    """Run the worker-channel latency benchmark (another script, optional) with the suite's
    backend; its options are passed only where its ``--help`` lists them."""
    script = Path(suite.args.channel_script)
    if not script.exists():
        return {"status": "absent", "note": f"{script} does not exist yet"}
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    help_text = run_text([sys.executable, str(script), "--help"], timeout=60)
    cmd = [sys.executable, str(script), "--backend", suite.backend_name]
    json_path = suite.out / "channel.json"
    wanted = [("--json", str(json_path))]
    if suite.mode == "dry":
        wanted += [("--workers", "1"), ("--iters", "10"), ("--warmup", "2")]
    else:
        import torch

        wanted.append(("--devices", str(max(1, torch.cuda.device_count()))))
        if suite.mode == "quick":
            wanted += [("--workers", "1,2"), ("--iters", "50")]
    for opt, value in wanted:
        if opt in help_text:
            cmd += [opt, value]
    limit = max(10.0, min(240.0, suite.remaining() - 5))
    log(f"   {' '.join(cmd)} (limit {limit:.0f} s)")
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit, check=False
        )
        output, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout if isinstance(exc.stdout, str) else ""
        rc, timed_out = None, True
    (suite.out / "channel.log").write_text(output)
    tail = [
        ln
        for ln in output.strip().splitlines()
        if "Warning" not in ln and "_conversion_method_template" not in ln
    ][-15:]
    for line in tail[-8:]:
        log(f"   | {line}")
    data = None
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(json_path.read_text())
    if rc != 0 or timed_out:
        raise RuntimeError(f"channel_latency.py exited {rc} (timed out: {timed_out})")
    return {"command": " ".join(cmd), "returncode": rc, "tail": tail, "results": data}
