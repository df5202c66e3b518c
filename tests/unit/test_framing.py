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
