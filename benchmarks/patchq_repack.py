"""Cost of repacking a forked engine wheel: patchq's stored-bytes copy vs ``zipfile``'s.

``patchq.wheel.repack`` copies every member the series does not touch as stored (no inflate /
deflate round trip) with its own small zip writer, because ``zipfile`` can only write a member
by compressing it again. This measures that choice side by side, interleaved, on a real pinned
wheel: copying every member of the wheel into a new zip

* with ``zipfile`` (read, then ``writestr`` deflated: what a zipfile-based repack or
  ``wheel pack`` does), and
* with patchq's ``_ZipWriter.copy`` (the bytes as stored),

and reports the median wall and process-CPU seconds of ``--repeats`` rounds and their ratio.

    python -m benchmarks.patchq_repack [--engine sglang --version 0.5.23] [--repeats 3]

The wheel comes from the artifact cache (downloaded and verified if missing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from patchq.wheel import _ZipWriter
from patchq.workspace import Workspace, running_python


def _with_zipfile(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for member in zin.infolist():
            zout.writestr(member, zin.read(member), compress_type=zipfile.ZIP_DEFLATED)


def _with_patchq(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zin, open(src, "rb") as raw, open(dst, "wb") as fh:
        out = _ZipWriter(fh)
        for member in zin.infolist():
            out.copy(raw, member, member.filename)
        out.close()


def _timed(fn: Callable[[Path, Path], None], src: Path, dst: Path) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn(src, dst)
    result = time.perf_counter() - wall, time.process_time() - cpu
    with zipfile.ZipFile(dst) as check:  # both outputs must be complete, valid archives
        assert len(check.infolist()) > 0
    dst.unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="sglang")
    parser.add_argument("--version", default="0.5.23")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ws = Workspace()
    wheel = ws.cache.fetch(ws.release(args.engine, args.version), "wheel", running_python())
    runs: dict[str, list[tuple[float, float]]] = {"zipfile": [], "patchq": []}
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "out.whl"
        for _ in range(args.repeats):
            runs["zipfile"].append(_timed(_with_zipfile, wheel, dst))
            runs["patchq"].append(_timed(_with_patchq, wheel, dst))
    size = wheel.stat().st_size / 2**20
    print(f"{wheel.name} ({size:.0f} MiB), median of {args.repeats} interleaved rounds")
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in runs.items()
    }
    for name, (wall, cpu) in med.items():
        print(f"  {name:8s} wall {wall:7.2f} s   cpu {cpu:7.2f} s")
    ratio_wall = med["zipfile"][0] / med["patchq"][0]
    ratio_cpu = med["zipfile"][1] / med["patchq"][1]
    print(f"  zipfile / patchq: wall {ratio_wall:.1f}x, cpu {ratio_cpu:.1f}x")


if __name__ == "__main__":
    main()
