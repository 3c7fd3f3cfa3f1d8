"""What only the host backend promises: real mmap faults, libc errors as VmmError, the
configurable device size, fds that come and go with handles, cross-process accounting."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvcore.errors import BackendUnavailable, OutOfDeviceMemory, VmmError
from kvcore.vmm import open_backend
from kvcore.vmm.host import DEVICE_BYTES_ENV, HostBackend, shared_dir

G = 2 << 20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_device_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_BYTES_ENV, str(6 * G))
    b = HostBackend()
    assert b.mem_info().total == 6 * G
    assert HostBackend(device_bytes=2 * G).mem_info().total == 2 * G  # argument wins
    monkeypatch.setenv(DEVICE_BYTES_ENV, "lots")
    with pytest.raises(VmmError, match=DEVICE_BYTES_ENV):
        HostBackend()


def test_device_uuid_is_stable_and_per_device() -> None:
    a, b, c = HostBackend(0), HostBackend(0), HostBackend(1)
    assert a.device_uuid() == b.device_uuid() != c.device_uuid()
    assert a.device_uuid().startswith("HOST-")


def test_handles_are_memfds_closed_on_release() -> None:
    b = HostBackend(device_bytes=16 * G)
    before = open_fds()
    handles = [b.create(G) for _ in range(4)]
    assert open_fds() == before + 4
    for h in handles:
        b.release(h)
    assert open_fds() == before
    assert b.live_handles == 0


def test_libc_failures_name_the_call_and_errno() -> None:
    b = HostBackend(device_bytes=G)
    with pytest.raises(VmmError) as err:
        b.reserve(1 << 62)  # more address space than the process has
    assert err.value.call == "mmap" and err.value.code == "ENOMEM"
    assert "length=" in str(err.value)


def test_contract_violations_are_refused() -> None:
    b = HostBackend(device_bytes=8 * G)
    va = b.reserve(4 * G)
    h = b.create(2 * G)
    with pytest.raises(VmmError, match="mapped whole"):
        b.map(va, G, h)
    with pytest.raises(VmmError, match="multiples"):
        b.map(va + 1, 2 * G, h)
    with pytest.raises(VmmError, match="reservation"):
        b.map(va + 3 * G, 2 * G, h)  # sticks out of the reservation
    b.map(va, 2 * G, h)
    with pytest.raises(VmmError, match="inside a mapping"):
        b.unmap(va, G)  # half a mapping
    with pytest.raises(VmmError, match="EBUSY"):
        b.free_reservation(va, 4 * G)
    b.unmap(va, 2 * G)
    b.free_reservation(va, 4 * G)
    b.close()
    with pytest.raises(VmmError, match="closed"):
        b.create(G)


def test_create_beyond_the_device_is_out_of_device_memory() -> None:
    b = HostBackend(device_bytes=3 * G)
    b.create(2 * G)
    with pytest.raises(OutOfDeviceMemory) as err:
        b.create(2 * G)
    assert err.value.call == "create" and DEVICE_BYTES_ENV in str(err.value)
    assert b.live_handles == 1


def test_as_tensor_is_the_mapping_itself() -> None:
    b = HostBackend(device_bytes=4 * G)
    va = b.reserve(G)
    h = b.create(G)
    b.map(va, G, h)
    b.set_access(va, G)
    t = b.as_tensor(va, G, torch.bfloat16)
    assert t.data_ptr() == va and t.numel() == G // 2
    t[7] = 1.5
    assert float(b.as_tensor(va, G, torch.bfloat16)[7]) == 1.5


@pytest.mark.parametrize(
    ("action", "setup"),
    [
        pytest.param("read of an unbacked address", "pass", id="unbacked-read"),
        pytest.param(
            "write to a read-only mapping",
            "b.map(va, g, b.create(g)); b.set_access(va, g, writable=False)",
            id="read-only-write",
        ),
    ],
)
def test_faults_are_real(action: str, setup: str) -> None:
    op = "t[0] = 1" if "write" in action else "float(t[0])"
    proc = run_child(
        f"""
        import torch
        from kvcore.vmm.host import HostBackend
        b = HostBackend(device_bytes=1 << 30)
        g = b.granularity()
        va = b.reserve(g)
        {setup}
        t = b.as_tensor(va, g, torch.uint8)
        print("before", flush=True)
        {op}
        print("survived", flush=True)
        """
    )
    assert "before" in proc.stdout, proc.stderr
    assert "survived" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV


def test_shared_accounting_across_processes() -> None:
    device = 1000 + os.getpid() % 1000  # a device id of our own
    parent = HostBackend(device, device_bytes=8 * G, shared_accounting=True)
    path = shared_dir() / f"kvcore-hostdev-{parent.device_uuid()}.json"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from kvcore.vmm.host import HostBackend
                b = HostBackend({device}, device_bytes={8 * G}, shared_accounting=True)
                hs = [b.create({G}) for _ in range(3)]
                print("held", flush=True)
                time.sleep(120)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held"
        assert parent.mem_info().free == 5 * G
        parent.create(4 * G)
        with pytest.raises(OutOfDeviceMemory):
            parent.create(2 * G)  # 3 + 4 + 2 > 8 across the two processes
        child.kill()
        child.wait()  # reaped: its /proc entry is gone, so the next update drops its bytes
        assert parent.mem_info().free == 4 * G  # the dead child's bytes were reclaimed
        parent.close()
        assert parent.mem_info().free == 8 * G
    finally:
        child.kill()
        child.wait()
        Path(path).unlink(missing_ok=True)
        path.with_name(path.name + ".lock").unlink(missing_ok=True)


def test_a_symlink_at_the_shared_count_path_is_refused(tmp_path: Path) -> None:
    device = 2000 + os.getpid() % 1000
    probe = HostBackend(device, device_bytes=8 * G)
    path = shared_dir() / f"kvcore-hostdev-{probe.device_uuid()}.json"
    probe.close()
    victim = tmp_path / "victim"
    victim.write_text("the owner's file")
    path.symlink_to(victim)
    try:
        with pytest.raises(VmmError, match="ELOOP"):
            HostBackend(device, device_bytes=8 * G, shared_accounting=True).create(G)
        assert victim.read_text() == "the owner's file"  # never written through
    finally:
        path.unlink()
        path.with_name(path.name + ".lock").unlink(missing_ok=True)


@pytest.mark.parametrize("content", [b"[1, 2]", b'{"12": "x", "x": [1, 2]}', b"\xff{", b"null"])
def test_wrongly_shaped_shared_count_content_counts_as_empty(content: bytes) -> None:
    device = 3000 + os.getpid() % 1000
    b = HostBackend(device, device_bytes=8 * G, shared_accounting=True)
    path = shared_dir() / f"kvcore-hostdev-{b.device_uuid()}.json"
    try:
        path.write_bytes(content)
        assert b.mem_info().free == 8 * G
        h = b.create(G)
        assert b.mem_info().free == 7 * G
        assert json.loads(path.read_text())[str(os.getpid())][1] == G
        b.release(h)
        assert not list(path.parent.glob(path.name + ".*.tmp"))  # replaced, not left over
    finally:
        b.close()
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".lock").unlink(missing_ok=True)


@pytest.mark.parametrize(("module", "extra"), [("cuda", "cuda"), ("hip", "rocm")])
def test_driver_backends_without_their_library(module: str, extra: str) -> None:
    lib = {"cuda": "cuda.bindings", "hip": "hip"}[module]
    try:
        found = importlib.util.find_spec(lib) is not None
    except ModuleNotFoundError:
        found = False
    if found:
        pytest.skip(f"{lib} is installed here")
    with pytest.raises(BackendUnavailable, match=rf"kvcore\[{extra}\]"):
        open_backend(module)


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(BackendUnavailable, match="cuda, hip, host"):
        open_backend("metal")


def test_a_misspelt_backend_option_is_named_with_the_known_ones() -> None:
    with pytest.raises(BackendUnavailable, match="granularty") as info:
        open_backend("host", granularty=1 << 16)
    assert "granularity" in info.value.hint and "device_bytes" in info.value.hint


def test_a_size_option_larger_than_any_device_is_refused() -> None:
    with pytest.raises(BackendUnavailable, match="outside"):
        open_backend("host", device_bytes=1 << 70)
