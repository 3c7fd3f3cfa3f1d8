"""Shares of the GPU budget: what an instance may borrow, and when it must give way.

Instances sharing a GPU draw on one budget (``kvcore.budget.ledger``). Without a rule, the
first instance under load maps the whole budget and keeps it for as long as its own requests
keep arriving: a second instance that starts a burst later waits (or preempts) although the
first holds far more than a static split would have given it. kvcore's rule is a guaranteed
share with work-conserving borrowing:

* every instance has a **share**: the bytes set for it (``kvctl share NAME SIZE``), else an
  equal part of the GPU budget among the instances registered in the ledger
  (``budget // instances``);
* an instance may map beyond its share while nobody else wants that memory (an idle
  neighbour's part is borrowed, which is the point of elastic KV);
* an instance **below its share that the budget refuses** is *waiting*: its gate marks its
  record (and the ledger header) ``wanted_until = now + WANT_HOLD_S``, and keeps renewing
  that mark while it stays short (``LedgerGate.note_wanted``, at most every
  ``WANT_REFRESH_S``, and every budget refusal). The record also says what it asks for
  (``wanted_bytes``: the largest refusal while the mark is live, never beyond its share);
* while some other instance waits, an instance **over its share yields**: its gate admits
  no page that takes it beyond its share (``try_acquire``, ``headroom``), keeps no idle
  reserve beyond it (``reserve_target``) and asks its engine to give pages back, never
  below its share (``overage``, ``PageAllocator.shed_wanted``): everything above the share
  where the engine drains pages (all must start emptying at once), or, where it preempts
  to empty them (``LedgerGate``'s ``give_back="asked"``), its part of what the waiting
  instances ask for beyond the budget's free bytes, in proportion to how far each borrower
  is over its share (``Contention.give_back``). Cached KV is shed, no new request
  is admitted into the free blocks of those pages (``BlockLedger.withheld``), and, with
  the ``reclaim`` option ``"preempt"`` (the default where the engine has the seam), the
  engine preempts the running requests that alone fill one such page, one page a step
  (``BlockLedger.owners_emptying_page``; vLLM: ``ElasticBlockPool.requests_to_reclaim``);
  with ``"drain"`` those pages empty as their requests finish. Running requests still
  grow into free blocks of held pages (one that needs a new page beyond the share waits
  or is preempted, as under any limit). Pages that empty are unmapped, and the waiting
  instance maps them.

An instance therefore gets about ``min(what it asks for, its share)`` within a few engine
steps of the borrowers (``"drain"``: within one of their request lifetimes), and all the
memory nobody else asks for. Borrowers that preempt give back what is asked, not everything
above their shares, and again as the waiting instance maps it and asks on: a neighbour that
needs a little more costs them a little, and little is left unmapped for nobody. Nobody
gives back below its share, so two instances that both want more than their shares settle at
the shares instead of taking memory from each other in turn. A mark expires ``WANT_HOLD_S``
after the last refusal, so borrowing resumes by itself once the waiting instance has what it
needs. Releasing memory does not end it: a waiting instance frees the pages of its own
finished requests while its queue still waits, and a borrower that grew back then would
re-admit (and with ``"preempt"`` preempt again) what it had just given up. An instance over its
share never marks: among borrowers the first to map keeps what it holds.

Cost: the hot path of a gate reads one more header field (``wanted_until``); the records are
scanned (``contention``) only while some mark is live, i.e. only under contention.

The functions here read and write a mapped ledger; the caller holds the file lock (shared
to read, exclusive to write), as for every ``kvcore.budget.ledger_file`` accessor.
"""

from __future__ import annotations

import mmap
import time

from kvcore.budget.ledger_file import (
    CAPACITY,
    HEADER,
    RECORD,
    InstanceRecord,
    LedgerSnapshot,
    State,
    record_offset,
)

__all__ = [
    "WANT_HOLD_S",
    "WANT_REFRESH_S",
    "Contention",
    "contention",
    "equal_share",
    "header_wanted_until",
    "mark_wanted",
    "share_of",
    "yields",
]

WANT_HOLD_S = 1.0
"""How long (wall-clock seconds) one refusal keeps an instance marked as waiting."""
WANT_REFRESH_S = 0.25
"""A gate renews its waiting mark at most this often (``LedgerGate.note_wanted``)."""

_STATE_OFF, _STATE = RECORD.field["state"]
_MAPPED_OFF, _MAPPED = RECORD.field["mapped"]
_TAIL_OFF, _TAIL = RECORD.span("share", "wanted_bytes")
_BASES = [record_offset(s) for s in range(CAPACITY)]
_HDR_WANTED_OFF, _HDR_WANTED = HEADER.field["wanted_until"]


def equal_share(budget: int, instances: int) -> int:
    """The share of an instance without one set: an equal part of ``budget``."""
    return budget // max(1, instances)


class Contention:
    """What a gate needs to know about the other instances, read under the ledger lock:
    ``share`` (this instance's, in bytes), ``others_wait`` (another instance below its
    share is marked waiting now), ``others_want`` (the bytes those instances still ask
    for, each at most what takes it to its share) and ``over_total`` (the bytes every
    instance maps beyond its share: what the borrowers split a give-back by)."""

    __slots__ = ("others_wait", "others_want", "over_total", "share")

    def __init__(
        self, share: int, others_wait: bool, others_want: int = 0, over_total: int = 0
    ) -> None:
        self.share = share
        self.others_wait = others_wait
        self.others_want = others_want
        self.over_total = over_total

    def give_back(self, mapped: int, free: int) -> int:
        """What an instance mapping ``mapped`` bytes should give back now, with ``free``
        bytes of the budget unmapped: its part (in proportion to how far it is over its
        share, among all borrowers) of what the waiting instances ask for beyond what is
        free, at most what it maps beyond its share; 0 while nobody waits."""
        over = mapped - self.share
        if not self.others_wait or over <= 0 or self.over_total <= 0:
            return 0
        short = self.others_want - max(0, free)
        if short <= 0:
            return 0
        return min(over, -(-short * over // self.over_total))


def header_wanted_until(buf: mmap.mmap) -> float:
    """The header's mark: the latest time until which some instance waits (0: never)."""
    value: float = _HDR_WANTED.unpack_from(buf, _HDR_WANTED_OFF)[0]
    return value


def contention(buf: mmap.mmap, slot: int, budget: int, now: float) -> Contention:
    """This instance's (``slot``) share, whether another active instance below its own
    share is marked waiting at wall-clock ``now`` and what those ask for, and how far the
    instances map beyond their shares in all. Scans every record: call it only while
    ``header_wanted_until(buf) > now`` (or on a refusal), under the lock."""
    records: list[tuple[int, int, int, float, int]] = []  # slot, share, mapped, until, bytes
    active = State.ACTIVE
    for s, base in enumerate(_BASES):
        if _STATE.unpack_from(buf, base + _STATE_OFF)[0] != active:
            continue
        share, until, wanted = _TAIL.unpack_from(buf, base + _TAIL_OFF)
        mapped = _MAPPED.unpack_from(buf, base + _MAPPED_OFF)[0]
        records.append((s, share, mapped, until, wanted))
    default = equal_share(budget, len(records))
    mine = default
    others_wait = False
    others_want = over_total = 0
    for s, share, mapped, until, wanted in records:
        own = share or default
        over_total += max(0, mapped - own)
        if s == slot:
            mine = own
        elif until > now and mapped < own:
            others_wait = True
            others_want += min(wanted, own - mapped)
    return Contention(mine, others_wait, others_want, over_total)


def share_of(snapshot: LedgerSnapshot, rec: InstanceRecord) -> int:
    """``rec``'s share in ``snapshot``: the one set for it, else an equal part of the
    budget among the snapshot's instances (what its gate enforces; ``kvctl``, ``kvtop``)."""
    return rec.share or equal_share(snapshot.budget, len(snapshot.records))


def yields(snapshot: LedgerSnapshot, rec: InstanceRecord, now: float | None = None) -> bool:
    """Whether ``rec`` is held at its share now: it maps at least its share while another
    instance below its own share waits (what its gate refuses memory for)."""
    now = time.time() if now is None else now
    if rec.mapped < share_of(snapshot, rec):
        return False
    return any(
        o.slot != rec.slot and o.wanted_until > now and o.mapped < share_of(snapshot, o)
        for o in snapshot.records
    )


def mark_wanted(buf: mmap.mmap, slot: int, until: float, nbytes: int, now: float) -> None:
    """Mark instance ``slot`` as waiting until wall-clock ``until``, in its record and in
    the header (which keeps the latest mark of all), for ``nbytes`` it was refused: its
    record then asks for the larger of those and what a mark still live at ``now`` asked
    for. Caller holds the exclusive lock."""
    base = record_offset(slot)
    live = RECORD.get_float(buf, base, "wanted_until") > now
    asked = RECORD.get(buf, base, "wanted_bytes") if live else 0
    RECORD.put(buf, base, "wanted_until", until)
    RECORD.put(buf, base, "wanted_bytes", max(asked, nbytes))
    if header_wanted_until(buf) < until:
        _HDR_WANTED.pack_into(buf, _HDR_WANTED_OFF, until)
