"""Damage in the log: finding it, reading past it, and what it means for each message.

Recovery and the queue runners stop at the first frame that fails its check before the
durable end (``CorruptSpool``): nothing is ever skipped silently. This module is for the
operator's tools (``spool check``, ``spool check --repair``), which must say exactly what
is damaged and set only that aside, keeping every intact frame.

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
import re
from collections.abc import Iterable, Iterator

import attrs
import cbor2

from spool import format as fmt
from spool import records as rec
from spool.framing import Frame, encode_frame, pad_frame, parse_frame
from spool.reader import check_segment_header, looks_torn, segment_salt
from spool.records import Position

# The smallest frame any record can be (a START record: id, a position, a class and a
# float time: 45 bytes of CBOR and a 9-byte header). A damaged region smaller than this
# held only padding.
RECORD_FRAME_MIN = 54
# A header whose length field's top byte is 0 (no payload reaches 16 MiB) and whose type
# byte is a frame type: the only offsets worth a CRC check when searching past damage.
_CANDIDATE = re.compile(rb"(?s)(?=.{7}\x00[\x01-\x06\x0f])")


class RegionKind(enum.Enum):
    BODY = "body"  # exactly one message's BODY frame
    BODY_AND_RECORDS = "body and records"  # a BODY frame and unknown frames after it
    PADDING = "padding"  # nothing of value
    RECORDS = "records"  # unknown frames


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

    @property
    def records_lost(self) -> bool:
        return self.kind in (RegionKind.RECORDS, RegionKind.BODY_AND_RECORDS)

    def holds(self, at: Position) -> bool:
        return at.segment == self.segment and self.start <= at.offset < self.end

    def __str__(self) -> str:
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

    @property
    def regions(self) -> list[Region]:
        return [item for _, item in self.items if isinstance(item, Region)]


def scan_segment(data: bytes, number: int, *, newest: bool, durable_end: int) -> SegmentScan:
    """Read segment ``number`` (its bytes ``data``) past any damage (module docstring).

    ``durable_end`` is the offset of this segment up to which the log is known durable (0
    when the restart positions vouch for none of it). Bad bytes in the newest segment at
    or after it that look like an interrupted last write are a torn tail, exactly as
    recovery decides (``reader.LogCursor``): the scan stops there.
    """
    problem = check_segment_header(data, number, "")
    if problem is not None and newest and durable_end == 0:
        return SegmentScan(number, None, problem, (), 0, problem, len(data))
    salt = _salt_of(data, problem)
    if salt is None:
        whole = Region(number, 0, len(data), RegionKind.RECORDS, f"segment header: {problem}")
        return SegmentScan(number, None, problem, ((0, whole),), None, "", len(data))
    items: list[tuple[int, Frame | Region]] = []
    if problem is not None:
        header = Region(number, 0, fmt.SEGMENT_HEADER_SIZE, RegionKind.PADDING, problem)
        items.append((0, header))
    pos = fmt.SEGMENT_HEADER_SIZE
    body_end: tuple[str, int] | None = None  # (msg id, end) of a BODY an envelope announced
    while pos < len(data):
        result = parse_frame(data, pos, salt)
        if isinstance(result, Frame):
            region = _as_marker(result, number, pos)
            items.append((pos, region or result))
            body_end = _announced_body(result, pos)
            pos += result.size
            continue
        reason = getattr(result, "reason", "truncated frame")
        first = pos - pos % fmt.SECTOR
        if newest and pos >= durable_end and looks_torn(data[first:], first, pos, salt):
            return SegmentScan(number, salt, problem, tuple(items), pos, reason, len(data))
        vouched = body_end if body_end is not None and body_end[1] > pos else None
        end = _resync(data, pos, salt, vouched[1] if vouched else None)
        items.append((pos, _classify(data, number, pos, end, salt, vouched, reason)))
        body_end = None
        pos = end
    return SegmentScan(number, salt, problem, tuple(items), None, "", len(data))


def _salt_of(data: bytes, problem: str | None) -> int | None:
    """The segment's salt: from a good header, or from a damaged one if the first frame
    checks with the salt it names (the damage hit another field); None if no salt works."""
    if problem is None:
        return segment_salt(data)
    if len(data) < fmt.SEGMENT_HEADER_SIZE + fmt.FRAME_HEADER_SIZE:
        return None
    raw = fmt.SEGMENT_HEADER.unpack_from(data)[4]
    for salt in (raw, 0):
        if isinstance(parse_frame(data, fmt.SEGMENT_HEADER_SIZE, salt), Frame):
            return int(salt)
    return None


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
    """The first offset after bad bytes at ``pos`` where a valid frame starts (or the end)."""
    low = pos + fmt.FRAME_HEADER_SIZE
    if vouched_end is not None:
        if vouched_end >= len(data):
            return len(data)
        if isinstance(parse_frame(data, vouched_end, salt), Frame):
            return vouched_end
        low = vouched_end
    for match in _CANDIDATE.finditer(data, low):
        if isinstance(parse_frame(data, match.start(), salt), Frame):
            return match.start()
    return len(data)


def _classify(
    data: bytes,
    number: int,
    start: int,
    end: int,
    salt: int,
    vouched: tuple[str, int] | None,
    reason: str,
) -> Region:
    if vouched is not None:
        msg_id, body_end = vouched
        size = min(body_end, end) - start
        if end <= body_end:
            why = f"body of {msg_id} damaged ({reason})"
            return Region(number, start, end, RegionKind.BODY, why, msg_id, size)
        why = f"body of {msg_id} and the records after it damaged ({reason})"
        return Region(number, start, end, RegionKind.BODY_AND_RECORDS, why, msg_id, size)
    if _was_padding(data[start:end]) or end - start < RECORD_FRAME_MIN:
        return Region(number, start, end, RegionKind.PADDING, f"padding damaged ({reason})")
    known = _single_record(data[start:end])
    if known is not None:
        kind, target = known
        why = f"one {kind} record of {target} damaged ({reason})"
        return Region(number, start, end, RegionKind.RECORDS, why, lost=kind, lost_target=target)
    return Region(number, start, end, RegionKind.RECORDS, f"records damaged ({reason})")


def _single_record(raw: bytes) -> tuple[str, str] | None:
    """(kind, message) of the one record ``raw`` held, if its header spans exactly ``raw``
    and its payload still decodes as a record of the header's type; else None. A flipped
    type byte makes the payload fail to decode as that type, so the kind is reliable; the
    message id may itself be damaged, so it is only used to narrow, never to settle."""
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
    return fmt.TYPE_NAMES[ftype], target


def _was_padding(raw: bytes) -> bool:
    """A PAD frame whose header survived (type 15, the right length) and whose payload is
    still zeros but for a few flipped bytes: no record can look like that."""
    if len(raw) < fmt.FRAME_HEADER_SIZE:
        return False
    _crc, length, ftype = fmt.FRAME_HEADER.unpack_from(raw)
    payload = raw[fmt.FRAME_HEADER_SIZE :]
    nonzero = len(payload) - payload.count(0)
    return ftype == fmt.T_PAD and length == len(payload) and nonzero <= 8


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
    if record.target and record.body:
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
    )


# --- markers ---------------------------------------------------------------------------


def replacement(region: Region, salt: int, at: float, copy: str) -> bytes:
    """The bytes a repair writes in place of ``region``: a ``damaged`` marker frame of
    exactly its size, or a PAD frame where nothing of value was lost (or no marker fits)."""
    size = region.end - region.start
    if region.kind is not RegionKind.PADDING and size >= RECORD_FRAME_MIN:
        target = region.body_of or region.lost_target
        marker = rec.Control(rec.DAMAGED, target, at, region.body_bytes, copy, region.lost)
        payload = _sized_marker(marker, size - fmt.FRAME_HEADER_SIZE)
        if payload is not None:
            return encode_frame(fmt.T_CONTROL, payload, salt)
    return pad_frame(size, salt)


def _sized_marker(marker: rec.Control, size: int) -> bytes | None:
    """The marker's CBOR map with a ``pad`` byte string that makes it exactly ``size``
    bytes (readers ignore unknown keys), or None if no padding fits."""
    base = rec.control_map(marker)
    for extra in ({}, {"_": ""}):  # a filler key steps over a CBOR length-prefix boundary
        empty = len(cbor2.dumps({**base, **extra, "pad": b""}))
        need = size - empty
        for k in range(max(0, need - 8), need + 1):
            payload = cbor2.dumps({**base, **extra, "pad": bytes(k)})
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


@attrs.frozen
class Affected:
    """One message the damage touched, and why."""

    msg_id: str
    verdict: Verdict
    region: Region
    live: bool  # still queued (an envelope or an attempt that nothing settled)
    held: bool = False
    detail: str = ""


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
        self.previous: tuple[Position, Frame | Region] | None = None

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
        self.regions.append(region)
        if region.body_of:
            self.lost_bodies[pos] = region
        if not region.records_lost:
            return
        target = self.live.get(region.lost_target)
        if region.lost in (_ENVELOPE, _FINISH, _CONTROL):
            # Safe to lose alone: a replacement envelope's attempt is rebuilt by recovery
            # from its start and deltas (a first envelope's body, if it follows, is named
            # as a lone body); a finish likewise; an outcome acknowledgement costs at most
            # a second bounce.
            return
        # A lost start endangers the message it started (if that is still unstarted here),
        # a lost delta the attempt it belongs to (if that is in flight here).
        wanted = {_START: False, _DELTA: True}.get(region.lost)
        if target is not None and wanted is not None and target.started == wanted:
            self.suspects.setdefault(region.lost_target, region)
        else:
            # Unknown records: a start or a delivered delta of any message live here may
            # have been among them; attempting it again could deliver twice.
            for msg_id in self.live:
                self.suspects.setdefault(msg_id, region)

    def _body(self, pos: Position, frame: Frame) -> None:
        if self.previous is not None and isinstance(self.previous[1], Region):
            # A BODY frame right after damage: its first envelope was in the damage.
            msg_id = frame.payload[: fmt.MSG_ID_LENGTH].decode("ascii", "replace")
            self.lone_bodies[msg_id] = self.previous[1]

    def _record(self, pos: Position, frame: Frame, record: rec.Record) -> None:
        if isinstance(record, rec.Envelope):
            body = record.body
            if body.kind == rec.BODY_INLINE and body.at is None:
                body = rec.BodyRef(
                    body.kind, body.size, Position(pos.segment, pos.offset + frame.size)
                )
            self.live[record.msg_id] = _Live(pos, record, body)
            self._reestablished(record.msg_id)
        elif isinstance(record, rec.Start):
            state = self.live.get(record.msg_id)
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
            self.live.pop(record.msg_id, None)
            self._reestablished(record.msg_id)
            self.lost_envelopes.pop(record.msg_id, None)

    def _reestablished(self, msg_id: str) -> None:
        self.suspects.pop(msg_id, None)
        self.lone_bodies.pop(msg_id, None)

    def verdicts(self) -> list[Affected]:
        out: list[Affected] = []
        for msg_id, state in self.live.items():
            env = state.envelope
            held = env is not None and env.held is not None
            body = state.body
            lost_at = body.at if body is not None and body.kind == rec.BODY_INLINE else None
            region = self.lost_bodies.get(lost_at) if lost_at is not None else None
            if region is not None:
                out.append(Affected(msg_id, Verdict.BODY_LOST, region, True, held))
            elif body is not None and body.kind == rec.BODY_FILE and msg_id in self.bad_files:
                file_region = Region(0, 0, 0, RegionKind.BODY, "body file damaged or missing")
                out.append(Affected(msg_id, Verdict.BODY_LOST, file_region, True, held))
            elif msg_id in self.lost_envelopes:
                detail = "recovery finishes it with the outcomes that survived"
                region = self.lost_envelopes[msg_id]
                out.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, True, False, detail))
            elif msg_id in self.suspects:
                out.append(
                    Affected(msg_id, Verdict.RECORDS_LOST, self.suspects[msg_id], True, held)
                )
        for msg_id, region in self.lone_bodies.items():
            if msg_id not in self.live:
                detail = "sender and recipients unknown; its data is in the copy in corrupt/"
                out.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, False, False, detail))
        return sorted(out, key=lambda a: a.msg_id)


def regions_of(scans: Iterable[SegmentScan]) -> Iterator[Region]:
    for scan in scans:
        yield from scan.regions
