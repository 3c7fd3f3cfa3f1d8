"""``kvtop``: one frame as text (``--once`` and rich's recording console), and the live
view in a real pseudo-terminal quitting on ``q`` and Ctrl-C."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import InstanceRecord, LedgerSnapshot, list_ledgers
from kvcore.cli import kvtop
from tests.cli.conftest import Spawn, wait_dead
from tests.ledger_procs import ROOT

MiB = 1 << 20


def _record(name: str, mapped: int, limit: int = 0, reserve: int = 0) -> InstanceRecord:
    return InstanceRecord(
        slot=0, pid=1, start_time=1, pidns=0, device=0, engine="vllm",
        engine_version="0.33.0", name=name, model="m", limit=limit, limit_revision=1,
        mapped=mapped, reserve=reserve, denied=0, over_limit=False, trim_until=0.0,
        registered=0.0, updated=0.0,
    )  # fmt: skip


def _snapshot(records: tuple[InstanceRecord, ...], free: int, free_time: float) -> LedgerSnapshot:
    return LedgerSnapshot(
        path=Path("/dev/null"), device_uuid="GPU-abc", device_total=1000 * MiB,
        budget_setting=0, budget_revision=1, total_mapped=sum(r.mapped for r in records),
        device_free=free, device_free_time=free_time, generation=1, records=records,
    )  # fmt: skip


def _text(renderable: object) -> str:
    console = Console(record=True, width=100, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_frame_shows_bar_and_rows() -> None:
    snap = _snapshot(
        (_record("llama-a", 200 * MiB, limit=400 * MiB, reserve=20 * MiB), _record("b", 50 * MiB)),
        free=500 * MiB,
        free_time=time.time(),
    )
    text = _text(kvtop.render([snap]))
    assert "GPU GPU-abc" in text
    bar = next(line for line in text.splitlines() if "█" in line)
    # 250 of 1000 MiB kvcore, 250 other, 500 free: a quarter, a quarter, a half
    assert (bar.count("█"), bar.count("▒"), bar.count("░")) == (12, 12, 24)
    assert "kvcore 250.0 MiB  other 250.0 MiB  free 500.0 MiB  of 1000.0 MiB" in text
    row = next(line for line in text.splitlines() if "llama-a" in line).strip("│ ")
    assert re.split(r"\s{2,}", row) == [
        "llama-a", "vllm 0.33.0", "400.0 MiB", "200.0 MiB", "20.0 MiB", "50%"
    ]  # fmt: skip
    assert "5% of budget" in next(line for line in text.splitlines() if " b " in line)


def test_frame_without_device_figures_says_unknown() -> None:
    text = _text(kvtop.render([_snapshot((), free=0, free_time=0.0)]))
    assert "other unknown" in text and "no instances" in text


def test_once_against_real_instances(
    capsys: pytest.CaptureFixture[str], instance: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance("llama-a", 256 * MiB, 64 * MiB)
    instance("qwen-b", 128 * MiB)
    assert kvtop.main(["--once"]) == 0
    out = capsys.readouterr().out
    assert "GPU HOST-" in out
    assert "kvcore 384.0 MiB" in out and "of 1.0 GiB" in out
    assert "llama-a" in out and "qwen-b" in out and "256.0 MiB" in out and "64.0 MiB" in out


def test_once_reclaims_dead_instances(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    instance("alive", MiB)
    victim = instance("victim", 64 * MiB)
    os.kill(victim, signal.SIGKILL)
    wait_dead(victim)
    assert kvtop.main(["--once"]) == 0
    out = capsys.readouterr().out
    assert "alive" in out and "victim" not in out
    (path,) = list_ledgers()
    with GpuLedger.open_path(path) as led:
        assert led.snapshot().find("victim") is None


def test_no_ledger(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvtop.main(["--once"]) == 3
    assert "created when the first kvcore instance starts" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_interval_is_a_usage_error(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as info:
        kvtop.main(["--interval", value])
    assert info.value.code == 2
    assert "--interval" in capsys.readouterr().err


def _foreground_job() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _live_kvtop() -> tuple[subprocess.Popen[bytes], int, int]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore.cli.kvtop", "--interval", "0.1"],
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
        start_new_session=True,
        # make the pty its controlling terminal, so Ctrl-C reaches it as SIGINT, with SIGINT's
        # default action as a shell gives its foreground job (a non-interactive shell starts
        # background commands with SIGINT ignored, and Python then installs no handler)
        preexec_fn=_foreground_job,
    )
    return proc, master, slave


def _read_until(master: int, needle: bytes, timeout: float = 20.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    return seen


@pytest.mark.parametrize("how", ["q", "ctrl-c"])
def test_live_view_in_a_terminal_quits_cleanly(instance: Spawn, how: str) -> None:
    instance("llama-a", 8 * MiB)
    proc, master, slave = _live_kvtop()
    try:
        seen = _read_until(master, b"llama-a")
        assert b"llama-a" in seen, seen[-2000:]
        seen += _read_until(master, b"llama-a", timeout=1.0)  # at least one refresh
        if how == "q":
            os.write(master, b"q")
        else:
            os.write(master, b"\x03")  # the terminal turns Ctrl-C into SIGINT
        # keep reading while it exits: its last frame and the terminal reset (TCSADRAIN)
        # block while the pty's buffer is full, as they never do on a terminal someone reads
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            seen += _read_until(master, b"\0", timeout=0.2)
        assert proc.wait(1) == 0
        seen += _read_until(master, b"\0", timeout=0.3)
        assert b"\x1b[?1049h" not in seen, "no alternate screen"
        assert b"\x1b[?1000h" not in seen and b"\x1b[?1006h" not in seen, "no mouse"
        assert b"Traceback" not in seen
        mode = termios.tcgetattr(slave)
        assert mode[3] & termios.ICANON and mode[3] & termios.ECHO, "terminal mode restored"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        os.close(master)
        os.close(slave)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        kvtop.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvtop") and "--interval" in out and "kvtop --once" in out


def test_frame_shows_shares_and_who_waits_only_when_in_play() -> None:
    from dataclasses import replace

    lender = replace(_record("llama-a", 700 * MiB), slot=0)
    waiter = replace(_record("qwen-b", 100 * MiB), slot=1, wanted_until=time.time() + 60)
    plain = _text(kvtop.render([_snapshot((lender, replace(waiter, wanted_until=0.0)), 0, 0)]))
    assert "SHARE" not in plain and "STATE" not in plain, "no shares in play: the usual table"
    text = _text(kvtop.render([_snapshot((lender, waiter), 0, 0)]))
    rows = {
        cells[0]: cells
        for line in text.splitlines()
        if (cells := re.split(r"\s{2,}", line.strip("│ ")))[0] in ("llama-a", "qwen-b")
    }
    # an equal share of the 1000 MiB device each; the waiter below it, the lender above
    assert rows["llama-a"][3:] == ["500.0 MiB", "700.0 MiB", "0 B", "70% of budget", "yielding"]
    assert rows["qwen-b"][3:] == ["500.0 MiB", "100.0 MiB", "0 B", "10% of budget", "waiting"]
