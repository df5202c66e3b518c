"""Pinned bytes: the format must not change by accident (docs/format.md shows the same)."""

from __future__ import annotations

from spool import format as fmt
from spool.framing import encode_frame
from spool.segment_header import segment_header

SALT = 0x5A17CAFE  # the salt docs/format.md uses in its examples


def test_segment_header_bytes_are_pinned() -> None:
    assert segment_header(1, SALT).hex() == (
        "53504f4f4c4c4f4702000000200000000100000000000000feca175abf6fa600"
    )


def test_frame_bytes_are_pinned() -> None:
    assert encode_frame(fmt.T_CONTROL, b"hi", SALT).hex() == "b6ef542e02000000066869"


def test_a_version_1_frame_is_a_frame_salted_0() -> None:
    # Version 1 wrote no salt (the header field was reserved, 0) and its CRC was plain
    # CRC-32C: version 2 readers check version 1 frames with salt 0, unchanged.
    assert encode_frame(fmt.T_CONTROL, b"hi", 0).hex() == "fa6b75be02000000066869"


def test_constants_are_pinned() -> None:
    assert (fmt.SEGMENT_HEADER_SIZE, fmt.FRAME_HEADER_SIZE, fmt.SECTOR) == (32, 9, 512)
    assert (fmt.T_ENVELOPE, fmt.T_BODY, fmt.T_START, fmt.T_DELTA) == (1, 2, 3, 4)
    assert (fmt.T_FINISH, fmt.T_CONTROL, fmt.T_PAD, fmt.T_NONE) == (5, 6, 15, 0)
    assert fmt.FORMAT_VERSION == 2 and {1, 2} == fmt.FORMAT_VERSIONS_READ


def test_crc32c_is_the_castagnoli_polynomial() -> None:
    from crc32c import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
