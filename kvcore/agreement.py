"""Agreement of physical allocation outcomes across ranks that must decide alike.

SGLang's tensor-parallel ranks each run the same scheduler on the same inputs and must take
the same decisions; each rank owns its own kvcore manager (its GPU, its budget) and no page
operation is sent to a peer. Without a physical budget a rank's capacity is the ledger's
logical count, the same on every rank. With one (``limit_bytes``, the per-GPU ledger), a
rank can miss where its peers do not, and the schedulers would diverge. ``AgreedLedger``
closes that gap with two small collectives over the ranks' CPU group, never a page
operation:

* ``alloc(n)`` allocates locally, then all ranks reduce ``(ok, room)`` with MIN: the
  allocation stands only if every rank got its blocks; a rank that got them while a peer
  missed frees them again (rollback), so every rank returns ``None`` together. ``room`` is
  the smallest physical room left on any rank.
* ``available()`` is that agreed room plus the blocks freed since, capped by the logical free
  count: the same number on every rank, computed without a collective (SGLang also reads
  it from metrics and logging code that does not run in lockstep).
* ``step()`` is called once per scheduler iteration (lockstep on every rank): while the
  agreed room is below the logical free count (the budget binds) it refreshes the room
  with one collective, so memory freed by another instance on the GPU is seen even when
  this instance allocates nothing.

Cost: one all-reduce of two int64 over the CPU group per allocation call (one per prefill
batch and one per decode step in SGLang), plus one per scheduler iteration while the
budget binds; ``benchmarks/sglang_tp_agreement.py`` measures it. Nothing is exchanged
without a budget: ``agreement_for`` returns ``None`` there and the plain ledger is used.

Why every allocation and not only those that map new pages: after a rollback the ledgers
of the ranks hold the same counts and the same number of pages, but which of several
equally filled pages is picked next may differ, so "this allocation needs a fresh page"
is not guaranteed to be the same predicate on every rank, and a collective entered by some
ranks only would hang. Every decision taken from an ``AgreedLedger`` depends on counts
(``used``, agreed room, blocks freed), never on a rank's page layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcore.errors import AgreementError

if TYPE_CHECKING:
    from kvcore.blocks import BlockLedger
    from kvcore.geometry import KVGeometry
    from kvcore.pages import PageAllocator

__all__ = ["AgreedLedger", "RankAgreement", "TorchGroupAgreement"]

_UNBOUNDED = (1 << 62) - 1


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
        return self._size

    def min(self, values: Sequence[int]) -> list[int]:
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


class AgreedLedger:
    """A ``BlockLedger`` whose allocation outcomes and physical room are agreed across ranks
    (module docstring). Offers the ledger calls the engine allocators use; everything not
    about capacity forwards to the wrapped ledger."""

    def __init__(self, ledger: BlockLedger, agreement: RankAgreement) -> None:
        self._ledger = ledger
        self._agreement = agreement
        self._room = self._agree_room()  # a collective: every rank wraps its ledger together
        self._freed = 0

    @property
    def inner(self) -> BlockLedger:
        """The rank-local ledger."""
        return self._ledger

    @property
    def geometry(self) -> KVGeometry:
        return self._ledger.geometry

    @property
    def pages(self) -> PageAllocator:
        return self._ledger.pages

    def alloc(self, n: int) -> list[int] | None:
        """``BlockLedger.alloc`` agreed by every rank: the ids when all ranks got theirs,
        else ``None`` on every rank (a rank that succeeded frees them again). A collective
        (every rank calls it at the same point); ``n <= 0`` is local."""
        if n <= 0:
            return self._ledger.alloc(n)
        ids = self._ledger.alloc(n)
        try:
            ok, room = self._agreement.min([ids is not None, self._local_room()])
        except BaseException:
            if ids is not None:
                self._ledger.free(ids)
            raise
        self._room, self._freed = room, 0
        if ok:
            return ids
        if ids is not None:  # a peer missed: roll back so every rank reports the miss
            self._ledger.free(ids)
        # every rank (rolled back or not) agrees the room left after the miss
        self._room, self._freed = self._agree_room(), 0
        return None

    def free(self, block_ids: Sequence[int], fence: int | None = None) -> None:
        """``BlockLedger.free``; local (no collective). The freed blocks count towards the
        agreed room until the next agreement."""
        self._ledger.free(block_ids, fence)
        self._freed += len(block_ids)

    def free_range(self, first: int, count: int, fence: int | None = None) -> None:
        """Free the ``count`` consecutive ids from ``first`` (as ``free``)."""
        self.free(range(first, first + count), fence)

    def available(self) -> int:
        """Blocks every rank can allocate, as last agreed plus the blocks freed since,
        capped by the logical free count. The same on every rank; no collective."""
        logical = self._logical_free()
        return min(self._room + self._freed, logical)

    def step(self) -> bool:
        """Call once per scheduler iteration on every rank. While the agreed room is below
        the logical free count, refresh it with one collective; returns whether it did."""
        if self._room + self._freed >= self._logical_free():
            return False
        self._room, self._freed = self._agree_room(), 0
        return True

    def used(self) -> int:
        return self._ledger.used()

    def page_of(self, block_id: int) -> int:
        return self._ledger.page_of(block_id)

    def is_allocated(self, block_id: int) -> bool:
        return self._ledger.is_allocated(block_id)

    def eviction_order(self, candidates: Iterable[int]) -> list[int]:
        return self._ledger.eviction_order(candidates)

    def close(self) -> None:
        self._ledger.close()

    def _logical_free(self) -> int:
        return self._ledger.geometry.num_blocks - self._ledger.used()

    def _local_room(self) -> int:
        return min(self._ledger.available(), _UNBOUNDED)

    def _agree_room(self) -> int:
        return self._agreement.min([self._local_room()])[0]
