"""Damage in the log: finding it, reading past it, and what it means for each message.

Recovery and every reader stop at the first frame they read that fails its check before
the durable end (``CorruptSpool``): nothing read is ever passed over silently. A running
spool does not read every frame, though: a queue runner reads only its class's envelopes
and steps over the rest by position (docs/design.md, "Busy classes jump between their
envelopes"), and over BODY frames by their header. Damage in a frame nobody has read is
found when something reads it (recovery, if it lies in the working suffix; ``spool
check``; a listing), and matters to nothing once its segment is retired. This module is
for the operator's tools (``spool check``, ``spool check --repair``), which must say
exactly what is damaged and set only that aside, keeping every intact frame.

Reading past damage (``scan_segment``). Frames are self-delimiting, so after a bad frame
at offset *o* the reader looks for the next offset where a valid frame starts:

* if the bad frame is the BODY frame right after a valid first envelope, its extent is
  known from the envelope (``body.n``), whatever its own damaged header says, and the
  search starts at its end; so a damaged body never costs the frames after it;
* otherwise every offset after the bad frame's header is a candidate.

Message data cannot fool this search: a frame is valid only if its CRC, which starts from
the salt in its segment's header (32 random bits, docs/format.md "Salts"), matches. Bytes
inside a body that imitate a frame were written by someone who never saw that salt, so
they pass with probability 2^-32, the same as random damage; a valid frame found by the
search is, to that probability, one the writer wrote.

What a damaged region held (``Region``): the body of one message (known from the
envelope before it), padding (a PAD frame's header survived and its payload is zeros, or
the region is too small for any record), or unknown records.

What it means for mail (``assess``). Walking the whole live log in order, a message is:

* *body lost*: its live envelope names an inline body inside a damaged region (or a body
  file that is missing or damaged): it can never be delivered; repair fails its pending
  recipients, so a bounce says so;
* *records possibly lost*: it was live or in flight where unknown records were lost (its
  start or a delta may have been among them), and no later envelope, start or finish of
  it re-established its state: attempting it again could deliver twice, so repair holds
  it for the operator;
* *envelope lost*: a later record names an envelope inside a damaged region; recovery
  finishes such a message with the outcomes that survived (decision R5), and a lone body
  whose envelope was lost is named, its bytes kept in the copy in ``corrupt/``.

Everything else is intact and stays exactly as it was.

Errors:
    None raised here: damage is data, reported by the callers (``check.py``).
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Container, Iterable, Iterator

import attrs
import cbor2
from crc32c import crc32c

from spool import format as fmt
from spool import records as rec
from spool.framing import (
    NEED_DATA,
    Frame,
    encode_frame,
    frame_crc,
    one_bit_fixed,
    pad_frame,
    parse_frame,
)
from spool.reader import first_valid_frame, looks_torn, written_bytes
from spool.records import Position
from spool.segment_header import check_segment_header, header_blank, segment_salt

# The smallest frame any record can be (a START record: id, a position, a class and a
# float time: 45 bytes of CBOR and a 9-byte header). A damaged region smaller than this
# held only padding.
RECORD_FRAME_MIN = 54


class RegionKind(enum.Enum):
    BODY = "body"  # exactly one message's BODY frame
    BODY_AND_RECORDS = "body and records"  # a BODY frame and unknown frames after it
    PADDING = "padding"  # nothing of value
    RECORDS = "records"  # unknown frames
    BODY_FILE = "body file"  # a message's body file in bodies/ (no bytes of a segment)


@attrs.frozen
class Region:
    """Damaged bytes ``[start, end)`` of a segment, or a marker a repair left in their place.

    ``body_of`` is the message whose BODY frame the region begins with (``body_bytes`` of
    it). ``lost`` names the kind of the one record the region held when that is known (the
    region is exactly one frame by its own header and its payload still decodes as that
    kind), ``lost_target`` that record's message. ``marker`` is True for a region already
    set aside (a ``damaged`` control record); ``copy`` then names the copy of the damaged
    segment in ``corrupt/``.
    """

    segment: int
    start: int
    end: int
    kind: RegionKind
    reason: str
    body_of: str = ""
    body_bytes: int = 0
    lost: str = ""
    lost_target: str = ""
    marker: bool = False
    copy: str = ""
    sup: tuple[Position, ...] = ()  # envelopes the lost bytes superseded (see assess)
    record: rec.Record | None = None  # the one lost record as it still decodes (unchecked)

    @property
    def records_lost(self) -> bool:
        return self.kind in (RegionKind.RECORDS, RegionKind.BODY_AND_RECORDS)

    def holds(self, at: Position) -> bool:
        return at.segment == self.segment and self.start <= at.offset < self.end

    def __str__(self) -> str:
        if self.kind is RegionKind.BODY_FILE:
            return self.reason  # the file's name: it has no place in a segment
        return f"{self.segment}:{self.start} ({self.end - self.start} bytes)"


@attrs.frozen
class SegmentScan:
    """One segment read past its damage: its valid frames and its damaged regions in
    order, and a torn tail if it ends in one (newest segment only)."""

    number: int
    salt: int | None
    header_problem: str | None
    items: tuple[tuple[int, Frame | Region], ...]
    torn_at: int | None
    torn_reason: str
    size: int
    # Frames with one flipped bit, set right: (offset, corrected frame, what it is). They
    # appear in ``items`` as the frames they were; a repair writes them back.
    corrections: tuple[tuple[int, bytes, str], ...] = ()
    # Of the torn tail, the bytes up to its last that is not zero: zeros after them are
    # space never written, or written ahead of the log (writer invariant W6).
    torn_written: int = 0

    @property
    def regions(self) -> list[Region]:
        return [item for _, item in self.items if isinstance(item, Region)]

    @property
    def extent(self) -> int:
        """Where the segment ends: its size, or past it where stand-ins for a lost end
        reach (``_lost_end_of``)."""
        return _extent(self.size, self.items)


def _extent(size: int, items: Iterable[tuple[int, Frame | Region]]) -> int:
    return max([size, *(r.end for _, r in items if isinstance(r, Region))])


def scan_segment(data: bytes, number: int, *, newest: bool, durable_end: int) -> SegmentScan:
    """Read segment ``number`` (its bytes ``data``) past any damage (module docstring).

    ``durable_end`` is the offset of this segment up to which the log is known durable (0
    when the restart positions vouch for none of it). Bad bytes in the newest segment at
    or after it that look like an interrupted last write are a torn tail, exactly as
    recovery decides (``reader.LogCursor``): the scan stops there.
    """
    problem = check_segment_header(data, number, "")
    if problem is not None and newest and durable_end == 0 and header_blank(data[: fmt.SECTOR]):
        written = written_bytes(data, 0)
        return SegmentScan(number, None, problem, (), 0, problem, len(data), (), written)
    salt = None if _names_another_segment(data, number) else _salt_of(data, problem, number)
    if salt is None:
        whole = Region(number, 0, len(data), RegionKind.RECORDS, f"segment header: {problem}")
        return SegmentScan(number, None, problem, ((0, whole),), None, "", len(data))
    items: list[tuple[int, Frame | Region]] = []
    if problem is not None:
        header = Region(number, 0, fmt.SEGMENT_HEADER_SIZE, RegionKind.PADDING, problem)
        items.append((0, header))
    pos = fmt.SEGMENT_HEADER_SIZE
    body_end: tuple[str, int] | None = None  # (msg id, end) of a BODY an envelope announced
    corrections: list[tuple[int, bytes, str]] = []
    cut_short = False  # the file ends inside its last frame, cut short (``_cut_in``)
    while pos < len(data):
        result = parse_frame(data, pos, salt)
        cut_short = False
        if isinstance(result, Frame):
            item: Frame | Region = _as_marker(result, number, pos) or result
            if body_end is not None:  # where the envelope before put its BODY frame
                item = _set_aside_body(item, result, number, pos, body_end)
            items.append((pos, item))
            body_end = _announced_body(result, pos)
            pos += result.size
            continue
        reason = getattr(result, "reason", "truncated frame")
        first = pos - pos % fmt.SECTOR
        if newest and pos >= durable_end and looks_torn(data[first:], first, pos, salt):
            written = written_bytes(data[pos:], pos)
            return SegmentScan(
                number,
                salt,
                problem,
                tuple(items),
                pos,
                reason,
                len(data),
                tuple(corrections),
                written,
            )
        vouched = body_end if body_end is not None and body_end[1] > pos else None
        pad_end = None
        if vouched is None:
            pad_end = _padding_end(data, pos, salt) or _burst_padding_end(data, pos, salt)
            if pad_end is None and pos == fmt.SEGMENT_HEADER_SIZE:
                pad_end = _padding_alone_in_shape(data, pos)  # whatever the salt
        if pad_end is not None:
            why = f"padding damaged ({reason})"
            items.append((pos, Region(number, pos, pad_end, RegionKind.PADDING, why)))
            body_end = None
            pos = pad_end
            continue
        fixed = _correct_in_place(data, pos, salt, vouched)
        if fixed is not None:
            frame, what = fixed
            corrections.append((pos, _frame_bytes(frame, salt), what))
            items.append((pos, frame))
            body_end = _announced_body(frame, pos)
            pos += frame.size
            continue
        end = _resync(data, pos, salt, vouched[1] if vouched else None)
        items.append((pos, _classify(data, number, pos, end, salt, vouched, reason)))
        cut_short = result is NEED_DATA and _cut_in(data, pos, vouched)
        body_end = None
        pos = end
    if not newest and (cut_short or body_end is not None):
        items += _lost_end_of(number, items, len(data), body_end)
    return SegmentScan(number, salt, problem, tuple(items), None, "", len(data), tuple(corrections))


def _cut_in(data: bytes, pos: int, vouched: tuple[str, int] | None) -> bool:
    """Whether the frame at ``pos``, which runs past the end of ``data``, was cut short by
    a shorter file rather than hit where its length is: its header says where it ends as
    only an intact one does. A PAD frame ends on a sector boundary within
    ``PAD_SIZE_MAX`` (a burst over its length ends it there one time in hundreds); a BODY
    frame where its envelope says; a record's is any length (a region of records lost
    already holds every message live there). A header itself cut: only a shorter file."""
    if pos + fmt.FRAME_HEADER_SIZE > len(data):
        return True
    length: int = fmt.FRAME_HEADER.unpack_from(data, pos)[1]
    ftype: int = data[pos + fmt.FRAME_HEADER_SIZE - 1]
    end = pos + fmt.FRAME_HEADER_SIZE + length
    if ftype == fmt.T_PAD:
        return end % fmt.SECTOR == 0 and end - pos <= PAD_SIZE_MAX
    if ftype == fmt.T_BODY:
        return vouched is None or vouched[1] == end
    return ftype in fmt.TYPE_NAMES


def _lost_end_of(
    number: int,
    items: list[tuple[int, Frame | Region]],
    size: int,
    body_end: tuple[str, int] | None,
) -> list[tuple[int, Frame | Region]]:
    """Stand-ins for the lost end of a segment before the newest that ends inside a frame,
    or right after a first envelope (the writer appends its BODY frame with it): the file
    was cut short, and records after the cut may have been lost with it. The BODY frame
    announced, if any, then records of unknown kind (``RECORD_FRAME_MIN`` bytes: how many
    is unknown; a later record naming a place further on widens them,
    ``Assessment._lost_end``). The repair's markers make the file grow to cover them.
    A cut at a batch's start leaves no trace: nothing in the format says how long a
    segment was."""
    start = _extent(size, items)
    lost: list[tuple[int, Frame | Region]] = []
    if body_end is not None:
        msg_id, end = body_end
        why = "body lost with the segment's end"
        length = end - start
        body = Region(number, start, end, RegionKind.BODY, why, body_of=msg_id, body_bytes=length)
        lost.append((start, body))
        start = end
    why = "the segment's end is lost (the file was cut short)"
    lost.append((start, Region(number, start, start + RECORD_FRAME_MIN, RegionKind.RECORDS, why)))
    return lost


def _names_another_segment(data: bytes, number: int) -> bool:
    """Whether ``data`` begins with an intact segment header of another number: a copy
    of another segment (or a file renamed), whose frames, valid as they are, are that
    segment's records, not this one's. No damage makes an intact header name another
    number (its checksum covers the number)."""
    if len(data) < fmt.SEGMENT_HEADER_SIZE:
        return False
    magic, _version, _size, seg, _salt, crc = fmt.SEGMENT_HEADER.unpack_from(data)
    intact = crc32c(data[: fmt.SEGMENT_HEADER_SIZE - 4]) == crc and magic == fmt.SEGMENT_MAGIC
    return bool(intact and seg != number)


def _padding_end(data: bytes, pos: int, salt: int) -> int | None:
    """Where a damaged PAD frame at ``pos`` ends, if it is one: its header reads as a PAD
    and its length holds, by one flipped bit put right or by a payload still all but zero.
    Then the frames after it are judged on their own."""
    if pos + fmt.FRAME_HEADER_SIZE > len(data):
        return None
    _crc, length, _ftype = fmt.FRAME_HEADER.unpack_from(data, pos)
    end = pos + fmt.FRAME_HEADER_SIZE + length
    if length > fmt.FRAME_PAYLOAD_MAX or end > len(data):
        return None
    aligned = end % fmt.SECTOR == 0  # a PAD ends its batch on a sector boundary
    if end < len(data) and not aligned and not isinstance(parse_frame(data, end, salt), Frame):
        return None  # the length itself may be the damage: let the search find the end
    corrected = one_bit_fixed(data[pos:end], salt)
    if corrected is not None and isinstance(parse_frame(corrected, 0, salt), Frame):
        return end if corrected[8] == fmt.T_PAD else None
    return end if _was_padding(data[pos:end]) else None


# The payload bytes a PAD frame must have for ``_burst_padding_end`` to take it as padding
# but for two runs: a record's first 16 payload bytes (a CBOR map's head, its keys and
# the start of its id) are a dozen non-zero bytes, more than a run can cover.
TWO_BURSTS_ZEROS_MIN = 16


def _burst_padding_end(data: bytes, pos: int, salt: int) -> int | None:
    """Where a PAD frame at ``pos`` ends whose header a burst hit (its length no longer
    says): the sector boundary a PAD frame there would end at, if the bytes up to it are
    that frame but for the burst, or for two (``_padding_but_for_a_burst``,
    ``_padding_but_for_two_bursts``: the tests ``_classify`` takes padding by). The frames
    after it are then judged on their own: a torn last batch after a damaged PAD is a torn
    tail, not records lost with the padding (the search for the next valid frame would run
    through the tear into that batch's later sectors, and the repair held the mail there:
    tests/crash/test_found_repair_states.py)."""
    end = pos - pos % fmt.SECTOR + fmt.SECTOR
    if end - pos < fmt.FRAME_HEADER_SIZE:
        end += fmt.SECTOR  # a widened PAD frame (``framing.padding_for``)
    if end > len(data):
        return None
    raw = data[pos:end]
    # Two runs need zeros to vouch for them: over a frame of a few bytes' payload (a
    # record's header the last bytes of a sector, its type hit), one run over the CRC
    # and one over the length and type would pass with nothing else to compare.
    if _padding_but_for_a_burst(raw, salt):
        return end
    if len(raw) - fmt.FRAME_HEADER_SIZE >= TWO_BURSTS_ZEROS_MIN and _padding_but_for_two_bursts(
        raw, salt
    ):
        return end
    return None


def _correct_in_place(
    data: bytes, pos: int, salt: int, vouched: tuple[str, int] | None
) -> tuple[Frame, str] | None:
    """The frame at ``pos`` (which fails its check) set right, if one flipped bit explains
    the failure, with what it is; None otherwise.

    Its extent is taken from its envelope (a BODY frame after its first envelope), or from
    its own length field (the flip elsewhere), or, failing both, from where the next valid
    frame starts (the flip in the length). CRC-32C has a Hamming distance of 4 for frames
    of any size used here, so damage of two bits in one frame is never taken for one:
    only three or more could be "corrected" wrongly.
    """
    ends = []
    if vouched is not None:
        ends.append(vouched[1])
    if pos + fmt.FRAME_HEADER_SIZE <= len(data):
        length = fmt.FRAME_HEADER.unpack_from(data, pos)[1]
        ends.append(pos + fmt.FRAME_HEADER_SIZE + length)
    ends.append(_resync(data, pos, salt, None))
    for end in dict.fromkeys(e for e in ends if e <= len(data)):
        fixed = _correct_frame(data[pos:end], salt, vouched[0] if vouched else None)
        if fixed is not None:
            return fixed
    return None


def _correct_frame(raw: bytes, salt: int, body_of: str | None) -> tuple[Frame, str] | None:
    """The frame ``raw`` was, if one flipped bit explains its failed check and the result
    spans ``raw`` exactly and reads as what belongs there: a record that decodes, or the
    BODY frame of ``body_of`` (the message whose first envelope precedes it). Padding is
    never taken (it holds nothing: a damaged PAD is set aside as padding)."""
    corrected = one_bit_fixed(raw, salt)
    if corrected is None:
        return None
    frame = parse_frame(corrected, 0, salt)
    if not isinstance(frame, Frame) or frame.size != len(raw) or frame.type == fmt.T_PAD:
        return None
    if frame.type == fmt.T_BODY:
        owner = frame.payload[: fmt.MSG_ID_LENGTH].decode("ascii", "replace")
        if owner != body_of:
            return None
        return frame, f"one flipped bit in the body of {owner}"
    if body_of is not None:
        return None  # a first envelope's body must follow it
    try:
        record = rec.decode(frame.type, frame.payload)
    except rec.RecordError:
        return None
    target = record.target if isinstance(record, rec.Control) else record.msg_id
    return frame, f"one flipped bit in the {fmt.TYPE_NAMES[frame.type]} record of {target}"


def _frame_bytes(frame: Frame, salt: int) -> bytes:
    return encode_frame(frame.type, frame.payload, salt)


def _salt_of(data: bytes, problem: str | None, number: int) -> int | None:
    """The segment's salt: from a good header; from a damaged one, the salt its frames
    check with (module docstring: ``recover_salt``); None if none does."""
    if problem is None:
        return segment_salt(data)
    if len(data) < fmt.SEGMENT_HEADER_SIZE + fmt.FRAME_HEADER_SIZE:
        return None
    return recover_salt(data, number)


# How many bits of a damaged salt field may differ from the salt the first frame gives.
SALT_BITS_MAX = 4


def recover_salt(data: bytes, number: int | None = None) -> int | None:
    """The salt of a segment whose header is damaged, or None (docs/format.md, "The salt
    is found among", says the same rules for a reader of the format).

    Candidates: the salt field as it reads (the damage hit another field), the one value
    of that field that makes the header's CRC match (the damage hit the salt), the same
    over the header's public part put right (magic, version, size, and ``number``, the
    file name's), the one salt that makes the first frame's CRC match (both were hit),
    and 0 (a version-1 header). A CRC is affine in its starting value and in its last
    four bytes, so each solution is found by elimination over GF(2) (``_solve``). The
    rules, in order:

    0. The public part put right makes the header consistent: the field's salt.
    1. The first frame checks with a candidate and the frame after it confirms it
       (``_frame_after_confirms``); or it is the salt field as it reads; or, a lone
       first frame, its own salt is within ``SALT_BITS_MAX`` bits of the field.
    2. The first frame put right checks with a candidate, and so does the frame where it
       then ends (``_put_right_and_followed``): no sender can make the
       spool's first frame check with a salt of his.
    3. The two frames where the first frame's length field says it ends (or the two
       after a hit second frame) check with a candidate whose field is not of low
       entropy (``_guessable``): a sender could bet on such damage and put frames where a
       hit length points. Never salt 0.
    4. Neither field right: the salt solved where the first frame ends, put right, or at
       the sector boundary after a first frame that is padding in shape
       (``_salt_after_a_damaged_first_frame``).
    5. A header one flipped bit from consistent: its salt (a secret), if two frames in a
       row at a sector boundary check with it. Last: a burst can leave a header so with a
       wrong salt, and every frame rule above outvotes it.
    6. No frame checks: a segment that is its padding alone (but for a burst that spared
       its salted CRC, or in all but its CRC and a few bits or one burst) keeps the salt
       its header or padding gives; it holds nothing any salt could make a record of.

    No frame found elsewhere confirms a salt: message data may hold frames made with any
    salt its author chose, at any place, sector boundaries included.
    """
    first = fmt.SEGMENT_HEADER_SIZE
    head = data[: fmt.SEGMENT_HEADER_SIZE]
    raw = fmt.SEGMENT_HEADER.unpack_from(head)[4]
    stored_crc = fmt.SEGMENT_HEADER.unpack_from(head)[5]
    candidates = [int(raw)]
    by_header = _solve(lambda x: crc32c(head[:24] + x.to_bytes(4, "little")), stored_crc)
    if by_header is not None:
        candidates.append(by_header)
    by_public = _salt_of_the_public_header(head, number)
    if by_public == raw:
        # Only the public part was hit: put right, the header is consistent, and both the
        # salt field and the CRC field read as written (one of them hit would need the
        # other hit to match it exactly).
        return by_public
    if by_public not in (None, by_header):
        candidates.append(by_public)
    crc, length, _ftype = fmt.FRAME_HEADER.unpack_from(data, first)
    covered = data[first + 4 : first + fmt.FRAME_HEADER_SIZE + length]
    by_frame = _solve(lambda x: crc32c(covered, x), crc)
    if by_frame is not None:
        candidates.append(by_frame)
    version = fmt.SEGMENT_HEADER.unpack_from(head)[1]
    zero = [0] if version == 1 else []  # version 1's salt; the field of a burst, else
    candidates += zero
    for salt in candidates:
        frame = parse_frame(data, first, salt)
        if not isinstance(frame, Frame):
            continue
        after = first + frame.size
        # A salt the first frame's own CRC gives is no secret when that CRC reads as low
        # entropy and the frame is padding (zeros and a length anyone can know).
        secret = salt != by_frame or not _guessable(data[first : first + 4])
        # Every candidate but the field as it reads is solved from a CRC, and a CRC is
        # affine in its start: a salt solved from a header CRC field off by e checks with
        # any frame whose bytes 8 to 11 are off by e, and makes the frame after look one
        # bit off. One flipped bit in each place does it, so such a salt needs a frame
        # after the first that checks as it is.
        solved = salt != raw
        if after < len(data) and _frame_after_confirms(data, after, salt, secret, solved):
            return salt  # two frames check with it (the second, perhaps, put right)
        if salt == raw:
            return salt  # the salt field vouches for it (its bit flipped would move the
            # first frame's length, where that frame ends: no bit of it can make up for one)
        # A lone frame (nothing after it) checks with the salt solved from its own CRC
        # whatever it holds: that alone confirms nothing (below: the field must be near).
    if (
        by_frame is not None
        and bin(by_frame ^ raw).count("1") <= SALT_BITS_MAX
        and isinstance(parse_frame(data, first, by_frame), Frame)
    ):
        # A lone first frame (a fresh segment's padding, with nothing durable after it)
        # checks with some salt whatever it is; that salt within a few bits of the salt
        # field is the field's, damaged (a random salt is that near once in 10^5).
        return by_frame
    for maybe in (int(raw), by_header, by_public, *zero):
        # The first frame is damaged too, by one flipped bit (its length's or type's
        # included) or, the open's padding, in its length: put right, it checks with the
        # salt, and so does the frame where it then ends (the spool's, not a body's).
        if maybe is not None and _put_right_and_followed(data, first, maybe):
            return maybe
    from_fields = ((int(raw), head[24:28]), (by_header, head[28:32]), (by_public, head[28:32]))
    for maybe, field in from_fields:
        # The first frame is damaged beyond that: the two frames where its length field
        # says it ends confirm the field's salt or the header CRC's, if that salt is a
        # secret. A sender could guess the salt a field of low entropy gives (damage of a
        # kind anyone can predict, over all of it or part) and put frames made with it in
        # a message body, where the first frame's length, hit too, may point. Never a
        # frame found by searching (a body may hold frames made with any salt at any
        # place), and never salt 0: anyone knows it.
        if (
            maybe is not None
            and not _guessable(field)
            and (
                _second_and_third_check(data, first, maybe)
                or _two_frames_after_the_second(data, first, maybe)
            )
        ):
            return maybe
    chained = _salt_after_a_damaged_first_frame(data, first)
    if chained is not None:
        return chained
    fixed = _header_one_bit_fixed(head)
    if fixed is not None and _two_frames_at_a_boundary(data, first, segment_salt(fixed)):
        # The header one flipped bit from consistent, and the first frame too damaged to
        # say anything: that salt is a secret (a bit of the salt field, the CRC field or
        # the rest put right), so two frames in a row at a sector boundary that check with
        # it are the spool's, not a sender's. Last: a burst can leave a header one bit from
        # consistent with a wrong salt, and then the frames above outvote it.
        return segment_salt(fixed)
    for maybe in (int(raw), by_header):
        # Nothing checks: a fresh segment's padding alone, hit as well. Padding but for a
        # burst that spares its CRC, which is salted, confirms the salt.
        if maybe is not None and _padding_alone_but_for_a_burst(data, first, maybe):
            return maybe
    end = _padding_alone_in_shape(data, first)
    if end is not None:
        # Padding alone but for a few bits, its CRC and the header: no byte of the segment
        # can be a record, so no salt can make a message of it, and the repair rewrites
        # the header (and the padding, unless it checks) with the salt chosen here. The
        # salt the padding's CRC gives for the PAD frame it should be (its length to
        # ``end``, its payload zeros), if that is the frame as it reads; else the salt of
        # the header put right by one flipped bit (the field, or the value its CRC solves
        # for); else that PAD's salt again (its length or payload hit, its CRC intact);
        # else the field as it reads.
        size = end - first - fmt.FRAME_HEADER_SIZE
        shape = encode_frame(fmt.T_PAD, bytes(size), 0)
        stored = int.from_bytes(data[first : first + 4], "little")
        by_pad = _solve(functools.partial(crc32c, shape[4:]), stored)
        if by_pad is not None and data[first:end] == encode_frame(fmt.T_PAD, bytes(size), by_pad):
            return by_pad
        fixed = _header_one_bit_fixed(head)
        if fixed is not None:
            return segment_salt(fixed)
        return by_pad if by_pad is not None else int(raw)
    return None


def _guessable(field: bytes) -> bool:
    """A header field that reads as a value of low entropy, over all of it or part: a
    byte 0x00 or 0xFF, or two of its bytes alike (a burst of zeros, ones or one repeated
    byte over two to four of its bytes, the rest intact), or at most 4 bits set or unset.
    That is what damage typically leaves, and a sender can bet on it and on the few secret
    bits left (8 of them after a burst of three), so neither the field nor the salt solved
    from it (the rest of the header is public) is a secret. A random salt is such a value
    about once in 18; then other rules decide. What is left to a forger: a burst of one
    byte (24 secret bits), or of two or more distinct bytes whose values he foresaw."""
    bits = int.from_bytes(field, "little").bit_count()
    return (
        any(byte in (0x00, 0xFF) for byte in field)
        or len(set(field)) < len(field)
        or not 4 < bits < 28
    )


def _boundary_at_or_after(offset: int) -> int:
    """The first sector boundary at ``offset`` or after it."""
    return offset + -offset % fmt.SECTOR


def _salt_of_the_public_header(head: bytes, number: int | None) -> int | None:
    """The salt that makes the header's CRC field match once its public part is put
    right: the magic, the size, the current version (salts are version 2's; version 1's
    is 0) and the segment's number (from its file name). A burst over the number and the
    salt field leaves the CRC field intact, and this gives the salt it was computed over.
    None without the number, or if the public part reads right already (``by_header``
    is it)."""
    if number is None:
        return None
    public = fmt.SEGMENT_HEADER.pack(
        fmt.SEGMENT_MAGIC, fmt.FORMAT_VERSION, fmt.SEGMENT_HEADER_SIZE, number, 0, 0
    )[:24]
    if public == head[:24]:
        return None
    crc = fmt.SEGMENT_HEADER.unpack_from(head)[5]
    return _solve(lambda x: crc32c(public + x.to_bytes(4, "little")), crc)


def _end_by_length(data: bytes, first: int) -> int | None:
    """Where the frame at ``first`` ends by its length field, whatever its type byte
    reads; None if the length is more than any frame's."""
    length = fmt.FRAME_HEADER.unpack_from(data, first)[1]
    return first + fmt.FRAME_HEADER_SIZE + length if length <= fmt.FRAME_PAYLOAD_MAX else None


# How many times a segment's size ``_two_frames_at_a_boundary`` may checksum in all.
SCAN_WORK = 4


def _two_frames_at_a_boundary(data: bytes, first: int, salt: int) -> bool:
    """Whether, at some sector boundary after ``first``, a frame and the one after it
    check with ``salt``: the start of a batch the spool wrote, if the salt is a secret
    (two frames at random check with a wrong salt once in 2^64 for each boundary). The
    work is bounded (``SCAN_WORK``, bytes checked in all): bytes that claim long frames
    at every boundary give up the search, not minutes of it."""
    budget = SCAN_WORK * max(len(data), fmt.SECTOR)
    for at in range(_boundary_at_or_after(first + 1), len(data), fmt.SECTOR):
        if at + fmt.FRAME_HEADER_SIZE > len(data):
            break
        length = fmt.FRAME_HEADER.unpack_from(data, at)[1]
        budget -= min(length, len(data))
        if budget < 0:
            return False
        if _two_frames_check(data, at, salt):
            return True
    return False


def _two_frames_after_the_second(data: bytes, first: int, salt: int) -> bool:
    """Whether, the second frame (where the first one's length field says it ends) being
    hit too, the two frames after it by its length field check with ``salt``: two, since
    a salt solved from a damaged header CRC field checks with any one frame damaged to
    match (a CRC is affine in its start)."""
    second = _end_by_length(data, first)
    if second is None or second + fmt.FRAME_HEADER_SIZE > len(data):
        return False
    third = _end_by_length(data, second)
    return third is not None and third < len(data) and _two_frames_check(data, third, salt)


def _second_and_third_check(data: bytes, first: int, salt: int) -> bool:
    """Whether the frame where the first one ends (by its length field) and the frame
    after it both check with ``salt``: frames the spool wrote, never message data."""
    second = _end_by_length(data, first)
    return second is not None and second < len(data) and _two_frames_check(data, second, salt)


def _salt_after_a_damaged_first_frame(data: bytes, first: int) -> int | None:
    """The salt when the header and the first frame were both hit, from the frame where
    the first one ends: the spool wrote that frame (no message data can stand there), so
    the salt solved from its CRC is the segment's if the first frame confirms it.

    Where the first frame ends: by its length field put right (``_ends_put_right``), and
    then the frame after the second must check with the salt and the first frame check
    with it too (``_checks_ending_at``). Or, when the first frame is the padding an open's
    checkpoint begins a segment with, whatever its CRC, length and type read
    (``_padding_shaped_end``), at the sector boundary where the spool began its next
    batch; and then the PAD's own CRC must be the one that salt gives, or the frame after
    the second check with it. A frame found anywhere else could be message data made with
    a salt of its author's choosing; these could be only if the first frame's length put
    right pointed into a message body and the first frame then checked with the author's
    salt (about 2^-32 for each end and each bit tried), or a record were within a few
    bits or one burst of padding (its id alone is dozens of bits from it).
    """
    ends = _ends_put_right(data, first)
    for second in ends:
        salt = _salt_of_frame_at(data, second)
        if (
            salt is not None
            and _two_frames_check(data, second, salt)
            and _checks_ending_at(data, first, second, salt)
        ):
            return salt
    end = _padding_shaped_end(data, first)
    salt = _salt_of_frame_at(data, end) if end is not None else None
    if end is None or salt is None:
        return None
    if pad_frame(end - first, salt)[:4] == data[first : first + 4]:
        return salt  # the padding's own CRC (salted) confirms it
    return salt if _two_frames_check(data, end, salt) else None


def _frame_after_confirms(data: bytes, at: int, salt: int, secret: bool, solved: bool) -> bool:
    """Whether the frame at ``at``, after a first frame that checks with ``salt``, confirms
    it: it checks with it; or it does once put right (one flipped bit, its length's
    included: ``_ends_put_right``, ``_checks_ending_at``) and, if the salt was
    ``solved`` from the first frame's own CRC, the frame where it then ends checks too;
    or, the salt being a ``secret``, the frame after it by its length field checks (the
    second frame hit beyond one bit).

    Why the frame after, for a solved salt: a CRC is affine in its starting value, and a
    salt off by *d* changes a frame's CRC as a flipped bit would at a place that depends
    on *d* and the frame's length. So the salt solved from a first frame with one bit
    flipped makes the next frame look one bit off, wherever that bit is: a third frame,
    which a wrong salt would have to match exactly, tells the two apart. Otherwise a salt
    wrong for the segment has each of these about once in 2^32 for each bit and end
    tried, and the spool's first frame checks with a salt a sender chose only if it were
    damaged exactly so."""
    if isinstance(parse_frame(data, at, salt), Frame):
        return True
    if solved:
        if _put_right_and_followed(data, at, salt):
            return True
    elif any(_checks_ending_at(data, at, end, salt) for end in _ends_put_right(data, at)):
        return True
    following = (
        _end_by_length(data, at) if secret and at + fmt.FRAME_HEADER_SIZE <= len(data) else None
    )
    return (
        following is not None
        and following < len(data)
        and isinstance(parse_frame(data, following, salt), Frame)
    )


def _put_right_and_followed(data: bytes, at: int, salt: int) -> bool:
    """Whether the frame at ``at``, put right (``_ends_put_right``, ``_checks_ending_at``),
    checks with ``salt``, and the frame where it then ends does too. For the first frame:
    two frames the spool wrote, as a sender's could only be if the spool's first frame
    checked with the sender's salt."""
    return any(
        end < len(data)
        and _checks_ending_at(data, at, end, salt)
        and isinstance(parse_frame(data, end, salt), Frame)
        for end in _ends_put_right(data, at)
    )


def _ends_put_right(data: bytes, at: int) -> list[int]:
    """Where the frame at ``at`` may end, its length field put right: as it reads, with
    any one of its 32 bits flipped, and, if it is a PAD frame, at each sector boundary its
    zeros reach within ``PAD_SIZE_MAX`` (a burst over its length). Only ends in the file."""
    low = at + fmt.FRAME_HEADER_SIZE
    if low > len(data):
        return []  # not even a frame header
    length = fmt.FRAME_HEADER.unpack_from(data, at)[1]
    lengths = [length, *(length ^ 1 << bit for bit in range(32))]
    if data[low - 1] == fmt.T_PAD:  # its type byte
        span = data[low : at + PAD_SIZE_MAX]
        zeros_to = low + len(span) - len(span.lstrip(b"\0"))
        lengths += [
            end - low for end in range(_boundary_at_or_after(low), zeros_to + 1, fmt.SECTOR)
        ]
    ends: list[int] = []
    for n in lengths:
        if n <= fmt.FRAME_PAYLOAD_MAX and low + n <= len(data) and low + n not in ends:
            ends.append(low + n)
    return ends


def _checks_ending_at(data: bytes, first: int, end: int, salt: int) -> bool:
    """Whether the frame at ``first``, ending at ``end``, checks with ``salt``: with its
    length field set to that and the rest as it reads, or, where its length field says
    it ends, with one flipped bit put right (``one_bit_fixed``)."""
    crc, length, ftype = fmt.FRAME_HEADER.unpack_from(data, first)
    size = end - first - fmt.FRAME_HEADER_SIZE
    length_and_type = fmt.FRAME_HEADER.pack(0, size, ftype)[4:]
    if frame_crc(length_and_type, data[first + fmt.FRAME_HEADER_SIZE : end], salt) == crc:
        return True
    return size == length and one_bit_fixed(data[first:end], salt) is not None


def _salt_of_frame_at(data: bytes, at: int) -> int | None:
    """The salt that makes the frame at ``at`` check (solved from its CRC), if its header
    reads as a frame's that lies within the file; None otherwise."""
    if at + fmt.FRAME_HEADER_SIZE > len(data):
        return None
    crc, length, ftype = fmt.FRAME_HEADER.unpack_from(data, at)
    end = at + fmt.FRAME_HEADER_SIZE + length
    if ftype not in fmt.FRAME_TYPES or length > fmt.FRAME_PAYLOAD_MAX or end > len(data):
        return None
    return _solve(functools.partial(crc32c, data[at + 4 : end]), crc)


def _two_frames_check(data: bytes, second: int, salt: int) -> bool:
    """Whether the frame at ``second`` and the one after it both check with ``salt``."""
    frame = parse_frame(data, second, salt)
    if not isinstance(frame, Frame):
        return False
    third = second + frame.size
    return third < len(data) and isinstance(parse_frame(data, third, salt), Frame)


def _header_one_bit_fixed(head: bytes) -> bytes | None:
    """The segment header with the one flipped bit that makes its CRC match and its magic
    and version right, or None (none, or more than one: then nothing is vouched for)."""
    if len(head) < fmt.SEGMENT_HEADER_SIZE:
        return None
    found = []
    for bit in range(fmt.SEGMENT_HEADER_SIZE * 8):
        candidate = bytearray(head)
        candidate[bit // 8] ^= 1 << bit % 8
        magic, version, _size, _seg, _salt, crc = fmt.SEGMENT_HEADER.unpack_from(candidate)
        if (
            crc32c(bytes(candidate[: fmt.SEGMENT_HEADER_SIZE - 4])) == crc
            and magic == fmt.SEGMENT_MAGIC
            and version in fmt.FORMAT_VERSIONS_READ
        ):
            found.append(bytes(candidate))
    return found[0] if len(found) == 1 else None


def _padding_alone_in_shape(data: bytes, first: int) -> int | None:
    """Where the padding ends if ``data`` from ``first`` is one PAD frame to a sector
    boundary in all but its CRC and a few flipped bits (``_padding_in_shape``), then
    nothing but zeros to the end: what an open's checkpoint leaves in a fresh segment,
    whatever its CRC and its header became. None if it is not that."""
    if len(data) < first + fmt.FRAME_HEADER_SIZE:
        return None
    tail = data[first + fmt.FRAME_HEADER_SIZE :]
    if len(tail) - tail.count(0) > PAD_BITS_MAX:
        return None  # more non-zero bytes than flipped bits allowed: not padding
    last = first + fmt.FRAME_HEADER_SIZE + len(tail.rstrip(b"\0"))  # zeros from here
    low = max(last, first + fmt.FRAME_HEADER_SIZE)
    top = min(len(data), first + PAD_SIZE_MAX)  # the spool pads no further: one pass
    for end in range(_boundary_at_or_after(low), top + 1, fmt.SECTOR):
        if _padding_in_shape(data, first, end):
            return end
    return None


def _padding_shaped_end(data: bytes, first: int) -> int | None:
    """Where the spool's padding starting at ``first`` ends (the first sector boundary at
    least a frame header on: ``framing.padding_for``) if ``data`` from ``first`` is
    padding: its payload zeros to there but for at most ``PAD_BITS_MAX`` bits or one
    burst (``BURST`` bytes), whatever its CRC, length and type read (one burst may hit
    them all). No record is that near (its payload holds a 16-digit id, dozens of set
    bits where this has zeros), and the header before it was written in the same sector.
    None if it is not that."""
    low = first + fmt.FRAME_HEADER_SIZE
    end = _boundary_at_or_after(low)
    if end > len(data):
        return None
    payload = data[low:end]
    if int.from_bytes(payload, "little").bit_count() <= PAD_BITS_MAX:
        return end
    stray = payload.strip(b"\0")  # or any bits, all within one burst
    return end if len(stray) <= BURST else None


def _padding_in_shape(data: bytes, first: int, end: int) -> bool:
    """Whether ``data[first:end]`` is a PAD frame in all but its CRC and either at most
    ``PAD_BITS_MAX`` flipped bits, at most ``PAD_HEADER_BITS_MAX`` of them in its length
    and type, the rest in its zero payload, or one burst (any bits in at most ``BURST``
    bytes, its length and type included). No record is that near (its payload holds a
    16-digit id, dozens of set bits where this has zeros), nor bytes a lost write zeroed:
    they are 8 bits from the length and type, and differ from them in bytes five apart
    (the length's two low bytes, never 0 for a PAD that ends at a sector boundary past
    the header's sector, and the type)."""
    length = end - first - fmt.FRAME_HEADER_SIZE
    if not 0 <= length <= fmt.FRAME_PAYLOAD_MAX:
        return False
    ideal = fmt.FRAME_HEADER.pack(0, length, fmt.T_PAD)[4:]
    if _zeros_after_but_for_a_burst(data[first + 4 : end], ideal):
        return True
    header_bits = _bits_apart(data[first + 4 : first + fmt.FRAME_HEADER_SIZE], ideal)
    if header_bits > PAD_HEADER_BITS_MAX:  # zeros are 8 bits off: a lost write
        return False
    payload_bits = int.from_bytes(data[first + fmt.FRAME_HEADER_SIZE : end], "little")
    return header_bits + payload_bits.bit_count() <= PAD_BITS_MAX


def _padding_alone_but_for_a_burst(data: bytes, first: int, salt: int) -> bool:
    """Whether ``data`` from ``first`` is one PAD frame to a sector boundary, damaged but
    for one burst that left its CRC as this salt makes it (so the salt, not only the
    shape, is checked: another salt's CRC differs in about 16 of those 32 bits), then
    nothing but zeros (sectors a crash left unwritten) to the end."""
    top = min(len(data), first + PAD_SIZE_MAX)  # the spool pads no further
    boundaries = range(fmt.SECTOR, top + 1, fmt.SECTOR)
    for end in (b for b in boundaries if b - first >= fmt.FRAME_HEADER_SIZE):
        raw = data[first:end]
        ideal = encode_frame(fmt.T_PAD, bytes(len(raw) - fmt.FRAME_HEADER_SIZE), salt)
        if (
            raw[:4] == ideal[:4]
            and _padding_but_for_a_burst(raw, salt)
            and not data[end:].strip(b"\0")
        ):
            return True
    return False


def _solve(f: Callable[[int], int], target: int) -> int | None:
    """The 32-bit x with f(x) == target, for an affine f over GF(2)^32 (a CRC as a function
    of its starting value or of its last four bytes); None if f is not invertible."""
    base = f(0)
    rows = [(f(1 << i) ^ base, 1 << i) for i in range(32)]  # (image of bit i, bit i)
    want, x = target ^ base, 0
    for bit in range(31, -1, -1):
        pivot = next((r for r in rows if r[0] >> bit & 1), None)
        if pivot is None:
            continue
        rows.remove(pivot)
        rows = [
            (img ^ pivot[0], src ^ pivot[1]) if img >> bit & 1 else (img, src) for img, src in rows
        ]
        if want >> bit & 1:
            want ^= pivot[0]
            x ^= pivot[1]
    return x if want == 0 else None


def _announced_body(frame: Frame, pos: int) -> tuple[str, int] | None:
    """(msg id, end) of the BODY frame a first envelope with an inline body announces."""
    if frame.type != fmt.T_ENVELOPE:
        return None
    try:
        env = rec.decode(frame.type, frame.payload)
    except rec.RecordError:
        return None
    if not isinstance(env, rec.Envelope) or env.body.kind != rec.BODY_INLINE:
        return None
    if env.body.at is not None:
        return None
    start = pos + frame.size
    return env.msg_id, start + fmt.FRAME_HEADER_SIZE + fmt.MSG_ID_LENGTH + env.body.size


def _resync(data: bytes, pos: int, salt: int, vouched_end: int | None) -> int:
    """The first offset after bad bytes at ``pos`` where a valid frame starts (or the end);
    for a damaged BODY frame, where its envelope says it ends: what follows it is judged
    on its own (padding hit there too is padding, not records lost with the body)."""
    if vouched_end is not None:
        return min(vouched_end, len(data))
    return first_valid_frame(data, pos + fmt.FRAME_HEADER_SIZE, len(data), salt)


def _classify(
    data: bytes,
    number: int,
    start: int,
    end: int,
    salt: int,
    vouched: tuple[str, int] | None,
    reason: str,
) -> Region:
    if vouched is not None:  # it ends where its envelope says, or where the file does
        msg_id, body_end = vouched
        size = body_end - start  # a file cut inside the body: all of it is lost
        why = f"body of {msg_id} damaged ({reason})"
        return Region(number, start, end, RegionKind.BODY, why, msg_id, size)
    raw = data[start:end]
    corrected = one_bit_fixed(raw, salt)
    padding = corrected is not None and corrected[8] == fmt.T_PAD
    if (
        padding
        or _was_padding(raw)
        or _near_padding(raw, salt)
        or _padding_but_for_a_burst(raw, salt)
        or _padding_but_for_two_bursts(raw, salt)
        or (end - start < RECORD_FRAME_MIN and not _cut_record(data, start, end))
    ):
        return Region(number, start, end, RegionKind.PADDING, f"padding damaged ({reason})")
    known = single_record(data[start:end])
    if known is not None:
        target = known.target if isinstance(known, rec.Control) else known.msg_id
        kind = fmt.TYPE_NAMES[rec.encode(known)[0]]
        why = f"one {kind} record of {target} damaged ({reason})"
        return Region(
            number,
            start,
            end,
            RegionKind.RECORDS,
            why,
            lost=kind,
            lost_target=target,
            record=known,
        )
    why = f"records damaged ({reason})"
    return Region(number, start, end, RegionKind.RECORDS, why)


ID_LENGTH = 16
# An id with at most two characters damaged, or a burst of four, keeps one of these
# pieces whole.
_ID_PIECES = ((0, 5), (5, 10), (10, 16))


# A message id as a record holds it, whole: CBOR text of 16 (0x70), upper-case hex; or as
# a BODY frame starts its payload: right after the frame's type byte.
_WHOLE_ID = re.compile(rb"[\x70\x%02x]([0-9A-F]{16})" % fmt.T_BODY)


def whole_ids(raw: bytes) -> set[str]:
    """The message ids that damaged bytes still hold whole (with the byte before them that
    a record or a BODY frame puts there)."""
    return set(whole_ids_read(raw))


def whole_ids_read(raw: bytes) -> list[str]:
    """``whole_ids``, each as many times as the bytes hold it."""
    return [m.group(1).decode("ascii") for m in _WHOLE_ID.finditer(raw)]


# What a damaged id shows for each character the damage left no hex digit.
UNKNOWN_CHAR = "?"
_HEX_DIGITS = b"0123456789ABCDEF"
_ID_ANCHOR = re.compile(rb"[\x70\x%02x](?=[\x00-\xff]{16})" % fmt.T_BODY, re.DOTALL)


def partial_id_reads(raw: bytes) -> list[tuple[int, str]]:
    """(where, id) of each id damaged bytes hold in part: the 16 bytes after a byte a
    record or a BODY frame puts before an id, all upper-case hex digits but for at most
    two of them or one run of at most ``BURST``. Whole ids are ``whole_ids``'. A message
    whose every copy of its id was hit (its envelope's and its BODY frame's) is known by
    these alone. What the damage may have changed is shown as ``UNKNOWN_CHAR``
    (``_suspect``)."""
    found = []
    for m in _ID_ANCHOR.finditer(raw):
        window = raw[m.end() : m.end() + ID_LENGTH]
        if len(window.translate(None, _HEX_DIGITS)) > BURST:
            continue  # quick: more bytes than a burst are no hex digits
        bad = [i for i, byte in enumerate(window) if byte not in _HEX_DIGITS]
        if bad and (len(bad) <= 2 or bad[-1] - bad[0] < BURST):
            found.append((m.end(), _suspect(window.decode("latin-1"), bad)))
    return found


def _suspect(text: str, bad: list[int]) -> str:
    """``text`` with every character the damage may have changed unknown: those that are
    no hex digit, and, when they lie within one burst, the others that burst may have
    covered (a byte of a burst can become another hex digit: no sign of damage)."""
    if bad[-1] - bad[0] < BURST:
        bad = list(range(max(0, bad[-1] - BURST + 1), min(len(text), bad[0] + BURST)))
    return "".join(UNKNOWN_CHAR if i in bad else c for i, c in enumerate(text))


_HEX_RUN = re.compile(rb"[0-9A-F]{%d,}" % (ID_LENGTH - fmt.BURST))


def loose_ids(raw: bytes) -> list[tuple[int, str]]:
    """(where, id) of the ids damaged bytes hold without the byte a record or a BODY frame
    puts before them: a burst over that byte and up to ``BURST`` - 1 of the id's first
    characters (each now no hex digit, or another one). Each run of at least 12 hex
    digits after another byte gives the id it may be the rest of, for each number of
    characters lost before it, the first ``BURST`` - 1 unknown. Message data may hold
    such runs: what they give is only ever named."""
    found: list[tuple[int, str]] = []
    lead = BURST - 1
    for m in _HEX_RUN.finditer(raw):
        start = m.start()
        if start > 0 and raw[start - 1] in (0x70, fmt.T_BODY):
            continue  # where ``whole_ids`` and ``partial_ids`` read
        run = m.group().decode("ascii")
        texts = {
            UNKNOWN_CHAR * lead + run[lead - lost : ID_LENGTH - lost]
            for lost in range(lead + 1)
            if len(run) >= ID_LENGTH - lost
        }
        found += [(start, text) for text in sorted(texts)]
    return found


def fits_any(ids: set[str]) -> Callable[[str], bool]:
    """Whether a partial id fits one of ``ids`` (reads as it wherever it is not
    ``UNKNOWN_CHAR``): by the ids masked where it is unknown, one set per mask (a queue
    may hold millions of ids; a damaged region, a few partial ones)."""
    masked: dict[tuple[int, ...], set[str]] = {}

    def mask(msg_id: str, unknown: tuple[int, ...]) -> str:
        return "".join(UNKNOWN_CHAR if i in unknown else c for i, c in enumerate(msg_id))

    def fits(partial: str) -> bool:
        unknown = tuple(i for i, c in enumerate(partial) if c == UNKNOWN_CHAR)
        if unknown not in masked:
            masked[unknown] = {mask(m, unknown) for m in ids if len(m) == len(partial)}
        return partial in masked[unknown]

    return fits


def id_merged(a: str, b: str) -> str | None:
    """The id two partial copies make together, if they agree wherever both are known
    and leave no character unknown; else None."""
    out = []
    for x, y in zip(a, b, strict=True):
        if UNKNOWN_CHAR not in (x, y) and x != y:
            return None
        out.append(y if x == UNKNOWN_CHAR else x)
    merged = "".join(out)
    return None if UNKNOWN_CHAR in merged else merged


def id_agreement(a: str, b: str) -> set[str]:
    """What two copies of one id, each hit in one place, leave known: ``UNKNOWN_CHAR``
    wherever either is unknown or they differ; and the same with each run of differences
    widened as far as a burst reaches (it may have changed a character next to them into
    another hex digit, the same one the other copy's damage made of it). Each only if it
    still holds at least a quarter of the id: each copy may have lost up to seven
    characters (``_suspect``)."""
    pairs = list(zip(a, b, strict=True))
    unknown = {i for i, (x, y) in enumerate(pairs) if UNKNOWN_CHAR in (x, y) or x != y}
    differ = [i for i, (x, y) in enumerate(pairs) if x != y and UNKNOWN_CHAR not in (x, y)]
    wide = set(unknown)
    while differ:  # each run of differences within a burst, and as far as it may reach
        run = [i for i in differ if i - differ[0] < BURST]
        differ = differ[len(run) :]
        wide.update(range(max(0, run[-1] - BURST + 1), min(len(a), run[0] + BURST)))
    return {
        "".join(UNKNOWN_CHAR if i in gone else x for i, x in enumerate(a))
        for gone in (unknown, wide)
        if len(a) - len(gone) >= ID_LENGTH // 4
    }


def id_near(raw: bytes, msg_id: str, others: Container[str] = ()) -> bool:
    """Whether damaged bytes ``raw`` hold ``msg_id``, or its text with at most two
    characters wrong (``same_id``) that is not one of ``others`` (the ids the bytes hold
    whole of messages the log names intact: their own records in the damage; ids of one
    second differ in a character or two, so a neighbour's own id must not count). So that
    a message whose envelope was in the damage, and whose body file no live message names,
    is named, not taken for an orphan.

    Looked for by the id's pieces (whatever the bytes around it, the CBOR length byte before
    it included: flipped, that byte once hid the id), each found at C speed, so the cost is
    a few scans of the region per candidate, not a window per byte."""
    text = msg_id.encode("ascii", "replace")
    for lo, hi in _ID_PIECES:
        piece = text[lo:hi]
        at = raw.find(piece)
        while at != -1:
            start = at - lo
            window = raw[start : start + ID_LENGTH].decode("latin-1") if start >= 0 else ""
            if window == msg_id or (
                len(window) == ID_LENGTH and same_id(window, msg_id) and window not in others
            ):
                return True
            at = raw.find(piece, at + 1)
    return False


def same_id(damaged: str, msg_id: str) -> bool:
    """Whether an id read from damaged bytes is ``msg_id`` but for at most two characters,
    or for a burst of up to four in a row (one bad run of bytes)."""
    if len(damaged) != len(msg_id):
        return False
    wrong = [i for i, (a, b) in enumerate(zip(damaged, msg_id, strict=True)) if a != b]
    return len(wrong) <= 2 or (len(wrong) <= BURST and wrong[-1] - wrong[0] < BURST)


BURST = fmt.BURST


def single_record(raw: bytes) -> rec.Record | None:
    """The one record ``raw`` held, if its header spans exactly ``raw`` and its payload
    still decodes as a record of the header's type; else None. A flipped type byte makes
    the payload fail to decode as that type, so the kind is reliable; the content may hold
    the damage (a flipped letter of an address), so it is never trusted to settle mail,
    only to narrow what may have been lost, or to restore a message *held* for the
    operator to check."""
    if len(raw) < fmt.FRAME_HEADER_SIZE:
        return None
    _crc, length, ftype = fmt.FRAME_HEADER.unpack_from(raw)
    if length + fmt.FRAME_HEADER_SIZE != len(raw) or ftype not in fmt.TYPE_NAMES:
        return None
    if ftype in (fmt.T_BODY, fmt.T_PAD):
        return None
    try:
        record = rec.decode(ftype, raw[fmt.FRAME_HEADER_SIZE :])
    except rec.RecordError:
        return None
    target = record.target if isinstance(record, rec.Control) else record.msg_id
    if not fmt.is_id_shaped(target):
        # The damage hit the id's length (a flipped length byte reads it as empty, or as
        # longer) or left bytes no name holds (NUL, "/"): whose record it was is unknown,
        # so it counts as records of unknown kind (every message live here a suspect).
        # An id of 16 characters some of which are no hex digit stays: it still tells
        # which message it was (within a few characters), but never names one itself
        # (``Assessment._region``).
        return None
    return record


def _cut_record(data: bytes, start: int, end: int) -> bool:
    """Whether the region is the start of a record frame the end of the file cut (a
    segment file shortened): its header reads as a record's, its length runs past the end.
    Then it held a record however few bytes are left; between two frames a region that
    small cannot have. Fewer bytes than a frame header at the end: a frame cut whose
    type is gone with the rest, taken for records (a PAD frame's place grows by a marker
    then, where it could not even hold a PAD frame)."""
    if end != len(data):
        return False
    if end - start < fmt.FRAME_HEADER_SIZE:
        return True
    _crc, length, ftype = fmt.FRAME_HEADER.unpack_from(data, start)
    return ftype in fmt.FRAME_TYPES and ftype != fmt.T_PAD and start + 9 + length > end


def _was_padding(raw: bytes) -> bool:
    """A PAD frame whose header survived (type 15, the right length) and whose payload is
    still zeros but for a few flipped bytes: no record can look like that."""
    if len(raw) < fmt.FRAME_HEADER_SIZE:
        return False
    _crc, length, ftype = fmt.FRAME_HEADER.unpack_from(raw)
    payload = raw[fmt.FRAME_HEADER_SIZE :]
    nonzero = len(payload) - payload.count(0)
    return ftype == fmt.T_PAD and length == len(payload) and nonzero <= 8


# How far (in bits) damaged bytes may be from the PAD frame that would span them exactly,
# and how far their stored CRC from that frame's, for them to be taken for that padding.
PAD_BITS_MAX = 16
PAD_CRC_BITS_MAX = 2
# How far a padding-alone segment's PAD length and type may be from the frame's
# (``_padding_alone_in_shape``): zeroed bytes, a lost write, are 8 bits from them.
PAD_HEADER_BITS_MAX = 2
# The largest PAD frame the writer adds (framing.padding_for: a gap too small for a frame
# header is widened by a sector): where a PAD whose length was hit may have ended.
PAD_SIZE_MAX = fmt.SECTOR + fmt.FRAME_HEADER_SIZE - 1


def _near_padding(raw: bytes, salt: int) -> bool:
    """Bad bytes that are a PAD frame spanning them exactly but for a few flipped bits,
    the length field included (which ``_was_padding`` needs intact).

    A PAD frame is fixed by its extent and the segment's salt, so the frame that would span
    ``raw`` can be built and compared. Its stored CRC must be within two bits of that
    frame's: the CRC is salted, so a record's (or any bytes' not written as this padding)
    is that close with probability about 2^-23. And no record is within 16 bits of the
    frame: a record's payload is a CBOR map of ASCII keys and a 16-digit message id,
    dozens of set bits where the padding has zeros.
    """
    if len(raw) < fmt.FRAME_HEADER_SIZE:
        return False
    ideal = encode_frame(fmt.T_PAD, bytes(len(raw) - fmt.FRAME_HEADER_SIZE), salt)
    crc_bits = _bits_apart(raw[:4], ideal[:4])
    return (
        crc_bits <= PAD_CRC_BITS_MAX and crc_bits + _bits_apart(raw[4:], ideal[4:]) <= PAD_BITS_MAX
    )


def _padding_but_for_a_burst(raw: bytes, salt: int) -> bool:
    """Bad bytes that are the PAD frame spanning them exactly but for one run of at most
    ``BURST`` bytes (any bits in them): a burst over a PAD frame's header, which hits its
    CRC and its length together (so neither ``_was_padding`` nor ``_near_padding`` holds).

    Outside the run every byte is the padding's: a payload of zeros, which no record has
    (a CBOR map of ASCII keys and a 16-digit id) and no BODY frame (its payload begins
    with the id); bytes zeroed by a lost write differ from it in the CRC, the length and
    the type, nine bytes apart. So nothing of value was there, whatever the run held.
    """
    size = len(raw) - fmt.FRAME_HEADER_SIZE
    if not 0 <= size <= fmt.FRAME_PAYLOAD_MAX:
        return False
    header = encode_frame(fmt.T_PAD, bytes(size), salt)[: fmt.FRAME_HEADER_SIZE]
    return _zeros_after_but_for_a_burst(raw, header)


def _padding_but_for_two_bursts(raw: bytes, salt: int) -> bool:
    """Bad bytes that are the PAD frame spanning them exactly but for two runs of at most
    ``BURST`` bytes each (any bits in them): two places of damage in one PAD frame (a
    burst over its CRC and a bit of its type, a burst over its zeros and a bit of its
    length, two bursts over its length and type).

    Outside the runs its payload is zeros, which no record has and no BODY frame (its
    payload begins with the id). What else differs from a PAD in its header alone: a
    record whose payload alone was zeroed (a lost write), which keeps its length and reads
    a record's type, so a type byte reading a record's type is not taken for padding; and
    bytes all zeroed, or zeroed from the type on, which read type 0, so a type byte reading
    0 counts only with the PAD's own CRC (salted: nothing else has it) intact.
    """
    size = len(raw) - fmt.FRAME_HEADER_SIZE
    if not 0 <= size <= fmt.FRAME_PAYLOAD_MAX:
        return False
    ftype = raw[fmt.FRAME_HEADER_SIZE - 1]
    header = encode_frame(fmt.T_PAD, bytes(size), salt)[: fmt.FRAME_HEADER_SIZE]
    if ftype in fmt.FRAME_TYPES - {fmt.T_PAD} or (ftype == 0 and raw[:4] != header[:4]):
        return False
    payload = raw[fmt.FRAME_HEADER_SIZE :]
    if size - payload.count(0) > 2 * BURST:
        return False  # more bytes than two bursts change
    differ = [i for i in range(fmt.FRAME_HEADER_SIZE) if raw[i] != header[i]]
    differ += [fmt.FRAME_HEADER_SIZE + m.start() for m in re.finditer(rb"[^\0]", payload)]
    runs = 0
    reach = -1
    for at in differ:  # in order: a run starts at the first byte the one before left out
        if at > reach:
            runs += 1
            reach = at + BURST - 1
    return runs <= 2


def _zeros_after_but_for_a_burst(raw: bytes, head: bytes) -> bool:
    """Whether ``raw`` is ``head`` and then zeros but for one run of at most ``BURST``
    bytes (any bits in them)."""
    differ = [i for i in range(len(head)) if raw[i] != head[i]]
    payload = raw[len(head) :]
    after_zeros = payload.lstrip(b"\0")
    if after_zeros:
        differ.append(len(raw) - len(after_zeros))
        differ.append(len(head) + len(payload.rstrip(b"\0")) - 1)
    return not differ or differ[-1] - differ[0] < BURST


def _bits_apart(a: bytes, b: bytes) -> int:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).bit_count()


def _set_aside_body(
    item: Frame | Region, frame: Frame, number: int, pos: int, body: tuple[str, int]
) -> Frame | Region:
    """The body an earlier repair set aside right after its first envelope: a ``damaged``
    marker with ``body`` (its ``tgt`` may be empty: the envelope names the message), or,
    where no marker fitted, a PAD frame of exactly the announced BODY frame's size (the
    writer never puts padding between a first envelope and its body)."""
    msg_id, end = body
    if isinstance(item, Region) and item.marker and item.body_bytes:
        return attrs.evolve(item, body_of=msg_id)
    if frame.type == fmt.T_PAD and pos + frame.size == end:
        why = "set aside by an earlier repair"
        return Region(number, pos, end, RegionKind.BODY, why, msg_id, frame.size, marker=True)
    return item


def _as_marker(frame: Frame, number: int, pos: int) -> Region | None:
    """The region a ``damaged`` marker stands for, if ``frame`` is one."""
    if frame.type != fmt.T_CONTROL:
        return None
    try:
        record = rec.decode(frame.type, frame.payload)
    except rec.RecordError:
        return None
    if not isinstance(record, rec.Control) or record.action != rec.DAMAGED:
        return None
    end = pos + frame.size
    why = "set aside by an earlier repair"
    if record.body:
        kind = RegionKind.BODY if record.body >= frame.size else RegionKind.BODY_AND_RECORDS
        return Region(
            number, pos, end, kind, why, record.target, record.body, marker=True, copy=record.copy
        )
    lost_target = record.target if record.lost else ""
    return Region(
        number,
        pos,
        end,
        RegionKind.RECORDS,
        why,
        lost=record.lost,
        lost_target=lost_target,
        marker=True,
        copy=record.copy,
        sup=record.sup,
    )


# --- markers ---------------------------------------------------------------------------


def replacement(region: Region, salt: int, at: float, copy: str) -> bytes:
    """The bytes a repair writes in place of ``region``: a ``damaged`` marker frame of
    exactly its size, as informative as fits (with the copy's name, then without, then
    saying only how much body it held), or a PAD frame where nothing of value was lost.

    A damaged body too small for even the last marker is replaced by a PAD frame of its
    size, which after a first envelope stands for its body (``_set_aside_body``). A records
    region smaller than ``RECORD_FRAME_MIN`` (> the last marker's size) is only ever at the
    end of a file, and its marker is ``RECORD_FRAME_MIN`` bytes: the file grows."""
    size = region.end - region.start
    if region.kind is RegionKind.BODY:
        # A BODY frame the end of a shortened file cut: its stand-in reaches the end its
        # envelope announced (``_classify``), the file grows to it.
        size = max(size, region.body_bytes)
    if region.kind is RegionKind.PADDING and not region.sup:
        return pad_frame(size, salt)
    if size < RECORD_FRAME_MIN and region.kind is not RegionKind.BODY:
        # Records cut by the end of a shortened file (``_cut_record``), or an unreadable
        # segment shorter than a marker: the marker runs past where the file ended.
        size = RECORD_FRAME_MIN
    target = region.body_of or region.lost_target
    when = int(at)  # an integer time is valid and takes 5 bytes, not 9
    body, lost, sup = region.body_bytes, region.lost, region.sup
    for marker in (
        rec.Control(rec.DAMAGED, target, when, body, copy, lost, sup),
        rec.Control(rec.DAMAGED, target, when, body, "", lost, sup),
        rec.Control(rec.DAMAGED, "", 0, body, "", lost, sup),
        rec.Control(rec.DAMAGED, "", 0, body, "", "", sup),  # sup is never dropped
    ):
        payload = _sized_marker(marker, size - fmt.FRAME_HEADER_SIZE)
        if payload is not None:
            return encode_frame(fmt.T_CONTROL, payload, salt)
    if region.kind is RegionKind.BODY and size == body and not sup:
        return pad_frame(size, salt)
    # Never reached: every region is at least RECORD_FRAME_MIN bytes, which the last
    # marker always fits. A bug, not damage.
    raise AssertionError(f"no marker fits the damaged region {region}")


def _sized_marker(marker: rec.Control, size: int) -> bytes | None:
    """The marker's CBOR map made exactly ``size`` bytes, or None if it cannot be.

    Readers ignore unknown keys, so a filler (a text ``_`` or a byte string ``pad``) takes
    up the slack; the time's integer width (0, 24, 256: one, two or three bytes) covers the
    sizes a filler cannot reach (it costs at least three bytes)."""
    base = rec.control_map(marker)
    for when in (base["ts"], 0, 24, 256):
        obj = {**base, "ts": when}
        plain = cbor2.dumps(obj)
        if len(plain) == size:
            return plain
        for key, unit in (("_", "x"), ("pad", b"\0")):
            need = size - len(cbor2.dumps({**obj, key: unit[:0]}))
            for k in range(max(0, need - 8), need + 1):
                payload = cbor2.dumps({**obj, key: unit * k})
                if len(payload) == size:
                    return payload
    return None


# --- what the damage means for mail --------------------------------------------------

_ENVELOPE, _START, _DELTA, _FINISH, _CONTROL = (
    fmt.TYPE_NAMES[t]
    for t in (fmt.T_ENVELOPE, fmt.T_START, fmt.T_DELTA, fmt.T_FINISH, fmt.T_CONTROL)
)


class Verdict(enum.Enum):
    BODY_LOST = "body lost"  # fail the pending recipients
    RECORDS_LOST = "records possibly lost"  # hold for the operator
    ENVELOPE_LOST = "envelope lost"  # recovery finishes it (R5), or nothing is left
    ENVELOPE_DAMAGED = "envelope damaged"  # restore it held, as it still decodes
    # Its inline body lay in a segment deleted since (the envelope naming its promoted
    # copy was set aside): name the copy in its body file, or fail the pending recipients.
    BODY_SEGMENT_GONE = "body's segment gone"
    # In flight from its only envelope, which still decodes: recovery restores it held
    # with the recipients its attempt left (R5b), from the copy the marker names.
    ENVELOPE_DAMAGED_IN_FLIGHT = "envelope damaged in flight"
    # Two valid body files of one message that differ (incoming/ and bodies/): which is
    # its own cannot be told. Held, the one in incoming/ kept in corrupt/.
    BODY_AMBIGUOUS = "two different body files"
    # In flight or queued here, yet an outcome acknowledgement of it follows: its finish
    # (and maybe its start) was in the damage. Finished: nothing to settle, only named.
    FINISH_LOST = "finish lost"


@attrs.frozen
class Affected:
    """One message the damage touched, and why."""

    msg_id: str
    verdict: Verdict
    region: Region
    live: bool  # still queued (an envelope or an attempt that nothing settled)
    held: bool = False
    detail: str = ""
    # FINISH_LOST of a message that looks queued on this envelope: the repair finishes it.
    queued_on: Position | None = None


@attrs.define
class _Live:
    envelope_at: Position | None
    envelope: rec.Envelope | None
    body: rec.BodyRef | None
    started: bool = False


def assess(scans: Iterable[SegmentScan], bad_body_files: Iterable[str] = ()) -> list[Affected]:
    """Every message the damage in ``scans`` (the live log, oldest segment first) and the
    damaged or missing body files ``bad_body_files`` touch (module docstring)."""
    walk = Assessment(set(bad_body_files))
    for scan in scans:
        for offset, item in scan.items:
            walk.step(Position(scan.number, offset), item)
    return walk.verdicts()


class Assessment:
    """The walk behind ``assess``, one item at a time (``check.py`` streams segments
    through it, so memory stays bounded by the live messages, not the log)."""

    def __init__(self, bad_files: set[str]) -> None:
        self.bad_files = bad_files
        self.live: dict[str, _Live] = {}
        self.regions: list[Region] = []
        self.lost_bodies: dict[Position, Region] = {}
        self.suspects: dict[str, Region] = {}
        self.lost_envelopes: dict[str, Region] = {}
        self.lone_bodies: dict[str, Region] = {}
        # Regions whose one START was identified exactly, and the envelope it named (the
        # repair's marker carries it: ``lost_starts``, by region).
        self.exact_starts: dict[tuple[int, int], Position] = {}
        self.lost_starts: dict[tuple[int, int], list[Position]] = {}
        # Envelopes a finish showed used up by a START lost to damage (in order), and those
        # a repair's note (``used-up``) or a marker already says are: the repair notes the
        # difference (``unnoted``).
        self.used_up: dict[Position, None] = {}
        self.noted: set[Position] = set()
        # Regions whose one record decoded as an operator's action in flight that names no
        # message in flight here: their markers must say "records of unknown kind", or a
        # later check would take the lost record for one that is safe to lose.
        self.unknown_operator: set[tuple[int, int]] = set()
        self.lost_envelopes_of: dict[str, Region] = {}  # one lost envelope record each
        self.previous: tuple[Position, Frame | Region] | None = None
        # Finished messages with a body file and no outcome acknowledgement (yet): with
        # outcome tracking their files are kept for the bounce (outcomes.py).
        self.awaiting_ack: set[str] = set()
        # Messages whose finish was seen: settled for good. A damaged envelope after it that
        # still reads as theirs is another message's whose id the damage changed.
        self.finished: set[str] = set()
        # Messages live here that an outcome acknowledgement showed finished (its finish
        # was lost), with the damage that held the finish where one is known.
        self.finish_lost: dict[str, Region] = {}
        # Those of them that looked queued (their start lost too), by the envelope they
        # were queued on: the repair writes their finish, which releases their body.
        self.finish_envelopes: dict[str, Position] = {}
        # Every message an intact record names (an id that only damage holds is a message
        # whose records were all lost: check.py names it).
        self.seen: set[str] = set()
        # Each segment's size as scanned (a missing one: its header's), and, for a segment
        # that a record shows to have lost its end (``_lost_end``), the region of those
        # bytes.
        self.sizes: dict[int, int] = {}
        self.lost_ends: dict[int, Region] = {}

    def region_at(self, at: Position) -> Region | None:
        return next((r for r in self.regions if r.holds(at)), None)

    def step(self, pos: Position, item: Frame | Region) -> None:
        if isinstance(item, Region):
            self._region(pos, item)
        elif item.type == fmt.T_BODY:
            self._body(pos, item)
        elif item.type != fmt.T_PAD:
            try:
                record = rec.decode(item.type, item.payload)
            except rec.RecordError:
                record = None  # reported by the check; nothing to learn from it here
            if record is not None:
                self._record(pos, item, record)
        self.previous = (pos, item)

    def _region(self, pos: Position, region: Region) -> None:
        region = self._owned_replacement(region)
        self.regions.append(region)
        self.noted.update(region.sup)
        for state in self.live.values():
            if state.envelope_at in region.sup:
                state.started = True  # a repair recorded that a lost start used it up
        if region.body_of:
            self.lost_bodies[pos] = region
        if not region.records_lost:
            return
        if region.record is None and region.lost == _START and region.sup:
            # A repair's marker for a start it identified exactly: what it used up is
            # known (``sup``), nothing else was lost.
            return
        target = self.live.get(region.lost_target)
        if region.lost == _ENVELOPE and not fmt.is_message_id(region.lost_target):
            # A first envelope whose id the damage left malformed: no message has that id,
            # and none may be restored under it. Its message is named by its body file
            # (within four characters: ``_envelopes_lost_with_files``), by its intact BODY
            # frame, or by its id in the damaged bytes.
            return
        if region.lost == _ENVELOPE and region.lost_target not in self.finished:
            # Unless a later envelope or finish of the message re-establishes it, this was
            # the envelope that carried it on (a first one; or a replacement that settled an
            # attempt whose own envelope may be long deleted): it is restored, held, or
            # named as lost (verdicts).
            self.lost_envelopes_of.setdefault(region.lost_target, region)
            return
        # A control record an operator wrote on a message in flight (hold, delete, bounce)
        # must not be lost alone. One known only from a repair's marker (``record`` None:
        # the marker keeps the kind and the target, not the action) may have been one if
        # its target is in flight (an outcome acknowledgement's is finished).
        operator = (region.record is None and target is not None and target.started) or (
            isinstance(region.record, rec.Control) and region.record.action in rec.IN_FLIGHT_ACTIONS
        )
        if region.lost == _FINISH or (region.lost == _CONTROL and not operator):
            # Safe to lose alone: the attempt a finish closed is decided again by recovery
            # from its start and deltas; a lost outcome acknowledgement costs at most a
            # second bounce.
            return
        started = region.record if isinstance(region.record, rec.Start) else None
        exact = (
            started is not None
            and target is not None
            and not target.started
            and target.envelope_at == started.envelope_at
            # A start follows the envelope it names in the log: one before it is another
            # message's whose id and envelope position the damage both hit.
            and target.envelope_at is not None
            and target.envelope_at < Position(region.segment, region.start)
        )
        if exact and started is not None and target is not None:
            # The lost start is known exactly and names the message's live envelope: the
            # repair's marker carries it (``sup``), and recovery takes the marker for that
            # start, so the deltas after it count as they did.
            target.started = True
            key = (region.segment, region.start)
            self.lost_starts.setdefault(key, []).append(started.envelope_at)
            self.exact_starts[key] = started.envelope_at
            return
        # A lost start endangers the message it started (if that is still unstarted here),
        # a lost delta the attempt it belongs to (if that is in flight here).
        # An operator's action on a message in flight (a control record) counts as a delta:
        # recovery would decide the attempt without the hold or delete it asked for.
        wanted = {_START: False, _DELTA: True, _CONTROL: True}.get(region.lost)
        if target is not None and wanted is not None and target.started == wanted:
            # The record failed its check, its id too may be damaged: ids of one second
            # differ in a character or two (one bit, often), so every message in the same
            # state with an id that close may be the one it belonged to.
            for msg_id, state in self.live.items():
                if state.started == wanted and same_id(region.lost_target, msg_id):
                    self.suspects.setdefault(msg_id, region)
        else:
            # Unknown records: a start or a delivered delta of any message live here may
            # have been among them; attempting it again could deliver twice.
            if operator and not region.marker:
                self.unknown_operator.add((region.segment, region.start))
            for msg_id in self.live:
                self.suspects.setdefault(msg_id, region)

    def _owned_replacement(self, region: Region) -> Region:
        """A damaged replacement envelope that still decodes names, in ``supersedes``, the
        envelope it replaced: when a live message stands on that envelope, the record is
        that message's, whatever id the damage left in it (ids of one second differ in a
        character or two). It counts as that message's lost envelope; as its content is
        not the message's own (the id is wrong), it is not restored: recovery finishes a
        message in flight from it (R5), and names it."""
        env = region.record
        if region.lost != _ENVELOPE or not isinstance(env, rec.Envelope) or not env.supersedes:
            return region
        owner = next((m for m, st in self.live.items() if st.envelope_at == env.supersedes), None)
        if owner is None or owner == env.msg_id:
            return region
        return attrs.evolve(region, lost_target=owner)

    def _body(self, pos: Position, frame: Frame) -> None:
        if self.previous is not None and isinstance(self.previous[1], Region):
            # A BODY frame right after damage: its first envelope was in the damage.
            msg_id = frame.payload[: fmt.MSG_ID_LENGTH].decode("ascii", "replace")
            self.lone_bodies[msg_id] = self.previous[1]
        self.seen.add(frame.payload[: fmt.MSG_ID_LENGTH].decode("ascii", "replace"))

    def _record(self, pos: Position, frame: Frame, record: rec.Record) -> None:
        self.seen.add(record.target if isinstance(record, rec.Control) else record.msg_id)
        for named in _positions_named(record):
            self._lost_end(named)
        if isinstance(record, rec.Envelope):
            if record.supersedes is not None:
                self._passed_over(self.live.get(record.msg_id), record.supersedes)
            body = record.body
            if body.kind == rec.BODY_INLINE and body.at is None:
                body = rec.BodyRef(
                    body.kind, body.size, Position(pos.segment, pos.offset + frame.size)
                )
            self.live[record.msg_id] = _Live(pos, record, body)
            self._reestablished(record.msg_id)
        elif isinstance(record, rec.Start):
            state = self.live.get(record.msg_id)
            self._passed_over(state, record.envelope_at)
            lost = self.region_at(record.envelope_at)
            if lost is not None:
                self.lost_envelopes[record.msg_id] = lost
                self.live[record.msg_id] = _Live(None, None, None, started=True)
            elif state is not None:
                state.started = True
                self._reestablished(record.msg_id)
            else:
                self.live[record.msg_id] = _Live(record.envelope_at, None, None, started=True)
        elif isinstance(record, rec.Delta):
            state = self.live.get(record.msg_id)
            if self.regions and (state is None or not state.started):
                # A delta of an attempt whose start was never seen: the start was lost.
                self.suspects.setdefault(record.msg_id, self.regions[-1])
        elif isinstance(record, rec.Finish):
            self._finished(record.msg_id)
            self.finish_envelopes.pop(record.msg_id, None)  # (R6's, or a repair's: done)
            if record.body.kind == rec.BODY_FILE:
                self.awaiting_ack.add(record.msg_id)
        elif isinstance(record, rec.Control) and record.action == rec.OUTCOME_ACK:
            self.awaiting_ack.discard(record.target)
            target = record.target
            if target in self.live or target in self.lost_envelopes_of:
                # An acknowledgement is written only for an outcome handed out, and that
                # only once its finish is durable (outcome_desk.py): the finish was before
                # it, and is lost. Recovery finishes an attempt in flight again (R6: not
                # decided again, the acknowledgement let the body file go); a message that
                # looks queued (its start lost too) is finished by the repair; one whose
                # only envelope was damaged is not restored.
                region = (
                    self.suspects.get(target)
                    or self.lost_envelopes.get(target)
                    or self.lost_envelopes_of.get(target)
                    or next((r for r in self.regions if r.lost_target == target), None)
                )
                state = self.live.get(target)
                if state is not None and not state.started and state.envelope_at is not None:
                    self.finish_envelopes[target] = state.envelope_at
                self._finished(target)
                if region is not None:
                    self.finish_lost[target] = region
        elif isinstance(record, rec.Control) and record.action == rec.USED_UP:
            self.noted.update(record.sup)
            for state in self.live.values():
                if state.envelope_at in record.sup:
                    state.started = True

    def _finished(self, msg_id: str) -> None:
        """A finish of ``msg_id``, seen or proven: settled for good. If its live envelope
        was never started here, the start was lost in damage."""
        state = self.live.pop(msg_id, None)
        if state is not None and not state.started and state.envelope_at is not None:
            self._start_was_lost(state.envelope_at)
        self._reestablished(msg_id)
        self.finished.add(msg_id)

    def _lost_end(self, named: Position) -> None:
        """A record names ``named``, an earlier place in the log. Past the end of its
        segment as scanned, it shows that the segment lost its end (a file cut short, or
        missing: truncated frames and gaps aside, a cut at a batch's start leaves no trace
        in the segment itself). Those bytes, from the end to past ``named``, are a region
        of records possibly lost: every message live here is suspect, a start that names
        an envelope there lost it, and the repair's marker fills them (the file grows), so
        that recovery finds the envelope set aside, not "no frame header here"."""
        size = self.sizes.get(named.segment)
        if size is None or named.offset < size:
            return
        end = named.offset + RECORD_FRAME_MIN
        region = self.lost_ends.get(named.segment)
        if region is None:
            why = f"the segment's end is lost: a record names offset {named.offset} in it"
            region = Region(named.segment, size, end, RegionKind.RECORDS, why)
            self.lost_ends[named.segment] = region
            self._region(Position(named.segment, size), region)
        elif end > region.end:
            grown = attrs.evolve(region, end=end)
            self.regions[self.regions.index(region)] = grown
            self.lost_ends[named.segment] = grown
            for table in (self.suspects, self.lost_envelopes, self.lost_envelopes_of):
                for msg_id in [m for m, r in table.items() if r is region]:
                    table[msg_id] = grown

    def _passed_over(self, state: _Live | None, named: Position) -> None:
        """A record of a message moves on from ``named``; if the message's live envelope
        is another one, not yet started, something that superseded it (a start, an
        operator's replacement) was lost in damage since, and must be said to have."""
        if state is None or state.started or state.envelope_at is None:
            return
        if state.envelope_at != named:
            self._start_was_lost(state.envelope_at)

    def _start_was_lost(self, envelope_at: Position) -> None:
        """A finish of a message whose live envelope no start named: the start was in
        damage after the envelope. The repair notes that the envelope is used up (a
        ``used-up`` record of its own: the damaged bytes may be too few for a marker that
        says it, a whole segment, or an earlier repair's marker), or the runner of its
        class would hand it out again."""
        self.used_up[envelope_at] = None
        # Records regions after the envelope could have held that start. If each of them
        # was taken for another message's START known exactly (its damaged id and envelope
        # read as that message's), one of those was not: the last one's message, if it is
        # still in flight on that start alone, goes back to queued, a suspect (held by the
        # repair). One that finished since keeps its start: its finish vouches for it.
        after = [
            (r.segment, r.start)
            for r in self.regions
            if (r.segment, r.start) > envelope_at and r.records_lost
        ]
        if not after or any(key not in self.exact_starts for key in after):
            return
        key = after[-1]
        taken = self.exact_starts[key]
        for msg_id, state in self.live.items():
            if state.envelope_at == taken and state.started:
                state.started = False
                region = next(r for r in self.regions if (r.segment, r.start) == key)
                self.suspects.setdefault(msg_id, region)
                self.lost_starts[key].remove(taken)
                del self.exact_starts[key]
                return

    def unnoted(self) -> list[Position]:
        """The used-up envelopes no note or marker names yet, in log order."""
        return [p for p in self.used_up if p not in self.noted]

    def _reestablished(self, msg_id: str) -> None:
        # A later envelope or start of the message: it moved on from whatever was lost
        # before (an attempt from a lost envelope that ended with a replacement is over).
        self.lost_envelopes.pop(msg_id, None)
        self.suspects.pop(msg_id, None)
        self.lone_bodies.pop(msg_id, None)
        self.lost_envelopes_of.pop(msg_id, None)

    def verdicts(self) -> list[Affected]:
        out: list[Affected] = []
        for msg_id, state in self.live.items():
            env = state.envelope
            held = env is not None and env.held is not None
            body = state.body
            lost_at = body.at if body is not None and body.kind == rec.BODY_INLINE else None
            # Its BODY frame damaged: vouched for by its first envelope, or in a region with
            # that envelope (both hit), which a later replacement names it by position.
            region = (
                (self.lost_bodies.get(lost_at) or self.region_at(lost_at))
                if lost_at is not None
                else None
            )
            if region is not None:
                out.append(Affected(msg_id, Verdict.BODY_LOST, region, True, held))
            elif body is not None and body.kind == rec.BODY_FILE and msg_id in self.bad_files:
                name = f"{fmt.BODY_DIR}/{msg_id}"
                file_region = Region(0, 0, 0, RegionKind.BODY_FILE, name)
                out.append(Affected(msg_id, Verdict.BODY_LOST, file_region, True, held))
            elif msg_id in self.lost_envelopes:
                detail = "recovery finishes it with the outcomes that survived"
                region = self.lost_envelopes[msg_id]
                out.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, True, False, detail))
            elif msg_id in self.suspects:
                out.append(
                    Affected(msg_id, Verdict.RECORDS_LOST, self.suspects[msg_id], True, held)
                )
        for msg_id, region in self.finish_lost.items():
            detail = "its outcome was acknowledged later, so it had finished"
            queued_on = self.finish_envelopes.get(msg_id)
            out.append(
                Affected(msg_id, Verdict.FINISH_LOST, region, False, False, detail, queued_on)
            )
        for msg_id, region in self.lost_envelopes_of.items():
            flying = self.live.get(msg_id)
            if msg_id in self.lone_bodies:
                continue
            if flying is not None and flying.started and flying.envelope is not None:
                # In flight from an envelope that is still there: recovery rebuilds the
                # replacement that was lost from that envelope and the deltas.
                continue
            out = [a for a in out if a.msg_id != msg_id]  # restoring it settles the rest
            queued = flying is not None and not flying.started and flying.envelope_at
            if flying is not None and queued:
                # Still queued on an earlier envelope: the damaged record replaced it (a hold
                # or a release of queued mail; one that ended an attempt would leave the
                # message in flight), or the damage hit its id or what it superseded.
                # Restoring it would leave two live envelopes, and "in flight" it is not.
                # The queued one is held instead, as for lost records of unknown kind: what
                # the lost envelope changed (a hold, say) is unknown, its recipients not.
                held = flying.envelope is not None and flying.envelope.held is not None
                out.append(Affected(msg_id, Verdict.RECORDS_LOST, region, True, held))
                continue
            lost = _lost_envelope(msg_id, region)
            out.append(attrs.evolve(lost, live=False) if flying is None else _in_flight(lost))
        for msg_id, region in self.lone_bodies.items():
            flying = self.live.get(msg_id)
            lost = _lost_envelope(msg_id, self.lost_envelopes_of.get(msg_id, region))
            if flying is None:
                out.append(lost)
            elif flying.started and flying.envelope is None:
                out = [a for a in out if a.msg_id != msg_id]
                out.append(_in_flight(lost))
        return sorted(out, key=lambda a: a.msg_id)


def _positions_named(record: rec.Record) -> list[Position]:
    """The earlier places in the log that ``record`` names."""
    if isinstance(record, rec.Start):
        return [record.envelope_at]
    if isinstance(record, rec.Envelope):
        named = [record.supersedes, record.body.at, record.promoted_from]
        return [p for p in named if p is not None]
    if isinstance(record, rec.Finish):
        return [record.promoted_from] if record.promoted_from is not None else []
    if isinstance(record, rec.Control):
        return list(record.sup)
    return []


def _in_flight(lost: Affected) -> Affected:
    """``lost`` for a message in flight from that envelope: recovery settles it (R5, or
    restored held from the kept copy if the envelope still decodes: R5b)."""
    if lost.verdict is Verdict.ENVELOPE_DAMAGED:
        detail = "recovery restores it, held, with the recipients its attempt left"
        return attrs.evolve(
            lost, verdict=Verdict.ENVELOPE_DAMAGED_IN_FLIGHT, live=True, detail=detail
        )
    detail = "recovery finishes it with the outcomes that survived"
    return attrs.evolve(lost, live=True, detail=detail)


def _lost_envelope(msg_id: str, region: Region) -> Affected:
    """A message whose only envelope was in damaged bytes: restored held if the record
    still decodes as its envelope, else named as lost."""
    if isinstance(region.record, rec.Envelope) and region.record.msg_id == msg_id:
        detail = "restored, held, from the damaged envelope: check its sender and recipients"
        return Affected(msg_id, Verdict.ENVELOPE_DAMAGED, region, False, False, detail)
    detail = "sender and recipients unknown; the damaged bytes are in the copy in corrupt/"
    return Affected(msg_id, Verdict.ENVELOPE_LOST, region, False, False, detail)


def regions_of(scans: Iterable[SegmentScan]) -> Iterator[Region]:
    for scan in scans:
        yield from scan.regions
