"""SGLang's real server with elastic KV on and off, one after the other, on the same greedy
batch: do both serve, and are their tokens the same?

Each mode starts ``python -m sglang.launch_server`` on the same offline model directory with
dummy weights (SGLang's dummy loader seeds them, so both servers hold the same weights),
sends one batch to ``/generate`` by HTTP and stops the server; with ``--together`` every
mode's server starts at once and each runs the batch in turn while the others idle. The
batch mixes short and long prompts of token ids and prompts that share a long prefix, in
two rounds, so the second round hits the radix cache. Greedy, ``ignore_eos``, so every
request decodes ``--max-new-tokens``. The GPU's used memory (``nvidia-smi``) is recorded
before the start, once up, after the batch and after the stop.

    python -m benchmarks.sglang_smoke --model /tmp/sgdev/models/qwen3-0.6b --out $OUT/smoke \\
        -- --attention-backend triton --sampling-backend pytorch --grammar-backend none

Arguments after ``--`` go to every server, ``--kvcore-config`` to the elastic one. Writes
``<out>/smoke.json`` (per mode: start seconds, memory, outputs; and whether the modes agree
token for token) and a log per server; exits 1 when a mode fails to serve or the outputs
differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.sglang_serve import MODES, launch_server_cmd, split_server_args
from benchmarks.vllm_servers import ServeProcess, stop_all, wait_ready


def batch(vocab: int, seed: int = 0) -> list[list[int]]:
    """The prompts (token ids below ``vocab``): 8 short (16-64), 4 long (600-1,200) and 8
    that share a 512-token prefix with their own 32-token tails."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prefix = ids(512)
    return (
        [ids(rng.randint(16, 64)) for _ in range(8)]
        + [ids(rng.randint(600, 1200)) for _ in range(4)]
        + [prefix + ids(32) for _ in range(8)]
    )


def gpu_used_mib() -> int | None:
    """The first GPU's used memory from ``nvidia-smi``, in MiB; ``None`` without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=20,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out.split()[0])


def generate(port: int, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """One ``/generate`` call for ``prompts``; each prompt's output token ids."""
    body = {
        "input_ids": prompts,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
        },
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        items = json.loads(r.read())
    return [list(item["output_ids"]) for item in items]


def _serve_batches(server: ServeProcess, seen: dict[str, Any], args: argparse.Namespace,
                   prompts: list[list[int]]) -> None:  # fmt: skip
    """Run the batch twice on a ready ``server``, recording into ``seen``."""
    seen["start_s"] = server.start_s
    rounds = []
    for _ in range(2):  # the second round hits the radix cache
        t0 = time.monotonic()
        rounds.append(generate(server.port, prompts, args.max_new_tokens))
        seen.setdefault("batch_s", []).append(round(time.monotonic() - t0, 2))
    seen["used_mib"]["after_batch"] = gpu_used_mib()
    seen["outputs"] = rounds
    seen["rounds_agree"] = rounds[0] == rounds[1]


def _wait_up(server: ServeProcess, seen: dict[str, Any], timeout_s: float) -> None:
    wait_ready([server], timeout_s)
    seen["used_mib"]["up"] = gpu_used_mib()


def _attempt(seen: dict[str, Any], step: Any) -> None:
    """Run ``step()`` for a server whose earlier steps succeeded; a failure is recorded as
    its ``error``, and later steps skip it."""
    if "error" in seen:
        return
    try:
        step()
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}"[-3000:]


def serve(
    modes: list[str], args: argparse.Namespace, prompts: list[list[int]], server_args: list[str]
) -> list[dict[str, Any]]:
    """Start one server per mode of ``modes`` at once (ports from ``args.port`` up), run the
    batch twice on each in turn (the others idle), stop them all; what was seen per mode.
    A mode whose server fails records ``error`` and does not stop the others."""
    before = gpu_used_mib()
    servers: list[ServeProcess] = []
    seen: list[dict[str, Any]] = []
    for i, mode in enumerate(modes):
        port = args.port + i
        cmd = launch_server_cmd(args.model, port, MODES[mode], args.kvcore_config, server_args)
        seen.append({"mode": mode, "cmd": cmd, "used_mib": {"before": before}})
        servers.append(ServeProcess(cmd, os.environ, port, args.out / f"server-{mode}.log",
                                    f"sglang {mode}"))  # fmt: skip
    try:
        for server, s in zip(servers, seen, strict=True):  # every server up before any batch
            _attempt(s, lambda sv=server, s=s: _wait_up(sv, s, args.start_timeout_s))
        for server, s in zip(servers, seen, strict=True):  # then each in turn, the others idle
            _attempt(s, lambda sv=server, s=s: _serve_batches(sv, s, args, prompts))
    finally:
        stop_all(servers)
    after = gpu_used_mib()
    for s in seen:
        s["used_mib"]["after_stop"] = after
    return seen


def main(argv: list[str] | None = None) -> int:
    own, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an offline model directory")
    parser.add_argument("--out", type=Path, required=True, help="folder for smoke.json, logs")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["on", "off"])
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--together",
        action="store_true",
        help="start every mode's server at once (each runs the batch in turn, the others "
        "idle; size them with --mem-fraction-static and --max-total-tokens after --), and "
        "check the memory once all have stopped",
    )
    parser.add_argument("--start-timeout-s", type=float, default=240)
    parser.add_argument(
        "--kvcore-config",
        default=None,
        help="--kvcore-config JSON for the elastic server, e.g. a limit_bytes that makes "
        "requests wait (add --enable-deterministic-inference after -- so that a different "
        "batch composition cannot change the tokens)",
    )
    args = parser.parse_args(own)
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = batch(vocab)
    groups = [args.modes] if args.together else [[m] for m in args.modes]
    runs = []
    for group in groups:
        print(f"sglang_smoke: {' + '.join(group)}: starting", flush=True)
        runs += serve(group, args, prompts, server_args)
        for r in runs[-len(group) :]:
            print(f"sglang_smoke: {r['mode']}: start {r.get('start_s')} s, batches "
                  f"{r.get('batch_s')} s, used MiB {r['used_mib']}, "
                  f"{r.get('error', 'served')}", flush=True)  # fmt: skip
    served = [r for r in runs if "outputs" in r]
    agree = len(served) == len(runs) > 1 and all(
        r["outputs"] == served[0]["outputs"] for r in served
    )
    if len(served) > 1:
        first = served[0]["outputs"][0]
        differ = [i for i, o in enumerate(served[1]["outputs"][0]) if o != first[i]]
        print(f"sglang_smoke: prompts whose tokens differ between modes: {differ}", flush=True)
    (args.out / "smoke.json").write_text(json.dumps({"runs": runs, "agree": agree}, indent=1))
    print(f"sglang_smoke: served {len(served)} of {len(runs)}; token-identical: {agree}")
    return 0 if agree or (len(runs) == 1 and served) else 1


if __name__ == "__main__":
    sys.exit(main())
