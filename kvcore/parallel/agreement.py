"""Agreement of physical allocation outcomes across ranks that must decide alike.

SGLang's tensor-parallel ranks each run the same scheduler on the same inputs and must take
the same decisions; each rank owns its own kvcore memory (its GPU, its budget) and no page
operation is sent to a peer. Without a physical budget a rank's capacity is the logical
count (free blocks, free slots), the same on every rank. With one (``limit_bytes``, the
per-GPU ledger), a rank can miss where its peers do not, and the schedulers would diverge.
This module closes that gap with small collectives over the ranks' CPU group, never a page
operation:

* ``AgreedRoom.decide(attempt, undo)`` runs one allocation decision (any "try locally ->
  result or ``None``" operation: a ledger's ``alloc``, the hybrid SWA pair over two
  ledgers, a Mamba slot ``take``), then all ranks reduce ``(ok, room...)`` with MIN: the
  result stands only if every rank got it; a rank that got it while a peer missed undoes it
  (rollback), so every rank returns ``None`` together. ``room`` is a small vector (one
  figure per thing the engine plans with: blocks of a ledger, tokens of each SWA side,
  slots), the smallest on any rank.
* ``AgreedRoom.available(i)`` is that agreed room plus what was freed since, capped by the
  logical free count: the same number on every rank, computed without a collective (SGLang
  also reads it from metrics and logging code that does not run in lockstep).
* ``Agreement.step()`` is called once per scheduler iteration (lockstep on every rank):
  every room of the rank whose agreed figure is below its logical free count (the budget
  binds) is refreshed, all in one collective, so memory freed by another instance on the
  GPU (or by another pool on the same gate) is seen even when this rank allocates nothing.

``AgreedLedger`` is a ``BlockLedger`` whose ``alloc`` is such a decision (the token and
paged allocators); ``RoomLedger`` is one part of a decision taken by its owner (each side of
the hybrid SWA allocator).

Why it cannot hang. A collective is entered by ``decide`` (one; two after an agreed miss),
by ``step`` (one while any room binds) and when a room is created (one). Each is reached
from the scheduler's own control flow, which takes the same path on every rank because it
reads only rank-independent figures: agreed rooms, counts of frees (the same requests free
the same amounts everywhere) and logical counts. The agreed ``ok`` is itself the same on
every rank, so the miss path's second collective is entered by all or none. All rooms of a
rank share one CPU group, whose collectives are matched in issue order; a scheduler step
that allocates KV and then Mamba slots issues the KV decision's collective(s) and then the
Mamba decision's on every rank, in that order. A decision is never skipped on a
rank-local condition (``AgreedLedger.alloc(n <= 0)`` skips on a rank-independent one). A
local exception between entering a decision and its collective (an index kernel failing)
leaves the peers waiting in the collective until the group's timeout, then they raise
``AgreementError``; that is a crashed rank, which SGLang cannot survive anyway.

Why every allocation and not only those that map new pages: after a rollback the ledgers
of the ranks hold the same counts, but which of several equally filled pages is picked next
may differ, so "this allocation needs a fresh page" is not guaranteed to be the same
predicate on every rank, and a collective entered by some ranks only would hang.

Cost: one all-reduce of a few int64 over the CPU group per allocation decision (one per
prefill batch and one per decode step in SGLang, one more per Mamba slot allocation), plus
one per scheduler iteration while a budget binds; ``benchmarks/sglang_tp_agreement.py``
measures it. Nothing is exchanged without a budget: the SGLang scope builds no agreement
there and the plain ledger and slot state are used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvcore.errors import AgreementError

if TYPE_CHECKING:
    from array import array

    import torch

    from kvcore.memory.blocks import BlockLedger
    from kvcore.memory.geometry import KVGeometry
    from kvcore.memory.pages import PageAllocator

__all__ = [
    "AgreedLedger",
    "AgreedRoom",
    "Agreement",
    "RankAgreement",
    "RoomLedger",
    "TorchGroupAgreement",
]

_UNBOUNDED = (1 << 62) - 1

T = TypeVar("T")


class RankAgreement(Protocol):
    """Element-wise minimum of small integer vectors across a fixed set of ranks."""

    @property
    def size(self) -> int:
        """Number of ranks taking part."""
        ...

    def min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of ``values`` over every rank. A collective: every rank
        must call it at the same point with vectors of the same length. Raises
        ``AgreementError`` when the group fails."""
        ...


class TorchGroupAgreement:
    """``RankAgreement`` over a ``torch.distributed`` process group, normally the CPU (gloo)
    group of the ranks that share one scheduler's decisions (SGLang: the attention-TP
    group). ``group=None`` is the default group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._size = int(dist.get_world_size(group))

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return self._size

    def min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of ``values`` over every rank (a collective: an
        ``all_reduce``). Raises ``AgreementError`` when a peer is gone."""
        import torch

        t = torch.tensor(list(values), dtype=torch.int64)
        try:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        except (RuntimeError, ValueError) as exc:  # a peer gone; the group destroyed
            raise AgreementError(
                f"kvcore: the ranks' allocation agreement failed ({exc})",
                hint="a peer rank died or left; restart the engine",
            ) from exc
        return [int(v) for v in t.tolist()]


def _clamp(values: Sequence[int]) -> list[int]:
    return [min(int(v), _UNBOUNDED) for v in values]


class AgreedRoom:
    """The agreed room of one allocator (module docstring). Build it with
    ``Agreement.room``. ``local()`` is this rank's own room vector (what it could allocate
    now), ``logical()`` the logical free counts (the same on every rank), same length."""

    def __init__(
        self,
        ranks: RankAgreement,
        local: Callable[[], Sequence[int]],
        logical: Callable[[], Sequence[int]],
    ) -> None:
        self._ranks = ranks
        self._local = local
        self._logical = logical
        self._room = self._ranks.min(_clamp(local()))  # a collective: every rank together
        self._freed = [0] * len(self._room)

    def decide(self, attempt: Callable[[], T | None], undo: Callable[[T], None]) -> T | None:
        """Run ``attempt`` here and agree its outcome with every rank: its result when every
        rank's attempt succeeded, else ``None`` on every rank, ``undo(result)`` having run
        where the attempt had succeeded. A collective (every rank calls it at the same
        point). Raises ``AgreementError`` (after ``undo``) when the group fails; an
        exception from ``attempt`` propagates before any collective."""
        got = attempt()
        try:
            ok, *room = self._ranks.min([got is not None, *self.local_room()])
        except BaseException:
            if got is not None:
                undo(got)
            raise
        self.settle(room)
        if ok:
            return got
        if got is not None:  # a peer missed: roll back so every rank reports the miss
            undo(got)
        self.refresh()  # every rank (rolled back or not) agrees the room after the miss
        return None

    def freed(self, count: int, index: int = 0) -> None:
        """Note ``count`` units of ``index`` freed here since the last agreement (local; the
        same count on every rank, as the same requests free the same amounts)."""
        self._freed[index] += count

    def available(self, index: int = 0) -> int:
        """Units of ``index`` every rank can allocate, as last agreed plus those freed since,
        capped by the logical free count. The same on every rank; no collective."""
        return max(0, min(self._room[index] + self._freed[index], self._logical()[index]))

    def binds(self) -> bool:
        """Whether an agreed figure is below its logical free count (rank-independent)."""
        logical = self._logical()
        return any(r + f < g for r, f, g in zip(self._room, self._freed, logical, strict=True))

    def refresh(self) -> None:
        """Agree this rank's current room with every rank (a collective)."""
        self.settle(self._ranks.min(self.local_room()))

    def local_room(self) -> list[int]:
        """This rank's own room now, clamped as it is exchanged (no collective): what
        ``Agreement.step`` contributes for this room."""
        return _clamp(self._local())

    def settle(self, room: Sequence[int]) -> None:
        """Take ``room`` (the minimum over every rank of ``local_room()``, one entry per
        index) as the agreed room; the frees noted since the last agreement are in it."""
        if len(room) != len(self._room):
            raise ValueError(f"agreed room has {len(room)} entries, this room {len(self._room)}")
        self._room = list(room)
        self._freed = [0] * len(self._room)

    @property
    def size(self) -> int:
        """How many figures the room agrees (its vector's length)."""
        return len(self._room)


class Agreement:
    """One rank's agreement with its peers over ``ranks``: the ``AgreedRoom`` of each of
    its allocators, refreshed together by ``step``. An engine instance holds one (SGLang's
    scope: one per rank), so its allocators' collectives all go over the same group."""

    def __init__(self, ranks: RankAgreement) -> None:
        self.ranks = ranks
        self._rooms: list[AgreedRoom] = []

    def room(
        self, local: Callable[[], Sequence[int]], logical: Callable[[], Sequence[int]]
    ) -> AgreedRoom:
        """A new agreed room (see ``AgreedRoom``); a collective: every rank creates its
        allocators' rooms in the same order."""
        room = AgreedRoom(self.ranks, local, logical)
        self._rooms.append(room)
        return room

    def step(self) -> bool:
        """Call once per scheduler iteration on every rank. Refreshes every room that binds,
        in one collective; returns whether it exchanged anything."""
        binding = [r for r in self._rooms if r.binds()]
        if not binding:
            return False
        values = [v for r in binding for v in r.local_room()]
        agreed = self.ranks.min(values)
        at = 0
        for r in binding:
            r.settle(agreed[at : at + r.size])
            at += r.size
        return True


class RoomLedger:
    """A ``BlockLedger`` that is part ``index`` of an ``AgreedRoom`` whose decisions its
    owner takes (``room.decide`` around an allocation over several ledgers, e.g. the two
    sides of the hybrid SWA allocator): ``alloc`` is this rank's own, frees count toward the
    agreed room, ``available()`` is the agreed figure. Everything not about capacity
    forwards to the wrapped ledger."""

    def __init__(self, ledger: BlockLedger, room: AgreedRoom, index: int = 0) -> None:
        self._ledger = ledger
        self.room = room
        self.index = index

    @property
    def inner(self) -> BlockLedger:
        """The rank-local ledger."""
        return self._ledger

    @property
    def geometry(self) -> KVGeometry:
        """``BlockLedger.geometry``."""
        return self._ledger.geometry

    @property
    def pages(self) -> PageAllocator:
        """``BlockLedger.pages``: the rank-local page allocator."""
        return self._ledger.pages

    def alloc(self, n: int) -> list[int] | None:
        """``BlockLedger.alloc`` on this rank only (the owner agrees the decision)."""
        return self._ledger.alloc(n)

    def free(self, block_ids: Sequence[int], fence: int | None = None) -> None:
        """``BlockLedger.free``; local (no collective). The freed blocks count towards the
        agreed room until the next agreement."""
        self._ledger.free(block_ids, fence)
        self.room.freed(len(block_ids), self.index)

    def alloc_split(self, n: int) -> tuple[array[int], list[tuple[int, int]]] | None:
        """``BlockLedger.alloc_split`` on this rank only (the owner agrees the decision)."""
        return self._ledger.alloc_split(n)

    def free_tensor(self, block_ids: torch.Tensor, fence: int | None = None) -> None:
        """``BlockLedger.free_tensor``, counted toward the agreed room like ``free``."""
        self._ledger.free_tensor(block_ids, fence)
        self.room.freed(block_ids.numel(), self.index)

    def free_range(self, first: int, count: int, fence: int | None = None) -> None:
        """``BlockLedger.free_range``, counted toward the agreed room like ``free``."""
        self._ledger.free_range(first, count, fence)
        self.room.freed(count, self.index)

    def free_runs(self, runs: Sequence[tuple[int, int]], fence: int | None = None) -> None:
        """``BlockLedger.free_runs``, counted toward the agreed room like ``free``."""
        self._ledger.free_runs(runs, fence)
        self.room.freed(sum(count for _, count in runs), self.index)

    def available(self) -> int:
        """Blocks every rank can allocate (``AgreedRoom.available``); no collective."""
        return self.room.available(self.index)

    def used(self) -> int:
        """``BlockLedger.used`` of this rank."""
        return self._ledger.used()

    def held_free(self) -> int:
        """``BlockLedger.held_free`` of this rank."""
        return self._ledger.held_free()

    def page_of(self, block_id: int) -> int:
        """``BlockLedger.page_of``."""
        return self._ledger.page_of(block_id)

    def is_allocated(self, block_id: int) -> bool:
        """``BlockLedger.is_allocated`` on this rank."""
        return self._ledger.is_allocated(block_id)

    def eviction_order(self, candidates: Iterable[int]) -> list[int]:
        """``BlockLedger.eviction_order`` on this rank."""
        return self._ledger.eviction_order(candidates)

    def close(self) -> None:
        """``BlockLedger.close``: closes the rank-local page allocator."""
        self._ledger.close()


class AgreedLedger(RoomLedger):
    """A ``BlockLedger`` whose allocation outcomes and physical room are agreed across ranks
    (module docstring): its own one-figure ``AgreedRoom`` (blocks), every ``alloc`` one
    decision. ``agreement``: the rank's ``Agreement`` (its other rooms refresh with this
    one in ``step``) or a bare ``RankAgreement``. Creating it is a collective."""

    def __init__(self, ledger: BlockLedger, agreement: Agreement | RankAgreement) -> None:
        self._agreement = agreement if isinstance(agreement, Agreement) else Agreement(agreement)
        room = self._agreement.room(
            lambda: [ledger.available()],
            lambda: [ledger.geometry.num_blocks - ledger.used()],
        )
        super().__init__(ledger, room)

    def alloc(self, n: int) -> list[int] | None:
        """``BlockLedger.alloc`` agreed by every rank: the ids when all ranks got theirs,
        else ``None`` on every rank (a rank that succeeded frees them again). A collective
        (every rank calls it at the same point); ``n <= 0`` is local."""
        if n <= 0:
            return self._ledger.alloc(n)
        return self.room.decide(lambda: self._ledger.alloc(n), self._ledger.free)

    def alloc_split(self, n: int) -> tuple[array[int], list[tuple[int, int]]] | None:
        """``BlockLedger.alloc_split`` agreed by every rank, as ``alloc`` (a collective)."""
        if n <= 0:
            return self._ledger.alloc_split(n)
        return self.room.decide(lambda: self._ledger.alloc_split(n), self._undo_split)

    def _undo_split(self, got: tuple[array[int], list[tuple[int, int]]]) -> None:
        """Give back what ``alloc_split`` allocated."""
        ids, runs = got
        if ids:
            self._ledger.free(ids)
        if runs:
            self._ledger.free_runs(runs)

    def step(self) -> bool:
        """``Agreement.step`` of this rank (call once per scheduler iteration)."""
        return self._agreement.step()
