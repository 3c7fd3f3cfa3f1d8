"""``benchmarks/kvcached_mode.py`` on CPU: the servers' environment, the limit segments'
reader, the ballast's arithmetic and its failure to start without a GPU, and the
benchmark's refusal to run kvcached beside the other modes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from benchmarks import kvcached_mode
from benchmarks.vllm_colocate import kv_panel, parse_args, start_groups

GiB = 1 << 30


def test_each_instance_gets_its_own_ipc_name() -> None:
    names = ["llama-3-8b", "llama-3.2-3b", "qwen3-0.6b"]
    ipc = [kvcached_mode.ipc_name(n) for n in names]
    assert ipc == ["kvc_llama_3_8b", "kvc_llama_3_2_3b", "kvc_qwen3_0_6b"]
    assert len(set(ipc)) == 3


def test_server_env_puts_the_hook_first_and_turns_kvcached_on(tmp_path: Path) -> None:
    env = kvcached_mode.server_env(tmp_path / "site", "qwen3-0.6b")
    path = env["PYTHONPATH"].split(":")
    assert path[:2] == [str(kvcached_mode.BOOT_DIR), str(tmp_path / "site")]
    assert (kvcached_mode.BOOT_DIR / "sitecustomize.py").exists()
    assert env["KVCACHED_SITE"] == str(tmp_path / "site")
    assert (env["ENABLE_KVCACHED"], env["KVCACHED_AUTOPATCH"]) == ("true", "1")
    assert env["KVCACHED_IPC_NAME"] == "kvc_qwen3_0_6b"
    assert env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"


def test_segments_are_read_as_kvcached_writes_them(tmp_path: Path) -> None:
    (tmp_path / "kvc_a").write_bytes(struct.pack("<qqq", 8 * GiB, 2 * GiB, GiB // 2))
    (tmp_path / "kvc_b").write_bytes(b"\\0" * 10)  # being written: too short
    seg = kvcached_mode.read_segment("a", tmp_path)
    assert seg == kvcached_mode.Segment(8 * GiB, 2 * GiB, GiB // 2)
    assert seg is not None and seg.mapped == 2 * GiB + GiB // 2
    assert kvcached_mode.read_segment("b", tmp_path) is None
    assert kvcached_mode.read_segment("c", tmp_path) is None  # not there (yet, or any more)
    sample = kvcached_mode.segment_sample(["a", "b", "c"], 1.23456, tmp_path)
    assert sample == {
        "t": 1.2346,
        "instances": {"a": {"mapped": 2 * GiB + GiB // 2, "used": 2 * GiB, "limit": 8 * GiB}},
        "total_mapped": 2 * GiB + GiB // 2,
    }


def test_the_ballast_leaves_the_budget_less_what_is_mapped() -> None:
    assert kvcached_mode.room_left(12 * GiB, 3 * GiB) == 9 * GiB
    with pytest.raises(ValueError, match="beyond the budget"):
        kvcached_mode.room_left(GiB, 2 * GiB)


def test_a_ballast_that_cannot_start_says_why() -> None:
    ballast = kvcached_mode.Ballast(GiB)
    with pytest.raises(RuntimeError, match="the GPU ballast did not start"):
        ballast.start(timeout=120.0)  # no GPU here: torch.cuda refuses
    assert ballast.proc is None
    ballast.stop()  # stopping twice is harmless


def test_kv_panel_takes_kvcached_held_and_in_use_from_its_segments() -> None:
    samples = [{"t": 10.0 + i, "instances": {"a": {"mapped": i * GiB, "used": i * GiB // 2}}}
               for i in range(3)]  # fmt: skip
    # kvcached's usage gauge counts against the blocks it has mapped: not a KV size
    gauges = [{"t": 11.0, "mode": "kvcached", "instance": "a", "vllm:kv_cache_usage_perc": 0.9}]
    panel = kv_panel("kvcached", (10.0, 12.0), ["a"], samples, gauges, {"a": 4 * GiB})
    assert panel["a"]["held"] == [(0.0, 0.0), (1.0, float(GiB)), (2.0, float(2 * GiB))]
    assert panel["a"]["in_use"] == [(0.0, 0.0), (1.0, float(GiB // 2)), (2.0, float(GiB))]


def test_kvcached_servers_run_alone_after_the_other_modes(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "run.json")]
    assert parse_args(out).modes == ["elastic", "static"]  # kvcached is opt-in
    args = parse_args([*out, "--modes", "kvcached", "elastic", "static"])
    assert start_groups(args.modes, args.start) == [["elastic", "static"], ["kvcached"]]
    assert start_groups(["elastic", "static"], "together") == [["elastic", "static"]]
    assert start_groups(["kvcached"], "together") == [["kvcached"]]
    assert start_groups(["static", "kvcached"], "sequential") == [["static"], ["kvcached"]]
