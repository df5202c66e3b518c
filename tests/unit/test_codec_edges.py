"""Edges of the record codec: each way a checked payload can still be malformed.

Every case starts from a valid record, spoils one field of its CBOR map, and expects
``RecordError`` naming what is wrong: a payload that passed its CRC but does not decode is
a bug or a foreign writer, and recovery reports it as corruption, never as a crash.
"""

from __future__ import annotations

from typing import Any

import cbor2
import pytest

from spool import format as fmt
from spool import records as rec
from spool.framing import NEED_DATA, BadFrame, Frame, Scanner, encode_frame, peek_header
from spool.records import Position

MSG_ID = "6B0357990E172DB3"
ENVELOPE = rec.Envelope(
    msg_id=MSG_ID,
    sender="a@example.org",
    recipients=("b@example.net", "c@example.net"),
    accepted_at=1.8e9,
    written_at=1.8e9,
    body=rec.BodyRef(rec.BODY_INLINE, 10, Position(1, 32)),
    attempts=1,
    klass=1,
    supersedes=Position(1, 32),
    outcomes=(rec.Outcome("d@example.net", rec.DELIVERED, "250 ok", 1.8e9),),
)
START = rec.Start(MSG_ID, Position(1, 32), 0, 1.8e9)
DELTA = rec.Delta(MSG_ID, rec.DELIVERED, ("b@example.net",), "250 ok", 1.8e9)
FINISH = rec.Finish(MSG_ID, 1.8e9, rec.BodyRef(rec.BODY_FILE, 10), (), "done")
CONTROL = rec.Control("outcome-ack", MSG_ID, 1.8e9)


def spoiled(record: rec.Record, **changes: Any) -> tuple[int, bytes]:
    """(frame type, payload) of ``record`` with some fields of its CBOR map replaced."""
    ftype, payload = rec.encode(record)
    obj = cbor2.loads(payload)
    obj.update(changes)
    return ftype, cbor2.dumps(obj)


@pytest.mark.parametrize(
    ("ftype", "payload", "complaint"),
    [
        pytest.param(*spoiled(START, env=[1]), "bad position", id="position-too-short"),
        pytest.param(*spoiled(START, env=[1, -32]), "bad position", id="position-negative"),
        pytest.param(*spoiled(START, env="1:32"), "bad position", id="position-not-a-list"),
        pytest.param(
            *spoiled(ENVELOPE, sup=[1, True, 3]), "bad position", id="supersedes-three-items"
        ),
        pytest.param(
            *spoiled(ENVELOPE, body={"k": "tape", "n": 10}),
            "bad body reference",
            id="body-kind-unknown",
        ),
        pytest.param(
            *spoiled(ENVELOPE, body=["inline", 10]), "bad body reference", id="body-not-a-map"
        ),
        pytest.param(
            *spoiled(ENVELOPE, body={"k": "inline", "n": -1}),
            "bad body size",
            id="body-size-negative",
        ),
        pytest.param(*spoiled(FINISH, body={"k": "file"}), "bad body size", id="body-size-missing"),
        pytest.param(
            *spoiled(ENVELOPE, out=[["d@example.net", rec.DEFERRED, "451 later", 1.8e9]]),
            "bad outcome",
            id="outcome-deferred",
        ),
        pytest.param(
            *spoiled(FINISH, out=[["d@example.net", rec.DELIVERED, "250 ok"]]),
            "bad outcome",
            id="outcome-three-items",
        ),
        pytest.param(
            *spoiled(ENVELOPE, to="b@example.net"),
            "bad recipient list",
            id="recipients-a-string",
        ),
        pytest.param(
            *spoiled(DELTA, to=["b@example.net", 7]),
            "bad recipient list",
            id="recipient-not-text",
        ),
        pytest.param(*spoiled(START, ts="yesterday"), "expected a number", id="time-is-text"),
        pytest.param(*spoiled(DELTA, ts=True), "expected a number", id="time-is-boolean"),
        pytest.param(
            *spoiled(ENVELOPE, att=-1), "expected a non-negative integer", id="attempts-negative"
        ),
        pytest.param(
            *spoiled(START, cls=1.5), "expected a non-negative integer", id="class-fractional"
        ),
        pytest.param(
            *spoiled(ENVELOPE, crash=False),
            "expected a non-negative integer",
            id="crashes-boolean",
        ),
        pytest.param(
            *spoiled(DELTA, st="bounced"), "unknown delta status 'bounced'", id="delta-status"
        ),
        pytest.param(
            *spoiled(CONTROL, act="purge"),
            "unknown control action 'purge'",
            id="control-action",
        ),
    ],
)
def test_a_checked_payload_with_one_bad_field_is_a_record_error_naming_it(
    ftype: int, payload: bytes, complaint: str
) -> None:
    with pytest.raises(rec.RecordError, match=complaint):
        rec.decode(ftype, payload)


def test_the_unspoiled_records_used_above_decode_to_themselves() -> None:
    for record in (ENVELOPE, START, DELTA, FINISH, CONTROL):
        assert rec.decode(*rec.encode(record)) == record


@pytest.mark.parametrize("ftype", [fmt.T_BODY, fmt.T_PAD])
def test_a_cbor_map_in_a_frame_type_that_carries_no_record_is_a_record_error(
    ftype: int,
) -> None:
    _, payload = rec.encode(START)
    with pytest.raises(rec.RecordError, match=f"frame type {ftype} carries no record"):
        rec.decode(ftype, payload)


@pytest.mark.parametrize("length", [0, 1, fmt.MSG_ID_LENGTH - 1])
def test_a_body_frame_shorter_than_a_message_id_is_a_record_error(length: int) -> None:
    with pytest.raises(rec.RecordError, match="shorter than a message id"):
        rec.decode_body(MSG_ID.encode("ascii")[:length])


def test_a_body_frame_whose_message_id_is_not_ascii_is_a_record_error() -> None:
    payload = "6B0357990E172DB\u00e9".encode("latin-1") + b"data"
    assert len(payload) == fmt.MSG_ID_LENGTH + 4
    with pytest.raises(rec.RecordError, match="not ASCII") as info:
        rec.decode_body(payload)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


def test_a_body_frame_of_exactly_a_message_id_has_empty_data() -> None:
    assert rec.decode_body(rec.encode_body(MSG_ID, b"")) == (MSG_ID, b"")


@pytest.mark.parametrize("ftype", [fmt.T_NONE, 7, 14, 16, 255])
def test_peeking_at_a_header_of_an_unknown_frame_type_is_a_bad_frame(ftype: int) -> None:
    header = fmt.FRAME_HEADER.pack(0, 10, ftype)
    result = peek_header(header + bytes(10), 0)
    assert result == BadFrame(f"unknown frame type {ftype}")


def test_peeking_at_a_known_header_gives_type_and_size_without_the_payload() -> None:
    frame = encode_frame(fmt.T_BODY, rec.encode_body(MSG_ID, b"x" * 100))
    assert peek_header(frame[: fmt.FRAME_HEADER_SIZE], 0) == (fmt.T_BODY, len(frame))
    assert peek_header(frame[: fmt.FRAME_HEADER_SIZE - 1], 0) is NEED_DATA


def test_a_scanner_fed_a_long_stream_drops_consumed_bytes_and_loses_no_frame() -> None:
    # 1000-byte frames fed 700 bytes at a time: frames straddle every feed, and the
    # consumed prefix passes the 64 KiB mark many times over, so the buffer is compacted
    # while a partly fed frame sits at its end.
    frames = [encode_frame(fmt.T_ENVELOPE, bytes([i % 256]) * 991) for i in range(400)]
    stream = b"".join(frames)
    scanner = Scanner()
    got: list[bytes] = []
    largest_buffer = 0
    for at in range(0, len(stream), 700):
        scanner.feed(stream[at : at + 700])
        largest_buffer = max(largest_buffer, len(scanner._buf))
        while isinstance(result := scanner.next(), Frame):
            got.append(result.payload)
        assert result is NEED_DATA
    assert got == [bytes([i % 256]) * 991 for i in range(400)]
    # Without compaction the buffer would hold the whole 400 kB stream.
    assert largest_buffer < 2 * 65536 + 2000, largest_buffer


def test_a_scanner_stays_at_a_bad_frame_after_compacting_its_buffer() -> None:
    good = encode_frame(fmt.T_DELTA, bytes(1000))
    scanner = Scanner()
    for _ in range(100):
        scanner.feed(good)
        assert isinstance(scanner.next(), Frame)
    scanner.feed(bytes(fmt.FRAME_HEADER_SIZE) + good)  # a zeroed header, then a frame
    bad = scanner.next()
    assert bad == BadFrame(f"unknown frame type {fmt.T_NONE}")
    assert scanner.next() == bad  # not consumed: the caller decides what comes next
