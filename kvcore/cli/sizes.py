"""Byte sizes as shell users write and read them.

``parse_size`` accepts a plain byte count (``1073741824``), binary units (``512K``, ``512M``,
``2G``, ``1T``, optionally written ``MiB``/``GiB`` or ``Mi``/``Gi``; fractions like ``1.5G``
are fine), decimal units (``500MB``, ``2GB``: powers of 1000) and a share of the device
(``40%``). ``none`` means "no limit" (0). ``format_bytes`` prints binary units.
"""

from __future__ import annotations

import re

ACCEPTED = (
    "a byte count (1073741824), 512M / 2G / 1.5GiB (binary), 500MB (decimal), "
    "40% of the device, or none"
)
"""The accepted forms, for error messages."""

_BINARY = {"": 1, "B": 1} | {
    prefix + suffix: 1 << (10 * (i + 1))
    for i, prefix in enumerate("KMGT")
    for suffix in ("", "I", "IB")
}
_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


MAX_SIZE = 1 << 56
"""The largest size accepted (``kvcore.budget.ledger_file.MAX_BYTES``)."""


class SizeError(ValueError):
    """A size string in none of the accepted forms; the message lists them."""


def parse_size(text: str, *, device_total: int | None = None) -> int:
    """Bytes meant by ``text`` (see the module docstring), rounded down to whole bytes.
    A percentage needs ``device_total``. Raises ``SizeError``."""
    value = text.strip()
    if value.lower() in ("none", "unlimited"):
        return 0
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            raise SizeError(f"malformed size {text!r}; use {ACCEPTED}") from None
        if not 0 < share <= 100:
            raise SizeError(f"{text!r}: a share of the device must be in (0, 100]%")
        if device_total is None:
            raise SizeError(f"{text!r}: a share needs the device's size, which is unknown here")
        return int(device_total * share / 100)
    m = _SIZE_RE.match(value)
    if m is None:
        raise SizeError(f"malformed size {text!r}; use {ACCEPTED}")
    number, unit = m.group(1), m.group(2).upper()
    factor = _DECIMAL.get(unit) or _BINARY.get(unit)
    if factor is None:
        raise SizeError(f"unknown unit {m.group(2)!r} in {text!r}; use {ACCEPTED}")
    if "." in number and factor == 1:
        raise SizeError(f"{text!r}: a plain byte count must be a whole number")
    n = int(float(number) * factor) if "." in number else int(number) * factor
    if n > MAX_SIZE:
        raise SizeError(f"{text!r} is more than {MAX_SIZE} bytes (64 PiB), larger than any device")
    return n


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with one decimal (``1.5 GiB``, ``512.0 MiB``, ``0 B``)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
