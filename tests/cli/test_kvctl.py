"""``kvctl`` as a shell user meets it: output text, exit codes and messages, against
ledgers that real instance processes registered in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import list_ledgers
from kvcore.cli import kvctl
from kvcore.cli.sizes import ACCEPTED
from tests.cli.conftest import Spawn, wait_dead

MiB = 1 << 20
GiB = 1 << 30


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = kvctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def only_ledger() -> GpuLedger:
    (path,) = list_ledgers()
    return GpuLedger.open_path(path)


def rows(out: str) -> dict[str, list[str]]:
    """Table rows of ``kvctl list`` by instance name (columns split on 2+ spaces)."""
    import re

    table = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 9 and cells[0] not in ("NAME",):
            table[cells[0]] = cells
    return table


def test_no_ledger_says_how_one_gets_created(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "list")
    assert code == kvctl.EXIT_NO_LEDGER == 3
    assert out == ""
    assert "no kvcore ledger in" in err
    assert "created when the first kvcore instance starts" in err


def test_list_shows_every_instance(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    pid_a = instance("llama-a", 256 * MiB, 64 * MiB)
    pid_b = instance("qwen-b", 128 * MiB)
    code, out, err = run(capsys, "list")
    assert (code, err) == (0, "")
    assert "1.0 GiB total, budget = whole device (rev 1), kvcore maps 384.0 MiB in 2" in out
    table = rows(out)
    assert table["llama-a"] == [
        "llama-a", "vllm 0.33.0", str(pid_a), "active", "none", "512.0 MiB (equal)",
        "256.0 MiB", "64.0 MiB", "-", "1",
    ]  # fmt: skip
    assert table["qwen-b"][2:8] == [
        str(pid_b), "active", "none", "512.0 MiB (equal)", "128.0 MiB", "0 B"
    ]  # fmt: skip


def test_list_json(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    pid = instance("llama-a", 256 * MiB, 64 * MiB)
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0
    doc = json.loads(out)
    (gpu,) = doc["gpus"]
    assert gpu["device_total"] == GiB and gpu["total_mapped"] == 256 * MiB
    assert gpu["budget"] == GiB and gpu["budget_setting"] == 0
    (inst,) = gpu["instances"]
    assert inst["name"] == "llama-a" and inst["pid"] == pid and inst["engine"] == "vllm"
    assert (inst["mapped"], inst["reserve"], inst["limit"]) == (256 * MiB, 64 * MiB, 0)
    assert doc["reclaimed"] == []


def test_limit_sets_and_reports(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    instance("llama-a", 256 * MiB)
    code, out, _ = run(capsys, "limit", "llama-a", "512M")
    assert code == 0
    assert out == "llama-a: limit none -> 512.0 MiB (revision 2)\n"
    code, out, _ = run(capsys, "limit", "llama-a", "40%")
    assert code == 0 and "-> 409.6 MiB (revision 3)" in out
    with only_ledger() as led:
        assert led.snapshot().find("llama-a").limit == int(GiB * 0.4)  # type: ignore[union-attr]


def test_lowering_below_use_is_explained_not_an_error(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("llama-a", 256 * MiB)
    code, out, _ = run(capsys, "limit", "llama-a", "128M")
    assert code == 0
    assert "maps 256.0 MiB, above the new limit: it gets no new memory until" in out
    _, out, _ = run(capsys, "list")
    assert rows(out)["llama-a"][3:5] == ["over-limit", "128.0 MiB"]
    assert rows(out)["llama-a"][8] == "200%"
    code, out, _ = run(capsys, "limit", "llama-a", "none")
    assert code == 0 and "-> none" in out


def test_unknown_instance_lists_known_ones(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("llama-a", MiB)
    instance("qwen-b", MiB)
    code, out, err = run(capsys, "limit", "mistral", "1G")
    assert code == kvctl.EXIT_FAILED == 1
    assert out == ""
    assert "no instance named 'mistral' (known: llama-a, qwen-b)" in err
    assert "kvctl list" in err


@pytest.mark.parametrize("size", ["12X", "lots", "1.5", "G1", "0%", "150%"])
def test_malformed_size_says_the_accepted_forms(
    capsys: pytest.CaptureFixture[str], instance: Spawn, size: str
) -> None:
    instance("llama-a", MiB)
    code, out, err = run(capsys, "limit", "llama-a", size)
    assert code == kvctl.EXIT_USAGE == 2
    assert out == ""
    assert err.startswith("kvctl limit: ")
    assert ACCEPTED in err or "(0, 100]" in err or "whole number" in err


@pytest.mark.parametrize(
    ("verb", "size"), [("limit", "18446744073709551616"), ("budget", "99999999T")]
)
def test_a_size_beyond_any_device_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], instance: Spawn, verb: str, size: str
) -> None:
    instance("llama-a", MiB)
    args = ("limit", "llama-a", size) if verb == "limit" else ("budget", size)
    code, out, err = run(capsys, *args)
    assert code == kvctl.EXIT_USAGE and out == ""
    assert "larger than any device" in err and "Traceback" not in err


def test_stale_revision_is_refused(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    instance("llama-a", MiB)
    assert run(capsys, "limit", "llama-a", "1G", "--if-revision", "1")[0] == 0
    code, _, err = run(capsys, "limit", "llama-a", "2G", "--if-revision", "1")
    assert code == 1 and "at revision 2" in err and "retry" in err
    with only_ledger() as led:
        assert led.snapshot().find("llama-a").limit == GiB  # type: ignore[union-attr]


def test_budget(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    instance("llama-a", 256 * MiB)
    code, out, _ = run(capsys, "budget", "200M")
    assert code == 0
    assert "budget 200.0 MiB (revision 2)" in out
    assert "above the budget" in out
    _, out, _ = run(capsys, "list")
    assert "budget 200.0 MiB (rev 2)" in out


def test_budget_needs_a_device_when_several_gpus(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("llama-a", MiB)
    GpuLedger.open("GPU-second", device_total=GiB).close()
    code, _, err = run(capsys, "budget", "1G")
    assert code == 2 and "--device UUID" in err and "GPU-second" in err
    code, out, _ = run(capsys, "--device", "GPU-sec", "budget", "1G")
    assert code == 0 and out.startswith("GPU-second: budget 1.0 GiB")
    code, out, _ = run(capsys, "budget", "2G", "--device", "GPU-sec")  # after it works too
    assert code == 0 and out.startswith("GPU-second: budget 2.0 GiB")
    code, _, err = run(capsys, "budget", "2T", "--device", "GPU-sec")
    assert code == 0 and "more than the device's 1.0 GiB" in err


def test_trim_waits_for_an_instance_that_honours_it(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("qwen-b", 64 * MiB, role="honour-trim")
    code, out, _ = run(capsys, "trim", "qwen-b", "--wait", "10")
    assert code == 0
    assert "qwen-b: asked to drop its reserve (64.0 MiB), none for 60 s" in out
    assert "qwen-b: reserve is empty" in out
    with only_ledger() as led:
        rec = led.snapshot().find("qwen-b")
        assert rec is not None and rec.reserve == 0 and rec.trimming


def test_trim_wait_times_out_with_status_1(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("llama-a", 64 * MiB, 64 * MiB)  # never looks at its reserve target
    code, _, err = run(capsys, "trim", "llama-a", "--wait", "0.3")
    assert code == 1 and "still holds a reserve of 64.0 MiB after 0.3 s" in err


def test_clean_reclaims_dead_instances(capsys: pytest.CaptureFixture[str], instance: Spawn) -> None:
    instance("alive", MiB)
    victim = instance("victim", 32 * MiB)
    import os
    import signal

    os.kill(victim, signal.SIGKILL)
    wait_dead(victim)
    code, out, err = run(capsys, "clean")
    assert code == 0
    assert f"reclaimed the record of dead instance 'victim' (pid {victim}" in err
    with only_ledger() as led:
        snap = led.snapshot()
        assert [r.name for r in snap.records] == ["alive"] and snap.total_mapped == MiB
    code, out, err = run(capsys, "clean")
    assert (code, out, err) == (0, "no stale records\n", "")


def test_list_reclaims_dead_instances_too(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    victim = instance("victim", 32 * MiB)
    import os
    import signal

    os.kill(victim, signal.SIGKILL)
    wait_dead(victim)
    code, out, err = run(capsys, "list", "--json")
    assert code == 0 and "dead instance 'victim'" in err
    doc = json.loads(out)
    assert doc["gpus"][0]["instances"] == [] and doc["reclaimed"][0]["name"] == "victim"


def test_a_foreign_file_is_reported_and_the_rest_still_listed(
    capsys: pytest.CaptureFixture[str], instance: Spawn, ledger_dir: Path
) -> None:
    instance("llama-a", MiB)
    foreign = ledger_dir / "kvcore-gpu-GPU-bogus.ledger"
    foreign.write_text("not a ledger\n" * 100)
    code, out, err = run(capsys, "list")
    assert code == 0  # the command did its work; the foreign file is a warning
    assert "llama-a" in out
    assert f"{foreign} is not a kvcore ledger" in err and "foreign" in err
    assert foreign.read_text() == "not a ledger\n" * 100


@pytest.mark.parametrize("sub", [[], ["list"], ["limit"], ["budget"], ["trim"], ["clean"]])
def test_help_everywhere_with_examples(capsys: pytest.CaptureFixture[str], sub: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        kvctl.main([*sub, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvctl")
    assert "examples:" in out and "kvctl " in out.split("examples:")[1]


def test_the_installed_console_script(ledger_dir: Path, instance: Spawn) -> None:
    script = Path(sys.executable).parent / "kvctl"
    assert script.exists(), "kvctl is a [project.scripts] entry point"
    empty = ledger_dir / "empty"
    empty.mkdir()
    res = subprocess.run([script, "--dir", str(empty), "list"], capture_output=True, text=True)
    assert res.returncode == 3 and "no kvcore ledger" in res.stderr
    instance("llama-a", MiB)
    res = subprocess.run([script, "limit", "llama-a", "2Q"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown unit" in res.stderr
    res = subprocess.run([script, "list"], capture_output=True, text=True)
    assert res.returncode == 0 and "llama-a" in res.stdout and "vllm 0.33.0" in res.stdout


def test_zero_is_not_how_a_limit_is_removed(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("llama-a", MiB)
    assert run(capsys, "limit", "llama-a", "1G")[0] == 0
    code, _, err = run(capsys, "limit", "llama-a", "0")
    assert code == kvctl.EXIT_USAGE and "kvctl limit llama-a none" in err
    with only_ledger() as led:
        assert led.snapshot().find("llama-a").limit == GiB  # type: ignore[union-attr]
    assert run(capsys, "limit", "llama-a", "none")[0] == 0


def test_a_negative_size_is_named_not_taken_for_an_option(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    instance("llama-a", MiB)
    code, _, err = run(capsys, "limit", "llama-a", "-5G")
    assert code == kvctl.EXIT_USAGE and "'-5G': a size cannot be negative" in err


def test_names_from_the_file_reach_the_terminal_as_text(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    """A hostile ledger file: a name with a terminal escape and rich markup, a NaN time."""
    from kvcore.budget.ledger_file import RECORD, record_offset

    instance("llama-a", MiB)
    with only_ledger() as led:
        rec = led.snapshot().find("llama-a")
        assert rec is not None
        with led.locked(exclusive=True) as buf:
            RECORD.put(buf, record_offset(rec.slot), "name", b"\x1b[2Jx[bold]y")
            RECORD.put(buf, record_offset(rec.slot), "updated", float("nan"))
    code, out, _ = run(capsys, "list")
    assert code == 0 and "\x1b" not in out and "\\x1b[2Jx[bold]y" in out
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0 and "NaN" not in out
    assert json.loads(out)["gpus"][0]["instances"][0]["updated"] is None


def test_share_sets_reports_and_list_shows_who_waits_and_who_yields(
    capsys: pytest.CaptureFixture[str], instance: Spawn
) -> None:
    from kvcore.budget.ledger_gate import LedgerGate

    instance("llama-a", 768 * MiB)
    code, out, _ = run(capsys, "share", "llama-a", "256M")
    assert code == 0
    assert out == "llama-a: share equal -> 256.0 MiB (256.0 MiB now)\n"
    with only_ledger() as led:
        waiter = LedgerGate(led, name="qwen-b", engine="test")
        try:
            assert not waiter.try_acquire(512 * MiB), "768 + 512 MiB exceed the 1 GiB device"
            _, out, _ = run(capsys, "list")
            table = rows(out)
            assert table["qwen-b"][3:6] == ["waiting", "none", "512.0 MiB (equal)"]
            assert table["llama-a"][3:6] == ["yielding", "none", "256.0 MiB"]
            _, out, _ = run(capsys, "list", "--json")
            got = {i["name"]: i for i in json.loads(out)["gpus"][0]["instances"]}
            assert (got["qwen-b"]["waiting"], got["qwen-b"]["share"]) == (True, 512 * MiB)
            assert got["llama-a"]["yielding"] and got["llama-a"]["share_setting"] == 256 * MiB
        finally:
            waiter.close()
    code, out, err = run(capsys, "share", "llama-a", "2G")
    assert code == 0 and "add up to 2.0 GiB, more than its budget 1.0 GiB" in err
    code, out, _ = run(capsys, "share", "llama-a", "none")
    assert (code, out) == (0, "llama-a: share 2.0 GiB -> equal (1.0 GiB now)\n")
    code, _, err = run(capsys, "share", "llama-a", "0")
    assert code == kvctl.EXIT_USAGE and "kvctl share llama-a none" in err
