"""Where a process's samples went, from ``py-spy record --format raw`` files (plain or .gz).

    python -m benchmarks.pyspy_share FILE [FILE ...] [--having event_loop_overlap]
        [--match kvcore/] [--top 25]

Per file: the samples whose stack has a frame holding ``--having`` (all when empty: e.g.
``sglang::scheduler`` keeps that process, ``event_loop_overlap`` its main thread),
how many of them have a frame whose text holds ``--match`` (kvcore's share), and the
``--top`` frames by inclusive samples (a frame counted once per stack) and by own samples
(the innermost frame). Frames are ``function (file:line)`` as py-spy writes them; lines are
dropped, so a function's samples add up over its lines. For the serving benchmarks'
``--py-spy`` output (``benchmarks/serve_rounds.py``), to set two modes' profiles side by
side.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path
from typing import Any

_LINE = re.compile(r":\d+\)$")


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """The ``(frames, samples)`` of every line of a raw py-spy file, outermost frame first."""
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode(errors="replace")
    stacks = []
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        if head and count.isdigit():
            stacks.append((head.split(";"), int(count)))
    return stacks


def share(stacks: list[tuple[list[str], int]], having: str, match: str, top: int) -> dict[str, Any]:
    """Totals and top frames of the stacks with a frame holding ``having`` (module
    docstring)."""
    total = matched = 0
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for frames, n in stacks:
        if having and not any(having in f for f in frames):
            continue
        total += n
        names = [_LINE.sub(")", f) for f in frames]
        if match and any(match in f for f in names):
            matched += n
        for name in set(names):
            inclusive[name] += n
        own[names[-1]] += n
    return {
        "samples": total,
        "matched": matched,
        "inclusive": inclusive.most_common(top),
        "own": own.most_common(top),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--having", default="", help="keep stacks with a frame holding this")
    parser.add_argument("--match", default="kvcore/", help="count stacks with a frame holding this")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.files:
        got = share(read_stacks(path), args.having, args.match, args.top)
        n = got["samples"] or 1
        print(f"{path.name}: {got['samples']} samples, {got['matched']} with {args.match!r} "
              f"({100 * got['matched'] / n:.1f}%)")  # fmt: skip
        for title in ("inclusive", "own"):
            print(f"  top {title}:")
            for name, k in got[title]:
                print(f"    {100 * k / n:5.1f}%  {name[:150]}")


if __name__ == "__main__":
    main()
