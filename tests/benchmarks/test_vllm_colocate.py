"""The GPU co-location benchmark's pure parts (``benchmarks/vllm_colocate.py``), on CPU:
seeded traces have the promised shapes, rates and lengths; the figures are right on
hand-made request records; ledger samples are read from a real per-GPU ledger; the KV plot
is written; a server log's flags count only what it printed before its stop. The benchmark
itself needs vLLM and a GPU (``docs/colocation-gpu.md``)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks.vllm_colocate import (
    PHASE_MARGIN_S,
    SERVER_START_FLOOR_S,
    STOP_MARGIN_S,
    BurstySpec,
    GiB,
    HandoffSpec,
    MiB,
    RampSpec,
    Run,
    Slo,
    SteadySpec,
    build_plan,
    bursty_trace,
    compare,
    handoff_summary,
    handoff_trace,
    kv_panel,
    kvtop_frame,
    least_time_limit,
    ledger_sample,
    log_flags,
    meets,
    parse_args,
    parse_steer,
    percentile,
    phase_summary,
    plot_kv,
    prompt_ids,
    ramp_rate,
    ramp_trace,
    split_bytes,
    steady_trace,
    summarize,
    tpot,
)
from benchmarks.vllm_servers import MemorySampler, machine_summary, parse_metrics
from kvcore.budget import GpuLedger, LedgerGate

ROOT = Path(__file__).resolve().parents[2]


def _within_poisson(count: int, mean: float, sigmas: float = 4.0) -> bool:
    return abs(count - mean) <= sigmas * math.sqrt(max(mean, 1.0))


# -- the staggered ramp ---------------------------------------------------------------------


def test_ramp_rate_climbs_holds_falls_to_the_floor_staggered() -> None:
    spec = RampSpec(3, peak=10.0, stagger_s=20, ramp_s=10, hold_s=5, tail_s=5, floor=1.0)
    assert spec.duration == 2 * 20 + 2 * 10 + 5 + 5
    assert ramp_rate(spec, 0, 0.0) == 0.0
    assert ramp_rate(spec, 0, 5.0) == pytest.approx(5.0)
    assert ramp_rate(spec, 0, 12.0) == 10.0  # holding
    assert ramp_rate(spec, 0, 20.0) == pytest.approx(10.0 + (1.0 - 10.0) * 5 / 10)
    assert ramp_rate(spec, 0, 40.0) == 1.0  # the floor, for good
    assert ramp_rate(spec, 1, 19.9) == 0.0  # instance 1 starts 20 s later
    assert ramp_rate(spec, 2, 45.0) == pytest.approx(5.0)


def test_ramp_trace_is_seeded_sorted_and_has_fixed_lengths() -> None:
    spec = RampSpec(3, peak=12.0, seed=5)
    trace = ramp_trace(spec)
    assert trace == ramp_trace(RampSpec(3, peak=12.0, seed=5))
    assert trace != ramp_trace(RampSpec(3, peak=12.0, seed=6))
    assert [r.t for r in trace] == sorted(r.t for r in trace)
    assert {(r.prompt_tokens, r.output_tokens) for r in trace} == {(256, 256)}
    for inst in range(3):
        mine = [r for r in trace if r.instance == inst]
        assert [r.index for r in mine] == list(range(len(mine)))
        assert min(r.t for r in mine) >= inst * spec.stagger_s
        assert max(r.t for r in mine) < spec.duration


def test_ramp_arrivals_follow_the_rate_profile() -> None:
    spec = RampSpec(3, peak=20.0, seed=1, stagger_s=20, ramp_s=20, hold_s=30, tail_s=20)
    trace = ramp_trace(spec)
    grid = np.linspace(0.0, spec.duration, 20001)
    for inst in range(3):
        times = np.array([r.t for r in trace if r.instance == inst])
        expected = np.trapezoid([ramp_rate(spec, inst, t) for t in grid], grid)
        assert _within_poisson(len(times), expected), (inst, len(times), expected)
        hold_start = inst * spec.stagger_s + spec.ramp_s
        held = np.sum((times >= hold_start) & (times < hold_start + spec.hold_s))
        assert _within_poisson(int(held), spec.peak * spec.hold_s)
        tail_start = inst * spec.stagger_s + 2 * spec.ramp_s + spec.hold_s
        tail = np.sum(times >= tail_start)
        assert _within_poisson(int(tail), spec.floor * (spec.duration - tail_start))


def test_a_higher_peak_sends_more_in_the_same_time() -> None:
    low, high = ramp_trace(RampSpec(2, peak=4.0)), ramp_trace(RampSpec(2, peak=16.0))
    assert len(high) > 2.5 * len(low)
    assert RampSpec(2, peak=4.0).duration == RampSpec(2, peak=16.0).duration


# -- the bursty trace ------------------------------------------------------------------------


def test_bursty_trace_is_seeded_and_has_idle_periods() -> None:
    spec = BurstySpec(2, seed=3, duration=300.0, on_s=10.0, off_s=20.0, burst_rate=10.0)
    trace = bursty_trace(spec)
    assert trace == bursty_trace(BurstySpec(2, seed=3, duration=300.0, on_s=10.0, off_s=20.0,
                                            burst_rate=10.0))  # fmt: skip
    assert trace != bursty_trace(BurstySpec(2, seed=4, duration=300.0, on_s=10.0, off_s=20.0,
                                            burst_rate=10.0))  # fmt: skip
    for inst in range(2):
        times = np.array([r.t for r in trace if r.instance == inst])
        assert times.min() >= 0 and times.max() < spec.duration
        gaps = np.diff(times)
        # idle periods: OFF periods average 20 s, so some gaps last many ON-rate gaps
        assert gaps.max() > 5.0
        # burstier than Poisson: gamma shape 0.5 and ON/OFF modulation, CV well above 1
        assert gaps.std() / gaps.mean() > 1.3


def test_bursty_rate_is_the_burst_rate_while_on() -> None:
    # over a long trace each instance is ON on / (on + off) of the time, at burst_rate
    spec = BurstySpec(2, seed=0, duration=3000.0, on_s=10.0, off_s=20.0, burst_rate=10.0)
    trace = bursty_trace(spec)
    expected = spec.burst_rate * spec.duration * spec.on_s / (spec.on_s + spec.off_s)
    for inst in range(2):
        n = sum(1 for r in trace if r.instance == inst)
        assert 0.8 * expected < n < 1.2 * expected, (inst, n, expected)


def test_bursty_lengths_are_lognormal_within_bounds() -> None:
    spec = BurstySpec(3, seed=0, duration=600.0, prompt_median=500.0, output_median=150.0,
                      sigma=0.8, max_prompt=2048, max_output=1024)  # fmt: skip
    trace = bursty_trace(spec)
    prompts = np.array([r.prompt_tokens for r in trace])
    outputs = np.array([r.output_tokens for r in trace])
    assert len(trace) > 2000
    assert prompts.min() >= 16 and prompts.max() <= 2048
    assert outputs.min() >= 1 and outputs.max() <= 1024
    assert np.median(prompts) == pytest.approx(500.0, rel=0.1)
    assert np.median(outputs) == pytest.approx(150.0, rel=0.1)
    # log-lengths spread with sigma (clipping trims only the far tails)
    assert np.std(np.log(prompts)) == pytest.approx(0.8, rel=0.1)


def test_bursty_instances_have_their_own_arrival_processes() -> None:
    trace = bursty_trace(BurstySpec(2, seed=0, duration=200.0))
    a = [round(r.t, 6) for r in trace if r.instance == 0]
    b = [round(r.t, 6) for r in trace if r.instance == 1]
    assert a and b and set(a).isdisjoint(b)


# -- the steady load --------------------------------------------------------------------------


def test_steady_at_rate_zero_sends_everything_at_once() -> None:
    trace = steady_trace(SteadySpec(requests=50, rate=0.0))
    assert len(trace) == 50 and {r.t for r in trace} == {0.0}
    assert {r.instance for r in trace} == {0} and [r.index for r in trace] == list(range(50))


def test_steady_at_a_rate_is_poisson_at_that_rate() -> None:
    spec = SteadySpec(requests=4000, rate=20.0, seed=2)
    trace = steady_trace(spec)
    gaps = np.diff([0.0, *(r.t for r in trace)])
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential
    assert spec.duration == pytest.approx(200.0)


# -- prompts and the static split ----------------------------------------------------------------


def test_prompt_ids_are_seeded_unique_and_avoid_special_and_byte_tokens() -> None:
    ids = prompt_ids(0, 1, 7, 256, 1000)
    assert ids == prompt_ids(0, 1, 7, 256, 1000)
    assert len(ids) == 256 and all(256 <= i < 998 for i in ids)
    assert ids != prompt_ids(0, 1, 8, 256, 1000)
    assert ids != prompt_ids(0, 2, 7, 256, 1000)
    assert ids != prompt_ids(1, 1, 7, 256, 1000)


def test_split_bytes_is_proportional_in_whole_mib() -> None:
    assert split_bytes(12 * GiB, [1, 1, 1]) == [4 * GiB] * 3
    parts = split_bytes(10 * GiB, [3, 2])
    assert parts == [6 * GiB, 4 * GiB]
    odd = split_bytes(10 * GiB + 5, [1, 1, 1])
    assert all(p % MiB == 0 for p in odd) and sum(odd) <= 10 * GiB + 5
    with pytest.raises(ValueError):
        split_bytes(GiB, [])
    with pytest.raises(ValueError):
        split_bytes(GiB, [1, 0])


# -- the figures ------------------------------------------------------------------------------


def _rec(inst: str, t_sent: float, ttft: float | None, latency: float | None, n: int,
         ok: bool = True, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"instance": inst, "t_sent": t_sent, "ttft": ttft, "latency": latency,
            "output_tokens": n, "ok": ok, "error": None, "unfinished": False, **extra}  # fmt: skip


def test_tpot_and_slo_of_one_request() -> None:
    r = _rec("a", 0.0, 0.5, 0.5 + 99 * 0.02, 100)
    assert tpot(r) == pytest.approx(0.02)
    assert meets(r, Slo(1.0, 0.05))
    assert not meets(r, Slo(0.4, 0.05))  # TTFT too long
    assert not meets(r, Slo(1.0, 0.01))  # TPOT too long
    assert tpot(_rec("a", 0.0, 0.1, 0.1, 1)) is None
    assert meets(_rec("a", 0.0, 0.1, 0.1, 1), Slo())  # no TPOT to miss
    assert not meets(_rec("a", 0.0, 0.1, 0.2, 10, ok=False), Slo())


def test_summarize_hand_made_records() -> None:
    records = [
        _rec("a", 0.0, 0.1, 0.1 + 9 * 0.01, 10, itl=[0.01] * 9),  # meets
        _rec("a", 1.0, 0.3, 0.3 + 9 * 0.03, 10, itl=[0.03] * 9),  # meets
        _rec("a", 2.0, 2.0, 2.0 + 9 * 0.01, 10, itl=[0.01] * 9),  # TTFT miss
        _rec("a", 3.0, 0.2, 0.2 + 9 * 0.10, 10, itl=[0.10] * 9),  # TPOT miss
        _rec("a", 4.0, None, None, 0, ok=False, error="HTTP 500: boom"),
        _rec("a", 5.0, 0.4, None, 3, ok=False, unfinished=True),
    ]
    s = summarize(records, duration_s=10.0, slo=Slo(1.0, 0.05))
    assert (s["sent"], s["finished"], s["errors"], s["unfinished"]) == (6, 4, 1, 1)
    assert s["slo_met"] == 2 and s["slo_attainment"] == pytest.approx(2 / 6, abs=1e-4)
    assert s["goodput_rps"] == pytest.approx(0.2) and s["request_rps"] == pytest.approx(0.4)
    assert s["output_tok_s"] == pytest.approx(4.0)  # 40 tokens of finished requests / 10 s
    ttfts = [0.1, 0.3, 2.0, 0.2]
    assert s["ttft_p50_ms"] == pytest.approx(np.percentile(ttfts, 50) * 1000)
    assert s["ttft_p99_ms"] == pytest.approx(np.percentile(ttfts, 99) * 1000)
    assert s["tpot_p50_ms"] == pytest.approx(np.percentile([10, 30, 10, 100], 50))
    assert s["tpot_p99_ms"] == pytest.approx(np.percentile([10, 30, 10, 100], 99))
    itls = [0.01] * 18 + [0.03] * 9 + [0.10] * 9
    assert s["itl_p50_ms"] == pytest.approx(np.percentile(itls, 50) * 1000)
    assert s["itl_p99_ms"] == pytest.approx(100.0)
    assert s["error_samples"] == ["HTTP 500: boom"]


def test_summarize_nothing_finished_has_no_percentiles() -> None:
    s = summarize([], 5.0, Slo())
    assert s["sent"] == 0 and s["ttft_p99_ms"] is None and s["slo_attainment"] is None
    assert percentile([], 50) is None


def test_phase_summary_splits_instances_over_one_duration() -> None:
    records = [_rec("a", 0.0, 0.1, 1.0, 10), _rec("b", 5.0, 0.2, 7.0, 10)]
    ph = phase_summary(records, ["a", "b"], trace_s=6.0, slo=Slo())
    assert ph["all"]["duration_s"] == pytest.approx(12.0)  # b ends at 5 + 7
    assert ph["instances"]["a"]["duration_s"] == pytest.approx(12.0)
    assert ph["instances"]["a"]["sent"] == 1 and ph["instances"]["b"]["sent"] == 1
    assert ph["all"]["finished"] == 2
    # a phase whose requests all ended early still lasts the trace
    assert phase_summary(records[:1], ["a"], 6.0, Slo())["all"]["duration_s"] == 6.0


def test_compare_reports_elastic_against_static() -> None:
    def phase(mode: str, ttft: float, tok: float) -> dict[str, Any]:
        records = [_rec("a", float(i), ttft, ttft + 9 * 0.01, 10) for i in range(4)]
        ph = phase_summary(records, ["a"], 4.0, Slo())
        ph["all"]["output_tok_s"] = ph["instances"]["a"]["output_tok_s"] = tok
        return {"mode": mode, "workload": "ramp", "peak": 8.0, "repeat": 0, "summary": ph,
                "preemptions": {"a": 3.0 if mode == "static" else 0.0}}  # fmt: skip

    skipped = {"mode": "static", "workload": "ramp", "peak": 16.0, "repeat": 0, "skipped": "x"}
    rows = compare([phase("elastic", 0.1, 990.0), phase("static", 2.0, 1000.0), skipped])
    assert [r["instance"] for r in rows] == ["a", "all"]
    row = rows[1]
    assert row["ttft_p99_x"] == pytest.approx(20.0) and row["ttft_p50_x"] == pytest.approx(20.0)
    assert row["output_ratio"] == pytest.approx(0.99)
    assert row["slo_elastic"] == 1.0 and row["slo_static"] == 0.0
    assert (row["preemptions_elastic"], row["preemptions_static"]) == (0.0, 3.0)
    assert compare([phase("elastic", 0.1, 1.0)]) == []  # no static to compare with
    # kvcached against the same static phase: its own keys, elastic's phase left out
    kvc = compare([phase("elastic", 0.1, 990.0), phase("kvcached", 0.5, 1000.0),
                   phase("static", 2.0, 1000.0)], "kvcached")  # fmt: skip
    assert [(r["mode"], r["instance"]) for r in kvc] == [("kvcached", "a"), ("kvcached", "all")]
    assert kvc[1]["ttft_p99_x"] == pytest.approx(4.0) and kvc[1]["slo_kvcached"] == 1.0
    assert "slo_elastic" not in kvc[1] and kvc[1]["preemptions_kvcached"] == 0.0


# -- samples ---------------------------------------------------------------------------------


def test_ledger_sample_from_a_real_ledger(tmp_path: Path) -> None:
    ledger = GpuLedger.open("GPU-colocate-test", device_total=8 * GiB, directory=tmp_path)
    try:
        ledger.set_budget(2 * GiB)
        a = LedgerGate(ledger, name="vllm-1-a", engine="vllm")
        b = LedgerGate(ledger, name="vllm-2-b", engine="vllm")
        stray = LedgerGate(ledger, name="someone-else", engine="sglang")
        assert a.try_acquire(512 * MiB) and b.try_acquire(256 * MiB)
        assert stray.try_acquire(64 * MiB)
        a.report_reserve(128 * MiB)
        ledger.set_limit("vllm-2-b", 1 * GiB)
        assert not b.try_acquire(1 * GiB)  # over its limit: refused, counted
        owners = {"vllm-1-a": "llama", "vllm-2-b": "qwen"}
        sample = ledger_sample(ledger.snapshot(), lambda rec: owners.get(rec.name), t=1.5)
        assert sample["t"] == 1.5 and sample["budget"] == 2 * GiB
        assert sample["total_mapped"] == (512 + 256 + 64) * MiB
        llama, qwen = sample["instances"]["llama"], sample["instances"]["qwen"]
        assert (llama["mapped"], llama["in_use"], llama["limit"]) == (512 * MiB, 384 * MiB, 0)
        assert (qwen["mapped"], qwen["limit"], qwen["denied"]) == (256 * MiB, GiB, 1)
        assert llama["record"] == "vllm-1-a"
        assert sample["other"] == {"someone-else": 64 * MiB}
        # an equal share of the 2 GiB budget among 3 instances; nobody waits
        assert (llama["share"], llama["waiting"], llama["yielding"]) == (2 * GiB // 3, False, False)
        frame = kvtop_frame(ledger.snapshot())
        assert "vllm-1-a" in frame and "512.0 MiB" in frame and "budget 2.0 GiB" in frame
        assert "vllm-2-b" in frame and "25%" in frame  # 256 MiB of its 1 GiB limit
        for gate in (a, b, stray):
            gate.close()
        assert ledger_sample(ledger.snapshot(), lambda rec: None, 2.0)["instances"] == {}
    finally:
        ledger.close()


def test_parse_metrics_sums_labels_and_skips_comments() -> None:
    text = (
        "# HELP vllm:num_preemptions_total Cumulative preemptions\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
        'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        "vllm:num_requests_running 7\n"
        "garbage line\n"
    )
    got = parse_metrics(text, ["vllm:num_preemptions_total", "vllm:kv_cache_usage_perc",
                               "vllm:num_requests_running", "vllm:absent"])  # fmt: skip
    assert got == {"vllm:num_preemptions_total": 5.0, "vllm:kv_cache_usage_perc": 0.25,
                   "vllm:num_requests_running": 7.0}  # fmt: skip


def test_parse_metrics_keeps_a_named_label_apart() -> None:
    """``metric{label}``: one key per value of ``label``, summed over the other labels (a
    sample without the label counts under an empty value)."""
    text = (
        'sglang:cuda_graph_passes_total{model_name="m",mode="decode_cuda_graph"} 40.0\n'
        'sglang:cuda_graph_passes_total{model_name="n",mode="decode_cuda_graph"} 2.0\n'
        'sglang:cuda_graph_passes_total{mode="prefill_none",model_name="m"} 7.0\n'
        'sglang:cuda_graph_passes_total{model_name="m"} 1.0\n'
        'sglang:other_mode_total{mode="x"} 9.0\n'
    )
    got = parse_metrics(text, ["sglang:cuda_graph_passes_total{mode}", "sglang:other_mode_total"])
    assert got == {
        'sglang:cuda_graph_passes_total{mode="decode_cuda_graph"}': 42.0,
        'sglang:cuda_graph_passes_total{mode="prefill_none"}': 7.0,
        'sglang:cuda_graph_passes_total{mode=""}': 1.0,
        "sglang:other_mode_total": 9.0,
    }


_RUN_LOG = (
    "INFO  Started server process — ready\n"
    "Traceback (most recent call last):\n"
    '  File "worker.py", line 1, in step\n'
    "torch.OutOfMemoryError: CUDA out of memory\n"
)
_STOP_LOG = (
    "ERROR AsyncLLM output_handler failed.\n"
    "Traceback (most recent call last):\n"
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
)


def test_log_flags_counts_only_the_lines_before_upto(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    log.write_bytes((_RUN_LOG + _STOP_LOG).encode())
    stop = len(_RUN_LOG.encode())  # bytes, not characters: the log has a non-ASCII one
    assert log_flags(log) == {"oom": 1, "kvcore_error": 0, "traceback": 2}  # the whole log
    assert log_flags(log, stop) == {"oom": 1, "kvcore_error": 0, "traceback": 1}
    assert log_flags(log, 0) == {"oom": 0, "kvcore_error": 0, "traceback": 0}
    assert log_flags(tmp_path / "absent.log") == {"oom": 0, "kvcore_error": 0, "traceback": 0}


def test_stopping_records_live_servers_log_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def server(label: str, alive: bool) -> SimpleNamespace:
        log = tmp_path / f"{label}.log"
        log.write_bytes(_RUN_LOG.encode())
        proc = SimpleNamespace(poll=lambda: None if alive else 1)
        return SimpleNamespace(label=label, log_path=log, proc=proc)

    servers = [server("live", True), server("died", False)]

    def stop_all(live: list[SimpleNamespace]) -> None:  # the shutdown noise of a real stop
        for s in live:
            with s.log_path.open("ab") as f:
                f.write(_STOP_LOG.encode())

    monkeypatch.setattr("benchmarks.vllm_colocate.stop_all", stop_all)
    run = SimpleNamespace(_stop_offsets={}, say=lambda text: None)
    Run._stop_servers(run, servers)  # type: ignore[arg-type]
    assert run._stop_offsets == {"live": len(_RUN_LOG.encode())}  # a dead one is read whole
    got = log_flags(servers[0].log_path, run._stop_offsets.get("live"))
    assert got["traceback"] == 1 and log_flags(servers[0].log_path)["traceback"] == 2


def test_a_steering_event_keeps_kvtop_frames(tmp_path: Path) -> None:
    ledger = GpuLedger.open("GPU-colocate-test", device_total=8 * GiB, directory=tmp_path)
    gate = LedgerGate(ledger, name="vllm-1-a", engine="vllm")
    said: list[str] = []
    try:
        assert gate.try_acquire(GiB)
        run = SimpleNamespace(samplers=SimpleNamespace(open_ledger=lambda: ledger), say=said.append)
        event: dict[str, Any] = {"t": 20.0, "instance": "llama", "size": "512M"}
        Run._keep_kvtop(run, event, 20.2)  # type: ignore[arg-type]
        Run._keep_kvtop(run, event, 23.2)  # type: ignore[arg-type]
        assert [f["t"] for f in event["kvtop"]] == [20.2, 23.2]
        assert "vllm-1-a" in event["kvtop"][0]["frame"] and "1.0 GiB" in event["kvtop"][0]["frame"]
        assert len(said) == 2 and said[0].startswith("kvtop at 20.2 s of the phase:")
    finally:
        gate.close()
        ledger.close()


def _samples() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ledger = [
        {"t": 9.0, "instances": {"a": {"mapped": 1 * GiB}}},  # before the phase
        {"t": 10.0, "instances": {"a": {"mapped": 1 * GiB}, "b": {"mapped": 0}}},
        {"t": 11.0, "instances": {"a": {"mapped": 3 * GiB}, "b": {"mapped": GiB}}},
        {"t": 12.0, "instances": {"b": {"mapped": 2 * GiB}}},
        {"t": 30.0, "instances": {"a": {"mapped": 0}}},  # after
    ]
    gauges = [
        {"t": 10.5, "mode": "elastic", "instance": "a", "vllm:kv_cache_usage_perc": 0.5},
        {"t": 10.5, "mode": "static", "instance": "a", "vllm:kv_cache_usage_perc": 0.25},
        {"t": 11.5, "mode": "static", "instance": "b", "vllm:kv_cache_usage_perc": 1.0},
    ]
    return ledger, gauges


def test_kv_panel_elastic_from_the_ledger_static_fixed() -> None:
    ledger, gauges = _samples()
    el = kv_panel("elastic", (10.0, 20.0), ["a", "b"], ledger, gauges, {"a": 8 * GiB, "b": 8 * GiB})
    assert el["a"]["held"] == [(0.0, float(GiB)), (1.0, float(3 * GiB))]
    assert el["b"]["held"] == [(0.0, 0.0), (1.0, float(GiB)), (2.0, float(2 * GiB))]
    assert el["a"]["in_use"] == [(0.5, float(4 * GiB))]
    st = kv_panel("static", (10.0, 20.0), ["a", "b"], ledger, gauges, {"a": 4 * GiB, "b": 2 * GiB})
    assert st["a"]["held"] == [(0.0, float(4 * GiB)), (10.0, float(4 * GiB))]
    assert st["a"]["in_use"] == [(0.5, float(GiB))]
    assert st["b"]["in_use"] == [(1.5, float(2 * GiB))]


def test_plot_kv_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ledger, gauges = _samples()
    panels = {
        "elastic": kv_panel("elastic", (10.0, 20.0), ["a", "b"], ledger, gauges,
                            {"a": 8 * GiB, "b": 8 * GiB}),
        "static": kv_panel("static", (10.0, 20.0), ["a", "b"], ledger, gauges,
                           {"a": 4 * GiB, "b": 4 * GiB}),
    }  # fmt: skip
    marks = {"elastic": [(1.0, "limit a 1G")]}
    out = plot_kv(panels, 8 * GiB, tmp_path / "sub" / "kv.png", "test", marks)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


# -- the command line --------------------------------------------------------------------------


def test_parse_steer() -> None:
    assert parse_steer("30:llama-3-8b:4G") == (30.0, "llama-3-8b", "4G")
    assert parse_steer("0.5:a:none") == (0.5, "a", "none")
    for bad in ("30:a", "x:a:4G", "-1:a:4G", "30::4G", "30:a:"):
        with pytest.raises(ValueError):
            parse_steer(bad)


def test_smoke_defaults_yield_to_explicit_options() -> None:
    args = parse_args(["--out", "x.json", "--smoke"])
    assert args.enforce_eager and args.kv_total_gib == 4.0 and args.peak == [4.0]
    assert len(args.models) == 2 and args.time_limit_s == 240.0
    args = parse_args(["--out", "x.json", "--smoke", "--kv-total-gib", "6", "--peak", "2", "3"])
    assert args.kv_total_gib == 6.0 and args.peak == [2.0, 3.0]
    args = parse_args(["--out", "x.json"])
    assert args.models == ["llama-3-8b", "llama-3.2-3b", "qwen3-0.6b"] and not args.enforce_eager
    steady = parse_args(["--out", "x.json", "--workload", "steady"])
    assert steady.models == ["llama-3-8b"] and steady.drain_s == 150.0  # the run is the drain
    assert parse_args(["--out", "x", "--workload", "steady", "--drain-s", "40"]).drain_s == 40
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--models", "qwen3-0.6b"])  # nothing to co-locate
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--steer", "soon:a:1G"])


def test_help_needs_neither_vllm_nor_aiohttp() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['vllm_colocate.py', '--help']\n"
        "try:\n"
        "    runpy.run_module('benchmarks.vllm_colocate', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('LOADED', sorted(m for m in ('vllm', 'aiohttp', 'matplotlib', 'pynvml')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--workload {ramp,bursty,steady,handoff}" in out.stdout
    assert "LOADED []" in out.stdout


def test_a_time_limit_too_short_for_any_phase_is_refused_before_servers_start(
    tmp_path: Path,
) -> None:
    args = parse_args(["--out", "x.json", "--models", "llama-3-8b", "qwen3-0.6b", "--peak", "8"])
    plan = build_plan(args, 2)
    least = least_time_limit(plan)
    trace_s = plan.traces[8.0][1]
    assert least == SERVER_START_FLOOR_S + trace_s + PHASE_MARGIN_S + STOP_MARGIN_S
    args.time_limit_s = least - 1
    with pytest.raises(SystemExit, match=r"--time-limit-s .* at least"):
        Run(args, tmp_path)
    assert list(tmp_path.iterdir()) == []  # no ledger, no model dir, no server


def test_handoff_trace_sends_the_donor_burst_then_the_receiver() -> None:
    spec = HandoffSpec()
    trace = handoff_trace(spec)
    donor = [r for r in trace if r.instance == 0]
    receiver = [r for r in trace if r.instance == 1]
    assert len(donor) == spec.donor_requests and {r.t for r in donor} == {0.0}
    assert {r.t for r in receiver} == {spec.receiver_start_s}
    # prompt and output end inside the block the prefill took: no growth while decoding
    block = 16
    assert -(-(spec.donor_prompt + spec.donor_output) // block) == -(-spec.donor_prompt // block)


def _sample(t: float, donor: int, receiver: int, budget: int = 21 * GiB) -> dict[str, Any]:
    return {
        "t": t,
        "budget": budget,
        "total_mapped": donor + receiver,
        "instances": {"a": {"mapped": donor}, "b": {"mapped": receiver}},
    }


def test_handoff_summary_times_release_and_take_over_from_the_last_end() -> None:
    records = [
        {"instance": "a", "ok": True, "t_sent": 0.0, "latency": lat} for lat in (2.99, 3.0)
    ] + [{"instance": "b", "ok": True, "t_sent": 0.5, "latency": 9.0}]
    t_start = 10.0  # the donor's last end: 13.0 on the samples' clock
    samples = [
        _sample(12.99, 10 * GiB, 11 * GiB),
        _sample(13.02, 10 * GiB, 11 * GiB),
        _sample(13.03, 9 * GiB, 11 * GiB),
        _sample(13.05, 1 * GiB, 11 * GiB),
        _sample(13.06, MiB, 11 * GiB + 64 * MiB),
        _sample(13.2, MiB, 20 * GiB),
    ]
    got = handoff_summary(records, samples, t_start, "a", "b")
    assert got["donor_finished"] == 2 and got["end_spread_ms"] == 10.0
    assert got["donor_held_at_end"] == 10 * GiB and got["freed"] == 10 * GiB - MiB
    assert got["gave_first_ms"] == 30.0
    assert got["released_ms"] == 50.0  # 1 GiB is within 10 % of the freed bytes
    assert got["first_map_ms"] == 60.0
    assert got["took_90_ms"] == 200.0
    assert got["budget_free_at_end"] == 0


def test_handoff_summary_without_samples_after_the_end_says_nothing() -> None:
    records = [{"instance": "a", "ok": True, "t_sent": 0.0, "latency": 3.0}]
    got = handoff_summary(records, [_sample(12.0, GiB, GiB)], 10.0, "a", "b")
    assert got == {"donor": "a", "receiver": "b", "donor_finished": 1}


def test_machine_summary_takes_the_phase_window_only() -> None:
    series = [
        {"t": 0.5, "used": 1, "load1": 40.0, "sm_mhz": 900.0},  # before the phase
        {"t": 1.0, "used": 1, "load1": 2.0, "gpu_util": 50.0, "sm_mhz": 1980.0},
        {"t": 1.5, "used": 1, "load1": 4.0, "gpu_util": 90.0, "sm_mhz": 1980.0},
        {"t": 2.0, "used": 1, "load1": 3.0, "sm_mhz": 1700.0},  # NVML had no utilization
    ]
    got = machine_summary(series, 1.0, 2.0)
    assert got == {
        "load1": {"median": 3.0, "max": 4.0},
        "gpu_util": {"median": 70.0, "max": 90.0},
        "sm_mhz": {"median": 1980.0, "max": 1980.0},
    }
    assert machine_summary(series, 5.0, 6.0) == {}


def test_memory_sampler_samples_the_machine_without_every_nvml_query(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A binding without the SM clock (no ``NVML_CLOCK_SM``) and a driver refusing the
    utilization leave those out; the memory samples go on."""
    import types

    class NVMLError(Exception):
        pass

    def refuse(_handle: object) -> None:
        raise NVMLError("not supported")

    nvml = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: 0,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=123),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [],
        nvmlDeviceGetUtilizationRates=refuse,
        nvmlDeviceGetClockInfo=lambda h, clock: 1980,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = MemorySampler({}, interval=0.01)
    try:
        deadline = time.monotonic() + 30
        while len(sampler.series) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        series = sampler.close()
    assert len(series) >= 2
    assert {k for k in series[-1] if k not in ("t", "phase")} == {"used", "load1"}
    assert series[-1]["used"] == 123
