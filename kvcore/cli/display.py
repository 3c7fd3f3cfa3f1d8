"""Text that ``kvctl`` and ``kvtop`` print from ledger files: data, never terminal input."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with every non-printable character (control characters, terminal escape
    sequences) shown as ``\\xNN`` (``\\uNNNN`` beyond one byte)."""
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"
