"""vLLM's OpenAI server with elastic KV on and off, loaded by vLLM's own benchmark client.

Per model shape, one ``vllm serve`` per mode in ``--modes`` starts at once, each on its own
port with the same KV capacity (``--kv-cache-memory-bytes``: upstream allocates it at start,
elastic KV plans it as its logical capacity and maps pages as they fill), so that idle
servers hold memory but no compute and the rounds can interleave:

* ``off``: upstream code, vLLM's default layout (LBNHC with FLASH_ATTN and TRITON_ATTN);
* ``off-blnhc`` / ``off-blhnc``: upstream code on a block-outermost layout
  (``VLLM_KV_CACHE_LAYOUT``), what the layout alone costs;
* ``on``: ``--kvcore-elastic`` on the layout it resolves (on one GPU vLLM's own, LBNHC with
  FLASH_ATTN and TRITON_ATTN: kvcore's per-layer ranges); ``on-blnhc`` / ``on-blhnc``:
  elastic KV on a block-outermost layout (one row of every layer per block id, what
  TP x PP runs); ``on-reserve``: elastic KV with a reserve of 8 to 32 idle pages mapped
  ahead by the background thread (``reserve_min`` / ``reserve_max``), so that the
  scheduler's thread takes new pages without a driver call.

Then ``--repeats`` rounds: in each, every rate of ``--rates`` is sent to every server in turn
(the order rotates between rounds) by vLLM's own benchmark client (``vllm bench serve``'s
``main``, in this process: random dataset, ``--input-len`` / ``--output-len`` tokens,
``--ignore-eos``, seed = the round, so every mode gets the same prompts and no round hits
another's prefix cache). The first round of an elastic server maps its pages from cold; the
table gives medians over all rounds and, apart, the first round's ratio. While the servers
run, device memory in use is sampled through NVML, device-wide and per server process group
where NVML names the processes. Each client result carries, for its server and its run, the
CPU seconds its processes spent by process name (``/proc``) and the deltas of the server's
Prometheus counters (preemptions, prefix-cache hits, generated tokens). With ``--py-spy``,
the run at rate ``--py-spy-rate`` of round ``--py-spy-round`` of every server is sampled by
``py-spy record`` (every process of the server, raw collapsed stacks next to ``--out``), so
the modes' CPU time can be compared frame by frame. The JSON written to ``--out`` holds every
client result and the memory series.

    bash benchmarks/vllm_device.sh run python3 -m benchmarks.vllm_serve \\
        --models $KVDEV/models/qwen3-0.6b --out $OUT/serve.json

Runs where vLLM, a GPU and the offline model directories are (``vllm_device.sh``); needs
``nvidia-ml-py`` (the GPU image has it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm_servers import (
    CLI,
    MemorySampler,
    ServeProcess,
    cpu_seconds,
    delta,
    stop_all,
)

MODES: dict[str, tuple[bool, str | None, dict[str, int]]] = {
    "off": (False, None, {}),
    "off-blnhc": (False, "BLNHC", {}),
    "off-blhnc": (False, "BLHNC", {}),
    "on": (True, None, {}),
    "on-reserve": (True, None, {"reserve_min": 8, "reserve_max": 32}),
    "on-blnhc": (True, "BLNHC", {}),
    "on-blhnc": (True, "BLHNC", {}),
}
"""Mode -> (elastic KV, ``VLLM_KV_CACHE_LAYOUT`` or None for the engine's own choice, the
mode's own ``--kvcore-config`` keys, merged over ``--kvcore-config``)."""
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
GiB = 1 << 30


COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)
"""Prometheus counters of the server whose change over each run is recorded."""


class Server(ServeProcess):
    """One ``vllm serve`` of one mode (``MODES``) for ``model``."""

    def __init__(self, model: str, mode: str, port: int, args: Any, workdir: Path) -> None:
        elastic, layout, own = MODES[mode]
        self.mode = mode
        env = dict(os.environ, VLLM_CACHE_ROOT=str(workdir / f"cache-{mode}"))
        env.pop("VLLM_KV_CACHE_LAYOUT", None)
        if layout:
            env["VLLM_KV_CACHE_LAYOUT"] = layout
        cmd = [*CLI, "serve", model, "--load-format", "dummy", "--port", str(port),
               "--max-model-len", str(args.max_model_len), "--seed", "0",
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--kv-cache-memory-bytes", str(int(args.kv_gib * GiB))]  # fmt: skip
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if elastic:
            cmd.append("--kvcore-elastic")
            config = {**json.loads(args.kvcore_config or "{}"), **own}
            if config:
                cmd += ["--kvcore-config", json.dumps(config)]
        super().__init__(cmd, env, port, workdir / f"serve-{Path(model).name}-{mode}.log", mode)


class _PySpy:
    """``py-spy record`` of every process of one server (raw collapsed stacks in ``path``)
    from construction to ``stop()``."""

    def __init__(self, server: Server, path: Path, extra: list[str]) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            ["py-spy", "record", "--pid", str(server.proc.pid), "--subprocesses",
             "--rate", "200", "--format", "raw", "--output", str(path), "--nonblocking",
             *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(1.0)  # attach before the load starts

    def stop(self) -> str:
        """Stop sampling; the output file's name, or py-spy's complaint."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if self.path.exists():
            return self.path.name
        return f"py-spy failed ({self.proc.returncode}): {err.decode(errors='replace')[-500:]}"


def _bench(model: str, port: int, rate: str, seed: int, args: Any) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``port`` (vLLM's client, in this process)."""
    from vllm.benchmarks import serve as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    num_prompts = args.num_prompts if rate == "inf" else args.num_prompts_rate
    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    argv = ["--backend", "vllm", "--model", model, "--base-url", f"http://127.0.0.1:{port}",
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
            "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        data = bench.main(parser.parse_args(argv))
    return {k: data.get(k) for k in (*METRICS, "completed", "num_prompts", "duration")}


def run_model(model: str, args: Any, workdir: Path, results: list[dict[str, Any]]) -> None:
    """Serve ``model`` in every mode and load it; its result joins ``results``, which is
    written to ``--out`` after every client run (a run cut short keeps what it measured)."""
    servers = [Server(model, m, args.port + i, args, workdir) for i, m in enumerate(args.modes)]
    sampler = MemorySampler({s.proc.pid: s.mode for s in servers})
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": Path(model).name, "modes": list(args.modes), "runs": runs}
    results.append(result)
    try:
        deadline = time.monotonic() + args.start_timeout
        while not all(s.ready() for s in servers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers not ready after {args.start_timeout:.0f} s")
            time.sleep(1.0)
        print(f"{Path(model).name}: up in " + ", ".join(f"{s.mode} {s.start_s} s" for s in servers))
        sampler.phase = "idle"
        time.sleep(3.0)
        for r in range(args.repeats):
            order = servers[r % len(servers) :] + servers[: r % len(servers)]
            for rate in args.rates:
                for s in order:
                    sampler.phase = f"{s.mode} rate={rate} round={r}"
                    spy = None
                    if args.py_spy and r == args.py_spy_round and rate == args.py_spy_rate:
                        spy = _PySpy(
                            s,
                            args.out.parent / f"pyspy-{Path(model).name}-{s.mode}.txt",
                            args.py_spy_args.split(),
                        )
                    cpu0, count0 = cpu_seconds(s.proc.pid), s.metrics(COUNTERS)
                    got = _bench(model, s.port, rate, seed=r, args=args)
                    got["cpu_s"] = delta(cpu_seconds(s.proc.pid), cpu0)
                    got["counters"] = delta(s.metrics(COUNTERS), count0)
                    if spy is not None:
                        got["py_spy"] = spy.stop()
                    runs.append({"mode": s.mode, "rate": rate, "round": r, **got})
                    _write(args, results)
                    sampler.phase = "idle"
                    print(f"  round {r} rate {rate:>4} {s.mode:>9}: "
                          f"{got['output_throughput']:.0f} tok/s, "
                          f"TPOT p50 {got['median_tpot_ms']:.2f} ms", flush=True)  # fmt: skip
                    time.sleep(2.0)
    finally:
        # the series so far first: a call limit reached while the servers stop keeps it
        result["memory"] = list(sampler.series)
        result["start_s"] = {s.mode: s.start_s for s in servers}
        _write(args, results)
        stop_all(servers)
        sampler.phase = "stopped"
        time.sleep(3.0)
        result["memory"] = sampler.close()
        result["logs"] = {s.mode: s.log_path.read_text(errors="replace")[-4000:] for s in servers}
        _write(args, results)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and rate: each mode's median of each metric over the rounds and its ratio to
    ``off`` (upstream as users run it); ``first_*``: the first round alone."""
    rows = []
    for res in results:
        for rate in dict.fromkeys(r["rate"] for r in res["runs"]):
            row: dict[str, Any] = {"model": res["model"], "rate": rate}
            for mode in res["modes"]:
                runs = [r for r in res["runs"] if r["mode"] == mode and r["rate"] == rate]
                for m in METRICS:
                    vals = [r[m] for r in runs if r.get(m) is not None]
                    row[f"{m}_{mode}"] = statistics.median(vals) if vals else None
                    first = [r[m] for r in runs if r["round"] == 0 and r.get(m) is not None]
                    row[f"first_{m}_{mode}"] = first[0] if first else None
            for mode in res["modes"]:
                for m in METRICS:
                    for key in (f"{m}_{{}}", f"first_{m}_{{}}"):
                        base, val = row.get(key.format("off")), row[key.format(mode)]
                        row[key.format(mode) + "_ratio"] = val / base if base and val else None
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="offline model directories")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", default=["off", "on"], choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every server")
    parser.add_argument("--rates", nargs="+", default=["inf", "16"])
    parser.add_argument("--num-prompts", type=int, default=500, help="at rate inf")
    parser.add_argument("--num-prompts-rate", type=int, default=240, help="at a finite rate")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-gib", type=float, default=20.0, help="KV capacity per server")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.1,
        help="only vLLM's start-up check of free memory (the KV size is --kv-gib)",
    )
    parser.add_argument("--kvcore-config", default=None, help="--kvcore-config JSON (on side)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--port", type=int, default=8011, help="first server's port")
    parser.add_argument("--start-timeout", type=float, default=420.0)
    parser.add_argument(
        "--py-spy", action="store_true", help="sample one run per server with py-spy"
    )
    parser.add_argument("--py-spy-round", type=int, default=1)
    parser.add_argument("--py-spy-rate", default="inf")
    parser.add_argument(
        "--py-spy-args",
        default="",
        help="more py-spy record options, written with '=': --py-spy-args='--idle' (threads "
        "waiting on a lock or the GIL too), --py-spy-args='--idle --native' (C frames too)",
    )
    args = parser.parse_args()
    # `timeout` and the device tool stop a run with SIGTERM: unwind, so the servers stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "off" not in args.modes:
        parser.error("--modes must include off: ratios are to upstream")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            run_model(model, args, Path(tmp), results)
    for row in summarize(results):
        for mode in args.modes:
            cells = [
                f"{m} {row[f'{m}_{mode}']:.1f} ({row[f'{m}_{mode}_ratio']:.3f}x)"
                for m in METRICS
                if row[f"{m}_{mode}_ratio"] is not None
            ]
            first = row.get(f"first_output_throughput_{mode}_ratio")
            cells.append(f"first round {first:.3f}x" if first else "")
            print(f"{row['model']:>12} rate={row['rate']:>4} {mode:>9}: " + "  ".join(cells))


def _write(args: Any, results: list[dict[str, Any]]) -> None:
    doc = {"argv": sys.argv[1:], "results": results, "summary": summarize(results)}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
