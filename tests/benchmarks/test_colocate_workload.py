"""The co-location demo's workload (``benchmarks/colocate.py``): seeded, bursty, staggered,
realistic lengths; traces round-trip. The demo's run itself needs vLLM:
``test_colocate_run.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.colocate import (
    MAX_OUTPUT,
    MAX_PROMPT,
    Arrival,
    WorkloadSpec,
    bursty_workload,
    read_trace,
    write_trace,
)


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    spec = WorkloadSpec(seed=3)
    assert bursty_workload(spec) == bursty_workload(WorkloadSpec(seed=3))
    assert bursty_workload(spec) != bursty_workload(WorkloadSpec(seed=4))


def test_bursts_are_staggered_per_instance() -> None:
    spec = WorkloadSpec(seed=0, instances=2, steps=3000, bursts=3, trickle_per_step=0.0)
    arrivals = bursty_workload(spec)
    period = int(spec.steps * 0.7) / spec.bursts
    for inst in range(2):
        steps = np.array([a.step for a in arrivals if a.instance == inst])
        # every arrival lies in one of this instance's bursts, offset by inst/instances
        phase = (steps - inst * period / 2) % period
        assert np.all(phase <= spec.burst_spread + 1), inst
        # each burst holds about burst_size requests
        assert len(steps) == pytest.approx(spec.bursts * spec.burst_size, rel=0.2)
    first = [min(a.step for a in arrivals if a.instance == i) for i in range(2)]
    assert first[1] - first[0] == pytest.approx(period / 2, abs=spec.burst_spread)


def test_lengths_follow_their_distributions_within_bounds() -> None:
    spec = WorkloadSpec(seed=1, bursts=10, burst_size=200.0, prompt_median=700.0, output_mean=220.0)
    arrivals = bursty_workload(spec)
    prompts = np.array([a.prompt_tokens for a in arrivals])
    outputs = np.array([a.output_tokens for a in arrivals])
    assert prompts.min() >= 16 and prompts.max() <= MAX_PROMPT
    assert outputs.min() >= 1 and outputs.max() <= MAX_OUTPUT
    assert np.median(prompts) == pytest.approx(700, rel=0.15)  # lognormal median
    assert np.mean(outputs) == pytest.approx(220, rel=0.15)  # geometric mean
    assert np.mean(prompts) > np.median(prompts) * 1.2  # right-skewed, as real prompts


def test_trace_round_trips_and_sorts(tmp_path: Path) -> None:
    arrivals = [Arrival(5, 1, 300, 20), Arrival(0, 0, 100, 10)]
    path = tmp_path / "t.jsonl"
    write_trace(arrivals, path)
    assert read_trace(path) == sorted(arrivals, key=lambda a: (a.step, a.instance))


@pytest.mark.parametrize(
    "line",
    [
        '{"step": 0, "instance": 0, "prompt_tokens": 10}',
        '{"step": -1, "instance": 0, "prompt_tokens": 10, "output_tokens": 1}',
        f'{{"step": 0, "instance": 0, "prompt_tokens": {MAX_PROMPT + 1}, "output_tokens": 1}}',
        "not json",
    ],
)
def test_malformed_trace_names_its_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0, "instance": 0, "prompt_tokens": 10, "output_tokens": 1}\n' + line)
    with pytest.raises(ValueError, match=r"t\.jsonl:2"):
        read_trace(path)
