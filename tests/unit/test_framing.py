"""The frame codec without I/O: round trips, one byte at a time, every truncation, bit flips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spool import format as fmt
from spool.framing import (
    NEED_DATA,
    BadFrame,
    Frame,
    Scanner,
    encode_frame,
    padding_for,
    parse_frame,
    whole_frames,
)

TYPES = sorted(fmt.FRAME_TYPES)


@given(st.sampled_from(TYPES), st.binary(max_size=2000))
def test_encoded_frame_parses_back_to_itself(ftype: int, payload: bytes) -> None:
    frame = encode_frame(ftype, payload)
    assert parse_frame(frame, 0) == Frame(ftype, payload, len(frame))


def test_scanner_fed_one_byte_at_a_time_yields_every_frame() -> None:
    frames = [encode_frame(fmt.T_ENVELOPE, b"a" * n) for n in (0, 1, 100, 513)]
    scanner = Scanner()
    got = []
    for byte in b"".join(frames):
        scanner.feed(bytes([byte]))
        while isinstance(result := scanner.next(), Frame):
            got.append(result.payload)
        assert result is NEED_DATA
    assert got == [b"", b"a", b"a" * 100, b"a" * 513]


def test_truncation_at_every_offset_needs_data_never_misparses() -> None:
    frame = encode_frame(fmt.T_DELTA, bytes(range(256)))
    for cut in range(len(frame)):
        assert parse_frame(frame[:cut], 0) is NEED_DATA


def test_every_single_bit_flip_is_detected() -> None:
    frame = encode_frame(fmt.T_START, b"hello world, this is a record")
    for i in range(len(frame) * 8):
        damaged = bytearray(frame)
        damaged[i // 8] ^= 1 << (i % 8)
        result = parse_frame(bytes(damaged), 0)
        # A flipped length bit can make the frame look longer than the buffer.
        assert isinstance(result, BadFrame) or result is NEED_DATA, i


def test_zeroed_bytes_never_parse_as_a_frame() -> None:
    assert isinstance(parse_frame(bytes(4096), 0), BadFrame)


def test_oversized_length_field_is_bad_not_need_data() -> None:
    header = fmt.FRAME_HEADER.pack(0, fmt.FRAME_PAYLOAD_MAX + 1, fmt.T_BODY)
    assert isinstance(parse_frame(header, 0), BadFrame)


@pytest.mark.parametrize("offset", [0, 1, 9, 500, 503, 504, 511, 512, 1000])
def test_padding_reaches_the_next_sector_boundary(offset: int) -> None:
    pad = padding_for(offset)
    assert (offset + len(pad)) % fmt.SECTOR == 0
    if pad:
        assert parse_frame(pad, 0) == Frame(fmt.T_PAD, pad[9:], len(pad))


def test_a_frame_checks_only_with_the_salt_of_its_segment() -> None:
    frame = encode_frame(fmt.T_START, b"a record", 0x5A17CAFE)
    assert parse_frame(frame, 0, 0x5A17CAFE) == Frame(fmt.T_START, b"a record", len(frame))
    for other in (0, 0x5A17CAFF, 1):
        assert parse_frame(frame, 0, other) == BadFrame("checksum mismatch")


def test_scanner_offsets_are_stream_offsets_from_its_start() -> None:
    first, second = encode_frame(fmt.T_START, b"one"), encode_frame(fmt.T_DELTA, b"two")
    scanner = Scanner(start=4096)
    assert (scanner.position, scanner.end) == (4096, 4096)
    scanner.feed(first + second[:5])
    assert scanner.end == 4096 + len(first) + 5
    assert scanner.peek() == (fmt.T_START, len(first))
    assert isinstance(scanner.next(), Frame)
    assert scanner.position == 4096 + len(first)
    assert scanner.peek() is NEED_DATA  # only 5 bytes of the next header
    scanner.feed(second[5:])
    assert scanner.next() == Frame(fmt.T_DELTA, b"two", len(second))
    assert scanner.position == scanner.end


def test_scanner_seek_inside_the_fed_bytes_keeps_them_and_outside_drops_them() -> None:
    frames = [encode_frame(fmt.T_ENVELOPE, bytes([n]) * n) for n in range(1, 6)]
    stream = b"".join(frames)
    starts = [sum(map(len, frames[:i])) for i in range(len(frames))]
    scanner = Scanner()
    scanner.feed(stream)
    scanner.seek(starts[3])  # forward, inside
    assert scanner.next() == Frame(fmt.T_ENVELOPE, b"\x04" * 4, len(frames[3]))
    scanner.seek(starts[1])  # back, inside (nothing fed since)
    assert scanner.next() == Frame(fmt.T_ENVELOPE, b"\x02" * 2, len(frames[1]))
    scanner.seek(len(stream) + 100)  # past the end: the next feed starts there
    assert (scanner.position, scanner.end) == (len(stream) + 100, len(stream) + 100)
    assert scanner.next() is NEED_DATA
    scanner.feed(frames[0])
    assert scanner.next() == Frame(fmt.T_ENVELOPE, b"\x01", len(frames[0]))


@given(
    st.lists(st.tuples(st.sampled_from(TYPES), st.binary(max_size=300)), max_size=12),
    st.lists(st.integers(1, 700), min_size=1, max_size=40),
)
def test_scanner_read_in_any_chunks_and_stepping_over_bodies_sees_every_frame(
    records: list[tuple[int, bytes]], chunks: list[int]
) -> None:
    """What the log reader does: feed chunks of any size from ``end``, step over BODY
    frames by ``seek`` on their header alone, parse the rest; every frame comes out once,
    at its own offset."""
    start = fmt.SEGMENT_HEADER_SIZE
    encoded = [encode_frame(t, p, 77) for t, p in records]
    stream = b"".join(encoded)
    expected = []
    offset = start
    for (ftype, payload), frame in zip(records, encoded, strict=True):
        expected.append((offset, ftype, b"" if ftype == fmt.T_BODY else payload))
        offset += len(frame)
    scanner = Scanner(77, start)
    got = []
    turn = 0
    while scanner.position < start + len(stream):
        head = scanner.peek()
        if isinstance(head, tuple) and head[0] == fmt.T_BODY:
            got.append((scanner.position, fmt.T_BODY, b""))
            scanner.seek(scanner.position + head[1])
            continue
        at = scanner.position
        result = scanner.next()
        if isinstance(result, Frame):
            got.append((at, result.type, result.payload))
            continue
        assert result is NEED_DATA
        size = chunks[turn % len(chunks)]
        turn += 1
        scanner.feed(stream[scanner.end - start : scanner.end - start + size])
    assert got == expected


@given(
    st.lists(st.tuples(st.sampled_from(TYPES), st.binary(max_size=300)), max_size=8),
    st.integers(min_value=0, max_value=10_000),
    st.sampled_from(["flip", "cut", "none"]),
    st.sampled_from([0, 32, 70_000]),
)
def test_whole_frames_yields_what_the_scanner_checks_and_stops_where_it_does(
    parts: list[tuple[int, bytes]], at: int, change: str, base: int
) -> None:
    salt = 0x5EED
    stream = bytearray(b"".join(encode_frame(t, p, salt) for t, p in parts))
    if stream and change == "flip":
        stream[at % len(stream)] ^= 0x01
    elif change == "cut":
        del stream[at % (len(stream) + 1) :]
    data = bytes(stream)
    scanner = Scanner(salt)
    scanner.feed(data)
    expected = []
    while True:
        head = scanner.peek()
        if isinstance(head, tuple) and head[0] == fmt.T_BODY:
            if scanner.position + head[1] > len(data):
                break
            expected.append((scanner.position, head[1], fmt.T_BODY, b""))  # stepped over
            scanner.seek(scanner.position + head[1])
            continue
        start = scanner.position
        frame = scanner.next()
        if not isinstance(frame, Frame):
            break
        expected.append((start, frame.size, frame.type, frame.payload))
    stopped = expected[-1][0] + expected[-1][1] if expected else 0  # the last whole end
    expected_frames = [(at, t, payload) for at, _size, t, payload in expected]
    frames = whole_frames(data, 0, salt, base=base)
    got = []
    while True:
        try:
            at, t, payload = next(frames)
        except StopIteration as end:
            assert end.value == base + stopped  # the end of the last whole frame
            break
        got.append((at - base, t, payload))
    assert got == [f for f in expected_frames if f[1] not in (fmt.T_BODY, fmt.T_PAD)]
