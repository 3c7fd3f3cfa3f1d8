"""``kvctl``: inspect and steer the kvcore instances sharing this machine's GPUs.

Every command reads the per-GPU ledgers (``kvcore.budget.ledger``) in ``/dev/shm`` (or
``$KVCORE_LEDGER_DIR``) and first reclaims the records of dead instances.

Exit status: 0 success; 1 the operation failed (unknown instance, a concurrent change won,
an unusable ledger file); 2 usage error (bad option, malformed size); 3 no ledger exists yet.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from kvcore.budget.ledger import GpuLedger
from kvcore.budget.ledger_file import InstanceRecord, LedgerSnapshot, Liveness
from kvcore.budget.shares import share_of, yields
from kvcore.cli._ledgers import Opened, open_ledgers
from kvcore.cli.display import printable
from kvcore.cli.sizes import ACCEPTED, SizeError, format_bytes, parse_size
from kvcore.errors import KvcoreError, LedgerNotFound, UnknownInstance

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_LEDGER = 3
_NEGATIVE = re.compile(r"^-\d")

_EPILOG = """\
examples:
  kvctl list                      instances on every GPU, as a table
  kvctl list --json               the same for scripts
  kvctl limit llama-a 24G         cap instance llama-a at 24 GiB of KV memory
  kvctl limit llama-a 40%         ... at 40% of its GPU
  kvctl limit llama-a none        remove the cap
  kvctl budget 100G               cap all kvcore instances on the GPU together
  kvctl share llama-a 30G         keep 30 GiB for llama-a while others borrow beyond theirs
  kvctl share llama-a none        back to an equal part of the budget
  kvctl trim llama-a              make llama-a drop its idle pre-mapped reserve
  kvctl clean                     reclaim records left by dead instances

sizes: {accepted}
exit status: 0 ok, 1 operation failed, 2 usage error, 3 no ledger yet
"""


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvctl`` (every subcommand has ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="kvctl",
        description="Inspect and steer the kvcore instances sharing this machine's GPUs.",
        epilog=_EPILOG.format(accepted=ACCEPTED),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory of the ledger files (default: $KVCORE_LEDGER_DIR or /dev/shm)",
    )
    parser.add_argument(
        "--device",
        metavar="UUID",
        default=None,
        help="only the GPU whose uuid starts with UUID (needed when a command is ambiguous)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # --dir and --device work after the subcommand as well (default SUPPRESS: the value
    # given before it stays unless repeated after it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument(
        "--device", metavar="UUID", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    def add(name: str, help_: str, examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_,
            description=help_,
            epilog=f"examples:\n{examples}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[common],
        )

    p = add("list", "list the instances on each GPU", "  kvctl list\n  kvctl list --json")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = add(
        "limit",
        "set an instance's KV memory limit (lowering below use is applied as use falls)",
        "  kvctl limit llama-a 24G\n  kvctl limit llama-a 40%\n  kvctl limit llama-a none\n"
        "  kvctl limit llama-a 8G --if-revision 3   # only if nobody changed it since rev 3",
    )
    p.add_argument("name", help="instance name (see kvctl list)")
    p.add_argument("size", help="new limit: " + ACCEPTED.replace("%", "%%"))
    p.add_argument(
        "--if-revision",
        type=int,
        default=None,
        metavar="N",
        help="change only if the limit is still at revision N (compare-and-set)",
    )

    p = add(
        "share",
        "set the memory an instance keeps while others borrow (default: an equal part of the "
        "budget); above its share, an instance gives way to one below its share that waits",
        "  kvctl share llama-a 30G\n  kvctl share llama-a 50%\n"
        "  kvctl share llama-a none   # an equal part of the budget",
    )
    p.add_argument("name", help="instance name (see kvctl list)")
    p.add_argument("size", help="new share: " + ACCEPTED.replace("%", "%%"))

    p = add(
        "budget",
        "set the GPU-wide budget all kvcore instances on a GPU share",
        "  kvctl budget 100G\n  kvctl budget 90%\n  kvctl budget none   # the whole device",
    )
    p.add_argument("size", help="new budget: " + ACCEPTED.replace("%", "%%"))
    p.add_argument("--if-revision", type=int, default=None, metavar="N", help="compare-and-set")

    p = add(
        "trim",
        "ask an instance to drop its idle reserve of pre-mapped pages",
        "  kvctl trim llama-a\n  kvctl trim llama-a --hold 300 --wait 10",
    )
    p.add_argument("name", help="instance name (see kvctl list)")
    p.add_argument(
        "--hold",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="keep no reserve for this long (default 60; 'inf' until the next trim)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the reserve to reach 0 (exit 1 if it does not)",
    )

    add("clean", "reclaim the records of dead instances", "  kvctl clean")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvctl`` with ``argv`` (default: the command line); returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    bad = next((a for a in argv if _NEGATIVE.match(a)), None)
    if bad is not None:  # "-5G" is a (bad) size, not an option
        print(f"kvctl: {bad!r}: a size cannot be negative; use {ACCEPTED}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    try:
        opened = open_ledgers(args.dir, args.device)
    except LedgerNotFound as exc:
        _err(exc)
        return EXIT_NO_LEDGER
    try:
        for device, rec in opened.reclaimed:
            name = printable(rec.name)
            _note(f"reclaimed the record of dead instance {name!r} (pid {rec.pid}, {device})")
        for error in opened.errors:
            _err(error)
        # a ledger that cannot be read is reported above; the command's own result decides
        return _COMMANDS[args.command](args, opened)
    except _UsageError as exc:
        print(f"kvctl {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvcoreError as exc:
        _err(exc)
        return EXIT_FAILED
    finally:
        opened.close()


def _cmd_list(args: argparse.Namespace, opened: Opened) -> int:
    snaps = [ledger.snapshot() for ledger in opened.ledgers]
    if args.json:
        doc = {
            "gpus": [_snapshot_json(s) for s in snaps],
            "reclaimed": [
                {"device_uuid": d, "name": r.name, "pid": r.pid} for d, r in opened.reclaimed
            ],
        }
        print(json.dumps(doc, indent=2, allow_nan=False))
        return EXIT_OK
    from rich.console import Console

    # A pipe gets whole lines (no wrapping at 80 columns); a terminal gets its width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 1000)
    for i, snap in enumerate(snaps):
        if i:
            console.print()
        console.print(_gpu_line(snap))
        console.print(_table(snap))
    return EXIT_OK


def _setting(args: argparse.Namespace, opened: Opened, zero: str) -> tuple[GpuLedger, int]:
    """The ledger holding instance ``args.name`` and ``args.size`` in bytes; a size of 0
    must be written ``none`` (a typo never lifts a cap): ``zero`` says what ``none`` does."""
    ledger, _ = _resolve(opened, args.name)
    size = _size(args.size, ledger)
    if size == 0 and args.size.strip().lower() not in ("none", "unlimited"):
        raise _UsageError(
            f"{args.size!r} would {zero}; say `kvctl {args.command} {args.name} none` to do that"
        )
    return ledger, size


def _cmd_limit(args: argparse.Namespace, opened: Opened) -> int:
    ledger, size = _setting(args, opened, "remove the limit")
    before, after = ledger.set_limit(args.name, size, if_revision=args.if_revision)
    print(
        f"{after.name}: limit {_limit(before.limit)} -> {_limit(after.limit)} "
        f"(revision {after.limit_revision})"
    )
    if after.limit and after.mapped > after.limit:
        print(
            f"{after.name} maps {format_bytes(after.mapped)}, above the new limit: it gets no "
            "new memory until its use falls below the limit (its reserve is trimmed first)"
        )
    return EXIT_OK


def _cmd_share(args: argparse.Namespace, opened: Opened) -> int:
    ledger, size = _setting(args, opened, "give it an equal part of the budget")
    before, after = ledger.set_share(args.name, size)
    snap = ledger.snapshot()
    now = snap.find(args.name) or after
    print(
        f"{after.name}: share {_share_setting(before.share)} -> {_share_setting(after.share)} "
        f"({format_bytes(share_of(snap, now))} now)"
    )
    total = sum(share_of(snap, r) for r in snap.records)
    if total > snap.budget:
        _note(
            f"the shares on this GPU add up to {format_bytes(total)}, more than its budget "
            f"{format_bytes(snap.budget)}: not all of them can be kept at once"
        )
    return EXIT_OK


def _share_setting(n: int) -> str:
    return format_bytes(n) if n else "equal"


def _cmd_budget(args: argparse.Namespace, opened: Opened) -> int:
    if len(opened.ledgers) > 1:
        raise _UsageError(
            "several GPUs have ledgers; pick one with --device UUID (uuids: "
            + ", ".join(ledger.device_uuid for ledger in opened.ledgers)
            + ")"
        )
    ledger = opened.ledgers[0]
    size = _size(args.size, ledger)
    rev = ledger.set_budget(size, if_revision=args.if_revision)
    snap = ledger.snapshot()
    print(f"{snap.device_uuid}: budget {format_bytes(snap.budget)} (revision {rev})")
    if size > snap.device_total:
        _note(
            f"the budget {format_bytes(size)} is more than the device's "
            f"{format_bytes(snap.device_total)}: the device runs out first"
        )
    if snap.total_mapped > snap.budget:
        print(
            f"instances map {format_bytes(snap.total_mapped)} in all, above the budget: none "
            "gets new memory until the total falls below it"
        )
    return EXIT_OK


def _cmd_trim(args: argparse.Namespace, opened: Opened) -> int:
    ledger, _ = _resolve(opened, args.name)
    hold = args.hold if not math.isnan(args.hold) else 0.0
    rec = ledger.request_trim(args.name, hold)
    held = "until the next trim" if math.isinf(hold) else f"for {hold:g} s"
    print(f"{rec.name}: asked to drop its reserve ({format_bytes(rec.reserve)}), none {held}")
    deadline = time.monotonic() + max(0.0, args.wait)
    while args.wait > 0:
        snap = ledger.snapshot()
        now = snap.find(args.name)
        if now is None:
            print(f"{args.name}: the instance exited")
            return EXIT_OK
        if now.reserve == 0:
            print(f"{args.name}: reserve is empty")
            return EXIT_OK
        if time.monotonic() > deadline:
            print(
                f"kvctl trim: {args.name} still holds a reserve of {format_bytes(now.reserve)} "
                f"after {args.wait:g} s (its allocator trims on its next refill)",
                file=sys.stderr,
            )
            return EXIT_FAILED
        time.sleep(0.05)
    return EXIT_OK


def _cmd_clean(args: argparse.Namespace, opened: Opened) -> int:
    # open_ledgers already reclaimed; report what is left.
    if not opened.reclaimed:
        print("no stale records")
    unknown = [
        r
        for ledger in opened.ledgers
        for r in ledger.snapshot().records
        if r.liveness is Liveness.UNKNOWN
    ]
    for r in unknown:
        print(
            f"{r.name!r} (pid {r.pid}) was registered from another pid namespace and is left "
            "alone: its liveness cannot be checked from here"
        )
    return EXIT_OK


_COMMANDS = {
    "list": _cmd_list,
    "limit": _cmd_limit,
    "share": _cmd_share,
    "budget": _cmd_budget,
    "trim": _cmd_trim,
    "clean": _cmd_clean,
}


def _resolve(opened: Opened, name: str) -> tuple[GpuLedger, InstanceRecord]:
    hits = []
    known: list[str] = []
    for ledger in opened.ledgers:
        snap = ledger.snapshot()
        known += [r.name for r in snap.records]
        rec = snap.find(name)
        if rec is not None:
            hits.append((ledger, rec))
    if not hits:
        listed = ", ".join(sorted(known)) if known else "none"
        raise UnknownInstance(
            f"no instance named {name!r} (known: {listed})",
            hint="names are shown by `kvctl list`",
        )
    if len(hits) > 1:
        raise _UsageError(
            f"instances named {name!r} run on several GPUs; pick one with --device UUID "
            "(uuids: " + ", ".join(ledger.device_uuid for ledger, _ in hits) + ")"
        )
    return hits[0]


def _size(text: str, ledger: GpuLedger) -> int:
    try:
        return parse_size(text, device_total=ledger.snapshot().device_total)
    except SizeError as exc:
        raise _UsageError(str(exc)) from None


def _limit(n: int) -> str:
    return format_bytes(n) if n else "none"


def _state(snap: LedgerSnapshot, rec: InstanceRecord) -> str:
    if rec.liveness is Liveness.UNKNOWN:
        return "other-pidns"
    if rec.over_limit or (rec.limit and rec.mapped > rec.limit):
        return "over-limit"
    if rec.waiting and rec.mapped < share_of(snap, rec):
        return "waiting"
    if yields(snap, rec):
        return "yielding"
    if rec.trimming:
        return "trimming"
    return "active"


def _gpu_line(snap: LedgerSnapshot) -> str:
    budget = (
        f"budget {format_bytes(snap.budget)}" if snap.budget_setting else "budget = whole device"
    )
    return (
        f"device {snap.device_uuid}: {format_bytes(snap.device_total)} total, {budget} "
        f"(rev {snap.budget_revision}), kvcore maps {format_bytes(snap.total_mapped)} "
        f"in {len(snap.records)} instance(s)"
    )


def _table(snap: LedgerSnapshot) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    cols = (
        "NAME",
        "ENGINE",
        "PID",
        "STATE",
        "LIMIT",
        "SHARE",
        "MAPPED",
        "RESERVE",
        "%LIMIT",
        "REV",
    )
    for col in cols:
        justify: Literal["left", "right"] = "right" if col in ("PID", "%LIMIT", "REV") else "left"
        table.add_column(col, justify=justify, no_wrap=True)
    for r in sorted(snap.records, key=lambda r: r.name):
        engine = f"{r.engine} {r.engine_version}".strip()
        share = f"{100 * r.mapped / r.limit:.0f}%" if r.limit else "-"
        table.add_row(
            Text(printable(r.name)),  # Text: a name is never rich markup
            Text(printable(engine)),
            str(r.pid),
            _state(snap, r),
            _limit(r.limit),
            format_bytes(share_of(snap, r)) + ("" if r.share else " (equal)"),
            format_bytes(r.mapped),
            format_bytes(r.reserve),
            share,
            str(r.limit_revision),
        )
    return table


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN or infinity


def _snapshot_json(snap: LedgerSnapshot) -> dict[str, Any]:
    return {
        "device_uuid": snap.device_uuid,
        "path": str(snap.path),
        "device_total": snap.device_total,
        "budget": snap.budget,
        "budget_setting": snap.budget_setting,
        "budget_revision": snap.budget_revision,
        "total_mapped": snap.total_mapped,
        "instances": [
            {
                "name": r.name,
                "engine": r.engine,
                "engine_version": r.engine_version,
                "model": r.model,
                "pid": r.pid,
                "device": r.device,
                "state": _state(snap, r),
                "limit": r.limit,
                "limit_revision": r.limit_revision,
                "share": share_of(snap, r),
                "share_setting": r.share,
                "waiting": r.waiting,
                "yielding": yields(snap, r),
                "mapped": r.mapped,
                "reserve": r.reserve,
                "denied": r.denied,
                "updated": _finite(r.updated),
            }
            for r in sorted(snap.records, key=lambda r: r.name)
        ],
    }


def _err(exc: KvcoreError) -> None:
    print(f"kvctl: {printable(exc.message)}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)


def _note(text: str) -> None:
    print(f"kvctl: {printable(text)}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
