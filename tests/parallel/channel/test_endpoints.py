"""Socket directories: private modes, rank -> path, removal on exit, reclaim after a crash,
refusal of an unsafe root, and the SO_PEERCRED check."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore.errors import ChannelError, PeerRejected
from kvcore.parallel.channel.endpoints import (
    CHANNEL_ENV,
    RUNTIME_DIR_ENV,
    ChannelDirectory,
    channel_dir_from_env,
    check_peer,
    peer_credentials,
    reclaim_stale,
    runtime_base,
    socket_path,
    user_root,
)


@pytest.fixture
def base() -> Iterator[Path]:
    # Short on purpose: Unix socket paths are capped at 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="kvc"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_directory_is_private_and_removed(base: Path) -> None:
    directory = ChannelDirectory.create(base)
    root = directory.path.parent
    assert root.name == f"kvcore-{os.geteuid()}"
    for path in (root, directory.path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert directory.path.name.startswith(f"ch-{os.getpid()}-")
    assert socket_path(directory.path, 3) == directory.path / "rank-3.sock"
    assert directory.env() == {CHANNEL_ENV: str(directory.path)}
    with pytest.raises(ChannelError, match="already exists"):
        ChannelDirectory.create(base)
    directory.remove()
    directory.remove()
    assert not directory.path.exists()


def test_base_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, base: Path) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(base))
    assert runtime_base() == base
    monkeypatch.delenv(RUNTIME_DIR_ENV)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1")
    assert runtime_base() == Path("/run/user/1")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_base() == Path("/tmp")


def test_worker_reads_the_directory_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    with pytest.raises(ChannelError, match=CHANNEL_ENV):
        channel_dir_from_env()
    monkeypatch.setenv(CHANNEL_ENV, "/x/y")
    assert channel_dir_from_env() == Path("/x/y")


def test_unsafe_root_is_refused(base: Path) -> None:
    root = base / f"kvcore-{os.geteuid()}"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o777)
    with pytest.raises(ChannelError, match="not a private directory"):
        user_root(base)
    root.rmdir()
    root.symlink_to(base)
    with pytest.raises(ChannelError, match="not a private directory"):
        user_root(base)


def test_overlong_socket_path_is_refused_with_a_hint() -> None:
    with pytest.raises(ChannelError, match="longer than") as info:
        socket_path(Path("/tmp") / ("d" * 120), 0)
    assert RUNTIME_DIR_ENV in info.value.hint


_CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from kvcore.parallel.channel.endpoints import ChannelDirectory
    d = ChannelDirectory.create(Path(sys.argv[1]))
    (d.path / "rank-0.sock").write_text("")
    print(d.path, flush=True)
    if sys.argv[2] == "crash":
        os.kill(os.getpid(), 9)
    """
)


def _child(base: Path, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(base), how], capture_output=True, text=True
    )
    return proc, Path(proc.stdout.strip())


def test_directory_removed_at_normal_exit(base: Path) -> None:
    proc, path = _child(base, "exit")
    assert proc.returncode == 0, proc.stderr
    assert not path.exists()


def test_crashed_instance_is_reclaimed_by_the_next(base: Path) -> None:
    proc, path = _child(base, "crash")
    assert proc.returncode == -signal.SIGKILL
    assert (path / "rank-0.sock").exists()  # SIGKILL: nothing ran
    live = ChannelDirectory.create(base)  # create reclaims dead owners' directories
    try:
        assert not path.exists()
        assert live.path.exists()
        assert reclaim_stale(base) == []  # a live owner's directory stays
    finally:
        live.remove()


def test_recycled_pid_does_not_keep_a_directory_alive(base: Path) -> None:
    root = user_root(base)
    fake = root / f"ch-{os.getpid()}-1"  # our pid, but not our start time
    fake.mkdir()
    assert reclaim_stale(base) == [fake]


def test_peer_credentials_of_a_socket_pair() -> None:
    a, b = socket.socketpair()
    with a, b:
        cred = peer_credentials(a)
        assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.geteuid(), os.getegid())
        assert check_peer(a) == cred
        with pytest.raises(PeerRejected, match=f"uid {os.geteuid()}, expected uid"):
            check_peer(a, uid=os.geteuid() + 1)
