"""Pinned bytes: the format must not change by accident (docs/format.md shows the same)."""

from __future__ import annotations

from spool import format as fmt
from spool.framing import encode_frame
from spool.writer import segment_header


def test_segment_header_bytes_are_pinned() -> None:
    assert segment_header(1).hex() == (
        "53504f4f4c4c4f470100000020000000010000000000000000000000ff6437e8"
    )


def test_frame_bytes_are_pinned() -> None:
    frame = encode_frame(fmt.T_CONTROL, b"hi")
    assert frame.hex() == "fa6b75be02000000066869"


def test_constants_are_pinned() -> None:
    assert (fmt.SEGMENT_HEADER_SIZE, fmt.FRAME_HEADER_SIZE, fmt.SECTOR) == (32, 9, 512)
    assert (fmt.T_ENVELOPE, fmt.T_BODY, fmt.T_START, fmt.T_DELTA) == (1, 2, 3, 4)
    assert (fmt.T_FINISH, fmt.T_CONTROL, fmt.T_PAD, fmt.T_NONE) == (5, 6, 15, 0)


def test_crc32c_is_the_castagnoli_polynomial() -> None:
    from crc32c import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
