"""Frames: the length + CRC-32C envelope around every record. No I/O here.

``encode_frame`` builds one frame; ``parse_frame`` looks at a buffer and says what is at an
offset: a whole ``Frame``, ``NEED_DATA`` (the buffer ends inside the frame), or a
``BadFrame`` (the bytes there cannot be a frame). Both take the ``salt`` of the segment the
frame belongs to (from its header; 0 for a version 1 segment): the CRC starts from it, so
bytes that were never written as a frame of this segment (message data that imitates a
frame, a frame of another segment) fail the check. Whether a ``BadFrame`` is a torn tail or
corruption is not decided here: only the reader knows where the durable end of the log is
(see ``reader.py``). Because nothing here touches a file, tests feed frames one byte at a
time and cut them at every offset.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Final

import attrs
from crc32c import crc32c

from spool import format as fmt


@attrs.frozen
class Frame:
    """One checked frame: its type, payload and total size on disk."""

    type: int
    payload: bytes
    size: int


@attrs.frozen
class BadFrame:
    """Bytes that are not a valid frame, and why."""

    reason: str


@attrs.frozen
class _NeedData:
    """The buffer ends inside the frame: read more, or it is a truncated tail."""


NEED_DATA: Final = _NeedData()

_HEADER = fmt.FRAME_HEADER
_HEADER_SIZE = fmt.FRAME_HEADER_SIZE


def frame_crc(length_and_type: bytes, payload: bytes, salt: int = 0) -> int:
    """The CRC-32C of a frame: over the length, the type byte and the payload, starting
    from ``salt`` (the running value of the ``crc32c`` package; 0 is plain CRC-32C)."""
    return crc32c(payload, crc32c(length_and_type, salt))


def encode_frame(ftype: int, payload: bytes, salt: int = 0) -> bytes:
    """Encode one frame for a segment salted with ``salt``. The type must be a known type
    other than NONE, the payload at most ``FRAME_PAYLOAD_MAX`` (callers check first)."""
    assert ftype in fmt.FRAME_TYPES, ftype
    assert len(payload) <= fmt.FRAME_PAYLOAD_MAX, len(payload)
    length_and_type = _HEADER.pack(0, len(payload), ftype)[4:]
    crc = frame_crc(length_and_type, payload, salt)
    return crc.to_bytes(4, "little") + length_and_type + payload


def pad_frame(size: int, salt: int = 0) -> bytes:
    """A PAD frame of exactly ``size`` bytes (header included); size >= header size."""
    assert size >= _HEADER_SIZE, size
    return encode_frame(fmt.T_PAD, bytes(size - _HEADER_SIZE), salt)


def padding_for(offset: int, salt: int = 0, sector: int = fmt.SECTOR) -> bytes:
    """The PAD frame that brings ``offset`` to the next sector boundary (b'' if aligned).

    A gap too small for a frame header is widened by one more sector.
    """
    gap = -offset % sector
    if gap == 0:
        return b""
    if gap < _HEADER_SIZE:
        gap += sector
    return pad_frame(gap, salt)


def parse_frame(
    buf: bytes | bytearray | memoryview, offset: int, salt: int = 0
) -> Frame | BadFrame | _NeedData:
    """Parse the frame starting at ``offset`` of ``buf``, in a segment salted ``salt``.

    Returns ``NEED_DATA`` when ``buf`` ends before the frame does (also for a length field
    that is plausible but runs past the buffer), ``BadFrame`` when the bytes cannot be a
    frame: unknown type, impossible length, or a CRC mismatch.
    """
    end_of_header = offset + _HEADER_SIZE
    if len(buf) < end_of_header:
        return NEED_DATA
    crc, length, ftype = _HEADER.unpack_from(buf, offset)
    if ftype not in fmt.FRAME_TYPES:
        return BadFrame(f"unknown frame type {ftype}")
    if length > fmt.FRAME_PAYLOAD_MAX:
        return BadFrame(f"frame length {length} exceeds the maximum {fmt.FRAME_PAYLOAD_MAX}")
    end = end_of_header + length
    if len(buf) < end:
        return NEED_DATA
    payload = bytes(buf[end_of_header:end])
    if frame_crc(bytes(buf[offset + 4 : end_of_header]), payload, salt) != crc:
        return BadFrame("checksum mismatch")
    return Frame(ftype, payload, end - offset)


def peek_header(
    buf: bytes | bytearray | memoryview, offset: int
) -> tuple[int, int] | BadFrame | _NeedData:
    """(type, total size) of the frame at ``offset`` without checking its CRC.

    Used to step over a body frame whose payload the caller does not need; the caller
    must not treat the frame as checked.
    """
    if len(buf) < offset + _HEADER_SIZE:
        return NEED_DATA
    _crc, length, ftype = _HEADER.unpack_from(buf, offset)
    if ftype not in fmt.FRAME_TYPES:
        return BadFrame(f"unknown frame type {ftype}")
    if length > fmt.FRAME_PAYLOAD_MAX:
        return BadFrame(f"frame length {length} exceeds the maximum {fmt.FRAME_PAYLOAD_MAX}")
    return ftype, _HEADER_SIZE + length


def whole_frames(
    buf: bytes,
    offset: int,
    salt: int,
    *,
    base: int = 0,
    skip_bodies: bool = True,
) -> Generator[tuple[int, int, bytes], None, int]:
    """(offset, type, payload) of each record frame of ``buf`` from ``offset`` on, as long
    as each frame is whole and checked, for a reader of records that holds a whole segment
    in memory; it returns the end of the last whole, checked frame (BODY and PAD frames
    are checked and counted, not given). Offsets given and returned are ``base`` plus the
    offset in ``buf`` (``buf`` is the file from ``base`` on).

    It stops quietly at the first frame that is not (a bad type, an impossible length, a
    checksum mismatch, or a frame that runs past ``buf``): the caller then reads on from
    the end returned with ``reader.LogCursor``, the one reader that decides whether such
    bytes are a torn tail or damage. The checks are ``parse_frame``'s, in one loop without
    a call or an object a frame. With ``skip_bodies`` a BODY frame's checksum is not
    checked, as ``LogCursor(skip_bodies=True)`` steps over one.
    """
    unpack = _HEADER.unpack_from
    types = fmt.FRAME_TYPES
    body = fmt.T_BODY
    pad = fmt.T_PAD
    most = fmt.FRAME_PAYLOAD_MAX
    total = len(buf)
    while offset + _HEADER_SIZE <= total:
        crc, length, ftype = unpack(buf, offset)
        start = offset + _HEADER_SIZE
        end = start + length
        if ftype not in types or length > most or end > total:
            break
        if ftype != body or not skip_bodies:
            payload = buf[start:end]
            if crc32c(payload, crc32c(buf[offset + 4 : start], salt)) != crc:
                break
            if ftype != body and ftype != pad:
                yield base + offset, ftype, payload
        offset = end
    return base + offset


# Frames up to this size are searched for a single flipped bit (8 CRC steps a byte).
CORRECT_MAX = 64 * 1024


def one_bit_fixed(raw: bytes, salt: int) -> bytes | None:
    """``raw``, one frame that fails its check, with the one flipped bit that explains the
    failure put right; None if no single bit does (or the frame is too long to search).

    A CRC is affine, so flipping bit *b* of the byte *k* bytes before the end changes it by
    a value that depends only on *b* and *k* (the "syndrome"). CRC-32C's Hamming distance
    is 4 for frames up to 2^31 bits (Koopman), so the syndromes of single bits all differ,
    and no damage of two bits has one's syndrome: a result is the frame as written unless
    three or more of its bits flipped.
    """
    if not fmt.FRAME_HEADER_SIZE <= len(raw) <= CORRECT_MAX:
        return None
    stored = int.from_bytes(raw[:4], "little")
    covered = raw[4:]
    syndrome = stored ^ crc32c(covered, salt)
    if bin(syndrome).count("1") == 1:
        # The flip is in the stored CRC: the rest is intact, the CRC is the one it covers.
        return (stored ^ syndrome).to_bytes(4, "little") + covered
    zero = crc32c(b"\0", 0)
    effects = [crc32c(bytes([1 << b]), 0) ^ zero for b in range(8)]
    for k in range(len(covered)):
        if syndrome in effects:
            fixed = bytearray(covered)
            fixed[len(covered) - 1 - k] ^= 1 << effects.index(syndrome)
            return raw[:4] + bytes(fixed)
        effects = [crc32c(b"\0", e) ^ zero for e in effects]  # one more byte after it
    return None


class Scanner:
    """Turns a stream of bytes into frames; fed with ``feed``, pulled with ``next``.

    Does no I/O. After a ``BadFrame`` the scanner stays at the bad bytes: what to do next
    is the caller's decision. ``salt`` is the segment's (0 for version 1). Offsets are
    those of the stream: ``start`` is the offset of the first byte fed (the log reader
    feeds a segment file from where it starts reading, so offsets are file offsets).
    ``seek`` moves to another offset: inside what was fed, the bytes are kept; outside,
    they are dropped and the next ``feed`` must bring the bytes from there (``end``).
    This is the one frame buffer of the package: ``reader.LogCursor`` reads through it.
    """

    def __init__(self, salt: int = 0, start: int = 0) -> None:
        self._buf = b""
        self._base = start  # the stream offset of _buf[0]
        self._pos = 0  # the next frame's index in _buf
        self._salt = salt

    @property
    def position(self) -> int:
        """The stream offset of the next frame."""
        return self._base + self._pos

    @property
    def end(self) -> int:
        """The stream offset just past the bytes fed: where the next ``feed`` continues."""
        return self._base + len(self._buf)

    def feed(self, data: bytes) -> None:
        """Append bytes to the stream (the bytes from ``end`` on)."""
        if self._pos:
            self._buf = self._buf[self._pos :]
            self._base += self._pos
            self._pos = 0
        self._buf += data

    def seek(self, offset: int) -> None:
        """Make ``offset`` the position of the next frame."""
        if self._base <= offset <= self.end:
            self._pos = offset - self._base
        else:
            self._buf, self._base, self._pos = b"", offset, 0

    def forget_from(self, offset: int) -> None:
        """Drop the bytes fed from ``offset`` on (the next ``feed`` brings them again)."""
        if offset < self.end:
            keep = max(offset - self._base, self._pos)
            self._buf = self._buf[:keep]

    def peek(self) -> tuple[int, int] | BadFrame | _NeedData:
        """(type, total size) of the next frame from its header, CRC not checked (see
        ``peek_header``): to step over a frame whose payload is not needed."""
        return peek_header(self._buf, self._pos)

    def next(self) -> Frame | BadFrame | _NeedData:
        """The next frame, ``NEED_DATA``, or ``BadFrame`` (without consuming it)."""
        result = parse_frame(self._buf, self._pos, self._salt)
        if isinstance(result, Frame):
            self._pos += result.size
        return result
