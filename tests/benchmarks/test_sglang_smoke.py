"""``benchmarks.sglang_smoke`` against a stand-in ``sglang.launch_server`` (an HTTP server
with SGLang's ``/health`` and ``/generate`` shapes: SGLang cannot serve on a CPU machine):
both modes are started, served and stopped, in turn or together, and the verdict is token
identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .ports import free_ports

ROOT = Path(__file__).resolve().parents[2]

# Answers /generate with each prompt's ids repeated; with --kvcore-elastic and FLIP set, the
# last prompt's first token is changed (a mode that decodes differently).
_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
flip = "--kvcore-elastic" in sys.argv and os.environ.get("FLIP") == "1"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        outs = [(ids * n)[:n] for ids in body["input_ids"]]
        if flip:
            outs[-1][0] += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps([{"text": "", "output_ids": o} for o in outs]).encode())

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _smoke(tmp_path: Path, flip: bool, together: bool = False) -> tuple[int, dict]:
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(_SERVER)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}", "FLIP": "1" if flip else "0"}
    cmd = [sys.executable, "-m", "benchmarks.sglang_smoke", "--model", str(model), "--out",
           str(out), "--port", str(free_ports(2)), "--max-new-tokens", "4",
           *(["--together"] * together), "--", "--attention-backend", "triton"]  # fmt: skip
    rc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, timeout=300).returncode
    return rc, json.loads((out / "smoke.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("together", [False, True], ids=["in-turn", "together"])
@pytest.mark.parametrize("flip", [False, True])
def test_the_smoke_passes_only_when_both_modes_give_the_same_tokens(
    tmp_path: Path, flip: bool, together: bool
) -> None:
    rc, report = _smoke(tmp_path, flip, together)
    assert [r["mode"] for r in report["runs"]] == ["on", "off"]
    for run in report["runs"]:
        assert "error" not in run
        assert run["rounds_agree"]
        assert len(run["outputs"]) == 2 and len(run["outputs"][0]) == 20  # two rounds
        assert ("--kvcore-elastic" in run["cmd"]) == (run["mode"] == "on")
        assert "--attention-backend" in run["cmd"]  # what follows -- reaches every server
    assert report["agree"] is not flip
    assert rc == (1 if flip else 0)
