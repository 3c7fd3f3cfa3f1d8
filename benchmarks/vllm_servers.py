"""``vllm serve`` processes for the serving benchmarks (``vllm_serve.py``, ``vllm_colocate.py``).

Each server runs in its own session (``start_new_session``), so its API server, engine core
and workers are one process group to signal, one session to find in ``/proc`` and in NVML's
process list. Stopping stops the engine core first with SIGTERM (vLLM's own SIGINT path
kills it at once, so kvcore's shutdown summary would never be logged), then the session with
SIGINT, then SIGKILL. Standard library only at import (``MemorySampler`` imports pynvml).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
"""How the benchmarks start vLLM's CLI (the interpreter running them)."""


def procs() -> list[tuple[int, str, list[str]]]:
    """Every live process: pid, name and the ``/proc/<pid>/stat`` fields after the name
    (state, ppid, pgrp, session, ..., utime at 11, stime at 12)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        found.append((int(stat.parent.name), name, text.rsplit(")", 1)[1].split()))
    return found


def session_of(pid: int) -> int | None:
    """The session id of ``pid``; ``None`` when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[3])


def engine_cores(session: int) -> list[int]:
    """The live ``EngineCore`` processes of ``session`` (vLLM names them ``VLLM::EngineCore``,
    cut to 15 characters; a zombie no longer counts)."""
    return [
        pid
        for pid, name, fields in procs()
        if "EngineCor" in name and fields[0] != "Z" and int(fields[3]) == session
    ]


def cpu_seconds(session: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the live processes of ``session``, by name."""
    tick = os.sysconf("SC_CLK_TCK")
    got: dict[str, float] = {}
    for _, name, fields in procs():
        if int(fields[3]) == session:
            got[name] = got.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return got


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per key of ``after`` (a key new in ``after`` counts from 0)."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """The Prometheus samples of ``names`` in ``text`` (``/metrics``), summed over labels.
    A name written ``metric{label}`` keeps ``label`` apart: one key per value, written as
    Prometheus does (``metric{label="value"}``), each summed over the other labels."""
    split: dict[str, str | None] = {}
    for spec in names:
        base, _, label = spec.partition("{")
        split[base] = label.rstrip("}") or None
    got: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split(" ", 1)[0].split("{", 1)[0]
        if name not in split:
            continue
        key = name
        kept = split[name]  # the label whose values stay apart, if any
        if kept is not None:
            value = re.search(rf'[{{,]{re.escape(kept)}="([^"]*)"', line)
            key = f'{name}{{{kept}="{value.group(1) if value else ""}"}}'
        with contextlib.suppress(ValueError, IndexError):
            got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


class ServeProcess:
    """One server (``cmd``: ``vllm serve``, or SGLang's ``launch_server``) in its own session
    on ``port``, its output appended to ``log_path``; ``label`` names it in messages."""

    def __init__(
        self, cmd: Sequence[str], env: Mapping[str, str], port: int, log_path: Path, label: str
    ) -> None:
        self.cmd, self.port, self.log_path, self.label = list(cmd), port, log_path, label
        _let_children_take_sigint()
        self._log = log_path.open("ab")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(env),
        )  # fmt: skip
        self.start_s: float | None = None
        """Seconds from launch to the first healthy ``/health``."""

    def ready(self) -> bool:
        """Whether ``/health`` answers 200. Raises ``RuntimeError`` with the log's tail when
        the server has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"server {self.label!r} exited with {self.proc.returncode}\n" + self.log_tail(3000)
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                ok = bool(r.status == 200)
        except OSError:
            return False
        if ok and self.start_s is None:
            self.start_s = round(time.monotonic() - self.t0, 1)
        return ok

    def metrics(self, names: Sequence[str]) -> dict[str, float]:
        """``names`` from the server's ``/metrics`` (``parse_metrics``); {} on failure."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                return parse_metrics(r.read().decode(), names)
        except OSError:
            return {}

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the server's output."""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        """``stop_all([self])``."""
        stop_all([self])


def wait_ready(servers: Sequence[ServeProcess], timeout: float) -> None:
    """Poll every server's ``/health`` once a second until all answer. Raises
    ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError`` (``ready``) when one exits."""
    deadline = time.monotonic() + timeout
    while not all(s.ready() for s in servers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers not ready after {timeout:.0f} s")
        time.sleep(1.0)


def _let_children_take_sigint() -> None:
    """Make the servers started from here interruptible: a process started from a
    non-interactive shell's background job (``cmd &``, ``nohup``) ignores SIGINT, and an
    ignored signal stays ignored across ``exec``, so ``stop_all``'s SIGINT would reach
    nothing and each stop would wait for SIGKILL. A handler is reset to the default at
    ``exec``, so installing Python's own here lets the servers (Python too) install theirs.
    Only the main thread may; elsewhere nothing changes."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_all(servers: Sequence[ServeProcess]) -> None:
    """Stop every server at once: SIGTERM to each engine core (so kvcore's shutdown runs and
    its summary reaches the log), up to 30 s for them to exit, then SIGINT to each session,
    60 s, then SIGKILL; their logs are closed. Idempotent."""
    live = [s for s in servers if s.proc.poll() is None]
    for s in live:
        for pid in engine_cores(s.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while any(engine_cores(s.proc.pid) for s in live) and time.monotonic() < deadline:
        time.sleep(0.5)
    for s in live:
        if s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    for s in live:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
    for s in servers:
        s._log.close()


class SessionMemory:
    """Device memory held per server, from NVML's process list: ``read()`` maps each label of
    ``sessions`` (session id -> label) whose processes NVML lists to the bytes they hold
    (a server NVML does not list is absent). GPU 0."""

    def __init__(self, sessions: dict[int, str]) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self._sessions = sessions

    def read(self) -> dict[str, int]:
        held: dict[str, int] = {}
        try:
            running = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return held
        for p in running:
            label = self._sessions.get(session_of(p.pid))  # type: ignore[arg-type]
            if label is not None and p.usedGpuMemory is not None:
                held[label] = held.get(label, 0) + int(p.usedGpuMemory)
        return held


def wait_down_to(
    read: Callable[[], int],
    target: int,
    *,
    timeout_s: float = 60.0,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll ``read()`` (bytes a server holds) every ``poll_s`` until it is at most ``target``
    or ``timeout_s`` has passed. Returns ``from`` (the first reading), ``to`` (the last),
    ``s`` (seconds until ``target`` was reached, or until the timeout) and ``reached``."""
    start = clock()
    first = got = read()
    while got > target and clock() - start < timeout_s:
        sleep(poll_s)
        got = read()
    return {"from": first, "to": got, "s": round(clock() - start, 3), "reached": got <= target}


class MemorySampler:
    """Device memory in use every ``interval`` seconds on a thread (NVML, bytes): the device
    total, and per server (the processes of its session, ``sessions`` maps session id to
    label; ``SessionMemory``) where NVML lists processes. Each sample also says how busy the
    machine was (``MACHINE_KEYS``): a run slowed by something else on the host or a throttled
    GPU shows there, not only in its latencies."""

    def __init__(self, sessions: dict[int, str], interval: float = 0.5) -> None:
        self._servers = SessionMemory(sessions)
        self._nvml = self._servers.nvml
        self._handle = self._servers.handle
        self.interval = interval
        self.t0 = time.monotonic()
        self.series: list[dict[str, Any]] = []
        self.phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _machine(self) -> dict[str, float]:
        # informative only: a driver or binding without one of these leaves it out, and
        # never stops the memory samples
        nvml, h = self._nvml, self._handle
        got: dict[str, float] = {"load1": os.getloadavg()[0]}
        with contextlib.suppress(Exception):
            got["gpu_util"] = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        with contextlib.suppress(Exception):
            got["sm_mhz"] = float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        return got

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            t = round(time.monotonic() - self.t0, 2)
            self.series.append({"t": t, "phase": self.phase, "used": used,
                                **self._machine(), **self._servers.read()})  # fmt: skip

    def close(self) -> list[dict[str, Any]]:
        """Stop sampling; the series."""
        self._stop.set()
        self._thread.join()
        return self.series


MACHINE_KEYS = ("load1", "gpu_util", "sm_mhz")
"""What ``MemorySampler`` samples of the machine: the host's 1-minute load average, the
GPU's utilization (percent of time a kernel ran) and its SM clock (MHz)."""


def machine_summary(series: Sequence[Mapping[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Median and maximum of each ``MACHINE_KEYS`` value over the samples of ``series`` with
    ``t0 <= t <= t1`` (``MemorySampler``'s clock); keys without samples are left out."""
    out: dict[str, Any] = {}
    for key in MACHINE_KEYS:
        vals = sorted(float(s[key]) for s in series if t0 <= s["t"] <= t1 and key in s)
        if vals:
            out[key] = {"median": statistics.median(vals), "max": vals[-1]}
    return out
