"""The forked vLLM serving on a GPU with elastic KV: start-up, token identity, memory.

Each engine runs in its own process (``gpu_generate.py``) over the offline model directory
of ``benchmarks/offline_model.py`` (``KVCORE_MODEL_DIR``; dummy weights, seeded, so every
launch has the same weights). Greedy tokens with elastic KV on must equal upstream's, token
for token, both on vLLM's default KV cache layout (LBNHC, which kvcore backs with a range per
layer), and with elastic KV on the block-outermost BLNHC (one row per block id, what TP x PP
runs); the engines of those pairs run side by side (``KVCORE_GPU_PARALLEL``). A
tight ``limit_bytes`` that makes requests wait is compared under vLLM's batch-invariant mode
(``VLLM_BATCH_INVARIANT=1`` on both sides), where a different batch composition cannot
change a float. The driver's free memory must fall while KV fills, come back once requests
finish, and all of it once the engine is gone, with the per-GPU ledger record removed; those
engines run alone. Two elastic instances share the GPU through one per-GPU ledger. An idle
engine whose limit ``kvctl`` lowers sheds its cached blocks down to it and serves under it. Marked
``gpu``: skipped without CUDA, or without the forked vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).parent
MODEL = os.environ.get("KVCORE_MODEL_DIR", "")
MiB = 1 << 20
PARALLEL = max(1, int(os.environ.get("KVCORE_GPU_PARALLEL", "4")))
"""Engines of the token-identity pairs run this many at a time, side by side: each with a
fixed KV size (``--kv-cache-memory-bytes``, so vLLM's memory profiling, which fails when
another process frees memory meanwhile, is skipped) and a share of the device for vLLM's
start-up check of free memory (``PAIR_UTILIZATION``)."""
PAIR_UTILIZATION = str(round(min(0.2, 0.8 / PARALLEL), 3))
PAIR_KV_BYTES = str(4 << 30)  # the prompt mix peaks near 12,000 tokens (1.3 GiB here)


def _needs() -> str | None:
    if not MODEL or not Path(MODEL, "config.json").exists():
        return "KVCORE_MODEL_DIR names no offline model directory (benchmarks/offline_model.py)"
    try:
        from vllm.config.cache import CacheConfig
    except ImportError:
        return "vLLM is not installed"
    if "kvcore_elastic" not in getattr(CacheConfig, "__dataclass_fields__", {}):
        return "the installed vLLM is not the kvcore fork"
    return None


@pytest.fixture(autouse=True)
def _engine_available() -> None:
    reason = _needs()
    if reason:
        pytest.skip(reason)


def _free() -> int:
    import torch

    return int(torch.cuda.mem_get_info()[0])


def run_engine(*flags: str, env: dict[str, str] | None = None, timeout: int = 480) -> Any:
    """Run one engine; its report, or the tail of its output (a ``str``) when it failed.

    Each engine compiles into a cache directory of its own (``VLLM_CACHE_ROOT``), so engines
    running side by side never share one; the report keeps the engine's output
    (``"output"``), where vLLM names the KV cache layout it resolved."""
    cmd = [sys.executable, str(HERE / "gpu_generate.py"), "--model", MODEL, *flags]
    with tempfile.TemporaryDirectory(prefix="kvcore-vllm-cache-") as cache:
        # its own session, killed whole once it is done: vLLM's engine core and torch's
        # compile workers must not outlive the engine and slow what runs next on the machine
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cuda", "VLLM_CACHE_ROOT": cache,
                 **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"{' '.join(flags)}: no report after {timeout} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = stdout + stderr
    lines = [ln for ln in stdout.splitlines() if ln.startswith("KVCORE-REPORT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(output.splitlines()[-60:])
        return f"{' '.join(flags)}: exit {proc.returncode}\n{tail}"
    report = json.loads(lines[-1].removeprefix("KVCORE-REPORT "))
    out = os.environ.get("KVCORE_GPU_REPORTS")
    if out:  # the device run keeps every report for docs/results
        with open(out, "a") as f:
            f.write(json.dumps({"flags": flags, "env": env or {}, **report}) + "\n")
    report["output"] = output
    return report


def generate(*flags: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One engine alone on the GPU; its report, plus the free memory seen from here around
    it. Fails the test when the engine failed."""
    before = _free()
    report = run_engine(*flags, env=env)
    if isinstance(report, str):
        pytest.fail(report)
    report["free_before"], report["free_after"] = before, _free()
    return report


def resolved_layout(report: dict[str, Any]) -> str:
    """The KV cache layout vLLM's engine core resolved (its ``Using X KV cache layout.``)."""
    found = {w for ln in report["output"].splitlines() if "KV cache layout." in ln
             for w in ln.split() if w.isupper() and len(w) == 5}  # fmt: skip
    assert len(found) == 1, f"no single resolved KV cache layout in the log: {found}"
    return found.pop()


def assert_same_tokens(off: dict[str, Any], on: dict[str, Any]) -> None:
    assert len(off["tokens"]) == len(on["tokens"]) == 28
    mismatched = [
        i for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"], strict=True)) if a != b
    ]
    assert not mismatched, f"requests {mismatched} differ with elastic KV on"
    assert all(len(t) == 48 for t in on["tokens"])


BLNHC = {"VLLM_KV_CACHE_LAYOUT": "BLNHC"}
PAIRS: dict[str, tuple[tuple[str, ...], dict[str, str], dict[str, str]]] = {
    "v2-compiled-flash-attn": ((), {}, {}),
    "v2-eager-flash-attn": (("--enforce-eager",), {}, {}),
    "v2-compiled-triton": (("--attention-backend", "TRITON_ATTN"), {}, {}),
    "v2-eager-triton": (("--enforce-eager", "--attention-backend", "TRITON_ATTN"), {}, {}),
    "v1-eager-flash-attn": (("--enforce-eager",), {"VLLM_USE_V2_MODEL_RUNNER": "0"}, {}),
    "v2-compiled-flash-attn-fp8": (("--kv-cache-dtype", "fp8"), {}, {}),
    "v2-compiled-flash-attn-blnhc": ((), {}, BLNHC),
    "v2-compiled-triton-blnhc": (("--attention-backend", "TRITON_ATTN"), {}, BLNHC),
}
"""Engine configurations compared elastic on vs off: flags and environment of both sides
(model runner V2 or V1, attention backend, torch.compile + CUDA graphs or eager, KV cache
dtype), then the elastic side's own environment (its KV cache layout). Async scheduling,
prefix caching and chunked prefill are vLLM's defaults in all of them."""


@pytest.fixture(scope="module")
def pair_reports(request: pytest.FixtureRequest) -> dict[tuple[str, bool], Any]:
    """Every selected pair's two engines, ``PARALLEL`` at a time: ``(pair, elastic)`` ->
    report (or failure text)."""
    wanted = [
        item.callspec.id
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_elastic_tokens_equal_upstream"
    ]
    jobs = [(pair, elastic) for pair in wanted for elastic in (False, True)]

    def one(job: tuple[str, bool]) -> Any:
        flags, env, elastic_env = PAIRS[job[0]]
        side: tuple[str, ...] = ()
        if job[1]:
            side, env = ("--elastic",), {**env, **elastic_env}
        sizes = ("--gpu-memory-utilization", PAIR_UTILIZATION, "--kv-cache-memory-bytes",
                 PAIR_KV_BYTES)  # fmt: skip
        return run_engine(*flags, *sizes, *side, env=env)

    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


@pytest.mark.timeout(1800)  # the first test's set-up runs every selected pair's engines
@pytest.mark.parametrize("pair", list(PAIRS))
def test_elastic_tokens_equal_upstream(pair: str, pair_reports: dict[Any, Any]) -> None:
    """Start-up (warm-up, CUDA graphs where compiled), prefix-cache hits and chunked prefill
    of long prompts: greedy tokens with elastic KV on equal upstream's, token for token.
    Upstream runs vLLM's default KV cache layout (LBNHC), and so does elastic KV (one range
    per layer) unless the pair sets its ``VLLM_KV_CACHE_LAYOUT`` (BLNHC: one row per block
    id)."""
    off, on = pair_reports[(pair, False)], pair_reports[(pair, True)]
    for report in (off, on):
        if isinstance(report, str):
            pytest.fail(report)
    asked = PAIRS[pair][2].get("VLLM_KV_CACHE_LAYOUT")
    assert (resolved_layout(off), resolved_layout(on)) == ("LBNHC", asked or "LBNHC")
    assert_same_tokens(off, on)


@pytest.mark.timeout(1000)
def test_tight_limit_waits_and_matches_batch_invariant() -> None:
    """A 512 MiB KV limit (about 4,700 tokens of this shape) cannot hold the first wave's
    ~14,000 prompt tokens at once: requests wait or are preempted, all finish, and with
    upstream's tokens (batch-invariant mode on both sides)."""
    env = {"VLLM_BATCH_INVARIANT": "1"}
    flags = ("--enforce-eager", "--attention-backend", "TRITON_ATTN")
    off = generate(*flags, env=env)
    limit = json.dumps({"limit_bytes": 512 * MiB})
    on = generate(*flags, "--elastic", "--kvcore-config", limit, env=env)
    assert_same_tokens(off, on)
    held = max(on["samples"][0][2] - s[2] for s in on["samples"])
    assert held <= 512 * MiB + 256 * MiB, f"{held >> 20} MiB mapped under a 512 MiB limit"


@pytest.mark.timeout(600)
def test_memory_follows_the_load_and_returns(tmp_path: Path) -> None:
    """Free device memory falls while KV fills, returns when requests finish (less the
    pages still held for reuse), and returns whole when the engine is gone; the per-GPU
    ledger record is removed at shutdown."""
    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_file import list_ledgers

    config = {"gpu_ledger": True, "ledger_dir": str(tmp_path)}
    # without prefix caching a finished request's blocks are free at once (cached blocks stay
    # mapped, as upstream keeps them, until evicted or bounded by max_cached_tokens)
    flags = ("--enforce-eager", "--no-prefix-caching", "--elastic")
    on = generate(*flags, "--kvcore-config", json.dumps(config))
    samples = on["samples"]
    idle = samples[0][2]
    lowest = min(s[2] for s in samples)
    drained = [s[2] for s in samples if s[1] == "drained"]
    assert idle - lowest >= 256 * MiB, "KV pages were never mapped"
    assert all(d >= lowest + (idle - lowest) // 2 for d in drained), (idle, lowest, drained)
    assert abs(on["free_after"] - on["free_before"]) <= 64 * MiB
    ledgers = list_ledgers(tmp_path)
    assert ledgers, f"gpu_ledger wrote no ledger under {tmp_path}"
    for path in ledgers:
        ledger = GpuLedger.open_path(path)
        try:
            assert ledger.snapshot().records == ()
        finally:
            ledger.close()


@pytest.mark.timeout(900)
def test_two_instances_share_the_gpu_through_one_ledger(tmp_path: Path) -> None:
    """A second elastic instance starts and serves on the GPU while the first holds KV
    memory: both register in one per-GPU ledger, each sees both records holding memory at
    once, both give the same greedy tokens, and the ledger is empty once both are gone."""
    from kvcore.budget.ledger import GpuLedger
    from kvcore.budget.ledger_file import list_ledgers

    config = json.dumps({"gpu_ledger": True, "ledger_dir": str(tmp_path)})
    flags = ("--enforce-eager", "--elastic", "--kvcore-config", config, "--ledger-peers", "2",
             "--gpu-memory-utilization", PAIR_UTILIZATION, "--kv-cache-memory-bytes",
             PAIR_KV_BYTES)  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda _: run_engine(*flags), range(2)))
    for report in reports:
        if isinstance(report, str):
            pytest.fail(report)
        names = {name for name, _ in report["peers"]}
        assert len(names) == 2, f"an instance saw {report['peers']} in the ledger"
    assert_same_tokens(reports[0], reports[1])
    for path in list_ledgers(tmp_path):
        ledger = GpuLedger.open_path(path)
        try:
            assert ledger.snapshot().records == ()
        finally:
            ledger.close()


@pytest.mark.timeout(600)
def test_an_idle_engine_sheds_to_a_lowered_limit_and_serves_under_it(tmp_path: Path) -> None:
    """``kvctl limit`` lowered while the engine is idle with its prefix cache full: the
    engine core process, woken by kvcore (patch 0010), frees cached blocks until its record
    maps no more than the limit, the driver's free memory rises by what it gave back, the
    prompts served again under the limit all finish within it, and lifting it succeeds."""
    config = json.dumps({"gpu_ledger": True, "ledger_dir": str(tmp_path)})
    on = generate("--enforce-eager", "--elastic", "--kvcore-config", config,
                  "--lower-limit", "0.3")  # fmt: skip
    steer = on["steer"]
    assert steer["rc"] == 0 and steer["lifted_rc"] == 0
    before, limit = steer["before"], steer["limit"]
    assert before - limit >= 256 * MiB, f"only {before >> 20} MiB mapped while idle"
    t, mapped, free = steer["shed"][-1]
    assert 0 <= mapped <= limit, f"{mapped >> 20} MiB still mapped after {t:.1f} s"
    given_back = free - steer["shed"][0][2]
    assert given_back >= (before - mapped) - 64 * MiB, (given_back >> 20, (before - mapped) >> 20)
    # the second wave again: 8 requests, all finished with their 48 tokens, within the limit
    assert all(len(t) == 48 for t in on["tokens"][-8:])
    assert steer["peak_under_limit"] <= limit, steer["peak_under_limit"] >> 20
