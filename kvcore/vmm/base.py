"""The virtual-memory backend seam every higher layer of kvcore is written against.

A backend exposes the five primitives of GPU virtual memory management (reserve a VA range,
create a physical handle, map it, set access, unmap) plus the facts the allocator needs
(granularity, free/total memory, a stable device id). All sizes and addresses are bytes and
must be multiples of ``granularity()`` unless stated otherwise.

Contract for every method:

* It either completes fully or raises, leaving nothing half done that the caller cannot see
  (a failed ``map`` leaves the range unmapped; a failed ``create`` leaves no handle).
* Failures raise ``kvcore.errors.VmmError`` naming the call and its arguments;
  ``OutOfDeviceMemory`` (a subclass) when ``create`` finds no physical memory left.
* Methods are safe to call from any thread; a backend serialises internally where its driver
  needs it.

Mapping unit: a handle is mapped whole (``map`` of a handle at a non-zero offset is
unsupported on CUDA), so a caller that wants several address ranges per page creates several
handles or one handle per range. A handle may be mapped at several addresses at once (the
zero page relies on this).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    import torch

Handle = NewType("Handle", int)
"""An opaque physical-memory handle, valid only with the backend that created it."""


@dataclass(frozen=True)
class MemInfo:
    """Physical memory on the device, in bytes."""

    free: int
    total: int


class VmmBackend(abc.ABC):
    """One device's virtual-memory driver. Create with the backend's constructor; ``close``
    releases everything the backend still tracks (handles, reservations)."""

    name: str
    """``cuda``, ``hip`` or ``host``."""

    device: int
    """Device ordinal this backend drives."""

    @abc.abstractmethod
    def granularity(self) -> int:
        """The mapping granularity in bytes (2 MiB on the H200). Every size passed to
        ``reserve``, ``create``, ``map``, ``unmap`` and ``set_access`` is a multiple of it."""

    @abc.abstractmethod
    def device_uuid(self) -> str:
        """A stable id of the physical device (GPU UUID; a machine-local id for ``host``).
        The per-GPU ledger is keyed by it."""

    @abc.abstractmethod
    def mem_info(self) -> MemInfo:
        """Free and total physical memory of the device as the driver sees it now."""

    @abc.abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space, unbacked; returns its base
        address. Reading an unbacked address faults: map the zero page first."""

    @abc.abstractmethod
    def free_reservation(self, va: int, size: int) -> None:
        """Give back a reservation made by ``reserve``. Every mapping in it must be gone."""

    @abc.abstractmethod
    def create(self, size: int) -> Handle:
        """Create ``size`` bytes of physical memory. Raises ``OutOfDeviceMemory`` when the
        device has too little free."""

    @abc.abstractmethod
    def release(self, handle: Handle) -> None:
        """Release a handle. Physical memory returns to the device once no mapping of the
        handle remains."""

    @abc.abstractmethod
    def map(self, va: int, size: int, handle: Handle) -> None:
        """Map the whole of ``handle`` (``size`` bytes) at ``va`` inside a reservation.
        The range must be unmapped. Access must then be granted with ``set_access``."""

    @abc.abstractmethod
    def set_access(self, va: int, size: int, *, writable: bool = True) -> None:
        """Grant this device read (and, if ``writable``, write) access to a mapped range.
        The range may span several mappings, each covered whole (``cuMemSetAccess`` takes
        any fully mapped range; a backend must do the same: the zero page and
        ``LocalPageMapper``'s runs of pages rely on it)."""

    @abc.abstractmethod
    def unmap(self, va: int, size: int) -> None:
        """Remove the mappings of ``[va, va+size)``: one, or several each covered whole (as
        for ``set_access``). The handles stay valid."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until every kernel that may read or write mapped memory has finished.
        Called before an unmap takes memory away from running work."""

    @abc.abstractmethod
    def as_tensor(self, va: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``size`` bytes viewing ``[va, va+size)`` without a copy; its
        ``data_ptr()`` is ``va``. The caller keeps the range reserved while it lives."""

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release whatever the backend still tracks. Idempotent."""
