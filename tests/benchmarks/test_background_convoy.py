"""``benchmarks/background_convoy.py`` on the host backend: every variant gives back and
maps ahead every page (the script checks the allocator's figures after each run), and the
interpreter's switch interval is as it was once the script is done."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import background_convoy


def test_every_variant_gives_back_and_maps_ahead_every_page(tmp_path) -> None:
    out_path = tmp_path / "convoy.json"
    before = sys.getswitchinterval()
    background_convoy.main(
        [
            "--layers", "2", "--pages", "2", "--page-mib", "0.0625", "--repeats", "1",
            "--switch-us", "1000", "50", "--json", str(out_path),
        ]
    )  # fmt: skip
    assert sys.getswitchinterval() == before
    out = json.loads(out_path.read_text())
    assert out["complete"] is True
    rows = {(r["switch_us"], r["work"]): r for r in out["results"]}
    assert set(rows) == {(us, w) for us in (1000, 50) for w in background_convoy.WORKS}
    for row in rows.values():
        assert row["handles"] == 2 * 2 * 2  # pages x layers x (K, V)
        assert row["idle_ms"] > 0 and row["busy_ms"] > 0


def test_each_finished_row_is_kept_before_the_next_begins() -> None:
    """A run a timeout stops keeps its rows: ``on_row`` sees the results after each one,
    marked incomplete until the last."""
    args = background_convoy.parse_args(
        ["--layers", "1", "--pages", "1", "--page-mib", "0.0625", "--repeats", "1",
         "--switch-us", "50"]
    )  # fmt: skip
    seen: list[tuple[int, bool]] = []
    got = background_convoy.run(args, lambda r: seen.append((len(r["results"]), r["complete"])))
    assert seen == [(1, False), (2, False), (3, False)]
    assert got["complete"] is True and len(got["results"]) == 3


@pytest.mark.parametrize("bad", [["--pages", "0"], ["--switch-us", "-5"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        background_convoy.parse_args(bad)
