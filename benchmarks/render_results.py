"""Render the GPU suite's ``results.json`` as the Markdown tables of ``docs/benchmarks.md``.

    python -m benchmarks.render_results OUT/results.json            # print
    python -m benchmarks.render_results OUT/results.json -o run.md  # write a file

One table per figure (ours, baseline, ratio, units, goal), the run's environment (GPU,
driver, torch, cuda-python, Triton, command, commit, date), the step outcomes and the
decisions taken (the default layout on CUDA). Only the standard library is used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FIGURES = {
    "a": "(a) VMM operation cost: kvcore vs raw cuda.bindings",
    "b": "(b) Paged-KV read bandwidth: kvcore views vs plain torch.empty",
    "c": "(c) Handoff between two processes sharing the GPU ledger",
    "d": "(d) Steady-state decode step: allocation overhead and driver calls",
}
ENV_KEYS = (
    ("GPU", "gpu"),
    ("driver", "driver"),
    ("CUDA (driver API)", "cuda_driver_api"),
    ("torch", "torch"),
    ("torch CUDA", "torch_cuda"),
    ("cuda-bindings", "cuda-bindings"),
    ("triton", "triton"),
    ("python", "python"),
    ("mode", "mode"),
    ("command", "command"),
    ("commit", "commit"),
    ("date", "date"),
)


def _num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, (int, float)):
        return f"{x:.{digits}g}"
    return str(x)


def _met(m: Any) -> str:
    return {True: "yes", False: "**no**"}.get(m, "-")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(results: dict[str, Any], level: int = 2, *, notes: bool = True) -> str:
    """The whole report as Markdown, its headings at ``level`` (2: ``##``); without
    ``notes`` the figure tables leave their notes column out (a compact console summary)."""
    h = "#" * level
    meta = results.get("meta", {})
    lines = [f"{h} Environment", "", "| | |", "|---|---|"]
    for label, key in ENV_KEYS:
        if meta.get(key) is not None:
            value = f"`{meta[key]}`" if key in ("command", "commit") else meta[key]
            lines.append(f"| {label} | {_cell(value)} |")
    if len(lines) == 4:
        lines.append("| run | not yet run |")
    lines.append("")
    decisions = results.get("decisions") or {}
    if decisions:
        lines += [f"{h} Decisions", ""]
        for key, dec in decisions.items():
            summary = dec.get("summary", dec) if isinstance(dec, dict) else dec
            lines.append(f"- **{key}**: {_cell(summary)}")
        lines.append("")
    figures = results.get("figures", [])
    for fig, title in FIGURES.items():
        rows = [f for f in figures if f.get("figure") == fig]
        lines += [f"{h} {title}", ""]
        if not rows:
            lines += ["not yet run", ""]
            continue
        cols = ["figure", "ours", "baseline", "ratio", "units", "goal", "met"]
        if notes:
            cols.append("notes")
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            base = _num(r.get("baseline"))
            if r.get("baseline_label") and r.get("baseline") is not None:
                base = f"{base} ({r['baseline_label']})"
            lines.append(
                "| "
                + " | ".join(
                    _cell(x)
                    for x in (
                        r.get("name", ""),
                        _num(r.get("ours")),
                        base,
                        _num(r.get("ratio"), 3),
                        r.get("units", ""),
                        r.get("goal", ""),
                        _met(r.get("met")),
                        *([r.get("note", "")] if notes else []),
                    )
                )
                + " |"
            )
        lines.append("")
    steps = results.get("steps", {})
    lines += _channel_table(steps.get("channel", {}), h)
    if steps:
        lines += [f"{h} Steps", "", "| step | status | seconds | detail |", "|---|---|---|---|"]
        for name, rec in steps.items():
            detail = rec.get("error") or rec.get("reason") or ""
            if name == "pytest" and rec.get("status") == "ok":
                d = rec.get("details", {})
                counts = d.get("counts", {})
                detail = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"
                if d.get("timed_out"):
                    detail += " (timed out)"
            lines.append(
                f"| {name} | {rec.get('status')} | {_num(rec.get('seconds'))} | {_cell(detail)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _channel_table(step: dict[str, Any], h: str) -> list[str]:
    """The worker-channel latency rows of ``channel_latency.py --json``, where present."""
    data = (step.get("details") or {}).get("results") or {}
    rows = data.get("channel") if isinstance(data, dict) else None
    if not rows:
        return []
    local = data.get("local", {})
    out = [
        f"{h} Worker channel: per-page map/unmap through the channel vs the local mapper",
        "",
        f"Local mapper: map {_num(local.get('map_ms'))} ms, unmap "
        f"{_num(local.get('unmap_ms'))} ms per page.",
        "",
        "| workers | map ms/page | unmap ms/page | map vs local | unmap vs local |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.get('workers')} | {_num(r.get('map_ms'))} | {_num(r.get('unmap_ms'))} | "
            f"{_num(r.get('map_ratio'), 3)} | {_num(r.get('unmap_ratio'), 3)} |"
        )
    return [*out, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="results.json written by benchmarks.gpu_suite")
    ap.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    ap.add_argument("--level", type=int, default=2, help="heading level (3 inside the docs)")
    ap.add_argument(
        "--commit", help="override the recorded commit (e.g. when the device copy had no .git)"
    )
    args = ap.parse_args(argv)
    results = json.loads(args.results.read_text())
    if args.commit:
        results.setdefault("meta", {})["commit"] = args.commit
    text = render_markdown(results, args.level)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
