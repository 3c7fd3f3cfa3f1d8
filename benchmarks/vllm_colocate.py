"""Co-location on one GPU: several `vllm serve` share it through kvcore, against a static split.

Two or three ``vllm serve`` instances of different model shapes (``--models``: offline model
directories of ``benchmarks/offline_model.py``, or shape names looked up under
``$KVDEV/models``, else built into the run's temporary directory; dummy weights) run on one
GPU, each its own process with its own OpenAI server, port and session. Each mode of
``--modes`` gets its own set of servers; all of them receive the same generated trace, seed
and SLO:

* ``elastic``: ``--kvcore-elastic --kvcore-config '{"gpu_ledger": true, "ledger_dir": D}'``
  (D a private directory, so only this run's instances share its ledger). Every instance
  plans the whole ``--kv-total-gib`` as its logical capacity (``--kv-cache-memory-bytes``:
  a virtual range, no memory); the GPU-wide budget of the ledger (``GpuLedger.set_budget``,
  what ``kvctl budget`` does) is set to the same total as soon as the ledger file exists,
  before any load: pages are mapped and charged as blocks fill, and one instance can map
  what another gave back.
* ``static``: upstream vLLM, no kvcore: ``--kv-cache-memory-bytes`` per instance splits the
  same total (evenly, or by ``--static-shares``), allocated at start for the server's life.
* ``kvcached`` (opt-in): the anchor, kvcached on vLLM 0.30.0 from ``--kvcached-site``;
  every instance plans the whole total, and a ballast process leaves the kvcached instances
  exactly the total to share (``benchmarks/kvcached_mode.py``). The ballast would bind any
  other server on the GPU, so this mode's servers always start after the other modes'
  servers have stopped (``start_groups``).

``--gpu-memory-utilization`` is only vLLM's start-up check of free memory in both modes (the
KV sizes are given in bytes, so vLLM skips its memory profiling). Prefix caching is off in
both modes unless ``--prefix-caching`` (the prompts are random: nothing to share; with it on,
an idle elastic instance keeps its cached blocks mapped and gives them to no other instance).

With ``--start together`` (default) every mode's servers start at once and stay up: a
server whose mode is not being measured is idle (it holds memory but no compute), which
fits both modes, their start-up and their stop into one 10-minute device call. ``--start
sequential`` starts one mode's servers, measures them, stops them, then the next mode's.

Workloads (``--workload``; generated here, seeded with numpy from ``--seed``; every
instance its own arrival process; ``python -m benchmarks.vllm_colocate --help`` lists the knobs):

* ``ramp``: per instance, the rate climbs linearly 0 -> ``--peak`` req/s over ``--ramp-s``,
  holds ``--hold-s``, falls to ``--floor`` req/s over ``--ramp-s`` and stays there; instance
  ``i`` starts ``i * --stagger-s`` after the first; Poisson arrivals (thinning); random
  prompts of ``--input-len`` tokens and ``--output-len`` output tokens (256/256). Several
  ``--peak`` values sweep the peak (one phase per peak and mode) to find the knee where the
  static split starts to starve.
* ``bursty``: per instance, ON/OFF periods (exponential, means ``--on-s`` / ``--off-s``,
  random initial phase) and, while ON, gamma-renewal arrivals at ``--burst-rate`` req/s
  (shape ``--gamma-shape``; < 1 is burstier than Poisson); lognormal prompt and output
  lengths (medians ``--prompt-median`` / ``--output-median``, sigma ``--length-sigma``).
* ``handoff``: two models; the donor (first) gets one burst that frees its KV at once when
  it ends, while the receiver (second) is refused for more than the budget leaves it
  (``HandoffSpec``). Per elastic phase, ``handoff`` in the JSON: from the donor's last
  request's end to its pages' release and to the receiver's first map of the freed bytes
  (``handoff_summary``; sample the ledger finely, ``--ledger-interval 0.005``).
* ``steady``: the first model alone, ``--steady-requests`` requests at ``--steady-rate``
  req/s (0: all at once, vLLM's ``--request-rate inf``): single-model saturation, what
  elastic KV costs when there is nothing to share.

Load is sent by real HTTP clients: one process per instance running an asyncio streaming
OpenAI client (aiohttp) that posts ``/v1/completions`` with the prompt as token ids,
``max_tokens`` from the trace, ``ignore_eos``, at the trace's times (open loop), and reads
the stream: TTFT (first chunk with a choice), ITL (between chunks), TPOT ((latency - TTFT) /
(tokens - 1), vLLM bench's definition), errors (HTTP status, a broken stream, fewer tokens
than asked), and requests still running ``--drain-s`` after the trace's end (unfinished).

Measured per phase (one mode, one workload, one peak, one repeat), per instance and over
all: requests sent / finished / errors / unfinished, TTFT, TPOT, ITL and latency p50/p99,
SLO attainment (finished with TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``, over
requests sent), goodput (such requests per second of the phase) and output throughput,
vLLM's preemption counter delta (``/metrics``) and the servers' CPU seconds (``/proc``).
Over time: KV memory per instance (elastic: the ledger records' mapped bytes, every
``--ledger-interval`` s; static: the fixed size), KV in use (vLLM's
``vllm:kv_cache_usage_perc`` x capacity, every second, both modes), and device memory per
server process session (NVML). ``--out`` gets the raw JSON after every phase; a PNG of KV
memory per instance over time for both modes on one scale goes next to it for every
workload/peak/repeat both modes ran. ``--steer T:INSTANCE:SIZE`` sets an elastic instance's
limit (``kvctl limit``'s sizes) T seconds into each elastic phase.

    bash benchmarks/vllm_device.sh run python3 -m benchmarks.vllm_colocate \\
        --workload ramp --peak 12 --out $OUT/colocate-ramp.json
    bash benchmarks/vllm_device.sh run python3 -m benchmarks.vllm_colocate --smoke \\
        --out $OUT/colocate-smoke.json

Runs where vLLM, a GPU and the offline model directories are (``vllm_device.sh``); needs
aiohttp, and nvidia-ml-py for the NVML series (the GPU image has both). Every server is
stopped on exit and on SIGTERM (engine core first, as ``vllm_serve.py`` does).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import kvcached_mode
from benchmarks.vllm_servers import (  # stdlib only at import
    CLI,
    MemorySampler,
    ServeProcess,
    cpu_seconds,
    delta,
    machine_summary,
    session_of,
    stop_all,
)

GiB = 1 << 30
MiB = 1 << 20
MODES = ("elastic", "static", "kvcached")
"""``kvcached``: the anchor, on vLLM 0.30.0 (``benchmarks/kvcached_mode.py``); opt-in."""
DEFAULT_MODES = ("elastic", "static")
SHARED_MODES = ("elastic", "kvcached")
"""Modes whose instances share one budget: each gets all of it as its logical capacity, and
their KV held is sampled over time (elastic: the ledger; kvcached: its segments)."""
WORKLOADS = ("ramp", "bursty", "steady", "handoff")
DEFAULT_MODELS = ("llama-3-8b", "llama-3.2-3b", "qwen3-0.6b")
SMOKE_MODELS = ("qwen3-0.6b", "llama-3.2-3b")
WARMUP_INDEX = 1_000_000
"""Request index of the warm-up prompts (no trace reaches it: their prompts are new)."""
CLIENT_KEEPALIVE_S = 2.0
"""A client drops a connection idle this long, before vLLM's server closes it (5 s)."""
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
"""vLLM gauges sampled every second per server (summed over labels)."""
COUNTERS = ("vllm:num_preemptions_total", "vllm:generation_tokens_total")
"""vLLM counters whose change over each phase is recorded per server."""


# ------------------------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Request:
    """One request of a trace: sent ``t`` seconds after the phase starts to ``instance``."""

    t: float
    instance: int
    index: int
    """Position among ``instance``'s requests (seeds its prompt)."""
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class RampSpec:
    """The staggered ramp (module docstring)."""

    instances: int
    peak: float
    seed: int = 0
    stagger_s: float = 15.0
    ramp_s: float = 15.0
    hold_s: float = 15.0
    tail_s: float = 10.0
    floor: float = 1.0
    input_len: int = 256
    output_len: int = 256

    @property
    def duration(self) -> float:
        """Seconds from the first arrival window's start to the trace's end."""
        return (self.instances - 1) * self.stagger_s + 2 * self.ramp_s + self.hold_s + self.tail_s


@dataclass(frozen=True)
class BurstySpec:
    """ON/OFF-modulated gamma arrivals with lognormal lengths (module docstring)."""

    instances: int
    seed: int = 0
    duration: float = 100.0
    burst_rate: float = 8.0
    gamma_shape: float = 0.5
    on_s: float = 15.0
    off_s: float = 15.0
    prompt_median: float = 512.0
    output_median: float = 192.0
    sigma: float = 0.8
    max_prompt: int = 2048
    max_output: int = 1024


@dataclass(frozen=True)
class SteadySpec:
    """One instance, ``requests`` at ``rate`` req/s (0: all at t = 0)."""

    requests: int = 1000
    rate: float = 0.0
    seed: int = 0
    input_len: int = 256
    output_len: int = 256

    @property
    def duration(self) -> float:
        return 0.0 if self.rate <= 0 else self.requests / self.rate


@dataclass(frozen=True)
class HandoffSpec:
    """Two instances: the donor (instance 0) gets ``donor_requests`` identical requests at
    t = 0, sized so that prompt plus output fill whole blocks they took at prefill (no
    growth while decoding); the receiver (instance 1) gets ``receiver_requests`` at
    ``receiver_start_s``, more than the budget leaves it, so it is refused when the donor's
    requests end together and free their KV at once."""

    donor_requests: int = 40
    donor_prompt: int = 2033
    donor_output: int = 15
    receiver_start_s: float = 0.5
    receiver_requests: int = 120
    receiver_prompt: int = 1024
    receiver_output: int = 1024
    tail_s: float = 15.0

    @property
    def duration(self) -> float:
        return self.receiver_start_s + self.tail_s


def handoff_trace(spec: HandoffSpec) -> list[Request]:
    """The donor's burst at t = 0, then the receiver's at ``spec.receiver_start_s``."""
    donor = [Request(0.0, 0, i, spec.donor_prompt, spec.donor_output)
             for i in range(spec.donor_requests)]  # fmt: skip
    receiver = [Request(spec.receiver_start_s, 1, i, spec.receiver_prompt, spec.receiver_output)
                for i in range(spec.receiver_requests)]  # fmt: skip
    return donor + receiver


def handoff_summary(
    records: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]], t_start: float,
    donor: str, receiver: str,
) -> dict[str, Any]:  # fmt: skip
    """The live handoff in one elastic phase (times in ms after the donor's last request
    ended, as its client saw it; ``t_start`` is the phase's start on the samples' clock):
    when the donor's mapped bytes first fell (``gave_first_ms``: it gives back chunk by
    chunk), when they fell to within 10 % of their floor (``released_ms``), when
    the receiver first mapped more than it held then (``first_map_ms``) and when it held 90 %
    of the freed bytes more (``took_90_ms``). ``None`` where it did not happen or the samples
    do not cover it. A negative time: the engine freed before its last chunk reached the
    client."""
    ends = [t_start + r["t_sent"] + r["latency"] for r in records
            if r["instance"] == donor and r["ok"]]  # fmt: skip
    out: dict[str, Any] = {"donor": donor, "receiver": receiver, "donor_finished": len(ends)}
    rows = [x for x in samples if donor in x["instances"] and receiver in x["instances"]]
    if not ends or not rows:
        return out
    t_end = max(ends)
    before = [x for x in rows if x["t"] <= t_end]
    after = [x for x in rows if x["t"] > t_end]
    if not before or not after:
        return out
    at = before[-1]
    held = at["instances"][donor]["mapped"]
    recv0 = at["instances"][receiver]["mapped"]
    floor = min(x["instances"][donor]["mapped"] for x in after)
    freed = held - floor

    def first(pred: Callable[[Mapping[str, Any]], bool]) -> float | None:
        # the sample before t_end counts too: the engine may free before the client sees it
        for x in [at, *after]:
            if pred(x["instances"]):
                return round((x["t"] - t_end) * 1000.0, 1)
        return None

    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(rows)]
    out.update(
        end_spread_ms=round((t_end - min(ends)) * 1000.0, 1),
        donor_peak=max(x["instances"][donor]["mapped"] for x in rows),
        donor_held_at_end=held, donor_floor=floor, freed=freed,
        receiver_at_end=recv0, budget_free_at_end=at["budget"] - at["total_mapped"],
        gave_first_ms=None, released_ms=None, first_map_ms=None, took_90_ms=None,
        sample_interval_ms=_ms(percentile(gaps, 50)),
    )  # fmt: skip
    if freed:  # nothing freed: nothing was handed off
        out.update(
            gave_first_ms=first(lambda i: i[donor]["mapped"] < held),
            released_ms=first(lambda i: i[donor]["mapped"] <= floor + 0.1 * freed),
            first_map_ms=first(lambda i: i[receiver]["mapped"] > recv0),
            took_90_ms=first(lambda i: i[receiver]["mapped"] >= recv0 + 0.9 * freed),
        )
    return out


def _rngs(seed: int, n: int, salt: int) -> list[np.random.Generator]:
    """One independent generator per instance, from (``seed``, the workload's ``salt``)."""
    children = np.random.SeedSequence([seed, salt]).spawn(n)
    return [np.random.default_rng(c) for c in children]


def ramp_rate(spec: RampSpec, instance: int, t: float) -> float:
    """Instance ``instance``'s arrival rate (req/s) at ``t`` seconds into the trace."""
    x = t - instance * spec.stagger_s
    if x < 0:
        return 0.0
    if x < spec.ramp_s:
        return spec.peak * x / spec.ramp_s
    x -= spec.ramp_s
    if x < spec.hold_s:
        return spec.peak
    x -= spec.hold_s
    if x < spec.ramp_s:
        return spec.peak + (spec.floor - spec.peak) * x / spec.ramp_s
    return spec.floor


def ramp_trace(spec: RampSpec) -> list[Request]:
    """The arrivals of ``spec`` sorted by time: a non-homogeneous Poisson process per
    instance (Lewis-Shedler thinning of rate ``max(peak, floor)``) over ``[0, duration)``,
    fixed lengths. A pure function of ``spec``."""
    out: list[Request] = []
    top = max(spec.peak, spec.floor)
    for inst, rng in enumerate(_rngs(spec.seed, spec.instances, 1)):
        if top <= 0:
            continue
        n = int(rng.poisson(top * spec.duration))
        times = np.sort(rng.uniform(0.0, spec.duration, n))
        keep = rng.uniform(0.0, top, n) < np.array([ramp_rate(spec, inst, t) for t in times])
        for i, t in enumerate(times[keep]):
            out.append(Request(float(t), inst, i, spec.input_len, spec.output_len))
    out.sort(key=lambda r: (r.t, r.instance))
    return out


def _on_periods(rng: np.random.Generator, spec: BurstySpec) -> list[tuple[float, float]]:
    """ON intervals of one instance over ``[0, duration)``: alternating exponential ON and
    OFF periods, starting ON or OFF at random with a random part of the first period."""
    periods: list[tuple[float, float]] = []
    on = bool(rng.uniform() < spec.on_s / (spec.on_s + spec.off_s))
    t = -rng.uniform(0.0, spec.on_s if on else spec.off_s)
    while t < spec.duration:
        length = rng.exponential(spec.on_s if on else spec.off_s)
        if on and t + length > 0:
            periods.append((max(t, 0.0), min(t + length, spec.duration)))
        t += length
        on = not on
    return periods


def bursty_trace(spec: BurstySpec) -> list[Request]:
    """The arrivals of ``spec`` sorted by time: per instance, gamma-renewal arrivals (mean
    gap ``1 / burst_rate``, shape ``gamma_shape``) inside its ON periods, none while OFF;
    lognormal prompt and output lengths clipped to 16..``max_prompt`` / 1..``max_output``.
    A pure function of ``spec``."""
    out: list[Request] = []
    scale = 1.0 / (spec.burst_rate * spec.gamma_shape)
    for inst, rng in enumerate(_rngs(spec.seed, spec.instances, 2)):
        index = 0
        for start, end in _on_periods(rng, spec):
            t = start + rng.gamma(spec.gamma_shape, scale)
            while t < end:
                p = int(np.clip(round(rng.lognormal(math.log(spec.prompt_median), spec.sigma)),
                                16, spec.max_prompt))  # fmt: skip
                o = int(np.clip(round(rng.lognormal(math.log(spec.output_median), spec.sigma)),
                                1, spec.max_output))  # fmt: skip
                out.append(Request(float(t), inst, index, p, o))
                index += 1
                t += rng.gamma(spec.gamma_shape, scale)
    out.sort(key=lambda r: (r.t, r.instance))
    return out


def steady_trace(spec: SteadySpec) -> list[Request]:
    """``spec.requests`` requests to instance 0: Poisson at ``spec.rate``, or all at t = 0."""
    if spec.rate <= 0:
        times = np.zeros(spec.requests)
    else:
        (rng,) = _rngs(spec.seed, 1, 3)
        times = np.cumsum(rng.exponential(1.0 / spec.rate, spec.requests))
    return [Request(float(t), 0, i, spec.input_len, spec.output_len) for i, t in enumerate(times)]


def prompt_ids(seed: int, instance: int, index: int, length: int, vocab_size: int) -> list[int]:
    """The prompt of request ``index`` of ``instance``: ``length`` random token ids, none of
    the vocabulary's last two (offline_model's special tokens) nor its first 256 (single
    bytes). The same in every mode and run of ``seed``; unique prompts, so no prefix hits."""
    rng = np.random.default_rng([seed, instance, index, 7])
    return [int(x) for x in rng.integers(256, vocab_size - 2, length)]


def split_bytes(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` bytes split in proportion to ``shares``, each rounded down to whole MiB.
    Raises ``ValueError`` for no shares or a share that is not positive."""
    if not shares or any(s <= 0 for s in shares):
        raise ValueError(f"shares must be positive, got {list(shares)}")
    whole = sum(shares)
    return [int(total * s / whole) // MiB * MiB for s in shares]


# ------------------------------------------------------------------------------ figures


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when it finished with TTFT and TPOT at most these."""

    ttft_s: float = 1.0
    tpot_s: float = 0.050


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (numpy's linear interpolation, as vLLM bench); None if empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def tpot(rec: Mapping[str, Any]) -> float | None:
    """Time per output token after the first: ``(latency - ttft) / (tokens - 1)``."""
    n, ttft, latency = rec.get("output_tokens") or 0, rec.get("ttft"), rec.get("latency")
    if n < 2 or ttft is None or latency is None:
        return None
    return float((latency - ttft) / (n - 1))


def meets(rec: Mapping[str, Any], slo: Slo) -> bool:
    """Finished without error within the SLO (a one-token output has no TPOT to miss)."""
    if not rec.get("ok") or rec.get("ttft") is None or rec["ttft"] > slo.ttft_s:
        return False
    t = tpot(rec)
    return t is None or t <= slo.tpot_s


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def summarize(records: Sequence[Mapping[str, Any]], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The figures of one group of request records (client records, see ``_one_request``)
    over a phase of ``duration_s`` seconds. Times in ms; rates per second."""
    ok = [r for r in records if r.get("ok")]
    ttfts = [r["ttft"] for r in ok if r.get("ttft") is not None]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    itls = [x for r in ok for x in (r.get("itl") or ())]
    lat = [r["latency"] for r in ok if r.get("latency") is not None]
    good = sum(1 for r in records if meets(r, slo))
    out_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    sent = len(records)
    d = max(duration_s, 1e-9)
    return {
        "sent": sent,
        "finished": len(ok),
        "errors": sum(1 for r in records if not r.get("ok") and not r.get("unfinished")),
        "unfinished": sum(1 for r in records if r.get("unfinished")),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "tpot_p50_ms": _ms(percentile(tpots, 50)),
        "tpot_p99_ms": _ms(percentile(tpots, 99)),
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
        "latency_p50_ms": _ms(percentile(lat, 50)),
        "latency_p99_ms": _ms(percentile(lat, 99)),
        "slo_met": good,
        "slo_attainment": round(good / sent, 4) if sent else None,
        "goodput_rps": round(good / d, 4),
        "request_rps": round(len(ok) / d, 4),
        "output_tok_s": round(out_tokens / d, 2),
        "duration_s": round(duration_s, 3),
        "error_samples": sorted({str(r.get("error")) for r in records if r.get("error")})[:5],
    }


def phase_duration(records: Sequence[Mapping[str, Any]], trace_s: float) -> float:
    """Seconds from the phase's start to its last finished request (at least ``trace_s``)."""
    ends = [r["t_sent"] + r["latency"] for r in records if r.get("ok")]
    return max([trace_s, *ends])


def phase_summary(
    records: Sequence[Mapping[str, Any]], instances: Sequence[str], trace_s: float, slo: Slo
) -> dict[str, Any]:
    """``summarize`` per instance (records' ``instance`` names) and over all, over the
    same phase duration."""
    d = phase_duration(records, trace_s)
    per = {n: summarize([r for r in records if r["instance"] == n], d, slo) for n in instances}
    return {"instances": per, "all": summarize(records, d, slo)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def compare(phases: Sequence[Mapping[str, Any]], mode: str = "elastic") -> list[dict[str, Any]]:
    """``mode`` (elastic, or kvcached) against static for every (workload, peak, repeat)
    both ran, per instance and ``all``: ``ttft_p99_x`` / ``ttft_p50_x`` static over ``mode``
    (above 1: ``mode`` is better), ``tpot_*_ratio``, ``output_ratio`` and ``goodput_ratio``
    ``mode`` over static, and both modes' SLO attainment, errors and preemptions (keys
    named after the mode: ``slo_elastic``, ``slo_static``, ...). Each row names ``mode``."""
    by_key: dict[tuple[Any, ...], dict[str, Mapping[str, Any]]] = {}
    for ph in phases:
        if ph.get("summary"):
            by_key.setdefault((ph["workload"], ph.get("peak"), ph["repeat"]), {})[ph["mode"]] = ph
    rows = []
    for (workload, peak, repeat), modes in by_key.items():
        if not {mode, "static"} <= set(modes):
            continue
        e, s = modes[mode], modes["static"]
        for name in [*e["summary"]["instances"], "all"]:
            fe = e["summary"]["all"] if name == "all" else e["summary"]["instances"].get(name)
            fs = s["summary"]["all"] if name == "all" else s["summary"]["instances"].get(name)
            if fe is None or fs is None:
                continue
            pe = e.get("preemptions", {})
            ps = s.get("preemptions", {})
            rows.append({
                "mode": mode, "workload": workload, "peak": peak, "repeat": repeat,
                "instance": name,
                "ttft_p99_x": _ratio(fs["ttft_p99_ms"], fe["ttft_p99_ms"]),
                "ttft_p50_x": _ratio(fs["ttft_p50_ms"], fe["ttft_p50_ms"]),
                "tpot_p50_ratio": _ratio(fe["tpot_p50_ms"], fs["tpot_p50_ms"]),
                "tpot_p99_ratio": _ratio(fe["tpot_p99_ms"], fs["tpot_p99_ms"]),
                "output_ratio": _ratio(fe["output_tok_s"], fs["output_tok_s"]),
                "goodput_ratio": _ratio(fe["goodput_rps"], fs["goodput_rps"]),
                f"slo_{mode}": fe["slo_attainment"], "slo_static": fs["slo_attainment"],
                f"errors_{mode}": fe["errors"], "errors_static": fs["errors"],
                f"preemptions_{mode}": sum(pe.values()) if name == "all" else pe.get(name),
                "preemptions_static": sum(ps.values()) if name == "all" else ps.get(name),
            })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------ samples


def ledger_sample(snapshot: Any, owner: Callable[[Any], str | None], t: float) -> dict[str, Any]:
    """One KV-memory sample from a ``kvcore.budget.ledger_file.LedgerSnapshot``: per instance
    (``owner(record)``: its name, or None for a record of no instance of this run) the
    record's mapped bytes, in use (mapped less the idle reserve), limit, refusals, and its
    share of the budget with whether it waits below it or yields to another that does
    (``kvcore.budget.shares``)."""
    from kvcore.budget.shares import share_of, yields

    per: dict[str, dict[str, Any]] = {}
    other: dict[str, int] = {}
    wall = time.time()  # waiting marks are wall-clock times
    for rec in snapshot.records:
        name = owner(rec)
        if name is None:
            other[rec.name] = rec.mapped
            continue
        share = share_of(snapshot, rec)
        per[name] = {
            "mapped": rec.mapped, "in_use": rec.in_use, "limit": rec.limit,
            "denied": rec.denied, "over_limit": rec.over_limit, "record": rec.name,
            "share": share, "waiting": rec.wanted_until > wall and rec.mapped < share,
            "yielding": yields(snapshot, rec, wall),
        }  # fmt: skip
    return {
        "t": round(t, 3),
        "budget": snapshot.budget,
        "total_mapped": snapshot.total_mapped,
        "instances": per,
        "other": other,
    }


def kvtop_frame(snapshot: Any) -> str:
    """What ``kvtop --once`` shows for ``snapshot`` (a ``LedgerSnapshot``), as plain text 100
    columns wide: the frame the steering events keep."""
    from rich.console import Console

    from kvcore.cli import kvtop

    console = Console(record=True, width=100, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(kvtop.render([snapshot]))
    return console.export_text()


KVTOP_AFTER_S = 3.0
"""A steering event keeps a kvtop frame when it is applied and this long after."""

Series = list[tuple[float, float]]


def kv_panel(
    mode: str,
    window: tuple[float, float],
    instances: Sequence[str],
    ledger: Sequence[Mapping[str, Any]],
    gauges: Sequence[Mapping[str, Any]],
    capacity: Mapping[str, int],
) -> dict[str, dict[str, Series]]:
    """Per instance of one phase, ``held`` and ``in_use`` KV bytes over phase time (seconds
    from ``window[0]``). Elastic and kvcached: held from ``ledger``, their mapped-bytes
    samples (the ledger's; kvcached's segments); static: the fixed ``capacity``. In use:
    kvcached's segments (``used``: its patched block pool reports vLLM's usage gauge
    against the blocks it has mapped, not against its capacity); elastic and static:
    vLLM's ``kv_cache_usage_perc`` x ``capacity`` (the server's KV capacity in bytes,
    logical for elastic) from the gauge samples (entries ``{"t", "mode", "instance",
    "vllm:kv_cache_usage_perc"}``)."""
    t0, t1 = window
    panel: dict[str, dict[str, Series]] = {}
    for name in instances:
        if mode in SHARED_MODES:
            held = [
                (s["t"] - t0, float(s["instances"][name]["mapped"]))
                for s in ledger
                if t0 <= s["t"] <= t1 and name in s["instances"]
            ]
        else:
            held = [(0.0, float(capacity[name])), (t1 - t0, float(capacity[name]))]
        if mode == "kvcached":
            use = [
                (s["t"] - t0, float(s["instances"][name]["used"]))
                for s in ledger
                if t0 <= s["t"] <= t1 and name in s["instances"]
            ]
        else:
            use = [
                (g["t"] - t0, float(g["vllm:kv_cache_usage_perc"]) * capacity[name])
                for g in gauges
                if g.get("mode") == mode
                and g.get("instance") == name
                and t0 <= g["t"] <= t1
                and "vllm:kv_cache_usage_perc" in g
            ]
        panel[name] = {"held": held, "in_use": use}
    return panel


def plot_kv(
    panels: Mapping[str, Mapping[str, Mapping[str, Series]]],
    budget_bytes: int,
    path: Path,
    title: str,
    marks: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> Path:
    """KV memory per instance over time, one panel per mode on one shared scale (GiB over
    seconds since the phase start): solid = held (elastic: mapped through the ledger;
    static: reserved), dotted = in use, grey = sum held, dashed red = the KV total;
    ``marks[mode]``: (seconds, text) drawn as vertical lines (steering). PNG (matplotlib,
    Agg) at ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(panels)
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(12.5, 3.4 * len(modes)), sharex=True, sharey=True, squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(n for m in modes for n in panels[m]))
    top = budget_bytes
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        grid: list[float] = []
        for lines in panels[mode].values():
            grid += [t for t, _ in lines.get("held", ())]
        grid = sorted(set(grid))
        total = np.zeros(len(grid))
        for name, lines in panels[mode].items():
            k = names.index(name)
            color = colors[k % len(colors)]
            held = lines.get("held") or []
            if held:  # equal static shares coincide: the wider line below stays visible
                t, b = zip(*held, strict=True)
                lw = max(0.8, 2.6 - 0.7 * k)
                ax.plot(t, np.array(b) / GiB, color=color, lw=lw, label=f"{name} held")
                total += np.interp(grid, t, b, left=0.0, right=b[-1])
                top = max(top, max(b))
            use = lines.get("in_use") or []
            if use:
                t, b = zip(*use, strict=True)
                ax.plot(t, np.array(b) / GiB, color=color, lw=1.0, ls=":", label=f"{name} in use")
        if grid:
            ax.plot(grid, total / GiB, color="0.35", lw=0.9, label="sum held")
            top = max(top, float(total.max()))
        ax.axhline(budget_bytes / GiB, color="crimson", ls="--", lw=1, label="KV total (budget)")
        for t, text in (marks or {}).get(mode, ()):
            ax.axvline(t, color="0.5", ls="-.", lw=0.8)
            ax.annotate(text, (t, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=7, color="0.3", ha="right", va="bottom")  # fmt: skip
        what = {
            "elastic": "one GPU budget through kvcore's ledger (mapped pages)",
            "kvcached": "kvcached on vLLM 0.30.0, the budget left free beside a ballast "
            "(mapped pages)",
        }.get(mode, "static split (--kv-cache-memory-bytes, reserved at start)")
        ax.set_title(f"{mode}: {what}", fontsize=10)
        ax.set_ylabel("KV memory (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[0, 0].set_ylim(0, top / GiB * 1.1)
    axes[-1, 0].set_xlabel("seconds since the phase started (dotted: blocks in use)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_phases(
    done: Mapping[str, Mapping[str, Any]],
    held: Callable[[str], Sequence[Mapping[str, Any]]],
    gauges: Sequence[Mapping[str, Any]],
    capacity: Callable[[str], Mapping[str, int]],
    kv_total: int,
    workload: str,
    stem: Path,
) -> Path:
    """The KV plot of one (peak, repeat): ``done`` maps each mode that ran it to its phase
    (the document's entries: ``mode``, ``peak``, ``repeat``, ``t_start``, ``t_end``,
    ``summary``, ``steer``); ``held(mode)`` gives that mode's mapped-bytes samples,
    ``capacity(mode)`` its servers' KV bytes by instance. Written to
    ``<stem>-kv-<workload>[-peak<P>]-r<R>.png``; returns that path. Raises what matplotlib
    raises (``ImportError`` without it)."""
    first = next(iter(done.values()))
    peak, repeat = first["peak"], first["repeat"]
    panels = {}
    for mode in [m for m in MODES if m in done]:
        ph = done[mode]
        names = list(ph["summary"]["instances"])
        panels[mode] = kv_panel(mode, (ph["t_start"], ph["t_end"]), names, held(mode), gauges,
                                capacity(mode))  # fmt: skip
    tag = workload + (f"-peak{peak:g}" if peak is not None else "")
    path = Path(f"{stem}-kv-{tag}-r{repeat}.png")
    title = (f"KV memory per instance, {workload}"
             + (f" (peak {peak:g} req/s per model)" if peak is not None else "")
             + f", KV total {kv_total / GiB:.1f} GiB")  # fmt: skip
    marks = {
        m: [(e["t"], f"limit {e['instance']} {e['size']}") for e in ph.get("steer", ())
            if e.get("applied")]
        for m, ph in done.items()
    }  # fmt: skip
    return plot_kv(panels, kv_total, path, title, marks)


def parse_steer(text: str) -> tuple[float, str, str]:
    """``T:INSTANCE:SIZE`` -> (seconds, instance, size text as ``kvctl limit`` takes it).
    Raises ``ValueError`` for a malformed entry."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise ValueError(f"--steer wants T:INSTANCE:SIZE (e.g. 30:llama-3-8b:4G), got {text!r}")
    t = float(parts[0])
    if t < 0:
        raise ValueError(f"--steer time must be >= 0 s, got {text!r}")
    return t, parts[1], parts[2]


# ------------------------------------------------------------------------------ HTTP client


async def _one_request(
    session: Any, url: str, model: str, req: tuple[float, int, int, int], vocab: int,
    seed: int, instance_id: int, t0: float, rec: dict[str, Any],
) -> None:  # fmt: skip
    """Send one streaming completion and fill ``rec`` (the client record: ``t_sent``,
    ``ttft``, ``latency``, ``itl``, ``output_tokens``, ``ok``, ``error``)."""
    _, index, prompt_len, max_tokens = req
    payload = {
        "model": model,
        "prompt": prompt_ids(seed, instance_id, index, prompt_len, vocab),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    st = time.monotonic()
    rec["t_sent"] = round(st - t0, 4)
    itl: list[float] = []
    rec["itl"] = itl
    last = st
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                rec["error"] = f"HTTP {resp.status}: {body}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line or line.startswith(b":") or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec["error"] = f"stream error: {str(msg['error'])[:300]}"
                    return
                now = time.monotonic()
                if msg.get("choices"):
                    if rec["ttft"] is None:
                        rec["ttft"] = round(now - st, 6)
                    else:
                        itl.append(round(now - last, 6))
                    last = now
                    chunks += 1
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
        rec["latency"] = round(time.monotonic() - st, 6)
        rec["output_tokens"] = int(usage_tokens if usage_tokens is not None else chunks)
        if rec["ttft"] is None:
            rec["error"] = "no token in the stream"
        elif rec["output_tokens"] < max_tokens:
            rec["error"] = f"short output: {rec['output_tokens']} of {max_tokens} tokens"
        else:
            rec["ok"] = True
    except Exception as exc:  # a broken stream, a reset connection, a read timeout
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


async def _run_client(
    port: int, model: str, reqs: Sequence[tuple[float, int, int, int]], vocab: int, seed: int,
    instance_id: int, t0: float, deadline: float, read_timeout: float, counts: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """Open-loop load: each request sent at ``t0 + t`` (monotonic clock), all awaited until
    ``deadline``; requests still running then are cancelled and marked unfinished."""
    import asyncio

    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    records: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []

    async def tracked(req: tuple[float, int, int, int], rec: dict[str, Any]) -> None:
        with counts.get_lock():
            counts[0] += 1
        try:
            await _one_request(session, url, model, req, vocab, seed, instance_id, t0, rec)
        finally:
            if rec["ok"] or rec["error"]:
                with counts.get_lock():
                    counts[1 if rec["ok"] else 2] += 1

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout)
    # vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); aiohttp
    # keeps idle ones 15 s by default, so a request could go out on a connection the server
    # is closing and fail with "Connection reset by peer". Drop idle connections first.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for req in reqs:
            rec: dict[str, Any] = {
                "instance": model, "index": req[1], "t_plan": round(req[0], 4),
                "prompt_tokens": req[2], "max_tokens": req[3], "t_sent": None, "ttft": None,
                "latency": None, "output_tokens": 0, "ok": False, "error": None,
                "unfinished": False,
            }  # fmt: skip
            records.append(rec)
            delay = t0 + req[0] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() >= deadline:
                rec["unfinished"] = True  # never sent: the phase ran out of time
                continue
            tasks.append(asyncio.create_task(tracked(req, rec)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    for rec in records:
        if not rec["ok"] and rec["error"] is None and rec["t_sent"] is not None:
            rec["unfinished"] = True
    return records


def _client_main(
    port: int, model: str, reqs: list[tuple[float, int, int, int]], vocab: int, seed: int,
    instance_id: int, t0: float, deadline: float, read_timeout: float, counts: Any, out: str,
) -> None:  # fmt: skip
    """One instance's client process: run the load, write the records to ``out``."""
    import asyncio

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    records = asyncio.run(
        _run_client(port, model, reqs, vocab, seed, instance_id, t0, deadline, read_timeout,
                    counts)
    )  # fmt: skip
    Path(out).write_text(json.dumps(records))


# ------------------------------------------------------------------------------ servers


@dataclass
class Instance:
    """One model of the run: its name (the served model name), directory and vocabulary."""

    name: str
    path: Path
    vocab: int


class Server(ServeProcess):
    """One ``vllm serve`` of one mode and instance (``vllm_servers.ServeProcess``)."""

    def __init__(
        self, mode: str, inst: Instance, port: int, kv_bytes: int, args: Any, workdir: Path,
        ledger_dir: Path,
    ) -> None:  # fmt: skip
        self.mode, self.inst, self.kv_bytes = mode, inst, kv_bytes
        label = f"{mode}/{inst.name}"
        env = dict(os.environ, VLLM_CACHE_ROOT=str(workdir / f"cache-{mode}-{inst.name}"))
        cmd = [*CLI, "serve", str(inst.path), "--served-model-name", inst.name,
               "--load-format", "dummy", "--port", str(port), "--seed", "0",
               "--max-model-len", str(args.max_model_len),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--kv-cache-memory-bytes", str(kv_bytes)]  # fmt: skip
        cmd.append(
            "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching"
        )
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if mode == "elastic":
            config = {**json.loads(args.kvcore_config or "{}"), "gpu_ledger": True,
                      "ledger_dir": str(ledger_dir)}  # fmt: skip
            cmd += ["--kvcore-elastic", "--kvcore-config", json.dumps(config)]
        elif mode == "kvcached":
            env.update(kvcached_mode.server_env(args.kvcached_site, inst.name))
        cmd += shlex.split(args.serve_args or "")
        super().__init__(cmd, env, port, workdir / f"serve-{mode}-{inst.name}.log", label)


class _Samplers:
    """Background sampling while servers run: the ledger every ``ledger_interval`` s (KV
    bytes per elastic instance) and every server's vLLM gauges every second."""

    def __init__(self, clock0: float, ledger_dir: Path, servers: Sequence[Server],
                 ledger_interval: float) -> None:  # fmt: skip
        self.clock0 = clock0
        self.ledger_dir = ledger_dir
        self.servers = list(servers)
        self.ledger: list[dict[str, Any]] = []
        self.segments: list[dict[str, Any]] = []
        """kvcached instances' mapped bytes (``kvcached_mode.segment_sample``), while any
        kvcached server runs."""
        self.gauges: list[dict[str, Any]] = []
        self.active_mode: str | None = None
        self.phase = "start"
        self.notes: list[str] = []
        self._owners: dict[int, str | None] = {}
        self._ledger: Any = None
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._ledger_loop, args=(ledger_interval,), daemon=True),
            threading.Thread(target=self._gauge_loop, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def now(self) -> float:
        return time.monotonic() - self.clock0

    def owner(self, rec: Any) -> str | None:
        """The instance name of a ledger record, from its pid's session (its server)."""
        if rec.pid not in self._owners:
            sid = session_of(rec.pid)
            match = [s.inst.name for s in self.servers if s.mode == "elastic" and s.proc.pid == sid]
            self._owners[rec.pid] = match[0] if match else None
        return self._owners[rec.pid]

    def held(self, mode: str) -> list[dict[str, Any]]:
        """The mapped-bytes samples of ``mode``'s instances: kvcached's segments, the
        ledger's for elastic (and nothing to sample for static: the ledger's, unused)."""
        return self.segments if mode == "kvcached" else self.ledger

    def open_ledger(self) -> Any:
        """The run's ledger (opened once its file exists); None before that."""
        if self._ledger is None:
            from kvcore.budget import GpuLedger, list_ledgers

            paths = list_ledgers(self.ledger_dir)
            if len(paths) > 1:
                raise RuntimeError(f"{len(paths)} ledgers under {self.ledger_dir}: one GPU only")
            if paths:
                self._ledger = GpuLedger.open_path(paths[0])
        return self._ledger

    def _ledger_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            kvc = [s.inst.name for s in self.servers
                   if s.mode == "kvcached" and s.proc.poll() is None]  # fmt: skip
            if kvc:
                sample = kvcached_mode.segment_sample(kvc, self.now())
                sample["phase"] = self.phase
                self.segments.append(sample)
            try:
                ledger = self.open_ledger()
                if ledger is not None:
                    sample = ledger_sample(ledger.snapshot(), self.owner, self.now())
                    sample["phase"] = self.phase
                    self.ledger.append(sample)
            except Exception as exc:  # a busy lock, a ledger going away at shutdown
                if len(self.notes) < 20:
                    self.notes.append(f"ledger sample at {self.now():.1f} s: {exc!r}")

    def _gauge_loop(self) -> None:
        while not self._stop.wait(1.0):
            mode = self.active_mode
            for s in self.servers:
                if mode is not None and s.mode != mode:
                    continue
                got = s.metrics(GAUGES)
                if got:
                    row = {"t": round(self.now(), 3), "mode": s.mode, "instance": s.inst.name}
                    self.gauges.append({**row, "phase": self.phase, **got})

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        if self._ledger is not None:
            self._ledger.close()


# ------------------------------------------------------------------------------ the run


def resolve_models(specs: Sequence[str], workdir: Path) -> list[Instance]:
    """Offline model directories for ``specs``: a directory as given, a shape name of
    ``offline_model.SHAPES`` from ``$KVDEV/models`` (default /tmp/kvdev) or built into
    ``workdir``. Instance names are the directory names, made unique."""
    out: list[Instance] = []
    for spec in specs:
        path = Path(spec)
        if not (path / "config.json").exists():
            found = Path(os.environ.get("KVDEV", "/tmp/kvdev")) / "models" / spec
            if (found / "config.json").exists():
                path = found
            else:
                from benchmarks.offline_model import SHAPES, write_model_dir

                if spec not in SHAPES:
                    raise SystemExit(f"{spec}: no model directory and no shape of that name")
                print(f"building the offline model directory {spec} in {workdir}", flush=True)
                path = write_model_dir(workdir / "models", spec)
        name, k = path.name, 2
        while name in {i.name for i in out}:
            name, k = f"{path.name}-{k}", k + 1
        vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
        out.append(Instance(name, path, vocab))
    return out


@dataclass
class Plan:
    """What one invocation measures (resolved from the arguments)."""

    workload: str
    modes: list[str]
    peaks: list[float | None]
    repeats: int
    kv_total: int
    static_kv: list[int]
    elastic_kv: int
    slo: Slo
    traces: dict[float | None, tuple[list[Request], float, dict[str, Any]]] = field(
        default_factory=dict
    )


def build_plan(args: Any, n_instances: int) -> Plan:
    """Traces per peak (``None`` for the workloads without one) with their duration and
    spec, the KV sizes per mode."""
    kv_total = int(args.kv_total_gib * GiB)
    shares = args.static_shares or [1.0] * n_instances
    if len(shares) != n_instances:
        raise SystemExit(f"--static-shares needs {n_instances} values, got {len(shares)}")
    plan = Plan(
        workload=args.workload, modes=list(args.modes),
        peaks=list(args.peak) if args.workload == "ramp" else [None],
        repeats=args.repeats, kv_total=kv_total, static_kv=split_bytes(kv_total, shares),
        elastic_kv=int((args.elastic_capacity_gib or args.kv_total_gib) * GiB),
        slo=Slo(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0),
    )  # fmt: skip
    for peak in plan.peaks:
        spec: Any
        if args.workload == "ramp":
            assert peak is not None
            spec = RampSpec(
                n_instances, peak, seed=args.seed, stagger_s=args.stagger_s, ramp_s=args.ramp_s,
                hold_s=args.hold_s, tail_s=args.tail_s, floor=args.floor,
                input_len=args.input_len, output_len=args.output_len,
            )  # fmt: skip
            trace, duration = ramp_trace(spec), spec.duration
        elif args.workload == "bursty":
            spec = BurstySpec(
                n_instances, seed=args.seed, duration=args.duration_s,
                burst_rate=args.burst_rate, gamma_shape=args.gamma_shape, on_s=args.on_s,
                off_s=args.off_s, prompt_median=args.prompt_median,
                output_median=args.output_median, sigma=args.length_sigma,
                max_prompt=args.max_model_len // 2, max_output=args.max_model_len // 4,
            )  # fmt: skip
            trace, duration = bursty_trace(spec), spec.duration
        elif args.workload == "handoff":
            spec = HandoffSpec()
            trace, duration = handoff_trace(spec), spec.duration
        else:
            spec = SteadySpec(args.steady_requests, args.steady_rate, args.seed,
                              args.input_len, args.output_len)  # fmt: skip
            trace, duration = steady_trace(spec), spec.duration
        plan.traces[peak] = (trace, duration, asdict(spec))
    return plan


STOP_MARGIN_S = 30.0
"""Left free at the end of ``--time-limit-s``: stopping every server, the last plots and the
JSON (give the device call's own timeout some seconds more)."""
PHASE_MARGIN_S = 15.0
"""A phase starts only while its trace plus this much (its last requests' drain) is left."""
SERVER_START_FLOOR_S = 60.0
"""At most the quickest start of the servers seen on the H200 (docs/benchmarks.md)."""


def start_groups(modes: Sequence[str], start: str) -> list[list[str]]:
    """The modes whose servers are up at the same time, in the order they run: with
    ``start`` ``"together"`` every mode but kvcached in one group, then kvcached alone (its
    ballast holds what the GPU has free beyond the budget); with ``"sequential"`` one mode a
    group. A group's servers stop before the next group's start."""
    if start == "sequential":
        return [[m] for m in modes]
    alone = [m for m in modes if m == "kvcached"]
    return [g for g in ([m for m in modes if m not in alone], alone) if g]


def least_time_limit(plan: Plan) -> float:
    """The ``--time-limit-s`` below which not even the shortest phase could run after the
    servers' start: ``SERVER_START_FLOOR_S``, that trace, ``PHASE_MARGIN_S`` and
    ``STOP_MARGIN_S``. ``Run`` refuses a smaller limit before it starts anything."""
    shortest = min(duration for _, duration, _ in plan.traces.values())
    return SERVER_START_FLOOR_S + shortest + PHASE_MARGIN_S + STOP_MARGIN_S


class Run:
    """One invocation: servers, samplers, phases, the JSON document and the plots."""

    def __init__(self, args: Any, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.clock0 = time.monotonic()
        self.deadline = self.clock0 + args.time_limit_s
        self.plan = build_plan(args, len(args.models))
        least = least_time_limit(self.plan)
        if args.time_limit_s < least:
            raise SystemExit(
                f"--time-limit-s {args.time_limit_s:g} leaves no time for a phase: the "
                f"servers' start (>= {SERVER_START_FLOOR_S:g} s), the shortest trace and its "
                f"drain and the stop need at least {least:.0f} s"
            )
        self.ledger_dir = workdir / "ledger"
        self.ledger_dir.mkdir(mode=0o700)
        self.instances = resolve_models(args.models, workdir)
        self.servers: list[Server] = []
        self.samplers: _Samplers | None = None
        self.nvml: Any = None
        self.phases: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.budget_info: dict[str, Any] = {}
        self.warmup: dict[str, Any] = {}
        self.plots: list[str] = []
        self.logs: dict[str, str] = {}
        self.log_flags: dict[str, dict[str, int]] = {}
        self._stop_offsets: dict[str, int] = {}
        """Each stopped server's log size in bytes when its stop began (``log_flags``)."""
        self._children: list[Any] = []
        self._ballast: kvcached_mode.Ballast | None = None
        self.ballast_report: dict[str, Any] = {}
        """What the kvcached mode's ballast held (``kvcached_mode.Ballast.report``) and
        the KV bytes the kvcached instances had mapped when it started."""

    # -- output --------------------------------------------------------------------------

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.clock0:6.1f}s] {text}"
        self.events.append(line)
        print(line, flush=True)

    def document(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "argv": sys.argv[1:],
            "config": {
                "workload": plan.workload,
                "modes": plan.modes,
                "peaks": plan.peaks,
                "repeats": plan.repeats,
                "kv_total_bytes": plan.kv_total,
                "static_kv_bytes": dict(
                    zip([i.name for i in self.instances], plan.static_kv, strict=True)
                ),
                "elastic_capacity_bytes": plan.elastic_kv,
                "slo": asdict(plan.slo),
                "instances": [
                    {"name": i.name, "path": str(i.path), "vocab": i.vocab} for i in self.instances
                ],
                "traces": {
                    str(k): {"spec": v[2], "requests": len(v[0]), "duration_s": v[1]}
                    for k, v in plan.traces.items()
                },
                "start": self.args.start,
                "prefix_caching": self.args.prefix_caching,
                "enforce_eager": self.args.enforce_eager,
                "steer": self.args.steer,
            },
            "servers": {
                s.label: {
                    "port": s.port,
                    "kv_bytes": s.kv_bytes,
                    "start_s": s.start_s,
                    "cmd": s.cmd,
                }
                for s in self.servers
            },
            "budget": self.budget_info,
            "warmup": self.warmup,
            "phases": self.phases,
            "comparison": compare(self.phases) + compare(self.phases, "kvcached"),
            "ledger": list(self.samplers.ledger) if self.samplers else [],
            "kvcached_segments": list(self.samplers.segments) if self.samplers else [],
            "ballast": self.ballast_report,
            "gauges": list(self.samplers.gauges) if self.samplers else [],
            "sampler_notes": list(self.samplers.notes) if self.samplers else [],
            "memory": list(self.nvml.series) if self.nvml is not None else [],
            "plots": self.plots,
            "events": self.events,
            "log_flags": self.log_flags,
            "logs": self.logs,
        }

    def write(self) -> None:
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.document(), indent=1) + "\n")
        tmp.replace(out)

    # -- servers -------------------------------------------------------------------------

    def start(self, modes: Sequence[str]) -> list[Server]:
        new = []
        for mode in modes:
            for i, inst in enumerate(self.instances):
                shared = mode in SHARED_MODES  # logical: the whole budget
                kv = self.plan.elastic_kv if shared else self.plan.static_kv[i]
                port = self.args.port + len(self.servers)
                s = Server(mode, inst, port, kv, self.args, self.workdir, self.ledger_dir)
                self.servers.append(s)
                new.append(s)
        if self.samplers is None:
            self.samplers = _Samplers(self.clock0, self.ledger_dir, self.servers,
                                      self.args.ledger_interval)  # fmt: skip
        else:
            self.samplers.servers = list(self.servers)
        self._start_nvml()
        self.say("starting " + ", ".join(f"{s.label} (port {s.port}, KV {s.kv_bytes / GiB:.2f}"
                                         f" GiB)" for s in new))  # fmt: skip
        limit = time.monotonic() + self.args.start_timeout
        last = 0.0
        while True:
            if "elastic" in modes:
                self._try_budget()
            states = [s.ready() for s in new]
            if all(states):
                break
            if time.monotonic() > limit:
                raise TimeoutError(f"servers not ready after {self.args.start_timeout:.0f} s")
            if time.monotonic() - last > 15:
                last = time.monotonic()
                self.say(f"waiting for servers: {sum(states)}/{len(new)} ready")
            time.sleep(1.0)
        self.say("up: " + ", ".join(f"{s.label} {s.start_s} s" for s in new))
        if "elastic" in modes:
            self._check_budget()
        self._warm_up(new)
        return new

    def _warm_up(self, servers: Sequence[Server]) -> None:
        """Two short streamed requests per server through the benchmark's own client, before
        any phase: the stream must parse as the phases expect (else nothing measured later
        could be trusted, so the run stops here)."""
        import asyncio
        import multiprocessing as mp

        names = [i.name for i in self.instances]
        for s in servers:
            reqs = [(0.0, WARMUP_INDEX + k, 32, 16) for k in range(2)]
            t0 = time.monotonic()
            recs = asyncio.run(
                _run_client(s.port, s.inst.name, reqs, s.inst.vocab, self.args.seed,
                            names.index(s.inst.name), t0, t0 + 120.0, 120.0, mp.Array("l", 3))
            )  # fmt: skip
            self.warmup[s.label] = [{k: r[k] for k in ("ok", "error", "ttft", "latency",
                                    "output_tokens")} for r in recs]  # fmt: skip
            bad = [r for r in recs if not r["ok"]]
            if bad:
                raise RuntimeError(f"warm-up of {s.label} failed: {bad[0]['error']}")
        self.say("warm-up: every server streamed 2 x 16 tokens")

    def _start_nvml(self) -> None:
        sessions = {s.proc.pid: s.label for s in self.servers}
        if self.nvml is not None:
            self.nvml._sessions = sessions
            return
        try:
            self.nvml = MemorySampler(sessions, interval=0.5)
            self.nvml.t0 = self.clock0
        except Exception as exc:  # no pynvml, no driver
            self.say(f"NVML sampling off: {exc!r}")

    def _try_budget(self) -> None:
        """Set the GPU budget as soon as the run's ledger exists (before any load)."""
        if self.budget_info.get("set") or self.samplers is None:
            return
        ledger = self.samplers.open_ledger()
        if ledger is None:
            return
        rev = ledger.set_budget(self.plan.kv_total)
        snap = ledger.snapshot()
        self.budget_info = {"set": True, "budget": snap.budget, "revision": rev,
                            "device_total": snap.device_total, "device_uuid": snap.device_uuid,
                            "path": str(snap.path)}  # fmt: skip
        self.say(f"ledger {snap.path.name}: GPU budget set to {snap.budget / GiB:.2f} GiB "
                 f"(device {snap.device_total / GiB:.1f} GiB)")  # fmt: skip

    def _check_budget(self) -> None:
        assert self.samplers is not None
        self._try_budget()
        ledger = self.samplers.open_ledger()
        if ledger is None:
            raise RuntimeError(f"the elastic servers wrote no ledger under {self.ledger_dir}")
        snap = ledger.snapshot()
        owned = {self.samplers.owner(r): r.mapped for r in snap.records}
        names = {i.name for i in self.instances}
        if snap.budget != self.plan.kv_total:
            raise RuntimeError(f"the ledger's budget is {snap.budget}, not {self.plan.kv_total}")
        if not names <= set(owned):  # the KV series per instance will miss someone
            self.say(
                f"WARNING: ledger records {[r.name for r in snap.records]} map to "
                f"{sorted(map(str, owned))}, not to every instance of {sorted(names)}"
            )
        self.budget_info["idle_mapped"] = {str(k): v for k, v in owned.items()}
        self.say("ledger at idle: " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in owned.items()))

    # -- phases --------------------------------------------------------------------------

    def phase(self, mode: str, peak: float | None, repeat: int) -> None:
        args, plan = self.args, self.plan
        assert self.samplers is not None
        trace, trace_s, _ = plan.traces[peak]
        servers = {s.inst.name: s for s in self.servers if s.mode == mode}
        label = f"{mode} {plan.workload}" + (f" peak={peak:g}" if peak is not None else "")
        label += f" r{repeat}"
        left = self.deadline - time.monotonic() - STOP_MARGIN_S
        record: dict[str, Any] = {"mode": mode, "workload": plan.workload, "peak": peak,
                                  "repeat": repeat, "label": label}  # fmt: skip
        dead = [s.label for s in servers.values() if s.proc.poll() is not None]
        if dead:
            record["skipped"] = f"server(s) exited: {', '.join(dead)}"
        elif trace_s + PHASE_MARGIN_S > left:
            record["skipped"] = f"{left:.0f} s left before --time-limit-s; trace is {trace_s:.0f} s"
        if "skipped" in record:
            self.phases.append(record)
            self.say(f"SKIP {label}: {record['skipped']}")
            return
        used = (
            [self.instances[0].name]
            if plan.workload == "steady"
            else [i.name for i in self.instances]
        )
        self.samplers.phase, self.samplers.active_mode = label, mode
        if self.nvml is not None:
            self.nvml.phase = label
        before = {n: servers[n].metrics(COUNTERS) for n in used}
        cpu0 = {n: cpu_seconds(servers[n].proc.pid) for n in used}
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        t0 = time.monotonic() + 3.0  # every client process up before the first arrival
        drain_deadline = min(t0 + trace_s + args.drain_s, time.monotonic() + left)
        clients = []
        for k, name in enumerate(used):
            inst_id = [i.name for i in self.instances].index(name)
            reqs = [(r.t, r.index, r.prompt_tokens, r.output_tokens) for r in trace
                    if r.instance == k]  # fmt: skip
            counts = ctx.Array("l", 3)
            out = self.workdir / f"records-{len(self.phases)}-{name}.json"
            p = ctx.Process(
                target=_client_main, daemon=True,
                args=(servers[name].port, name, reqs, self.instances[inst_id].vocab, args.seed,
                      inst_id, t0, drain_deadline, args.read_timeout_s, counts, str(out)),
            )  # fmt: skip
            p.start()
            self._children.append(p)
            clients.append((name, p, counts, out, len(reqs)))
        self.say(f"{label}: {len(trace)} requests over {trace_s:.0f} s to {', '.join(used)}")
        record["t_start"] = round(t0 - self.clock0, 3)
        steer = sorted(parse_steer(x) for x in args.steer) if mode == "elastic" else []
        steered: list[dict[str, Any]] = []
        frames_due: list[tuple[float, dict[str, Any]]] = []  # (when, steering event)
        last = time.monotonic()
        while any(p.is_alive() for _, p, *_ in clients):
            time.sleep(0.2)
            now = time.monotonic()
            while steer and now >= t0 + steer[0][0]:
                steered.append(self._steer(*steer.pop(0)))
                self._keep_kvtop(steered[-1], now - t0)
                frames_due.append((now + KVTOP_AFTER_S, steered[-1]))
            for due in [d for d in frames_due if now >= d[0]]:
                frames_due.remove(due)
                self._keep_kvtop(due[1], now - t0)
            if now - last >= args.progress_s:
                last = now
                self.say(f"{label} t={now - t0:5.0f}s " + self._progress(mode, clients))
            if now > drain_deadline + 30:
                for _, p, *_ in clients:
                    p.terminate()
        for _, p, *_ in clients:
            p.join(timeout=10)
        t_end = time.monotonic()
        records: list[dict[str, Any]] = []
        for name, _p, _c, out, _n in clients:
            if out.exists():
                records += json.loads(out.read_text())
            else:
                self.say(f"{label}: the client of {name} wrote no records")
        after = {n: servers[n].metrics(COUNTERS) for n in used}
        record.update(
            t_end=round(t_end - self.clock0, 3), trace_s=trace_s, steer=steered,
            summary=phase_summary(records, used, trace_s, plan.slo),
            preemptions={n: after[n].get(COUNTERS[0], 0.0) - before[n].get(COUNTERS[0], 0.0)
                         for n in used},
            counters={n: delta(after[n], before[n]) for n in used},
            cpu_s={n: delta(cpu_seconds(servers[n].proc.pid), cpu0[n])
                   for n in used},
        )  # fmt: skip
        if self.nvml is not None:
            record["machine"] = machine_summary(self.nvml.series, record["t_start"],
                                                record["t_end"])  # fmt: skip
            self.say(f"{label} machine: " + ", ".join(
                f"{k} {v['median']:g} (max {v['max']:g})"
                for k, v in record["machine"].items()))  # fmt: skip
        gone = [s.label for s in servers.values() if s.proc.poll() is not None]
        if gone:
            record["servers_exited"] = {g: servers[g.split("/", 1)[1]].log_tail() for g in gone}
            self.say(f"{label}: server(s) exited during the phase: {', '.join(gone)}")
        if plan.workload == "handoff" and mode == "elastic":
            record["handoff"] = handoff_summary(records, self.samplers.ledger,
                                                record["t_start"], used[0], used[1])  # fmt: skip
            self.say(f"{label} handoff: {record['handoff']}")
        if not args.keep_itl:
            for r in records:
                r.pop("itl", None)
        record["records"] = records
        self.phases.append(record)
        self.samplers.phase, self.samplers.active_mode = "idle", None
        if self.nvml is not None:
            self.nvml.phase = "idle"
        for name in [*used, "all"]:
            self.say(f"{label} {name:>14}: " + _line(record, name))
        self.write()

    def _progress(self, mode: str, clients: Sequence[Any]) -> str:
        cells = []
        held = self.samplers.held(mode) if self.samplers is not None else []
        latest = held[-1] if held and mode in SHARED_MODES else None
        for name, _p, counts, _out, n in clients:
            sent, done, err = counts[:]
            cell = f"{name} {sent}/{n} sent {done} ok {err} err"
            if latest and name in latest["instances"]:
                cell += f" {latest['instances'][name]['mapped'] / GiB:.2f} GiB"
            cells.append(cell)
        return "; ".join(cells)

    def _steer(self, t: float, name: str, size: str) -> dict[str, Any]:
        from kvcore.cli.sizes import parse_size

        assert self.samplers is not None
        ledger = self.samplers.open_ledger()
        event: dict[str, Any] = {"t": t, "instance": name, "size": size}
        try:
            rec = next(r for r in ledger.snapshot().records if self.samplers.owner(r) == name)
            limit = parse_size(size, device_total=ledger.snapshot().device_total)
            before, _ = ledger.set_limit(rec.name, limit)
            event.update(limit=limit, mapped_before=before.mapped, applied=True)
            self.say(f"steer: limit of {name} ({rec.name}) -> {size} at {t:g} s "
                     f"(mapped {before.mapped / GiB:.2f} GiB)")  # fmt: skip
        except Exception as exc:
            event.update(applied=False, error=repr(exc))
            self.say(f"steer {name} {size} failed: {exc!r}")
        return event

    def _keep_kvtop(self, event: dict[str, Any], t: float) -> None:
        """Add a kvtop frame of the ledger now to a steering event (and to the log)."""
        assert self.samplers is not None
        try:
            frame = kvtop_frame(self.samplers.open_ledger().snapshot())
        except Exception as exc:  # informative only: the run goes on
            frame = f"kvtop frame failed: {exc!r}"
        event.setdefault("kvtop", []).append({"t": round(t, 3), "frame": frame})
        self.say(f"kvtop at {t:.1f} s of the phase:\n{frame}")

    def plot(self, peak: float | None, repeat: int) -> None:
        """The KV plot of ``(peak, repeat)`` once both modes of it ran."""
        assert self.samplers is not None
        done = {p["mode"]: p for p in self.phases if p.get("summary") and p["peak"] == peak
                and p["repeat"] == repeat}  # fmt: skip
        if not done:
            return
        samplers = self.samplers
        try:
            path = plot_phases(
                done, samplers.held, samplers.gauges,
                lambda mode: {s.inst.name: s.kv_bytes for s in self.servers if s.mode == mode},
                self.plan.kv_total, self.plan.workload, self.args.out.with_suffix(""),
            )  # fmt: skip
            if str(path) not in self.plots:
                self.plots.append(str(path))
            self.say(f"plot: {path}")
        except Exception as exc:  # no matplotlib: the JSON still has every sample
            self.say(f"plot failed: {exc!r}")

    # -- the whole run -------------------------------------------------------------------

    def run(self) -> None:
        plan = self.plan
        groups = start_groups(plan.modes, self.args.start)
        try:
            for group in groups:
                self.start(group)
                if "kvcached" in group:
                    self._hold_ballast()
                for repeat in range(plan.repeats):
                    for k, peak in enumerate(plan.peaks):
                        order = list(group)
                        if (repeat + k) % 2:  # alternate which mode goes first
                            order.reverse()
                        for mode in order:
                            self.phase(mode, peak, repeat)
                            time.sleep(self.args.gap_s)
                        self.plot(peak, repeat)
                if len(groups) > 1:
                    self._drop_ballast()
                    self._stop_servers([s for s in self.servers if s.mode in group])
        finally:
            self._drop_ballast()
            for p in self._children:
                if p.is_alive():
                    p.terminate()
            self._stop_servers(self.servers)
            if self.samplers is not None:
                self.samplers.close()
            if self.nvml is not None:
                self.nvml.phase = "stopped"
                time.sleep(1.0)
                self.nvml.close()
            for peak in plan.peaks:
                for repeat in range(plan.repeats):
                    self.plot(peak, repeat)
            self.logs = {s.label: s.log_tail() for s in self.servers}
            self.log_flags = {
                s.label: log_flags(s.log_path, self._stop_offsets.get(s.label))
                for s in self.servers
            }
            self.write_final()

    def _hold_ballast(self) -> None:
        """Make the GPU the kvcached instances' budget (``kvcached_mode``): hold what the
        device has free beyond the budget less what they have mapped since their start."""
        names = [s.inst.name for s in self.servers if s.mode == "kvcached"]
        sample = kvcached_mode.segment_sample(names, 0.0)
        if set(sample["instances"]) != set(names):
            raise RuntimeError(
                f"kvcached segments found for {sorted(sample['instances'])}, not for every "
                f"instance of {sorted(names)}: is kvcached on (KVCACHED_SITE, the start-up hook)?"
            )
        mapped = int(sample["total_mapped"])
        room = kvcached_mode.room_left(self.plan.kv_total, mapped)
        self._ballast = kvcached_mode.Ballast(room)
        report = self._ballast.start()
        self.ballast_report = {**report, "kvcached_mapped_at_start": mapped, "room": room}
        self.say(f"ballast holds {report['held'] / GiB:.2f} GiB: kvcached instances hold "
                 f"{mapped / GiB:.2f} GiB and may map {room / GiB:.2f} GiB more "
                 f"(device free {report['free_after'] / GiB:.2f} GiB)")  # fmt: skip

    def _drop_ballast(self) -> None:
        if self._ballast is not None:
            self._ballast.stop()
            self._ballast = None
            self.say("ballast released")

    def _stop_servers(self, servers: Sequence[Server]) -> None:
        live = [s for s in servers if s.proc.poll() is None]
        if live:
            for s in live:  # what the servers log while they stop is no finding of the run
                with contextlib.suppress(OSError):
                    self._stop_offsets.setdefault(s.label, s.log_path.stat().st_size)
            self.say("stopping " + ", ".join(s.label for s in live))
            stop_all(live)
            self.say("stopped")

    def write_final(self) -> None:
        self.write()
        for mode in SHARED_MODES:
            rows = compare(self.phases, mode)
            if rows:
                print(f"\n{mode} vs static (x: static / {mode}, ratio: {mode} / static)")
            for r in rows:
                peak = f" peak={r['peak']:g}" if r["peak"] is not None else ""
                print(f"  {r['workload']}{peak} r{r['repeat']} {r['instance']:>14}: "
                      f"TTFT p99 {r['ttft_p99_x']}x p50 {r['ttft_p50_x']}x, TPOT p50 "
                      f"{r['tpot_p50_ratio']}, output {r['output_ratio']}, goodput "
                      f"{r['goodput_ratio']}, SLO {r[f'slo_{mode}']} vs {r['slo_static']}, "
                      f"errors {r[f'errors_{mode}']} vs {r['errors_static']}, preemptions "
                      f"{r[f'preemptions_{mode}']} vs {r['preemptions_static']}")  # fmt: skip
        print(f"wrote {self.args.out}" + "".join(f"\nwrote {p}" for p in self.plots), flush=True)


def _line(phase: Mapping[str, Any], name: str) -> str:
    s = phase["summary"]["all"] if name == "all" else phase["summary"]["instances"][name]
    pre = phase["preemptions"]
    n_pre = sum(pre.values()) if name == "all" else pre.get(name, 0)

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    slo = s["slo_attainment"]
    return (f"{s['finished']}/{s['sent']} ok, {s['errors']} err, {s['unfinished']} unfinished; "
            f"TTFT p50/p99 {f(s['ttft_p50_ms'])}/{f(s['ttft_p99_ms'])} ms, TPOT p50/p99 "
            f"{f(s['tpot_p50_ms'])}/{f(s['tpot_p99_ms'])} ms; SLO "
            f"{'-' if slo is None else f'{slo:.1%}'}, goodput {s['goodput_rps']:.2f} req/s, "
            f"{s['output_tok_s']:.0f} tok/s; preemptions {n_pre:.0f}")  # fmt: skip


# ------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--out", type=Path, required=True, help="JSON written after every phase; PNGs beside it")
    a("--workload", choices=WORKLOADS, default="ramp", help="default: ramp")
    a("--models", nargs="+", default=None,
      help=f"2 or 3 offline model dirs or shape names (default: {' '.join(DEFAULT_MODELS)}; "
           "steady uses the first only)")  # fmt: skip
    a("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
      help="default: elastic static; kvcached (with --kvcached-site) runs after the "
           "others, its servers alone on the GPU")  # fmt: skip
    a("--start", choices=("together", "sequential"), default="together",
      help="start every mode's servers at once (default; kvcached's still after the "
           "others') or one mode after the other")  # fmt: skip
    a("--smoke", action="store_true",
      help="tiny run (~3 min): 2 small models, eager, 4 GiB KV, a 30 s trace")  # fmt: skip
    a("--seed", type=int, default=0)
    a("--repeats", type=int, default=1, help="rounds over every peak and mode")
    g = p.add_argument_group("memory")
    g.add_argument(
        "--kv-total-gib",
        type=float,
        default=12.0,
        help="KV total: the elastic GPU budget and the static split's sum (12)",
    )
    g.add_argument(
        "--static-shares",
        type=float,
        nargs="+",
        default=None,
        help="static split in proportion to these (default: even)",
    )
    g.add_argument(
        "--elastic-capacity-gib",
        type=float,
        default=None,
        help="each elastic instance's logical KV capacity (default: the KV total)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.1,
        help="only vLLM's start-up check of free memory (0.1)",
    )
    g.add_argument(
        "--kvcore-config",
        default=None,
        help="more --kvcore-config keys for elastic (JSON; gpu_ledger and "
        "ledger_dir are the benchmark's)",
    )
    g.add_argument(
        "--steer",
        nargs="*",
        default=[],
        metavar="T:INSTANCE:SIZE",
        help="set an elastic instance's ledger limit T s into each elastic phase "
        "(sizes as kvctl limit: 2G, 40%%, none)",
    )
    g = p.add_argument_group("servers")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--enforce-eager", action="store_true", help="no torch.compile/CUDA graphs")
    g.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep vLLM's prefix caching on (default off in both modes)",
    )
    g.add_argument("--serve-args", default="", help="more `vllm serve` arguments (one string)")
    g.add_argument(
        "--kvcached-site",
        type=Path,
        default=Path(os.environ.get("KVCACHED_SITE", "/tmp/kvdev030/site")),
        help="vLLM 0.30.0's site with kvcached built into it, for the kvcached mode "
        "(benchmarks/kvcached_device.sh install; default $KVCACHED_SITE or "
        "/tmp/kvdev030/site)",
    )
    g.add_argument("--port", type=int, default=8031, help="first server's port")
    g.add_argument("--start-timeout", type=float, default=300.0)
    g = p.add_argument_group("ramp")
    g.add_argument(
        "--peak",
        type=float,
        nargs="+",
        default=[12.0],
        help="peak req/s per model; several: a sweep (12)",
    )
    g.add_argument("--stagger-s", type=float, default=15.0)
    g.add_argument("--ramp-s", type=float, default=15.0, help="0 -> peak, and peak -> floor")
    g.add_argument("--hold-s", type=float, default=15.0)
    g.add_argument("--tail-s", type=float, default=10.0)
    g.add_argument("--floor", type=float, default=1.0, help="req/s after the ramp down")
    g.add_argument("--input-len", type=int, default=256, help="ramp and steady")
    g.add_argument("--output-len", type=int, default=256, help="ramp and steady")
    g = p.add_argument_group("bursty")
    g.add_argument("--duration-s", type=float, default=100.0)
    g.add_argument("--burst-rate", type=float, default=8.0, help="req/s per model while ON")
    g.add_argument("--gamma-shape", type=float, default=0.5)
    g.add_argument("--on-s", type=float, default=15.0, help="mean ON period")
    g.add_argument("--off-s", type=float, default=15.0, help="mean idle period")
    g.add_argument("--prompt-median", type=float, default=512.0)
    g.add_argument("--output-median", type=float, default=192.0)
    g.add_argument("--length-sigma", type=float, default=0.8)
    g = p.add_argument_group("steady")
    g.add_argument("--steady-requests", type=int, default=1000)
    g.add_argument("--steady-rate", type=float, default=0.0, help="req/s; 0: all at once")
    g = p.add_argument_group("measurement")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=50.0)
    g.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="wait this long after the trace for requests to finish (30; steady: 150)",
    )
    g.add_argument(
        "--read-timeout-s",
        type=float,
        default=300.0,
        help="a stream silent this long (queueing included) is an error (300)",
    )
    g.add_argument("--ledger-interval", type=float, default=0.25)
    g.add_argument("--progress-s", type=float, default=10.0)
    g.add_argument("--gap-s", type=float, default=3.0, help="idle seconds between phases")
    g.add_argument("--keep-itl", action="store_true", help="keep every ITL in the JSON")
    g.add_argument(
        "--time-limit-s",
        type=float,
        default=540.0,
        help=f"skip phases that would end later than this after the start, less "
        f"{STOP_MARGIN_S:g} s to stop (540); give the device call's timeout some seconds more",
    )
    return p


STEADY_DRAIN_S = 150.0
"""``--drain-s`` of the steady workload unless given: its requests arrive at once, so the
whole run is the drain."""

SMOKE = {
    "kv_total_gib": 4.0, "enforce_eager": True, "peak": [4.0], "stagger_s": 5.0,
    "ramp_s": 5.0, "hold_s": 5.0, "tail_s": 5.0, "duration_s": 30.0, "steady_requests": 100,
    "drain_s": 20.0, "time_limit_s": 240.0, "burst_rate": 4.0, "on_s": 6.0, "off_s": 6.0,
}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:  # smoke values where the option was left at its default
        for key, value in SMOKE.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        if args.models is None:
            args.models = list(SMOKE_MODELS)
    if args.models is None:
        args.models = list(DEFAULT_MODELS)
    if args.workload == "steady":
        args.models = args.models[:1]
        if args.drain_s == parser.get_default("drain_s"):  # everything arrives at once
            args.drain_s = STEADY_DRAIN_S
    elif len(args.models) < 2:
        parser.error("co-location needs at least 2 models (steady runs one)")
    elif args.workload == "handoff" and len(args.models) != 2:
        parser.error("handoff needs 2 models: the donor, then the receiver")
    for s in args.steer:
        try:
            parse_steer(s)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def _on_sigterm(*_: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up
    print("SIGTERM: stopping the servers", flush=True)
    sys.exit(143)


def log_flags(path: Path, upto: int | None = None) -> dict[str, int]:
    """How many lines of a server log name an out-of-memory, a kvcore error or a Python
    traceback (for the errors/OOM figure; the logs' tails are in the JSON), in the log's
    first ``upto`` bytes (None: all of it). ``Run`` passes the log's size when the
    benchmark began stopping the server, so the errors a server prints because it is being
    stopped (the API server's ``EngineDeadError`` once its engine core is gone) do not
    count; a server that died by itself is not stopped and has its whole log read."""
    pats = {"oom": ("out of memory", "OutOfDeviceMemory", "OutOfMemoryError"),
            "kvcore_error": ("KvcoreError", "ElasticMiss", "PoolFailed", "LedgerError"),
            "traceback": ("Traceback (most recent call last)",)}  # fmt: skip
    got = dict.fromkeys(pats, 0)
    data = b""
    with contextlib.suppress(OSError), path.open("rb") as f:
        data = f.read() if upto is None else f.read(max(0, upto))
    for line in data.decode(errors="replace").splitlines():
        for key, needles in pats.items():
            if any(n in line for n in needles):
                got[key] += 1
    return got


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # `timeout` and the device tool stop a run with SIGTERM: unwind, so the servers stop
    signal.signal(signal.SIGTERM, _on_sigterm)
    with tempfile.TemporaryDirectory(prefix="kvcore-colocate-") as tmp:
        Run(args, Path(tmp)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
