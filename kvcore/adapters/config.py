"""Options of an engine's elastic KV mode (``--kvcore-config '{...}'``), engine-agnostic.

``ElasticConfig.parse(value)`` turns the engine option (a JSON object, already decoded by the
engine's argument parser into a dict, JSON text, or ``None``) into a validated, frozen
config. Every unknown key or wrong type raises ``UnsupportedConfiguration`` at start-up,
naming the key. Each engine adapter reads the fields it supports; the memory gate the options
ask for is opened by ``kvcore.adapters.gates.open_gate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvcore.errors import UnsupportedConfiguration
from kvcore.memory.switch_interval import DEFAULT_BACKGROUND_SWITCH_S

__all__ = ["ElasticConfig"]


@dataclass(frozen=True)
class ElasticConfig:
    """Per-rank (per-worker) elastic KV options.

    ``backend``: VMM backend name (``cuda``, ``hip``, ``host``); ``backend_options``: keyword
    arguments for it (``host``: ``device_bytes``, ``granularity``). ``limit_bytes``: the
    physical budget of this rank's KV cache (``None``: only the device limits it).
    ``share_bytes`` (with ``gpu_ledger``): what this instance keeps while instances sharing
    the GPU borrow beyond theirs (``None``: an equal part of the GPU budget;
    ``kvcore.budget.shares``, ``kvctl share`` changes it while serving).
    ``reserve_min``/``reserve_max``: pre-mapped idle pages kept for bursts. ``map_ahead``:
    pages a growing engine finds mapped ahead by the background thread, kept only while it
    keeps acquiring (``kvcore.memory.pages``; 0, the default: every new page is mapped on
    the allocating thread unless the reserve holds one).
    ``max_cached_tokens``: bound on the radix cache's evictable tokens (``None``: unbounded,
    as upstream). ``eviction``: radix-cache eviction order, ``"page-aware"`` (leaves that empty
    physical pages first) or ``"engine"`` (the engine's own order); ``None``: page-aware
    where the engine adapter can apply it safely, else the engine's order.
    ``reclaim`` (with ``gpu_ledger`` or a limit): how pages the memory gate wants back
    (``PageAllocator.shed_wanted``) come back once the cached blocks are gone:
    ``"preempt"`` preempts, each engine step, the running requests whose blocks alone fill
    one such page, the fewest blocks first, so a waiting neighbour gets its share within
    steps (an engine whose scheduler has no such seam refuses it at start-up);
    ``"drain"`` only stops admitting new requests into those pages and lets the running
    ones finish (no recomputation, but a neighbour waits about one request lifetime);
    ``None`` (default): ``"preempt"`` where the engine's scheduler has the seam (patch
    0011 of kvcore's vLLM series), else ``"drain"``. ``page_bytes``: physical page size
    (default: the smallest multiple of the backend granularity that holds whole SGLang pages).
    ``sanity``: map the zero page writable and check it at every transition (debugging).
    ``background_switch_us``: the interpreter's switch interval, in microseconds, while
    kvcore calls the driver (the page thread's rounds, a map on the engine's thread, a TP
    worker's channel requests; ``kvcore.memory.switch_interval``: beside another thread
    running Python each call otherwise waits up to the interpreter's 5 ms for the GIL); 0
    leaves the interval alone.
    """

    backend: str = "cuda"
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    limit_bytes: int | None = None
    share_bytes: int | None = None
    gpu_ledger: bool = False
    ledger_dir: str | None = None
    reserve_min: int = 0
    reserve_max: int = 0
    map_ahead: int = 0
    max_cached_tokens: int | None = None
    eviction: str | None = None
    reclaim: str | None = None
    page_bytes: int | None = None
    sanity: bool = False
    background_switch_us: int = round(DEFAULT_BACKGROUND_SWITCH_S * 1e6)

    @property
    def budgeted(self) -> bool:
        """Whether this rank's physical memory has a budget (``limit_bytes`` or
        ``gpu_ledger``); without one the pool is bounded only by its logical size and the
        device."""
        return self.limit_bytes is not None or self.gpu_ledger

    @property
    def background_switch_s(self) -> float | None:
        """``background_switch_us`` in seconds, ``None`` for 0 (the interval left alone)."""
        return self.background_switch_us * 1e-6 if self.background_switch_us else None

    @classmethod
    def parse(cls, value: Mapping[str, Any] | str | None) -> ElasticConfig:
        """Build from the ``--kvcore-config`` value (dict, JSON text or ``None``).

        Raises ``UnsupportedConfiguration`` for unknown keys, wrong types or bad bounds.
        """
        if value is None:
            return cls()
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError, ValueError) as exc:
                raise UnsupportedConfiguration(
                    f"--kvcore-config is not valid JSON: {str(exc)[:200]}",
                    hint="pass a JSON object, e.g. '{\"limit_bytes\": 8589934592}'",
                ) from None
        if not isinstance(value, Mapping):
            raise UnsupportedConfiguration(
                f"--kvcore-config must be a JSON object, got {type(value).__name__}"
            )
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise UnsupportedConfiguration(
                f"--kvcore-config: unknown key(s) {unknown}",
                hint=f"known keys: {', '.join(known)}",
            )
        kwargs: dict[str, Any] = dict(value)
        for name in ("limit_bytes", "share_bytes", "max_cached_tokens", "page_bytes"):
            _check_int(kwargs, name, optional=True)
        for name in ("reserve_min", "reserve_max", "map_ahead"):
            _check_int(kwargs, name, optional=False)
        switch = kwargs.get("background_switch_us", 0)
        if (
            isinstance(switch, bool)
            or not isinstance(switch, int)
            or not 0 <= switch <= _MAX_SWITCH_US
        ):
            raise UnsupportedConfiguration(
                f"--kvcore-config: background_switch_us must be an integer number of "
                f"microseconds in 0 .. {_MAX_SWITCH_US}, got {switch!r}",
                hint="0 leaves the interpreter's switch interval alone",
            )
        if not isinstance(kwargs.get("backend", "cuda"), str):
            raise UnsupportedConfiguration("--kvcore-config: backend must be a string")
        options = kwargs.get("backend_options", {})
        if not isinstance(options, Mapping):
            raise UnsupportedConfiguration("--kvcore-config: backend_options must be an object")
        for key, option in options.items():  # scalars only: the backends take sizes, names
            if not isinstance(option, (str, int, float, bool)) or (
                isinstance(option, int) and not isinstance(option, bool) and option > _MAX_INT
            ):
                raise UnsupportedConfiguration(
                    f"--kvcore-config: backend_options.{key} must be a number, string or "
                    f"boolean no larger than 2**56, got {str(option)[:80]}"
                )
        for name in ("sanity", "gpu_ledger"):
            if not isinstance(kwargs.get(name, False), bool):
                raise UnsupportedConfiguration(f"--kvcore-config: {name} must be true or false")
        if kwargs.get("eviction") not in (None, "page-aware", "engine"):
            raise UnsupportedConfiguration(
                f'--kvcore-config: eviction must be "page-aware" or "engine", got '
                f"{kwargs['eviction']!r}"
            )
        if kwargs.get("reclaim") not in (None, "preempt", "drain"):
            raise UnsupportedConfiguration(
                f'--kvcore-config: reclaim must be "preempt" or "drain", got {kwargs["reclaim"]!r}'
            )
        if not isinstance(kwargs.get("ledger_dir") or "", str):
            raise UnsupportedConfiguration("--kvcore-config: ledger_dir must be a path string")
        config = cls(**kwargs)
        if config.share_bytes is not None and not config.gpu_ledger:
            raise UnsupportedConfiguration(
                "--kvcore-config: share_bytes needs gpu_ledger (a share is kept against the "
                "other instances in the GPU's ledger)",
                hint='add "gpu_ledger": true, or drop share_bytes',
            )
        if config.reserve_min > config.reserve_max:
            raise UnsupportedConfiguration(
                f"--kvcore-config: reserve_min={config.reserve_min} exceeds "
                f"reserve_max={config.reserve_max}"
            )
        return config


_MAX_INT = 1 << 56
_MAX_SWITCH_US = 100_000  # CPython's own default is 5,000


def _check_int(kwargs: dict[str, Any], name: str, *, optional: bool) -> None:
    if name not in kwargs or (optional and kwargs[name] is None):
        return
    v = kwargs[name]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_INT:
        raise UnsupportedConfiguration(
            f"--kvcore-config: {name} must be an integer in 0 .. 2**56 (64 PiB: more than "
            f"any device), got {v!r}"
        )
