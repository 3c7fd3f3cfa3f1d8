"""TP ranks with physical budgets agree every allocation (``kvcore.parallel.agreement``).

Two real processes form a gloo group (SGLang's TP CPU group is a gloo group too); each builds
real SGLang pools and allocators through kvcore's scope, with a budget of its own on the
host backend, rank 1's tighter (or its device smaller). They run the same allocation
sequence, as SGLang's TP schedulers do: both must see the miss at the same step and keep
identical books. Three stacks:

* ``kv``: ``MHATokenToKVPool`` + the paged allocator (``AgreedLedger``);
* ``swa``: ``SWAKVPool`` + ``SWATokenToKVPoolAllocator`` (one decision per full + SWA pair);
* ``mamba``: ``MambaPool`` (through the series' seam, as ``test_mamba.py`` builds it) +
  ``HybridLinearKVPool`` with the paged allocator, one scope: a step allocates KV then a
  Mamba slot, so both kinds of collectives interleave on one group.

The control runs the same stacks without the agreement group: the ranks diverge.
"""

from __future__ import annotations

import queue
import socket
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from .harness import requires_cpu_paged_kernels, requires_fork

pytestmark = requires_fork

KIB = 1 << 10
GRAN = 64 * KIB
QUIET = {"reserve_min": 0, "reserve_max": 0}  # no idle pages: books compare exactly
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


def _host(device_bytes: int = 1 << 30) -> dict[str, Any]:
    return {
        "backend": "host",
        "backend_options": {"device_bytes": device_bytes, "granularity": GRAN},
    }


def _extend(alloc: Any, seq_len: int) -> Any:
    """A fresh request's ``alloc_extend`` (no prefix)."""
    t = torch.tensor
    return alloc.alloc_extend(t([0]), t([0]), t([seq_len]), t([seq_len]), t([-1]), seq_len)


# -- the stacks, one function per rank and stack: each returns its trace -------------------


def _kv(rank: int, case: str) -> list[Any]:
    from .harness import build

    options: dict[str, Any] = {"device_bytes": 1 << 30, "granularity": GRAN}
    if case == "device" and rank == 1:
        options["device_bytes"] = 5 * PAGE_ID_BYTES  # the device itself is short
    limit = 16 if case == "device" else (16 if rank == 0 else 5)
    engine = build(
        "on",
        size=4096,
        page_size=16,
        backend="host",
        backend_options=options,
        limit_bytes=limit * PAGE_ID_BYTES,
    )
    pool, a, scope = engine.pool, engine.allocator, engine.scope
    ledger = pool.kvcore_manager.ledger

    def books(step: str, got: Any) -> tuple[Any, ...]:
        pool.kvcore_manager.pages.flush()
        stats = pool.kvcore_manager.stats()
        return (step, got is not None, ledger.used(), stats.in_use, a.available_size())

    trace: list[Any] = [type(a.ledger).__name__]
    held = []
    for i in range(8):  # 256 tokens = one physical page each
        idx = a.alloc(TOKENS_PER_PAGE)
        trace.append(books(f"alloc{i}", idx))
        if idx is None:
            break
        held.append(idx)
    a.free(held.pop())
    # the page's unmap runs on the background thread: until it settles the gate still holds
    # it and the agreed room is a page short (conservative, never over); let it settle so
    # the step's figure does not depend on thread timing
    pool.kvcore_manager.pages.flush()
    a.kvcore_step()  # the scheduler's next iteration
    trace.append(books("free", True))
    again = a.alloc(TOKENS_PER_PAGE)
    trace.append(books("again", again))
    scope.close()
    return trace


SWA_FULL, SWA_SWA = 4096, 2048  # tokens per sub-pool: 17 and 9 pages of 256 tokens
# one 256-token request needs one new page on each side: 1 layer x K/V x 64 KiB on the full
# side, 3 layers x K/V x 64 KiB on the SWA side
FULL_PAGE, SWA_PAGE = 2 * GRAN, 6 * GRAN


def _swa_stack(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    from .test_swa import Stack

    s = Stack("on", full=SWA_FULL, swa=SWA_SWA, **config)
    return s.scope, s.pool, s.alloc


def _swa(rank: int, case: str) -> list[Any]:
    # the starting charge (both block-0 pages, the caches' zero pages), measured alike on
    # both ranks from a probe without a budget
    probe, pool, _ = _swa_stack({**_host(), **QUIET})
    managers = (pool.full_kv_pool.kvcore_manager, pool.swa_kv_pool.kvcore_manager)
    for m in managers:
        m.pages.flush()
    start = probe.gate.gate.held
    swa_device = managers[1].backend.mem_info()
    swa_start = swa_device.total - swa_device.free
    probe.close()

    if case == "budget":  # rank 1: three request pairs above the start, rank 0 eight
        config = {
            **_host(),
            "limit_bytes": start + (8 if rank == 0 else 3) * (FULL_PAGE + SWA_PAGE),
        }
    else:  # "device": rank 1's SWA side runs out of device memory after its full side allocated
        device = 1 << 30 if rank == 0 else swa_start + 2 * SWA_PAGE + SWA_PAGE // 2
        config = {**_host(device), "limit_bytes": 1 << 30}
    scope, pool, a = _swa_stack({**config, **QUIET})
    full, swa = pool.full_kv_pool.kvcore_manager, pool.swa_kv_pool.kvcore_manager
    swa_tries: list[bool] = []
    charged = -1
    side_extend = a.swa_attn_allocator.alloc_extend

    def spy(*args: Any, **kw: Any) -> Any:  # forwards; records the SWA side's own outcome
        got = side_extend(*args, **kw)
        swa_tries.append(got is not None)
        return got

    a.swa_attn_allocator.alloc_extend = spy

    def books(step: str, got: Any) -> tuple[Any, ...]:
        for m in (full, swa):
            m.pages.flush()
        return (
            step,
            got is not None,
            full.ledger.used(),
            swa.ledger.used(),
            full.stats().in_use,
            swa.stats().in_use,
            a.full_available_size(),
            a.swa_available_size(),
        )

    trace: list[Any] = [type(a.full_attn_allocator.ledger).__name__]
    held = []
    for i in range(8):
        out = _extend(a, TOKENS_PER_PAGE)
        trace.append(books(f"pair{i}", out))
        if out is None:
            # the requests' bytes on this rank's gate, less the handles the mappers pool
            pooled = sum(m.mapper.stats()["pooled_handles"] for m in (full, swa)) * GRAN
            charged = scope.gate.gate.held - start - pooled
            break
        held.append(out)
    a.free(held.pop())
    for m in (full, swa):  # the freed pages' background unmap, done by the next iteration
        m.pages.flush()
    a.kvcore_step()
    trace.append(books("free", True))
    again = _extend(a, TOKENS_PER_PAGE)
    trace.append(books("again", again))
    trace.append(("rank-local", swa_tries, charged))
    scope.close()
    return trace


MAMBA_KV_PAGE = 3 * 2 * GRAN  # HybridLinearKVPool: 3 full-attention layers x K/V
SSM_PAGE = 3 * GRAN  # one per-layer SSM page in each of the 3 Mamba layers (16 slots)


def _mamba_stack(config: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    from kvcore.adapters.sglang import ElasticScope

    from .test_mamba import hybrid_stack

    scope = ElasticScope(config)
    # the slot allocator's room is created first (collective 1), then the KV ledger's (2)
    _, slots, kv, alloc = hybrid_stack(scope, size=1024)
    return scope, kv.full_kv_pool.kvcore_manager, alloc, slots


def _mamba(rank: int, case: str) -> list[Any]:
    probe, manager, _, _ = _mamba_stack({**_host(), **QUIET})
    manager.pages.flush()
    start = probe.gate.gate.held
    probe.close()
    # rank 1: one more KV page id and a quarter of an SSM page over the start; rank 0: plenty
    extra = 1 << 30 if rank == 0 else MAMBA_KV_PAGE + SSM_PAGE // 4
    scope, manager, a, slots = _mamba_stack({**_host(), "limit_bytes": start + extra, **QUIET})
    state = slots.state

    def books(step: str, kv: Any, slot: Any) -> tuple[Any, ...]:
        manager.pages.flush()
        return (
            step,
            kv is not None,
            slot is not None,
            manager.ledger.used(),
            manager.stats().in_use,
            state.mapped_pages(),
            slots.available_size(),
            a.available_size(),
            slots.schedulable_available_size(),
        )

    trace: list[Any] = [type(a.ledger).__name__, type(slots).__name__]
    requests = []
    # a scheduler step: a 64-token request's KV, then its Mamba slot (two decisions)
    for i in range(12):
        kv = _extend(a, 64)
        slot = slots.alloc(1) if kv is not None else None
        trace.append(books(f"step{i}", kv, slot))
        if kv is None or slot is None:
            break
        requests.append((kv, slot))
    # the KV budget is spent; Mamba slots alone until the next SSM page does not fit
    extra_slots = []
    for i in range(12):
        slot = slots.alloc(1)
        trace.append(books(f"slot{i}", True, slot))
        if slot is None:
            break
        extra_slots.append(slot)
    # requests 4..7 finish: their KV page empties and is unmapped; the next iteration's
    # step refreshes both rooms (one collective), and the slot fits again
    for kv, slot in requests[3:]:
        a.free(kv)
        slots.free(slot)
    trace.append(books("freed", True, True))  # (books flushed the background unmaps)
    manager.pages.trim()  # the KV side's idle handles go back (the gate's reserve target)
    manager.pages.flush()
    a.kvcore_step()
    trace.append(books("step", True, True))
    again = slots.alloc(SSM_PAGE_SLOTS)
    trace.append(books("again", True, again))
    scope.close()
    return trace


SSM_PAGE_SLOTS = 16

_STACKS = {"kv": _kv, "swa": _swa, "mamba": _mamba}


def _rank(rank: int, port: int, runs: list[tuple[str, str]], agree: bool, out: Any) -> None:
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # SGLang's attention-TP group as the scope finds it (world_size, cpu_group)
        group = SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
        parallel = {"tp_size": 2, "attn_tp_size": 2, "attn_tp_group": group} if agree else {}
        traces = {}
        with get_parallel().override(**parallel):
            for stack, case in runs:
                traces[stack, case] = _STACKS[stack](rank, case)
        out.put((rank, traces))
    except BaseException as exc:  # report instead of leaving the parent to time out
        out.put((rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def _run(runs: list[tuple[str, str]], agree: bool) -> dict[tuple[str, str], list[Any]]:
    """Run ``runs`` (stack, case) in two fresh gloo ranks; each run's traces, rank by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, runs, agree, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        # generous: each rank imports SGLang, slow when other sessions load this host
        results = dict(out.get(timeout=900) for _ in procs)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        pytest.fail(f"a rank reported nothing within 900 s (exit codes {codes})")
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():  # a rank stuck in a collective: do not leave it behind
                p.kill()
    assert not any(isinstance(v, str) for v in results.values()), results
    assert [p.exitcode for p in procs] == [0, 0]
    return {run: [results[0][run], results[1][run]] for run in runs}


_RUNS = [
    ("kv", "budget"),
    ("kv", "device"),
    ("swa", "budget"),
    ("swa", "device"),
    ("mamba", "budget"),
]
_CONTROL = [("kv", "budget"), ("swa", "budget"), ("mamba", "budget")]


def _supported(runs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``runs`` less the stacks whose paged allocation needs Triton on this SGLang (< 0.5.23:
    no CPU path for ``alloc_extend``)."""
    from .harness import _paged

    cpu_paged = hasattr(_paged, "alloc_decode_naive")
    return [run for run in runs if cpu_paged or run[0] == "kv"]


@pytest.fixture(scope="module")
def agreed() -> dict[tuple[str, str], list[Any]]:
    """Every stack with the agreement, in one pair of ranks (each pair imports SGLang)."""
    return _run(_supported(_RUNS), agree=True)


@pytest.fixture(scope="module")
def unagreed() -> dict[tuple[str, str], list[Any]]:
    """The control: the same ranks without SGLang's attention-TP group published."""
    return _run(_supported(_CONTROL), agree=False)


def _outcomes(trace: list[Any], field: int = 1) -> list[bool]:
    return [row[field] for row in trace if isinstance(row, tuple) and len(row) > 2]


@pytest.mark.parametrize("case", ["budget", "device"])
def test_both_ranks_see_the_same_miss_and_keep_identical_books(agreed: Any, case: str) -> None:
    """KV: rank 1's budget (``limit_bytes``), or its device, holds a few page ids where rank
    0 has room for 16: the first 256-token allocation rank 1 cannot back misses on both
    ranks, rank 0 rolls its blocks back, and the ranks' used blocks, mapped pages and
    admission capacity stay identical step by step."""
    trace0, trace1 = agreed["kv", case]
    assert trace0[0] == trace1[0] == "AgreedLedger"
    assert trace0 == trace1
    rows = trace0[1:]
    outcomes = [ok for _, ok, *_ in rows]
    k = outcomes.index(False)
    assert k >= 2 and outcomes == [True] * k + [False] + [True, True]
    _, _, used, in_use, _ = rows[k]
    assert used == 1 + 16 * k  # block 0 + k allocations: nothing half-allocated
    assert in_use == k + 1  # rank 0 gave back the page it had mapped for the rolled-back blocks
    # a freed page's worth: both ranks may allocate it again, and do
    assert rows[k + 1][4] >= TOKENS_PER_PAGE and rows[k + 2][1]


@requires_cpu_paged_kernels
@pytest.mark.parametrize("case", ["budget", "device"])
def test_swa_pairs_miss_together_and_roll_back_both_sides(agreed: Any, case: str) -> None:
    """Hybrid SWA: rank 1's budget holds three request pairs (``budget``: its full side
    misses first), or its SWA side's device runs out after its full side allocated
    (``device``: a rank failing mid-allocation). Every rank misses the same pair; the ranks
    that got blocks give both sides back, so used blocks, mapped pages, what the gate holds
    and both available sizes are identical at every step and nothing leaks."""
    trace0, trace1 = agreed["swa", case]
    assert trace0[0] == trace1[0] == "RoomLedger"
    assert trace0[:-1] == trace1[:-1]  # every figure but the local spy's
    rows = trace0[1:-1]
    outcomes = [row[1] for row in rows]
    k = outcomes.index(False)
    assert k >= 2 and outcomes == [True] * k + [False] + [True, True]
    _, _, full_used, swa_used, full_pages, swa_pages, _, _ = rows[k]
    assert (full_used, swa_used) == (1 + 16 * k, 1 + 16 * k)  # no side half-allocated
    assert (full_pages, swa_pages) == (k + 1, k + 1)
    assert rows[k + 2][1]  # a pair freed: both ranks allocate one again
    (_, tries0, charged0), (_, tries1, charged1) = trace0[-1], trace1[-1]
    # nothing leaked: besides pooled handles, each rank's gate holds the k pairs, no more
    assert charged0 == charged1 == k * (FULL_PAGE + SWA_PAGE)
    if case == "device":  # rank 1 failed on its SWA side, after its full side succeeded
        assert tries1[k] is False and tries0[k] is True
    else:  # rank 1's full side missed first: its SWA side was never tried
        assert len(tries1) == len(tries0) - 1


@requires_cpu_paged_kernels
def test_kv_and_mamba_decisions_interleave_and_agree(agreed: Any) -> None:
    """A hybrid Mamba stack: each step allocates a request's KV, then its Mamba slot, two
    decisions on one group. Rank 1's budget runs out first for KV, then for the next SSM
    page; both ranks miss together each time, keep identical KV and slot books, and after
    requests finish one ``kvcore_step`` refreshes both rooms and the slots fit again."""
    trace0, trace1 = agreed["mamba", "budget"]
    assert trace0[:2] == ["AgreedLedger", "ElasticMambaSlotAllocator"]
    assert trace0 == trace1
    rows = {row[0]: row for row in trace0[2:]}
    steps = [r for name, r in rows.items() if name.startswith("step") and name != "step"]
    kv_miss = [r[1] for r in steps].index(False)
    assert kv_miss >= 3 and all(r[2] for r in steps[:kv_miss])
    slot_rows = [r for name, r in rows.items() if name.startswith("slot")]
    slot_ok = [r[2] for r in slot_rows]
    k = slot_ok.index(False)
    assert slot_ok == [True] * k + [False]
    taken = kv_miss + k  # slots 1..15 share slot 0's SSM pages: the 16th needs a new one
    assert taken == SSM_PAGE_SLOTS - 1
    miss = slot_rows[k]
    assert miss[5] == [3, 3] and miss[8] == 0  # one conv page, one SSM page per layer; no room
    assert rows["freed"][8] == 4  # the freed slots count; the KV page the step sees
    assert rows["step"][8] >= SSM_PAGE_SLOTS  # the step agreed the room the KV page freed
    assert rows["again"][2] and rows["again"][5] == [3, 6]


def test_without_agreement_the_ranks_diverge(unagreed: Any) -> None:
    """The control: the same ranks without an agreement group take different decisions (rank
    0 allocates where rank 1 misses), which is what the agreement prevents, for every
    stack."""
    for stack, _ in unagreed:
        trace0, trace1 = unagreed[stack, "budget"]
        assert trace0[0] == "BlockLedger", stack
        rows0 = [r for r in trace0 if isinstance(r, tuple) and len(r) > 2]
        rows1 = [r for r in trace1 if isinstance(r, tuple) and len(r) > 2]
        k = [r[1] for r in rows1].index(False)  # rank 1's first miss (KV, or the SWA pair)
        assert rows0[k][1] is True, stack  # rank 0 went on alone
        assert rows0[k] != rows1[k], stack  # their books differ
