"""Opening a spool is recovery: read the restart positions, scan the working suffix.

The procedure (docs/design.md, "Recovery", has it with its invariants):

1. Load the restart positions; missing or damaged means "scan from the oldest segment".
2. Check the segment files form a contiguous run (a gap is corruption).
3. Scan from the working-suffix start to the end of the log, checking every frame. A bad
   frame before the positions' consistent end is ``CorruptSpool``; at the end of the
   newest segment it is a torn tail, cut off here (truncate + fdatasync).
4. Collect, for each start record with no later replacement or finish, its deltas; note
   every envelope superseded ahead of the runners; replay body references after the
   consistent end.
5. Decide each working message with ``DECISIONS`` (below): replace, finish, or hold.

The caller (``Spool.open``) then starts the writer on a fresh segment, appends the
decided records, syncs, and writes new restart positions. A crash anywhere in this
leaves the same positions and a log that now may contain some of the decided records;
the next recovery sees them as settlements (case R1) and converges.

Crash safety:
    The only writes here are the torn-tail cut and the removal of an empty torn newest
    segment. Both remove bytes no caller was told were durable (writer invariant W1), and
    both are idempotent: a crash before they are durable makes the next recovery redo them.

Errors:
    ``CorruptSpool`` for damage that no crash explains.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import time
from collections.abc import Callable
from typing import Final

import attrs

from spool import format as fmt
from spool import records as rec
from spool.bodies import body_file_paths, is_body_entry, read_body, read_body_file
from spool.damage import single_record
from spool.errors import CorruptSpool
from spool.framing import Frame
from spool.fs import FileSystem, read_file, write_file_durably
from spool.options import SpoolOptions
from spool.positions import RestartPositions, load_positions, pin_body, unpin_body, unretired
from spool.reader import (
    LogCursor,
    SkippedBody,
    TornTail,
    list_segments,
    read_frame_at,
    written_bytes,
)
from spool.records import Position


class Decision(enum.Enum):
    SETTLED = "settled"  # nothing to write
    REPLACE = "replace"  # write a replacement envelope with the remaining recipients
    FINISH = "finish"  # write a finish record: no recipient remains
    HOLD = "hold"  # write a held replacement envelope: crash-loop breaker
    FINISH_LOST = "finish, envelope lost"  # write a finish with the outcomes that survived


ANY = None  # a fact the row does not depend on


@attrs.frozen
class Case:
    label: str
    settled: bool | None
    envelope_lost: bool | None
    remaining: bool | None
    crash_loop: bool | None
    decision: Decision
    cause: str

    def matches(self, facts: tuple[bool, bool, bool, bool]) -> bool:
        mine = (self.settled, self.envelope_lost, self.remaining, self.crash_loop)
        return all(want is ANY or want == have for want, have in zip(mine, facts, strict=True))


# Every combination of facts about a message whose start record is in the scanned suffix.
# (settled: a replacement or finish follows the start; envelope_lost: the envelope the
# start names lies in bytes a repair set aside as damaged (a "damaged" marker); remaining:
# recipients left after the deltas; crash_loop: this crash brings the message's crash
# count to the limit.)
DECISIONS: tuple[Case, ...] = (
    Case("R1", True, ANY, ANY, ANY, Decision.SETTLED, "crash after the attempt closed"),
    Case("R2", False, False, True, False, Decision.REPLACE, "crash during a delivery attempt"),
    Case("R3", False, False, True, True, Decision.HOLD, "in flight at K crashes"),
    Case("R4", False, False, False, ANY, Decision.FINISH, "crash after the last delta"),
    Case(
        "R5",
        False,
        True,
        ANY,
        ANY,
        Decision.FINISH_LOST,
        "media damage took the envelope; spool check --repair set it aside",
    ),
)


def decide(settled: bool, envelope_lost: bool, remaining: bool, crash_loop: bool) -> Case:
    """Look up the decision-table row for these facts (exactly one matches)."""
    facts = (settled, envelope_lost, remaining, crash_loop)
    rows = [c for c in DECISIONS if c.matches(facts)]
    assert len(rows) == 1, (facts, rows)
    return rows[0]


ENVELOPE_LOST_REASON = "envelope lost to disk damage"
BODY_LOST_REASON = "message data lost to disk damage"
# R6: the finish of a message whose outcome was acknowledged, written again (the first was
# lost to damage). Nothing is handed out for it: its outcome was acknowledged once.
FINISH_LOST_REASON = "finish lost to disk damage; its outcome had been acknowledged"
# The hold reason of the crash-loop breaker (R3; also a worker that died in an attempt).
CRASH_LOOP_HOLD: Final = "crash loop: in flight at {crashes} crashes"
RESTORED_HOLD = (
    "restored from an envelope damaged at {where} while in flight: check its sender and "
    "recipients before releasing it"
)
BODY_LOST_REPLY = (
    "554 5.3.0 message data lost in the spool: its log segment was gone and no copy was found"
)


@attrs.frozen
class RecoveryReport:
    """What recovery did; ``Spool.recovery``."""

    positions_used: bool
    scanned_from: Position | None
    records_scanned: int
    bytes_scanned: int
    working_found: int
    replacements_written: int
    finishes_written: int
    held_for_crash_loop: int
    torn_bytes_cut: int  # written bytes of the tail cut (not the zeros after them, W6)
    torn_at: Position | None
    segments: int
    seconds: float
    orphan_bodies: int = 0  # body files in incoming/ that no envelope names: removed


@attrs.define
class _Working:
    start_at: Position
    envelope_at: Position
    klass: int
    delivered: dict[str, tuple[str, str, float]] = attrs.field(factory=dict)
    settled: bool = False
    # An operator action recorded while the attempt was in flight (control records):
    # a hold reason, and the (status, reply) that ends the rest for a delete or bounce.
    hold: str | None = None
    ending: tuple[str, str] | None = None
    # An outcome acknowledgement of the message follows its start and nothing settled it:
    # its finish was lost to damage (R6).
    acknowledged: bool = False


@attrs.define
class RecoveredState:
    """What the spool needs to resume: writer start, runner state, records to write."""

    next_segment: int
    first_segment: int
    cursors: list[Position]
    superseded: set[Position]
    body_refs: dict[int, int]
    outcome_front: Position
    outcome_acked: set[str]
    bodies_to_remove: list[str]
    to_write: list[rec.Record]
    working_at: list[Position]
    report: RecoveryReport
    # Body files in incoming/ that a scanned envelope names: moved to bodies/ by the
    # first checkpoint (bodies.py).
    incoming_named: list[str] = attrs.Factory(list)
    # The positions file describes the log exactly as found (nothing past its consistent
    # end, nothing decided, nothing to remove): an open that appends nothing need not
    # write it again, so a command that changes nothing writes nothing.
    positions_current: bool = False
    # The oldest segment file on disk, retired leftovers included: a checkpoint whose
    # front lies past it has segments to free, and must write positions to free them.
    oldest_on_disk: int = 1


def _scan_start(
    positions: RestartPositions | None, segments: list[int], n_classes: int
) -> tuple[RestartPositions | None, Position]:
    """Where to scan from; drops positions that do not fit the log on disk."""
    oldest = Position(segments[0], 0)
    if positions is None:
        return None, oldest
    usable = (
        len(positions.cursors) == n_classes
        and positions.working_start.segment >= segments[0]
        and positions.consistent.segment <= segments[-1]
        and all(c.segment >= segments[0] for c in positions.cursors)
    )
    if not usable:
        return None, oldest
    return positions, min(positions.working_start, positions.consistent)


def _durable_end(loaded: RestartPositions | None, segments: list[int]) -> Position:
    """Where the log is known durable up to: the positions' consistent end, even when the
    positions do not fit the spool's settings any more (a crash after an open recorded
    other retry classes, before its checkpoint): bad bytes before it are damage, never a
    tail to cut."""
    oldest = Position(segments[0], 0)
    if loaded is None or loaded.consistent.segment > segments[-1]:
        return oldest
    return max(loaded.consistent, oldest)


def recover(
    fs: FileSystem,
    root: str,
    *,
    options: SpoolOptions,
    clock: Callable[[], float],
    dry_run: bool = False,
) -> RecoveredState:
    """Scan what must be scanned and decide every message that was in flight.

    ``options`` gives the retry classes and the crash-loop limit. With ``dry_run`` nothing
    is written: the decisions are computed and reported (``spool recover --dry-run``,
    ``spool check``).
    """
    started = time.monotonic()
    n_classes = options.last_class + 1
    log_dir = os.path.join(root, fmt.LOG_DIR)
    segments = list_segments(fs, log_dir)
    if not segments:
        first = Position(1, fmt.SEGMENT_HEADER_SIZE)
        # No log: no envelope names any file in incoming/ (a crash during the first accept).
        _, orphans = _incoming_files(fs, root, set(), [])
        report = RecoveryReport(False, None, 0, 0, 0, 0, 0, 0, 0, None, 0, 0.0, len(orphans))
        return RecoveredState(
            1, 1, [first] * n_classes, set(), {}, first, set(), orphans, [], [], report
        )
    loaded = load_positions(fs, root)
    oldest_on_disk = segments[0]
    segments = unretired(segments, loaded)
    for prev, nxt in itertools.pairwise(segments):
        if nxt != prev + 1:
            raise CorruptSpool(
                os.path.join(log_dir, fmt.segment_name(prev + 1)), 0, "segment file is missing"
            )
    positions, start = _scan_start(loaded, segments, n_classes)
    consistent = positions.consistent if positions else Position(segments[0], 0)
    cursor = LogCursor(
        fs,
        log_dir,
        start,
        durable_end=_durable_end(loaded, segments),
        newest_segment=segments[-1],
        beside_owner=dry_run,  # a dry run (``spool check``'s) may read beside an owner
    )
    working: dict[str, _Working] = {}
    superseded: set[Position] = set(positions.superseded) if positions else set()
    pins = _Pins(dict(positions.body_refs) if positions else {}, consistent)
    acked: set[str] = set(positions.outcome_acked) if positions else set()
    # Finishes after the positions were written with tracking on only if the positions say
    # it was on (an open that turns it on writes positions before any finish of its own).
    tracked = options.outcomes and (loaded is None or bool(loaded.settings.get("outcomes", True)))
    dead_bodies: list[str] = []
    # Messages a scanned envelope gives a body file, and those whose files the positions
    # say stay in incoming/ past them (``Checkpointer._settle_staged``): never leftovers.
    named_files: set[str] = set(loaded.unsettled) if loaded else set()
    records = 0
    past_positions = 0  # frames at or after the positions' consistent end
    # A message's first envelope and its BODY frame are appended as one piece; the
    # envelope counts only once its body has been read (see _unpaired_envelope).
    awaiting: tuple[Position, rec.Envelope, int] | None = None
    damaged: list[tuple[Position, int]] = []  # "damaged" markers a repair left: (at, size)
    try:
        for pos, frame in cursor:
            records += 1
            past_positions += pos >= consistent
            if awaiting is not None:
                env_at, env, env_size = awaiting
                if not _is_body_after(frame, pos, env_at, env, env_size):
                    raise CorruptSpool(
                        cursor.path(env_at.segment), env_at.offset, "envelope without its body"
                    )
                _apply(env, env_at, env_size, env_at >= consistent, working, superseded, pins)
                awaiting = None
                continue
            if isinstance(frame, SkippedBody) or frame.type in (fmt.T_BODY, fmt.T_PAD):
                continue
            record = rec.decode_stored(
                frame.type, frame.payload, cursor.path(pos.segment), pos.offset
            )
            if _has_inline_body_next(record):
                assert isinstance(record, rec.Envelope)
                awaiting = (pos, record, frame.size)
                continue
            after = pos >= consistent
            _apply(record, pos, frame.size, after, working, superseded, pins)
            if (
                isinstance(record, rec.Envelope) or (isinstance(record, rec.Finish) and tracked)
            ) and record.body.kind == rec.BODY_FILE:
                # (With outcome tracking a finish may name a copy made as it finished.)
                named_files.add(record.msg_id)
            if isinstance(record, rec.Control) and record.action == rec.OUTCOME_ACK:
                acked.add(record.target)
                flying = working.get(record.target)
                if flying is not None and not flying.settled:
                    # An acknowledgement follows only a durable finish (outcome_desk.py):
                    # this attempt's finish was lost to damage a repair set aside (R6). A
                    # finish that recovery wrote for it since comes later and settles it.
                    flying.acknowledged = True
                if after:
                    # With outcome tracking a body file lives until its outcome is
                    # acknowledged (outcomes.py); a crash may have kept it past that.
                    dead_bodies.append(record.target)
            elif isinstance(record, rec.Control) and record.action == rec.DAMAGED:
                damaged.append((pos, frame.size))
                superseded.update(record.sup)  # envelopes the lost bytes had used up
                _lost_start(fs, log_dir, record, pos, working)
            elif isinstance(record, rec.Control) and record.action == rec.USED_UP:
                superseded.update(record.sup)  # a repair's note: lost starts used them up
            elif isinstance(record, rec.Control) and record.action in rec.IN_FLIGHT_ACTIONS:
                _operator_in_flight(record, working)
            elif (
                isinstance(record, rec.Finish)
                and after
                and record.body.kind == rec.BODY_FILE
                and not tracked
            ):
                dead_bodies.append(record.msg_id)
    finally:
        cursor.close()
    torn = _unpaired_envelope(cursor, awaiting, consistent, segments[-1])
    torn_bytes = _torn_bytes(fs, log_dir, torn.at) if torn is not None else 0
    if torn is not None and not dry_run:
        _cut_torn_tail(fs, root, log_dir, torn.at)
    if not dry_run:
        _make_durable(fs, root, [s for s in segments if s >= start.segment])
    cursors = list(positions.cursors) if positions else [Position(segments[0], 0)] * n_classes
    low = min(cursors)
    superseded = {p for p in superseded if p >= low}
    to_write, held = _decide_all(
        fs, root, working, damaged, segments[0], options, clock(), named_files, pins
    )
    pins.settle()
    # Pins of segments already deleted (a full scan replays finishes of messages whose
    # bodies went with them) mean nothing: keep only live segments with live bodies.
    body_refs = {seg: n for seg, n in pins.counts.items() if seg >= segments[0] and n > 0}
    named, orphans = _incoming_files(fs, root, named_files, damaged)
    dead_bodies.extend(orphans)
    live = [w.start_at for w in working.values() if not w.settled]
    report = RecoveryReport(
        positions_used=positions is not None,
        scanned_from=start,
        records_scanned=records,
        bytes_scanned=cursor.bytes_read,
        working_found=len(live),
        replacements_written=sum(isinstance(r, rec.Envelope) for r in to_write),
        finishes_written=sum(isinstance(r, rec.Finish) for r in to_write),
        held_for_crash_loop=held,
        torn_bytes_cut=torn_bytes,
        torn_at=torn.at if torn else None,
        segments=len(segments),
        seconds=time.monotonic() - started,
        orphan_bodies=len(orphans),
    )
    next_segment = segments[-1] + 1
    if torn is not None and not dry_run and torn.at.offset < fmt.SEGMENT_HEADER_SIZE:
        # The newest segment was removed (its header never became durable): its number
        # is free again, and reusing it keeps the segment numbers contiguous.
        next_segment = torn.at.segment
    outcome_front = positions.outcome_front if positions else Position(segments[0], 0)
    if options.outcomes and not tracked:
        # Tracking is turned on at this open: it tracks the mail that finishes from now on.
        outcome_front = Position(next_segment, 0)
    return RecoveredState(
        next_segment=next_segment,
        first_segment=segments[0],
        cursors=cursors,
        superseded=superseded,
        body_refs=body_refs,
        outcome_front=outcome_front,
        outcome_acked=acked,
        bodies_to_remove=dead_bodies,
        to_write=to_write,
        working_at=live,
        report=report,
        incoming_named=named,
        positions_current=(
            positions is not None
            and torn is None
            and past_positions == 0
            and consistent.segment == segments[-1]
            and not (to_write or dead_bodies or damaged or live or named)
        ),
        oldest_on_disk=oldest_on_disk,
    )


def _incoming_files(
    fs: FileSystem, root: str, named_files: set[str], damaged: list[tuple[Position, int]]
) -> tuple[list[str], list[str]]:
    """The body files in incoming/ that a scanned envelope names, and the orphans.

    Every envelope that can name a file in incoming/ lies in the scanned suffix: the scan
    starts at or before the consistent end of the restart positions, and the checkpoint
    that writes them first moves to bodies/ every file whose envelope lies before that end
    (an envelope appended after the positions were taken lies after it). So a file no
    scanned envelope names was left by a crash between the file and its envelope (or its
    finish, for a copy kept for a bounce), and no mail refers to it. With damage set
    aside in the suffix, the envelope may have been in it: such files are kept for
    ``spool check`` to match.
    """
    incoming = os.path.join(root, fmt.INCOMING_DIR)
    try:
        names = sorted(fs.listdir(incoming))
    except FileNotFoundError:
        return [], []
    named = [n for n in names if n in named_files]
    orphans = [] if damaged else [n for n in names if n not in named_files]
    # Only a regular file with no namesake in bodies/ is an accept's leftover: anything
    # else (a directory, a FIFO, a file beside a settled body) was put there by someone
    # else; ``spool check`` names it and the repair moves it aside. Removing it would
    # remove the settled file too (``Checkpoints._remove_bodies`` unlinks both names).
    orphans = [n for n in orphans if _lone_staged_file(fs, root, n)]
    return named, orphans


def _lone_staged_file(fs: FileSystem, root: str, name: str) -> bool:
    """Whether incoming/``name`` is a body file (a regular file, not a link) with nothing
    at all of that name in bodies/ (not even a link to nothing)."""
    staged, settled = body_file_paths(root, name)
    return is_body_entry(fs, staged) and not fs.lexists(settled)


def _make_durable(fs: FileSystem, root: str, scanned: list[int]) -> None:
    """(R0) Make durable everything the scan read, before anything built on it is written.

    After a process crash (``kill -9``) the dead owner's last batches may still be only in
    the page cache: the scan reads them and decides on them (a replacement settles a
    message, a start supersedes an envelope), and the restart positions written next say
    the log is consistent up to a point past them. A power cut would then take those
    records back while the decisions built on them stay: a superseded envelope whose
    replacement no longer exists is mail lost. So every scanned segment is fdatasynced
    (a clean one costs little) and the log directory fsynced (the newest segment's entry
    may not be durable yet), restoring W3 before the writer creates a new segment.

    The same holds for the body directories: the dead owner may have moved a file from
    incoming/ to bodies/ (or unlinked one) without the directory fsyncs; positions written
    past its envelope would let a power cut put the file back in incoming/, where the next
    recovery, no longer scanning that envelope, would take it for an orphan. Both are
    fsynced too.
    """
    log_dir = os.path.join(root, fmt.LOG_DIR)
    for sub in (fmt.INCOMING_DIR, fmt.BODY_DIR):
        with contextlib.suppress(FileNotFoundError):  # a spool an earlier build made
            fs.fsync_dir(os.path.join(root, sub))
    for seg in scanned:
        path = os.path.join(log_dir, fmt.segment_name(seg))
        try:
            fd = fs.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # the torn newest segment that recovery removed
        try:
            fs.fdatasync(fd)
        finally:
            fs.close(fd)
    fs.fsync_dir(log_dir)


def _has_inline_body_next(record: rec.Record) -> bool:
    """Whether ``record`` is a first envelope, whose BODY frame follows it directly."""
    return (
        isinstance(record, rec.Envelope)
        and record.body.kind == rec.BODY_INLINE
        and record.body.at is None
    )


def _is_body_after(
    frame: Frame | SkippedBody,
    pos: Position,
    env_at: Position,
    env: rec.Envelope,
    env_size: int,
) -> bool:
    """Whether ``frame`` at ``pos`` is the body of the first envelope ``env`` before it:
    its BODY frame, or what a repair wrote in place of that frame (``is_damaged_body``)."""
    if pos != Position(env_at.segment, env_at.offset + env_size):
        return False
    if isinstance(frame, SkippedBody) or frame.type == fmt.T_BODY:
        return True
    return is_damaged_body(frame, env)


def is_damaged_body(frame: Frame, env: rec.Envelope) -> bool:
    """Whether ``frame``, right after the first envelope ``env``, is what ``spool check
    --repair`` left in place of its damaged BODY frame: a ``damaged`` marker with ``body``
    (naming the message or no message), or a PAD frame of exactly the BODY frame's size,
    where no marker fitted (the writer never pads between an envelope and its body)."""
    if frame.type == fmt.T_PAD:
        return frame.size == fmt.FRAME_HEADER_SIZE + fmt.MSG_ID_LENGTH + env.body.size
    if frame.type != fmt.T_CONTROL:
        return False
    try:
        record = rec.decode(frame.type, frame.payload)
    except rec.RecordError:
        return False
    return (
        isinstance(record, rec.Control)
        and record.action == rec.DAMAGED
        and record.target in ("", env.msg_id)
        and record.body > 0
    )


def _unpaired_envelope(
    cursor: LogCursor,
    awaiting: tuple[Position, rec.Envelope, int] | None,
    consistent: Position,
    newest: int,
) -> TornTail | None:
    """The torn tail to cut, moved back over a first envelope whose body did not survive.

    An envelope and its BODY frame are written in one batch; a tear can keep the envelope
    and lose the body. The accept was not acknowledged (its fdatasync did not return), so
    the pair goes together: the cut starts at the envelope. The same envelope before the
    durable end, or in an older segment, is corruption.
    """
    torn = cursor.torn
    if awaiting is None:
        return torn
    env_at, _env, _size = awaiting
    if env_at < consistent or env_at.segment != newest:
        raise CorruptSpool(cursor.path(env_at.segment), env_at.offset, "envelope without its body")
    file_size = cursor.file_size(env_at.segment)
    reason = torn.reason if torn is not None else "log ends after an envelope"
    return TornTail(env_at, file_size, f"{reason}: cut with the envelope it belongs to")


@attrs.define
class _Pins:
    """The segment pins of inline bodies as the scan replays them, paired message by
    message (``body_refs``: docs/design.md, "Bodies").

    A first envelope at or after ``consistent`` takes a pin (the positions count those
    before it); a finish or a promotion at or after ``consistent`` releases the pin its
    message holds: one taken in this scan, or one the positions count (its body lies
    before ``consistent``). Damage a repair set aside can take one side of a pair: a
    message whose first envelope is gone took no pin here, and releases none (it would
    release another message's); one still live at the end of the scan whose body no pin
    counts is pinned then (``settle``), so that the spool's release when it ends
    (its finish, at run time or decided below) pairs with a pin."""

    counts: dict[int, int]
    consistent: Position
    taken: dict[str, Position] = attrs.Factory(dict)  # first envelopes pinned in this scan
    inline: dict[str, rec.BodyRef] = attrs.Factory(dict)  # each live message's inline body

    def envelope(self, env: rec.Envelope, pos: Position, size: int, after: bool) -> None:
        body = resolve_body(env, pos, size)
        if env.supersedes is None and after and body.at is not None:
            pin_body(self.counts, pos.segment)  # the BODY frame follows the envelope
            self.taken[env.msg_id] = body.at
        if after and env.promoted_from is not None:
            self.release(env.msg_id, env.promoted_from)
        if body.at is not None:
            self.inline[env.msg_id] = body
        else:
            self.inline.pop(env.msg_id, None)

    def finish(self, record: rec.Finish, after: bool) -> None:
        # The inline body is released: named by the finish, or copied from as it finished.
        inline = record.body.at if record.body.kind == rec.BODY_INLINE else record.promoted_from
        if after and inline is not None:
            self.release(record.msg_id, inline)
        self.inline.pop(record.msg_id, None)

    def release(self, msg_id: str, at: Position) -> None:
        if self.taken.pop(msg_id, None) is not None or at < self.consistent:
            unpin_body(self.counts, at.segment)

    def settle(self) -> None:
        """At the end of the scan (and of the decisions: ``inline`` holds every message
        that lives on with an inline body): a pin taken by a message that no longer has
        one is released (the promotion that released it was lost to damage: its later
        envelopes name a body file, or it finished naming one); a live inline body that
        no pin counts is pinned."""
        for msg_id, at in list(self.taken.items()):
            if msg_id not in self.inline:
                self.release(msg_id, at)
        for msg_id, body in self.inline.items():
            assert body.at is not None, "resolve_body resolves an inline body"
            if msg_id in self.taken or body.at < self.consistent:
                continue  # counted: here, or by the positions
            pin_body(self.counts, body.at.segment)  # (a live segment: past ``consistent``)
            self.taken[msg_id] = body.at


def _apply(
    record: rec.Record,
    pos: Position,
    size: int,
    after_consistent: bool,
    working: dict[str, _Working],
    superseded: set[Position],
    pins: _Pins,
) -> None:
    """Fold one scanned record into the recovery state."""
    if isinstance(record, rec.Start):
        working[record.msg_id] = _Working(pos, record.envelope_at, record.klass)
        superseded.add(record.envelope_at)
    elif isinstance(record, rec.Delta):
        w = working.get(record.msg_id)
        if w is not None and not w.settled and record.status != rec.DEFERRED:
            for r in record.recipients:
                w.delivered[r] = (record.status, record.reply, record.at)
    elif isinstance(record, rec.Envelope):
        if record.supersedes is not None:
            superseded.add(record.supersedes)
            w = working.get(record.msg_id)
            if w is not None:
                w.settled = True
        pins.envelope(record, pos, size, after_consistent)
    elif isinstance(record, rec.Finish):
        w = working.get(record.msg_id)
        if w is not None:
            w.settled = True
        pins.finish(record, after_consistent)


# What the rest of a message's recipients become after an operator ended it in flight.
_ENDING_STATUS = {rec.IN_FLIGHT_DELETE: rec.DELETED, rec.IN_FLIGHT_BOUNCE: rec.FAILED}
_ENDING_REASON = {rec.DELETED: "deleted by the operator", rec.FAILED: "bounced by the operator"}


def _operator_in_flight(record: rec.Control, working: dict[str, _Working]) -> None:
    """Note an operator action taken while the message's attempt was in flight; it is
    applied when the attempt is decided (the spool writes the record only then, so an
    attempt already settled ignores it)."""
    w = working.get(record.target)
    if w is None or w.settled:
        return
    if record.action == rec.IN_FLIGHT_HOLD:
        w.hold = record.why
    elif record.action == rec.IN_FLIGHT_RELEASE:
        w.hold = None
    else:
        w.ending = (_ENDING_STATUS[record.action], record.why)


def _decide_all(
    fs: FileSystem,
    root: str,
    working: dict[str, _Working],
    damaged: list[tuple[Position, int]],
    first_segment: int,
    options: SpoolOptions,
    now: float,
    named_files: set[str],
    pins: _Pins,
) -> tuple[list[rec.Record], int]:
    """Records that settle every message left in flight, in start-record order, and how
    many of them the crash-loop breaker held. A message whose successor names a body file
    found in incoming/ is added to ``named_files`` (the file moves to bodies/); the inline
    body of an envelope read back from a repair's copy (R5b) is the message's live inline
    body in ``pins`` (pinned there if no pin counts it yet)."""
    log_dir = os.path.join(root, fmt.LOG_DIR)
    out: list[rec.Record] = []
    held_for_crash_loop = 0
    for msg_id, w in sorted(working.items(), key=lambda kv: kv[1].start_at):
        if w.settled:
            continue
        known = pins.inline.get(msg_id)  # the inline body its scanned envelopes name
        retired = w.envelope_at.segment < first_segment
        marked_after = any(at > w.start_at for at, _size in damaged)
        gone = _in_damaged(w.envelope_at, damaged) or (retired and marked_after)
        if w.acknowledged and (retired or gone):
            # R6 with its envelope past reading: the body as R5 names it.
            out.append(finish_acknowledged(msg_id, now, _named_body(known)))
            continue
        kept = kept_envelope(fs, root, msg_id, w.envelope_at) if gone and not retired else None
        if gone and kept is None:
            # R5: the envelope is gone: in bytes a repair set aside, or (its attempt's
            # settling record set aside after the start) in a segment retired since. Its
            # recipients are unknown but for those the deltas settled: finish it with
            # those, so that it is never attempted from a guess.
            assert decide(False, True, False, False).decision is Decision.FINISH_LOST
            out.append(_finish_lost(msg_id, w, now, known))
            continue
        frame = read_frame_at(fs, log_dir, w.envelope_at)
        try:
            env: rec.Record | None = rec.decode(frame.type, frame.payload)
        except rec.RecordError:
            env = None  # a BODY or PAD frame, or a checked frame that holds no record
        if kept is not None:
            env = kept  # the marker's stand-in: the record as it decodes in the kept copy
        if not isinstance(env, rec.Envelope) or env.msg_id != msg_id:
            path = os.path.join(log_dir, fmt.segment_name(w.envelope_at.segment))
            raise CorruptSpool(path, w.envelope_at.offset, f"start of {msg_id} names no envelope")
        body = resolve_body(env, w.envelope_at, frame.size)
        if w.acknowledged:
            # R6. (An inline body in a segment retired since, which a promotion set aside
            # as damage had released, holds no pin: releasing it again counts nothing.)
            out.append(finish_acknowledged(msg_id, now, body, env))
            continue
        reason = "all recipients settled"
        if body.kind == rec.BODY_INLINE and body.at is not None and body.at.segment < first_segment:
            # The start names an envelope whose inline body lay in a segment retired since:
            # its pin was released when a later envelope named a copy in a body file (a
            # promotion), and that envelope is gone (a repair set it aside as damaged).
            copy = _promoted_copy(fs, root, msg_id, body)
            if copy is not None:
                body = copy
                named_files.add(msg_id)
            else:
                # No copy either: the message data is lost. The recipients left fail, so
                # that the sender is told (never attempted without a body, never dropped),
                # unless the operator ended it in flight (a delete or bounce stands).
                body = rec.BodyRef(rec.BODY_FILE, 0)
                w.ending = w.ending or (rec.FAILED, BODY_LOST_REPLY)
        if w.ending is not None:
            # The operator ended it in flight: the rest of its recipients end as asked (R4).
            status, reply = w.ending
            for r in env.recipients:
                w.delivered.setdefault(r, (status, reply, now))
            reason = BODY_LOST_REASON if reply == BODY_LOST_REPLY else _ENDING_REASON[status]
        outcomes = env.outcomes + tuple(
            rec.Outcome(r, st, reply, at) for r, (st, reply, at) in w.delivered.items()
        )
        remaining = tuple(r for r in env.recipients if r not in w.delivered)
        if kept is not None and not remaining:
            # A damaged record never settles mail: the finish is written as for a lost
            # envelope (R5), with the outcomes the deltas recorded.
            out.append(_finish_lost(msg_id, w, now, known))
            continue
        crashes = env.crashes + 1
        case = decide(False, False, bool(remaining), crashes >= options.crash_limit)
        if case.decision is Decision.FINISH:
            out.append(rec.Finish(msg_id, now, body, outcomes, reason, env.sender, env.accepted_at))
            continue
        # Held by the crash-loop breaker (R3), or by the operator during the attempt.
        held: str | None = w.hold if w.hold is not None else env.held
        if case.decision is Decision.HOLD:
            held = CRASH_LOOP_HOLD.format(crashes=crashes)
        if kept is not None:
            # Restored from a damaged envelope: held for the operator to check (R5b). Its
            # file moves to bodies/; its inline body's segment stays pinned until the
            # message ends (by its first envelope's pin, or, if that one is gone too, by
            # one taken for it now: ``_Pins.settle``).
            held = RESTORED_HOLD.format(where=w.envelope_at)
            if body.kind == rec.BODY_FILE:
                named_files.add(msg_id)
                pins.inline.pop(msg_id, None)  # a promotion set aside: it released the pin
            else:
                pins.inline[msg_id] = body
        hold = case.decision is Decision.HOLD or w.hold is not None or kept is not None
        klass = options.last_class if hold else options.class_for_attempts(env.attempts + 1)
        out.append(
            successor_envelope(
                env,
                w.envelope_at,
                remaining=remaining,
                outcomes=outcomes,
                body=body,
                now=now,
                klass=klass,
                held=held,
                crashes=crashes,
                last_reply=env.last_reply,
            )
        )
        held_for_crash_loop += case.decision is Decision.HOLD
    return out, held_for_crash_loop


def _lost_start(
    fs: FileSystem,
    log_dir: str,
    marker: rec.Control,
    pos: Position,
    working: dict[str, _Working],
) -> None:
    """A repair's marker for a START it identified exactly stands for that start: the
    attempt it began is working from here, so its deltas after the marker count."""
    if marker.lost != "start" or len(marker.sup) != 1:
        return
    try:
        frame = read_frame_at(fs, log_dir, marker.sup[0])
        env = rec.decode(frame.type, frame.payload)
    except (CorruptSpool, rec.RecordError):
        return  # no envelope there (any more): R5 or the plain rules decide
    if isinstance(env, rec.Envelope):
        working[env.msg_id] = _Working(pos, marker.sup[0], env.klass)


def _finish_lost(
    msg_id: str, w: _Working, now: float, known: rec.BodyRef | None = None
) -> rec.Finish:
    """R5's finish: the outcomes the deltas settled, and no body (it died with the
    envelope, or is not to be trusted from a damaged one), unless an intact envelope of
    the message named an inline body (``known``): that one is named, so that the finish
    releases its pin (``_Pins``)."""
    outcomes = tuple(rec.Outcome(r, st, reply, at) for r, (st, reply, at) in w.delivered.items())
    return rec.Finish(msg_id, now, _named_body(known), outcomes, ENVELOPE_LOST_REASON)


def _named_body(known: rec.BodyRef | None) -> rec.BodyRef:
    """The body a finish names when the message's envelope is past reading: the inline
    body an intact envelope of it named (so that the finish releases its pin), else none
    (a body file of size 0: nothing in the log to release)."""
    return known or rec.BodyRef(rec.BODY_FILE, 0)


def finish_acknowledged(
    msg_id: str, now: float, body: rec.BodyRef, env: rec.Envelope | None = None
) -> rec.Finish:
    """R6's finish: its outcome was handed out and acknowledged, so its recipients were
    all settled; the finish that said so was lost. Written again with no outcomes (nothing
    is handed out for it) and the body the message had (``env``'s, or as R5 names it when
    the envelope is past reading), so that it releases that body as the lost one did (an
    inline body's pin: ``_Pins``, ``AttemptBook.append_recovered``). Recovery writes it,
    and ``spool check --repair`` for the queued form (``OperatorDesk.finish_acknowledged``)."""
    sender, accepted_at = (env.sender, env.accepted_at) if env is not None else (None, None)
    return rec.Finish(msg_id, now, body, (), FINISH_LOST_REASON, sender, accepted_at)


def kept_envelope(fs: FileSystem, root: str, msg_id: str, at: Position) -> rec.Envelope | None:
    """The envelope of ``msg_id`` that a repair's ``damaged`` marker at ``at`` stands for,
    as it still decodes in the copy of the damaged segment the repair kept (the marker
    names it), if its body can still be read; else None. A message in flight from it is
    then restored, held, with the recipients its deltas left (R5b): the decoded record
    may hold the damage, so it never settles mail and waits for the operator."""
    try:
        frame = read_frame_at(fs, os.path.join(root, fmt.LOG_DIR), at)
        marker = rec.decode(frame.type, frame.payload)
        if not (
            isinstance(marker, rec.Control)
            and marker.action == rec.DAMAGED
            and marker.lost == "envelope"
            and marker.target == msg_id
            and marker.copy
        ):
            return None  # no copy named, or not one envelope of this message
        kept = read_file(fs, os.path.join(root, marker.copy))
        env = single_record(kept[at.offset : at.offset + frame.size])
        if not isinstance(env, rec.Envelope) or env.msg_id != msg_id:
            return None
        read_body(fs, root, msg_id, resolve_body(env, at, frame.size))
    except (CorruptSpool, rec.RecordError, OSError):
        return None  # inside a larger region, the copy or the body gone: R5
    return env


def _promoted_copy(
    fs: FileSystem, root: str, msg_id: str, inline: rec.BodyRef
) -> rec.BodyRef | None:
    """The body file a promotion copied ``inline`` to, if it is still there (in incoming/
    if no checkpoint moved it yet, else in bodies/) and intact: its header and checksum
    hold, and it holds the inline body's size; None if there is no such copy."""
    try:
        data = read_body_file(fs, root, msg_id)
    except CorruptSpool:
        return None  # missing or damaged: the data is lost
    return rec.BodyRef(rec.BODY_FILE, inline.size) if len(data) == inline.size else None


def _in_damaged(at: Position, damaged: list[tuple[Position, int]]) -> bool:
    return any(
        at.segment == pos.segment and pos.offset <= at.offset < pos.offset + size
        for pos, size in damaged
    )


def successor_envelope(
    env: rec.Envelope,
    envelope_at: Position,
    *,
    remaining: tuple[str, ...],
    outcomes: tuple[rec.Outcome, ...],
    body: rec.BodyRef,
    now: float,
    klass: int,
    held: str | None,
    crashes: int,
    last_reply: str | None,
    promoted_from: Position | None = None,
) -> rec.Envelope:
    """The envelope that carries a message on after an attempt on ``env`` (at
    ``envelope_at``): its ``remaining`` recipients, one attempt more, superseding ``env``.
    Built here for both the end of an attempt (``attempts.py``) and recovery's decision
    for an attempt a crash left open (R2, R3), so that both write the same record."""
    return rec.Envelope(
        msg_id=env.msg_id,
        sender=env.sender,
        recipients=remaining,
        accepted_at=env.accepted_at,
        written_at=now,
        body=body,
        attempts=env.attempts + 1,
        klass=klass,
        held=held,
        crashes=crashes,
        supersedes=envelope_at,
        outcomes=outcomes,
        last_reply=last_reply,
        promoted_from=promoted_from,
    )


def resolve_body(env: rec.Envelope, envelope_at: Position, envelope_size: int) -> rec.BodyRef:
    """The envelope's body reference with an absolute position for an inline body."""
    if env.body.kind == rec.BODY_INLINE and env.body.at is None:
        at = Position(envelope_at.segment, envelope_at.offset + envelope_size)
        return rec.BodyRef(rec.BODY_INLINE, env.body.size, at)
    return env.body


def _cut_torn_tail(fs: FileSystem, root: str, log_dir: str, at: Position) -> None:
    """Remove a torn tail: truncate the newest segment, or remove it if its header is torn.

    Torn bytes that are not all zeros are first copied to ``corrupt/`` so that nothing is
    dropped unseen (Postfix's corrupt queue); the copy is named after segment and offset.
    """
    path = os.path.join(log_dir, fmt.segment_name(at.segment))
    _quarantine_tail(fs, root, path, at)
    if at.offset < fmt.SEGMENT_HEADER_SIZE:
        # Created but never synced with a frame in it: nothing in it was acknowledged.
        # A crash before the directory fsync brings the file back; we remove it again.
        fs.unlink(path)
        fs.fsync_dir(log_dir)
        return
    fd = fs.open(path, os.O_WRONLY)
    try:
        # A crash before the fdatasync may leave the torn bytes; the next recovery finds
        # the same tail (the writer starts a new segment and never appends here) and cuts
        # it again.
        fs.ftruncate(fd, at.offset)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)


def _torn_bytes(fs: FileSystem, log_dir: str, at: Position) -> int:
    """The bytes of the torn tail at ``at`` that were written (``reader.written_bytes``:
    not the sectors of zeros after them, never written or written ahead, writer W6)."""
    path = os.path.join(log_dir, fmt.segment_name(at.segment))
    try:
        return written_bytes(read_file(fs, path, at.offset), at.offset)
    except FileNotFoundError:
        return 0  # a newest segment already removed (its header torn)


def _quarantine_tail(fs: FileSystem, root: str, path: str, at: Position) -> None:
    tail = read_file(fs, path, at.offset)
    tail = tail[: written_bytes(tail, at.offset)]  # sectors of zeros after it: no tear
    if not tail:
        return
    corrupt = os.path.join(root, fmt.CORRUPT_DIR)
    if not fs.is_dir(corrupt):
        fs.mkdir(corrupt, 0o700)
    name = os.path.join(corrupt, f"{os.path.basename(path)}.{at.offset}.torn")
    # A crash before these syncs may lose the copy; the tail is still in the segment (it
    # is cut only after this returns), so the next recovery copies it again. A failure
    # (a full disk, say) leaves no partial copy behind.
    write_file_durably(fs, name, tail)
    fs.fsync_dir(corrupt)
    fs.fsync_dir(root)
