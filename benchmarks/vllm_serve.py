"""vLLM's OpenAI server with elastic KV on and off, loaded by vLLM's own benchmark client.

For each model shape, servers are launched in turn in each of ``--modes`` (``off``:
upstream, vLLM's default KV layout; ``off-blhnc``: upstream code on the block-outermost
layout elastic KV needs, ``VLLM_KV_CACHE_LAYOUT=BLHNC``; ``on``: elastic KV, same layout),
``--repeats`` rounds; each launch serves every load in ``--rates``
with ``vllm bench serve`` (random dataset, ``--input-len`` / ``--output-len`` tokens,
``--ignore-eos``), twice per rate. While a server runs, the device's used memory is sampled
through NVML. The JSON written to ``--out`` holds every client result and memory series;
the printed table holds medians over runs, and elastic-on / off ratios.

    bash benchmarks/vllm_device.sh run python3 benchmarks/vllm_serve.py \\
        --models $KVDEV/models/qwen3-0.6b --out $OUT/serve.json

Runs where vLLM, a GPU and the offline model directories are (``vllm_device.sh``); needs
``nvidia-ml-py`` (the GPU image has it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
MODES = ("off", "off-blhnc", "on")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


class MemorySampler:
    """Device memory in use (NVML, bytes) every ``interval`` seconds on a thread."""

    def __init__(self, interval: float = 0.25) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.interval = interval
        self.t0 = time.monotonic()
        self.series: list[tuple[float, str, int]] = []
        self.phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.series.append((round(time.monotonic() - self.t0, 2), self.phase, self.used()))

    def close(self) -> list[tuple[float, str, int]]:
        self._stop.set()
        self._thread.join()
        return self.series


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not ready on port {port} after {timeout:.0f} s")


def _serve_args(model: str, elastic: bool, kvcore_config: str | None, args: Any) -> list[str]:
    cmd = [*CLI, "serve", model, "--load-format", "dummy", "--port", str(args.port),
           "--max-model-len", str(args.max_model_len), "--seed", "0",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           ]  # fmt: skip
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if elastic:
        cmd.append("--kvcore-elastic")
        if kvcore_config:
            cmd += ["--kvcore-config", kvcore_config]
    return cmd


def _bench(model: str, rate: str, args: Any, result: Path) -> dict[str, Any]:
    num_prompts = args.num_prompts if rate == "inf" else args.num_prompts_rate
    cmd = [*CLI, "bench", "serve", "--backend", "vllm", "--model", model,
           "--base-url", f"http://127.0.0.1:{args.port}", "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(num_prompts), "--request-rate", rate, "--ignore-eos",
           "--seed", "0", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles",
           "50,99", "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(result.read_text())
    return {k: data.get(k) for k in (*METRICS, "completed", "num_prompts", "duration")}


def run_launch(model: str, mode: str, args: Any, workdir: Path) -> dict[str, Any]:
    elastic = mode == "on"
    env = dict(os.environ)
    if mode != "off":
        env["VLLM_KV_CACHE_LAYOUT"] = "BLHNC"
    log = (workdir / f"serve-{Path(model).name}-{mode}.log").open("ab")
    sampler = MemorySampler()
    idle_before = sampler.used()
    t0 = time.monotonic()
    cmd = _serve_args(model, elastic, args.kvcore_config if elastic else None, args)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    runs: list[dict[str, Any]] = []
    try:
        _wait_ready(args.port, proc, args.start_timeout)
        started = time.monotonic() - t0
        for rate in args.rates:
            for i in range(args.runs_per_rate):
                sampler.phase = f"rate={rate}"
                result = workdir / f"bench-{time.monotonic_ns()}.json"
                runs.append({"rate": rate, "run": i, **_bench(model, rate, args, result)})
                sampler.phase = "idle"
                time.sleep(2.0)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(3.0)
        sampler.phase = "stopped"
        time.sleep(1.0)
        series = sampler.close()
        log.close()
    return {
        "model": Path(model).name,
        "mode": mode,
        "start_s": round(started, 1),
        "used_before": idle_before,
        "used_after_stop": series[-1][2] if series else None,
        "runs": runs,
        "memory": series,
    }


def summarize(launches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and rate: the median of each metric per mode, and each mode's ratio to
    ``off`` (upstream as users run it)."""
    rows = []
    modes = list(dict.fromkeys(x["mode"] for x in launches))
    for model in dict.fromkeys(x["model"] for x in launches):
        rates = dict.fromkeys(r["rate"] for x in launches for r in x["runs"])
        for rate in rates:
            row: dict[str, Any] = {"model": model, "rate": rate}
            for mode in modes:
                runs = [r for x in launches if x["model"] == model and x["mode"] == mode
                        for r in x["runs"] if r["rate"] == rate]  # fmt: skip
                for m in METRICS:
                    vals = [r[m] for r in runs if r.get(m) is not None]
                    row[f"{m}_{mode}"] = statistics.median(vals) if vals else None
            for mode in modes:
                for m in METRICS:
                    base, val = row.get(f"{m}_off"), row[f"{m}_{mode}"]
                    row[f"{m}_{mode}_ratio"] = val / base if base and val else None
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="offline model directories")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of launches")
    parser.add_argument("--modes", nargs="+", default=["off", "on"], choices=MODES)
    parser.add_argument("--runs-per-rate", type=int, default=2)
    parser.add_argument("--rates", nargs="+", default=["inf", "16"])
    parser.add_argument("--num-prompts", type=int, default=400, help="at rate inf")
    parser.add_argument("--num-prompts-rate", type=int, default=200, help="at a finite rate")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kvcore-config", default=None, help="--kvcore-config JSON (on side)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()
    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for model in args.models:
            for _ in range(args.repeats):
                for mode in args.modes:
                    print(f"{Path(model).name}: {mode} ...", flush=True)
                    launches.append(run_launch(model, mode, args, workdir))
                    _write(args, launches)
        logs = {p.name: p.read_text(errors="replace")[-4000:] for p in workdir.glob("serve-*.log")}
    _write(args, launches, logs)
    for row in summarize(launches):
        for mode in args.modes:
            cells = [
                f"{m} {row[f'{m}_{mode}']:.1f} ({row[f'{m}_{mode}_ratio']:.3f}x)"
                for m in METRICS
                if row[f"{m}_{mode}_ratio"] is not None
            ]
            print(f"{row['model']:>12} rate={row['rate']:>4} {mode:>9}: " + "  ".join(cells))


def _write(args: Any, launches: list[dict[str, Any]], logs: dict[str, str] | None = None) -> None:
    doc = {"argv": sys.argv[1:], "launches": launches, "summary": summarize(launches)}
    if logs:
        doc["server_log_tails"] = logs
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
