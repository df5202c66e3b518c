"""The segment header: the 32 bytes that open every log segment (docs/format.md).

Written by the log writer when it starts a segment and by a repair that rebuilds one;
checked by every reader before it trusts a segment's frames. One module for both sides,
so the layout cannot drift between them.
"""

from __future__ import annotations

import secrets

from crc32c import crc32c

from spool import format as fmt


def new_salt() -> int:
    """A fresh segment salt: 32 random bits, never 0 (0 is what version 1 wrote)."""
    while not (salt := secrets.randbits(32)):
        pass
    return salt


def segment_header(number: int, salt: int) -> bytes:
    """The 32-byte header that opens segment ``number``, whose frames are salted ``salt``."""
    body = fmt.SEGMENT_HEADER.pack(
        fmt.SEGMENT_MAGIC, fmt.FORMAT_VERSION, fmt.SEGMENT_HEADER_SIZE, number, salt, 0
    )[:-4]
    return body + crc32c(body).to_bytes(4, "little")


def check_segment_header(data: bytes, number: int, path: str) -> str | None:
    """None if ``data`` starts with a valid header for segment ``number``, else why not."""
    if len(data) < fmt.SEGMENT_HEADER_SIZE:
        return f"header truncated ({len(data)} bytes)"
    magic, version, size, seg, _salt, crc = fmt.SEGMENT_HEADER.unpack_from(data)
    if crc32c(data[: fmt.SEGMENT_HEADER_SIZE - 4]) != crc:
        return "header checksum mismatch"
    if magic != fmt.SEGMENT_MAGIC:
        return "not a spool segment (bad magic)"
    if version not in fmt.FORMAT_VERSIONS_READ:
        readable = ", ".join(map(str, sorted(fmt.FORMAT_VERSIONS_READ)))
        return f"format version {version}, this spool reads versions {readable}"
    if size != fmt.SEGMENT_HEADER_SIZE or seg != number:
        return f"header names segment {seg}, file name says {number}"
    return None


def segment_salt(header: bytes) -> int:
    """The salt of a segment's frames, from its (checked) header: 0 for version 1."""
    _magic, version, _size, _seg, salt, _crc = fmt.SEGMENT_HEADER.unpack_from(header)
    return 0 if version == 1 else int(salt)


def header_blank(first_sector: bytes) -> bool:
    """Whether a segment's first sector (or what there is of it) is all zeros."""
    return not first_sector.strip(b"\0")
