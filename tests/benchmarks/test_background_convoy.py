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
    rows = {(r["switch_us"], r["work"]): r for r in out["results"]}
    assert set(rows) == {(us, w) for us in (1000, 50) for w in background_convoy.WORKS}
    for row in rows.values():
        assert row["handles"] == 2 * 2 * 2  # pages x layers x (K, V)
        assert row["idle_ms"] > 0 and row["busy_ms"] > 0


@pytest.mark.parametrize("bad", [["--pages", "0"], ["--switch-us", "-5"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        background_convoy.parse_args(bad)
