"""Real worker processes for channel tests: each runs a host-backed ``VirtualKVCache`` +
``LocalPageMapper`` behind a ``WorkerListener``, plus a control pipe through which the test
inspects its page states, writes and reads data through its KV tensor view, injects faults
(``FaultInjector``) and arranges for the process to kill itself inside a mapper call.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvcore.parallel.channel import ChannelCoordinator, ChannelDirectory, WorkerListener

GRANULARITY = 64 << 10  # host backend; CUDA's is 2 MiB
BLOCKS_PER_PAGE = 4
NUM_PAGES = 8
KV_BUFFERS = 2


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int = 1
    layers_per_stage: tuple[int, ...] = (2, 4)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def layers(self, rank: int) -> int:
        return self.layers_per_stage[(rank // self.tp) % len(self.layers_per_stage)]


def block_bytes_for(granularity: int) -> int:
    """Block bytes such that a 2-layer page id is exactly one granule."""
    return granularity // (BLOCKS_PER_PAGE * KV_BUFFERS * 2)


def page_bytes_for(layers: int, granularity: int = GRANULARITY) -> int:
    return BLOCKS_PER_PAGE * block_bytes_for(granularity) * layers * KV_BUFFERS


class _Hooked:
    """A ``PageMapper`` that forwards to the real one and, when told, kills its own process
    (SIGKILL) on the n-th call of an operation, before or after applying it, or stalls that
    call for some seconds (a slow worker)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.die: dict[str, tuple[int, str]] = {}
        self.stall: dict[str, tuple[int, float]] = {}
        self.calls: dict[str, int] = {}

    @property
    def num_pages(self) -> int:
        return int(self.inner.num_pages)

    @property
    def page_bytes(self) -> int:
        return int(self.inner.page_bytes)

    def _call(self, op: str, pages: Sequence[int]) -> None:
        self.calls[op] = n = self.calls.get(op, 0) + 1
        nth, when = self.die.get(op, (0, ""))
        stall_nth, seconds = self.stall.get(op, (0, 0.0))
        if n == stall_nth:
            time.sleep(seconds)
        if n == nth and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        getattr(self.inner, op)(pages)
        if n == nth and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    def map(self, pages: Sequence[int]) -> None:
        self._call("map", pages)

    def prepare_unmap(self, pages: Sequence[int]) -> None:
        self._call("prepare_unmap", pages)

    def commit_unmap(self, pages: Sequence[int]) -> None:
        self._call("commit_unmap", pages)

    def abort_unmap(self, pages: Sequence[int]) -> None:
        self._call("abort_unmap", pages)

    @property
    def held_bytes(self) -> int:
        return int(self.inner.held_bytes)

    @property
    def fixed_bytes(self) -> int:
        return int(self.inner.fixed_bytes)

    @property
    def pooled_pages(self) -> int:
        return int(self.inner.pooled_pages)

    def trim_pool(self) -> None:
        self.inner.trim_pool()

    def close(self) -> None:
        self.inner.close()


def worker_main(
    channel_dir: str, rank: int, layers: int, backend_name: str, control: Connection
) -> None:
    """Entry point of one worker process."""
    import torch

    from kvcore.memory.geometry import KVGeometry
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm import open_backend
    from kvcore.vmm.faults import FaultInjector

    if backend_name == "host":
        backend = FaultInjector(
            open_backend("host", device_bytes=64 << 20, granularity=GRANULARITY)
        )
    else:  # every worker shares GPU 0, as TP workers sharing one GPU in the GPU test
        backend = FaultInjector(open_backend(backend_name, 0))
    gran = backend.granularity()
    geometry = KVGeometry(
        num_layers=layers,
        kv_buffers=KV_BUFFERS,
        block_bytes=block_bytes_for(gran),
        num_blocks=NUM_PAGES * BLOCKS_PER_PAGE,
        page_bytes=page_bytes_for(layers, gran),
        granularity=gran,
        layout="compound",
    )
    cache = VirtualKVCache(backend, geometry, dtype=torch.uint8)
    local = LocalPageMapper(cache)
    mapper = _Hooked(local)
    listener = WorkerListener(mapper, rank=rank, channel_dir=channel_dir).start()
    control.send(("ready", os.getpid()))
    while True:
        cmd, *args = control.recv()
        if cmd == "states":
            control.send([local.state(p).value for p in range(local.num_pages)])
        elif cmd == "write":  # every layer's K and V of every block of the page
            page, value = args
            for block in geometry.blocks_of(page):
                for layer in range(layers):
                    for buf in range(KV_BUFFERS):
                        cache.view(layer, buf)[block].fill_(value)
            control.send(None)
        elif cmd == "read":  # the set of byte values found in the page's blocks
            page = args[0]
            seen: set[int] = set()
            for block in geometry.blocks_of(page):
                for layer in range(layers):
                    for buf in range(KV_BUFFERS):
                        seen.update(cache.view(layer, buf)[block].unique().tolist())
            control.send(sorted(seen))
        elif cmd == "fail":
            kind, nth, times, after = args
            backend.fail(kind, nth=nth, times=times, after=after)
            control.send(None)
        elif cmd == "clear":
            backend.clear()
            control.send(None)
        elif cmd == "die":
            op, nth, when = args
            mapper.die[op] = (mapper.calls.get(op, 0) + nth, when)
            control.send(None)
        elif cmd == "stall":
            op, nth, seconds = args
            mapper.stall[op] = (mapper.calls.get(op, 0) + nth, seconds)
            control.send(None)
        elif cmd == "trim":
            local.trim_pool(0)
            control.send(None)
        elif cmd == "held":  # device bytes of the mapper's handles, from the backend's books
            control.send((len(backend.live_handles) - 1) * geometry.page_bytes)
        elif cmd == "listener":
            control.send((list(listener.rejected), listener.sessions, listener.closed))
        elif cmd == "stop":
            listener.close()
            local.close()
            cache.close()
            control.send(None)
            return


class Cluster:
    """``topology.world_size`` worker processes and a coordinator over them."""

    def __init__(self, topology: Topology, *, timeout: float = 20.0, backend: str = "host") -> None:
        self.topology = topology
        self.base = Path(tempfile.mkdtemp(prefix="kvc"))
        self.directory = ChannelDirectory.create(self.base)
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Connection] = []
        for rank in range(topology.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(str(self.directory.path), rank, topology.layers(rank), backend, theirs),
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
            self.pipes.append(ours)
        self.pids = [self._ask(rank, timeout=120)[1] for rank in range(topology.world_size)]
        self.coordinator = ChannelCoordinator(
            self.directory, world_size=topology.world_size, timeout=timeout
        )

    def _ask(self, rank: int, *msg: Any, timeout: float = 30) -> Any:
        pipe = self.pipes[rank]
        if msg:
            pipe.send(msg)
        if not pipe.poll(timeout):
            raise TimeoutError(f"worker {rank} did not answer {msg!r}")
        return pipe.recv()

    def alive(self, rank: int) -> bool:
        return bool(self.procs[rank].is_alive())

    def live_ranks(self) -> list[int]:
        return [r for r in range(self.topology.world_size) if self.alive(r)]

    def states(self, rank: int) -> list[str]:
        return list(self._ask(rank, "states"))

    def write(self, rank: int, page: int, value: int) -> None:
        self._ask(rank, "write", page, value)

    def read(self, rank: int, page: int) -> list[int]:
        return list(self._ask(rank, "read", page))

    def fail(
        self, rank: int, kind: str, nth: int = 1, *, times: int = 1, after: bool = False
    ) -> None:
        self._ask(rank, "fail", kind, nth, times, after)

    def clear(self, rank: int) -> None:
        self._ask(rank, "clear")

    def die(self, rank: int, op: str, nth: int = 1, when: str = "before") -> None:
        self._ask(rank, "die", op, nth, when)

    def stall(self, rank: int, op: str, seconds: float, nth: int = 1) -> None:
        self._ask(rank, "stall", op, nth, seconds)

    def trim(self, rank: int) -> None:
        self._ask(rank, "trim")

    def held(self, rank: int) -> int:
        """Device bytes the rank's mapper holds (every live handle but the zero page)."""
        return int(self._ask(rank, "held"))

    def listener(self, rank: int) -> tuple[list[str], int, bool]:
        rejected, sessions, closed = self._ask(rank, "listener")
        return list(rejected), int(sessions), bool(closed)

    def socket(self, rank: int) -> Path:
        return self.directory.path / f"rank-{rank}.sock"

    def close(self) -> None:
        try:
            self.coordinator.close()
        finally:
            for rank, proc in enumerate(self.procs):
                if proc.is_alive():
                    with contextlib.suppress(TimeoutError, OSError, EOFError):
                        self._ask(rank, "stop", timeout=10)
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            self.directory.remove()
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
