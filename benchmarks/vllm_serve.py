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

Then ``--repeats`` interleaved rounds (``serve_rounds.run_rounds``: the order rotates, seed =
the round, per-run CPU seconds and counter deltas, NVML memory, optional py-spy), each run
by vLLM's own benchmark client (``vllm bench serve``'s ``main``, in this process: random
dataset, ``--input-len`` / ``--output-len`` tokens, ``--ignore-eos``). The first round of an
elastic server maps its pages from cold; the table gives medians over all rounds and, apart,
the first round's ratio. The JSON written to ``--out`` holds every client result and the
memory series.

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
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.serve_rounds import LOAD, METRICS, add_round_args, print_summary, run_rounds
from benchmarks.vllm_servers import CLI, ServeProcess

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


def _bench(
    model: str, port: int, rate: str, seed: int, num_prompts: int, args: Any
) -> dict[str, Any]:
    """One ``vllm bench serve`` run of ``num_prompts`` against ``port`` (vLLM's client, in
    this process)."""
    from vllm.benchmarks import serve as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    argv = ["--backend", "vllm", "--model", model, "--base-url", f"http://127.0.0.1:{port}",
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
            "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        data = bench.main(parser.parse_args(argv))
    return {k: data.get(k) for k in (*METRICS, *LOAD, "num_prompts")}


def run_model(model: str, args: Any, workdir: Path, results: list[dict[str, Any]]) -> None:
    """Serve ``model`` in every mode of ``args.modes`` and run the rounds on it."""
    servers = [Server(model, m, args.port + i, args, workdir) for i, m in enumerate(args.modes)]
    run_rounds(
        model, servers, lambda s, rate, seed, n: _bench(model, s.port, rate, seed, n, args),
        COUNTERS, args, results,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="offline model directories")
    parser.add_argument("--modes", nargs="+", default=["off", "on"], choices=list(MODES))
    add_round_args(parser)
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
    args = parser.parse_args()
    # `timeout` and the device tool stop a run with SIGTERM: unwind, so the servers stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "off" not in args.modes:
        parser.error("--modes must include off: ratios are to upstream")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            run_model(model, args, Path(tmp), results)
    print_summary(results, args.modes)


if __name__ == "__main__":
    main()
