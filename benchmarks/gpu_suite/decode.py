"""Step ``decode``, figure (d): a decode batch's block allocation through kvcore, with and
without the reserve, vs a static free list."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_suite.common import (
    Sizes,
    Suite,
    close_all,
    kv_cache,
    kv_geometry,
    kv_mapper,
    median,
    open_kv_backend,
    percentile,
)


class _StaticBlocks:
    """The baseline allocator of (d): every block pre-allocated, a plain free list (what an
    engine does without kvcore)."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = self._free[-n:]
        del self._free[-n:]
        return ids

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)

    def close(self) -> None:
        pass


@dataclass
class _DecodeRun:
    alloc_ns: list[int]
    step_ns: list[int]
    misses: int
    allocations: int
    frees: int


def _decode_loop(
    blocks: Any,
    sz: Sizes,
    gpu_work: Callable[[], None],
    on_measure: Callable[[], None] = lambda: None,
    on_end: Callable[[], None] = lambda: None,
) -> _DecodeRun:
    """A decode batch: every sequence gains one token per step, takes a block every
    ``block_size`` tokens, and when it reaches its length frees its blocks and is replaced by
    a new sequence with a prompt. The same seed gives every allocator the same requests."""
    rng = random.Random(7)
    bs = sz.shape.block_size
    seqs: list[list[Any]] = []  # [tokens, target, blocks]
    misses = allocations = frees = 0

    def new_seq() -> list[Any]:
        nonlocal misses, allocations
        prompt = rng.randint(bs, sz.decode_max_len // 4)
        target = rng.randint(prompt + 1, sz.decode_max_len)
        ids = blocks.alloc(-(-prompt // bs))
        if ids is None:
            misses += 1
            ids = []
            prompt = 0
        allocations += 1
        return [prompt, target, ids]

    for _ in range(sz.decode_seqs):
        seqs.append(new_seq())
    alloc_ns: list[int] = []
    step_ns: list[int] = []
    clock = time.perf_counter_ns
    for step in range(sz.decode_warmup + sz.decode_steps):
        if step == sz.decode_warmup:
            on_measure()
        t0 = clock()
        for i, seq in enumerate(seqs):
            if seq[0] % bs == 0:
                ids = blocks.alloc(1)
                if ids is None:  # a miss: the scheduler would preempt; this one restarts it
                    misses += 1
                    blocks.free(seq[2])
                    frees += 1
                    seqs[i] = new_seq()
                    continue
                allocations += 1
                seq[2].extend(ids)
            seq[0] += 1
            if seq[0] >= seq[1]:
                blocks.free(seq[2])
                frees += 1
                seqs[i] = new_seq()
        t1 = clock()
        gpu_work()
        t2 = clock()
        if step >= sz.decode_warmup:
            alloc_ns.append(t1 - t0)
            step_ns.append(t2 - t0)
    on_end()  # before the batch's blocks go back (counters read here cover the steps only)
    for seq in seqs:
        blocks.free(seq[2])
    return _DecodeRun(alloc_ns, step_ns, misses, allocations, frees)


def _gpu_work(suite: Suite) -> tuple[Callable[[], None], float]:
    """A fixed stand-in for the model's forward pass: the GPU spins ``decode_gpu_ms`` (the
    host backend sleeps instead), then the step synchronizes. Returns it and its measured
    duration in ms."""
    ms = suite.sizes.decode_gpu_ms
    if ms <= 0:
        return (lambda: None), 0.0
    if suite.backend_name != "cuda":

        def work() -> None:
            time.sleep(ms / 1e3)

    else:
        import torch

        probe_cycles = 1_000_000
        torch.cuda._sleep(probe_cycles)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe_cycles)
        end.record()
        end.synchronize()
        cycles = int(probe_cycles * ms / max(start.elapsed_time(end), 1e-3))

        def work() -> None:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()

    work()
    t0 = time.perf_counter()
    for _ in range(5):
        work()
    return work, (time.perf_counter() - t0) / 5 * 1e3


def kv_blocks(geometry: Any, pages: Any) -> Any:
    from kvcore.memory.blocks import BlockLedger

    return BlockLedger(geometry, pages)


def step_decode(suite: Suite) -> dict[str, Any]:
    import threading

    from kvcore.memory.pages import PageAllocator
    from kvcore.vmm.faults import FaultInjector

    sz = suite.sizes
    shape = sz.shape
    capacity = sz.decode_seqs * -(-sz.decode_max_len // shape.block_size) + sz.decode_seqs
    work, work_ms = _gpu_work(suite)
    details: dict[str, Any] = {"capacity_blocks": capacity, "gpu_work_ms": work_ms, "runs": {}}
    static = _decode_loop(_StaticBlocks(capacity), sz, work)
    base_alloc = median(static.alloc_ns) / 1e3
    base_step = median(static.step_ns) / 1e3
    details["runs"]["static"] = {
        "alloc_us_median": base_alloc,
        "alloc_us_p99": percentile(static.alloc_ns, 0.99) / 1e3,
        "step_us_median": base_step,
        "allocations": static.allocations,
        "misses": static.misses,
    }
    me = threading.get_ident()
    for label, page_bytes, reserve in sz.decode_configs:
        if suite.expired(20):
            details["truncated"] = f"budget: stopped before {label}"
            break
        fi = FaultInjector(open_kv_backend(suite))
        cache = mapper = pages = ledger = None
        try:
            num_blocks = capacity
            geo = kv_geometry(fi, shape, num_blocks, page_bytes, "compound")
            cache = kv_cache(fi, geo)
            mapper = kv_mapper(cache)
            # the refill keeps the whole reserve mapped (reserve_min = reserve_max): a new
            # sequence's prompt takes up to decode_max_len / 4 tokens of blocks at once, and
            # a reserve kept only half full let those bursts spill onto this thread
            pages = PageAllocator(mapper, reserve_min=reserve, reserve_max=reserve)
            ledger = kv_blocks(geo, pages)
            if reserve:
                pages.flush(timeout=30)
            marks: dict[str, Any] = {}

            fi.reset_counts()  # warm-up: from the first sequences' prompts on

            def on_measure(marks: dict[str, Any] = marks, pages: Any = pages, fi: Any = fi) -> None:
                marks["warmup_here"] = fi.calls(thread=me)
                marks["warmup_all"] = fi.calls()
                fi.reset_counts()
                marks["stats"] = pages.stats()

            def on_end(marks: dict[str, Any] = marks, pages: Any = pages, fi: Any = fi) -> None:
                marks["end"] = pages.stats()
                marks["here"] = fi.calls(thread=me)
                marks["all"] = fi.calls()
                marks["kinds"] = {
                    k: n
                    for k in ("map", "unmap", "set_access", "create", "release", "synchronize")
                    if (n := fi.calls(k, thread=me))
                }

            run = _decode_loop(ledger, sz, work, on_measure, on_end)
            st = marks["end"]
            calls_here, calls_all, kinds_here = marks["here"], marks["all"], marks["kinds"]
            steps = len(run.step_ns)
            ours_step = median(run.step_ns) / 1e3
            suite.figure(
                "d",
                f"decode step ({label})",
                ours_step,
                base_step,
                "us",
                ours_label="kvcore BlockLedger + PageAllocator",
                baseline_label="static free list",
                goal="overhead small vs step",
                note=f"{sz.decode_seqs} seqs, {steps} steps, GPU work {work_ms:.2f} ms/step; "
                f"overhead {ours_step - base_step:+.1f} us/step; "
                f"allocation part {median(run.alloc_ns) / 1e3:.1f} us median, "
                f"p99 {percentile(run.alloc_ns, 0.99) / 1e3:.1f} us (static "
                f"{base_alloc:.1f} us)",
            )
            suite.figure(
                "d",
                f"driver calls on the allocating thread per step ({label})",
                calls_here / max(steps, 1),
                None,
                "calls/step",
                ours_label="allocating thread",
                baseline_label="",
                goal="0 with the reserve" if reserve else "",
                limit=0.0 if reserve else None,
                absolute=True,
                note=f"steady state (after {sz.decode_warmup} warm-up steps): {calls_here} of "
                f"{calls_all} driver calls over {steps} steps on the allocating thread (rest: "
                f"refill thread); allocator misses {st.misses - marks['stats'].misses}; "
                f"counted through FaultInjector; by kind {kinds_here}",
            )
            suite.figure(
                "d",
                f"driver calls on the allocating thread per warm-up step ({label})",
                marks["warmup_here"] / max(sz.decode_warmup, 1),
                None,
                "calls/step",
                ours_label="allocating thread",
                baseline_label="",
                goal="",
                absolute=True,
                note=f"warm-up: the first {sz.decode_warmup} steps, from {sz.decode_seqs} "
                f"sequences' prompts arriving at once; {marks['warmup_here']} of "
                f"{marks['warmup_all']} driver calls on the allocating thread (not a goal: "
                "a burst beyond the reserve maps on the caller by design)",
            )
            details["runs"][label] = {
                "page_bytes": page_bytes,
                "reserve_pages": reserve,
                "alloc_us_median": median(run.alloc_ns) / 1e3,
                "alloc_us_p99": percentile(run.alloc_ns, 0.99) / 1e3,
                "step_us_median": ours_step,
                "step_us_p99": percentile(run.step_ns, 0.99) / 1e3,
                "driver_calls_allocating_thread": calls_here,
                "driver_calls_all_threads": calls_all,
                "warmup_steps": sz.decode_warmup,
                "warmup_driver_calls_allocating_thread": marks["warmup_here"],
                "warmup_driver_calls_all_threads": marks["warmup_all"],
                "driver_calls_allocating_thread_by_kind": kinds_here,
                "caller_mapper_calls": st.caller_mapper_calls - marks["stats"].caller_mapper_calls,
                "refill_mapper_calls": st.refill_mapper_calls - marks["stats"].refill_mapper_calls,
                "misses": run.misses,
                "allocations": run.allocations,
                "frees": run.frees,
            }
        finally:
            close_all(ledger, pages, mapper, cache, fi)
    return details
