"""The forked vLLM serving on a GPU with elastic KV: start-up, token identity, memory.

Each engine runs in its own process (``gpu_generate.py``) over the offline model directory
of ``benchmarks/offline_model.py`` (``KVCORE_MODEL_DIR``; dummy weights, seeded, so every
launch has the same weights). Greedy tokens with elastic KV on must equal elastic off's,
token for token; a tight ``limit_bytes`` that makes requests wait is compared under vLLM's
batch-invariant mode (``VLLM_BATCH_INVARIANT=1`` on both sides), where a different batch
composition cannot change a float. The driver's free memory must fall while KV fills, come
back once requests finish, and all of it once the engine is gone, with the per-GPU ledger
record removed. Marked ``gpu``: skipped without CUDA, or without the forked vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).parent
MODEL = os.environ.get("KVCORE_MODEL_DIR", "")
MiB = 1 << 20
LAYOUT = {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}
"""Both sides run the block-outermost layout elastic KV needs, so only elastic differs."""


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


def generate(*flags: str, env: dict[str, str] | None = None, timeout: int = 420) -> dict[str, Any]:
    """Run one engine; its report, plus the free memory seen from here around it."""
    before = _free()
    cmd = [sys.executable, str(HERE / "gpu_generate.py"), "--model", MODEL, *flags]
    proc = subprocess.run(
        cmd,
        env={**os.environ, **LAYOUT, "VLLM_TARGET_DEVICE": "cuda", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVCORE-REPORT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"{' '.join(flags)}: exit {proc.returncode}\n{tail}")
    report = json.loads(lines[-1].removeprefix("KVCORE-REPORT "))
    report["free_before"], report["free_after"] = before, _free()
    out = os.environ.get("KVCORE_GPU_REPORTS")
    if out:  # the device run keeps every report for docs/results
        with open(out, "a") as f:
            f.write(json.dumps({"flags": flags, "env": env or {}, **report}) + "\n")
    return report


def assert_same_tokens(off: dict[str, Any], on: dict[str, Any]) -> None:
    assert len(off["tokens"]) == len(on["tokens"]) == 28
    mismatched = [
        i for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"], strict=True)) if a != b
    ]
    assert not mismatched, f"requests {mismatched} differ with elastic KV on"
    assert all(len(t) == 48 for t in on["tokens"])


@pytest.mark.parametrize(
    ("mode", "env"),
    [
        pytest.param((), {}, id="v2-compiled-flash-attn"),
        pytest.param(("--enforce-eager",), {}, id="v2-eager-flash-attn"),
        pytest.param(
            ("--enforce-eager", "--attention-backend", "TRITON_ATTN"), {}, id="v2-eager-triton"
        ),
        pytest.param(
            ("--enforce-eager",), {"VLLM_USE_V2_MODEL_RUNNER": "0"}, id="v1-eager-flash-attn"
        ),
    ],
)
def test_elastic_tokens_equal_upstream(mode: tuple[str, ...], env: dict[str, str]) -> None:
    """Start-up (warm-up, CUDA graphs where compiled), prefix-cache hits and chunked
    prefill of long prompts: greedy tokens identical with elastic KV on and off."""
    off = generate(*mode, env=env)
    on = generate(*mode, "--elastic", env=env)
    assert_same_tokens(off, on)


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


def test_memory_follows_the_load_and_returns(tmp_path: Path) -> None:
    """Free device memory falls while KV fills, returns when requests finish (less the
    pages still held for reuse), and returns whole when the engine is gone; the per-GPU
    ledger record is removed at shutdown."""
    from kvcore.gpu_ledger import GpuLedger, list_ledgers

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
