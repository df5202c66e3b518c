"""End-to-end verification of a spool directory, and the repair that sets damage aside.

``check_spool`` reads everything without the lock and without writing: every segment,
past any damage (``damage.scan_segment``), every record decoded, every first envelope
paired with its body, every live message's body file, orphan body files, the settings and
the restart positions against the log; it works out what any damage means for each
message (``damage.assess``) and runs recovery's own scan and decisions as a dry run, so
that a spool it calls clean is one that opens. It returns the problems, each with the
file and offset. Intended for ``spool check``, tests and post-mortem analysis.

Beside a running owner the spool changes while it is read: a segment appended to, the
positions replaced, body files created and removed. So the check notes what it compares
(the positions, the segments and their sizes, the body files) before and after; if they
changed it checks again, and if they never stand still (a busy owner) it keeps as certain
only what a running owner cannot explain (damage in the log before the durable end the
positions named when the check began, a damaged settings file) and reports every other
finding as uncertain (``CheckReport.uncertain``), never as a problem.

``repair_spool`` makes a damaged spool openable without losing intact mail (Postfix sets
one corrupt queue file aside and leaves the rest):

1. under the owner lock, every damaged segment is copied whole into ``corrupt/``, damaged
   and orphan body files and a damaged settings file are moved there, the restart
   positions are moved there (so the next open scans the whole log), and each damaged
   segment is rewritten with only its damaged bytes replaced: by a ``damaged`` marker
   record of exactly their size naming what they held and where the copy is, or by
   padding where nothing of value was lost. Every intact frame stays where it was;
2. the spool is opened (recovery, over the whole log), and each message the damage made
   undeliverable is failed with a reply that says why (its sender gets a bounce), each
   one whose state may have been lost is held for the operator, and each one whose
   envelope was lost is finished by recovery with the outcomes that survived;
3. the spool is checked again.

Crash safety (repair):
    (X0) The file ``repairing`` is durable before the first change and removed after the
    last settlement: a crash in between leaves it, and every open but a repair's refuses
    the spool until a repair is run again, so no owner retires a marker whose message
    the repair has yet to restore (markers cannot hold an envelope; the copy can).
    Each copy into ``corrupt/`` is fdatasynced and its directory fsynced before the
    original is changed, so a crash never loses the damaged bytes. The positions file is
    moved aside (directory fsynced) before any segment is rewritten, so no recovery with
    old positions ever meets a marker it did not scan. A segment is rewritten into a
    temporary file, fdatasynced and renamed over the original (atomic; the log directory
    is fsynced), so a crash leaves the old segment or the repaired one. The markers say
    what was lost, so a repair interrupted at any point is finished by running it again:
    step 2 derives from the markers exactly what it derived from the damage.

Errors:
    ``SpoolLocked`` if an owner runs (a repair needs the spool to itself); ``OSError``
    from the file operations of a repair propagates (nothing is deleted, so running it
    again is safe).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import stat
import time
from collections import Counter
from collections.abc import Callable

import attrs
from crc32c import crc32c

from spool import format as fmt
from spool import records as rec
from spool import recovery
from spool.bodies import (
    TWO_BODIES,
    body_file_paths,
    check_body_file,
    copies_agree,
    copies_differ,
    is_body_entry,
    read_body_file,
    read_body_files,
    read_inline_body,
    read_raw_body_file,
)
from spool.damage import (
    RECORD_FRAME_MIN,
    UNKNOWN_CHAR,
    Affected,
    Assessment,
    Region,
    RegionKind,
    SegmentScan,
    Verdict,
    fits_any,
    id_agreement,
    id_merged,
    id_near,
    loose_ids,
    partial_id_reads,
    replacement,
    same_id,
    scan_segment,
    whole_ids,
    whole_ids_read,
)
from spool.directory import archive_file, check_layout
from spool.errors import CorruptSpool, SegmentUnreadable, SpoolError, SpoolMisuse, UnknownMessage
from spool.fs import FileSystem, read_file, write_file_durably
from spool.lock import OwnerLock
from spool.operator import ActionResult, OperatorAction
from spool.options import load_settings, resolve_options, store_settings
from spool.positions import RestartPositions, load_positions, unretired
from spool.reader import list_segments
from spool.records import Position
from spool.recovery import recover
from spool.segment_header import new_salt, segment_header
from spool.spool import Spool

BODY_LOST_REPLY = (
    "554 5.3.0 message data lost to disk damage in the spool; the damaged bytes were kept as {copy}"
)
BODY_SEGMENT_GONE_REPLY = recovery.BODY_LOST_REPLY
BODY_FILE_MISSING_REPLY = "554 5.3.0 message data lost in the spool: its body file was missing"
RESTORED_HOLD = (
    "restored by spool check --repair from a damaged envelope at {region}: check its sender "
    "and recipients before releasing it"
)
TWO_BODIES_HOLD = (
    "two different body files were found: the one in bodies/ is kept as its body, the other "
    "in corrupt/ (body.ID.STAMP.second): check which is the message's before releasing it"
)
SETTLED_MEANWHILE = "no longer queued (settled meanwhile)"
RECORDS_LOST_HOLD = (
    "records of this message may have been lost to disk damage at {region}: check whether "
    "its recipients were delivered before releasing it"
)


class ProblemKind(enum.Enum):
    """What sort of thing is wrong; ``Problem.what`` says it in words."""

    SEGMENT_MISSING = "segment missing"
    SEGMENT_HEADER = "segment header"
    BIT_FLIP = "a flipped bit"  # one bit, which the repair sets right
    DAMAGE = "damaged bytes"
    NO_BODY_FRAME = "envelope without its body frame"
    UNDECODABLE = "undecodable record"
    BODY_FILE = "body file missing or damaged"
    BODY_SEGMENT_GONE = "inline body in a deleted segment"
    UNFINISHED_REPAIR = "a message an earlier repair left unsettled"
    SETTINGS = "settings file"
    POSITIONS = "restart positions"
    RECOVERY_REFUSES = "recovery refuses"
    START_LOST = "a start lost to damage"  # its envelope used up, and nothing says so yet


@attrs.frozen
class Problem:
    """One thing wrong with a spool: its kind, where and what. ``fatal``: recovery would
    refuse."""

    kind: ProblemKind
    path: str
    offset: int
    what: str
    fatal: bool = True


@attrs.frozen
class CheckReport:
    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    segments: int
    records: int
    bytes: int
    live_messages: int
    body_files: int
    seconds: float
    orphan_bodies: tuple[str, ...] = ()
    regions: tuple[Region, ...] = ()  # damage not yet set aside
    corrections: tuple[tuple[int, int, str], ...] = ()  # (segment, offset, what): one bit
    affected: tuple[Affected, ...] = ()  # what the damage means for each message it touched
    bad_body_files: tuple[str, ...] = ()
    stray_entries: tuple[str, ...] = ()  # in incoming/ or bodies/, not files ("bodies/X")
    bad_settings: bool = False
    bad_positions: bool = False
    missing_segments: tuple[int, ...] = ()
    retired_segments: tuple[int, ...] = ()  # behind the durable garbage front
    durable_end: Position | None = None  # the positions' consistent end when the check began
    used_up: tuple[Position, ...] = ()  # envelopes lost starts used up, not yet noted
    changing: bool = False  # the spool changed under every pass (an owner is running)
    uncertain: tuple[Problem, ...] = ()  # findings a running owner's writes may explain

    @property
    def clean(self) -> bool:
        return not self.problems

    @property
    def mail_affected(self) -> bool:
        """Whether the damage touched mail: a message named by damage not yet set aside,
        records of unknown kind lost (an accept among them would be lost unnamed), or a
        repair left unfinished. The messages an earlier, finished repair settled are notes:
        a second repair does not count them again (it would exit 1 for ever)."""
        unknown = any(r.kind is RegionKind.RECORDS and not r.lost for r in self.regions)
        new = any(not a.region.marker for a in self.affected)
        unfinished = any(p.kind is ProblemKind.UNFINISHED_REPAIR for p in self.problems)
        return new or unknown or unfinished or bool(self.missing_segments)


CHECK_PASSES = 3  # passes over a spool that changes under each, before settling for less


def check_spool(
    path: str,
    fs: FileSystem | None = None,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Verify the spool at ``path`` end to end; see the module docstring."""
    fs = fs or FileSystem()
    check_layout(fs, path)  # an entry of the wrong kind: refused, nothing to check past it
    for _ in range(CHECK_PASSES):
        before = _fingerprint(fs, path)
        report = _check_once(fs, path, progress)
        if _fingerprint(fs, path) == before:
            return report
    return only_certain(report, path, fs)


def _fingerprint(fs: FileSystem, path: str) -> tuple[object, ...]:
    """What a check compares, as it stands now: the positions, the segments and their
    sizes, the newest segment's bytes, the body files. Equal before and after a pass:
    nothing moved under it. (The bytes, because a running owner overwrites the zeros it
    wrote ahead of the log, writer W6, without changing the file's size: a pass that read
    a batch half copied must not stand.)"""

    def listing(directory: str, sizes: bool) -> tuple[tuple[str, int], ...]:
        out = []
        with contextlib.suppress(OSError):
            for name in fs.listdir(directory):
                with contextlib.suppress(OSError):
                    out.append((name, fs.file_size(os.path.join(directory, name)) if sizes else 0))
        return tuple(sorted(out))

    try:
        positions = read_file(fs, os.path.join(path, fmt.POSITIONS_NAME))
    except OSError:
        positions = b""
    log = listing(os.path.join(path, fmt.LOG_DIR), True)
    newest = max((n for n, _ in log if fmt.parse_segment_name(n) is not None), default=None)
    tail = b""
    if newest is not None:
        with contextlib.suppress(OSError):
            tail = read_file(fs, os.path.join(path, fmt.LOG_DIR, newest))
    return (
        positions,
        log,
        crc32c(tail),
        listing(os.path.join(path, fmt.INCOMING_DIR), False),
        listing(os.path.join(path, fmt.BODY_DIR), False),
    )


def only_certain(report: CheckReport, path: str, fs: FileSystem | None = None) -> CheckReport:
    """``report`` of a spool that changed under every pass: the findings a running owner
    explains (anything at or past the durable end the positions named when the pass
    began, the positions, body files, orphans, what recovery would refuse) become
    uncertain; damage in the durable log and a damaged settings file stay problems."""
    end = report.durable_end
    log_dir = os.path.join(path, fmt.LOG_DIR)
    fs = fs or FileSystem()
    present = list_segments(fs, log_dir) if fs.is_dir(log_dir) else []

    def durable(segment: int, offset: int) -> bool:
        return end is not None and Position(segment, offset) < end

    def certain(problem: Problem) -> bool:
        if os.path.basename(problem.path) == fmt.SETTINGS_NAME:
            return True
        if os.path.dirname(problem.path) != log_dir:
            return False
        number = fmt.parse_segment_name(os.path.basename(problem.path))
        if number is None:
            return False
        if not fs.exists(problem.path):
            # An owner deletes segments from the front only: a gap above a segment that
            # is still there is damage, one at the front its garbage collection.
            return any(n < number for n in present)
        return durable(number, problem.offset)

    regions = tuple(r for r in report.regions if durable(r.segment, r.start))
    return attrs.evolve(
        report,
        problems=tuple(p for p in report.problems if certain(p)),
        uncertain=tuple(p for p in report.problems if not certain(p)),
        regions=regions,
        affected=tuple(a for a in report.affected if a.region in regions),
        corrections=tuple(c for c in report.corrections if durable(c[0], c[1])),
        orphan_bodies=(),
        missing_segments=(),
        changing=True,
    )


def _check_once(fs: FileSystem, path: str, progress: Callable[[int], None] | None) -> CheckReport:
    """One pass of ``check_spool``."""
    started = time.monotonic()
    log_dir = os.path.join(path, fmt.LOG_DIR)
    problems: list[Problem] = []
    notes: list[str] = []
    bad_settings = _check_settings(fs, path, problems)
    # The positions first: everything before their consistent end is on disk, whatever
    # an owner appends or starts while the log is walked.
    positions = load_positions(fs, path)
    segments = list_segments(fs, log_dir) if fs.is_dir(log_dir) else []
    _note_foreign_files(fs, log_dir, notes)
    kept = unretired(segments, positions)
    retired = tuple(s for s in segments if s not in kept)
    if retired:
        notes.append(f"{len(retired)} retired segment(s) awaiting deletion")
    segments = kept
    missing = [n for prev, nxt in itertools.pairwise(segments) for n in range(prev + 1, nxt)]
    if positions is not None and segments:
        # The durable positions vouch for every segment from their garbage front's to
        # their consistent end's: one gone before the first on disk, or after the last,
        # is missing as surely as one in a gap (its mail with it).
        missing = [
            *range(positions.front.segment, segments[0]),
            *missing,
            *range(segments[-1] + 1, positions.consistent.segment + 1),
        ]
    for n in missing:
        problems.append(
            Problem(ProblemKind.SEGMENT_MISSING, _segment_path(log_dir, n), 0, "segment missing")
        )
    walk = Assessment(set())
    for n in missing:
        walk.sizes[n] = fmt.SEGMENT_HEADER_SIZE  # what the repair puts there
    regions: list[Region] = []
    markers: list[Region] = []
    corrections: list[tuple[int, int, str]] = []
    records = size = 0
    not_segments: list[str] = []
    unusable: list[int] = []  # segment numbers with something else in their place
    for seg in segments:
        if seg - 1 in missing:
            walk.step(Position(seg - 1, 0), _missing_region(seg - 1))
        kind = _entry_kind(fs, _segment_path(log_dir, seg))
        if kind not in (_FILE, _GONE):
            # A directory, FIFO, socket or looping link where the segment should be: as
            # good as missing. The repair moves it aside and puts a segment in its place.
            why = f"not a segment file ({kind}): check --repair moves it to corrupt/"
            problems.append(
                Problem(ProblemKind.SEGMENT_MISSING, _segment_path(log_dir, seg), 0, why)
            )
            not_segments.append(os.path.join(fmt.LOG_DIR, fmt.segment_name(seg)))
            unusable.append(seg)
            walk.sizes[seg] = fmt.SEGMENT_HEADER_SIZE
            walk.step(Position(seg, 0), _missing_region(seg))
            continue
        try:
            scan = _scan(fs, log_dir, seg, segments[-1], positions)
        except FileNotFoundError:
            # Gone since the listing: deleted by a running owner (the pass is then
            # repeated, or the finding left uncertain), or missing indeed.
            problems.append(
                Problem(
                    ProblemKind.SEGMENT_MISSING, _segment_path(log_dir, seg), 0, "segment missing"
                )
            )
            walk.sizes[seg] = fmt.SEGMENT_HEADER_SIZE
            walk.step(Position(seg, 0), _missing_region(seg))
            continue
        # Where the segment ends, with the stand-ins for a lost end its scan found.
        walk.sizes[seg] = scan.extent
        records += sum(1 for _, item in scan.items if not isinstance(item, Region))
        size += scan.size
        _report_scan(scan, _segment_path(log_dir, seg), problems, notes)
        corrections.extend((seg, offset, what) for offset, _fixed, what in scan.corrections)
        for offset, item in scan.items:
            if isinstance(item, Region) and item.marker:
                item = _with_kept_record(fs, path, item)
            walk.step(Position(seg, offset), item)
            if isinstance(item, Region):
                # The walk's own copy: it may have named the message a region belongs to
                # (``Assessment._owned_replacement``), which the repair's marker must carry.
                (markers if item.marker else regions).append(walk.regions[-1])
        if progress is not None:
            progress(1)
    past_the_end = [n for n in missing if segments and n > segments[-1]]
    if past_the_end:
        walk.step(Position(past_the_end[0], 0), _missing_region(past_the_end[0]))
    if markers:
        copies = sorted({m.copy for m in markers if m.copy})
        notes.append(
            f"{len(markers)} damaged region(s) set aside by an earlier repair"
            + (f" (copies: {', '.join(copies)})" if copies else "")
        )
    for lost_end in walk.lost_ends.values():
        # Bytes a record names but the segment no longer holds (``Assessment._lost_end``).
        regions.append(lost_end)
        problems.append(
            Problem(
                ProblemKind.DAMAGE,
                _segment_path(log_dir, lost_end.segment),
                lost_end.start,
                f"{lost_end.reason}; at least {lost_end.end - lost_end.start} bytes",
            )
        )
    live = set(walk.live)
    bad_files, two_bodies = _check_bodies(fs, path, walk, problems)
    walk.bad_files = set(bad_files)
    affected = walk.verdicts()
    affected.extend(_two_bodies(walk, two_bodies))
    regions = [_as_noted(walk, r) for r in regions]
    used_up = walk.unnoted()
    for at in used_up:
        problems.append(
            Problem(
                ProblemKind.START_LOST,
                _segment_path(log_dir, at.segment),
                at.offset,
                "this envelope's message finished after a start lost to damage, and nothing "
                "says the envelope is used up (it would be handed out again): check --repair "
                "notes it",
            )
        )
    _report_unfinished_repairs(affected, problems, notes)
    affected.extend(_bodies_in_gone_segments(fs, path, walk, segments, problems))
    stray = not_segments + _stray_entries(fs, path, problems)
    present = _body_files(fs, path)
    # Body files no live message names and no finish names (those are kept for a bounce):
    # messages whose envelope may have been in the damage.
    candidates = present - live - walk.finished
    region_bytes = _region_bytes(fs, log_dir)
    affected.extend(
        _envelopes_lost_with_files(
            candidates, regions, affected, region_bytes, walk.seen, _body_size(fs, path)
        )
    )
    affected.extend(_messages_lost_whole(walk.seen, regions, affected, region_bytes))
    # A segment missing, or beyond reading as a whole (its header unreadable, or naming
    # another segment, whose frames these are): no bytes to find ids in. Every body file
    # still unnamed may be of a message whose envelope was there: named, never an orphan.
    gone = [r for r in walk.regions if r.start == 0 and r.records_lost and not r.marker]
    if gone:
        unnamed = candidates - {a.msg_id for a in affected}
        affected.extend(_envelopes_in_lost_segments(sorted(unnamed), gone[0]))
    named = {a.msg_id for a in affected if a.verdict is not Verdict.RECORDS_LOST}
    for_bounces = walk.awaiting_ack & present
    if not _tracks_outcomes(fs, path, bad_settings, positions):
        for_bounces = set()
    orphans = sorted(present - live - named - for_bounces)
    if for_bounces:
        notes.append(
            f"{len(for_bounces)} body file(s) of finished messages kept until their "
            "outcome is acknowledged (outcome tracking)"
        )
    if orphans:
        notes.append(
            f"{len(orphans)} body file(s) that no live message names (left by a crash during "
            f"an accept or a removal; check --repair moves them to {fmt.CORRUPT_DIR}/): "
            + ", ".join(orphans[:5])
            + (" ..." if len(orphans) > 5 else "")
        )
    _check_positions(fs, path, segments, positions, problems)
    if fs.exists(os.path.join(path, fmt.REPAIRING_NAME)):
        problems.append(
            Problem(
                ProblemKind.UNFINISHED_REPAIR,
                os.path.join(path, fmt.REPAIRING_NAME),
                0,
                "a repair of this spool was interrupted and no open will serve it: run "
                "spool check --repair to finish it",
            )
        )
    if not bad_settings and segments:
        _dry_run_recovery(fs, path, problems)
    return CheckReport(
        problems=tuple(problems),
        notes=tuple(notes),
        segments=len(segments),
        records=records,
        bytes=size,
        live_messages=len(live),
        body_files=len(present),
        seconds=time.monotonic() - started,
        orphan_bodies=tuple(orphans),
        regions=tuple(regions),
        corrections=tuple(corrections),
        affected=tuple(affected),
        bad_body_files=tuple(bad_files),
        stray_entries=tuple(stray),
        bad_settings=bad_settings,
        bad_positions=fs.exists(os.path.join(path, fmt.POSITIONS_NAME)) and positions is None,
        missing_segments=tuple(sorted(missing + unusable)),
        retired_segments=retired,
        durable_end=positions.consistent if positions is not None else None,
        used_up=tuple(used_up),
    )


def _as_noted(walk: Assessment, region: Region) -> Region:
    """``region`` as the repair's marker must describe it: with the envelope its START,
    known exactly, used up (``sup``); or as records of unknown kind where its one record
    decoded as an operator's action in flight on no message in flight here (``record`` is
    gone from the marker, and a later check would take it for a record safe to lose)."""
    key = (region.segment, region.start)
    if key in walk.unknown_operator:
        return attrs.evolve(region, lost="", lost_target="")
    return attrs.evolve(region, sup=tuple(walk.lost_starts.get(key, ())))


def _with_kept_record(fs: FileSystem, root: str, marker: Region) -> Region:
    """``marker`` with the one envelope it stands for, read back from the copy of the
    damaged segment that the repair kept (``recovery.kept_envelope``): a repair interrupted
    before it restored a damaged envelope restores it when run again."""
    if marker.lost != "envelope":
        return marker
    at = Position(marker.segment, marker.start)
    record = recovery.kept_envelope(fs, root, marker.lost_target, at)
    return marker if record is None else attrs.evolve(marker, record=record)


def _bodies_in_gone_segments(
    fs: FileSystem, root: str, walk: Assessment, segments: list[int], problems: list[Problem]
) -> list[Affected]:
    """Queued messages whose envelope names an inline body in a segment before the first
    one on disk. The garbage front never passes a live inline body, so this is what a
    repair leaves when it sets aside the replacement that named the body's promoted copy
    (the promotion released the segment's pin): every claim would fail to read the body.
    The repair names the copy instead, or fails the pending recipients if there is none.
    A message in flight is not one: recovery settles it from the copy (``recovery.py``)."""
    if not segments:
        return []
    log_dir = os.path.join(root, fmt.LOG_DIR)
    found = []
    for msg_id, state in sorted(walk.live.items()):
        body = state.body
        if state.started or body is None or body.kind != rec.BODY_INLINE or body.at is None:
            continue
        if body.at.segment >= segments[0]:
            continue
        at = body.at
        try:
            copy = len(read_body_file(fs, root, msg_id)) == body.size
        except CorruptSpool:
            copy = False  # missing or damaged
        detail = (
            "its body is in its body file: the repair names that"
            if copy
            else "no intact copy of its body was found: the repair fails its pending recipients"
        )
        region = Region(
            at.segment,
            at.offset,
            at.offset + body.size,
            RegionKind.BODY,
            "segment deleted",
            body_of=msg_id,
            body_bytes=body.size,
        )
        problems.append(
            Problem(
                ProblemKind.BODY_SEGMENT_GONE,
                _segment_path(log_dir, at.segment),
                at.offset,
                f"{msg_id}: its envelope names a body in segment {at.segment}, which is "
                f"gone; {detail}",
                fatal=False,
            )
        )
        held = state.envelope is not None and state.envelope.held is not None
        found.append(Affected(msg_id, Verdict.BODY_SEGMENT_GONE, region, True, held, detail))
    return found


def _envelopes_lost_with_files(
    unnamed_files: set[str],
    regions: list[Region],
    affected: list[Affected],
    region_bytes: Callable[[Region], bytes],
    seen: set[str],
    body_size: Callable[[str], int | None],
) -> list[Affected]:
    """Messages whose first envelope was in damage that no record of them outlived, found
    by their body file (which no live or finished message names) and their id still
    legible in the damaged bytes (``id_near``). Without this they would vanish unnamed,
    their body filed as an orphan."""
    known = {a.msg_id for a in affected}
    wanted = sorted(unnamed_files - known)
    found = []
    for region in regions:
        # A damaged envelope that still decodes, but under an id the damage changed (into
        # one that never existed, or that of another message): its body file is not the
        # one it names. An unnamed body file within two characters of that id (or a burst),
        # or within four and of the size the record gives, is its message's.
        env = region.record
        if not isinstance(env, rec.Envelope) or env.body.kind != rec.BODY_FILE:
            continue
        if env.msg_id in unnamed_files:
            continue
        for msg_id in [m for m in wanted if _differences(m, env.msg_id) <= 4]:
            if not same_id(env.msg_id, msg_id) and body_size(msg_id) != env.body.size:
                continue  # three or four characters apart: the size must agree too
            detail = f"its damaged envelope reads as {env.msg_id}; body file kept in corrupt/"
            found.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, False, False, detail))
            wanted.remove(msg_id)
    for region in regions:
        if not wanted:
            break
        raw = region_bytes(region)
        own = whole_ids(raw) & seen  # messages whose own records are in the damage
        for msg_id in [m for m in wanted if id_near(raw, m, own)]:
            detail = "sender and recipients unknown; its body file is kept in corrupt/"
            found.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, False, False, detail))
            wanted.remove(msg_id)
    return found


def _envelopes_in_lost_segments(unnamed_files: list[str], region: Region) -> list[Affected]:
    detail = (
        f"its envelope may have been in segment {region.segment} ({region.reason}), "
        "which nothing can read: sender and recipients unknown; its body file is kept in "
        "corrupt/ (a message finished long ago whose file a crash left reads the same)"
    )
    return [Affected(m, Verdict.ENVELOPE_LOST, region, False, False, detail) for m in unnamed_files]


def _messages_lost_whole(
    seen: set[str],
    regions: list[Region],
    affected: list[Affected],
    region_bytes: Callable[[Region], bytes],
) -> list[Affected]:
    """Messages whose every record was in the damage (an envelope and its inline body, a
    whole batch, a segment beyond reading): their id, whole in the damaged bytes, is named
    by no intact record anywhere. Nothing of them can be restored; they are named, so that
    no acknowledged message vanishes without a word (the bytes are in the copy in
    ``corrupt/``). A message accepted and settled within that damage is named too: a
    false alarm an operator can dismiss from the copy, never a silent loss.

    Every copy of an id may be hit (its envelope's and its BODY frame's): two partial
    copies that agree make the id whole; a partial copy that fits no id the log or the
    damage holds is named as it reads, its unknown characters shown as ``?``."""
    known = {a.msg_id for a in affected}
    plausible = _plausible_id(seen)
    found = []
    detail = (
        "every record of it was in the damage: sender, recipients and body are only "
        "in the copy in corrupt/"
    )
    for region in regions:
        raw = region_bytes(region)
        read = Counter(whole_ids_read(raw))  # each id as many times as the bytes hold it
        whole = set(read)
        named_before = set(known)  # by their body files, or in a region before
        for msg_id in sorted(whole - seen - known):
            if not plausible(msg_id):
                continue
            found.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, False, False, detail))
            known.add(msg_id)
        if region.kind not in (RegionKind.RECORDS, RegionKind.BODY_AND_RECORDS):
            continue  # one message's body, or padding: no other message's records
        reads = partial_id_reads(raw) + loose_ids(raw)
        partial = sorted({text for _at, text in reads})
        # Copies that may each be hit: partial ones, and ids read once (a byte of one may
        # have made it another's, a neighbour's included), each with where it was read.
        # So many come only from message data: then no pair is tried (their number
        # squared).
        copies = [(-1 - i, m) for i, m in enumerate(sorted(whole))]
        copies = [(at, m) for at, m in copies if read[m] == 1] + reads
        few = len(copies) <= ID_COPIES_PAIRED
        merged = {m for a in partial for b in partial if (m := id_merged(a, b))} if few else set()
        for msg_id in sorted(merged - seen - known):
            if plausible(msg_id):
                found.append(Affected(msg_id, Verdict.ENVELOPE_LOST, region, False, False, detail))
                known.add(msg_id)
        # A partial copy that fits an id the log names intact is taken for a damaged
        # record of that message; one that fits only what this damage reads may be the
        # copy that kept the id right where the other lost it: named as it reads.
        fits = fits_any(seen | named_before)
        unsure = {text for text in partial if not fits(text)}
        # Two copies of one id read in two places, each hit (read whole but changed into
        # another id, or in part; both alike where the distinguishing characters were
        # lost, even if they fit a neighbour's id): what they leave known, whatever a merge
        # made of them (a byte of a burst may have become another hex digit, in either).
        pairs = (
            {
                text
                for i, (at, a) in enumerate(copies)
                for where, b in copies[i + 1 :]
                if at != where
                for text in id_agreement(a, b)
            }
            if few
            else set()
        )
        for text in sorted(unsure | pairs):
            if text not in known and plausible(text):
                why = f"{detail}; its id is damaged too and reads as {text}"
                found.append(Affected(text, Verdict.ENVELOPE_LOST, region, False, False, why))
                known.add(text)
    return found


# How many copies of ids in one damaged region are paired to find an id two hit copies
# share (message data can hold any number of id-like texts).
ID_COPIES_PAIRED = 64


def _body_size(fs: FileSystem, root: str) -> Callable[[str], int | None]:
    """The size of the message a body file holds (None if it cannot be read)."""

    def size(msg_id: str) -> int | None:
        try:
            return fs.file_size(_body_path(fs, root, msg_id)) - fmt.BODY_HEADER_SIZE
        except OSError:
            return None

    return size


def _differences(a: str, b: str) -> int:
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


# An id's first eight digits are its accept second: one found in damaged bytes is taken for
# a message's only if that second lies within a week of the ids the log names intact.
ID_SECONDS_SLACK = 7 * 86400


def _plausible_id(seen: set[str]) -> Callable[[str], bool]:
    """Whether an id's accept second (its first eight digits; for a partial id, any it may
    be) lies within a week of the ids the log names intact."""
    seconds = [int(m[:8], 16) for m in seen if fmt.is_message_id(m)]
    if not seconds:
        return lambda _: True
    lo, hi = min(seconds) - ID_SECONDS_SLACK, max(seconds) + ID_SECONDS_SLACK

    def plausible(msg_id: str) -> bool:
        first = msg_id[:8]
        least = int(first.replace(UNKNOWN_CHAR, "0"), 16)
        most = int(first.replace(UNKNOWN_CHAR, "F"), 16)
        return least <= hi and most >= lo

    return plausible


def _region_bytes(fs: FileSystem, log_dir: str) -> Callable[[Region], bytes]:
    """Reads a region's bytes from its segment (the last segment read is kept)."""
    cache: dict[int, bytes] = {}

    def read(region: Region) -> bytes:
        if region.segment not in cache:
            cache.clear()
            try:
                cache[region.segment] = read_file(fs, _segment_path(log_dir, region.segment))
            except FileNotFoundError:
                cache[region.segment] = b""
        # The body a region is known to start with is a message's data, not records: an
        # id-like text in it says nothing (a body may hold any text).
        return cache[region.segment][region.start + region.body_bytes : region.end]

    return read


def _segment_path(log_dir: str, number: int) -> str:
    return os.path.join(log_dir, fmt.segment_name(number))


def _missing_region(number: int) -> Region:
    return Region(number, 0, 0, RegionKind.RECORDS, "segment missing")


def _note_foreign_files(fs: FileSystem, log_dir: str, notes: list[str]) -> None:
    """Name what the log directory holds besides segments: nothing reads it (an
    operator's copy, a ``.repair`` file an interrupted repair left), so it is a note,
    never a problem, and nothing moves it."""
    if not fs.is_dir(log_dir):
        return
    foreign = sorted(n for n in fs.listdir(log_dir) if fmt.parse_segment_name(n) is None)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        notes.append(
            f"{len(foreign)} file(s) in {fmt.LOG_DIR}/ not named as segments, not read: {shown}"
        )


def _scan(
    fs: FileSystem, log_dir: str, seg: int, newest: int, positions: RestartPositions | None
) -> SegmentScan:
    path = _segment_path(log_dir, seg)
    try:
        data = read_file(fs, path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # Not damage: what cannot be read cannot be checked, nor may the repair set it
        # aside (the mail in it is intact as far as anyone knows). Refused, nothing written.
        raise SegmentUnreadable.from_os_error(path, exc) from None
    consistent = positions.consistent if positions is not None else Position(0, 0)
    if consistent.segment > seg:
        durable_end = len(data)
    elif consistent.segment == seg:
        durable_end = consistent.offset
    else:
        durable_end = 0
    return scan_segment(data, seg, newest=seg == newest, durable_end=durable_end)


def _report_scan(scan: SegmentScan, path: str, problems: list[Problem], notes: list[str]) -> None:
    if scan.header_problem is not None and scan.torn_at is None and scan.salt is not None:
        problems.append(
            Problem(ProblemKind.SEGMENT_HEADER, path, 0, f"segment header: {scan.header_problem}")
        )
    for offset, _fixed, what in scan.corrections:
        problems.append(
            Problem(ProblemKind.BIT_FLIP, path, offset, f"{what}: check --repair sets it right")
        )
    for region in scan.regions:
        if not region.marker:
            what = f"{region.reason}; {region.end - region.start} bytes"
            if region.start == 0 and scan.salt is None:
                what = f"{region.reason}; the whole segment ({region.end} bytes) is unreadable"
            problems.append(Problem(ProblemKind.DAMAGE, path, region.start, what))
    if scan.torn_at is not None and scan.torn_written:  # zeros alone: nothing was torn
        notes.append(
            f"{path}: torn tail of {scan.torn_written} bytes at offset {scan.torn_at} "
            "(an interrupted last write; the next open cuts it)"
        )
    _check_pairs(scan, path, problems)


def _check_pairs(scan: SegmentScan, path: str, problems: list[Problem]) -> None:
    """Every first envelope with an inline body is followed by its BODY frame (or by the
    damage, or the marker a repair left, in its place); every record decodes."""
    expect: tuple[str, int] | None = None
    for offset, item in scan.items:
        if expect is not None:
            owner, at = expect
            expect = None
            if isinstance(item, Region):
                pass  # the body is in the damage: the damage is the problem
            elif item.type == fmt.T_BODY:
                if rec.decode_body(item.payload)[0] != owner:
                    problems.append(
                        Problem(
                            ProblemKind.NO_BODY_FRAME,
                            path,
                            at,
                            f"envelope of {owner} has no body frame",
                        )
                    )
            else:
                problems.append(
                    Problem(
                        ProblemKind.NO_BODY_FRAME,
                        path,
                        at,
                        f"envelope of {owner} has no body frame",
                    )
                )
        if isinstance(item, Region) or item.type in (fmt.T_BODY, fmt.T_PAD):
            continue
        try:
            record = rec.decode(item.type, item.payload)
        except rec.RecordError as exc:
            problems.append(
                Problem(ProblemKind.UNDECODABLE, path, offset, f"undecodable record: {exc}")
            )
            continue
        inline = isinstance(record, rec.Envelope) and record.body.kind == rec.BODY_INLINE
        if inline and isinstance(record, rec.Envelope) and record.body.at is None:
            expect = (record.msg_id, offset)
    # An envelope that ends the log: a tear that recovery cuts, or damage that its dry run
    # (``_dry_run_recovery``) reports.


def _body_files(fs: FileSystem, root: str) -> set[str]:
    """The names of the body files in incoming/ and bodies/ (incoming/ listed first: a
    file moving from there meanwhile is then seen in bodies/). Only regular files are body
    files (``_stray_entries``)."""
    names: set[str] = set()
    for sub in (fmt.INCOMING_DIR, fmt.BODY_DIR):
        with contextlib.suppress(FileNotFoundError):
            for name in fs.listdir(os.path.join(root, sub)):
                if _body_entry_kind(fs, os.path.join(root, sub, name)) in (_FILE, _GONE):
                    names.add(name)
    return names


def _stray_entries(fs: FileSystem, root: str, problems: list[Problem]) -> list[str]:
    """Entries in incoming/ or bodies/ that are not regular files: directories, FIFOs,
    devices, sockets, symbolic links (only the spool writes there, and only files). Each is
    a problem, moved to corrupt/ by the repair: one named as a live message's id would
    otherwise stand where its body file is looked for."""
    found = []
    for sub in (fmt.INCOMING_DIR, fmt.BODY_DIR):
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(fs.listdir(os.path.join(root, sub))):
                path = os.path.join(root, sub, name)
                kind = _body_entry_kind(fs, path)
                if kind == _FILE:
                    kind = _twin(fs, root, sub, name)
                if kind not in (_FILE, _GONE):
                    why = f"not a body file ({kind}): check --repair moves it to corrupt/"
                    problems.append(Problem(ProblemKind.BODY_FILE, path, 0, why))
                    found.append(os.path.join(sub, name))
    return found


def _twin(fs: FileSystem, root: str, sub: str, name: str) -> str:
    """``_FILE`` for the file ``sub``/``name``, unless the other body directory holds a
    different file of that name (the spool's own second copies agree) and that one is the
    body (``read_raw_body_file``: the one that checks, the settled one if both do): then
    what this one is."""
    other = fmt.BODY_DIR if sub == fmt.INCOMING_DIR else fmt.INCOMING_DIR
    if _body_entry_kind(fs, os.path.join(root, other, name)) != _FILE:
        return _FILE
    if copies_agree(fs, root, name) or copies_differ(fs, root, name):
        # A second copy the spool made (the next checkpoint moves it over); or two valid
        # ones that differ, which ``_check_bodies`` names (the repair holds the message).
        return _FILE
    try:
        _raw, body = read_raw_body_file(fs, root, name)
    except FileNotFoundError:
        return _FILE
    if body == os.path.join(root, sub, name):
        return _FILE
    return f"a second file beside the body file in {other}/"


_FILE, _GONE = "file", "gone"


def _entry_kind(fs: FileSystem, path: str) -> str:
    """A regular file (a symbolic link to one counts), gone since the listing (an owner
    moved or removed it), or what else it is ("a directory", "a FIFO", "a broken link",
    ...). ``stat`` never blocks on a FIFO."""
    try:
        mode = fs.stat(path).st_mode
    except FileNotFoundError:
        return "a broken link" if fs.lexists(path) else _GONE
    except OSError:
        return "a looping link"  # ELOOP; nothing else stat of a listed name can raise here
    if stat.S_ISREG(mode):
        return _FILE
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def _body_entry_kind(fs: FileSystem, path: str) -> str:
    """``_entry_kind`` of an entry in incoming/ or bodies/, where a symbolic link is never
    a body file (``bodies.is_body_entry``), whatever it points to."""
    return "a symbolic link" if fs.is_link(path) else _entry_kind(fs, path)


def _body_path(fs: FileSystem, root: str, msg_id: str) -> str:
    """Where the body file of ``msg_id`` is now: incoming/ or bodies/. ``msg_id`` is an id
    or a name listed there (a stray file is an orphan too); anything else is refused
    (``ValueError``): an empty name would make the path incoming/ itself."""
    if msg_id in ("", ".", "..") or "/" in msg_id or "\0" in msg_id:
        raise ValueError(f"not a body file name: {msg_id!r}")
    staged, settled = body_file_paths(root, msg_id)
    return staged if is_body_entry(fs, staged) else settled


def _check_bodies(
    fs: FileSystem, root: str, walk: Assessment, problems: list[Problem]
) -> tuple[list[str], list[str]]:
    """The body files of live messages: each present and intact, each read once. Returns
    the bad ones, and those with two valid files that differ."""
    bad: list[str] = []
    two: list[str] = []
    for msg_id, state in walk.live.items():
        if state.body is None or state.body.kind != rec.BODY_FILE:
            continue
        try:
            raw, path, differ = read_body_files(fs, root, msg_id)
        except FileNotFoundError:
            path = body_file_paths(root, msg_id)[1]
            problems.append(
                Problem(ProblemKind.BODY_FILE, path, 0, "body file of a live message is missing")
            )
            bad.append(msg_id)
            continue
        if differ:
            path = body_file_paths(root, msg_id)[0]
            problems.append(Problem(ProblemKind.BODY_FILE, path, 0, TWO_BODIES))
            two.append(msg_id)
            continue
        why = check_body_file(raw)
        if why is not None:
            problems.append(Problem(ProblemKind.BODY_FILE, path, 0, why))
            bad.append(msg_id)
    return bad, two


def _two_bodies(walk: Assessment, two: list[str]) -> list[Affected]:
    """The live messages ``two`` with two valid body files that differ: held by the
    repair, which keeps the one in incoming/ in corrupt/ (``_settle_two_bodies``)."""
    found = []
    for msg_id in two:
        env = walk.live[msg_id].envelope
        where = Region(0, 0, 0, RegionKind.BODY_FILE, f"{fmt.INCOMING_DIR}/{msg_id}")
        held = env is not None and env.held is not None
        found.append(Affected(msg_id, Verdict.BODY_AMBIGUOUS, where, True, held))
    return found


def _report_unfinished_repairs(
    affected: list[Affected], problems: list[Problem], notes: list[str]
) -> None:
    """Messages touched by damage an earlier repair set aside: those the repair has not
    yet settled (an interrupted repair) are problems; the rest are notes."""
    for a in affected:
        if not a.region.marker:
            continue  # new damage: reported as such, settled by the next repair
        if a.verdict is Verdict.BODY_LOST and a.live:
            problems.append(
                Problem(
                    ProblemKind.UNFINISHED_REPAIR,
                    a.region.copy or "log",
                    a.region.start,
                    f"{a.msg_id}: its body was lost to damage at {a.region} and it is still "
                    "queued; run spool check --repair to finish the repair",
                )
            )
        elif a.verdict is Verdict.RECORDS_LOST and a.live and not a.held:
            problems.append(
                Problem(
                    ProblemKind.UNFINISHED_REPAIR,
                    a.region.copy or "log",
                    a.region.start,
                    f"{a.msg_id}: its records may have been lost to damage at {a.region} and "
                    "it is not held; run spool check --repair to finish the repair",
                )
            )
        elif a.verdict is Verdict.ENVELOPE_DAMAGED and a.region.record is not None:
            problems.append(
                Problem(
                    ProblemKind.UNFINISHED_REPAIR,
                    a.region.copy or "log",
                    a.region.start,
                    f"{a.msg_id}: its envelope was damaged at {a.region} and is not restored "
                    "yet; run spool check --repair to finish the repair",
                )
            )
        else:
            notes.append(f"{a.msg_id}: {a.verdict.value} at {a.region} ({a.detail or 'held'})")


def _tracks_outcomes(
    fs: FileSystem, path: str, bad_settings: bool, positions: RestartPositions | None
) -> bool:
    """Whether the spool tracks outcomes (bodies kept for bounces): as its settings say;
    with a damaged settings file, as the positions' copy of them says (the repair restores
    that copy); without either, assume it does, so no kept body is taken for an orphan."""
    if not bad_settings:
        return bool(load_settings(fs, path).get("outcomes", False))
    if positions is not None and positions.settings:
        return bool(positions.settings.get("outcomes", False))
    return True


def _check_settings(fs: FileSystem, path: str, problems: list[Problem]) -> bool:
    try:
        load_settings(fs, path)
    except CorruptSpool as exc:
        problems.append(Problem(ProblemKind.SETTINGS, exc.path, exc.offset, exc.reason))
        return True
    return False


def _check_positions(
    fs: FileSystem,
    path: str,
    segments: list[int],
    positions: RestartPositions | None,
    problems: list[Problem],
) -> None:
    pos_path = os.path.join(path, fmt.POSITIONS_NAME)
    if not fs.exists(pos_path):
        return
    if positions is None:
        problems.append(
            Problem(
                ProblemKind.POSITIONS,
                pos_path,
                0,
                "restart positions are damaged (recovery will scan everything)",
                fatal=False,
            )
        )
        return
    if segments and positions.working_start.segment < segments[0]:
        problems.append(
            Problem(
                ProblemKind.POSITIONS,
                pos_path,
                0,
                "working suffix starts in a deleted segment",
                fatal=False,
            )
        )


def _dry_run_recovery(fs: FileSystem, path: str, problems: list[Problem]) -> None:
    """Recovery's own scan and decisions, writing nothing: what it refuses, the open would
    refuse too (reported once, if the check did not already find it)."""
    options = resolve_options(load_settings(fs, path), {})
    try:
        recover(fs, path, options=options, clock=time.time, dry_run=True)
    except CorruptSpool as exc:
        if not any(p.path == exc.path and p.offset == exc.offset for p in problems):
            problems.append(
                Problem(
                    ProblemKind.RECOVERY_REFUSES,
                    exc.path,
                    exc.offset,
                    f"recovery refuses: {exc.reason}",
                )
            )


# --- repair --------------------------------------------------------------------------


@attrs.frozen
class RepairReport:
    """What a repair found, did to files, and did to each message it touched."""

    before: CheckReport
    actions: tuple[str, ...]
    fates: tuple[tuple[str, str], ...]  # (message id, what became of it)
    after: CheckReport

    @property
    def mail_affected(self) -> bool:
        return self.before.mail_affected


def repair_spool(path: str, fs: FileSystem | None = None) -> RepairReport:
    """Set damage aside so that the spool opens, keeping every intact frame (module
    docstring). Needs the spool to itself: ``SpoolLocked`` while an owner runs."""
    fs = fs or FileSystem()
    check_layout(fs, path)  # refused before the first change (a repair would stop half way)
    owner = OwnerLock(fs, os.path.join(path, fmt.LOCK_NAME), path)
    flag = os.path.join(path, fmt.REPAIRING_NAME)
    try:
        before = check_spool(path, fs)
        if fs.exists(flag):
            # Interrupted: its own open may have written positions since it moved them
            # aside. Aside again, so that recovery scans the markers and keeps the body
            # files of the messages still to restore, which nothing else names.
            _positions_aside(fs, path, before)
            before = check_spool(path, fs)
        if _needs_repair(before) or before.affected or before.used_up:
            # (X0) Durable before the first change: until the last settlement below, no
            # open but the repair's own serves the spool (a crash leaves it for the rerun).
            write_file_durably(fs, flag, f"{os.getpid()}\n".encode())
            fs.fsync_dir(path)
        actions = _repair_files(fs, path, before) if _needs_repair(before) else []
        # Step 2 settles what the markers now in the log say, exactly what a check after
        # an interrupted repair derives, so a repair run twice converges.
        marked = check_spool(path, fs) if actions else before
    finally:
        owner.release()
    settle = marked.affected or marked.used_up
    fates = _settle_affected(path, marked, before, fs) if settle else []
    settled = {msg_id for msg_id, _fate in fates}
    fates += [  # named before the rewrite only: nothing of them left to settle
        (a.msg_id, f"{a.verdict.value} at {a.region}: {a.detail or 'nothing left to settle'}")
        for a in before.affected
        if a.msg_id not in settled
    ]
    if fs.exists(flag):
        # Every settlement is durable (each returned): the spool may be served again.
        fs.unlink(flag)
        fs.fsync_dir(path)
    return RepairReport(before, tuple(actions), tuple(fates), check_spool(path, fs))


def _positions_aside(fs: FileSystem, root: str, report: CheckReport) -> None:
    """Move the restart positions into ``corrupt/`` (the next open scans the whole log),
    after finishing the retirement they record (``_finish_retirement``)."""
    src = os.path.join(root, fmt.POSITIONS_NAME)
    if not fs.exists(src):
        return
    _finish_retirement(fs, root, report.retired_segments, [])
    corrupt = os.path.join(root, fmt.CORRUPT_DIR)
    if not fs.is_dir(corrupt):
        fs.mkdir(corrupt, 0o700)
        fs.fsync_dir(root)
    # (X2) As in step 1: a crash leaves the positions in place or aside, both of which a
    # repair run again handles.
    fs.rename(src, os.path.join(corrupt, f"positions.{time.strftime('%Y%m%dT%H%M%S')}"))
    fs.fsync_dir(corrupt)
    fs.fsync_dir(root)


def _shadows_a_staged_body(fs: FileSystem, root: str, entry: str) -> bool:
    """Whether the stray ``entry`` is in bodies/ with a body file of its name in
    incoming/."""
    sub, name = os.path.split(entry)
    return sub == fmt.BODY_DIR and is_body_entry(fs, body_file_paths(root, name)[0])


def _needs_repair(report: CheckReport) -> bool:
    return bool(
        report.regions
        or report.corrections
        or report.bad_body_files
        or report.stray_entries
        or report.orphan_bodies
        or report.bad_settings
        or report.bad_positions
        or report.missing_segments
        or any(p.kind is ProblemKind.SEGMENT_HEADER for p in report.problems)
    )


def _repair_files(fs: FileSystem, root: str, report: CheckReport) -> list[str]:
    """Step 1 of the module docstring; returns what was done, a line each."""
    done: list[str] = []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    log_dir = os.path.join(root, fmt.LOG_DIR)
    body_dir = os.path.join(root, fmt.BODY_DIR)
    corrupt = os.path.join(root, fmt.CORRUPT_DIR)
    if not fs.is_dir(corrupt):
        fs.mkdir(corrupt, 0o700)
        fs.fsync_dir(root)
    damaged = sorted(
        (
            {r.segment for r in report.regions}
            | {seg for seg, _offset, _what in report.corrections}
            | {
                fmt.parse_segment_name(os.path.basename(p.path)) or 0
                for p in report.problems
                if p.kind is ProblemKind.SEGMENT_HEADER
            }
        )
        - set(report.missing_segments)  # written whole below
    )
    copies: dict[int, str] = {}
    for seg in damaged:
        src = _segment_path(log_dir, seg)
        name = f"{fmt.segment_name(seg)}.{stamp}.bad"
        # (X1) The copy is durable before the segment is changed.
        _copy_durably(fs, src, os.path.join(corrupt, name), corrupt)
        copies[seg] = os.path.join(fmt.CORRUPT_DIR, name)
        done.append(f"copied {src} to {copies[seg]}")
    moved = False
    for msg_id in report.bad_body_files:
        src = _body_path(fs, root, msg_id)
        if fs.exists(src):
            target = os.path.join(corrupt, f"body.{msg_id}.{stamp}.bad")
            fs.rename(src, target)
            done.append(f"moved the damaged body file {src} to {target}")
            moved = True
    if any(_shadows_a_staged_body(fs, root, entry) for entry in report.stray_entries):
        # A stray entry in bodies/ kept the checkpoints from settling a live body staged
        # under its name, and their positions may lie past its envelope: with the entry
        # gone, recovery (no longer scanning that envelope) would take the staged file
        # for an accept's leftover and remove it. With the positions aside first, the
        # next open scans the whole log, sees the envelope, and settles the file.
        _positions_aside(fs, root, report)
    for entry in report.stray_entries:
        src = os.path.join(root, entry)
        if fs.lexists(src):
            target = os.path.join(corrupt, f"stray.{entry.replace(os.sep, '.')}.{stamp}")
            # A crash before the rename leaves the stray entry where it was (the next check
            # names it again); after it, in corrupt/. No mail is in it either way: only
            # files are body files.
            fs.rename(src, target)
            done.append(f"moved {src}, which is not a body file, to {target}")
            moved = True
    for msg_id in report.orphan_bodies:
        src = _body_path(fs, root, msg_id)
        if not is_body_entry(fs, src):
            continue  # gone since the check (an owner removed it), or moved above
        target = os.path.join(corrupt, f"body.{msg_id}.{stamp}.orphan")
        fs.rename(src, target)
        done.append(f"moved orphan body file {src} to {target}")
        moved = True
    for a in report.affected:
        # A message whose envelope was lost may still have a body file: keep its data (move
        # it when nothing live names it; copy it when recovery will finish the message).
        src = _body_path(fs, root, a.msg_id)
        if a.verdict is Verdict.ENVELOPE_LOST and fs.exists(src):
            target = os.path.join(corrupt, f"body.{a.msg_id}.{stamp}.lost-envelope")
            if a.live:
                _copy_durably(fs, src, target, corrupt)
            else:
                fs.rename(src, target)
                moved = True
            done.append(f"kept the body file of {a.msg_id} (its envelope was lost) as {target}")
    if report.bad_settings:
        src = os.path.join(root, fmt.SETTINGS_NAME)
        fs.rename(src, os.path.join(corrupt, f"settings.{stamp}"))
        done.append(_restore_settings(fs, root, src))
        moved = True
    src = os.path.join(root, fmt.POSITIONS_NAME)
    if report.bad_positions and fs.lexists(src):  # (moved aside above, for a stray)
        fs.rename(src, os.path.join(corrupt, f"positions.{stamp}"))
        done.append(f"moved the damaged {src} aside: the next open scans the whole log")
        moved = True
    if damaged or report.missing_segments:
        _finish_retirement(fs, root, report.retired_segments, done)
        src = os.path.join(root, fmt.POSITIONS_NAME)
        if fs.exists(src):
            # (X2) Before any segment changes: the next open scans the whole log, markers
            # included.
            fs.rename(src, os.path.join(corrupt, f"positions.{stamp}"))
            done.append(f"moved {src} aside: the next open scans the whole log")
            moved = True
    if moved:
        fs.fsync_dir(corrupt)
        for sub in (body_dir, os.path.join(root, fmt.INCOMING_DIR)):
            if fs.is_dir(sub):  # absent (removed by hand): the next open makes it again
                fs.fsync_dir(sub)
        fs.fsync_dir(root)
    regions = {seg: [r for r in report.regions if r.segment == seg] for seg in damaged}
    for seg in damaged:
        _rewrite_segment(fs, log_dir, seg, regions[seg], copies[seg])
        fixed = [f"{what} at {s}:{o}" for s, o, what in report.corrections if s == seg]
        what = ", ".join([f"{r.kind.value} at {r}" for r in regions[seg]] + fixed)
        done.append(
            f"set right the damaged bytes of {_segment_path(log_dir, seg)}: {what or 'its header'}"
        )
    for seg in report.missing_segments:
        lost = [r for r in report.regions if r.segment == seg]
        _write_segment(fs, log_dir, seg, _missing_segment(seg, lost))
        done.append(f"created {_segment_path(log_dir, seg)} in place of a missing segment")
    return done


def _restore_settings(fs: FileSystem, root: str, src: str) -> str:
    """Write the settings again from the copy in the restart positions, if there is one
    (the damaged file was moved aside first); otherwise the defaults apply."""
    positions = load_positions(fs, root) or _positions_set_aside(fs, root)
    copy = positions.settings if positions is not None else {}
    try:
        options = resolve_options(copy, {})
    except SpoolMisuse:
        copy = {}
    if not copy:
        return f"moved the damaged {src} aside: the spool's defaults apply (no copy found)"
    # (X5) Atomic replace (metafile.py): a crash leaves no settings file (the next repair
    # restores it again) or the restored one.
    store_settings(fs, root, options)
    return f"moved the damaged {src} aside and restored it from the copy in the positions"


def _positions_set_aside(fs: FileSystem, root: str) -> RestartPositions | None:
    """The newest readable positions a repair moved into corrupt/ (``_positions_aside``:
    this repair, for a stray in the way of a staged body, or an interrupted one), for
    their copy of the settings."""
    corrupt = os.path.join(root, fmt.CORRUPT_DIR)
    try:
        names = sorted((n for n in fs.listdir(corrupt) if n.startswith("positions.")), reverse=True)
    except FileNotFoundError:
        return None
    for name in names:
        positions = load_positions(fs, corrupt, name)
        if positions is not None:
            return positions
    return None


def _finish_retirement(
    fs: FileSystem, root: str, retired: tuple[int, ...], done: list[str]
) -> None:
    """Delete (or archive) the segments the durable positions retired, as the owner's next
    checkpoint would. They hold only garbage; once the positions are moved aside nothing
    would tell them from live segments, and a gap among them would stop every open."""
    if not retired:
        return
    options = resolve_options(load_settings(fs, root), {})
    archive = None if options.archive_dir is None else os.path.join(root, options.archive_dir)
    log_dir = os.path.join(root, fmt.LOG_DIR)
    for seg in retired:
        path = _segment_path(log_dir, seg)
        if not fs.lexists(path):
            continue  # retired already (by an earlier step of this repair)
        # (X4) Retired by durable positions (P3): a crash midway leaves some of them, which
        # the still-present positions keep retiring; a repeated repair finishes the job.
        if archive is not None:
            archive_file(fs, path, archive)
        else:
            fs.unlink(path)
    fs.fsync_dir(log_dir)
    done.append(f"finished retiring {len(retired)} segment(s) behind the garbage front")


def _rewrite_segment(
    fs: FileSystem, log_dir: str, seg: int, regions: list[Region], copy: str
) -> None:
    """The segment with each damaged region replaced by a marker or padding of its size."""
    data = read_file(fs, _segment_path(log_dir, seg))
    scan = scan_segment(data, seg, newest=False, durable_end=len(data))
    now = time.time()
    if scan.salt is None:
        salt = new_salt()
        out = bytearray(segment_header(seg, salt))
        end = max([len(data), *(r.end for r in regions)])  # a lost end included
        if end - fmt.SEGMENT_HEADER_SIZE >= fmt.FRAME_HEADER_SIZE:
            lost = Region(seg, len(out), end, RegionKind.RECORDS, "unreadable segment")
            out += replacement(lost, salt, now, copy)
    else:
        out = bytearray(data)
        out[: fmt.SEGMENT_HEADER_SIZE] = segment_header(seg, scan.salt)
        for offset, frame, _what in scan.corrections:
            out[offset : offset + len(frame)] = frame  # one flipped bit put right
        for region in regions:
            if region.start >= len(data):
                # The segment's lost end (``Assessment._lost_end``): from where the file now
                # ends (a marker of a cut record may have grown it) to past every place
                # a record names.
                if len(out) < region.end:
                    lost_end = attrs.evolve(region, start=len(out))
                    out += replacement(lost_end, scan.salt, now, copy)
            elif region.start >= fmt.SEGMENT_HEADER_SIZE:
                out[region.start : region.end] = replacement(region, scan.salt, now, copy)
    # Longer only by a marker of records a shortened file cut (``damage.replacement``), or
    # of its lost end.
    assert len(out) <= max(len(data), fmt.SEGMENT_HEADER_SIZE + RECORD_FRAME_MIN) or (
        bool(regions) and regions[-1].end >= len(data)
    )
    _write_segment(fs, log_dir, seg, bytes(out))


def _missing_segment(seg: int, named: list[Region]) -> bytes:
    """A segment in place of a missing one: its header, then a marker of records lost
    reaching past every place a record names in it (``named``: ``Assessment._lost_end``)."""
    salt = new_salt()
    start = fmt.SEGMENT_HEADER_SIZE
    end = max([start + RECORD_FRAME_MIN, *(r.end for r in named)])
    lost = Region(seg, start, end, RegionKind.RECORDS, "segment missing")
    return segment_header(seg, salt) + replacement(lost, salt, time.time(), "")


def _write_segment(fs: FileSystem, log_dir: str, seg: int, data: bytes) -> None:
    """(X3) Replace segment ``seg`` atomically: temp file, fdatasync, rename, dir fsync."""
    path = _segment_path(log_dir, seg)
    tmp = path + ".repair"  # not a segment name: readers never see it
    write_file_durably(fs, tmp, data)
    fs.rename(tmp, path)
    fs.fsync_dir(log_dir)


def _copy_durably(fs: FileSystem, src: str, dst: str, dst_dir: str) -> None:
    write_file_durably(fs, dst, read_file(fs, src))
    fs.fsync_dir(dst_dir)


def _settle_affected(
    path: str, report: CheckReport, before: CheckReport, fs: FileSystem
) -> list[tuple[str, str]]:
    """Step 2 of the module docstring: open the spool and settle each message the damage
    touched; returns what became of each. Envelopes to restore come from ``before``: the
    markers that replaced them cannot hold their content."""
    restore = {a.msg_id: a for a in before.affected if a.verdict is Verdict.ENVELOPE_DAMAGED}
    fates: list[tuple[str, str]] = []
    with Spool._open_for_repair(path, fs) as sp:
        if report.used_up:
            # First: no claim may hand out what a lost start used up. Durable on return;
            # a crash before it leaves the repair's flag, and the rerun notes it again.
            sp._desk.note_used_up(report.used_up)
        settled = _settle_in_bulk(sp, [a for a in report.affected if a.msg_id not in restore])
        for a in report.affected:
            if a.msg_id in restore:
                fates.append((a.msg_id, _restore_one(sp, path, restore.pop(a.msg_id))))
            elif a.msg_id in settled:
                fates.append((a.msg_id, settled[a.msg_id]))
            else:
                fates.append((a.msg_id, _settle_one(sp, a)))
    return fates


def _settle_in_bulk(sp: Spool, affected: list[Affected]) -> dict[str, str]:
    """Hold (records possibly lost) or bounce (body lost) the messages named once in
    ``affected``, with one walk of the queue per reason (``Spool.act``) instead of one per
    message: a repair naming thousands of messages is linear. Returns each settled
    message's fate; a message named more than once, or a group the bulk action could not
    settle, is left to ``_settle_one``, message by message (a bulk action that raised may
    have settled some of its group before: a hold again is a no-op, and a bounce that
    finds gone a message queued before the bulk one names that one, as nothing but the
    repair acts on the spool it has to itself). Each ``Spool.act`` is durable on return."""
    named = Counter(a.msg_id for a in affected)
    groups: dict[tuple[OperatorAction, str], list[Affected]] = {}
    for a in affected:
        if named[a.msg_id] != 1:
            continue
        if a.verdict is Verdict.RECORDS_LOST and not a.held:
            key = (OperatorAction.HOLD, RECORDS_LOST_HOLD.format(region=a.region))
        elif a.verdict is Verdict.BODY_LOST:
            key = (OperatorAction.BOUNCE, _body_lost_reply(sp, a))
        else:
            continue
        groups.setdefault(key, []).append(a)
    fates: dict[str, str] = {}
    queued = {entry.msg_id for entry in sp.list()} if groups else set()
    for (action, reason), group in groups.items():
        try:
            done = sp.act(action, [a.msg_id for a in group], reason=reason)
        except SpoolError:
            for a in group:  # message by message, each with its own error
                fate = _settle_one(sp, a)
                if fate == SETTLED_MEANWHILE and a.msg_id in queued:
                    fate = _bounced(a, reason)  # by the bulk bounce
                fates[a.msg_id] = fate
            continue
        for a in group:
            fates[a.msg_id] = _bulk_fate(a, action, reason, done)
    return fates


def _bulk_fate(a: Affected, action: OperatorAction, reason: str, done: ActionResult) -> str:
    """What ``done`` (a bulk hold or bounce) did to ``a``'s message, worded as
    ``_settle_one`` words it."""
    if a.msg_id in done.unknown:
        return SETTLED_MEANWHILE
    if a.msg_id in done.refused:
        return f"could not be settled: {done.refused[a.msg_id]}"
    if action is OperatorAction.BOUNCE:
        return _bounced(a, reason)
    if a.msg_id in done.unchanged:
        return _stays_held(a)
    return _held(a)


def _body_lost_reply(sp: Spool, a: Affected) -> str:
    """The reply a message whose body was lost fails with: where the damaged bytes are."""
    copy = _kept_copy(sp, a)
    return BODY_LOST_REPLY.format(copy=copy) if copy else BODY_FILE_MISSING_REPLY


def _bounced(a: Affected, reply: str) -> str:
    return f"its body was lost at {a.region}: its pending recipients failed ({reply})"


def _held(a: Affected) -> str:
    return (
        f"records possibly lost at {a.region}: held; check whether its recipients "
        "were delivered, then release or delete it"
    )


def _stays_held(a: Affected) -> str:
    return f"records possibly lost at {a.region}; it stays held"


def _restore_one(sp: Spool, path: str, a: Affected) -> str:
    """Queue again, held, a message whose only envelope was damaged but still decodes."""
    env = a.region.record
    assert isinstance(env, rec.Envelope)
    log_dir = os.path.join(path, fmt.LOG_DIR)
    try:
        if env.body.kind == rec.BODY_FILE:
            data = read_body_file(sp._state.fs, path, env.msg_id)
        else:
            at = env.body.at or Position(a.region.segment, a.region.end)  # first: body follows
            data = read_inline_body(sp._state.fs, log_dir, env.msg_id, at)
        reason = RESTORED_HOLD.format(region=a.region)
        sp._desk.restore_envelope(env, data, Position(a.region.segment, a.region.start), reason)
    except SpoolError as exc:
        return f"its envelope was lost at {a.region} and could not be restored ({exc})"
    return f"its envelope was damaged at {a.region}: {a.detail} (held)"


def _settle_one(sp: Spool, a: Affected) -> str:
    try:
        if a.verdict is Verdict.BODY_AMBIGUOUS:
            return _settle_two_bodies(sp, a)
        if a.verdict is Verdict.BODY_SEGMENT_GONE:
            return _rebind_one(sp, a)
        if a.verdict is Verdict.ENVELOPE_DAMAGED_IN_FLIGHT:
            return f"its envelope was damaged at {a.region} while in flight: {a.detail}"
        if a.verdict is Verdict.FINISH_LOST:
            if a.queued_on is None:
                return f"finish lost at {a.region}: {a.detail}; nothing to settle"
            sp._desk.finish_acknowledged(a.msg_id, a.queued_on)
            return f"finish lost at {a.region}, its start too: {a.detail}; finished again"
        if a.verdict is Verdict.BODY_LOST:
            reply = _body_lost_reply(sp, a)
            sp.bounce(a.msg_id, reply)  # failed, not deleted: the sender must be told
            return _bounced(a, reply)
        if a.verdict is Verdict.RECORDS_LOST:
            if a.held:
                return _stays_held(a)
            sp.hold(a.msg_id, RECORDS_LOST_HOLD.format(region=a.region))
            return _held(a)
    except UnknownMessage:
        return SETTLED_MEANWHILE
    except SpoolError as exc:
        return f"could not be settled: {exc}"
    return f"envelope lost at {a.region}: {a.detail}"


def _settle_two_bodies(sp: Spool, a: Affected) -> str:
    """Hold the message, then keep the body file in incoming/ in corrupt/: the one in
    bodies/ stays its body. A crash between the two leaves it held with both files, and
    the repair run again moves the second."""
    if not a.held:
        sp.hold(a.msg_id, TWO_BODIES_HOLD)
    fs = sp._state.fs
    src = body_file_paths(sp.path, a.msg_id)[0]
    corrupt = os.path.join(sp.path, fmt.CORRUPT_DIR)
    if not fs.is_dir(corrupt):
        fs.mkdir(corrupt, 0o700)
        fs.fsync_dir(sp.path)
    target = os.path.join(corrupt, f"body.{a.msg_id}.{time.strftime('%Y%m%dT%H%M%S')}.second")
    # (X6) A crash before the rename leaves both files (the rerun moves it); after it, the
    # second is in corrupt/, durable with the directory fsyncs below.
    fs.rename(src, target)
    fs.fsync_dir(corrupt)
    fs.fsync_dir(os.path.dirname(src))
    return (
        f"two different body files: held; the one in bodies/ stays its body, the other was "
        f"moved to {os.path.relpath(target, sp.path)}: check which is the message's before "
        "releasing it"
    )


def _rebind_one(sp: Spool, a: Affected) -> str:
    """Name the copy of a body whose segment is gone; without an intact copy, fail the
    message's pending recipients (the sender is told; nothing could deliver it)."""
    try:
        if not sp._desk.rebind_body(a.msg_id):
            return "nothing to do: its envelope no longer names the gone segment"
    except CorruptSpool as exc:
        sp.bounce(a.msg_id, BODY_SEGMENT_GONE_REPLY)
        return (
            f"its body's segment {a.region.segment} was gone and its copy unusable "
            f"({exc.reason}): its pending recipients failed ({BODY_SEGMENT_GONE_REPLY})"
        )
    return f"its body's segment {a.region.segment} was gone: it now names its body file"


def _kept_copy(sp: Spool, a: Affected) -> str:
    """Where the damaged bytes of ``a``'s lost body were kept: the copy of its segment, or
    the body file that step 1 moved to ``corrupt/`` (the newest, should repairs repeat);
    "" when there was nothing to keep (a body file that was missing)."""
    if a.region.kind is not RegionKind.BODY_FILE:
        return a.region.copy or f"{fmt.CORRUPT_DIR}/ (the copy of segment {a.region.segment})"
    fs = sp._state.fs
    corrupt = os.path.join(sp.path, fmt.CORRUPT_DIR)
    prefix = f"body.{a.msg_id}."
    names = fs.listdir(corrupt) if fs.is_dir(corrupt) else []
    kept = sorted(n for n in names if n.startswith(prefix) and n.endswith(".bad"))
    return f"{fmt.CORRUPT_DIR}/{kept[-1]}" if kept else ""
