"""``benchmarks/pyspy_share.py`` on a small raw py-spy file."""

from __future__ import annotations

import gzip
from pathlib import Path

from benchmarks import pyspy_share

_RAW = """\
process 1:"sched";loop (scheduler.py:10);alloc (kvcore/blocks.py:5);_take (kvcore/blocks.py:9) 30
process 1:"sched";loop (scheduler.py:11);forward (model.py:3) 60
process 1:"sched";loop (scheduler.py:10);alloc (kvcore/blocks.py:7) 10
process 2:"detok";recv (zmq.py:1) 100
"""


def test_shares_of_one_process_with_lines_merged(tmp_path: Path) -> None:
    path = tmp_path / "spy.txt.gz"
    path.write_bytes(gzip.compress(_RAW.encode()))
    got = pyspy_share.share(pyspy_share.read_stacks(path), "sched", "kvcore/", 10)
    assert got["samples"] == 100
    assert got["matched"] == 40
    inclusive = dict(got["inclusive"])
    assert inclusive["loop (scheduler.py)"] == 100  # two lines, one function
    assert inclusive["alloc (kvcore/blocks.py)"] == 40
    assert got["own"][0] == ("forward (model.py)", 60)


def test_everything_without_a_filter(tmp_path: Path) -> None:
    path = tmp_path / "spy.txt"
    path.write_text(_RAW)
    assert pyspy_share.share(pyspy_share.read_stacks(path), "", "kvcore/", 3)["samples"] == 200
