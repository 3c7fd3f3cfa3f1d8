"""Block ids from kvcore's host ledger to the GPU through one pinned buffer, without waiting.

The elastic allocators get the ids they hand SGLang from the ledger on the host, as an
``array('q')``, and must put them on the GPU without waiting for the work already queued on
the stream (under SGLang's overlap scheduler, the next batch's forward pass): a copy from
pageable memory would wait for it, so the copy must come from pinned memory. A pinned
tensor per copy (``pin_memory()``) is an allocation from torch's pinned-memory cache on the
scheduler's thread at every allocation of scattered ids, that is at nearly every decode
step.

``PinnedStaging`` allocates its pinned buffer once, as two halves. Each id list is written
into the current half (a host ``memcpy``, no torch call) and the copy of that slice to the
device is queued behind the current stream's work. Invariant: a slice is not written again
before the copy from it has run. Leaving a half records an event behind the last copy from
it on every stream a copy from it was queued on (SGLang's scheduler allocates on its
schedule stream: one); coming back to a half first waits for those events. They were
recorded a whole half's worth of ids earlier, so the wait is normally already over. A list
larger than a half takes a pinned tensor of its own, as before.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["PinnedStaging"]

HALF_IDS = 1 << 16
"""Ids one half holds (512 KiB of int64): 256 decode steps at a batch of 256, or 16
allocations of 4,096 scattered ids."""


class Marker(Protocol):
    """What marks a half's copies done: ``torch.cuda.Event``'s two methods used here."""

    def record(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...


class PinnedStaging:
    """Copies of id lists to ``device`` through a pinned buffer of two halves of ``half``
    ids each (module docstring). ``pin`` says whether to pin the buffer (a CUDA device).
    ``event`` makes the marker recorded behind a half's last copy on a stream
    (``torch.cuda.Event``) and ``stream`` names the stream a copy is queued on
    (``torch.cuda.current_stream``); tests give their own."""

    def __init__(
        self,
        device: torch.device | str,
        pin: bool = True,
        half: int = HALF_IDS,
        event: Callable[[], Marker] = torch.cuda.Event,
        stream: Callable[[], Any] = torch.cuda.current_stream,
    ) -> None:
        self._device = device
        self._pin = pin
        self._half = half
        self._event = event
        self._stream = stream
        self._buffer = torch.empty(2 * half, dtype=torch.int64, pin_memory=pin)
        self._host = self._buffer.numpy()  # the same memory: writes without a torch call
        self._side = 0
        self._at = 0
        """Ids written into the current half (its next free slot)."""
        self._streams: list[list[Any]] = [[], []]
        """Per half: the streams copies from it were queued on since it was last entered."""
        self._left: list[list[Marker]] = [[], []]
        """Per half: the events recorded behind its copies when it was left, until waited."""

    def to_device(self, ids: array[int]) -> torch.Tensor:
        """``ids`` (int64, not empty) as a new int64 tensor on the device, its copy queued
        on the current stream without waiting for the work before it. The caller reads
        the result on that stream (as SGLang's kernels do). May wait for a copy queued a
        half's worth of ids earlier, when that has not run yet."""
        n = len(ids)
        if n > self._half:
            own = torch.frombuffer(ids, dtype=torch.int64)
            if self._pin:
                own = own.pin_memory()
            return own.to(self._device, non_blocking=True, copy=True)
        if self._at + n > self._half:
            self._switch()
        stream = self._stream()
        streams = self._streams[self._side]
        if stream not in streams:
            streams.append(stream)
        start = self._side * self._half + self._at
        self._host[start : start + n] = np.frombuffer(ids, dtype=np.int64)
        self._at += n
        # copy=True: on the CPU (tests) ``to`` would otherwise return the buffer itself
        return self._buffer[start : start + n].to(self._device, non_blocking=True, copy=True)

    def _switch(self) -> None:
        """Leave the current half (an event behind its copies on each of their streams) for
        the other one, once every copy from the other one has run."""
        side = self._side
        for stream in self._streams[side]:
            done = self._event()
            done.record(stream)
            self._left[side].append(done)
        self._streams[side] = []
        side ^= 1
        self._side, self._at = side, 0
        for waiting in self._left[side]:
            waiting.synchronize()
        self._left[side] = []
