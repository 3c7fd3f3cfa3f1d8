"""The GPU suite's command line (``python -m benchmarks.gpu_suite --help``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import benchmarks.gpu_suite
from benchmarks.gpu_suite.bandwidth import step_bandwidth
from benchmarks.gpu_suite.channel import step_channel
from benchmarks.gpu_suite.common import ROOT, Suite, log
from benchmarks.gpu_suite.decode import step_decode
from benchmarks.gpu_suite.gpu_tests import step_pytest
from benchmarks.gpu_suite.handoff import step_handoff
from benchmarks.gpu_suite.mapper import step_mapper
from benchmarks.gpu_suite.vmm import step_vmm
from benchmarks.render_results import render_markdown

STEPS = ("pytest", "vmm", "mapper", "bandwidth", "handoff", "decode", "channel")

STEP_FUNCS: dict[str, tuple[Callable[[Suite], dict[str, Any] | None], float]] = {
    # name: (function, seconds of budget it needs to start)
    "pytest": (step_pytest, 20),
    "vmm": (step_vmm, 15),
    "mapper": (step_mapper, 15),
    "bandwidth": (step_bandwidth, 30),
    "handoff": (step_handoff, 40),
    "decode": (step_decode, 30),
    "channel": (step_channel, 20),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_suite",
        description=(benchmarks.gpu_suite.__doc__ or "").split("\n\n")[0],
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-suite-out",
        help="result directory (default: $OUT, else ./gpu-suite-out)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="global time budget; steps that would not fit are skipped",
    )
    ap.add_argument(
        "--grace-s",
        type=float,
        default=45.0,
        help="a watchdog exits this long after the budget, results written (default 45)",
    )
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="host backend, tiny sizes, no Triton or raw CUDA (CPU machines)",
    )
    ap.add_argument("--only", default="", help=f"comma-separated steps of {','.join(STEPS)}")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument(
        "--channel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run benchmarks/channel_latency.py if present (default on)",
    )
    ap.add_argument(
        "--channel-script",
        default=str(ROOT / "benchmarks" / "channel_latency.py"),
        help="the worker-channel benchmark the channel step runs",
    )
    ap.add_argument(
        "--pytest-timeout",
        type=float,
        default=150.0,
        help="limit for the gpu-marked tests, seconds",
    )
    ap.add_argument(
        "--pytest-targets", nargs="*", default=None, help="paths given to pytest (default: tests)"
    )
    ap.add_argument("--commit", default="", help="commit to record (default: git, or unknown)")
    args = ap.parse_args(argv)
    for opt in ("only", "skip"):
        bad = [s for s in getattr(args, opt).split(",") if s and s not in STEPS]
        if bad:
            ap.error(f"--{opt}: unknown step(s) {bad}; known: {', '.join(STEPS)}")
    return args


def selected_steps(args: argparse.Namespace) -> list[str]:
    only = [s for s in args.only.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    if not args.channel:
        skip.add("channel")
    if args.dry_run and not only:
        skip.add("pytest")  # the CPU suite runs the tests itself; nested pytest is waste
    return [s for s in STEPS if (not only or s in only) and s not in skip]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    suite = Suite(args)
    watchdog = suite.start_watchdog(args.grace_s)
    try:
        return _run_suite(suite)
    finally:
        watchdog.cancel()


def _run_suite(suite: Suite) -> int:
    args = suite.args
    meta = suite.results["meta"]
    log(f"kvcore gpu suite: mode {suite.mode}, budget {args.budget_s:.0f} s, out {suite.out}")
    log(
        f"   gpu {meta.get('gpu')} driver {meta.get('driver')} torch {meta.get('torch')} "
        f"cuda-bindings {meta.get('cuda-bindings')} triton {meta.get('triton')} "
        f"commit {meta.get('commit')}"
    )
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            log("no CUDA GPU visible: nothing to measure (use --dry-run on CPU)")
            suite.results["steps"]["setup"] = {"status": "error", "error": "no CUDA GPU"}
            suite.write()
            return 2
        torch.cuda.init()
    for name in selected_steps(args):
        fn, min_s = STEP_FUNCS[name]
        suite.run(name, fn, min_s)
    suite.write()
    print(render_markdown(suite.results, notes=False), flush=True)
    statuses = [s["status"] for s in suite.results["steps"].values()]
    log(
        f"done in {time.monotonic() - suite.start:.0f} s: "
        + ", ".join(f"{n} {s['status']}" for n, s in suite.results["steps"].items())
    )
    return 1 if "error" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
