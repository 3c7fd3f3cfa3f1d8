"""Cost of agreeing allocations across TP ranks (``kvcore.parallel.agreement.AgreedLedger``) on CPU.

Two processes form a gloo group over TCP on this host (SGLang's TP CPU group is a gloo
group too). Each builds the real kvcore stack (host backend, ``VirtualKVCache``,
``LocalPageMapper``, ``PageAllocator`` under a ``BudgetGate``, ``BlockLedger``) and times,
side by side in the same run, ``alloc(n)`` + ``free`` cycles on the plain ledger and on the
ledger wrapped in ``AgreedLedger`` (one all-reduce of two int64 per ``alloc``), a hybrid
SWA-like pair (two ledgers allocated together as one ``AgreedRoom.decide``: one all-reduce
of three int64), ``Agreement.step`` with three binding rooms (a KV ledger's, a SWA pair's, a
Mamba slot room's: one all-reduce of four int64), plus the bare all-reduce. Both ranks run
the same loop in lockstep, as SGLang's TP schedulers do.

    python -m benchmarks.sglang_tp_agreement [--repeats 11] [--iters 500]

Medians over ``--repeats`` runs of ``--iters`` cycles, rank 0's clock. ``--blocks`` is the
blocks per ``alloc`` (16: one physical page at 16 blocks per page; SGLang's decode step
asks for a few, a prefill batch for ~150).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from kvcore.budget.gate import BudgetGate
from kvcore.memory.blocks import BlockLedger
from kvcore.memory.geometry import KVGeometry
from kvcore.memory.local_mapper import LocalPageMapper
from kvcore.memory.pages import PageAllocator
from kvcore.memory.virtual_cache import VirtualKVCache
from kvcore.parallel.agreement import AgreedLedger, Agreement, TorchGroupAgreement
from kvcore.vmm.host import HostBackend

GRANULARITY = 64 << 10


def _stack() -> tuple[HostBackend, VirtualKVCache, BlockLedger]:
    backend = HostBackend(0, device_bytes=1 << 30, granularity=GRANULARITY)
    geometry = KVGeometry(
        num_layers=2,
        kv_buffers=2,
        block_bytes=4096,
        num_blocks=4096,
        page_bytes=GRANULARITY,
        granularity=GRANULARITY,
        layout="per-layer",
    )
    cache = VirtualKVCache(backend, geometry)
    pages = PageAllocator(LocalPageMapper(cache), BudgetGate(256 << 20))
    return backend, cache, BlockLedger(geometry, pages, pinned_blocks=(0,))


def _time(fn: Any, iters: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _rank(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stacks = [_stack() for _ in range(3)]
    ledger, full, swa = (led for _, _, led in stacks)
    agreement = TorchGroupAgreement()
    agreed = AgreedLedger(ledger, agreement)
    rank_agreement = Agreement(agreement)
    pair_room = rank_agreement.room(
        lambda: [full.available(), swa.available()],
        lambda: [full.geometry.num_blocks - full.used(), swa.geometry.num_blocks - swa.used()],
    )
    # rooms that always bind (agreed figure below the logical one), so step always exchanges
    for width in (1, 2, 1):
        rank_agreement.room(lambda w=width: [1] * w, lambda w=width: [2] * w)
    n = args.blocks

    def plain() -> None:
        ids = ledger.alloc(n)
        assert ids is not None
        ledger.free(ids)

    def with_agreement() -> None:
        ids = agreed.alloc(n)
        assert ids is not None
        agreed.free(ids)

    def attempt_pair() -> tuple[list[int], list[int]] | None:
        a = full.alloc(n)
        if a is None:
            return None
        b = swa.alloc(n)
        if b is None:
            full.free(a)
            return None
        return a, b

    def undo_pair(got: tuple[list[int], list[int]]) -> None:
        full.free(got[0])
        swa.free(got[1])

    def pair() -> None:
        got = pair_room.decide(attempt_pair, undo_pair)
        assert got is not None
        undo_pair(got)

    def step() -> None:
        rank_agreement.step()

    def bare() -> None:
        agreement.min([1, 2])

    fns = {"plain": plain, "agreed": with_agreement, "pair": pair, "step": step, "all-reduce": bare}
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        _time(fn, args.iters // 10 or 1)
    for _ in range(args.repeats):  # alternate, so drift hits all of them alike
        for name, fn in fns.items():
            runs[name].append(_time(fn, args.iters))
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in runs.items()})
    dist.barrier()
    for backend, cache, led in stacks:
        led.close()
        cache.close()
        backend.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--blocks", type=int, default=16)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    medians = out.get(timeout=600)
    for p in procs:
        p.join(60)
    plain, agreed = medians["plain"], medians["agreed"]
    print(
        f"2 ranks (gloo, one host), alloc({args.blocks}) + free, medians of {args.repeats} x "
        f"{args.iters} cycles:"
    )
    print(f"  plain BlockLedger      {plain:8.1f} us/cycle")
    print(f"  AgreedLedger           {agreed:8.1f} us/cycle  ({agreed / plain:.2f}x)")
    print(f"  agreed SWA-like pair   {medians['pair']:8.1f} us/cycle  (2 x alloc + free)")
    print(f"  Agreement.step, 3 binding rooms {medians['step']:8.1f} us")
    print(f"  bare all-reduce (2 x int64, MIN) {medians['all-reduce']:8.1f} us")


if __name__ == "__main__":
    main()
