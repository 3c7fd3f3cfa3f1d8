"""Per-transaction-id outcomes on a worker: retransmits are no-ops, late and reordered
requests are refused, commit is idempotent, a prepare after its abort is refused."""

from __future__ import annotations

import pytest

from kvcore.errors import TransactionRefused
from kvcore.parallel.channel.messages import Op, Request
from kvcore.parallel.channel.transactions import Outcome, TransactionLog


def step(
    log: TransactionLog, op: Op, txn: int, pages: tuple[int, ...] = (), ok: bool = True
) -> tuple[int, ...]:
    request = Request(op, txn, pages)
    todo = log.begin(request)
    log.finish(request, todo, ok)
    return todo


def test_map_then_retransmit_then_undo() -> None:
    log = TransactionLog()
    assert step(log, Op.MAP, 1, (3, 4)) == (3, 4)
    assert step(log, Op.MAP, 1, (3, 4)) == ()  # retransmit: nothing applied twice
    assert step(log, Op.UNDO_MAP, 1) == (3, 4)
    assert log.outcome(1) is Outcome.UNDONE
    assert step(log, Op.UNDO_MAP, 1) == ()
    with pytest.raises(TransactionRefused, match="undone"):
        log.begin(Request(Op.MAP, 1, (3, 4)))


def test_undo_before_map_refuses_the_late_map() -> None:
    log = TransactionLog()
    assert step(log, Op.UNDO_MAP, 5) == ()
    with pytest.raises(TransactionRefused):
        log.begin(Request(Op.MAP, 5, (1,)))


def test_failed_map_is_not_undone_and_not_retried() -> None:
    log = TransactionLog()
    step(log, Op.MAP, 2, (1,), ok=False)
    assert log.outcome(2) is Outcome.MAP_FAILED
    assert step(log, Op.UNDO_MAP, 2) == ()  # the mapper rolled back itself
    with pytest.raises(TransactionRefused):
        log.begin(Request(Op.MAP, 2, (1,)))


def test_prepare_commit_is_idempotent() -> None:
    log = TransactionLog()
    assert step(log, Op.PREPARE, 3, (1, 2)) == (1, 2)
    assert step(log, Op.PREPARE, 3, (1, 2)) == ()
    assert step(log, Op.COMMIT, 3, (1, 2)) == (1, 2)
    assert log.outcome(3) is Outcome.COMMITTED
    assert step(log, Op.COMMIT, 3, (1, 2)) == ()
    with pytest.raises(TransactionRefused, match="committed"):
        log.begin(Request(Op.ABORT, 3, (1,)))
    with pytest.raises(TransactionRefused, match="prepare after its abort or commit"):
        log.begin(Request(Op.PREPARE, 3, (1, 2)))


def test_failed_commit_is_retried() -> None:
    log = TransactionLog()
    step(log, Op.PREPARE, 3, (1,))
    step(log, Op.COMMIT, 3, (1,), ok=False)
    assert step(log, Op.COMMIT, 3, (1,)) == (1,)


def test_prepare_after_its_abort_is_refused() -> None:
    log = TransactionLog()
    step(log, Op.PREPARE, 4, (7,))
    assert step(log, Op.ABORT, 4, (7,)) == (7,)
    assert step(log, Op.ABORT, 4, (7,)) == ()
    with pytest.raises(TransactionRefused, match="prepare after its abort"):
        log.begin(Request(Op.PREPARE, 4, (7,)))
    with pytest.raises(TransactionRefused, match="aborted"):
        log.begin(Request(Op.COMMIT, 4, (7,)))


def test_abort_arriving_before_its_prepare() -> None:
    log = TransactionLog()
    assert step(log, Op.ABORT, 6, (1,)) == ()  # nothing to restore
    with pytest.raises(TransactionRefused, match="prepare after its abort"):
        log.begin(Request(Op.PREPARE, 6, (1,)))
    assert step(log, Op.ABORT, 6, (1,)) == ()  # a repeated abort restores nothing


def test_failed_prepare_is_recorded_aborted_and_abort_restores_nothing() -> None:
    log = TransactionLog()
    step(log, Op.PREPARE, 8, (1, 2), ok=False)
    assert log.outcome(8) is Outcome.ABORTED
    assert step(log, Op.ABORT, 8, (1, 2)) == ()


def test_commit_and_abort_of_parts() -> None:
    log = TransactionLog()
    step(log, Op.PREPARE, 9, (1, 2, 3))
    assert step(log, Op.COMMIT, 9, (1,)) == (1,)
    assert step(log, Op.ABORT, 9, (2, 3)) == (2, 3)
    with pytest.raises(TransactionRefused, match="not prepared under it"):
        log.begin(Request(Op.COMMIT, 9, (4,)))
    with pytest.raises(TransactionRefused, match="were aborted"):
        log.begin(Request(Op.COMMIT, 9, (2,)))
    with pytest.raises(TransactionRefused, match="only a prepared unmap can be committed"):
        log.begin(Request(Op.COMMIT, 99, (1,)))


def test_log_forgets_old_finished_transactions_but_never_a_pending_prepare() -> None:
    log = TransactionLog(capacity=4)
    step(log, Op.PREPARE, 1, (1,))
    for txn in range(2, 20):
        step(log, Op.MAP, txn, (txn,))
    assert log.outcome(1) is Outcome.PREPARED
    assert log.outcome(2) is None
    assert log.outcome(19) is Outcome.MAPPED
