"""``benchmarks.sglang_serve`` on CPU: stand-ins for SGLang's server and benchmark client
(SGLang cannot serve on a CPU machine) and for NVML, so what is checked is the benchmark's
own work: the command each mode's server gets, the client's command and result line, the
rounds, the counters and the ratios to ``off``."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import sglang_serve
from benchmarks.serve_rounds import METRICS, summarize

from .ports import free_ports

ROOT = Path(__file__).resolve().parents[2]

# The server records its command line; /metrics counts the /generate-free runs the client
# reports to it (POST /run), so the counter deltas are known.
_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
open(f"{sys.argv[sys.argv.index('--port') + 1]}.cmd", "w").write(json.dumps(sys.argv))
runs = [0]
calls = open(f"{port}.calls", "a")


print("serving on", port, flush=True)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        if self.path == "/metrics":
            self.wfile.write(f"sglang:generation_tokens_total {runs[0] * 100}.0\\n".encode())

    def do_POST(self):
        calls.write(self.path + "\\n")
        calls.flush()
        runs[0] += self.path == "/run"
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

# The client tells the server a run happened and writes SGLang's result line: the elastic
# server (the second port) is 10% slower.
_CLIENT = """
import json, sys, urllib.request
a = sys.argv
url = a[a.index("--base-url") + 1]
urllib.request.urlopen(urllib.request.Request(url + "/run", b"", method="POST"))
seed, prompts = a[a.index("--seed") + 1], a[a.index("--num-prompts") + 1]
open(url.rsplit(":", 1)[1] + ".clients", "a").write(f"{seed} {prompts}\\n")
slow = 1.1 if url.endswith("1") else 1.0
line = {"output_throughput": 1000 / slow, "median_ttft_ms": 10 * slow, "p99_ttft_ms": 20.0,
        "median_tpot_ms": 5 * slow, "p99_tpot_ms": 9.0, "duration": 1.0, "argv": a[1:],
        "completed": int(a[a.index("--num-prompts") + 1]),
        "total_input_tokens": 2000 * int(a[a.index("--num-prompts") + 1])}
open(a[a.index("--output-file") + 1], "a").write(json.dumps(line) + "\\n")
"""

_NVML = """
class NVMLError(Exception):
    pass
NVML_CLOCK_SM = 1
def nvmlInit(): pass
def nvmlDeviceGetHandleByIndex(i): return 0
def nvmlDeviceGetComputeRunningProcesses(h): return []
def nvmlDeviceGetMemoryInfo(h):
    class M: used = 1 << 30
    return M()
def nvmlDeviceGetUtilizationRates(h): raise NVMLError("not here")
def nvmlDeviceGetClockInfo(h, c): raise NVMLError("not here")
"""


def test_kv_bytes_per_token_of_the_test_shapes() -> None:
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096}  # fmt: skip
    qwen = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "hidden_size": 1024, "head_dim": 128}  # fmt: skip
    assert sglang_serve.kv_bytes_per_token(llama) == 131072
    assert sglang_serve.kv_bytes_per_token(qwen) == 114688


def test_a_variant_is_a_named_json_object_other_than_a_mode() -> None:
    import argparse

    assert sglang_serve.parse_variant('kept={"reserve_max": 16}') == (
        "kept", '{"reserve_max": 16}'
    )  # fmt: skip
    for bad, says in [("on={}", "NAME a word"), ("kept", "NAME=JSON"), ("a b={}", "NAME a word"),
                      ("kept={oops", "not JSON"), ("kept=[1]", "JSON object")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            sglang_serve.parse_variant(bad)


def test_a_plan_that_overcommits_the_device_is_refused_with_what_to_lower() -> None:
    h100 = 81_559 << 20  # an H100 80GB's NVML total
    # four servers of 20 GiB of KV beside 6 GiB each: the H100 run that lost its fourth server
    why = sglang_serve.overcommit(4, 20.0, 6.0, h100)
    assert why is not None
    assert "104.0 GiB exceed the device's 79.6 GiB" in why and "--kv-gib" in why
    assert sglang_serve.overcommit(3, 16.0, 6.0, h100) is None
    assert sglang_serve.overcommit(4, 20.0, 6.0, 143_771 << 20) is None  # an H200


def test_the_client_sends_token_ids_only_when_asked(tmp_path: Path) -> None:
    import argparse

    args = argparse.Namespace(input_len=1024, output_len=128, tokenize_prompt=False)
    out = tmp_path / "r.jsonl"
    text = sglang_serve.client_cmd("m", args, 30011, "inf", 1500, 2, out)
    assert text[text.index("--random-input-len") + 1] == "1024"
    assert text[text.index("--num-prompts") + 1] == "1500" and "--tokenize-prompt" not in text
    args.tokenize_prompt = True
    ids = sglang_serve.client_cmd("m", args, 30011, "inf", 1500, 2, out)
    assert ids == [*text, "--tokenize-prompt"]


def _serve(tmp_path: Path, servers: int, *args: str) -> tuple[int, Path, str]:
    """``benchmarks.sglang_serve`` with ``args`` over the stand-ins, in ``tmp_path``, on
    ``servers`` free ports from the first one it returns, a model of the Qwen3-0.6B shape;
    returns that port, the result file and what it printed. Fails the test when the run fails."""
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(_SERVER)
    (fake / "sglang" / "benchmark").mkdir()
    (fake / "sglang" / "benchmark" / "__init__.py").write_text("")
    (fake / "sglang" / "benchmark" / "serving.py").write_text(_CLIENT)
    (fake / "pynvml.py").write_text(_NVML)
    model = tmp_path / "qwen3-0.6b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "hidden_size": 1024, "head_dim": 128,
    }))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"}
    out = tmp_path / "serve.json"
    port = free_ports(servers)
    cmd = [sys.executable, "-m", "benchmarks.sglang_serve", "--models", str(model),
           "--out", str(out), "--repeats", "2", "--num-prompts", "7", "--kv-gib", "1",
           "--port", str(port), "--start-timeout", "120", *args]  # fmt: skip
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return port, out, run.stdout


@pytest.mark.slow
def test_rounds_of_both_modes_with_sglangs_client(tmp_path: Path) -> None:
    port, out, stdout = _serve(
        tmp_path, 3, "--rates", "inf", "--kvcore-config", '{"reserve_min": 2}',
        "--variant", 'kept={"reserve_max": 16}', "--warmup-prompts", "5",
        "--", "--attention-backend", "triton",
    )  # fmt: skip

    off_cmd = json.loads((tmp_path / f"{port}.cmd").read_text())
    on_cmd = json.loads((tmp_path / f"{port + 1}.cmd").read_text())
    tokens = str((1 << 30) // 114688)
    for cmd_line in (off_cmd, on_cmd):
        assert cmd_line[cmd_line.index("--max-total-tokens") + 1] == tokens
        assert "--enable-metrics" in cmd_line and "--attention-backend" in cmd_line
    assert "--kvcore-elastic" not in off_cmd
    assert on_cmd[on_cmd.index("--kvcore-config") + 1] == '{"reserve_min": 2}'
    # a variant is one more elastic server with its own --kvcore-config
    kept_cmd = json.loads((tmp_path / f"{port + 2}.cmd").read_text())
    assert "--kvcore-elastic" in kept_cmd
    assert kept_cmd[kept_cmd.index("--kvcore-config") + 1] == '{"reserve_max": 16}'

    doc = json.loads(out.read_text())
    runs = doc["results"][0]["runs"]
    assert [(r["mode"], r["round"]) for r in runs] == [
        ("off", 0), ("on", 0), ("kept", 0), ("on", 1), ("kept", 1), ("off", 1)
    ]  # the order rotates between rounds  # fmt: skip
    assert all(r["completed"] == 7 and r["num_prompts"] == 7 for r in runs)
    # the load the client reports is kept (the prompt tokens the server saw)
    assert all(r["total_input_tokens"] == 14000 for r in runs)
    assert all(r["total_output_tokens"] is None for r in runs)  # the stand-in leaves it out
    # without --flush-cache the servers see only the client's requests: first the warm-up
    # (its own seed, no round's, and --warmup-prompts prompts), then one run a round
    assert (tmp_path / f"{port}.calls").read_text() == "/run\n" * 3
    for p in (port, port + 1, port + 2):
        assert (tmp_path / f"{p}.clients").read_text() == "10000 5\n0 7\n1 7\n"
    assert set(doc["results"][0]["warmup"]) == {"off", "on", "kept"}
    assert "qwen3-0.6b: warmed up off " in stdout
    # the server's counter moved by one client run each time
    assert all(r["counters"] == {"sglang:generation_tokens_total": 100.0} for r in runs)
    (row,) = doc["summary"]
    assert row["output_throughput_on_ratio"] == pytest.approx(1 / 1.1)
    assert row["median_tpot_ms_on_ratio"] == pytest.approx(1.1)
    assert "on: output_throughput 909.1 (0.909x)" in stdout
    assert row["output_throughput_kept_ratio"] == pytest.approx(1.0)
    assert "kept: output_throughput 1000.0 (1.000x)" in stdout
    # each server's whole log comes back beside the result
    for mode, p in (("off", port), ("on", port + 1), ("kept", port + 2)):
        log = gzip.decompress((tmp_path / f"serve-qwen3-0.6b-{mode}.log.gz").read_bytes())
        assert f"serving on {p}" in log.decode()


@pytest.mark.slow
def test_flush_cache_empties_each_server_before_each_run(tmp_path: Path) -> None:
    port, out, _ = _serve(
        tmp_path, 2, "--rates", "inf", "16", "--num-prompts-rate", "3", "--flush-cache"
    )
    # the warm-up (default 64 prompts) first, flushed before as a measured run is: the first
    # flush takes the pool's empty size, which must come before the warm-up maps pages
    for p in (port, port + 1):
        assert (tmp_path / f"{p}.calls").read_text() == "/flush_cache\n/run\n" * 5
    runs = json.loads(out.read_text())["results"][0]["runs"]
    assert len(runs) == 8
    assert all(r["counters"] == {"sglang:generation_tokens_total": 100.0} for r in runs)
    # each elastic run waited for its pool to give back (the stand-in NVML lists no process:
    # nothing held, nothing to wait for); upstream's pool is whole and is not waited for
    for r in runs:
        if r["mode"] == "off":
            assert "give_back" not in r
        else:
            assert r["give_back"] == {"from": 0, "to": 0, "s": 0.0, "reached": True}


def test_a_refused_flush_stops_the_run_with_the_servers_answer() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"Flush cache failed: requests running")

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match=r"refused \(400\).*requests running"):
            sglang_serve._flush_cache(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow
def test_a_time_limit_ends_the_rounds_whole(tmp_path: Path) -> None:
    # round 0 always runs; with 1 s of limit no later round fits, whatever the machine's pace
    # (the later --repeats wins over _serve's own)
    _, out, stdout = _serve(tmp_path, 2, "--rates", "inf", "16", "--num-prompts-rate", "3",
                            "--repeats", "3", "--time-limit-s", "1")  # fmt: skip
    (result,) = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["rate"], r["round"]) for r in result["runs"]] == [
        ("off", "inf", 0), ("on", "inf", 0), ("off", "16", 0), ("on", "16", 0)
    ]  # fmt: skip
    assert result["stopped"].startswith("round 1 of 3 not started")
    assert "round 1 of 3 not started" in stdout
    # the servers were still stopped and their logs kept
    assert (tmp_path / "serve-qwen3-0.6b-on.log.gz").exists()


def test_the_first_round_and_the_later_ones_are_summarized_apart() -> None:
    # an elastic pool fills in its first round and is mapped in the later ones: the summary
    # keeps the fill and the serving after it apart, as well as the median over all rounds
    def run(mode: str, r: int, tok_s: float) -> dict[str, object]:
        return {"mode": mode, "rate": "inf", "round": r, "output_throughput": tok_s,
                **{m: 1.0 for m in METRICS if m != "output_throughput"}}  # fmt: skip

    runs = [run("off", r, 100.0) for r in range(3)]
    runs += [run("on", 0, 90.0), run("on", 1, 99.0), run("on", 2, 101.0)]
    (row,) = summarize([{"model": "m", "modes": ["off", "on"], "runs": runs}])
    assert row["first_output_throughput_on_ratio"] == pytest.approx(0.90)
    assert row["later_output_throughput_on_ratio"] == pytest.approx(1.00)
    assert row["output_throughput_on_ratio"] == pytest.approx(0.99)
    # one round: nothing after the first
    (row,) = summarize([{"model": "m", "modes": ["off", "on"], "runs": runs[:1] + runs[3:4]}])
    assert row["later_output_throughput_on"] is None
    assert row["later_output_throughput_on_ratio"] is None
