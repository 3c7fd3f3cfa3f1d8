"""Short texts for error messages that name many page ids or offsets (as runs of consecutive
values, not to be confused with virtual address ranges)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_REPORTED = 16
"""The most items an error message lists before it ends in ``...``."""


def runs_text(values: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``'3-5, 9'`` (first few runs only)."""
    runs: list[str] = []
    vals = sorted(values)
    i = 0
    while i < len(vals) and len(runs) < MAX_REPORTED:
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        runs.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    if i < len(vals):
        runs.append("...")
    return ", ".join(runs)
