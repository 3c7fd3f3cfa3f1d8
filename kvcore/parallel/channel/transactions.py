"""Transaction outcomes, remembered per transaction id on each worker.

The coordinator gives every page transition a fresh transaction id (``txn``). A worker
keeps the outcome of each id it has seen so that retransmits and late or reordered
requests are answered from that record instead of being applied twice:

=================  ==========================================================
request            worker's rule (by the outcome recorded for ``txn``)
=================  ==========================================================
``MAP``            new id: apply, record ``MAPPED`` (or ``MAP_FAILED``);
                   ``MAPPED`` with the same pages: nothing (a retransmit);
                   anything else: refused
``UNDO_MAP``       ``MAPPED``: unmap those pages, record ``UNDONE``; new id or
                   ``MAP_FAILED``: record ``UNDONE`` (a late ``MAP`` is refused);
                   ``UNDONE``: nothing
``PREPARE``        new id: apply, record ``PREPARED`` (``ABORTED`` if it failed);
                   ``PREPARED`` with the same pages: nothing; after its abort
                   (or commit): refused
``COMMIT``         pages prepared under the id: release those not yet committed
                   (idempotent); aborted or never prepared: refused
``ABORT``          pages prepared under the id: restore those not yet aborted;
                   new id: record ``ABORTED`` (so a late ``PREPARE`` is refused);
                   committed pages: refused
=================  ==========================================================

A refusal raises ``TransactionRefused`` and changes nothing. The log keeps the last
``capacity`` finished transactions (unfinished prepares are never forgotten).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from kvcore.errors import TransactionRefused
from kvcore.parallel.channel.messages import Op, Request

DEFAULT_CAPACITY = 1 << 16


class Outcome(enum.Enum):
    """What a worker did with one transaction id."""

    MAPPED = "mapped"
    MAP_FAILED = "map-failed"
    UNDONE = "undone"
    PREPARED = "prepared"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass
class _Entry:
    outcome: Outcome
    pages: frozenset[int]
    committed: set[int] = field(default_factory=set)
    aborted: set[int] = field(default_factory=set)


class TransactionLog:
    """One worker's outcomes by transaction id. Not thread-safe: one session applies
    requests in order.

    Use: ``pages = log.begin(request)`` (raises ``TransactionRefused``; ``pages`` are the
    page ids to apply now, possibly none), apply them, then ``log.finish(request, pages,
    ok)``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()

    def outcome(self, txn: int) -> Outcome | None:
        """The outcome recorded for ``txn`` (``None``: never seen or forgotten)."""
        entry = self._entries.get(txn)
        return None if entry is None else entry.outcome

    def begin(self, request: Request) -> tuple[int, ...]:
        """The page ids ``request`` must apply now, or ``TransactionRefused``."""
        op, txn, pages = request.op, request.txn, frozenset(request.pages)
        entry = self._entries.get(txn)
        state = None if entry is None else entry.outcome
        if op is Op.MAP:
            if entry is None:
                return request.pages
            if state is Outcome.MAPPED and entry.pages == pages:
                return ()
            raise self._refuse(request, state, "a map id is used once")
        if op is Op.UNDO_MAP:
            if entry is not None and state is Outcome.MAPPED:
                return tuple(sorted(entry.pages))
            if state in (None, Outcome.MAP_FAILED, Outcome.UNDONE):
                return ()
            raise self._refuse(request, state, "only a map can be undone")
        if op is Op.PREPARE:
            if entry is None:
                return request.pages
            if state is Outcome.PREPARED and entry.pages == pages:
                return ()
            raise self._refuse(request, state, "a prepare after its abort or commit is refused")
        if op is Op.COMMIT:
            if entry is None or state not in (Outcome.PREPARED, Outcome.COMMITTED):
                raise self._refuse(request, state, "only a prepared unmap can be committed")
            self._check_subset(request, entry, against=entry.aborted, other="aborted")
            return tuple(p for p in request.pages if p not in entry.committed)
        if op is Op.ABORT:
            if entry is None:
                return ()
            if state not in (Outcome.PREPARED, Outcome.ABORTED):
                raise self._refuse(request, state, "only a prepared unmap can be aborted")
            self._check_subset(request, entry, against=entry.committed, other="committed")
            return tuple(p for p in request.pages if p not in entry.aborted)
        raise TransactionRefused(f"operation {op.name} is not a transaction step")

    def finish(self, request: Request, applied: tuple[int, ...], ok: bool) -> None:
        """Record the result of applying ``applied`` for ``request``."""
        op, txn = request.op, request.txn
        entry = self._entries.get(txn)
        if op is Op.MAP:
            if entry is None:
                self._put(txn, Outcome.MAPPED if ok else Outcome.MAP_FAILED, request.pages)
        elif op is Op.UNDO_MAP:
            if ok:
                self._put(txn, Outcome.UNDONE, () if entry is None else entry.pages)
        elif op is Op.PREPARE:
            if entry is None and ok:
                self._put(txn, Outcome.PREPARED, request.pages)
            elif entry is None:  # the mapper restored (or quarantined) them itself
                self._put(txn, Outcome.ABORTED, request.pages).aborted.update(request.pages)
        elif op is Op.COMMIT and entry is not None and ok:
            entry.committed.update(applied)
            if entry.committed >= entry.pages:
                entry.outcome = Outcome.COMMITTED
        elif op is Op.ABORT and ok:
            if entry is None:  # abort before its prepare: nothing to restore
                self._put(txn, Outcome.ABORTED, request.pages).aborted.update(request.pages)
            else:
                entry.aborted.update(applied)
                if entry.aborted >= entry.pages:
                    entry.outcome = Outcome.ABORTED
        self._evict()

    def _put(self, txn: int, outcome: Outcome, pages: tuple[int, ...] | frozenset[int]) -> _Entry:
        entry = self._entries[txn] = _Entry(outcome, frozenset(pages))
        self._entries.move_to_end(txn)
        return entry

    def _evict(self) -> None:
        if len(self._entries) <= self.capacity:
            return
        for txn in list(self._entries):
            if len(self._entries) <= self.capacity:
                break
            if self._entries[txn].outcome is not Outcome.PREPARED:
                del self._entries[txn]

    @staticmethod
    def _check_subset(request: Request, entry: _Entry, *, against: set[int], other: str) -> None:
        stray = set(request.pages) - entry.pages
        if stray:
            raise TransactionRefused(
                f"{request.op.name} of txn {request.txn}: pages {sorted(stray)} were not "
                "prepared under it"
            )
        clash = set(request.pages) & against
        if clash:
            raise TransactionRefused(
                f"{request.op.name} of txn {request.txn}: pages {sorted(clash)} were {other}"
            )

    @staticmethod
    def _refuse(request: Request, state: Outcome | None, rule: str) -> TransactionRefused:
        seen = "never seen" if state is None else state.value
        return TransactionRefused(
            f"{request.op.name} of txn {request.txn} refused: the transaction is {seen} ({rule})",
            hint="the coordinator's view of this worker is stale; fail the pool",
        )
