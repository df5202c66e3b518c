"""Reading the log: frames from a position onward, across segment files.

``LogCursor`` walks frames in order, reading the segment files in large chunks and, when
asked, stepping over BODY frames without reading them (queue runners never read bodies).
It stops at a ``limit`` position (the writer's durable end for live readers) or at the
end of the files on disk (recovery, offline tools).

This is the one place that decides what a bad frame means (LevelDB's ``log_reader``):

* before ``durable_end`` (the end the restart positions vouch for): corruption, raised as
  ``CorruptSpool`` with the file and offset;
* after it, in the newest segment: a torn tail, reported as a ``TornTail`` for recovery to
  cut (a crash interrupted the last batch; nobody was told it was durable);
* after it, in an older segment: corruption too, because a segment is created only after
  the one before it is fully synced (writer invariant W3).

Errors:
    ``CorruptSpool`` as above, and for a bad segment header or a missing segment in the
    middle of the log.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Generator, Iterator
from typing import Final

import attrs

from spool import format as fmt
from spool.errors import CorruptSpool, SegmentUnreadable
from spool.framing import (
    NEED_DATA,
    BadFrame,
    Frame,
    Scanner,
    encode_frame,
    one_bit_fixed,
    parse_frame,
    peek_header,
    whole_frames,
)
from spool.fs import FileSystem
from spool.records import Position
from spool.segment_header import check_segment_header, header_blank, segment_salt

CHUNK_SIZE = 256 * 1024


# Before a reader calls bad bytes past the durable end damage, it reads them twice, this
# long apart: bytes that change are a running owner's write in progress (a batch copied
# over zeros written ahead takes microseconds; one of megabytes, a millisecond or so).
REREAD_AFTER: Final = 0.002


def list_segments(fs: FileSystem, log_dir: str) -> list[int]:
    """Numbers of the segment files in ``log_dir``, ascending."""
    numbers = [n for n in map(fmt.parse_segment_name, fs.listdir(log_dir)) if n is not None]
    return sorted(numbers)


def written_bytes(tail: bytes, offset: int) -> int:
    """How many bytes of ``tail``, the segment from ``offset`` to its end, were written:
    up to the end of its last sector holding a byte that is not zero (or of the file).
    Sectors of zeros after it are space never written, or zeros written ahead of the log
    (writer invariant W6); zeros inside a written sector (a PAD frame's) are counted."""
    last = _end_of_data(tail)
    if not last:
        return 0
    sector_end = -(-(offset + last) // fmt.SECTOR) * fmt.SECTOR
    return min(len(tail), sector_end - offset)


def looks_torn(data: bytes, first: int, offset: int, salt: int) -> bool:
    """Whether bad bytes at ``offset`` of a segment look like an interrupted last write.

    ``data`` holds the segment from ``first`` (the sector boundary at or before
    ``offset``) to its end. Under the fault model a torn write leaves whole sectors
    unwritten: zeros in a freshly appended file or over the zeros the writer wrote ahead
    (writer invariant W6), or a file that ends before the write did. So the bad frame is
    torn only if one of the sectors it covers is all zeros (from the frame on) or the file
    ends inside it; a frame every sector of which is there was damaged, not torn.
    And batches start at sector boundaries, so it is damage too if a valid frame starts at
    a later sector boundary with no all-zero sector between the damage and it (etcd's
    ``isTornEntry`` reasons the same way). Frames are salted, so message data cannot pose
    as that later frame.
    """
    sector = fmt.SECTOR
    if offset % sector == 0 and _zeros_but_one_burst(data, offset - first):
        return True
    zero = bytes(sector)
    for rel in range(0, len(data), sector):
        if rel > offset - first and isinstance(parse_frame(data, rel, salt), Frame):
            return False
        all_zero = data[rel : rel + sector] == zero[: len(data) - rel]
        if all_zero and not _widened_padding_into(data, offset - first, rel, salt):
            break
    return _covers_a_gap(data, offset - first, salt)


def _widened_padding_into(data: bytes, at: int, zeros: int, salt: int) -> bool:
    """Whether the all-zero sector at ``zeros`` may be the rest of a widened PAD frame
    at ``at`` whose header a burst hit, rather than a tear.

    A PAD frame widened by a sector (docs/format.md) has its header cross into the next
    sector, which holds nothing else but zeros: a burst over the header's last bytes
    (its type among them) leaves that sector all zero with nothing torn. It is that frame
    when its header is the one of the PAD frame ending at the next sector boundary but
    for one run of at most ``BURST`` bytes: then the search for a valid frame goes on
    past it (one at that boundary means damage, as after any sector that is there)."""
    sector = fmt.SECTOR
    end = zeros + sector
    if zeros != at - at % sector + sector or at + fmt.FRAME_HEADER_SIZE <= zeros:
        return False  # not the sector a header at ``at`` crosses into
    if end > len(data) or end - at - fmt.FRAME_HEADER_SIZE > fmt.FRAME_PAYLOAD_MAX:
        return False
    header = encode_frame(fmt.T_PAD, bytes(end - at - fmt.FRAME_HEADER_SIZE), salt)
    got = data[at : at + fmt.FRAME_HEADER_SIZE]
    differ = [i for i in range(fmt.FRAME_HEADER_SIZE) if got[i] != header[i]]
    return bool(differ) and differ[-1] - differ[0] < fmt.BURST


def _zeros_but_one_burst(data: bytes, at: int) -> bool:
    """Whether ``data`` from ``at`` (a sector boundary) to its end is zeros but for one
    run of at most ``BURST`` bytes in the sector at ``at``: sectors never written, or of
    zeros written ahead of the log (writer invariant W6), that damage hit after the end of
    the log. No frame was there: a batch's first frame starts on that boundary, and its
    header alone has bytes further apart than a run (its length, at most 2^23, in its
    first three bytes; its type in its ninth)."""
    last = _end_of_data(data, at) - at
    if not 0 < last <= fmt.SECTOR:
        return False
    head = data[at : at + last]
    first_set = last - len(head.lstrip(b"\0"))
    return last - first_set <= fmt.BURST


_ZERO_BLOCK: Final = bytes(1 << 16)


def _end_of_data(data: bytes, start: int = 0) -> int:
    """Where the last byte of ``data[start:]`` that is not zero ends (``start`` if none):
    whole blocks of zeros compared at memory speed (a restart meets up to ``write_ahead``
    of them after the log's end; ``rstrip`` takes a millisecond a megabyte)."""
    end = len(data)
    block = len(_ZERO_BLOCK)
    while end - start >= block and data[end - block : end] == _ZERO_BLOCK:
        end -= block
    return start + len(data[start:end].rstrip(b"\0"))


def _covers_a_gap(data: bytes, at: int, salt: int) -> bool:
    """Whether the frame at ``at`` of ``data`` (which starts on a sector boundary) covers
    an all-zero sector or runs past the end of ``data``: what a tear leaves. Its extent
    is what its header says, once the sectors holding the header are known to be there
    (a header that says more than a frame can hold, or a length with a valid frame
    inside it, was damaged)."""
    header_end = at + fmt.FRAME_HEADER_SIZE
    if header_end > len(data) or _zero_sector_in(data, at, header_end):
        return True
    length = fmt.FRAME_HEADER.unpack_from(data, at)[1]
    if length > fmt.FRAME_PAYLOAD_MAX:
        return False
    end = header_end + length
    if first_valid_frame(data, at + 1, min(end, len(data)), salt) < min(end, len(data)):
        return False  # a frame inside it: its length is the damage (data cannot pose, salts)
    if end <= len(data) and not _zero_sector_in(data, at, end):
        return False
    if _length_bit_flipped(data, at, salt):
        return False  # its length field is the damage: the frame it said is all there
    if end > len(data):
        return True
    # A sector of zeros inside a frame that is all there may be its data (a message with
    # a run of NULs): if one flipped bit outside every such sector explains its failed
    # check with the zeros as they are, the zeros were written and the bit is the damage.
    # A bit inside one is evidence only if a later batch follows this one: a sector
    # written as zeros but for one set bit, then torn, reads exactly so, but a tear is
    # never followed by another batch (the next is written once this one is synced).
    fixed = one_bit_fixed(data[at:end], salt)
    if fixed is None:
        return True
    flipped = at + next(i for i in range(len(fixed)) if fixed[i] != data[at + i])
    its_sector = max(at, flipped - flipped % fmt.SECTOR)  # from the frame's start at most
    if not _zero_sector_in(data, its_sector, its_sector + 1):
        return False
    return not _later_batch_follows(data, end, salt)


def _later_batch_follows(data: bytes, pos: int, salt: int) -> bool:
    """Whether the valid frames from ``pos`` on run to the end of a batch (a PAD frame
    ending on a sector boundary; ``data`` starts on one) with another valid frame, the
    next batch's, right after it."""
    while isinstance(frame := parse_frame(data, pos, salt), Frame):
        pos += frame.size
        if frame.type == fmt.T_PAD and pos % fmt.SECTOR == 0:
            return isinstance(parse_frame(data, pos, salt), Frame)
    return False


def _length_bit_flipped(data: bytes, at: int, salt: int) -> bool:
    """Whether the frame at ``at`` is valid but for one flipped bit of its length field
    (which, shortening it, leaves the one-bit search of its wrong extent nothing to find:
    a sector of zeros inside the frame it really is would then read as a tear)."""
    _crc, length, _ftype = fmt.FRAME_HEADER.unpack_from(data, at)
    for bit in range(32):
        size = fmt.FRAME_HEADER_SIZE + (length ^ 1 << bit)
        if size - fmt.FRAME_HEADER_SIZE > fmt.FRAME_PAYLOAD_MAX or at + size > len(data):
            continue
        fixed = bytearray(data[at : at + size])
        fixed[4:8] = (length ^ 1 << bit).to_bytes(4, "little")
        if isinstance(parse_frame(fixed, 0, salt), Frame):
            return True
    return False


# A header whose length field's top byte is 0 (no payload reaches 16 MiB) and whose type
# byte is a frame type: the only offsets worth a CRC check when looking for a valid frame.
_CANDIDATE = re.compile(rb"(?s)(?=.{7}\x00[\x01-\x06\x0f])")


def first_valid_frame(data: bytes, lo: int, hi: int, salt: int) -> int:
    """The first offset in ``[lo, hi)`` where a valid frame (with ``salt``) starts in
    ``data``, or ``hi``."""
    for match in _CANDIDATE.finditer(data, lo, hi + fmt.FRAME_HEADER_SIZE - 1):
        if match.start() >= hi:
            break
        if isinstance(parse_frame(data, match.start(), salt), Frame):
            return match.start()
    return hi


def _zero_sector_in(data: bytes, lo: int, hi: int) -> bool:
    """Whether a sector of ``data`` that overlaps ``[lo, hi)`` is all zeros from ``lo`` on
    (the first sector of a segment's first batch also holds the segment header, written
    before it)."""
    sector = fmt.SECTOR
    for rel in range(lo - lo % sector, min(hi, len(data)), sector):
        if not data[max(rel, lo) : rel + sector].strip(b"\0"):
            return True
    return False


@attrs.frozen
class TornTail:
    """A torn tail found in the newest segment: bytes from ``at`` to ``file_size``."""

    at: Position
    file_size: int
    reason: str


@attrs.frozen
class SkippedBody:
    """A BODY frame stepped over without reading: its size on disk."""

    size: int


class LogCursor:
    """Iterates frames from ``start``; not thread-safe (one cursor per reader).

    ``durable_end`` decides corruption versus torn tail (see the module docstring). A
    ``live`` reader (queue runners, the outcome reader) reads behind a running writer with
    the writer's durable end as the ``limit`` of each ``next``: any bad frame before it is
    corruption. A reader ``beside_owner`` (a view of a spool another process may be
    writing: the CLI's, the analytics') reads bad bytes past the durable end once more,
    ``REREAD_AFTER`` later, before it calls them damage: bytes still changing are a write
    in progress, and it stops there.
    """

    def __init__(
        self,
        fs: FileSystem,
        log_dir: str,
        start: Position,
        *,
        durable_end: Position | None = None,
        newest_segment: int | None = None,
        skip_bodies: bool = False,
        chunk_size: int = CHUNK_SIZE,
        live: bool = False,
        beside_owner: bool = False,
    ) -> None:
        self._fs = fs
        self._beside_owner = beside_owner
        self._dir = log_dir
        self.position = start
        self._durable_end = durable_end
        self._newest = newest_segment
        self._skip_bodies = skip_bodies
        self._chunk = chunk_size
        self._fd: int | None = None
        self._fd_segment = 0
        self._path: tuple[int, str] = (-1, "")
        self._salt = 0
        self._scanner = Scanner()
        self._size = -1
        self._size_whole = False
        self._limit: Position | None = None
        self._live = live
        self.torn: TornTail | None = None
        self.bytes_read = 0

    def close(self) -> None:
        if self._fd is not None:
            self._fs.close(self._fd)
            self._fd = None

    def path(self, segment: int) -> str:
        """The file of ``segment`` (that of the last one asked for is kept: a runner asks
        for it with every envelope it decodes, in case the envelope is damaged)."""
        if self._path[0] != segment:
            self._path = (segment, os.path.join(self._dir, fmt.segment_name(segment)))
        return self._path[1]

    def file_size(self, segment: int) -> int:
        """The size of ``segment``'s file now."""
        return self._fs.file_size(self.path(segment))

    def _open(self, segment: int) -> bool:
        """Open ``segment`` (validating its header); False if the file does not exist."""
        self.close()
        path = self.path(segment)
        try:
            fd = open_segment(self._fs, path)
        except FileNotFoundError:
            return False
        self._fd, self._fd_segment = fd, segment
        self._size = -1  # the file's size when last asked (it only grows)
        self._size_whole = False  # ... asked once the durable end was in a later segment
        header = self._fs.pread(fd, fmt.SEGMENT_HEADER_SIZE, 0)
        problem = check_segment_header(header, segment, path)
        if problem is not None:
            # The writer may have created the file and written it since the read (a reader
            # beside a running owner): read it again after taking the size, so that the
            # size never covers bytes the header read did not see.
            size = self._fs.size(fd)
            header = self._fs.pread(fd, fmt.SEGMENT_HEADER_SIZE, 0)
            problem = check_segment_header(header, segment, path)
            if problem is not None:
                self._bad(Position(segment, 0), problem, size)
        self._salt = segment_salt(header)
        if self.position.offset < fmt.SEGMENT_HEADER_SIZE:
            self.position = Position(segment, fmt.SEGMENT_HEADER_SIZE)
        self._scanner = Scanner(self._salt, self.position.offset)
        return True

    def _bad(self, at: Position, reason: str, file_size: int) -> None:
        """Classify a bad frame at ``at``: record a torn tail, or raise corruption.

        For a ``live`` reader (a queue runner, the outcome reader) the ``limit`` of each
        ``next`` call is the writer's durable end, so a bad frame before it is corruption
        too: never a tail to stop at quietly.
        """
        durable = self._durable_end
        if self._live and self._limit is not None:
            durable = self._limit if durable is None else max(durable, self._limit)
        newest = self._newest
        if (durable is None or at >= durable) and (newest is None or at.segment >= newest):
            if at.offset < fmt.SEGMENT_HEADER_SIZE:
                torn = self._header_blank(file_size)
            else:
                torn = self._looks_torn(at.offset, file_size)
            if torn:
                self.torn = TornTail(at, file_size, reason)
                # The tail may be zeros written ahead or a batch still being written
                # (writer invariants W6, W1): a later read must see what is there then.
                self._scanner.forget_from(at.offset)
                raise _Stop
            reason += (
                "; valid frames follow it, or every sector of the frame is on disk, "
                "so this is damage, not a torn write"
            )
        raise CorruptSpool(self.path(at.segment), at.offset, reason)

    def _header_blank(self, file_size: int) -> bool:
        """Whether a bad header is a segment created but never written: its first sector
        all zeros (sectors are written whole, fault model 5). A header sector that holds
        anything else was written, so its bad check is damage, not a tear."""
        assert self._fd is not None
        return header_blank(self._fs.pread(self._fd, min(fmt.SECTOR, file_size), 0))

    def _looks_torn(self, offset: int, file_size: int) -> bool:
        """``looks_torn`` for the open segment (``offset`` inside it)."""
        assert self._fd is not None
        first = offset - offset % fmt.SECTOR
        data = self._fs.pread(self._fd, file_size - first, first)
        if isinstance(parse_frame(data, offset - first, self._salt), Frame):
            # Whole now: the bytes parsed were read while a running owner wrote the frame
            # (over zeros written ahead, W6, the file already reaches past it). No damage:
            # this reader stops here, as at a tail still being written. (Nobody writes
            # beside recovery, which therefore never sees this.)
            return True
        if self._beside_owner:
            time.sleep(REREAD_AFTER)
            if self._fs.pread(self._fd, len(data), first) != data:
                return True  # still being written: the same
        return looks_torn(data, first, offset, self._salt)

    def _read_more(self, need: int, end_in_file: int) -> None:
        """Feed the scanner at least ``need`` more bytes of the open segment (fewer only
        at the end of the file), in chunks of ``chunk_size``, never past ``end_in_file``.

        Bytes past the end the cursor may read (the writer's durable end, for a runner)
        are never buffered: they may be zeros written ahead (writer invariant W6), or a
        batch being written, that the next batch or the rest of the write replaces; the
        cursor reads them when its limit reaches them."""
        assert self._fd is not None
        start = self._scanner.end
        size = min(max(self._chunk, need), end_in_file - start)
        data = self._fs.pread(self._fd, size, start) if size > 0 else b""
        self._scanner.feed(data)
        self.bytes_read += len(data)

    def segment_frames(self, stop: int) -> Generator[tuple[int, int, bytes], None, None]:
        """(offset, type, payload) of the record frames of the cursor's segment from its
        position to byte ``stop``, as ``next`` reads them (BODY and PAD frames are stepped
        over), for a reader of whole segments' records (the analytics).

        The bytes are read at once and their whole, checked frames taken in one loop
        (``framing.whole_frames``); from the first frame that is not, ``next`` reads on
        through the same descriptor and decides, as everywhere, whether that is a torn
        tail (the end, quietly) or damage (``CorruptSpool``). The position moves once the
        whole frames are taken: to the end of the last of them (a caller that stops before
        leaves it where it was)."""
        segment = self.position.segment
        limit = self._limit = Position(segment, stop)
        if self.position >= limit:
            return
        if self._fd is None or self._fd_segment != segment:
            try:
                if not self._open(segment):
                    return
            except _Stop:
                return  # a header never written: a torn tail
        assert self._fd is not None
        start = self.position.offset
        end_in_file = min(stop, self._fs.size(self._fd))
        if start < end_in_file:
            data = self._fs.pread(self._fd, end_in_file - start, start)
            self.bytes_read += len(data)
            taken = yield from whole_frames(
                data, 0, self._salt, base=start, skip_bodies=self._skip_bodies
            )
            # ``next`` goes on from the first frame that is not whole (not from the last
            # record: its verdict, and the reason it gives, must be the reader's own).
            self.position = Position(segment, taken)
        while (item := self.next(limit)) is not None:
            pos, frame = item
            if isinstance(frame, Frame) and frame.type not in (fmt.T_BODY, fmt.T_PAD):
                yield pos.offset, frame.type, frame.payload

    def next(self, limit: Position | None = None) -> tuple[Position, Frame | SkippedBody] | None:
        """The next frame and its position, or None at ``limit`` / end of the log.

        Sets ``torn`` (and returns None) when the log ends in a torn tail.
        """
        self._limit = limit
        try:
            return self._next(limit)
        except _Stop:
            return None

    def _next(self, limit: Position | None) -> tuple[Position, Frame | SkippedBody] | None:
        while True:
            pos = self.position
            if limit is not None and pos >= limit:
                if self._fd is not None and self._fd_segment != pos.segment:
                    # Moved past the segment it holds without reading on (a queue runner
                    # with nothing of its class pending skips to the head): let go of it
                    # now, since a deleted segment held open keeps its space until then.
                    self.close()
                return None
            if self._fd is None or self._fd_segment != pos.segment:
                if not self._open(pos.segment):
                    return None
                continue  # the position may have moved past the header
            assert self._fd is not None
            if limit is not None and limit.segment == pos.segment and self._size >= limit.offset:
                # The file was already seen to reach the limit (a durable end): no need to
                # ask again for every frame a runner reads.
                end_in_file = limit.offset
            elif limit is not None and limit.segment > pos.segment and self._size_whole:
                # Its size was taken once the durable end had moved past it: the writer
                # starts a segment only after the one before is whole (W3), so it no
                # longer grows (a runner trailing its retry interval reads such segments).
                end_in_file = self._size
            else:
                self._size = end_in_file = self._fs.size(self._fd)
                self._size_whole = limit is not None and limit.segment > pos.segment
                if limit is not None and limit.segment == pos.segment:
                    end_in_file = min(end_in_file, limit.offset)
            if pos.offset >= end_in_file:
                if limit is not None and limit.segment == pos.segment:
                    return None
                # End of this segment: the next one must exist, unless this is the last.
                nxt = Position(pos.segment + 1, 0)
                if not self._fs.exists(self.path(nxt.segment)):
                    return None
                self.position = nxt
                continue
            scanner = self._scanner
            if scanner.position != pos.offset:
                scanner.seek(pos.offset)  # a caller moved the cursor, or a frame was refused
            if self._skip_bodies:
                head = scanner.peek()
                if head is NEED_DATA:
                    self._read_more(fmt.FRAME_HEADER_SIZE, end_in_file)
                    head = scanner.peek()
                if isinstance(head, tuple) and head[0] == fmt.T_BODY:
                    if pos.offset + head[1] > end_in_file:
                        self._bad(pos, "truncated body frame", end_in_file)
                    scanner.seek(pos.offset + head[1])
                    self.position = Position(pos.segment, pos.offset + head[1])
                    return pos, SkippedBody(head[1])
            result = scanner.next()
            while result is NEED_DATA:
                # The scanner holds less than the frame: read on, unless the file (or the
                # limit) ends inside it. Two rounds at most: the header, then the rest.
                available = end_in_file - pos.offset
                head = scanner.peek()
                need = head[1] if isinstance(head, tuple) else fmt.FRAME_HEADER_SIZE
                if need > available:
                    self._bad(pos, f"truncated frame ({available} of {need} bytes)", end_in_file)
                before = scanner.end
                self._read_more(pos.offset + need - before, end_in_file)
                if scanner.end == before:
                    raise AssertionError(f"{self.path(pos.segment)} read nothing at {before}")
                result = scanner.next()
            if isinstance(result, BadFrame):
                self._bad(pos, result.reason, end_in_file)
            assert isinstance(result, Frame)
            if pos.offset + result.size > end_in_file:
                self._bad(pos, "frame runs past the durable end", end_in_file)
            self.position = Position(pos.segment, pos.offset + result.size)
            return pos, result

    def __iter__(self) -> Iterator[tuple[Position, Frame | SkippedBody]]:
        while (item := self.next()) is not None:
            yield item


# What an open of something else than a regular file under a segment's name fails with:
# a socket (ENXIO), a looping link (ELOOP), a device without a driver (ENODEV).
_NOT_A_FILE: Final = frozenset({errno.ENXIO, errno.ELOOP, errno.ENODEV})


def open_segment(fs: FileSystem, path: str) -> int:
    """A read-only descriptor of the segment file ``path``; ``FileNotFoundError`` if there
    is none, ``CorruptSpool`` if what is there is no regular file (a directory, a FIFO, a
    socket, a looping link: ``spool check`` names it, the repair moves it aside), and
    ``SegmentUnreadable`` if it cannot be opened for another reason (its permissions, an
    I/O error: not damage, so nothing may set it aside)."""
    try:
        fd = fs.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in _NOT_A_FILE:
            raise CorruptSpool(path, 0, f"not a segment file ({exc.strerror})") from None
        # EACCES (another user's file, a mode of 000), EIO, EMFILE: nothing says its bytes
        # are damaged, so nothing may set it aside.
        raise SegmentUnreadable.from_os_error(path, exc) from None
    if not fs.is_file(fd):
        fs.close(fd)
        raise CorruptSpool(path, 0, "not a segment file (not a regular file)")
    return fd


class _Stop(Exception):
    """Internal: the cursor hit a torn tail."""


def read_frame_at(fs: FileSystem, log_dir: str, at: Position, size_hint: int = 0) -> Frame:
    """Read and check the single frame at ``at`` (envelopes for attempts, bodies), opening
    its segment for this read alone (an open spool keeps its descriptors open instead:
    ``segment_files.py``). ``size_hint``: as ``frame_in``."""
    path = os.path.join(log_dir, fmt.segment_name(at.segment))
    fd, salt = open_segment_checked(fs, path, at.segment)
    try:
        return frame_in(fs, fd, path, at.offset, salt, size_hint)
    finally:
        fs.close(fd)


def open_segment_checked(fs: FileSystem, path: str, segment: int) -> tuple[int, int]:
    """A read-only descriptor of segment ``segment`` at ``path`` whose header checks, and
    its frames' salt. ``CorruptSpool`` if the file is missing or its header is bad (and
    as ``open_segment``)."""
    try:
        fd = open_segment(fs, path)
    except FileNotFoundError:
        raise CorruptSpool(path, 0, "segment file is missing") from None
    try:
        header = fs.pread(fd, fmt.SEGMENT_HEADER_SIZE, 0)
        problem = check_segment_header(header, segment, path)
        if problem is not None:
            raise CorruptSpool(path, 0, problem)
    except BaseException:
        fs.close(fd)
        raise
    return fd, segment_salt(header)


def frame_in(
    fs: FileSystem, fd: int, path: str, offset: int, salt: int, size_hint: int = 0
) -> Frame:
    """The checked frame at ``offset`` of the segment open as ``fd`` (named ``path`` in
    errors): ``CorruptSpool`` if there is none whole and sound. Read with one ``pread``
    when ``size_hint`` (the frame's size, when the caller knows it: a body's) covers it;
    else its header first, then the rest (no byte past the frame is read)."""
    longest = fmt.FRAME_HEADER_SIZE + fmt.FRAME_PAYLOAD_MAX
    first = max(fmt.FRAME_HEADER_SIZE, min(size_hint, longest))
    data = fs.pread(fd, first, offset)
    peek = peek_header(data, 0)
    if not isinstance(peek, tuple):
        raise CorruptSpool(path, offset, "no frame header here")
    if peek[1] > len(data) and len(data) == first:
        data += fs.pread(fd, peek[1] - len(data), offset + len(data))
    result = parse_frame(data[: peek[1]], 0, salt)
    if not isinstance(result, Frame):
        reason = result.reason if isinstance(result, BadFrame) else "truncated frame"
        raise CorruptSpool(path, offset, reason)
    return result
