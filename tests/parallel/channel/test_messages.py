"""The wire schema: every message round-trips, and every malformed frame is refused with
the typed error the module documents, before an oversized body is read."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from kvcore.errors import MalformedMessage, OversizedMessage, VersionMismatch
from kvcore.parallel.channel.messages import (
    HEADER_BYTES,
    MAGIC,
    SCHEMA_VERSION,
    FrameReader,
    Hello,
    Kind,
    Op,
    RemoteError,
    Reply,
    Request,
    Welcome,
    decode_body,
    encode,
    recv_message,
)

MESSAGES = [
    Hello(rank=3, world_size=4, instance="ch-1-2"),
    Welcome(rank=3, pid=1234, num_pages=70_000, page_bytes=2 << 20, fixed_bytes=2 << 20),
    Request(Op.MAP, txn=7, pages=(0, 5, 69_999)),
    Request(Op.UNDO_MAP, txn=7),
    Reply(Op.PREPARE, txn=9),
    Reply(
        Op.MAP,
        txn=10,
        error=RemoteError("OutOfDeviceMemory", "no memory", "wait", (), "create", "2"),
    ),
    Reply(Op.ABORT, txn=11, error=RemoteError("PageQuarantined", "x", page_ids=(4, 5))),
]


def frame(kind: int, body: object, *, version: int = SCHEMA_VERSION, magic: bytes = MAGIC) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return struct.pack("!4sHBBI", magic, version, kind, 0, len(raw)) + raw


def decode_all(data: bytes, max_bytes: int = 1 << 20) -> list[object]:
    reader = FrameReader(max_bytes=max_bytes)
    reader.feed(data)
    out = []
    while (m := reader.pop()) is not None:
        out.append(m)
    return out


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode_all(encode(message)) == [message]  # type: ignore[arg-type]


def test_reader_reassembles_frames_split_anywhere() -> None:
    stream = b"".join(encode(m) for m in MESSAGES)
    reader = FrameReader()
    got = []
    for i in range(0, len(stream), 7):
        reader.feed(stream[i : i + 7])
        while (m := reader.pop()) is not None:
            got.append(m)
    assert got == MESSAGES
    assert not reader.mid_frame


def _request(op: int, txn: int, count: int, *pages: int) -> bytes:
    return struct.pack("!BQI", op, txn, count) + struct.pack(f"!{len(pages)}I", *pages)


def _reply(op: int, txn: int, flag: int, rest: bytes = b"") -> bytes:
    return struct.pack("!BQB", op, txn, flag) + rest


@pytest.mark.parametrize(
    ("data", "error", "text"),
    [
        (frame(3, b"", magic=b"HTTP"), MalformedMessage, "magic"),
        (frame(3, b"", version=SCHEMA_VERSION + 1), VersionMismatch, "schema version"),
        (frame(99, b""), MalformedMessage, "unknown kind"),
        (frame(3, b"\x01\x00"), MalformedMessage, "too short"),
        (frame(3, _request(1, 1, 5, 1, 2)), MalformedMessage, "announces 5 pages"),
        (frame(3, _request(1, 1, 1, 1) + b"x"), MalformedMessage, "announces 1 pages"),
        (frame(3, _request(42, 1, 0)), MalformedMessage, "unknown operation 42"),
        (frame(4, b"\x01"), MalformedMessage, "too short"),
        (frame(4, _reply(1, 1, 0, b"{}")), MalformedMessage, "trailing bytes"),
        (frame(4, _reply(1, 1, 2)), MalformedMessage, "error flag 2"),
        (frame(4, _reply(1, 1, 1)), MalformedMessage, "error flag 1"),
        (frame(4, _reply(1, 1, 1, b"\xff\xfe")), MalformedMessage, "not UTF-8 JSON"),
        (frame(4, _reply(1, 1, 1, b'{"type": "X"}')), MalformedMessage, "expected"),
        (frame(4, _reply(9, 1, 0)), MalformedMessage, "unknown operation 9"),
        (frame(1, b"not json"), MalformedMessage, "not UTF-8 JSON"),
        (frame(1, [1, 2]), MalformedMessage, "not an object"),
        (frame(1, {"rank": 0, "world_size": 1}), MalformedMessage, "expected"),
        (
            frame(1, {"rank": 0, "world_size": 1, "instance": "x", "extra": 1}),
            MalformedMessage,
            "expected",
        ),
        (frame(1, {"rank": -1, "world_size": 1, "instance": "x"}), MalformedMessage, "non-neg"),
        (frame(1, {"rank": True, "world_size": 1, "instance": "x"}), MalformedMessage, "non-neg"),
        (frame(1, {"rank": 0, "world_size": 1, "instance": 5}), MalformedMessage, "string"),
        (
            frame(2, {"rank": 0, "pid": 1, "num_pages": "8", "page_bytes": 1, "fixed_bytes": 0}),
            MalformedMessage,
            "non-negative",
        ),
    ],
)
def test_malformed_frames_are_refused(data: bytes, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        decode_all(data)


def test_wrong_version_is_its_own_type_with_a_hint() -> None:
    with pytest.raises(VersionMismatch) as info:
        decode_all(frame(3, {}, version=0))
    assert "same kvcore version" in info.value.hint


def test_oversized_frame_is_refused_from_its_header_alone() -> None:
    header = struct.pack("!4sHBBI", MAGIC, SCHEMA_VERSION, Kind.REQUEST, 0, 1 << 30)
    reader = FrameReader(max_bytes=4096)
    reader.feed(header)  # no body at all: the header is enough to refuse
    with pytest.raises(OversizedMessage, match="over the 4096-byte cap"):
        reader.pop()
    assert len(header) == HEADER_BYTES


def test_page_ids_beyond_32_bits_are_not_encoded() -> None:
    with pytest.raises(MalformedMessage, match="32 bits"):
        encode(Request(Op.MAP, 1, (1 << 32,)))


def test_reserved_byte_must_be_zero() -> None:
    raw = bytearray(encode(Request(Op.MAP, 1, (1,))))
    raw[7] = 1
    with pytest.raises(MalformedMessage, match="reserved byte"):
        decode_all(bytes(raw))


def test_recv_message_tells_clean_close_from_truncation() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode(MESSAGES[0]))
        a.shutdown(socket.SHUT_WR)
        reader = FrameReader()
        assert recv_message(b, reader) == MESSAGES[0]
        assert recv_message(b, reader) is None
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode(MESSAGES[2])[:-3])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(MalformedMessage, match="middle of a frame"):
            recv_message(b, FrameReader())


def test_a_body_nested_past_the_recursion_limit_is_a_malformed_message() -> None:
    body = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(MalformedMessage, match="nested too deeply"):
        decode_body(Kind.HELLO, body)


def test_a_welcome_announcing_more_pages_than_any_device_holds_is_refused() -> None:
    fields = {"rank": 0, "pid": 1, "num_pages": 1 << 60, "page_bytes": 1, "fixed_bytes": 0}
    with pytest.raises(MalformedMessage, match="announces"):
        decode_body(Kind.WELCOME, json.dumps(fields).encode())
