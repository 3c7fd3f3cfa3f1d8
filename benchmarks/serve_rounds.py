"""Interleaved rounds of an engine's own benchmark client against servers of one model in
several modes, for ``vllm_serve.py`` and ``sglang_serve.py``.

All servers of a model are up at once (each in its own session: ``vllm_servers.ServeProcess``),
so machine drift falls on every mode alike. In each of ``--repeats`` rounds every rate of
``--rates`` is sent to every server in turn, the order rotating between rounds; seed = the
round, so every mode gets the same prompts and no round hits another's prefix cache. Each
client result carries, for its server and run, the CPU seconds of the server's processes by
name (``/proc``) and the deltas of its Prometheus counters; with ``--py-spy`` one run per
server is sampled by ``py-spy record``, each of its processes on its own. Each server's
whole log is kept beside ``--out`` (``<out stem>-<model>-<mode>.log.gz``). Device memory is
sampled through NVML while the servers run (``vllm_servers.MemorySampler``). ``summarize``
gives per rate each mode's median over the rounds and its ratio to ``off``.

Before the rounds, each server gets ``--warmup-prompts`` prompts at rate inf, unmeasured
(the record keeps only their duration under ``"warmup"``). The engines' Triton kernels are
compiled the first time each shape runs and kept in Triton's on-disk cache, which every
server on the machine shares: without a warm-up, the server measured first in round 0 pays
for compiling what the others then load, seconds on a fresh GPU machine. The warm-up also
maps pages of an elastic pool; ``--flush-cache`` empties the pools before every measured
run when the first fill is what is measured.

``--time-limit-s`` fits the rounds to a call's limit (a device call, ``timeout``): a round
starts only when, at the pace of the longest round so far, it and the servers' stop fit in
what is left of the limit, counted from this module's import (the benchmark's start, server
start-up included). Round 0 always runs. The rounds then end whole, every mode measured in
each, where a limit falling mid-round would leave a round with some modes missing.
"""

from __future__ import annotations

import gzip
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from benchmarks.vllm_servers import (
    MemorySampler,
    cpu_seconds,
    delta,
    procs,
    stop_all,
    wait_ready,
)

_STARTED = time.monotonic()  # the benchmark's start, for --time-limit-s
STOP_ALLOWANCE_S = 30.0
"""What ``--time-limit-s`` keeps for stopping the servers and writing their logs."""

METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
"""What every client result must hold (``None`` where the client could not measure it)."""
LOAD = ("completed", "duration", "total_input_tokens", "total_output_tokens")
"""What the client says the run's load was, kept beside ``METRICS`` in each run's record:
requests finished, seconds, and the prompt and output tokens the server saw (SGLang's and
vLLM's clients both report them), so the stated lengths can be checked."""


class ModeServer(Protocol):
    """A server ``run_rounds`` drives: a ``vllm_servers.ServeProcess`` with its mode."""

    mode: str
    port: int
    proc: subprocess.Popen[bytes]
    start_s: float | None
    log_path: Path

    def ready(self) -> bool: ...
    def metrics(self, names: Sequence[str]) -> dict[str, float]: ...


Bench = Callable[[ModeServer, str, int, int], dict[str, Any]]
"""One client run: ``(server, rate, seed, num_prompts)`` -> at least ``METRICS``,
``completed``, ``num_prompts`` and ``duration``."""

WARMUP_SEED = 10_000
"""The warm-up runs' seed: no round's (rounds are seeded 0, 1, ...), so no round's prompts hit
what a warm-up left in a prefix cache."""


class _PySpy:
    """``py-spy record`` of each process of one server's session, one sampler per process
    (raw collapsed stacks in ``<stem>-<process name>-<pid>.txt`` beside ``stem``), from
    construction to ``stop()``. One sampler per process: a single ``--subprocesses``
    sampler of the whole tree missed SGLang's scheduler process in some runs."""

    def __init__(self, server: ModeServer, stem: Path, extra: list[str]) -> None:
        self.spies: list[tuple[Path, subprocess.Popen[bytes]]] = []
        for pid, name, fields in procs():
            if int(fields[3]) != server.proc.pid:
                continue
            tag = "".join(c if c.isalnum() else "_" for c in name)
            path = stem.with_name(f"{stem.name}-{tag}-{pid}.txt")
            proc = subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                 "--output", str(path), "--nonblocking", *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            self.spies.append((path, proc))
        time.sleep(1.0)  # attach before the load starts

    def stop(self) -> list[str]:
        """Stop sampling; per process the output file's name, or py-spy's complaint."""
        for _, proc in self.spies:
            proc.send_signal(signal.SIGINT)
        got = []
        for path, proc in self.spies:
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if path.exists():
                got.append(path.name)
            else:
                tail = err.decode(errors="replace")[-300:]
                got.append(f"{path.name}: py-spy failed ({proc.returncode}): {tail}")
        return got


def run_rounds(
    model: str,
    servers: Sequence[ModeServer],
    bench: Bench,
    counters: Sequence[str],
    args: Any,
    results: list[dict[str, Any]],
    prepare: Callable[[ModeServer], dict[str, Any] | None] | None = None,
) -> None:
    """Wait for ``servers`` (all of ``model``), warm them up, run the rounds, stop them.
    ``prepare``, if given, is called on a server before each of its client runs (the
    warm-up's too), outside what the run measures (its CPU seconds, counters and py-spy
    samples); what it returns joins the run's record. The model's result joins ``results``,
    written to ``args.out`` after every client run (a run cut short keeps what it
    measured). Reads from ``args``: ``start_timeout``, ``warmup_prompts``, ``repeats``,
    ``rates``, ``num_prompts``, ``num_prompts_rate``, ``out``, ``py_spy``, ``py_spy_round``,
    ``py_spy_rate``, ``py_spy_args``, ``time_limit_s`` (0: none; a round that would not fit
    is not started, and the result says so under ``"stopped"``). Raises ``TimeoutError``
    when a server is not up in time and ``RuntimeError`` when one exits (its servers are
    stopped either way)."""
    name = Path(model).name
    sampler = MemorySampler({s.proc.pid: s.mode for s in servers})
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": name, "modes": [s.mode for s in servers], "runs": runs}
    results.append(result)
    try:
        wait_ready(servers, args.start_timeout)  # type: ignore[arg-type]
        print(f"{name}: up in " + ", ".join(f"{s.mode} {s.start_s} s" for s in servers))
        sampler.phase = "idle"
        time.sleep(3.0)
        if args.warmup_prompts:
            took = result["warmup"] = _warm_up(
                servers, bench, args.warmup_prompts, sampler, prepare
            )
            print(f"{name}: warmed up " + ", ".join(f"{m} {t:.1f} s" for m, t in took.items()))
        round_s: list[float] = []  # wall seconds of each finished round
        for r in range(args.repeats):
            stop = _out_of_time(args, r, round_s)
            if stop:
                result["stopped"] = stop
                print(f"{name}: {stop}", flush=True)
                break
            began = time.monotonic()
            order = list(servers[r % len(servers) :]) + list(servers[: r % len(servers)])
            for rate in args.rates:
                for s in order:
                    sampler.phase = f"{s.mode} rate={rate} round={r}"
                    prepared = prepare(s) if prepare is not None else None
                    spy = None
                    if args.py_spy and r == args.py_spy_round and rate == args.py_spy_rate:
                        spy = _PySpy(
                            s, args.out.parent / f"pyspy-{name}-{s.mode}",
                            args.py_spy_args.split(),
                        )  # fmt: skip
                    cpu0, count0 = cpu_seconds(s.proc.pid), s.metrics(counters)
                    got = bench(s, rate, r, _num_prompts(args, rate))
                    got["cpu_s"] = delta(cpu_seconds(s.proc.pid), cpu0)
                    got["counters"] = delta(s.metrics(counters), count0)
                    if spy is not None:
                        got["py_spy"] = spy.stop()
                    runs.append({"mode": s.mode, "rate": rate, "round": r, **(prepared or {}),
                                 **got})  # fmt: skip
                    write(args, results)
                    sampler.phase = "idle"
                    print(f"  round {r} rate {rate:>4} {s.mode:>9}: "
                          f"{got['output_throughput']:.0f} tok/s, "
                          f"TPOT p50 {got['median_tpot_ms']:.2f} ms", flush=True)  # fmt: skip
                    time.sleep(2.0)
            round_s.append(time.monotonic() - began)
    finally:
        # the series so far first: a call limit reached while the servers stop keeps it
        result["memory"] = list(sampler.series)
        result["start_s"] = {s.mode: s.start_s for s in servers}
        write(args, results)
        stop_all(servers)  # type: ignore[arg-type]
        sampler.phase = "stopped"
        time.sleep(3.0)
        result["memory"] = sampler.close()
        result["logs"] = {}
        for s in servers:  # the tail in the result, the whole log (per-batch lines) beside it
            log = s.log_path.read_bytes()
            result["logs"][s.mode] = log.decode(errors="replace")[-4000:]
            kept = args.out.with_name(f"{args.out.stem}-{name}-{s.mode}.log.gz")
            kept.write_bytes(gzip.compress(log))
        write(args, results)


def _num_prompts(args: Any, rate: str) -> int:
    """The prompts of one measured run at ``rate``."""
    return int(args.num_prompts if rate == "inf" else args.num_prompts_rate)


def _warm_up(
    servers: Sequence[ModeServer],
    bench: Bench,
    prompts: int,
    sampler: MemorySampler,
    prepare: Callable[[ModeServer], dict[str, Any] | None] | None,
) -> dict[str, float]:
    """One unmeasured run of ``prompts`` prompts at rate inf against each server, in order,
    each after ``prepare`` as a measured run (``--flush-cache`` takes each pool's empty size
    at its first call: before the warm-up maps pages); the seconds each run took, by mode."""
    took: dict[str, float] = {}
    for s in servers:
        if prepare is not None:
            prepare(s)
        sampler.phase = f"{s.mode} warm-up"
        began = time.monotonic()
        bench(s, "inf", WARMUP_SEED, prompts)
        took[s.mode] = round(time.monotonic() - began, 2)
    sampler.phase = "idle"
    return took


def _out_of_time(args: Any, r: int, round_s: list[float]) -> str | None:
    """Why round ``r`` must not start under ``args.time_limit_s``, or ``None``."""
    if not args.time_limit_s or not round_s:
        return None
    left = args.time_limit_s - (time.monotonic() - _STARTED)
    need = max(round_s) + STOP_ALLOWANCE_S
    if need <= left:
        return None
    return (f"round {r} of {args.repeats} not started: {left:.0f} s left of --time-limit-s "
            f"{args.time_limit_s:g}, a round took up to {max(round_s):.0f} s "
            f"(+{STOP_ALLOWANCE_S:.0f} s to stop)")  # fmt: skip


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and rate: each mode's median of each metric over the rounds and its ratio to
    ``off`` (upstream as users run it); ``first_*``: the first round alone; ``later_*``: the
    median over the rounds after it. Without a warm-up (``--warmup-prompts 0``) or one
    smaller than the pool, and without ``--flush-cache``, an elastic pool starts its first
    round (partly) empty and maps what the load asks for while it serves, and is already
    mapped in the later ones: the two answer different questions (the first fill's cost, and
    serving once the memory is there), so both are kept apart from the overall median."""
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
                    later = [r[m] for r in runs if r["round"] > 0 and r.get(m) is not None]
                    row[f"later_{m}_{mode}"] = statistics.median(later) if later else None
            for mode in res["modes"]:
                for m in METRICS:
                    for key in (f"{m}_{{}}", f"first_{m}_{{}}", f"later_{m}_{{}}"):
                        base, val = row.get(key.format("off")), row[key.format(mode)]
                        row[key.format(mode) + "_ratio"] = val / base if base and val else None
            rows.append(row)
    return rows


def print_summary(results: list[dict[str, Any]], modes: Sequence[str]) -> None:
    """One line per model, rate and mode: each metric's median and its ratio to ``off``."""
    for row in summarize(results):
        for mode in modes:
            cells = [
                f"{m} {row[f'{m}_{mode}']:.1f} ({row[f'{m}_{mode}_ratio']:.3f}x)"
                for m in METRICS
                if row[f"{m}_{mode}_ratio"] is not None
            ]
            first = row.get(f"first_output_throughput_{mode}_ratio")
            cells.append(f"first round {first:.3f}x" if first else "")
            later = row.get(f"later_output_throughput_{mode}_ratio")
            cells.append(f"later rounds {later:.3f}x" if later else "")
            print(f"{row['model']:>12} rate={row['rate']:>4} {mode:>9}: " + "  ".join(cells))


def write(args: Any, results: list[dict[str, Any]]) -> None:
    """``args.out``: the command line, every model's result and the summary, as JSON."""
    doc = {"argv": sys.argv[1:], "results": results, "summary": summarize(results)}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


def add_round_args(parser: Any) -> None:
    """The options ``run_rounds`` reads (and ``--out``), on an ``argparse`` parser."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every server")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=0.0,
        help="the call's limit in seconds, from the start: start a round only if it fits "
        "(at the longest round's pace), so rounds end whole; 0: no limit",
    )
    parser.add_argument("--rates", nargs="+", default=["inf", "16"])
    parser.add_argument("--num-prompts", type=int, default=500, help="at rate inf")
    parser.add_argument("--num-prompts-rate", type=int, default=240, help="at a finite rate")
    parser.add_argument(
        "--warmup-prompts",
        type=int,
        default=64,
        help="an unmeasured run of this many prompts at rate inf against each server before "
        "the rounds, so that no mode pays for compiling the kernels the others share "
        "through Triton's disk cache; 0: none",
    )
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
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
