"""A soak of the per-GPU ledger and page allocator under abuse, on CPU (issue 19).

``--instances`` real kvcore instances (processes on the ``host`` backend: ``LedgerGate`` ->
``PageAllocator`` -> ``BlockLedger``, allocating and freeing random blocks) share one
per-GPU ledger in a private directory for ``--seconds``, while the controller, at random:
kills an instance with SIGKILL and starts a new one, changes instance limits and the GPU
budget, and holds the ledger's lock for up to a second, now and then for 6 s (a stopped
``kvctl``). It samples the ledger all along. At the end it stops every instance and checks:

* while the GPU total the ledger shows is above the budget, it never grows (a budget lowered
  under use is deferred by design: no instance gets new memory until the total is under
  it): ``over_budget`` counts samples where it grew;
* every instance either was serving when stopped (it answers SIGTERM by closing cleanly and
  exiting 0) or fail-stopped with a message (a non-zero exit and a line on stderr);
  ``silent`` counts any other outcome;
* after the last instance is gone, the ledger holds no record and no memory
  (``leaked_records``, ``leaked_bytes``).

    PYTHONPATH=. python benchmarks/hardening_soak.py --seconds 60 --json F

Prints the counts and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
DEVICE = 256 * MiB
UUID = "GPU-soak"


def instance(name: str) -> int:
    """One instance's body (``python benchmarks/hardening_soak.py --instance NAME``)."""
    from kvcore.blocks import BlockLedger
    from kvcore.errors import KvcoreError
    from kvcore.geometry import KVGeometry
    from kvcore.gpu_ledger import GpuLedger, LedgerGate
    from kvcore.pages import PageAllocator
    from kvcore.tensors import LocalPageMapper, VirtualKVCache
    from kvcore.vmm.host import HostBackend

    gran = 64 << 10
    backend = HostBackend(device_bytes=DEVICE, granularity=gran)
    geometry = KVGeometry(
        num_layers=1, kv_buffers=1, block_bytes=gran // 4, num_blocks=4 * 256,
        page_bytes=gran, granularity=gran,
    )  # fmt: skip
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    ledger = GpuLedger.open(UUID, device_total=DEVICE)
    gate = LedgerGate(ledger, name=name, engine="soak")
    cache = VirtualKVCache(backend, geometry)
    mapper = LocalPageMapper(cache)
    pages = PageAllocator(mapper, gate, reserve_min=1, reserve_max=4)
    blocks = BlockLedger(geometry, pages)
    rng = random.Random(os.getpid())
    live: list[list[int]] = []
    try:
        while not stop:
            if live and rng.random() < 0.45:
                blocks.free(live.pop(rng.randrange(len(live))))
            else:
                got = blocks.alloc(rng.randrange(1, 64))
                if got is not None:
                    live.append(got)
            time.sleep(0.0005)
        for ids in live:
            blocks.free(ids)
        pages.close()
        mapper.close()
        cache.close()
        gate.close()
        ledger.close()
        backend.close()
        return 0
    except KvcoreError as exc:  # fail-stop: say why, leave the rest to the ledger's sweep
        print(f"{name}: fail-stop: {exc}", file=sys.stderr, flush=True)
        return 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--instance", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instance:
        return instance(args.instance)

    from kvcore.errors import KvcoreError
    from kvcore.gpu_ledger import GpuLedger

    rng = random.Random(args.seed)
    counts: dict[str, Any] = dict.fromkeys(
        ("kills", "limit_changes", "budget_changes", "lock_holds", "samples", "over_budget",
         "served_to_the_end", "fail_stops", "silent", "leaked_records", "leaked_bytes"), 0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvcore-soak-") as tmp:
        os.environ["KVCORE_LEDGER_DIR"] = tmp  # the controller's ledger is the instances'
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        procs: dict[str, subprocess.Popen[str]] = {}
        serial = 0

        def start() -> None:
            nonlocal serial
            serial += 1
            name = f"i{serial}"
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--instance", name],
                env=env, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip

        for _ in range(args.instances):
            start()
        time.sleep(1.0)
        ledger = GpuLedger.open(UUID, device_total=DEVICE)
        prev = (0, DEVICE)  # (total, budget) of the last sample
        outcomes: list[tuple[str, int, str]] = []
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.1:  # kill -9 one, start a new one
                name = rng.choice(sorted(procs))
                procs[name].kill()
                procs.pop(name).wait()
                counts["kills"] += 1
                start()
            elif roll < 0.3:
                snap = ledger.snapshot()
                if snap.records:
                    rec = rng.choice(snap.records)
                    limit = rng.choice((0, rng.randrange(1, 64) * MiB))
                    try:
                        ledger.set_limit(rec.name, limit)
                        counts["limit_changes"] += 1
                    except KvcoreError:  # the record went away meanwhile
                        pass
            elif roll < 0.4:
                budget = rng.randrange(16, 256) * MiB
                ledger.set_budget(budget)
                counts["budget_changes"] += 1
            elif roll < 0.45:  # a stopped kvctl holding the lock (now and then past 5 s)
                fd = os.open(ledger.path, os.O_RDWR)
                fcntl.flock(fd, fcntl.LOCK_EX)
                time.sleep(6.0 if rng.random() < 0.1 else rng.uniform(0.05, 1.0))
                os.close(fd)
                counts["lock_holds"] += 1
            snap = ledger.snapshot()
            counts["samples"] += 1
            # above the budget, the total may only fall (a budget lowered under use is
            # deferred: no instance gets new memory until the total is under it); a sample
            # right after a change of the budget starts the comparison afresh
            if (
                snap.total_mapped > snap.budget
                and snap.budget == prev[1]
                and snap.total_mapped > prev[0]
            ):
                counts["over_budget"] += 1
            prev = (snap.total_mapped, snap.budget)
            time.sleep(0.05)
        time.sleep(3.0)  # the instances started last reach their SIGTERM handler
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            err = proc.stderr.read() if proc.stderr else ""
            outcomes.append((name, code, err.strip()[-300:]))
            if code == 0:
                counts["served_to_the_end"] += 1
            elif "fail-stop" in err:
                counts["fail_stops"] += 1
            else:
                counts["silent"] += 1
        ledger.reclaim_stale()
        snap = ledger.snapshot()
        counts["leaked_records"] = len(snap.records)
        counts["leaked_bytes"] = snap.total_mapped
        ledger.close()
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "counts": counts,
           "outcomes": outcomes}  # fmt: skip
    print(json.dumps(counts, indent=1))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    bad = counts["over_budget"] or counts["silent"] or counts["leaked_records"]
    return 1 if bad or counts["leaked_bytes"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
