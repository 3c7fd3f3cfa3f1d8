"""Cost of the per-GPU ledger gate (``LedgerGate``) per call, beside in-process gates.

``try_acquire`` runs under an exclusive ``flock`` on the ledger file before every page map
(on the reserve-refill thread, or the scheduler thread on a reserve miss), so its cost must
stay small next to a map (create + map + set-access; its cost is in docs/benchmarks.md).
Side by side in one run:

* ``UnlimitedGate`` / ``BudgetGate`` (a thread lock and an add): the floor;
* ``LedgerGate`` alone in its ledger, and with 31 other instances registered (admission reads
  only the header total and its own record, so it should not grow with instances);
* ``LedgerGate`` while a second process hammers the same ledger (lock contention);
* a refused ``try_acquire`` (over the limit), ``reserve_target`` / ``report_reserve``, and
  the floor: one ``flock`` lock + unlock pair on the ledger file.

    python -m benchmarks.ledger_gate [--repeats 15] [--iters 5000] [--json F]

Each figure is the median over ``--repeats`` runs of ``--iters`` calls, after a warm-up run,
in microseconds per call: thread CPU time (robust on a shared machine) and wall time.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvcore.budget.gate import BudgetGate, UnlimitedGate
from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import DIR_ENV, HEADER, RECORD, record_offset
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.budget.shares import mark_wanted

UUID = "GPU-bench-ledger-gate"
GiB = 1 << 30
PAGE = 2 << 20


Figure = tuple[float, float]
"""(thread CPU us, wall us) per call: CPU time is robust on a shared machine; wall time
includes waiting for the lock (what the contended case is about)."""


def _now() -> tuple[int, int]:
    return time.thread_time_ns(), time.perf_counter_ns()


def _per_call(t0: tuple[int, int], t1: tuple[int, int], iters: int) -> Figure:
    return (t1[0] - t0[0]) / iters / 1000, (t1[1] - t0[1]) / iters / 1000


def _medians(runs: list[Figure]) -> Figure:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _median_us(fn: Callable[[int], None], iters: int, repeats: int) -> Figure:
    fn(iters)  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = _now()
        fn(iters)
        runs.append(_per_call(t0, _now(), iters))
    return _medians(runs)


def _acquire_then_release(gate: Any, iters: int, repeats: int) -> tuple[Figure, Figure]:
    """Medians per admitted ``try_acquire`` and per ``release``, each loop timed alone."""
    acq, rel = [], []
    for i in range(repeats + 1):  # the first round is the warm-up
        t0 = _now()
        for _ in range(iters):
            gate.try_acquire(PAGE)
        t1 = _now()
        for _ in range(iters):
            gate.release(PAGE)
        t2 = _now()
        if i:
            acq.append(_per_call(t0, t1, iters))
            rel.append(_per_call(t1, t2, iters))
    return _medians(acq), _medians(rel)


def _hammer(directory: str, stop: Any, ready: Any) -> None:
    os.environ[DIR_ENV] = directory
    gate = LedgerGate(GpuLedger.open(UUID), name="hammer", engine="bench")
    ready.set()
    while not stop.is_set():
        for _ in range(1000):
            if gate.try_acquire(PAGE):
                gate.release(PAGE)
    gate.close()


def measure(iters: int, repeats: int) -> dict[str, Figure]:
    """Per-call medians in microseconds."""
    out: dict[str, Figure] = {}

    def pair(label: str, gate: Any) -> None:
        acq, rel = _acquire_then_release(gate, iters, repeats)
        out[f"{label}: try_acquire"] = acq
        out[f"{label}: release"] = rel

    pair("UnlimitedGate", UnlimitedGate())
    pair("BudgetGate", BudgetGate(1 << 62))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[DIR_ENV] = tmp
        led = GpuLedger.open(UUID, device_total=1 << 50)
        gate = LedgerGate(led, name="bench", engine="bench")
        pair("LedgerGate, 1 instance", gate)
        fd = os.open(led.path, os.O_RDWR)

        def flock_pairs(n: int) -> None:
            for _ in range(n):
                fcntl.flock(fd, fcntl.LOCK_EX)
                fcntl.flock(fd, fcntl.LOCK_UN)

        out["flock(LOCK_EX) + flock(LOCK_UN) (the syscall floor)"] = _median_us(
            flock_pairs, iters, repeats
        )
        os.close(fd)
        others = [LedgerGate(led, name=f"other{i}", engine="bench") for i in range(31)]
        for o in others:
            o.try_acquire(PAGE)
        pair("LedgerGate, 32 instances", gate)
        # another instance marked waiting below its share: every call scans the records
        # (kvcore.budget.shares), and this one, below its own share, is still admitted
        waiter = led.snapshot().find("other0")
        assert waiter is not None
        with led.locked(exclusive=True) as buf:
            mark_wanted(buf, waiter.slot, time.time() + 3600)
        pair("LedgerGate, 32 instances, one waiting (records scanned)", gate)
        with led.locked(exclusive=True) as buf:
            RECORD.put(buf, record_offset(waiter.slot), "wanted_until", 0.0)
            HEADER.put(buf, 0, "wanted_until", 0.0)
        out["LedgerGate: reserve_target"] = _median_us(
            lambda n: [gate.reserve_target(PAGE) for _ in range(n)], iters, repeats
        )
        out["LedgerGate: report_reserve"] = _median_us(
            lambda n: [gate.report_reserve(0) for _ in range(n)], iters, repeats
        )
        full = LedgerGate(led, name="full", engine="bench", limit=PAGE)
        full.try_acquire(PAGE)
        out["LedgerGate: refused try_acquire (limit)"] = _median_us(
            lambda n: [full.try_acquire(PAGE) for _ in range(n)], iters, repeats
        )
        ctx = multiprocessing.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_hammer, args=(tmp, stop, ready))
        proc.start()
        ready.wait(60)
        pair("LedgerGate, 2nd process hammering", gate)
        stop.set()
        proc.join(60)
        for o in [gate, full, *others]:
            o.close()
        led.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    results = measure(args.iters, args.repeats)
    floor = results["BudgetGate: try_acquire"][0]
    title = f"gate cost per call, median of {args.repeats} x {args.iters} (load {_load()})"
    table = Table(title=title)
    table.add_column("gate / call")
    table.add_column("us/call (thread CPU)", justify="right")
    table.add_column("us/call (wall)", justify="right")
    table.add_column("CPU x BudgetGate.try_acquire", justify="right")
    for name, (cpu, wall) in results.items():
        table.add_row(name, f"{cpu:.2f}", f"{wall:.2f}", f"{cpu / floor:.0f}")
    Console(width=130).print(table)
    if args.json:
        doc = {"us_per_call_cpu_wall": results, "load": _load(), **vars(args)}
        args.json.write_text(json.dumps(doc, default=str))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
