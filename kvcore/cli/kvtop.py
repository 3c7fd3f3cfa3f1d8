"""``kvtop``: a live view of the kvcore instances on this machine's GPUs.

One panel per GPU: a memory bar (kvcore-mapped, held outside kvcore, free) and one row per
instance (name, engine, limit, mapped, reserve, share of its limit). Refreshes every
``--interval`` seconds, reclaiming the records of dead instances as it goes. Press ``q`` (or
Ctrl-C) to quit. It draws in the normal screen with plain cursor movement (no alternate
screen, no mouse), so it works in any terminal over plain SSH; ``--once`` prints one frame
and exits (pipes, scripts, tests).

"Held outside kvcore" is the device's used memory (as last reported by an instance's
backend) minus what kvcore instances map; it is shown as unknown until an instance has
reported the device's free memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from kvcore.budget.ledger_file import InstanceRecord, LedgerSnapshot, Liveness
from kvcore.budget.shares import share_of, yields
from kvcore.cli._ledgers import Opened, open_ledgers
from kvcore.cli.display import printable
from kvcore.cli.sizes import format_bytes
from kvcore.errors import KvcoreError, LedgerNotFound

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_LEDGER = 3
BAR_WIDTH = 48


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvtop``."""
    p = argparse.ArgumentParser(
        prog="kvtop",
        description="Live view of the kvcore instances on this machine's GPUs (q or Ctrl-C quits).",
        epilog="examples:\n  kvtop\n  kvtop --interval 0.5\n  kvtop --once > snapshot.txt\n"
        "exit status: 0 ok, 1 a ledger could not be read, 3 no ledger yet",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="refresh interval (default 1.0)",
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory of the ledger files (default: $KVCORE_LEDGER_DIR or /dev/shm)",
    )
    p.add_argument("--device", metavar="UUID", default=None, help="only this GPU (prefix)")
    return p


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("the interval must be > 0 seconds")
    return value


def render(snapshots: Sequence[LedgerSnapshot], *, now: float | None = None) -> Any:
    """One frame: a rich renderable of every GPU's bar and instance table."""
    from rich.console import Group
    from rich.panel import Panel

    now = time.time() if now is None else now
    if not snapshots:
        return Panel("no kvcore ledger", title="kvtop")
    return Group(*(Panel(_gpu(s, now), title=f"GPU {s.device_uuid}") for s in snapshots))


def _gpu(snap: LedgerSnapshot, now: float) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    total = max(1, snap.device_total)
    mapped = snap.total_mapped
    known = snap.device_free_time > 0
    other = max(0, total - snap.device_free - mapped) if known else 0
    free = max(0, total - mapped - other)
    bar = Text()
    cells = [(mapped, "█", "green"), (other, "▒", "yellow")]
    used_cells = 0
    for amount, char, style in cells:
        n = round(BAR_WIDTH * amount / total)
        n = min(n, BAR_WIDTH - used_cells)
        bar.append(char * n, style=style)
        used_cells += n
    bar.append("░" * (BAR_WIDTH - used_cells), style="dim")
    legend = Text()
    legend.append(f"kvcore {format_bytes(mapped)}", style="green")
    other_text = format_bytes(other) if known else "unknown"
    legend.append(f"  other {other_text}", style="yellow")
    legend.append(f"  free {format_bytes(free)}" if known else "", style="dim")
    legend.append(f"  of {format_bytes(snap.device_total)}")
    budget = format_bytes(snap.budget) if snap.budget_setting else "whole device"
    info = Text(f"budget {budget} (rev {snap.budget_revision})", style="dim")
    if known and now - snap.device_free_time > 10:
        info.append(f"; device figures {now - snap.device_free_time:.0f} s old")

    # SHARE and STATE only where shares are in play (one set, or an instance waiting or
    # yielding), so that the common view fits an 80-column terminal
    states = {r.slot: _state(snap, r, now) for r in snap.records}
    sharing = any(states.values()) or any(r.share for r in snap.records)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    cols = ["NAME", "ENGINE", "LIMIT", "MAPPED", "RESERVE", "%"]
    if sharing:
        cols[3:3] = ["SHARE"]
        cols.append("STATE")
    for col in cols:
        justify: Literal["left", "right"] = (
            "left" if col in ("NAME", "ENGINE", "STATE") else "right"
        )
        table.add_column(col, justify=justify, no_wrap=True)
    for r in sorted(snap.records, key=lambda r: r.name):
        pct = 100 * r.mapped / r.limit if r.limit else 100 * r.mapped / snap.budget
        style = "red" if r.limit and r.mapped > r.limit else ""
        name = r.name if r.liveness is not Liveness.UNKNOWN else f"{r.name} (?)"
        row: list[Text | str] = [
            Text(printable(name)),  # from a file: never markup, never terminal escapes
            Text(printable(f"{r.engine} {r.engine_version}".strip())),
            format_bytes(r.limit) if r.limit else "none",
            format_bytes(r.mapped),
            format_bytes(r.reserve),
            f"{pct:.0f}%" if r.limit else f"{pct:.0f}% of budget",
        ]
        if sharing:
            row[3:3] = [format_bytes(share_of(snap, r))]
            row.append(states[r.slot])
        table.add_row(*row, style=style)
    if not snap.records:
        return Group(bar, legend, info, Text("no instances", style="dim"))
    return Group(bar, legend, info, table)


def _state(snap: LedgerSnapshot, rec: InstanceRecord, now: float) -> str:
    """What the instance's gate does under shares now: waiting below its share, or held at
    its share for a waiting neighbour (``kvcore.budget.shares``); "" otherwise (a limit it is
    over shows in red)."""
    if rec.wanted_until > now and rec.mapped < share_of(snap, rec):
        return "waiting"
    if yields(snap, rec, now):
        return "yielding"
    return ""


def _frame(opened: Opened) -> Any:
    for ledger in opened.ledgers:
        ledger.reclaim_stale()
    return render([ledger.snapshot() for ledger in opened.ledgers])


@contextlib.contextmanager
def _keys() -> Iterator[int | None]:
    """Yield stdin's fd in cbreak mode (single keys, no echo) when it is a terminal, else
    ``None``; the terminal's mode is restored on exit."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_quit(fd: int | None, seconds: float) -> bool:
    """Sleep up to ``seconds``; ``True`` as soon as ``q`` is pressed."""
    if fd is None:
        time.sleep(seconds)
        return False
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready and os.read(fd, 1) in (b"q", b"Q"):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvtop`` with ``argv`` (default: the command line); returns the exit status."""
    from rich.console import Console
    from rich.live import Live

    args = build_parser().parse_args(argv)
    try:
        opened = open_ledgers(args.dir, args.device)
    except LedgerNotFound as exc:
        print(f"kvtop: {exc.message}\nhint: {exc.hint}", file=sys.stderr)
        return EXIT_NO_LEDGER
    status = EXIT_FAILED if opened.errors else EXIT_OK
    for error in opened.errors:
        print(f"kvtop: {error.message}\nhint: {error.hint}", file=sys.stderr)
    console = Console(highlight=False)
    try:
        if args.once:
            console.print(_frame(opened))
            return status
        with (
            _keys() as fd,
            Live(
                _frame(opened),
                console=console,
                screen=False,
                auto_refresh=False,
                redirect_stderr=False,
            ) as live,
        ):
            while not _wait_for_quit(fd, args.interval):
                live.update(_frame(opened), refresh=True)
    except KeyboardInterrupt:
        pass
    except KvcoreError as exc:
        print(f"kvtop: {exc.message}\nhint: {exc.hint}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        opened.close()
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
