"""kvcached as a third mode of ``benchmarks/vllm_colocate.py`` (issue 20, item 6).

kvcached (ovg-project/kvcached 0.1.6) patches upstream vLLM 0.30.0 at import; the GPU
machine gets it with ``benchmarks/kvcached_device.sh`` (docs/colocation-gpu.md, "kvcached
side by side"). It has no GPU-wide budget: each instance maps KV pages up to its own limit
(its logical capacity) while the device's free memory stays above ``1 -
KVCACHED_GPU_UTILIZATION`` of its total. So the mode gives every instance the whole budget
as its logical capacity, as the elastic mode does, and makes the GPU itself the budget:
once the instances are up, a ballast process (``benchmarks/gpu_ballast.py``) holds the
device memory beyond what leaves them the budget to share. Each instance's KV in use comes
from its limit segment, ``/dev/shm/<KVCACHED_IPC_NAME>`` (three little-endian int64:
limit, used, prealloc bytes).

What this module holds: the servers' environment (``server_env``), the segments' reader
(``read_segment``, ``segment_sample``) and the ballast (``Ballast``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BOOT_DIR = ROOT / "benchmarks" / "kvcached_boot"
"""The ``sitecustomize`` that turns kvcached on in every Python process of a server."""
GPU_UTILIZATION = 0.95
"""kvcached's ``KVCACHED_GPU_UTILIZATION`` default: it maps no KV page while the device's
free memory is below ``1 - GPU_UTILIZATION`` of its total."""
SHM_DIR = Path("/dev/shm")
_SEGMENT = struct.Struct("<qqq")


def ipc_name(instance: str) -> str:
    """The ``KVCACHED_IPC_NAME`` of ``instance``: its own, so that instances started
    together do not derive one name and delete each other's worker socket."""
    return "kvc_" + re.sub(r"[^A-Za-z0-9_]", "_", instance)


def server_env(site: Path, instance: str) -> dict[str, str]:
    """What a kvcached ``vllm serve`` of ``instance`` adds to its environment: vLLM 0.30.0's
    site with kvcached built into it (``site``) on ``PYTHONPATH`` after the start-up hook,
    kvcached on, its own IPC name, and the non-contiguous layout that vLLM's layer-outermost
    KV layout needs."""
    return {
        "PYTHONPATH": os.pathsep.join([str(BOOT_DIR), str(site), str(ROOT)]),
        "KVCACHED_SITE": str(site),
        "ENABLE_KVCACHED": "true",
        "KVCACHED_AUTOPATCH": "1",
        "KVCACHED_IPC_NAME": ipc_name(instance),
        "KVCACHED_CONTIGUOUS_LAYOUT": "false",
    }


@dataclass(frozen=True)
class Segment:
    """One instance's kvcached limit segment, in bytes."""

    limit: int
    used: int
    prealloc: int

    @property
    def mapped(self) -> int:
        """KV memory the instance has mapped: in use and its idle preallocated pages."""
        return self.used + self.prealloc


def read_segment(instance: str, shm: Path = SHM_DIR) -> Segment | None:
    """The segment of ``instance`` now; ``None`` while it does not exist (before the server
    made it, after it unlinked it) or is being written short."""
    try:
        raw = (shm / ipc_name(instance)).read_bytes()
    except OSError:
        return None
    if len(raw) < _SEGMENT.size:
        return None
    return Segment(*_SEGMENT.unpack_from(raw))


def segment_sample(instances: Sequence[str], t: float, shm: Path = SHM_DIR) -> dict[str, Any]:
    """One KV-memory sample of kvcached ``instances``, shaped as the benchmark's ledger
    samples (``instances[name]["mapped"]``), at phase clock ``t``."""
    per: dict[str, dict[str, int]] = {}
    for name in instances:
        seg = read_segment(name, shm)
        if seg is not None:
            per[name] = {"mapped": seg.mapped, "used": seg.used, "limit": seg.limit}
    return {"t": round(t, 4), "instances": per, "total_mapped": sum(
        x["mapped"] for x in per.values())}  # fmt: skip


def room_left(budget: int, mapped: int) -> int:
    """KV bytes kvcached instances holding ``mapped`` bytes may still map under ``budget``.
    Raises ``ValueError`` when they already hold more than ``budget``."""
    if mapped > budget:
        raise ValueError(f"kvcached instances hold {mapped} bytes, beyond the budget {budget}")
    return budget - mapped


class Ballast:
    """A ``benchmarks.gpu_ballast`` process holding the device's memory beyond ``room``
    bytes plus the ``1 - utilization`` of its total that kvcached keeps free, until
    ``stop``: kvcached instances can then map ``room`` more bytes and no more. ``start``
    waits for its report (``held``, ``free_after`` and ``device_total`` bytes, ``report``)
    and raises ``RuntimeError`` with its output when it fails or says nothing within
    ``timeout`` seconds."""

    def __init__(
        self, room: int, utilization: float = GPU_UTILIZATION,
        env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.room, self.utilization = room, utilization
        self._env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[str] | None = None
        self.report: dict[str, Any] = {}

    def start(self, timeout: float = 120.0) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "benchmarks.gpu_ballast", "--leave-free", str(self.room),
               "--leave-fraction", repr(1.0 - self.utilization)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=ROOT, env=self._env,
        )  # fmt: skip
        out = self.proc.stdout
        assert out is not None
        # a reader thread, so that a ballast that hangs without a word still times out;
        # None marks the end of its output
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for x in out:
                lines.put(x)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            if line.startswith("{"):
                self.report = json.loads(line)
                return self.report
        self.stop()
        raise RuntimeError("the GPU ballast did not start:\n" + "".join(seen[-20:]))

    def stop(self) -> None:
        """Let the ballast go (its stdin closes; it exits and frees the memory)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
