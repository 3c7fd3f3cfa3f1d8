"""Command line of the patch-queue tooling: ``python -m patchq <command> ...``.

Run from the repository root (the noxfile sessions do). Every failure prints the typed error
with its context and the next command, and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compat.matrix import MatrixError
from patchq.console import console
from patchq.errors import PatchqError
from patchq.workspace import Workspace


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m patchq", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("materialize", help="create forks/<engine>/<version>/ with the series")
    p.add_argument("engine")
    p.add_argument("version")
    p.add_argument("--force", action="store_true", help="replace an existing fork (export first)")
    p.add_argument("--python", help="the wheel's Python where wheels are per interpreter")

    p = sub.add_parser("export", help="write the fork's commits to patches/<engine>/<version>/")
    p.add_argument("engine")
    p.add_argument("version")

    p = sub.add_parser("check", help="every series applies exactly and re-exports identically")
    p.add_argument("engine", nargs="?")
    p.add_argument("version", nargs="?")

    p = sub.add_parser("fetch", help="download and verify a pinned artifact; print its path")
    p.add_argument("engine")
    p.add_argument("version")
    p.add_argument("kind", choices=["wheel", "sdist"])
    p.add_argument("--python")

    p = sub.add_parser("build", help="build the forked wheel into dist/ and check it installs")
    p.add_argument("engine")
    p.add_argument("version")
    p.add_argument("--python", help="the interpreter the wheel is for (default: this one)")
    p.add_argument("--no-install-check", action="store_true")
    p.add_argument(
        "--deps-env",
        type=Path,
        help="a venv with the engine's dependencies: the changed modules must then import",
    )

    p = sub.add_parser("rebase", help="replay a series onto another release")
    p.add_argument("engine")
    p.add_argument("target", help="the release to rebase onto (pinned or not)")
    p.add_argument("--from", dest="source", help="the series to replay (default: newest pinned)")
    _resume_flags(p)

    p = sub.add_parser(
        "roll",
        help="pin a new release: fetch it, rebase the nearest series onto it, build, report",
    )
    p.add_argument("engine")
    p.add_argument("version", help="a release compat/matrix.toml does not pin yet")
    _resume_flags(p)
    p.add_argument(
        "--no-install-check", action="store_true", help="build the wheel without installing it"
    )
    return parser


def _resume_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--continue", dest="resume", action="store_true", help="after resolving")
    p.add_argument("--force", action="store_true", help="replace an existing target fork")


def _run(args: argparse.Namespace, ws: Workspace) -> None:
    if args.command == "materialize":
        from patchq.fork import materialize

        materialize(ws, ws.release(args.engine, args.version), force=args.force, python=args.python)
    elif args.command == "export":
        from patchq.export import export

        export(ws, ws.release(args.engine, args.version))
    elif args.command == "check":
        from patchq.check import check_all

        results = check_all(ws, args.engine, args.version)
        checked = [k for k, v in results.items() if v]
        console.print(
            f"patches-check: {len(checked)} series checked ({', '.join(checked)}); "
            f"{len(results) - len(checked)} releases have no series yet"
        )
    elif args.command == "fetch":
        rel = ws.release(args.engine, args.version)
        print(ws.cache.fetch(rel, args.kind, args.python))
    elif args.command == "build":
        from patchq.wheel import build

        wheel = build(
            ws,
            ws.release(args.engine, args.version),
            python=args.python,
            install_check=not args.no_install_check,
            deps_env=args.deps_env,
        )
        print(wheel)  # the last stdout line, for scripts
    elif args.command == "rebase":
        from patchq.rebase import rebase

        rebase(
            ws, args.engine, args.target, source=args.source, resume=args.resume, force=args.force
        )
    elif args.command == "roll":
        from patchq.roll import roll

        roll(
            ws,
            args.engine,
            args.version,
            resume=args.resume,
            force=args.force,
            install_check=not args.no_install_check,
        )


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    args = _parser().parse_args(argv)
    try:
        _run(args, Workspace())
    except (PatchqError, MatrixError) as exc:
        console.print(f"[bold red]error:[/] {type(exc).__name__}: ", end="")
        console.print(str(exc), markup=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
