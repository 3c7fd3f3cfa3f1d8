"""Bodies of the real processes the GPU-ledger tests start (``multiprocessing`` spawn, or
``python -m tests.ledger_procs <role> ...`` for processes a test kills).

Each process is a genuine kvcore instance on the ``host`` backend: it registers a
``LedgerGate`` in the ledger of the backend's device and backs every byte the gate admits
with a real memfd handle, so its claim in the ledger and the memory it holds are two
separately observable facts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.vmm.base import Handle
from kvcore.vmm.host import HostBackend

PAGE = 64 << 10
ROOT = Path(__file__).resolve().parent.parent


def spawn_holder(
    name: str, nbytes: int, reserve: int = 0, *, role: str = "hold"
) -> tuple[subprocess.Popen[str], int]:
    """Start ``python -m tests.ledger_procs <role>`` (an instance holding ``nbytes``) and
    wait until it has registered; returns the process and its pid. ``kill`` it."""
    args = [name, str(1024 << 20), str(nbytes)] + ([str(reserve)] if role == "hold" else [])
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ledger_procs", role, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = json.loads(proc.stdout.readline())
    assert line.get("admitted", True), line
    return proc, int(line["pid"])


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc`` and reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def host_backend(device_bytes: int) -> HostBackend:
    return HostBackend(device=0, device_bytes=device_bytes, granularity=PAGE)


def hammer(
    name: str,
    device_bytes: int,
    iterations: int,
    seed: int,
    held: Any,
    peak: Any,
    results: Any,
    start: Any,
    linger: Any = None,
) -> None:
    """Acquire and release pages at random under the shared budget. ``held`` is a shared
    counter of bytes all hammers hold (raised only after an admission, lowered before a
    release, so it never exceeds what the ledger admitted); ``peak`` keeps its maximum.
    With a ``linger`` event, stay registered (holding) until it is set."""
    rng = random.Random(seed)
    backend = host_backend(device_bytes)
    gate = LedgerGate.from_backend(backend, name=name, engine="test")
    handles: list[Handle] = []
    admitted = refused = 0
    start.wait()
    for _ in range(iterations):
        if handles and rng.random() < 0.45:
            with held.get_lock():
                held.value -= PAGE
            backend.release(handles.pop())
            gate.release(PAGE)
        elif gate.try_acquire(PAGE):
            handles.append(backend.create(PAGE))
            admitted += 1
            with held.get_lock():
                held.value += PAGE
                peak.value = max(peak.value, held.value)
        else:
            refused += 1
        if rng.random() < 0.1:
            gate.report_reserve(rng.randrange(len(handles) + 1) * PAGE)
    rec = gate.record()
    results.put(
        {
            "name": name,
            "ledger_mapped": rec.mapped,
            "backend_bytes": backend.live_handles * PAGE,
            "own_bytes": len(handles) * PAGE,
            "admitted": admitted,
            "refused": refused,
        }
    )
    if linger is not None:
        linger.wait()
    with held.get_lock():
        held.value -= len(handles) * PAGE
    for h in handles:
        backend.release(h)
    gate.close()
    backend.close()


def set_limits(name: str, sizes: list[int], results: Any, start: Any) -> None:
    """Compare-and-set instance ``name``'s limit to each size in turn (read the revision,
    then write with ``if_revision``), recording every write that won."""
    from kvcore.errors import RevisionConflict

    ledger = GpuLedger.open_path(_only_ledger())
    won: list[tuple[int, int]] = []
    conflicts = 0
    start.wait()
    for size in sizes:
        rec = ledger.snapshot().find(name)
        assert rec is not None
        try:
            _, after = ledger.set_limit(name, size, if_revision=rec.limit_revision)
        except RevisionConflict:
            conflicts += 1
            continue
        assert after.limit_revision == rec.limit_revision + 1
        won.append((after.limit_revision, size))
    results.put({"won": won, "conflicts": conflicts})
    ledger.close()


def kvctl_limits(name: str, sizes: list[str], results: Any, start: Any) -> None:
    """Run ``kvctl limit NAME SIZE`` (its real entry point) for each size."""
    from kvcore.cli.kvctl import main

    start.wait()
    codes = [main(["limit", name, size]) for size in sizes]
    results.put({"codes": codes})


def _only_ledger() -> Any:
    from kvcore.budget.ledger_file import list_ledgers

    (path,) = list_ledgers()
    return path


def hold(name: str, device_bytes: int, nbytes: int, reserve: int) -> None:
    """Register, hold ``nbytes`` (real handles) with ``reserve`` of it idle, print one JSON
    line, then sleep until killed."""
    backend = host_backend(device_bytes)
    gate = LedgerGate.from_backend(backend, name=name, engine="vllm", engine_version="0.33.0")
    ok = gate.try_acquire(nbytes)
    handles = [backend.create(PAGE) for _ in range(nbytes // PAGE)] if ok else []
    gate.report_reserve(reserve)
    print(json.dumps({"pid": os.getpid(), "admitted": ok, "handles": len(handles)}), flush=True)
    while True:
        time.sleep(60)


def honour_trim(name: str, device_bytes: int, reserve: int) -> None:
    """Like ``hold``, but behaves like a page allocator's refill thread: keeps its reserve
    at the gate's ``reserve_target`` (so a trim request empties it)."""
    backend = host_backend(device_bytes)
    gate = LedgerGate.from_backend(backend, name=name, engine="sglang")
    assert gate.try_acquire(reserve)
    gate.report_reserve(reserve)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    current = reserve
    while True:
        target = gate.reserve_target(reserve)
        if target < current:
            gate.release(current - target)
            current = target
            gate.report_reserve(current)
        time.sleep(0.01)


def allocator_instance(name: str, budget_uuid: str, steps: Any, results: Any) -> None:
    """A real page allocator (``tests/memstack.py``: host backend -> virtual KV cache ->
    mapper -> ``PageAllocator``) whose gate is a ``LedgerGate``. Obeys ``steps`` (a queue):
    ``"fill"`` acquires single pages until a miss, ``"drop"`` releases every page (no
    reserve: they are unmapped), ``"stop"`` closes, anything else does nothing; reports
    after each step."""
    from tests.memstack import build_stack

    gate = LedgerGate(GpuLedger.open(budget_uuid), name=name, engine="test")
    # the allocator's default: the cache's zero page (one 64 KiB granule) is charged too
    stack = build_stack("host", num_blocks=64, blocks_per_page=4, gate=gate,
                        charge_fixed_bytes=None)  # fmt: skip
    held: list[int] = []
    while (step := steps.get(timeout=60)) != "stop":
        if step == "fill":
            # until the budget has no page left. A miss while it has one is retried: the
            # gate's short lock wait ran out on a loaded machine, or a neighbour's waiting
            # mark (shares.WANT_HOLD_S after its last refusal) still holds that page for it
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                ids = stack.pages.acquire(1)
                if ids is not None:
                    held += ids
                    continue
                snap = gate.ledger.snapshot()  # waits for the lock as long as it takes
                if snap.budget_setting - snap.total_mapped < stack.pages.page_bytes:
                    break
                time.sleep(0.01)
        elif step == "drop":
            stack.pages.release(held)
            held.clear()
            assert stack.pages.flush()
        results.put(
            {
                "name": name,
                "held_pages": len(held),
                "mapped_pages": len(stack.mapped_pages()),
                "ledger_mapped": gate.record().mapped,
                "page_bytes": stack.pages.page_bytes,
                "zero_page_bytes": stack.cache.zero_page_bytes,
            }
        )
    stack.close()
    gate.close()


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "hold":
        hold(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    elif role == "honour-trim":
        honour_trim(rest[0], int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown role {role!r}")
