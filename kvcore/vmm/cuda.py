"""The ``cuda`` backend: CUDA virtual memory management through cuda-python's driver API.

Every primitive is one driver call from ``cuda.bindings.driver`` (whose functions return a
tuple ``(CUresult, *values)``); every result is checked, and a failure raises ``VmmError``
naming the call, its arguments and the ``CUresult`` name (``OutOfDeviceMemory`` for
``CUDA_ERROR_OUT_OF_MEMORY`` from ``cuMemCreate``).

Context: the backend retains the device's *primary* context (the one torch's runtime uses)
and makes it current on whichever thread calls it, once per thread, so the page allocator's
refill thread can call it as well as the scheduler thread.

Hot path. ``create``, ``map``, ``set_access``, ``unmap`` and ``release`` are meant to cost
no more than the bare driver call: the allocation properties and both access descriptors
are built once, the per-thread context check is one attribute read, handle objects are
found without a lock, and an error's context (the call's arguments) is built only once the
call failed.

Physical memory is the driver's pinned device memory (``CU_MEM_ALLOCATION_TYPE_PINNED``);
the POSIX file-descriptor handle type is requested where the device supports it (so
handles could be exported later). ``set_access(...,
writable=False)`` asks for ``CU_MEM_ACCESS_FLAGS_PROT_READ``; should a driver refuse
read-only access to device memory, the backend falls back to read-write once, logs it, and
reports it in ``read_only_supported`` (stray writes then land in the zero page, which the
virtual cache's sanity mode detects).

Needs ``pip install 'kvcore[cuda]'`` (cuda-python); importing this module without it raises
``BackendUnavailable``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any

from kvcore.errors import BackendUnavailable, OutOfDeviceMemory, VmmError
from kvcore.vmm._driver import code_name, device_tensor, unpack
from kvcore.vmm.base import Handle, MemInfo, VmmBackend

try:
    from cuda.bindings import driver as _drv
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailable(
        "the cuda VMM backend needs cuda-python (cuda.bindings.driver)",
        hint="pip install 'kvcore[cuda]'",
    ) from exc

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SUCCESS = _drv.CUresult.CUDA_SUCCESS
_OOM = _drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
_REFUSED = frozenset(
    {_drv.CUresult.CUDA_ERROR_INVALID_VALUE, _drv.CUresult.CUDA_ERROR_NOT_SUPPORTED}
)


def _check(call: str, args: dict[str, object], result: Any) -> Any:
    """Unpack ``(CUresult, *values)``; a failure raises ``VmmError`` (``OutOfDeviceMemory``
    for ``CUDA_ERROR_OUT_OF_MEMORY`` from ``cuMemCreate``)."""
    oom = _OOM if call == "cuMemCreate" else None
    return unpack(call, args, result, success=_SUCCESS, oom=oom)


def _failed(call: str, args: dict[str, object], err: Any) -> VmmError:
    """The error of a failed hot-path call, built only after the failure
    (``OutOfDeviceMemory`` for ``CUDA_ERROR_OUT_OF_MEMORY`` from ``cuMemCreate``)."""
    cls = OutOfDeviceMemory if call == "cuMemCreate" and err == _OOM else VmmError
    return cls(call, args, code_name(err))


def _unknown_handle(call: str, handle: Handle) -> VmmError:
    return VmmError(
        call,
        {"handle": int(handle)},
        "CUDA_ERROR_INVALID_VALUE",
        hint="unknown or released handle",
    )


class _ThreadState(threading.local):
    current = False
    """True once this thread made the backend's context current."""


class CudaBackend(VmmBackend):
    """CUDA VMM on device ordinal ``device``. ``granularity="recommended"`` (default) or
    ``"minimum"`` picks which driver granularity sizes are multiples of."""

    name = "cuda"

    def __init__(self, device: int = 0, *, granularity: str = "recommended") -> None:
        if granularity not in ("recommended", "minimum"):
            raise VmmError(
                "CudaBackend",
                {"granularity": granularity},
                "invalid option",
                hint="use 'recommended' or 'minimum'",
            )
        self.device = device
        self._lock = threading.Lock()
        self._local = _ThreadState()
        # handle key -> the binding's handle object. The hot path reads and writes it with
        # single dict operations (atomic); close() takes its snapshot under _lock
        self._handles: dict[int, Any] = {}
        self._closed = False
        try:
            _check("cuInit", {"flags": 0}, _drv.cuInit(0))
        except Exception as exc:  # no driver library, no device, driver too old
            raise BackendUnavailable(
                f"the CUDA driver cannot be initialised: {exc}",
                hint="check that an NVIDIA GPU and driver are visible (nvidia-smi), or use the "
                "host backend",
            ) from exc
        self._dev = _check("cuDeviceGet", {"ordinal": device}, _drv.cuDeviceGet(device))
        self._ctx = _check(
            "cuDevicePrimaryCtxRetain", {"device": device}, _drv.cuDevicePrimaryCtxRetain(self._dev)
        )
        self._make_current()
        self._prop = self._allocation_prop()
        access = _drv.CUmemAccess_flags
        self._access_rw = [self._access_desc(access.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)]
        self._access_ro = [self._access_desc(access.CU_MEM_ACCESS_FLAGS_PROT_READ)]
        flags = _drv.CUmemAllocationGranularity_flags
        self.min_granularity = int(
            _check(
                "cuMemGetAllocationGranularity",
                {"option": "minimum"},
                _drv.cuMemGetAllocationGranularity(
                    self._prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )
        self.recommended_granularity = int(
            _check(
                "cuMemGetAllocationGranularity",
                {"option": "recommended"},
                _drv.cuMemGetAllocationGranularity(
                    self._prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                ),
            )
        )
        self._granularity = (
            self.recommended_granularity if granularity == "recommended" else self.min_granularity
        )
        self.read_only_supported = True
        """False once the driver refused read-only access (see the module docstring)."""
        self._uuid = self._read_uuid()

    # -- facts ---------------------------------------------------------------------------

    def granularity(self) -> int:
        return self._granularity

    def device_uuid(self) -> str:
        return self._uuid

    def mem_info(self) -> MemInfo:
        self._make_current()
        free, total = _check("cuMemGetInfo", {}, _drv.cuMemGetInfo())
        return MemInfo(free=int(free), total=int(total))

    # -- virtual address space -----------------------------------------------------------

    def reserve(self, size: int) -> int:
        self._make_current()
        ptr = _check(
            "cuMemAddressReserve",
            {"size": size, "alignment": self._granularity},
            _drv.cuMemAddressReserve(size, self._granularity, 0, 0),
        )
        return int(ptr)

    def free_reservation(self, va: int, size: int) -> None:
        self._make_current()
        _check("cuMemAddressFree", {"va": va, "size": size}, _drv.cuMemAddressFree(va, size))

    # -- physical memory -----------------------------------------------------------------

    def create(self, size: int) -> Handle:
        if not self._local.current:
            self._make_current()
        err, handle = _drv.cuMemCreate(size, self._prop, 0)
        if err != _SUCCESS:
            raise _failed("cuMemCreate", {"size": size, "device": self.device}, err)
        key: Handle = int(handle)  # type: ignore[assignment]
        self._handles[key] = handle
        return key

    def release(self, handle: Handle) -> None:
        if not self._local.current:
            self._make_current()
        obj = self._handles.get(handle)
        if obj is None:
            raise _unknown_handle("cuMemRelease", handle)
        (err,) = _drv.cuMemRelease(obj)
        if err != _SUCCESS:
            raise _failed("cuMemRelease", {"handle": int(handle)}, err)
        self._handles.pop(handle, None)

    # -- mappings ------------------------------------------------------------------------

    def map(self, va: int, size: int, handle: Handle) -> None:
        if not self._local.current:
            self._make_current()
        obj = self._handles.get(handle)
        if obj is None:
            raise _unknown_handle("cuMemMap", handle)
        (err,) = _drv.cuMemMap(va, size, 0, obj, 0)
        if err != _SUCCESS:
            raise _failed(
                "cuMemMap", {"va": va, "size": size, "offset": 0, "handle": int(handle)}, err
            )

    def set_access(self, va: int, size: int, *, writable: bool = True) -> None:
        if not self._local.current:
            self._make_current()
        if writable or not self.read_only_supported:
            (err,) = _drv.cuMemSetAccess(va, size, self._access_rw, 1)
            if err != _SUCCESS:
                raise _failed("cuMemSetAccess", {"va": va, "size": size, "writable": True}, err)
            return
        (err,) = _drv.cuMemSetAccess(va, size, self._access_ro, 1)
        if err == _SUCCESS:
            return
        if err not in _REFUSED:
            raise _failed("cuMemSetAccess", {"va": va, "size": size, "writable": False}, err)
        log.warning(
            "kvcore cuda: the driver refused read-only access (%s); mapping the zero page "
            "read-write instead (use sanity mode to catch stray writes)",
            code_name(err),
        )
        self.read_only_supported = False
        (err,) = _drv.cuMemSetAccess(va, size, self._access_rw, 1)
        if err != _SUCCESS:
            raise _failed("cuMemSetAccess", {"va": va, "size": size, "writable": True}, err)

    def unmap(self, va: int, size: int) -> None:
        if not self._local.current:
            self._make_current()
        (err,) = _drv.cuMemUnmap(va, size)
        if err != _SUCCESS:
            raise _failed("cuMemUnmap", {"va": va, "size": size}, err)

    def synchronize(self) -> None:
        if not self._local.current:
            self._make_current()
        (err,) = _drv.cuCtxSynchronize()
        if err != _SUCCESS:
            raise _failed("cuCtxSynchronize", {}, err)

    def as_tensor(self, va: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        self._make_current()
        return device_tensor(va, size, dtype, f"cuda:{self.device}")

    def close(self) -> None:
        """Release the handles this backend still tracks and the primary context. Mappings
        and reservations belong to their owners (``VirtualKVCache.close``). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._handles.items())
            self._handles.clear()
        self._make_current()
        for key, obj in handles:
            result = _drv.cuMemRelease(obj)
            if result[0] != _SUCCESS:
                log.warning(
                    "kvcore cuda: cuMemRelease(%#x) at close: %s", key, code_name(result[0])
                )
        _drv.cuDevicePrimaryCtxRelease(self._dev)

    # -- internals -----------------------------------------------------------------------

    def _make_current(self) -> None:
        if self._local.current:
            return
        _check("cuCtxSetCurrent", {"device": self.device}, _drv.cuCtxSetCurrent(self._ctx))
        self._local.current = True

    def _location(self) -> Any:
        loc = _drv.CUmemLocation()
        loc.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = self.device
        return loc

    def _access_desc(self, flags: Any) -> Any:
        desc = _drv.CUmemAccessDesc()
        desc.location = self._location()
        desc.flags = flags
        return desc

    def _allocation_prop(self) -> Any:
        prop = _drv.CUmemAllocationProp()
        prop.type = _drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = self._location()
        attr = (
            _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        )
        supported = _check(
            "cuDeviceGetAttribute",
            {"attribute": "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "device": self.device},
            _drv.cuDeviceGetAttribute(attr, self._dev),
        )
        handle_types = _drv.CUmemAllocationHandleType
        prop.requestedHandleTypes = (
            handle_types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            if supported
            else handle_types.CU_MEM_HANDLE_TYPE_NONE
        )
        return prop

    def _read_uuid(self) -> str:
        get = getattr(_drv, "cuDeviceGetUuid_v2", None) or _drv.cuDeviceGetUuid
        raw = _check("cuDeviceGetUuid", {"device": self.device}, get(self._dev)).bytes
        if isinstance(raw, str):  # pragma: no cover - bindings that hand back a str
            raw = raw.encode("latin-1")
        return f"GPU-{uuid.UUID(bytes=bytes(raw[:16]))}"
