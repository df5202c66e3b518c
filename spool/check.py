"""End-to-end verification of a spool directory, and the repair that sets damage aside.

``check_spool`` reads everything without the lock and without writing: every segment
header and frame (CRC and record decoding, bodies included), every envelope's body
reference (inline BODY frame present and owned by the message; body files present and
intact), orphan body files, and the restart positions against the log. It returns the
problems, each with the file and offset. Intended for ``spool check``, tests and
post-mortem analysis.

``repair_spool`` (owner lock held by the caller) makes a damaged spool openable without
deleting anything: a segment with damage is copied whole into ``corrupt/`` and cut back
to its last good frame (a segment whose header is damaged is replaced by an empty one, so
the numbering stays contiguous); damaged body files are moved into ``corrupt/``; the
positions file is moved aside so the next open scans everything.

Crash safety (repair):
    Each copy into ``corrupt/`` is fdatasynced and its directory fsynced before the
    original is cut or moved, so a crash never loses the damaged bytes; a repeated repair
    finds the same damage (or none) and converges.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

import attrs

from spool import format as fmt
from spool import records as rec
from spool.bodies import check_body_file
from spool.errors import CorruptSpool
from spool.framing import Frame
from spool.fs import FileSystem
from spool.positions import load_positions, unretired
from spool.reader import LogCursor, list_segments
from spool.records import Position
from spool.writer import segment_header


@attrs.frozen
class Problem:
    """One thing wrong with a spool: where and what. ``fatal``: recovery would refuse."""

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

    @property
    def clean(self) -> bool:
        return not self.problems


def check_spool(
    path: str,
    fs: FileSystem | None = None,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Verify the spool at ``path`` end to end; see the module docstring."""
    fs = fs or FileSystem()
    started = time.monotonic()
    log_dir = os.path.join(path, fmt.LOG_DIR)
    body_dir = os.path.join(path, fmt.BODY_DIR)
    problems: list[Problem] = []
    notes: list[str] = []
    segments = list_segments(fs, log_dir) if os.path.isdir(log_dir) else []
    kept = unretired(segments, load_positions(fs, path))
    if len(kept) < len(segments):
        notes.append(f"{len(segments) - len(kept)} retired segment(s) awaiting deletion")
    segments = kept
    for prev, nxt in itertools.pairwise(segments):
        if nxt != prev + 1:
            problems.append(
                Problem(os.path.join(log_dir, fmt.segment_name(prev + 1)), 0, "segment missing")
            )
    live: dict[str, rec.Envelope] = {}
    file_bodies: set[str] = set()
    records = size = 0
    for seg in segments:
        seg_records, seg_bytes = _check_segment(
            fs, log_dir, seg, segments[-1], live, problems, notes
        )
        records += seg_records
        size += seg_bytes
        if progress is not None:
            progress(1)
    for msg_id, env in live.items():
        if env.body.kind == rec.BODY_FILE:
            file_bodies.add(msg_id)
            _check_body_file(fs, body_dir, msg_id, problems)
    present = set(os.listdir(body_dir)) if os.path.isdir(body_dir) else set()
    orphans = sorted(present - file_bodies)
    if orphans:
        notes.append(
            f"{len(orphans)} body file(s) that no live message names (left by a crash during "
            f"an accept or a removal; check --repair moves them to {fmt.CORRUPT_DIR}/): "
            + ", ".join(orphans[:5])
            + (" ..." if len(orphans) > 5 else "")
        )
    _check_positions(fs, path, segments, problems)
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
    )


def _check_segment(
    fs: FileSystem,
    log_dir: str,
    seg: int,
    newest: int,
    live: dict[str, rec.Envelope],
    problems: list[Problem],
    notes: list[str],
) -> tuple[int, int]:
    path = os.path.join(log_dir, fmt.segment_name(seg))
    cursor = LogCursor(fs, log_dir, Position(seg, 0), newest_segment=newest)
    records = 0
    expect_body: tuple[str, Position] | None = None
    try:
        while (item := cursor.next(Position(seg + 1, 0))) is not None:
            pos, frame = item
            assert isinstance(frame, Frame)
            records += 1
            if expect_body is not None:
                owner, at = expect_body
                expect_body = None
                if frame.type != fmt.T_BODY or rec.decode_body(frame.payload)[0] != owner:
                    problems.append(
                        Problem(path, at.offset, f"envelope of {owner} has no body frame")
                    )
            if frame.type in (fmt.T_BODY, fmt.T_PAD):
                continue
            try:
                record = rec.decode(frame.type, frame.payload)
            except rec.RecordError as exc:
                problems.append(Problem(path, pos.offset, f"undecodable record: {exc}"))
                continue
            if isinstance(record, rec.Envelope):
                live[record.msg_id] = record
                if record.body.kind == rec.BODY_INLINE and record.body.at is None:
                    expect_body = (record.msg_id, pos)
            elif isinstance(record, rec.Finish):
                live.pop(record.msg_id, None)
    except CorruptSpool as exc:
        problems.append(Problem(exc.path, exc.offset, exc.reason))
    finally:
        cursor.close()
    if cursor.torn is not None:
        notes.append(
            f"{path}: torn tail of {cursor.torn.bytes} bytes at offset {cursor.torn.at.offset} "
            "(an interrupted last write; the next open cuts it)"
        )
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return records, size


def _check_body_file(fs: FileSystem, body_dir: str, msg_id: str, problems: list[Problem]) -> None:
    path = os.path.join(body_dir, msg_id)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        problems.append(Problem(path, 0, "body file of a live message is missing"))
        return
    why = check_body_file(raw)
    if why is not None:
        problems.append(Problem(path, 0, why))


def _check_positions(
    fs: FileSystem, path: str, segments: list[int], problems: list[Problem]
) -> None:
    pos_path = os.path.join(path, fmt.POSITIONS_NAME)
    if not os.path.exists(pos_path):
        return
    positions = load_positions(fs, path)
    if positions is None:
        problems.append(
            Problem(
                pos_path,
                0,
                "restart positions are damaged (recovery will scan everything)",
                fatal=False,
            )
        )
        return
    if segments and positions.consistent.segment > segments[-1]:
        problems.append(Problem(pos_path, 0, "restart positions point past the end of the log"))
    if segments and positions.working_start.segment < segments[0]:
        problems.append(
            Problem(pos_path, 0, "working suffix starts in a deleted segment", fatal=False)
        )


def repair_spool(path: str, fs: FileSystem | None = None) -> list[str]:
    """Set damaged files aside so that the spool opens; return what was done, a line each."""
    fs = fs or FileSystem()
    report = check_spool(path, fs)
    done: list[str] = []
    corrupt = os.path.join(path, fmt.CORRUPT_DIR)
    if not os.path.isdir(corrupt):
        fs.mkdir(corrupt, 0o700)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    log_dir = os.path.join(path, fmt.LOG_DIR)
    handled: set[str] = set()
    for problem in report.problems:
        if not problem.fatal or problem.path in handled:
            continue
        handled.add(problem.path)
        name = os.path.basename(problem.path)
        if os.path.dirname(problem.path) == log_dir and os.path.exists(problem.path):
            keep = problem.offset if problem.offset >= fmt.SEGMENT_HEADER_SIZE else 0
            target = os.path.join(corrupt, f"{name}.{stamp}.bad")
            _copy_durably(fs, problem.path, target, corrupt)
            number = fmt.parse_segment_name(name)
            assert number is not None
            _cut_segment(fs, problem.path, keep, number)
            done.append(
                f"copied {problem.path} to {target}; kept its first {max(keep, 32)} bytes "
                f"({problem.what} at offset {problem.offset})"
            )
        elif os.path.dirname(problem.path) == os.path.join(path, fmt.BODY_DIR):
            if os.path.exists(problem.path):
                target = os.path.join(corrupt, f"body.{name}.{stamp}.bad")
                fs.rename(problem.path, target)
                done.append(f"moved {problem.path} to {target} ({problem.what})")
        elif problem.what == "segment missing":
            number = fmt.parse_segment_name(name)
            assert number is not None
            _cut_segment(fs, problem.path, 0, number)
            done.append(f"created an empty {problem.path} in place of a missing segment")
    for orphan in report.orphan_bodies:
        src = os.path.join(path, fmt.BODY_DIR, orphan)
        target = os.path.join(corrupt, f"body.{orphan}.{stamp}.orphan")
        fs.rename(src, target)
        done.append(f"moved orphan body file {src} to {target}")
    if report.orphan_bodies:
        fs.fsync_dir(os.path.join(path, fmt.BODY_DIR))
    if any(p.fatal for p in report.problems):
        pos_path = os.path.join(path, fmt.POSITIONS_NAME)
        if os.path.exists(pos_path):
            target = os.path.join(corrupt, f"positions.{stamp}")
            fs.rename(pos_path, target)
            done.append(f"moved {pos_path} to {target}: the next open scans the whole log")
    if done:
        fs.fsync_dir(corrupt)
        fs.fsync_dir(log_dir)
        fs.fsync_dir(path)
    return done


def _copy_durably(fs: FileSystem, src: str, dst: str, dst_dir: str) -> None:
    with open(src, "rb") as f:
        data = f.read()
    fd = fs.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        fs.pwrite(fd, data, 0)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)
    fs.fsync_dir(dst_dir)


def _cut_segment(fs: FileSystem, path: str, keep: int, number: int) -> None:
    """Cut a segment back to ``keep`` bytes, or make it an empty segment (header only)."""
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        if keep < fmt.SEGMENT_HEADER_SIZE:
            fs.ftruncate(fd, 0)
            fs.pwrite(fd, segment_header(number), 0)
        else:
            fs.ftruncate(fd, keep)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)
