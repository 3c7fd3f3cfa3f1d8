"""Helpers shared by the driver-API backends (``cuda``, ``hip``): result unpacking into
typed errors, and wrapping a device address range as a torch tensor without a copy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcore.errors import OutOfDeviceMemory, VmmError

if TYPE_CHECKING:
    import torch


def code_name(err: Any) -> str:
    """The symbolic name of a driver result code (``CUDA_ERROR_OUT_OF_MEMORY``)."""
    name = getattr(err, "name", None)
    return name if isinstance(name, str) else str(err)


def unpack(call: str, args: dict[str, object], result: Any, *, success: Any, oom: Any) -> Any:
    """Unpack a binding's ``(status, *values)`` tuple: raise ``VmmError`` naming ``call``
    and ``args`` unless ``status == success`` (``OutOfDeviceMemory`` when it is ``oom``);
    return ``None``, the one value, or the tuple of values."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:  # a bare status
        err, values = result, ()
    if err != success:
        cls = OutOfDeviceMemory if err == oom else VmmError
        raise cls(call, args, code_name(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class _ArrayInterface:
    """``__cuda_array_interface__`` (v3) of ``size`` bytes at ``va``."""

    def __init__(self, va: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (va, False),
            "strides": None,
            "version": 3,
        }


def device_tensor(va: int, size: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A 1-D ``dtype`` tensor over ``[va, va+size)`` on ``device`` (``cuda:N``; ROCm builds
    of torch use the same name), without a copy: ``data_ptr() == va``."""
    import torch

    raw = torch.as_tensor(_ArrayInterface(va, size), device=device)
    return raw.view(dtype)
