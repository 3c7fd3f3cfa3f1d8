"""The ``hip`` backend: ROCm virtual memory management through hip-python's ``hipMem*`` API.

UNTESTED: this module is written against hip-python's documented API (functions return a
tuple ``(hipError_t, *values)``, like cuda-python) and has never run: kvcore has no AMD GPU
to test on, and ``compat/matrix.toml`` marks every ``rocm`` combination ``untested``.
Expect to fix details on first contact with a real ROCm machine; run
``pytest tests/vmm tests/memory/test_virtual_cache.py`` there with a ``hip`` entry added to
``tests/vmm_backends.py``.

It mirrors ``kvcore.vmm.cuda``: ``hipMemAddressReserve`` / ``hipMemCreate`` (pinned device
memory) / ``hipMemMap`` / ``hipMemSetAccess`` / ``hipMemUnmap`` / ``hipMemRelease``; the
device is made current (``hipSetDevice``) once on each calling thread. Tensors are made
through ``__cuda_array_interface__``, which ROCm builds of torch accept under the ``cuda``
device name.

Needs ``pip install 'kvcore[rocm]'`` (hip-python); importing this module without it raises
``BackendUnavailable``.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING, Any

from kvcore.errors import BackendUnavailable, VmmError
from kvcore.vmm._driver import device_tensor, unpack
from kvcore.vmm.base import Handle, MemInfo, VmmBackend

try:
    from hip import hip as _hip
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailable(
        "the hip VMM backend needs hip-python", hint="pip install 'kvcore[rocm]'"
    ) from exc

if TYPE_CHECKING:
    import torch

_SUCCESS = _hip.hipError_t.hipSuccess
_OOM = _hip.hipError_t.hipErrorOutOfMemory


def _check(call: str, args: dict[str, object], result: Any) -> Any:
    oom = _OOM if call == "hipMemCreate" else None
    return unpack(call, args, result, success=_SUCCESS, oom=oom)


class HipBackend(VmmBackend):
    """HIP VMM on device ordinal ``device`` (untested; see the module docstring)."""

    name = "hip"

    def __init__(self, device: int = 0, *, granularity: str = "recommended") -> None:
        self.device = device
        self._lock = threading.Lock()
        self._local = threading.local()
        self._handles: dict[int, Any] = {}
        self._closed = False
        try:
            self._make_current()
        except Exception as exc:
            raise BackendUnavailable(
                f"HIP device {device} cannot be used: {exc}",
                hint="check rocm-smi, or use the host backend",
            ) from exc
        self._prop = _hip.hipMemAllocationProp()
        self._prop.type = _hip.hipMemAllocationType.hipMemAllocationTypePinned
        self._prop.location = self._location()
        flags = _hip.hipMemAllocationGranularity_flags
        option = (
            flags.hipMemAllocationGranularityRecommended
            if granularity == "recommended"
            else flags.hipMemAllocationGranularityMinimum
        )
        self._granularity = int(
            _check(
                "hipMemGetAllocationGranularity",
                {"option": granularity},
                _hip.hipMemGetAllocationGranularity(self._prop, option),
            )
        )
        raw = _check("hipDeviceGetUuid", {"device": device}, _hip.hipDeviceGetUuid(device))
        self._uuid = f"GPU-{uuid.UUID(bytes=bytes(raw.bytes)[:16])}"

    def granularity(self) -> int:
        return self._granularity

    def device_uuid(self) -> str:
        return self._uuid

    def mem_info(self) -> MemInfo:
        self._make_current()
        free, total = _check("hipMemGetInfo", {}, _hip.hipMemGetInfo())
        return MemInfo(free=int(free), total=int(total))

    def reserve(self, size: int) -> int:
        self._make_current()
        ptr = _check(
            "hipMemAddressReserve",
            {"size": size, "alignment": self._granularity},
            _hip.hipMemAddressReserve(size, self._granularity, None, 0),
        )
        return int(ptr)

    def free_reservation(self, va: int, size: int) -> None:
        self._make_current()
        _check("hipMemAddressFree", {"va": va, "size": size}, _hip.hipMemAddressFree(va, size))

    def create(self, size: int) -> Handle:
        self._make_current()
        handle = _check(
            "hipMemCreate",
            {"size": size, "device": self.device},
            _hip.hipMemCreate(size, self._prop, 0),
        )
        key = int(handle)
        with self._lock:
            self._handles[key] = handle
        return Handle(key)

    def release(self, handle: Handle) -> None:
        self._make_current()
        obj = self._handle("hipMemRelease", handle)
        _check("hipMemRelease", {"handle": int(handle)}, _hip.hipMemRelease(obj))
        with self._lock:
            self._handles.pop(int(handle), None)

    def map(self, va: int, size: int, handle: Handle) -> None:
        self._make_current()
        obj = self._handle("hipMemMap", handle)
        _check(
            "hipMemMap",
            {"va": va, "size": size, "offset": 0, "handle": int(handle)},
            _hip.hipMemMap(va, size, 0, obj, 0),
        )

    def set_access(self, va: int, size: int, *, writable: bool = True) -> None:
        self._make_current()
        flags = _hip.hipMemAccessFlags
        desc = _hip.hipMemAccessDesc()
        desc.location = self._location()
        desc.flags = (
            flags.hipMemAccessFlagsProtReadWrite if writable else flags.hipMemAccessFlagsProtRead
        )
        _check(
            "hipMemSetAccess",
            {"va": va, "size": size, "writable": writable},
            _hip.hipMemSetAccess(va, size, [desc], 1),
        )

    def unmap(self, va: int, size: int) -> None:
        self._make_current()
        _check("hipMemUnmap", {"va": va, "size": size}, _hip.hipMemUnmap(va, size))

    def synchronize(self) -> None:
        self._make_current()
        _check("hipDeviceSynchronize", {}, _hip.hipDeviceSynchronize())

    def as_tensor(self, va: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        self._make_current()
        return device_tensor(va, size, dtype, f"cuda:{self.device}")

    def close(self) -> None:
        """Release the handles this backend still tracks. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._handles.values())
            self._handles.clear()
        for obj in handles:
            _hip.hipMemRelease(obj)

    def _make_current(self) -> None:
        if getattr(self._local, "current", False):
            return
        _check("hipSetDevice", {"device": self.device}, _hip.hipSetDevice(self.device))
        self._local.current = True

    def _handle(self, call: str, handle: Handle) -> Any:
        with self._lock:
            obj = self._handles.get(int(handle))
        if obj is None:
            raise VmmError(
                call, {"handle": int(handle)}, "hipErrorInvalidValue", hint="unknown handle"
            )
        return obj

    def _location(self) -> Any:
        loc = _hip.hipMemLocation()
        loc.type = _hip.hipMemLocationType.hipMemLocationTypeDevice
        loc.id = self.device
        return loc
