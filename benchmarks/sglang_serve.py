"""SGLang's server with elastic KV on and off, loaded by SGLang's own benchmark client.

Per model shape, one ``python -m sglang.launch_server`` per mode of ``--modes`` starts at
once, each on its own port with the same KV capacity: ``--max-total-tokens`` is ``--kv-gib``
of the model's KV bytes per token (upstream allocates that pool at start; elastic KV plans
it as its logical capacity and maps pages as they fill), each under the same
``--mem-fraction-static``. The KV is capped by ``--max-total-tokens`` whatever that share;
the share must pass SGLang's start-up check, which wants the free memory it measured
before loading, less the share, still free once its weights are in. Servers starting at
once take memory from each other in between, so with several servers a small share fails
("Raise --mem-fraction-static above ...") where a larger one passes:

* ``off``: upstream code;
* ``on``: ``--kvcore-elastic`` (with ``--kvcore-config`` when given);
* each ``--variant NAME=JSON``: one more elastic server, named ``NAME`` in the results,
  with ``JSON`` as its ``--kvcore-config`` (for example ``--variant
  'reserve={"reserve_min": 2, "reserve_max": 16}'``), so that two elastic configurations
  compare with upstream in the same run.

Arguments after ``--`` go to every server (the GPU machine's flags: ``--attention-backend
triton --sampling-backend pytorch --grammar-backend none``; ``--page-size 16`` for the paged
allocator). Then ``--repeats`` interleaved rounds (``serve_rounds.run_rounds``), each run by
SGLang's own client as users run it, ``python -m sglang.benchmark.serving --backend sglang``
(in a subprocess: its options are built inside its ``cli_main``): ``random-ids`` prompts
(no dataset download) of ``--input-len`` random token ids, which the client decodes to text
and the server tokenizes again, so a prompt reaches the server as about 1.9x as many tokens
for the Qwen3 tokenizer (about 1,900-2,000 for 1,024; the run's
``sglang:prompt_tokens_total`` counter says how many), or, with ``--tokenize-prompt``, as
the ids themselves, exactly ``--input-len`` tokens; ``--output-len`` tokens out
(``ignore_eos``, SGLang's client default), seed = the round. Counters come from the
servers' ``/metrics`` (``--enable-metrics``): retractions (SGLang's preemption), cached and
generated tokens. With ``--flush-cache`` every client run is preceded, outside what the run
measures, by SGLang's own ``POST /flush_cache`` on its server, which empties the radix cache
and frees every KV token; each elastic server is then waited for until its driver memory
is back to its empty pool's (``give_back`` in the run's record: how long that took). Every
round then starts each server from an empty pool, a first fill, where without it only round
0 does (the radix cache keeps finished requests' tokens until the pool is full).

    bash benchmarks/sglang_device.sh run python3 -m benchmarks.sglang_serve \\
        --models /tmp/sgdev/models/qwen3-0.6b --out $OUT/sglang-serve.json -- \\
        --attention-backend triton --sampling-backend pytorch --grammar-backend none

Runs where SGLang, a GPU and the offline model directories are (``sglang_device.sh``);
needs ``nvidia-ml-py`` for the memory series.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.serve_rounds import LOAD, METRICS, add_round_args, print_summary, run_rounds
from benchmarks.vllm_servers import ServeProcess, SessionMemory, wait_down_to

MODES = {"off": False, "on": True}
"""Mode -> elastic KV."""
COUNTERS = (
    "sglang:num_retracted_requests_total",
    "sglang:cached_tokens_total",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:evicted_tokens_total",
    "sglang:cuda_graph_passes_total{mode}",
    "sglang:forward_execution_seconds_total{category}",
    "sglang:scheduler_stage_seconds_total{category}",
    "sglang:scheduler_idle_seconds_total",
    "sglang:scheduler_process_cpu_seconds_total",
)
"""Prometheus counters of the server whose change over each run is recorded: tokens,
retractions and evictions; forward passes by kind (``cuda_graph_passes_total``: one per
prefill and per decode batch, so two modes' batch counts compare); and SGLang's own account
of the scheduler's time by stage, idle and in the process's CPU."""
GiB = 1 << 30


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """KV bytes one token takes in every layer of a dense attention model's ``config.json``
    (K and V, ``num_key_value_heads`` of ``head_dim``; ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * heads * head_dim * dtype_bytes)


def overcommit(servers: int, kv_gib: float, beside_gib: float, device_bytes: int) -> str | None:
    """Why ``servers`` servers of ``kv_gib`` of KV each, holding ``beside_gib`` beside it,
    do not fit a device of ``device_bytes``, or ``None`` when they do. Every elastic pool
    can be full at once (the radix cache keeps what its last run left), and the pool that
    finds the device full fails SGLang's next allocation: a plan that does not fit measures
    nothing."""
    need = servers * (kv_gib + beside_gib) * GiB
    if need <= device_bytes:
        return None
    return (
        f"{servers} servers x ({kv_gib:g} GiB of KV + {beside_gib:g} GiB beside it, "
        f"--beside-gib) = {need / GiB:.1f} GiB exceed the device's "
        f"{device_bytes / GiB:.1f} GiB: lower --kv-gib or run fewer servers "
        "(--modes, --variant)"
    )


def _device_bytes() -> int | None:
    """GPU 0's memory from NVML; ``None`` where NVML is missing (a CPU machine)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:  # no NVML library or no GPU: nothing to check against
        return None


def launch_server_cmd(
    model: str | Path, port: int, elastic: bool, kvcore_config: str | None, extra: list[str]
) -> list[str]:
    """SGLang's ``launch_server`` of ``model`` with seeded dummy weights on ``port``, elastic KV
    on (with ``kvcore_config``, if any) or off, then ``extra``: the one command line the SGLang
    benchmarks (this one, ``sglang_smoke.py``) start servers with."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--load-format", "dummy", "--port", str(port), "--random-seed", "0", *extra]  # fmt: skip
    if elastic:
        cmd.append("--kvcore-elastic")
        if kvcore_config:
            cmd += ["--kvcore-config", kvcore_config]
    return cmd


def split_server_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split at its first ``--``: the benchmark's own arguments, and those that go
    to every server."""
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def parse_variant(text: str) -> tuple[str, str]:
    """``NAME=JSON`` of ``--variant``: the name and the ``--kvcore-config`` text. Raises
    ``argparse.ArgumentTypeError`` for a name that is a mode or not a word, or a JSON text
    that is not an object."""
    name, sep, config = text.partition("=")
    if not sep or not name.isidentifier() or name in MODES:
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: want NAME=JSON, NAME a word other than {', '.join(MODES)}"
        )
    try:
        parsed = json.loads(config)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--variant {name}: not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--variant {name}: want a JSON object")
    return name, config


class Server(ServeProcess):
    """One SGLang server of one mode (``MODES``, or a ``--variant`` name: elastic with the
    variant's ``--kvcore-config``) for ``model``."""

    def __init__(
        self, model: str, mode: str, port: int, args: Any, server_args: list[str], log: Path
    ) -> None:
        self.mode = mode
        config = json.loads((Path(model) / "config.json").read_text())
        tokens = int(args.kv_gib * GiB) // kv_bytes_per_token(config)
        sized = ["--mem-fraction-static", str(args.mem_fraction_static),
                 "--max-total-tokens", str(tokens), "--enable-metrics"]  # fmt: skip
        variants = dict(args.variant)
        elastic = MODES.get(mode, True)
        kvcore_config = variants.get(mode, args.kvcore_config)
        cmd = launch_server_cmd(model, port, elastic, kvcore_config,
                                [*sized, *server_args])  # fmt: skip
        super().__init__(cmd, os.environ, port, log, mode)


def _flush_cache(port: int) -> None:
    """SGLang's ``POST /flush_cache`` on the server at ``port``, between runs (nothing
    running). Raises ``RuntimeError`` with the server's answer when it refuses."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/flush_cache", b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(
            f"POST /flush_cache on port {port} refused ({exc.code}): {exc.read()[:500]!r}"
        ) from None


GIVE_BACK_SLACK = 256 << 20
"""How far above its empty pool a flushed elastic server counts as given back (bytes)."""


class _Flush:
    """``--flush-cache``'s step before each client run: SGLang's ``POST /flush_cache``, then,
    on an elastic server, a wait until its driver memory is back to what it held before its
    first run, the warm-up (its empty pool), within ``GIVE_BACK_SLACK``, so that the run is
    a first fill and not a fill beside pages still being unmapped. The run's record gets
    ``give_back``: the bytes before and after and the seconds the pool took to give back what
    the flush freed (``vllm_servers.wait_down_to``; ``reached`` false after ``timeout_s``)."""

    def __init__(self, servers: list[Any], timeout_s: float) -> None:
        self._memory = SessionMemory({s.proc.pid: s.mode for s in servers})
        self._timeout_s = timeout_s
        self._empty: dict[str, int] = {}  # per elastic server: bytes before its first run

    def __call__(self, server: Any) -> dict[str, Any] | None:
        _flush_cache(server.port)
        if not MODES.get(server.mode, True):
            return None  # upstream's pool is allocated whole: nothing to give back

        def held() -> int:
            return self._memory.read().get(server.mode, 0)

        empty = self._empty.setdefault(server.mode, held())
        got = wait_down_to(held, empty + GIVE_BACK_SLACK, timeout_s=self._timeout_s)
        late = "" if got["reached"] else " (timed out)"
        print(f"  {server.mode}: flushed pool back to {got['to'] / GiB:.2f} GiB in "
              f"{got['s']:.2f} s{late}", flush=True)  # fmt: skip
        return {"give_back": got}


def client_cmd(
    model: str, args: Any, port: int, rate: str, num_prompts: int, seed: int, out: Path
) -> list[str]:
    """SGLang's own client (``python -m sglang.benchmark.serving``) for one run against the
    server on ``port``: ``num_prompts`` ``random-ids`` prompts at ``rate``, seeded, its
    result line appended to ``out`` (module docstring: the prompts' lengths)."""
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
           "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
           "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
           "--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed),
           "--output-file", str(out), "--disable-tqdm"]  # fmt: skip
    if args.tokenize_prompt:
        cmd.append("--tokenize-prompt")
    return cmd


def _run_bench(
    model: str, args: Any, work: Path, server: Any, rate: str, seed: int, num_prompts: int
) -> dict[str, Any]:
    """One ``python -m sglang.benchmark.serving`` run of ``num_prompts`` against ``server``;
    its result line. Raises ``RuntimeError`` with the client's output when it writes no
    result."""
    port = server.port
    out = work / f"bench-{port}-{rate}-{seed}.jsonl"
    cmd = client_cmd(model, args, port, rate, num_prompts, seed, out)
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if not out.exists():
        raise RuntimeError(
            f"sglang.benchmark.serving wrote no result (exit {run.returncode}):\n"
            + (run.stdout + run.stderr)[-3000:]
        )
    data = json.loads(out.read_text().splitlines()[-1])
    return {k: data.get(k) for k in (*METRICS, *LOAD)} | {"num_prompts": num_prompts}


def main(argv: list[str] | None = None) -> None:
    own, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="offline model directories")
    parser.add_argument("--modes", nargs="+", default=["off", "on"], choices=list(MODES))
    add_round_args(parser)
    parser.add_argument("--kv-gib", type=float, default=20.0, help="KV capacity per server")
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.4,
        help="SGLang's --mem-fraction-static for every server: the KV is --kv-gib whatever it "
        "is; raise it when a server fails SGLang's start-up check beside the others "
        "('Raise --mem-fraction-static above ...')",
    )
    parser.add_argument("--kvcore-config", default=None, help="--kvcore-config JSON (on side)")
    parser.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=[],
        metavar="NAME=JSON",
        help="one more elastic server, NAME in the results, JSON its --kvcore-config (repeatable)",
    )
    parser.add_argument(
        "--flush-cache",
        action="store_true",
        help="POST /flush_cache to each server before each client run, and wait for each "
        "elastic pool to give back what it freed: every round a first fill",
    )
    parser.add_argument(
        "--give-back-timeout",
        type=float,
        default=60.0,
        help="with --flush-cache, the most seconds to wait for a flushed pool (default 60)",
    )
    parser.add_argument(
        "--beside-gib",
        type=float,
        default=6.0,
        help="device memory each server holds beside its KV (weights, CUDA graphs, "
        "activations, its CUDA context; 5-6 GiB for the Qwen3-0.6B shape): the plan is "
        "refused before any server starts when the servers' KV and this exceed the device",
    )
    parser.add_argument(
        "--tokenize-prompt",
        action="store_true",
        help="send each prompt as token ids (SGLang's client --tokenize-prompt): exactly "
        "--input-len tokens; without it the client sends text that the server tokenizes "
        "into about 1.9x as many (the load of every figure before this option)",
    )
    parser.add_argument("--port", type=int, default=30011, help="first server's port")
    parser.add_argument("--start-timeout", type=float, default=420.0)
    args = parser.parse_args(own)
    # `timeout` and the device tool stop a run with SIGTERM: unwind, so the servers stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "off" not in args.modes:
        parser.error("--modes must include off: ratios are to upstream")
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"--variant names must differ: {names}")
    modes = [*args.modes, *names]
    device = _device_bytes()
    if device is not None:
        refused = overcommit(len(modes), args.kv_gib, args.beside_gib, device)
        if refused:
            parser.error(refused)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models:
            name = Path(model).name
            servers = [
                Server(model, m, args.port + i, args, server_args, work / f"{name}-{m}.log")
                for i, m in enumerate(modes)
            ]
            flush = _Flush(servers, args.give_back_timeout) if args.flush_cache else None
            run_rounds(model, servers, partial(_run_bench, model, args, work), COUNTERS, args,
                       results, prepare=flush)  # fmt: skip
    print_summary(results, modes)


if __name__ == "__main__":
    main()
