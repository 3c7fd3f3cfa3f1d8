"""Prometheus metrics of kvcore instances, through prometheus-client. Off by default.

Two ways to publish:

* **Per instance** (``InstanceMetrics``): the instance's ``LedgerGate`` calls it after each
  change (its ``on_change`` hook), setting per-instance gauges. ``metrics_hook()`` builds
  it from the environment and returns ``None`` when metrics are off:

  - ``KVCORE_METRICS_PORT=9400``: serve them on that port from this process, on
    ``127.0.0.1`` unless ``KVCORE_METRICS_ADDR`` names another address (``0.0.0.0``: every
    interface);
  - ``KVCORE_METRICS_MULTIPROC_DIR=/dir``: prometheus-client's multiprocess mode, writing
    to ``/dir``. Point it at the engine's own ``PROMETHEUS_MULTIPROC_DIR`` and the engine's
    ``/metrics`` endpoint serves kvcore's metrics with its own (vLLM runs its API server and
    engine core in separate processes, which is what multiprocess mode is for). With both
    set, this process also serves the whole directory on the port.

* **Whole machine** (``LedgerCollector``): reads every per-GPU ledger at scrape time; one
  exporter covers all instances of all engines. Run ``python -m kvcore.metrics --port 9400``
  (``--addr``: the address to listen on, ``127.0.0.1`` by default).

Metric names (labels ``device``, ``instance``, ``engine``): ``kvcore_mapped_bytes``,
``kvcore_reserve_bytes``, ``kvcore_limit_bytes`` (0: none), ``kvcore_acquire_denied``
(refused ``try_acquire`` calls, a running count); the collector adds per-GPU
``kvcore_gpu_total_bytes``, ``kvcore_gpu_budget_bytes``, ``kvcore_gpu_mapped_bytes``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import InstanceRecord, list_ledgers
from kvcore.errors import LedgerError

PORT_ENV = "KVCORE_METRICS_PORT"
ADDR_ENV = "KVCORE_METRICS_ADDR"
DEFAULT_ADDR = "127.0.0.1"
"""Where metrics servers listen unless told otherwise: this machine only."""
MULTIPROC_ENV = "KVCORE_METRICS_MULTIPROC_DIR"
_PROM_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LABELS = ("device", "instance", "engine")


@dataclass(frozen=True)
class MetricsConfig:
    """Where metrics go. Both ``None``: metrics are off."""

    port: int | None = None
    multiprocess_dir: Path | None = None
    addr: str = DEFAULT_ADDR
    """The address the port is served on (``KVCORE_METRICS_ADDR``)."""

    @property
    def enabled(self) -> bool:
        return self.port is not None or self.multiprocess_dir is not None

    @classmethod
    def from_env(cls) -> MetricsConfig:
        """Read ``KVCORE_METRICS_PORT``, ``KVCORE_METRICS_ADDR`` and
        ``KVCORE_METRICS_MULTIPROC_DIR``. Raises ``ValueError`` for a port that is not a
        number."""
        port_text = os.environ.get(PORT_ENV, "").strip()
        directory = os.environ.get(MULTIPROC_ENV, "").strip()
        addr = os.environ.get(ADDR_ENV, "").strip() or DEFAULT_ADDR
        try:
            port = int(port_text) if port_text else None
        except ValueError:
            raise ValueError(f"{PORT_ENV}={port_text!r} is not a port number") from None
        return cls(port=port, multiprocess_dir=Path(directory) if directory else None, addr=addr)


class InstanceMetrics:
    """Per-instance gauges, updated from the instance's ledger record. Call it with each
    fresh ``InstanceRecord`` (``LedgerGate(on_change=...)``)."""

    def __init__(self, device_uuid: str, *, registry: Any = None) -> None:
        """``registry``: a prometheus ``CollectorRegistry`` (default: the global one)."""
        self.device_uuid = device_uuid
        self._families = _families(registry)

    def __call__(self, rec: InstanceRecord) -> None:
        labels = (self.device_uuid, rec.name, rec.engine)
        mapped, reserve, limit, denied = self._families
        mapped.labels(*labels).set(rec.mapped)
        reserve.labels(*labels).set(rec.reserve)
        limit.labels(*labels).set(rec.limit)
        denied.labels(*labels).set(rec.denied)


_FAMILY_LOCK = threading.Lock()
_FAMILY_CACHE: dict[int, tuple[Any, Any, Any, Any]] = {}


def _families(registry: Any) -> tuple[Any, Any, Any, Any]:
    """One set of metric families per registry (prometheus refuses duplicates)."""
    from prometheus_client import REGISTRY, Gauge

    registry = REGISTRY if registry is None else registry
    with _FAMILY_LOCK:
        cached = _FAMILY_CACHE.get(id(registry))
        if cached is None:
            kw: dict[str, Any] = {"registry": registry, "multiprocess_mode": "livemostrecent"}
            cached = (
                Gauge("kvcore_mapped_bytes", "Bytes of KV memory mapped", _LABELS, **kw),
                Gauge("kvcore_reserve_bytes", "Mapped bytes idle in the reserve", _LABELS, **kw),
                Gauge("kvcore_limit_bytes", "Instance limit in bytes (0: none)", _LABELS, **kw),
                Gauge("kvcore_acquire_denied", "Refused memory requests so far", _LABELS, **kw),
            )
            _FAMILY_CACHE[id(registry)] = cached
        return cached


_SERVED: set[int] = set()


def metrics_hook(device_uuid: str, config: MetricsConfig | None = None) -> InstanceMetrics | None:
    """The ``on_change`` hook for an instance's gate, or ``None`` when metrics are off
    (``config`` defaults to ``MetricsConfig.from_env()``). Switches prometheus-client to
    multiprocess mode and starts the HTTP server as configured (once per process)."""
    config = MetricsConfig.from_env() if config is None else config
    if not config.enabled:
        return None
    registry: Any = None
    if config.multiprocess_dir is not None:
        config.multiprocess_dir.mkdir(parents=True, exist_ok=True)
        os.environ[_PROM_MULTIPROC_ENV] = str(config.multiprocess_dir)
        from prometheus_client import values

        # prometheus-client picks its value class when first imported; switch it now in
        # case something imported it before the directory was set.
        values.ValueClass = values.get_value_class()
    if config.port is not None and config.port not in _SERVED:
        from prometheus_client import CollectorRegistry, start_http_server

        if config.multiprocess_dir is not None:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=str(config.multiprocess_dir))
        start_http_server(config.port, addr=config.addr, registry=registry or _default_registry())
        _SERVED.add(config.port)
    return InstanceMetrics(device_uuid)


def _default_registry() -> Any:
    from prometheus_client import REGISTRY

    return REGISTRY


class LedgerCollector:
    """A prometheus collector reading every per-GPU ledger in ``directory`` at scrape
    time (a whole-machine exporter). Unreadable ledgers are skipped."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        gpu = {
            key: GaugeMetricFamily(f"kvcore_gpu_{key}_bytes", text, labels=["device"])
            for key, text in (
                ("total", "Device memory in bytes"),
                ("budget", "GPU-wide kvcore budget in bytes"),
                ("mapped", "Bytes all kvcore instances map"),
            )
        }
        inst = {
            key: GaugeMetricFamily(f"kvcore_{key}", text, labels=list(_LABELS))
            for key, text in (
                ("mapped_bytes", "Bytes of KV memory mapped"),
                ("reserve_bytes", "Mapped bytes idle in the reserve"),
                ("limit_bytes", "Instance limit in bytes (0: none)"),
                ("acquire_denied", "Refused memory requests so far"),
            )
        }
        for path in list_ledgers(self.directory):
            try:
                with GpuLedger.open_path(path) as ledger:
                    snap = ledger.snapshot()
            except LedgerError:
                continue
            gpu["total"].add_metric([snap.device_uuid], snap.device_total)
            gpu["budget"].add_metric([snap.device_uuid], snap.budget)
            gpu["mapped"].add_metric([snap.device_uuid], snap.total_mapped)
            for r in snap.records:
                labels = [snap.device_uuid, r.name, r.engine]
                inst["mapped_bytes"].add_metric(labels, r.mapped)
                inst["reserve_bytes"].add_metric(labels, r.reserve)
                inst["limit_bytes"].add_metric(labels, r.limit)
                inst["acquire_denied"].add_metric(labels, r.denied)
        yield from gpu.values()
        yield from inst.values()


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - a server loop
    """``python -m kvcore.metrics --port N``: serve ``LedgerCollector`` until killed."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcore.metrics",
        description="Serve Prometheus metrics of every kvcore instance on this machine.",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument("--dir", type=Path, default=None, help="ledger directory")
    parser.add_argument(
        "--addr",
        default=DEFAULT_ADDR,
        help=f"address to listen on (default {DEFAULT_ADDR}; 0.0.0.0 for every interface)",
    )
    args = parser.parse_args(argv)
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(LedgerCollector(args.dir))
    start_http_server(args.port, addr=args.addr, registry=registry)
    while True:
        time.sleep(3600)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
