"""``PinnedStaging``: the ledger's ids reach the device through one pinned buffer of two
halves, and no slice of it is written while a copy from it may still be queued.

On the CPU the buffer is not pinned and each copy completes at once; the events are the
test's own (``Marker``), so a half's copies can be held "in flight": coming back to that
half must wait for them (``synchronize``), and nothing else may wait.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from kvcore.adapters.sglang.staging import PinnedStaging

from .harness import requires_fork

pytestmark = requires_fork


class Marker:
    """An event the test inspects: recorded on a stream, then waited for or not."""

    def __init__(self) -> None:
        self.recorded: str | None = None
        self.waited = False

    def record(self, stream: str) -> None:
        self.recorded = stream

    def synchronize(self) -> None:
        self.waited = True


def _staging(half: int, streams: list[str] | None = None) -> tuple[PinnedStaging, list[Marker]]:
    """A staging on the CPU whose events are ``Marker``s (the list of those made) and
    whose current stream is ``streams[-1]`` (``"s"`` when not given)."""
    made: list[Marker] = []
    current = streams if streams is not None else ["s"]

    def event() -> Marker:
        made.append(Marker())
        return made[-1]

    staging = PinnedStaging("cpu", pin=False, half=half, event=event, stream=lambda: current[-1])
    return staging, made


def test_each_copy_holds_its_ids_after_the_buffer_is_written_again() -> None:
    staging, _ = _staging(half=8)
    lists = [array("q", range(k * 10, k * 10 + n)) for k, n in enumerate([3, 5, 2, 8, 1, 7, 6])]
    out = [staging.to_device(ids) for ids in lists]
    for ids, t in zip(lists, out, strict=True):
        assert t.dtype == torch.int64 and t.tolist() == list(ids)


def test_a_half_is_written_again_only_after_its_copies_are_waited_for() -> None:
    staging, made = _staging(half=8)
    staging.to_device(array("q", range(6)))  # half 0
    assert made == []  # no event while a half has room
    staging.to_device(array("q", range(4)))  # 6 + 4 > 8: half 1, half 0 left behind an event
    assert len(made) == 1 and made[0].recorded == "s" and not made[0].waited
    staging.to_device(array("q", range(4)))  # half 1 has room: nothing waits
    assert not made[0].waited
    staging.to_device(array("q", range(5)))  # back to half 0: its copies must have run
    assert made[0].waited
    assert len(made) == 2 and made[1].recorded == "s" and not made[1].waited


def test_a_half_used_on_two_streams_waits_for_both() -> None:
    """Copies queued on different streams are ordered by none of the others' events: leaving
    the half records one behind each, and coming back waits for all of them."""
    streams = ["schedule"]
    staging, made = _staging(half=8, streams=streams)
    staging.to_device(array("q", range(3)))
    streams.append("forward")
    staging.to_device(array("q", range(3)))
    staging.to_device(array("q", range(3)))  # 9 > 8: leaves half 0
    assert sorted(m.recorded or "" for m in made) == ["forward", "schedule"]
    staging.to_device(array("q", range(6)))  # 3 + 6 > 8: back to half 0
    assert all(m.waited for m in made[:2])
    assert [m.recorded for m in made[2:]] == ["forward"]  # half 1 had copies on one stream


def test_a_list_larger_than_a_half_takes_its_own_buffer() -> None:
    staging, made = _staging(half=4)
    staging.to_device(array("q", [1, 2]))
    big = array("q", range(100, 109))
    assert staging.to_device(big).tolist() == list(big)
    assert made == []  # the halves were not touched
    assert staging.to_device(array("q", [7, 8])).tolist() == [7, 8]  # still in half 0
    assert made == []


def test_the_allocators_scattered_ids_go_through_the_staging(make: Any) -> None:
    """The token allocator's ids from partly used pages (a list on the host) reach SGLang
    through the staging buffer, as on a GPU: the ids handed out are exactly the free ones,
    allocation after allocation, across both halves."""
    a = make("on", size=1024, page_size=1).allocator
    a._staging, made = _staging(half=64)
    held = a.alloc(a.available_size())
    assert held is not None
    for round_ in range(6):
        freed = held[round_::7][:40]  # scattered over the pool's pages
        a.free(freed)
        got = a.alloc(40)
        assert got is not None and sorted(got.tolist()) == sorted(freed.tolist())
        held = torch.cat([held[~torch.isin(held, freed)], got])
    assert made and all(m.recorded == "s" for m in made)  # the halves were switched
