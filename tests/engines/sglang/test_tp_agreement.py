"""TP ranks with physical budgets agree every allocation (``kvcore.agreement``).

Two real processes form a gloo group (SGLang's TP CPU group is a gloo group too); each builds
the real SGLang MHA pool and paged allocator through kvcore's scope, with a budget of its own
on the host backend, rank 1's tighter. They run the same allocation sequence, as SGLang's TP
schedulers do: both must see the miss at the same step and keep identical books.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import pytest

from .harness import requires_fork

pytestmark = requires_fork

KIB = 1 << 10
# MHA, 2 layers x K/V, 2 heads x 64 dims, bf16: 256 bytes a token row. A 64 KiB host
# granularity holds 16 SGLang pages (256 tokens) per (layer, K/V) buffer: one page id is
# 4 handles = 256 KiB of device memory and 256 tokens.
PAGE_ID_BYTES = 256 * KIB
TOKENS_PER_PAGE = 256


def free_port() -> int:
    """A TCP port free on this host now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(rank: int, case: str) -> dict[str, Any]:
    options: dict[str, Any] = {"device_bytes": 1 << 30, "granularity": 64 * KIB}
    if case == "device" and rank == 1:
        options["device_bytes"] = 5 * PAGE_ID_BYTES  # the device itself is short
    limit = 16 if case == "device" else (16 if rank == 0 else 5)
    return {
        "backend": "host",
        "backend_options": options,
        "limit_bytes": limit * PAGE_ID_BYTES,
    }


def _rank(rank: int, port: int, case: str, agree: bool, out: Any) -> None:
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    from .harness import build

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # SGLang's attention-TP group as the scope finds it (world_size, cpu_group)
        group = SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
        parallel = {"tp_size": 2, "attn_tp_size": 2, "attn_tp_group": group} if agree else {}
        with get_parallel().override(**parallel):
            engine = build("on", size=4096, page_size=16, **_config(rank, case))
        pool, a, scope = engine.pool, engine.allocator, engine.scope
        ledger = pool.kvcore_manager.ledger

        def books(step: str, got: Any) -> tuple[Any, ...]:
            pool.kvcore_manager.pages.flush()
            stats = pool.kvcore_manager.stats()
            return (step, got is not None, ledger.used(), stats.in_use, a.available_size())

        trace = []
        held = []
        for i in range(8):  # 256 tokens = one physical page each
            idx = a.alloc(TOKENS_PER_PAGE)
            trace.append(books(f"alloc{i}", idx))
            if idx is None:
                break
            held.append(idx)
        a.free(held.pop())
        a.kvcore_step()  # the scheduler's next iteration
        trace.append(books("free", True))
        again = a.alloc(TOKENS_PER_PAGE)
        trace.append(books("again", again))
        out.put((rank, trace, type(a.ledger).__name__))
        scope.close()
    except BaseException as exc:  # report instead of leaving the parent to time out
        out.put((rank, repr(exc), "error"))
        raise
    finally:
        dist.destroy_process_group()


def _run(case: str, agree: bool) -> dict[int, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, case, agree, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {r: (trace, kind) for r, trace, kind in (out.get(timeout=180) for _ in procs)}
    finally:
        for p in procs:
            p.join(60)
    assert "error" not in [kind for _, kind in results.values()], results
    assert [p.exitcode for p in procs] == [0, 0]
    return results


@pytest.mark.parametrize("case", ["budget", "device"])
def test_both_ranks_see_the_same_miss_and_keep_identical_books(case: str) -> None:
    """Rank 1's budget (``limit_bytes``), or its device, holds a few page ids where rank 0
    has room for 16: the first 256-token allocation rank 1 cannot back misses on both
    ranks, rank 0 rolls its blocks back, and the ranks' used blocks, mapped pages and
    admission capacity stay identical step by step."""
    results = _run(case, agree=True)
    (trace0, kind0), (trace1, kind1) = results[0], results[1]
    assert kind0 == kind1 == "AgreedLedger"
    assert trace0 == trace1
    outcomes = [ok for _, ok, *_ in trace0]
    k = outcomes.index(False)
    assert k >= 2 and outcomes == [True] * k + [False] + [True, True]
    _, _, used, in_use, _ = trace0[k]
    assert used == 1 + 16 * k  # block 0 + k allocations: nothing half-allocated
    assert in_use == k + 1  # rank 0 gave back the page it had mapped for the rolled-back blocks
    # a freed page's worth: both ranks may allocate it again, and do
    assert trace0[k + 1][4] >= TOKENS_PER_PAGE and trace0[k + 2][1]


def test_without_agreement_the_ranks_diverge() -> None:
    """The control: the same two ranks without an agreement group take different decisions
    (rank 0 allocates where rank 1 misses), which is what the agreement prevents."""
    results = _run("budget", agree=False)
    (trace0, kind0), (trace1, kind1) = results[0], results[1]
    assert kind0 == kind1 == "BlockLedger"
    k = [ok for _, ok, *_ in trace1].index(False)
    assert trace0[k][1] is True  # rank 0 went on alone
    assert trace0[k][2] != trace1[k][2]  # their books differ
