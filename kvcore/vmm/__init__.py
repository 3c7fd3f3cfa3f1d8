"""GPU virtual-memory backends.

``kvcore.vmm.base.VmmBackend`` is the seam; ``cuda`` (cuda-python driver API), ``hip``
(hip-python) and ``host`` (Linux memfd + mmap, for machines without a GPU) implement it.
``open_backend`` builds one by name; ``kvcore.vmm.faults.FaultInjector`` wraps any of them
for failure-path tests.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from kvcore.errors import BackendUnavailable
from kvcore.vmm.base import Handle, MemInfo, VmmBackend

__all__ = ["BACKENDS", "Handle", "MemInfo", "VmmBackend", "open_backend"]

BACKENDS: dict[str, tuple[str, str]] = {
    "cuda": ("kvcore.vmm.cuda", "CudaBackend"),
    "hip": ("kvcore.vmm.hip", "HipBackend"),
    "host": ("kvcore.vmm.host", "HostBackend"),
}
"""Backend name -> (module, class). The module is imported only when asked for, so a
missing optional driver library only matters to whoever opens that backend."""


def open_backend(name: str, device: int = 0, **options: Any) -> VmmBackend:
    """Open the VMM backend ``name`` on device ordinal ``device``.

    ``options`` go to the backend's constructor (e.g. ``device_bytes=`` for ``host``).
    Raises ``BackendUnavailable`` for an unknown name (listing the known ones) or when the
    backend's driver library is missing (its hint says what to install).
    """
    try:
        module_name, class_name = BACKENDS[name]
    except KeyError:
        raise BackendUnavailable(
            f"unknown VMM backend {name!r}",
            hint=f"use one of: {', '.join(sorted(BACKENDS))}",
        ) from None
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    accepted = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name != "device")
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise BackendUnavailable(
            f"unknown option(s) {unknown} for the {name!r} VMM backend",
            hint=f"its options are: {', '.join(accepted) or 'none'} (backend_options)",
        )
    for key, value in options.items():
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 1 << 56:
            raise BackendUnavailable(
                f"{name!r} VMM backend option {key}={value} is outside 0 .. 2**56",
                hint="give a size no larger than any device",
            )
    backend: VmmBackend = cls(device, **options)
    return backend
