"""The per-GPU shared ledger and ``LedgerGate``: file format and refusal of foreign files,
limits and the budget, deferred lowering, revisions, stale-record reclaim, and real
processes sharing one budget (``tests/ledger_procs.py``). The gate's interval and deadline
decisions run on a fake clock (``FakeClock``); only waits for a lock another holder keeps run
on the real clock."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import multiprocessing
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

import kvcore.budget.ledger_file as ledger_file
import kvcore.budget.ledger_gate as ledger_gate
from kvcore.budget.gate import MemoryGate
from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import HEADER, RECORD, Liveness, ledger_path, record_offset
from kvcore.budget.ledger_gate import LedgerGate
from kvcore.errors import (
    LedgerBusy,
    LedgerError,
    LedgerNotFound,
    RevisionConflict,
    UnknownInstance,
)
from kvcore.vmm.base import MemInfo
from tests import ledger_procs
from tests.ledger_procs import PAGE, kill, spawn_holder

MiB = 1 << 20
UUID = "GPU-test-0000"


@pytest.fixture
def ledger() -> Iterator[GpuLedger]:
    led = GpuLedger.open(UUID, device_total=1024 * MiB)
    yield led
    led.close()


class FakeClock:
    """A clock that moves only when told to (``advance``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def gate(
    led: GpuLedger,
    name: str,
    limit: int = 0,
    *,
    mem_info: Callable[[], MemInfo] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> LedgerGate:
    return LedgerGate(
        led,
        name=name,
        engine="test",
        limit=limit,
        mem_info=mem_info,
        clock=clock,
        wall_clock=wall_clock,
    )


# -- the file -----------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077])
def test_created_with_mode_0600_whatever_the_umask(umask: int) -> None:
    old = os.umask(umask)
    try:
        GpuLedger.open(UUID, device_total=MiB).close()
    finally:
        os.umask(old)
    assert ledger_path(UUID).stat().st_mode & 0o777 == 0o600


def test_group_mode_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        group = grp.getgrgid(os.getgid()).gr_name
    except KeyError:
        pytest.skip("this process's group has no name in the group database")
    monkeypatch.setenv(ledger_file.GROUP_ENV, group)
    GpuLedger.open(UUID, device_total=MiB).close()
    st = ledger_path(UUID).stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, os.getgid())


def test_unknown_group_is_refused_and_nothing_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ledger_file.GROUP_ENV, "no-such-group-kvcore")
    with pytest.raises(LedgerError, match="names no group") as info:
        GpuLedger.open(UUID, device_total=MiB)
    assert "getent group" in info.value.hint
    assert not list(ledger_path(UUID).parent.iterdir())


def test_unwritable_directory_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="cannot create a kvcore ledger in") as info:
        GpuLedger.open(UUID, device_total=MiB, directory=tmp_path / "missing")
    assert ledger_file.DIR_ENV in info.value.hint


def test_missing_ledger_without_device_size_is_not_found() -> None:
    with pytest.raises(LedgerNotFound) as info:
        GpuLedger.open(UUID)
    assert "first kvcore instance starts" in info.value.hint


def _refused_untouched(path: Path, content: bytes) -> LedgerError:
    path.write_bytes(content)
    before = path.stat().st_mtime_ns
    with pytest.raises(LedgerError) as info:
        GpuLedger.open(UUID, device_total=MiB)
    assert path.read_bytes() == content, "a refused file must never be written"
    assert path.stat().st_mtime_ns == before
    assert f"rm {path}" in info.value.hint
    return info.value


def test_foreign_file_is_refused_and_left_untouched() -> None:
    err = _refused_untouched(ledger_path(UUID), b"somebody else's data\n" * 2000)
    assert "foreign" in err.message


def test_empty_file_is_refused() -> None:
    err = _refused_untouched(ledger_path(UUID), b"")
    assert "shorter than a ledger header" in err.message


def test_unknown_layout_version_is_refused_and_left_untouched(ledger: GpuLedger) -> None:
    path = ledger.path
    ledger.close()
    data = bytearray(path.read_bytes())
    data[8:12] = (ledger_file.LAYOUT_VERSION + 1).to_bytes(4, "little")
    err = _refused_untouched(path, bytes(data))
    assert f"layout version {ledger_file.LAYOUT_VERSION + 1}" in err.message


def test_truncated_ledger_is_refused(ledger: GpuLedger) -> None:
    path = ledger.path
    ledger.close()
    err = _refused_untouched(path, path.read_bytes()[:1000])
    assert "truncated" in err.message


def test_ledger_of_another_device_is_refused(ledger: GpuLedger) -> None:
    ledger.close()
    other = ledger_path("GPU-other")
    ledger.path.rename(other)
    with pytest.raises(LedgerError, match="belongs to device 'GPU-test-0000'"):
        GpuLedger.open("GPU-other")


def test_symlink_at_the_ledger_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    ledger_path(UUID).symlink_to(target)
    with pytest.raises(LedgerError, match="cannot open"):
        GpuLedger.open(UUID, device_total=MiB)
    assert target.read_bytes() == b"precious"


def test_world_writable_ledger_is_refused(ledger: GpuLedger) -> None:
    ledger.close()
    ledger.path.chmod(0o666)  # anyone could have planted or rewritten it
    with pytest.raises(LedgerError, match="writable by every user"):
        GpuLedger.open(UUID)


def test_fifo_at_the_ledger_path_is_refused_without_hanging() -> None:
    os.mkfifo(ledger_path(UUID), 0o600)
    with pytest.raises(LedgerError, match="not a regular file"):
        GpuLedger.open(UUID, device_total=MiB)


def test_corrupt_record_is_reported_not_guessed(ledger: GpuLedger) -> None:
    gate(ledger, "a")
    with ledger.path.open("r+b") as f:
        f.seek(256)  # first record's state field
        f.write((7).to_bytes(4, "little"))
    with pytest.raises(LedgerError, match="unknown state 7: the file is corrupt"):
        ledger.snapshot()


def test_concurrent_creators_share_one_ledger() -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_open_and_register, args=(f"i{i}",)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [p.name for p in ledger_file.list_ledgers()] == [ledger_path(UUID).name]
    assert not [p for p in ledger_path(UUID).parent.iterdir() if p.name.startswith(".")]


def _open_and_register(name: str) -> None:
    led = GpuLedger.open(UUID, device_total=1024 * MiB)
    g = LedgerGate(led, name=name, engine="test")
    assert g.try_acquire(MiB)
    g.close()


# -- the gate -----------------------------------------------------------------------------


def test_gate_is_a_memory_gate(ledger: GpuLedger) -> None:
    assert isinstance(gate(ledger, "a"), MemoryGate)


def test_limit_and_budget_both_bound_admission(ledger: GpuLedger) -> None:
    ledger.set_budget(100 * MiB)
    a = gate(ledger, "a", limit=60 * MiB)
    b = gate(GpuLedger.open(UUID), "b")
    assert a.try_acquire(60 * MiB)
    assert not a.try_acquire(1), "over a's own limit"
    assert not b.try_acquire(41 * MiB), "over the budget with a's 60 MiB"
    assert b.try_acquire(40 * MiB)
    a.release(10 * MiB)
    assert b.try_acquire(10 * MiB)
    snap = ledger.snapshot()
    assert snap.total_mapped == 100 * MiB == sum(r.mapped for r in snap.records)
    assert (snap.find("a").denied, snap.find("b").denied) == (1, 1)  # type: ignore[union-attr]


def test_budget_defaults_to_the_device_total(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    assert a.try_acquire(1024 * MiB)
    assert not a.try_acquire(1)


def test_lowered_limit_is_deferred_and_trims_the_reserve_first(ledger: GpuLedger) -> None:
    a = gate(ledger, "a", limit=16 * MiB)
    assert a.try_acquire(8 * MiB)
    a.report_reserve(3 * MiB)  # in use: 5 MiB
    assert a.reserve_target(3 * MiB) == 3 * MiB
    assert a.overage() == 0
    ledger.set_limit("a", 6 * MiB)
    assert a.reserve_target(3 * MiB) == 1 * MiB, "the reserve shrinks to fit the limit"
    assert a.overage() == 0, "the 5 MiB in use fit: only the reserve is over"
    assert not a.try_acquire(PAGE), "no new memory while over the limit"
    rec = a.record()
    assert rec.over_limit and rec.mapped == 8 * MiB, "nothing taken away, nothing raised"
    ledger.set_limit("a", 4 * MiB)
    assert a.reserve_target(3 * MiB) == 0
    assert a.overage() == 1 * MiB, "in use beyond the limit: the engine is asked to shed it"
    a.release(3 * MiB)  # the allocator drops its reserve ...
    a.report_reserve(0)
    assert a.record().over_limit and a.overage() == 1 * MiB
    a.release(2 * MiB)  # ... and use falls below the limit
    assert not a.record().over_limit and a.overage() == 0
    assert a.try_acquire(1 * MiB)
    assert not a.try_acquire(1)
    ledger.set_limit("a", 0)  # lifted: growth comes back at once (kvcached #498)
    assert a.try_acquire(64 * MiB) and a.overage() == 0


def test_lowered_budget_is_deferred(ledger: GpuLedger) -> None:
    a, b = gate(ledger, "a"), gate(ledger, "b")
    assert a.try_acquire(300 * MiB) and b.try_acquire(300 * MiB)
    b.report_reserve(100 * MiB)
    ledger.set_budget(450 * MiB)  # below the 600 MiB mapped
    assert not a.try_acquire(PAGE)
    assert a.overage() == b.overage() == 0, "a lowered budget asks nobody in particular"
    assert b.reserve_target(100 * MiB) == 0, "reserves go first"
    b.release(100 * MiB)
    b.report_reserve(0)
    assert not a.try_acquire(PAGE), "500 MiB still above the budget"
    b.release(100 * MiB)  # b's requests finish
    assert a.try_acquire(50 * MiB)
    assert not a.try_acquire(PAGE)


def test_limit_revision_is_a_compare_and_set(ledger: GpuLedger) -> None:
    a = gate(ledger, "a", limit=10 * MiB)
    before, after = ledger.set_limit("a", 20 * MiB, if_revision=1)
    assert (before.limit_revision, after.limit_revision, after.limit) == (1, 2, 20 * MiB)
    with pytest.raises(RevisionConflict, match="revision 2") as info:
        ledger.set_limit("a", 5 * MiB, if_revision=1)  # a writer acting on an old reading
    assert "re-read" in info.value.hint
    assert a.record().limit == 20 * MiB
    assert a.try_acquire(15 * MiB)  # the gate's own writes never touch the limit
    a.report_reserve(MiB)
    a.release(MiB)
    assert (a.record().limit, a.record().limit_revision) == (20 * MiB, 2)


def test_budget_revision_is_a_compare_and_set(ledger: GpuLedger) -> None:
    assert ledger.set_budget(100 * MiB, if_revision=1) == 2
    with pytest.raises(RevisionConflict):
        ledger.set_budget(900 * MiB, if_revision=1)
    assert ledger.snapshot().budget == 100 * MiB


def test_unknown_instance_lists_the_known_ones(ledger: GpuLedger) -> None:
    gate(ledger, "alpha")
    gate(ledger, "beta")
    with pytest.raises(UnknownInstance, match=r"'gamma' .*\(known: alpha, beta\)"):
        ledger.set_limit("gamma", MiB)


def test_trim_holds_the_reserve_at_zero_for_the_hold(ledger: GpuLedger) -> None:
    wall = FakeClock(time.time())  # request_trim stamps the deadline on the real clock, later
    a = gate(ledger, "a", wall_clock=wall)
    assert a.try_acquire(4 * MiB)
    a.report_reserve(4 * MiB)
    ledger.request_trim("a", hold_s=30)
    assert a.reserve_target(4 * MiB) == 0
    wall.advance(29)
    assert a.reserve_target(4 * MiB) == 0, "still within the hold"
    wall.advance(3600)
    assert a.reserve_target(4 * MiB) == 4 * MiB, "the hold is over"
    ledger.request_trim("a", hold_s=float("inf"))
    assert a.reserve_target(4 * MiB) == 0
    ledger.request_trim("a", hold_s=0)
    assert a.reserve_target(4 * MiB) == 4 * MiB


def test_names_are_unique_among_live_instances(ledger: GpuLedger) -> None:
    gate(ledger, "a")
    with pytest.raises(LedgerError, match="already runs"):
        gate(GpuLedger.open(UUID), "a")


@pytest.mark.parametrize("name", ["", "has space", "-lead", "x" * 64, "tab\t"])
def test_unusable_names_are_refused(ledger: GpuLedger, name: str) -> None:
    with pytest.raises(LedgerError, match="not usable"):
        gate(ledger, name)


def test_full_ledger_is_refused_with_a_hint(ledger: GpuLedger) -> None:
    for i in range(ledger_file.CAPACITY):
        gate(ledger, f"i{i}")
    with pytest.raises(LedgerError, match="is full") as info:
        gate(ledger, "one-more")
    assert "kvctl clean" in info.value.hint


def test_close_removes_the_record_and_its_bytes(ledger: GpuLedger) -> None:
    a, b = gate(ledger, "a"), gate(ledger, "b")
    assert a.try_acquire(10 * MiB) and b.try_acquire(5 * MiB)
    a.close()
    a.close()
    snap = ledger.snapshot()
    assert [r.name for r in snap.records] == ["b"] and snap.total_mapped == 5 * MiB


def test_releasing_more_than_held_raises_and_changes_nothing(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    assert a.try_acquire(MiB)
    with pytest.raises(LedgerError, match="holds 1048576 bytes"):
        a.release(2 * MiB)
    assert a.record().mapped == MiB == ledger.snapshot().total_mapped


def test_gate_notices_its_record_was_removed(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    other = GpuLedger.open(UUID)
    with other.locked(exclusive=True) as buf:  # what a wrong reclaim would do
        buf[256 : 256 + 384] = bytes(384)
    with pytest.raises(LedgerError, match="removed by another process"):
        a.try_acquire(MiB)


def test_a_stuck_lock_holder_never_fails_a_serving_gate(
    ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the ledger's lock (a stopped ``kvctl``): the gate's calls
    return after ``GATE_LOCK_WAIT_S``, not the other users' ``LOCK_TIMEOUT_S``, without
    raising: an allocation misses, a release is deferred and written by the first call that
    gets the lock afterwards."""
    monkeypatch.setattr(ledger_file, "LOCK_TIMEOUT_S", 60.0)
    a = gate(ledger, "a")
    assert a.try_acquire(4 * MiB)
    fd = os.open(ledger.path, os.O_RDWR)  # another open file description: another holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert a.try_acquire(MiB) is False  # a miss: the allocation waits
        a.release(3 * MiB)  # deferred, not lost and not an error
        a.report_reserve(MiB)
        assert a.headroom() == 0 and a.reserve_target(2 * MiB) == 2 * MiB
        assert time.monotonic() - t0 < ledger_file.LOCK_TIMEOUT_S, "no call waited that long"
    finally:
        os.close(fd)
    assert a.try_acquire(MiB)  # the first call with the lock writes the deferred release
    assert ledger.snapshot().find("a").mapped == 2 * MiB


def test_a_busy_ledger_is_logged_once_per_interval(
    ledger: GpuLedger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    a = gate(ledger, "a", clock=clock)
    fd = os.open(ledger.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger=ledger_gate.__name__):
            assert not a.try_acquire(MiB) and not a.try_acquire(MiB)
            assert len(caplog.records) == 1, "a stuck holder is said once, not per call"
            clock.advance(ledger_gate.BUSY_LOG_INTERVAL_S)
            assert not a.try_acquire(MiB)
            assert len(caplog.records) == 2
        assert "an allocation waits" in caplog.records[0].getMessage()
    finally:
        os.close(fd)


def test_other_ledger_users_still_raise_on_a_stuck_lock_holder(
    ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate(ledger, "a")
    monkeypatch.setattr(ledger_file, "LOCK_TIMEOUT_S", 0.2)
    fd = os.open(ledger.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LedgerBusy, match="stayed locked") as info:
            ledger.set_limit("a", MiB)  # kvctl: says so and exits
        assert "fuser" in info.value.hint
    finally:
        os.close(fd)


class _ReleaseOnWarning(logging.Handler):
    """Lets go of a held ledger lock (closes ``fd``) once a starting instance says it waits
    for it."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd, self.seen = fd, 0

    def emit(self, record: logging.LogRecord) -> None:
        if "waits for the ledger lock" in record.getMessage() and not self.seen:
            self.seen += 1
            os.close(self.fd)


@contextlib.contextmanager
def _held_until_waited_for(ledger: GpuLedger) -> Iterator[_ReleaseOnWarning]:
    """Another holder takes ``ledger``'s lock and keeps it until a starting instance warns
    that it waits for it (so the wait is certain, whatever the machine's speed)."""
    fd = os.open(ledger.path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    release = _ReleaseOnWarning(fd)
    logger = logging.getLogger(ledger_file.__name__)
    logger.addHandler(release)
    try:
        yield release
    finally:
        logger.removeHandler(release)
        if not release.seen:
            os.close(fd)


def test_an_instance_registering_waits_for_a_stuck_lock_holder(
    ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine starting while a stopped ``kvctl`` holds the lock waits (and says so)
    instead of failing after ``LOCK_TIMEOUT_S``; it registers once the lock is free."""
    monkeypatch.setattr(ledger_file, "LOCK_TIMEOUT_S", 0.05)
    with _held_until_waited_for(ledger) as release:
        b = gate(ledger, "b")  # waits past LOCK_TIMEOUT_S, warning
    assert release.seen == 1 and b.record().name == "b"


def test_an_instance_opening_the_ledger_waits_for_a_stuck_lock_holder(
    ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger_file, "LOCK_TIMEOUT_S", 0.05)
    with _held_until_waited_for(ledger) as release:
        opened = GpuLedger.open(UUID)  # waits past LOCK_TIMEOUT_S, warning
    assert release.seen == 1
    opened.close()


def test_an_instance_registering_gives_up_after_the_register_wait(
    ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger_file, "LOCK_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ledger_file, "REGISTER_LOCK_WAIT_S", 0.2)
    fd = os.open(ledger.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LedgerBusy, match="stayed locked"):
            gate(ledger, "b")
    finally:
        os.close(fd)
    assert ledger.snapshot().find("b") is None


def test_readers_take_a_shared_lock(ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch) -> None:
    gate(ledger, "a")
    monkeypatch.setattr(ledger_file, "LOCK_TIMEOUT_S", 0.2)
    fd = os.open(ledger.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert ledger.snapshot().find("a") is not None, "readers share"
        with pytest.raises(LedgerError, match="stayed locked"):
            ledger.set_limit("a", MiB)  # a writer waits for readers
    finally:
        os.close(fd)


def test_use_after_fork_is_refused(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    pid = os.fork()
    if pid == 0:  # the child shares the parent's flock: it must not use the ledger
        try:
            a.try_acquire(MiB)
        except LedgerError as exc:
            os._exit(0 if "used after a fork" in exc.message else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert a.try_acquire(MiB), "the parent is unaffected"


def test_device_free_is_published_from_the_backend() -> None:
    backend = ledger_procs.host_backend(64 * MiB)
    with LedgerGate.from_backend(backend, name="a", engine="test") as g:
        snap = g.ledger.snapshot()
        assert (snap.device_uuid, snap.device_total) == (backend.device_uuid(), 64 * MiB)
        assert snap.device_free == 64 * MiB and snap.device_free_time > 0
    backend.close()


def test_device_free_is_published_once_per_interval(ledger: GpuLedger) -> None:
    """``try_acquire`` and ``release`` publish the device's free bytes, at most once per
    ``DEVICE_FREE_INTERVAL_S`` of the gate's clock."""
    clock, free = FakeClock(), [900 * MiB]
    a = gate(ledger, "a", clock=clock, mem_info=lambda: MemInfo(free=free[0], total=1024 * MiB))
    assert ledger.snapshot().device_free_time == 0, "nothing published before a call"
    assert a.try_acquire(MiB)
    assert ledger.snapshot().device_free == 900 * MiB
    free[0] = 800 * MiB
    clock.advance(ledger_gate.DEVICE_FREE_INTERVAL_S / 2)
    a.release(MiB)
    assert a.try_acquire(MiB)
    assert ledger.snapshot().device_free == 900 * MiB, "within the interval: not again"
    clock.advance(ledger_gate.DEVICE_FREE_INTERVAL_S / 2)
    a.release(MiB)
    assert ledger.snapshot().device_free == 800 * MiB


# -- stale records ------------------------------------------------------------------------


@pytest.mark.parametrize("reclaimer", ["next-instance", "reclaim_stale", "budget-refusal"])
def test_sigkilled_instance_is_reclaimed(reclaimer: str) -> None:
    backend = ledger_procs.host_backend(1024 * MiB)
    led = GpuLedger.open(backend.device_uuid(), device_total=1024 * MiB)
    led.set_budget(64 * MiB)
    proc, pid = spawn_holder("victim", 64 * MiB)
    clock = FakeClock()
    try:
        victim = led.snapshot().find("victim")
        assert victim is not None and victim.mapped == 64 * MiB and victim.pid == pid
        assert victim.liveness is Liveness.LIVE
        if reclaimer == "budget-refusal":  # registered (and swept) while the victim lives
            g = LedgerGate(led, name="next", engine="test", clock=clock)
            assert not g.try_acquire(PAGE)
            clock.advance(ledger_gate.SWEEP_INTERVAL_S)  # the refusal used this period's sweep
        kill(proc)
        assert led.snapshot().find("victim").liveness is Liveness.STALE  # type: ignore[union-attr]
        if reclaimer == "next-instance":
            g = LedgerGate(led, name="next", engine="test")
            assert led.snapshot().find("victim") is None
        elif reclaimer == "reclaim_stale":
            assert [r.name for r in led.reclaim_stale()] == ["victim"]
            g = LedgerGate(led, name="next", engine="test")
        assert g.try_acquire(64 * MiB), "the dead instance's memory is available again"
        snap = led.snapshot()
        assert [r.name for r in snap.records] == ["next"] and snap.total_mapped == 64 * MiB
    finally:
        if proc.poll() is None:
            kill(proc)
        led.close()
        backend.close()


def test_a_budget_refusal_sweeps_once_per_interval(ledger: GpuLedger) -> None:
    """A refused gate reclaims dead instances' records at most once per
    ``SWEEP_INTERVAL_S`` of its clock, and is admitted once a sweep frees the bytes."""
    ledger.set_budget(10 * MiB)
    clock = FakeClock()
    a, b = gate(ledger, "a", clock=clock), gate(ledger, "b")
    assert b.try_acquire(10 * MiB)
    assert not a.try_acquire(MiB), "refused; swept, but b is alive"
    rec = b.record()
    with ledger.locked(exclusive=True) as buf:  # b now reads as dead (same pid, reused)
        RECORD.put(buf, record_offset(rec.slot), "start_time", rec.start_time + 1)
    clock.advance(ledger_gate.SWEEP_INTERVAL_S / 2)
    assert not a.try_acquire(MiB), "within the interval: no sweep"
    assert ledger.snapshot().find("b") is not None
    clock.advance(ledger_gate.SWEEP_INTERVAL_S / 2)
    assert a.try_acquire(MiB), "the sweep reclaimed b's bytes"
    snap = ledger.snapshot()
    assert [r.name for r in snap.records] == ["a"] and snap.total_mapped == MiB


def test_reused_pid_is_stale(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    assert a.try_acquire(MiB)
    start = a.record().start_time
    with ledger.locked(exclusive=True) as buf:  # same pid, another process start time
        RECORD.put(buf, 256, "start_time", start + 1)
    assert ledger.snapshot().find("a").liveness is Liveness.STALE  # type: ignore[union-attr]
    assert [r.name for r in ledger.reclaim_stale()] == ["a"]
    assert ledger.snapshot().total_mapped == 0


def test_record_of_another_pid_namespace_is_never_reclaimed(ledger: GpuLedger) -> None:
    gate(ledger, "a")
    with ledger.locked(exclusive=True) as buf:
        RECORD.put(buf, 256, "pidns", 12345)
        RECORD.put(buf, 256, "pid", 999_999_999 % (1 << 31))
    assert ledger.snapshot().find("a").liveness is Liveness.UNKNOWN  # type: ignore[union-attr]
    assert ledger.reclaim_stale() == []


def test_sweep_heals_a_total_left_inconsistent(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    assert a.try_acquire(3 * MiB)
    with ledger.locked(exclusive=True) as buf:  # a writer killed between two writes
        HEADER.put(buf, 0, "total_mapped", 999 * MiB)
    assert ledger.reclaim_stale() == []
    assert ledger.snapshot().total_mapped == 3 * MiB


# -- real processes -----------------------------------------------------------------------


class _Hammers:
    """``n`` hammer processes (``ledger_procs.hammer``) allocating on one host device whose
    ledger has ``budget``; they stay registered until ``finish``."""

    def __init__(self, n: int, iterations: int, seed: int, budget: int) -> None:
        device = 1024 * MiB
        self.backend = ledger_procs.host_backend(device)
        self.led = GpuLedger.open(self.backend.device_uuid(), device_total=device)
        self.led.set_budget(budget)
        self.budget = budget
        self.ctx = multiprocessing.get_context("spawn")
        self.held, self.peak = self.ctx.Value("q", 0), self.ctx.Value("q", 0)
        self.results, self.start, self.linger = self.ctx.Queue(), self.ctx.Event(), self.ctx.Event()
        self.sync = (self.results, self.start, self.linger)
        self.procs = [
            self.ctx.Process(
                target=ledger_procs.hammer,
                args=(f"p{i}", device, iterations, seed + i, self.held, self.peak, *self.sync),
            )
            for i in range(n)
        ]
        for p in self.procs:
            p.start()
        while len(self.led.snapshot().records) < n:
            time.sleep(0.01)

    def done(self) -> bool:
        """Every hammer finished its iterations (and is lingering, still registered)."""
        return self.results.qsize() == len(self.procs)

    def finish(self, others: Sequence[BaseProcess] = ()) -> list[dict[str, int]]:
        """Let them close; check each one's ledger claim against the handles it held."""
        out: list[dict[str, int]] = [self.results.get(timeout=120) for _ in self.procs]
        self.linger.set()
        for p in [*self.procs, *others]:
            p.join(60)
            assert p.exitcode == 0
        for r in out:
            assert r["ledger_mapped"] == r["own_bytes"] == r["backend_bytes"]
        assert 0 < self.peak.value <= self.budget, "independent count of what they held"
        assert self.held.value == 0
        snap = self.led.snapshot()
        assert snap.records == () and snap.total_mapped == 0
        self.led.close()
        self.backend.close()
        return out


def test_processes_never_exceed_the_shared_budget_in_sum() -> None:
    budget = 40 * PAGE
    hammers = _Hammers(4, iterations=1500, seed=0, budget=budget)
    hammers.start.set()
    samples = 0
    while not hammers.done():
        snap = hammers.led.snapshot()
        assert snap.total_mapped <= budget
        assert snap.total_mapped == sum(r.mapped for r in snap.records)
        samples += 1
    out = hammers.finish()
    assert samples > 10
    assert sum(r["refused"] for r in out) > 0, "the budget was actually contended"


def test_limit_writers_race_allocators_without_corrupting_the_ledger() -> None:
    hammers = _Hammers(2, iterations=3000, seed=10, budget=64 * PAGE)
    sizes = [[(8 + 4 * k + w) * PAGE for k in range(60)] for w in range(2)]
    writer_results = hammers.ctx.Queue()
    writers = [
        hammers.ctx.Process(
            target=ledger_procs.set_limits, args=("p0", s, writer_results, hammers.start)
        )
        for s in sizes
    ]
    for p in writers:
        p.start()
    hammers.start.set()
    won = []
    for _ in writers:
        won += writer_results.get(timeout=120)["won"]
    hammers.finish(writers)
    revisions = sorted(rev for rev, _ in won)
    assert revisions == list(range(2, 2 + len(won))), "every revision won exactly once"
    assert len(won) >= 60, "at least one writer's worth of changes landed"


def test_kvctl_limit_races_allocation() -> None:
    """``kvctl limit`` (the real command) from two processes on one instance while two
    instances allocate."""
    hammers = _Hammers(2, iterations=2000, seed=20, budget=64 * PAGE)
    n_each = 25
    kv_results, go = hammers.ctx.Queue(), hammers.start
    writers = [
        hammers.ctx.Process(
            target=ledger_procs.kvctl_limits,
            args=("p0", [f"{256 * (w + 1) + k}K" for k in range(n_each)], kv_results, go),
        )
        for w in range(2)
    ]
    for p in writers:
        p.start()
    hammers.start.set()
    codes = [kv_results.get(timeout=120)["codes"] for _ in writers]
    assert codes == [[0] * n_each, [0] * n_each]
    p0 = hammers.led.snapshot().find("p0")  # the hammers are still registered
    assert p0 is not None
    assert p0.limit_revision == 1 + 2 * n_each, "no write lost"
    assert p0.limit in ((256 + n_each - 1) << 10, (512 + n_each - 1) << 10), "a last write won"
    hammers.finish(writers)


# -- with the real page allocator ---------------------------------------------------------


def test_two_page_allocators_in_two_processes_share_a_budget() -> None:
    page = 64 << 10  # tests/memstack.py: one 64 KiB granule per page id
    zero = page  # each cache's zero page (one granule), charged for the allocator's life
    led = GpuLedger.open(UUID, device_total=1024 * MiB)
    led.set_budget(6 * page + 2 * zero)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    steps = {n: ctx.Queue() for n in ("a", "b")}
    procs = {
        n: ctx.Process(target=ledger_procs.allocator_instance, args=(n, UUID, q, results))
        for n, q in steps.items()
    }
    for p in procs.values():
        p.start()

    def step(name: str, what: str) -> dict[str, int]:
        steps[name].put(what)
        out: dict[str, int] = results.get(timeout=120)
        assert out["name"] == name
        assert out["held_pages"] == out["mapped_pages"], "the ledger agrees with the mapper"
        assert out["zero_page_bytes"] == zero
        assert out["ledger_mapped"] == out["mapped_pages"] * page + zero, "pages + zero page"
        return out

    try:
        for q in steps.values():  # each charges its zero page at start: let both start first
            q.put("report")
        assert {results.get(timeout=120)["ledger_mapped"] for _ in steps} == {zero}
        steps["a"].put("fill")  # both fill at once
        steps["b"].put("fill")
        first = {o["name"]: o for o in (results.get(timeout=120) for _ in range(2))}
        assert first["a"]["held_pages"] + first["b"]["held_pages"] == 6
        assert led.snapshot().total_mapped == 6 * page + 2 * zero
        assert step("a", "drop")["mapped_pages"] == 0, "pages went back to the driver"
        assert step("b", "fill")["held_pages"] == 6, "b took what a gave back"
        assert step("a", "fill")["held_pages"] == 0, "a now misses: the budget is b's"
        snap = led.snapshot()
        assert snap.total_mapped == 6 * page + 2 * zero == sum(r.mapped for r in snap.records)
    finally:
        for q in steps.values():
            q.put("stop")
        for p in procs.values():
            p.join(60)
    assert [p.exitcode for p in procs.values()] == [0, 0]
    assert led.snapshot().records == ()


def test_page_allocator_honours_trim_and_a_lowered_limit(ledger: GpuLedger) -> None:
    from tests.memstack import build_stack

    g = gate(ledger, "a")
    stack = build_stack("host", num_blocks=64, blocks_per_page=4, gate=g, reserve_min=2,
                        reserve_max=2, charge_fixed_bytes=None)  # fmt: skip
    page = stack.pages.page_bytes
    zero = stack.cache.zero_page_bytes  # charged (in use, never idle) for the allocator's life
    try:
        assert stack.pages.flush()
        assert (g.record().mapped, g.record().reserve) == (2 * page + zero, 2 * page)
        ledger.request_trim("a", hold_s=60)
        assert stack.pages.flush()  # a refill round after the request sees the trim
        assert (g.record().mapped, g.record().reserve) == (zero, 0), "reserve unmapped"
        ledger.request_trim("a", hold_s=0)
        assert stack.pages.flush()
        assert g.record().reserve == 2 * page, "refilled once the trim ended"
        ids = stack.pages.acquire(4)
        assert ids is not None and stack.pages.flush()
        assert (g.record().mapped, g.record().reserve) == (6 * page + zero, 2 * page)
        ledger.set_limit("a", 2 * page + zero)  # below the 4 pages in use
        assert stack.pages.flush()
        assert (g.record().mapped, g.record().reserve) == (4 * page + zero, 0), "reserve first"
        assert g.record().over_limit
        assert stack.pages.acquire(1) is None, "a miss, not an error"
        stack.pages.release(ids[:3])
        assert stack.pages.flush()
        rec = g.record()  # one page in use; at most one more (reserve) fits the limit
        assert rec.in_use == page + zero and rec.mapped <= 2 * page + zero
        assert not rec.over_limit
        assert stack.pages.acquire(1) is not None
        assert stack.pages.acquire(1) is None
        stack.pages.close()
        assert g.record().mapped == 0, "the zero page's charge ends with the allocator"
    finally:
        stack.close()
    assert g.record().mapped == 0


@pytest.mark.gpu
def test_cuda_backend_keys_the_ledger_by_the_gpu_uuid(capsys: pytest.CaptureFixture[str]) -> None:
    """On a GPU: the ledger is named by the driver's UUID, sized by its total memory, and
    kvtop's bar gets the memory held outside kvcore from the published free figure."""
    from kvcore.cli import kvtop
    from kvcore.vmm import open_backend

    backend = open_backend("cuda", 0)
    try:
        info = backend.mem_info()
        with LedgerGate.from_backend(backend, name="gpu-test", engine="test") as g:
            snap = g.ledger.snapshot()
            assert snap.device_uuid == backend.device_uuid()
            assert snap.path == ledger_path(backend.device_uuid())
            assert snap.device_total == info.total
            assert 0 < snap.device_free <= info.total and snap.device_free_time > 0
            page = backend.granularity()
            assert g.try_acquire(page) and g.record().mapped == page
            assert kvtop.main(["--once"]) == 0
            out = capsys.readouterr().out
            assert "gpu-test" in out and "other unknown" not in out
    finally:
        backend.close()


@pytest.mark.parametrize("size", [1 << 64, 1 << 57, -1])
def test_sizes_the_ledger_cannot_hold_are_refused_by_name(ledger: GpuLedger, size: int) -> None:
    gate(ledger, "a")
    with pytest.raises(LedgerError, match=r"outside 0 \.\. "):
        ledger.set_limit("a", size)
    with pytest.raises(LedgerError, match=r"outside 0 \.\. "):
        ledger.set_budget(size)
    with pytest.raises(LedgerError, match=r"outside 0 \.\. "):
        LedgerGate(ledger, name="b", engine="test", limit=size)


def test_a_request_beyond_any_device_is_a_refusal(ledger: GpuLedger) -> None:
    assert gate(ledger, "a").try_acquire(1 << 64) is False


def test_a_ledger_truncated_while_in_use_is_an_error_not_a_sigbus(ledger: GpuLedger) -> None:
    a = gate(ledger, "a")
    os.truncate(ledger.path, 100)
    with pytest.raises(LedgerError, match="truncated to 100 bytes"):
        a.try_acquire(MiB)
    with pytest.raises(LedgerError, match="truncated"):
        ledger.snapshot()


@pytest.mark.skipif(os.geteuid() != 0, reason="handing the file to another uid needs root")
def test_a_ledger_another_user_owns_is_refused_naming_the_owner(
    ledger: GpuLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.chown(ledger.path, 54321, -1)  # planted by someone else (no such user needed)
    with pytest.raises(LedgerError, match="owned by uid 54321"):
        GpuLedger.open_path(ledger.path)
    monkeypatch.setenv(ledger_file.GROUP_ENV, grp.getgrgid(os.stat(ledger.path).st_gid).gr_name)
    GpuLedger.open_path(ledger.path).close()  # the configured group shares it


@pytest.mark.skipif(shutil.which("setfacl") is None, reason="setfacl is not installed")
def test_a_ledger_with_an_acl_is_refused(ledger: GpuLedger) -> None:
    done = subprocess.run(["setfacl", "-m", "u:54321:rw", str(ledger.path)], check=False)
    if done.returncode != 0:
        pytest.skip("this file system takes no ACLs")
    with pytest.raises(LedgerError, match="ACL"):
        GpuLedger.open_path(ledger.path)
