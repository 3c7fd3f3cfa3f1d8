"""The ``cuda`` backend's call and error handling on CPU, over a stub of
``cuda.bindings.driver`` (``benchmarks/vmm_python_overhead.py``'s): the hot path builds an
error's context only after a failure, so these prove that each failure still raises the
typed error naming the call and its arguments. The stub is installed in ``sys.modules`` for
one test at a time and never touches a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore.errors import OutOfDeviceMemory, VmmError

MiB = 1 << 20
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vmm_python_overhead.py"


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    spec = importlib.util.spec_from_file_location("_kvcore_vmm_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stub: types.ModuleType = bench.stub_driver()
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = stub  # type: ignore[attr-defined]
    cuda.bindings = bindings  # type: ignore[attr-defined]
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", stub)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "kvcore.vmm.cuda", raising=False)
    yield stub
    # never leave a stub-bound backend behind (the package keeps its submodule attribute)
    sys.modules.pop("kvcore.vmm.cuda", None)
    if hasattr(sys.modules["kvcore.vmm"], "cuda"):
        delattr(sys.modules["kvcore.vmm"], "cuda")


def backend(drv: types.ModuleType) -> Any:
    return importlib.import_module("kvcore.vmm.cuda").CudaBackend(0)


def fail_with(code: str) -> Any:
    def call(*args: object) -> tuple[object, ...]:
        return (getattr(sys.modules["cuda.bindings.driver"].CUresult, code),)

    return call


def test_the_happy_path_tracks_handles(drv: types.ModuleType) -> None:
    b = backend(drv)
    h = b.create(2 * MiB)
    b.map(1 << 40, 2 * MiB, h)
    b.set_access(1 << 40, 2 * MiB, writable=False)
    b.unmap(1 << 40, 2 * MiB)
    b.release(h)
    with pytest.raises(VmmError, match="unknown or released handle"):
        b.map(1 << 40, 2 * MiB, h)
    with pytest.raises(VmmError, match="cuMemRelease"):
        b.release(h)
    b.close()


@pytest.mark.parametrize(
    ("call", "op", "shown"),
    [
        ("cuMemMap", lambda b, h: b.map(1 << 40, 2 * MiB, h), "offset=0"),
        ("cuMemSetAccess", lambda b, h: b.set_access(1 << 40, 2 * MiB), "writable=True"),
        ("cuMemUnmap", lambda b, h: b.unmap(1 << 40, 2 * MiB), "size="),
        ("cuMemRelease", lambda b, h: b.release(h), "handle="),
        ("cuCtxSynchronize", lambda b, h: b.synchronize(), "cuCtxSynchronize()"),
    ],
)
def test_a_failed_call_raises_a_vmm_error_naming_it(
    drv: types.ModuleType, monkeypatch: pytest.MonkeyPatch, call: str, op: Any, shown: str
) -> None:
    b = backend(drv)
    h = b.create(2 * MiB)
    monkeypatch.setattr(drv, call, fail_with("CUDA_ERROR_INVALID_VALUE"))
    with pytest.raises(VmmError) as err:
        op(b, h)
    assert type(err.value) is VmmError and err.value.call == call
    assert err.value.code == "CUDA_ERROR_INVALID_VALUE" and shown in str(err.value)
    b.close()


def test_out_of_memory_in_create_is_out_of_device_memory(
    drv: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(drv)
    oom = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    monkeypatch.setattr(drv, "cuMemCreate", lambda size, prop, flags: (oom, None))
    with pytest.raises(OutOfDeviceMemory) as err:
        b.create(2 * MiB)
    assert err.value.args_ == {"size": 2 * MiB, "device": 0}
    b.close()


def test_a_refused_read_only_access_falls_back_to_read_write_once(
    drv: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend(drv)
    flags = drv.CUmemAccess_flags
    ro, rw = flags.CU_MEM_ACCESS_FLAGS_PROT_READ, flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    seen: list[object] = []  # the access flags of each call, as the driver sees them

    def set_access(va: int, size: int, desc: Any, count: int) -> tuple[object, ...]:
        (access,) = desc
        seen.append(access.flags)
        if access.flags == ro:
            return (drv.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
        return (drv.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(drv, "cuMemSetAccess", set_access)
    b.set_access(1 << 40, 2 * MiB, writable=False)
    assert seen == [ro, rw] and b.read_only_supported is False
    b.set_access(1 << 40, 2 * MiB, writable=False)  # read-write straight away from now on
    assert seen[2:] == [rw]
    b.close()


def test_every_thread_makes_the_context_current_once(
    drv: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    b = backend(drv)
    made: list[int] = []
    ok = drv.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(drv, "cuCtxSetCurrent", lambda ctx: (made.append(1), (ok,))[1])
    b.unmap(1 << 40, 2 * MiB)  # this thread did it at construction
    t = threading.Thread(target=lambda: [b.unmap(1 << 40, 2 * MiB) for _ in range(3)])
    t.start()
    t.join()
    assert made == [1]
    b.close()
