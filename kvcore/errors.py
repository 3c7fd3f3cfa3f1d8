"""Every exception kvcore raises, in one hierarchy.

Each error carries the context a user needs (the call, its arguments, the page or instance)
and a ``hint``: the next thing to do. Catch ``KvcoreError`` to handle them all.

Physical shortage is *not* an error in the allocator's API (``alloc`` returns ``None``: the
engine waits or preempts); ``OutOfDeviceMemory`` is raised only by the backend seam, where the
page allocator turns it into that miss.
"""

from __future__ import annotations

from collections.abc import Sequence


class KvcoreError(Exception):
    """Base of every kvcore error. ``hint`` says what to do next (may be empty)."""

    def __init__(self, message: str, *, hint: str = "") -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)


class BackendUnavailable(KvcoreError):
    """A VMM backend cannot be used here (library missing, no device, unsupported OS)."""


class VmmError(KvcoreError):
    """A virtual-memory driver call failed. ``call`` names it, ``args`` are its arguments and
    ``code`` is the driver's result code (name or number)."""

    def __init__(
        self,
        call: str,
        args: dict[str, object],
        code: object,
        *,
        hint: str = "",
    ) -> None:
        self.call = call
        self.args_ = dict(args)
        self.code = code
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in args.items())
        super().__init__(f"{call}({shown}) failed: {code}", hint=hint)


class OutOfDeviceMemory(VmmError):
    """Creating physical memory failed because the device (or the host backend's configured
    device size) has none left. The page allocator turns this into an allocation miss."""


class InjectedFault(VmmError):
    """A failure raised on purpose by the fault-injection backend wrapper (tests only)."""


class PoolFailed(KvcoreError):
    """The page allocator (or the page mapper under it) saw an inconsistent state and
    stopped (fail-stop), or was closed: every later call raises this. Restart the engine;
    the per-GPU ledger reclaims what this instance held."""


class PageQuarantined(KvcoreError):
    """A page's rollback failed; the page is quarantined (never reused). Capacity drops by
    one page; the engine continues. ``page_ids`` names the quarantined pages (empty when the
    raiser cannot tell; the page allocator then quarantines every page of the failed call)."""

    def __init__(self, message: str, *, page_ids: Sequence[int] = (), hint: str = "") -> None:
        self.page_ids = tuple(page_ids)
        super().__init__(message, hint=hint)


class InvalidTransition(KvcoreError, ValueError):
    """A page or block id was asked for a transition its state forbids (a double free,
    freeing an id never allocated, releasing a page that is not in use). ``ids`` names the
    offending ids. The caller's bookkeeping is wrong; kvcore's state is left unchanged."""

    def __init__(self, message: str, *, ids: Sequence[int] = (), hint: str = "") -> None:
        self.ids = tuple(ids)
        super().__init__(message, hint=hint)


class ZeroPageWritten(KvcoreError):
    """Sanity mode found bytes written into the shared zero page: something wrote through an
    unbacked block (a bug in block bookkeeping). ``offsets`` are the dirty byte offsets in
    the zero page; ``candidates`` the ``(layer, buffer, block)`` triples the write may have
    gone through (every unbacked block at one of those offsets)."""

    def __init__(
        self,
        message: str,
        *,
        offsets: Sequence[int] = (),
        candidates: Sequence[tuple[int, int, int]] = (),
        hint: str = "",
    ) -> None:
        self.offsets = tuple(offsets)
        self.candidates = tuple(candidates)
        super().__init__(message, hint=hint)


class GeometryError(KvcoreError, ValueError):
    """A KV layout cannot be built as asked (e.g. a block would straddle a page). The
    message names a block or page size that works."""


class LedgerError(KvcoreError):
    """The per-GPU shared ledger is unusable (foreign file, unknown layout version, lock)."""


class LedgerBusy(LedgerError):
    """Another process held the per-GPU ledger's lock for longer than the caller would wait
    (a slow ``kvctl``, a stopped process). Contention, not damage: a serving instance's gate
    turns it into a miss or a deferred update, never a fail-stop."""


class LedgerNotFound(LedgerError):
    """No per-GPU ledger exists yet (no kvcore instance has started on that GPU)."""


class UnknownInstance(LedgerError):
    """No live instance of that name is in the ledger; the message lists the known ones."""


class RevisionConflict(LedgerError):
    """A limit or budget changed since the caller read it (compare-and-set refused)."""


class ChannelError(KvcoreError):
    """The engine <-> worker channel failed (peer gone, malformed message, timeout)."""


class MalformedMessage(ChannelError):
    """A channel frame or message failed validation (bad magic, unknown kind, bad field).
    The connection that carried it is closed; the peer is buggy or not a kvcore peer."""


class OversizedMessage(MalformedMessage):
    """A channel frame announced more bytes than the size cap; its body is not read."""


class VersionMismatch(MalformedMessage):
    """A channel frame carries another schema version: engine and workers run different
    kvcore releases. Install one kvcore version everywhere."""


class PeerRejected(ChannelError):
    """A channel connection came from a process this side must not trust (another uid, the
    wrong rank, a second coordinator) and was refused."""


class WorkerLost(ChannelError):
    """A worker stopped answering: its connection closed, broke, or timed out. ``rank``
    names it."""

    def __init__(self, message: str, *, rank: int, hint: str = "") -> None:
        self.rank = rank
        super().__init__(message, hint=hint)


class WorkersMissing(ChannelError):
    """Workers of a TP x PP engine never opened their channel sockets within the start-up
    timeout. ``ranks`` names them (global rank ``pp_rank * tp_size + tp_rank``)."""

    def __init__(self, message: str, *, ranks: Sequence[int], hint: str = "") -> None:
        self.ranks = tuple(ranks)
        super().__init__(message, hint=hint)


class TransactionRefused(ChannelError):
    """A channel transaction was refused by its state (a prepare after its abort, a commit
    of an aborted unmap, a map of a page already mapped). Nothing was changed."""


class AgreementError(KvcoreError):
    """A collective agreeing allocation outcomes across an engine's ranks failed (a peer
    died or the process group was torn down); ``kvcore.parallel.agreement``."""


class UnsupportedConfiguration(KvcoreError):
    """Elastic KV was asked for on an engine configuration kvcore does not support; raised
    at engine start-up, naming the unsupported part."""


def _fmt(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 4096:
        return hex(value)
    return repr(value)
