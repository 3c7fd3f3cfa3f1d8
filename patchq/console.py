"""Progress and status output of the patch-queue tooling (rich, on stderr).

Downloads show a byte progress bar; long steps (importing a release, repacking a wheel) show a
spinner with the step's name. Non-terminal output (CI logs, tests) gets plain lines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

console = Console(stderr=True, highlight=False)


def info(message: str) -> None:
    """Print one status line."""
    console.print(message, markup=False, soft_wrap=True)


@contextmanager
def step(title: str) -> Iterator[None]:
    """Show ``title`` with a spinner while the block runs, then a done line with its time."""
    start = time.monotonic()
    with console.status(title):
        yield
    info(f"done: {title} ({time.monotonic() - start:.1f} s)")


@contextmanager
def download_bar(title: str, total: int | None) -> Iterator[tuple[Progress, TaskID]]:
    """A byte progress bar for one download of ``total`` bytes (``None``: unknown size)."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    with progress:
        yield progress, progress.add_task(title, total=total)
