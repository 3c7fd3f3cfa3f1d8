"""The worker channel's wire format: typed messages, their schema and their framing.

Every message travels as one *frame*::

    magic b"KVCH" | version u16 | kind u8 | reserved u8 (0) | body length u32 | body

(network byte order). Bodies by kind:

``Request`` (binary, the hot path)
    ``op u8 | txn u64 | count u32 | count x page id u32``
``Reply`` (binary, the hot path)
    ``op u8 | txn u64 | has_error u8`` then, if ``has_error`` is 1, a UTF-8 JSON object
    with exactly the ``RemoteError`` fields
``Hello`` / ``Welcome`` (the handshake)
    a UTF-8 JSON object with exactly the dataclass's fields

Nothing is unpickled and nothing is evaluated: a frame is accepted only if its body has
exactly the expected length, field names and types. A receiver rejects

* a wrong magic, unknown kind, non-zero reserved byte, a body of the wrong length, an
  unknown operation, undecodable or ill-typed JSON with ``MalformedMessage``;
* a frame announcing more than ``max_bytes`` (default ``MAX_FRAME_BYTES``) with
  ``OversizedMessage``, before reading the body;
* another ``SCHEMA_VERSION`` with ``VersionMismatch``.

Each of these closes the connection (a byte stream cannot be resynchronised after a bad
frame). The three message types:

``Hello`` / ``Welcome``
    the handshake: the coordinator names the rank it expects and the instance; the worker
    answers with its pid and its mapper's ``num_pages``, ``page_bytes`` and ``fixed_bytes``
    (device memory held whatever the page states: its cache's zero page).
``Request``
    one transition (``Op``) of one transaction id over several page ids.
``Reply``
    the answer to one request (or to ``Hello`` when refused): ``error`` is ``None`` on
    success, else a ``RemoteError`` naming the exception the worker raised.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import MalformedMessage, OversizedMessage, VersionMismatch

SCHEMA_VERSION = 3
"""Bumped on any change of a message's fields; peers of another version are refused."""

MAGIC = b"KVCH"
MAX_FRAME_BYTES = 1 << 20
"""Default cap on one frame's body (about 260k page ids per request)."""

_HEADER = struct.Struct("!4sHBBI")
HEADER_BYTES = _HEADER.size
_REQUEST = struct.Struct("!BQI")
_REPLY = struct.Struct("!BQB")
_MAX_ID = (1 << 63) - 1
MAX_PAGES = 1 << 24
"""The most page ids a worker may announce (16 M: 32 TiB of 2 MiB pages per rank)."""
_MAX_PAGE = (1 << 32) - 1


class Kind(enum.IntEnum):
    """Message type carried in the frame header."""

    HELLO = 1
    WELCOME = 2
    REQUEST = 3
    REPLY = 4


class Op(enum.IntEnum):
    """The transition a ``Request`` asks a worker to apply (see ``kvcore.memory.mapper``)."""

    HELLO = 0
    """Only in a ``Reply`` refusing a handshake."""
    MAP = 1
    """Map ``pages`` (all or nothing on this worker); remembered under ``txn``."""
    UNDO_MAP = 2
    """Unmap what the successful ``MAP`` of ``txn`` mapped (rollback of a failed map on
    another worker). A later ``MAP`` of the same ``txn`` is refused."""
    PREPARE = 3
    """Phase one of unmap of ``pages`` under ``txn``."""
    COMMIT = 4
    """Phase two: release ``pages`` prepared under ``txn``. Idempotent."""
    ABORT = 5
    """Restore ``pages`` prepared under ``txn``. A later ``PREPARE`` of ``txn`` is refused."""
    CLOSE = 6
    """Unmap and release everything (``PageMapper.close``) and end the session."""


@dataclass(frozen=True)
class Hello:
    """Coordinator -> worker, first frame of a session."""

    rank: int
    world_size: int
    instance: str


@dataclass(frozen=True)
class Welcome:
    """Worker -> coordinator, the handshake's answer: who the worker is and what it maps."""

    rank: int
    pid: int
    num_pages: int
    page_bytes: int
    fixed_bytes: int = 0
    """The worker mapper's ``fixed_bytes`` (its cache's zero page; ``kvcore.memory.mapper``)."""


@dataclass(frozen=True)
class Request:
    """Coordinator -> worker: apply ``op`` to ``pages`` as part of transaction ``txn``."""

    op: Op
    txn: int
    pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class RemoteError:
    """An exception raised on a worker, as carried back to the coordinator.

    ``type`` is the exception's class name (e.g. ``OutOfDeviceMemory``); ``call`` and
    ``code`` are set for ``VmmError`` and its subclasses; ``page_ids`` for
    ``PageQuarantined``."""

    type: str
    message: str
    hint: str = ""
    page_ids: tuple[int, ...] = ()
    call: str = ""
    code: str = ""


@dataclass(frozen=True)
class Reply:
    """Worker -> coordinator: the outcome of ``Request(op, txn)``."""

    op: Op
    txn: int
    error: RemoteError | None = field(default=None)

    @property
    def ok(self) -> bool:
        """Whether the request succeeded on that worker."""
        return self.error is None


Message = Hello | Welcome | Request | Reply


# ----------------------------------------------------------------------------- encoding


def encode(message: Message) -> bytes:
    """The frame carrying ``message`` (header and body)."""
    kind, raw = _to_body(message)
    return _HEADER.pack(MAGIC, SCHEMA_VERSION, kind, 0, len(raw)) + raw


def _to_body(message: Message) -> tuple[Kind, bytes]:
    if isinstance(message, Request):
        n = len(message.pages)
        if n and not 0 <= min(message.pages) <= max(message.pages) <= _MAX_PAGE:
            raise MalformedMessage(f"page ids of a Request must fit 32 bits: {message.pages}")
        return Kind.REQUEST, _REQUEST.pack(message.op, message.txn, n) + struct.pack(
            f"!{n}I", *message.pages
        )
    if isinstance(message, Reply):
        err = message.error
        head = _REPLY.pack(message.op, message.txn, err is not None)
        if err is None:
            return Kind.REPLY, head
        return Kind.REPLY, head + _json(
            {
                "type": err.type,
                "message": err.message,
                "hint": err.hint,
                "page_ids": err.page_ids,
                "call": err.call,
                "code": err.code,
            }
        )
    if isinstance(message, Hello):
        return Kind.HELLO, _json(
            {"rank": message.rank, "world_size": message.world_size, "instance": message.instance}
        )
    return Kind.WELCOME, _json(
        {
            "rank": message.rank,
            "pid": message.pid,
            "num_pages": message.num_pages,
            "page_bytes": message.page_bytes,
            "fixed_bytes": message.fixed_bytes,
        }
    )


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- decoding


def parse_header(header: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> tuple[Kind, int]:
    """Validate a frame header; returns its kind and body length. Raises
    ``MalformedMessage``, ``VersionMismatch`` or ``OversizedMessage``."""
    magic, version, kind, reserved, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise MalformedMessage(
            f"channel frame has magic {magic!r}, expected {MAGIC!r}",
            hint="the peer is not a kvcore channel endpoint",
        )
    if version != SCHEMA_VERSION:
        raise VersionMismatch(
            f"channel frame has schema version {version}, this side speaks {SCHEMA_VERSION}",
            hint="install the same kvcore version in the engine and every worker",
        )
    if reserved != 0:
        raise MalformedMessage(f"channel frame has reserved byte {reserved}, expected 0")
    try:
        kind_ = Kind(kind)
    except ValueError:
        raise MalformedMessage(f"channel frame has unknown kind {kind}") from None
    if length > max_bytes:
        raise OversizedMessage(
            f"channel frame announces {length} bytes, over the {max_bytes}-byte cap",
            hint="split the request into fewer pages per message",
        )
    return kind_, length


def decode_body(kind: Kind, body: bytes) -> Message:
    """Validate and build the message of ``kind`` from its ``body``. Raises
    ``MalformedMessage``."""
    if kind is Kind.REQUEST:
        return _decode_request(body)
    if kind is Kind.REPLY:
        return _decode_reply(body)
    fields = _Fields(kind.name, _load_json(kind.name, body))
    if kind is Kind.HELLO:
        fields.expect("rank", "world_size", "instance")
        return Hello(fields.integer("rank"), fields.integer("world_size"), fields.text("instance"))
    fields.expect("rank", "pid", "num_pages", "page_bytes", "fixed_bytes")
    num_pages = fields.integer("num_pages")
    if num_pages > MAX_PAGES:  # the coordinator keeps a state per page
        raise MalformedMessage(f"channel WELCOME announces {num_pages} pages (at most {MAX_PAGES})")
    return Welcome(
        fields.integer("rank"),
        fields.integer("pid"),
        num_pages,
        fields.integer("page_bytes"),
        fields.integer("fixed_bytes"),
    )


def _decode_request(body: bytes) -> Request:
    if len(body) < _REQUEST.size:
        raise MalformedMessage(f"channel REQUEST body of {len(body)} bytes is too short")
    op, txn, n = _REQUEST.unpack_from(body)
    if len(body) != _REQUEST.size + 4 * n:
        raise MalformedMessage(
            f"channel REQUEST announces {n} pages in a {len(body)}-byte body",
        )
    return Request(_op(op), txn, struct.unpack_from(f"!{n}I", body, _REQUEST.size))


def _decode_reply(body: bytes) -> Reply:
    if len(body) < _REPLY.size:
        raise MalformedMessage(f"channel REPLY body of {len(body)} bytes is too short")
    op, txn, has_error = _REPLY.unpack_from(body)
    rest = body[_REPLY.size :]
    if has_error == 0 and not rest:
        return Reply(_op(op), txn)
    if has_error != 1 or not rest:
        raise MalformedMessage(
            f"channel REPLY has error flag {has_error} and {len(rest)} trailing bytes"
        )
    inner = _Fields("REPLY.error", _load_json("REPLY.error", rest))
    inner.expect("type", "message", "hint", "page_ids", "call", "code")
    error = RemoteError(
        type=inner.text("type"),
        message=inner.text("message"),
        hint=inner.text("hint"),
        page_ids=inner.ids("page_ids"),
        call=inner.text("call"),
        code=inner.text("code"),
    )
    return Reply(_op(op), txn, error)


def _op(raw: int) -> Op:
    try:
        return Op(raw)
    except ValueError:
        raise MalformedMessage(f"channel message names unknown operation {raw}") from None


def _load_json(what: str, body: bytes) -> object:
    try:
        return json.loads(body.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMessage(f"channel {what} body is not UTF-8 JSON: {exc}") from None
    except RecursionError:  # a hostile body nested past the interpreter's limit
        raise MalformedMessage(f"channel {what} body is nested too deeply") from None


class _Fields:
    """Strict field access on one decoded JSON object."""

    def __init__(self, what: str, obj: object) -> None:
        if not isinstance(obj, dict):
            raise MalformedMessage(f"channel {what} body is {type(obj).__name__}, not an object")
        self.what = what
        self.obj: dict[str, object] = obj

    def expect(self, *names: str) -> None:
        if set(self.obj) != set(names):
            raise MalformedMessage(
                f"channel {self.what} has fields {sorted(self.obj)}, expected {sorted(names)}"
            )

    def integer(self, name: str) -> int:
        return _as_id(self.obj[name], f"{self.what}.{name}")

    def text(self, name: str) -> str:
        value = self.obj[name]
        if not isinstance(value, str):
            raise MalformedMessage(f"channel {self.what}.{name} must be a string, got {value!r}")
        return value

    def ids(self, name: str) -> tuple[int, ...]:
        value = self.obj[name]
        if not isinstance(value, list):
            raise MalformedMessage(f"channel {self.what}.{name} must be a list of ids")
        return tuple(_as_id(v, f"{self.what}.{name}[]") for v in value)


def _as_id(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_ID:
        raise MalformedMessage(f"channel {where} must be a non-negative integer, got {value!r}")
    return value


# ----------------------------------------------------------------------------- streams


class FrameReader:
    """Reassembles messages from the bytes of one stream connection.

    ``feed`` the bytes ``recv`` returned, then take complete messages with ``pop`` until it
    returns ``None``. A bad header raises as soon as its 12 bytes have arrived, so an
    oversized body is never buffered."""

    def __init__(self, *, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._pending: tuple[Kind, int] | None = None

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest has not."""
        return bool(self._buf) or self._pending is not None

    def feed(self, data: bytes) -> None:
        """Append bytes read from the socket; ``pop`` then parses them."""
        self._buf += data

    def pop(self) -> Message | None:
        """The next complete message, or ``None`` when more bytes are needed."""
        if self._pending is None:
            if len(self._buf) < HEADER_BYTES:
                return None
            self._pending = parse_header(bytes(self._buf[:HEADER_BYTES]), max_bytes=self.max_bytes)
            del self._buf[:HEADER_BYTES]
        kind, length = self._pending
        if len(self._buf) < length:
            return None
        body = bytes(self._buf[:length])
        del self._buf[:length]
        self._pending = None
        return decode_body(kind, body)


def send_message(sock: socket.socket, message: Message) -> None:
    """Write one message to a connected socket (blocking)."""
    sock.sendall(encode(message))


def recv_message(sock: socket.socket, reader: FrameReader) -> Message | None:
    """Read the next message from ``sock`` (blocking, honouring the socket's timeout).

    Returns ``None`` when the peer closed the connection between frames; raises
    ``MalformedMessage`` (or a subclass) for a bad frame or a connection closed mid-frame,
    ``TimeoutError`` or ``OSError`` from the socket."""
    while True:
        message = reader.pop()
        if message is not None:
            return message
        data = sock.recv(1 << 16)
        if not data:
            if reader.mid_frame:
                raise MalformedMessage("channel connection closed in the middle of a frame")
            return None
        reader.feed(data)


def page_list(page_ids: Sequence[int]) -> tuple[int, ...]:
    """``page_ids`` as the tuple a ``Request`` carries."""
    return tuple(int(p) for p in page_ids)
