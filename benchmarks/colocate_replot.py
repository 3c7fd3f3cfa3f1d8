"""Draw the KV plots of a saved ``benchmarks/vllm_colocate.py`` run again, from its JSON.

The run's document keeps every sample the plots are drawn from (the ledger's, kvcached's
segments, vLLM's gauges), so a plot can be redrawn here, without a GPU, after the plotting
changed or when the run's own PNG did not come back::

    python -m benchmarks.colocate_replot docs/results/colocate/RUN.json.gz [--out-dir DIR]

One PNG per (peak, repeat) that any mode finished, named as the run names them
(``<stem>-kv-<workload>[-peak<P>]-r<R>.png``), in ``--out-dir`` (default: beside the
JSON). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.vllm_colocate import plot_phases


def load_document(path: Path) -> dict[str, Any]:
    """A run's JSON document, gzip-compressed (``.gz``) or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        document: dict[str, Any] = json.load(f)
    return document


def run_stem(path: Path) -> str:
    """``RUN`` of ``RUN.json`` or ``RUN.json.gz``: the prefix the PNGs' names start with."""
    name = path.name.removesuffix(".gz")
    return name.removesuffix(".json")


def replot(document: Mapping[str, Any], stem: Path) -> list[Path]:
    """Every KV plot of ``document``, written as ``<stem>-kv-...png``; their paths."""
    config = document["config"]

    def held(mode: str) -> Sequence[Mapping[str, Any]]:
        key = "kvcached_segments" if mode == "kvcached" else "ledger"
        samples: Sequence[Mapping[str, Any]] = document.get(key, [])
        return samples

    def capacity(mode: str) -> dict[str, int]:
        prefix = mode + "/"
        return {label.removeprefix(prefix): server["kv_bytes"]
                for label, server in document["servers"].items()
                if label.startswith(prefix)}  # fmt: skip

    groups: dict[tuple[Any, Any], dict[str, Mapping[str, Any]]] = {}
    for phase in document["phases"]:
        if phase.get("summary"):
            groups.setdefault((phase["peak"], phase["repeat"]), {})[phase["mode"]] = phase
    kv_total, workload = config["kv_total_bytes"], config["workload"]
    gauges = document["gauges"]
    return [plot_phases(done, held, gauges, capacity, kv_total, workload, stem)
            for done in groups.values()]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("document", type=Path, help="the run's JSON (.json or .json.gz)")
    p.add_argument("--out-dir", type=Path, default=None, help="default: beside the JSON")
    args = p.parse_args(argv)
    out_dir = args.out_dir or args.document.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in replot(load_document(args.document), out_dir / run_stem(args.document)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
