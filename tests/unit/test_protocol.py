"""The control socket's frames (spool/protocol.py): round trips and every way to be wrong."""

from __future__ import annotations

import contextlib
import struct

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spool.errors import ProtocolError
from spool.protocol import HEADER, Decoder, ErrorReply, FrameKind, Reply, Request, encode

MESSAGES = [
    Request(1, "accept", {"sender": "a@example.org", "recipients": ["b@example.net"],
                          "data": b"x" * 10}),
    Reply(1, "6B06814FD9D372D3"),
    Reply(7, [{"msg_id": "X", "recipients": ["a@b.c"]}]),
    ErrorReply(2, "UnknownMessage", "no message X in the spool"),
    ErrorReply(0, "ProtocolError", "frame too long"),
]  # fmt: skip


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def test_messages_round_trip_whole_and_one_byte_at_a_time() -> None:
    stream = b"".join(encode(m) for m in MESSAGES)
    assert Decoder().feed(stream) == MESSAGES
    decoder, out = Decoder(), []
    for i in range(len(stream)):
        out += decoder.feed(stream[i : i + 1])
    assert out == MESSAGES and decoder.pending == 0


def test_the_header_is_length_then_kind() -> None:
    data = encode(Reply(3, None))
    length, kind = struct.unpack(">IB", data[:5])
    assert (length, kind) == (len(data) - 5, FrameKind.REPLY)
    assert cbor2.loads(data[5:]) == {"id": 3, "result": None}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (HEADER.pack(65, 1), "over the limit"),
        (frame(9, cbor2.dumps({"id": 1})), "unknown frame kind"),
        (frame(1, b"\xff\xff"), "not one CBOR data item"),
        (frame(1, cbor2.dumps([1, "op", {}])), "not a CBOR map"),
        (frame(1, cbor2.dumps({"id": -1, "op": "x", "args": {}})), "unsigned"),
        (frame(1, cbor2.dumps({"id": True, "op": "x", "args": {}})), "unsigned"),
        (frame(1, cbor2.dumps({"id": 2**63, "op": "x", "args": {}})), "63 bits"),
        (frame(1, cbor2.dumps({"id": 0, "op": "x", "args": {}})), "reserved"),
        (frame(1, cbor2.dumps({"id": 1, "op": 5, "args": {}})), "a request is"),
        (frame(1, cbor2.dumps({"id": 1, "op": "x", "args": []})), "a request is"),
        (frame(1, cbor2.dumps({"id": 1, "op": "x", "args": {}, "more": 1})), "a request is"),
        (frame(1, cbor2.dumps({"id": 1, "op": "x", "args": {1: 2}})), "names must be text"),
        (frame(1, cbor2.dumps({"id": 1, "op": "x", "args": {}}) + b"\x00"), "bytes after"),
        (frame(2, cbor2.dumps({"id": 1})), "a reply is"),
        (frame(3, cbor2.dumps({"id": 1, "error": "X"})), "an error is"),
        (frame(1, b""), "not one CBOR data item"),
    ],
)
def test_bad_frames_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        Decoder(max_frame=64).feed(data)


def test_an_incomplete_frame_waits_and_a_long_header_fails_before_the_payload() -> None:
    decoder = Decoder(max_frame=100)
    data = encode(Reply(1, "x" * 20))
    assert decoder.feed(data[:-1]) == [] and decoder.pending == len(data) - 1
    assert decoder.feed(data[-1:]) == [Reply(1, "x" * 20)]
    with pytest.raises(ProtocolError):
        Decoder(max_frame=100).feed(HEADER.pack(101, 1))  # refused on its header alone


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_messages_or_a_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        Decoder(max_frame=1000).feed(data)


@settings(max_examples=2000, deadline=None)
@given(st.sampled_from(MESSAGES), st.data())
def test_mutated_frames_give_messages_or_a_protocol_error(msg: object, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        Decoder(max_frame=1000).feed(bytes(raw))


def test_the_example_of_docs_protocol_md() -> None:
    request = Request(
        1,
        "accept",
        {
            "sender": "a@example.org",
            "recipients": ["b@example.net"],
            "data": b"Subject: hi\r\n\r\nhello\r\n",
        },
    )
    wire = encode(request)
    assert wire[:5].hex(" ") == "00 00 00 60 01"
    assert wire[5:26].hex(" ") == "a3 62 69 64 01 62 6f 70 66 61 63 63 65 70 74 64 61 72 67 73 a3"
    assert wire.endswith(bytes.fromhex("56") + b"Subject: hi\r\n\r\nhello\r\n")
    reply = encode(Reply(1, "6B06814FD9D372D3"))
    assert reply[:20].hex(" ") == "00 00 00 1d 02 a2 62 69 64 01 66 72 65 73 75 6c 74 70 36 42"
