"""The records of spool logs as rows: one per record and recipient.

A *source* is a spool directory (its log and, when it records one, its archive of retired
segments) or an archive directory alone. ``plan_segments`` lists the segments of sources
(one unit of parallel work each); ``segment_rows`` decodes one with the spool's own reader
and record codec, so the analytics read exactly what recovery reads:

- a live spool is read up to the end of what is on disk; a torn or half-written tail of
  the newest segment is where reading stops, quietly (as ``spool list`` does);
- damage before that is ``CorruptSpool`` naming file and offset, or, with
  ``on_damage="skip"``, one row of kind ``damaged`` (the reason in ``reply``) and the rest
  of that segment skipped; a segment of a format version the spool does not read is
  damage too (its header says so);
- a segment file this user may not read (its owner or mode), or whose read fails (an I/O
  error), is ``SegmentUnreadable``, whatever ``on_damage`` says: nothing of it was read, so
  nothing is known to be damaged; something else under a segment's name (a directory) is
  damage as the reader names it ("not a segment file (...)");
- files in a log or archive directory not named as segments (``<20 digits>.seg``) are
  not read, as the spool itself does not read them.

Reads only; takes no lock, so it runs beside a running owner.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Final

import attrs

from spool import format as fmt
from spool import records as rec
from spool.analytics.lean_rows import kind_of, lean_rows
from spool.errors import CorruptSpool, NotASpool, SegmentUnreadable
from spool.fs import FileSystem
from spool.options import archive_path, load_settings, resolve_options
from spool.positions import load_positions, unretired
from spool.reader import LogCursor, list_segments
from spool.records import Position

COLUMNS: Final = (
    ("server", "string"),
    ("segment", "long"),
    ("offset", "long"),
    ("time", "double"),  # seconds since the epoch, as the records carry them
    ("msg_id", "string"),
    ("record", "string"),  # envelope, start, delta, finish, control, damage
    ("kind", "string"),
    ("sender", "string"),
    ("recipient", "string"),
    ("status", "string"),
    ("reply", "string"),
    ("attempt", "int"),
    ("klass", "int"),
    ("held", "string"),
    ("body_size", "long"),
    ("accepted_at", "double"),
)
SCHEMA: Final = ", ".join(f"{name} {kind}" for name, kind in COLUMNS)


@attrs.frozen
class SegmentSource:
    """One segment to read: picklable, so it can travel to a Spark executor."""

    server: str
    log_dir: str
    segment: int
    newest: int | None  # the newest segment of a live log (where a torn tail may be)
    durable_end: tuple[int, int] | None  # the restart positions' consistent end
    # A live spool's archive_dir: where the segment is once retired after planning.
    archive: str | None = None


def parse_source(text: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (the server name is then the directory's name)."""
    name, sep, path = text.partition("=")
    if not sep or os.sep in name:
        path, name = text, ""
    path = os.path.abspath(path)
    return (name or os.path.basename(path.rstrip(os.sep)) or path), path


def plan_segments(sources: list[str], fs: FileSystem | None = None) -> list[SegmentSource]:
    """Every segment of ``sources`` (``NAME=PATH`` or ``PATH``), oldest first per source.

    A spool directory gives its live segments and, when it archives, the archived segments
    older than them (a segment in both, left by a crash midway through archiving, is read
    once, from the log). Raises ``NotASpool`` for a path that is neither kind.
    """
    fs = fs or FileSystem()
    plan: list[SegmentSource] = []
    names: dict[str, str] = {}
    read: dict[str, str] = {}  # directory of segments -> the source it was read for
    for text in sources:
        server, path = parse_source(text)
        if not os.path.exists(path):
            raise NotASpool(f"{path}: no such directory (give a spool directory or its archive)")
        if not os.path.isdir(path):
            raise NotASpool(f"{path}: not a directory (give a spool directory or its archive)")
        if names.setdefault(server, path) != path:
            raise NotASpool(
                f"server name {server!r} given to two directories ({names[server]} and "
                f"{path}): name them apart (NAME=DIR)"
            )
        log_dir = os.path.join(path, fmt.LOG_DIR)
        if os.path.isdir(log_dir):
            found = _spool_segments(fs, server, path, log_dir)
        elif _segment_numbers(path):
            found = _archived(server, path, _segment_numbers(path), below=None)
        elif not os.listdir(path):
            raise NotASpool(
                f"{path}: an empty directory, neither a spool nor an archive with segments "
                "(an unmounted file system?)"
            )
        else:
            raise NotASpool(
                f"{path}: not a spool directory (no {fmt.LOG_DIR}/) nor an archive of "
                f"segments (no *{fmt.SEGMENT_SUFFIX} files)"
            )
        for directory in {os.path.realpath(s.log_dir) for s in found}:
            if directory in read:
                raise NotASpool(
                    f"{text}: its segments in {directory} are read already for "
                    f"{read[directory]} (a spool is read with its archive): give each once"
                )
            read[directory] = text
        plan.extend(found)
    return plan


def _spool_segments(fs: FileSystem, server: str, root: str, log_dir: str) -> list[SegmentSource]:
    positions = load_positions(fs, root)
    live = unretired(list_segments(fs, log_dir), positions)
    plan: list[SegmentSource] = []
    archive = archive_path(root, resolve_options(load_settings(fs, root), {}))
    if archive is not None and os.path.isdir(archive):
        below = live[0] if live else None
        plan.extend(_archived(server, archive, _segment_numbers(archive), below))
    end = positions.consistent if positions is not None else None
    newest = live[-1] if live else None
    kept = archive if archive is not None and os.path.isdir(archive) else None
    for seg in live:
        durable = (end.segment, end.offset) if end else None
        plan.append(SegmentSource(server, log_dir, seg, newest, durable, kept))
    return plan


def _archived(
    server: str, directory: str, numbers: list[int], below: int | None
) -> list[SegmentSource]:
    # An archived segment is complete: any bad frame in it is damage, never a torn tail.
    return [
        SegmentSource(server, directory, n, None, (n + 1, 0))
        for n in numbers
        if below is None or n < below
    ]


def _segment_numbers(directory: str) -> list[int]:
    numbers = []
    for name in os.listdir(directory):
        stem, dot, suffix = name.partition(".")
        if dot and "." + suffix == fmt.SEGMENT_SUFFIX and stem.isdigit():
            numbers.append(int(stem))
    return sorted(numbers)


def segment_rows(
    source: SegmentSource,
    *,
    on_damage: str = "error",
    start: int = 0,
    stop: int | None = None,
    fs: FileSystem | None = None,
) -> Iterator[tuple[Any, ...]]:
    """The rows (in ``COLUMNS`` order) of one segment's records, in log order: of the
    frames from byte ``start`` (a frame boundary) to ``stop`` (the end of the segment if
    None)."""
    fs = fs or FileSystem()
    path = os.path.join(source.log_dir, fmt.segment_name(source.segment))
    if source.archive is not None and not fs.exists(path):
        # Retired since it was planned, into the archive: complete there, read there.
        yield from _archived_rows(source, on_damage, start, stop, fs)
        return
    if stop is None:
        try:
            stop = fs.file_size(path)  # what is there now: the end, asked once, not per frame
        except FileNotFoundError:
            # Deleted since it was planned (a live spool's garbage collection), or retired
            # into its archive since the look above.
            yield from _archived_rows(source, on_damage, start, stop, fs)
            return
        except OSError as exc:
            raise SegmentUnreadable.from_os_error(path, exc) from None
    # The record frames from ``start`` to ``stop`` (bodies stepped over, unread):
    # ``LogCursor.segment_frames``, which reads the range at once and decides at its
    # first bad frame as the spool's reader does.
    cursor = _cursor(fs, source, start)
    frames = cursor.segment_frames(stop)
    framed = False  # whether the file was found and a record of it read
    # Locals, not lookups: this loop is the analytics' decode, a pass a record.
    record_map, decode = rec.record_map, rec.decode_stored
    server, segment = source.server, source.segment
    try:
        for offset, ftype, payload in frames:
            framed = True
            obj = record_map(payload)
            rows = None if obj is None else lean_rows(server, segment, offset, ftype, obj)
            if rows is None:  # not as the spool writes it: the record codec decides
                try:
                    record = decode(ftype, payload, path, offset)
                except CorruptSpool as exc:
                    if on_damage != "skip":
                        raise
                    yield _damage_row(source, exc)
                    return
                rows = record_rows(server, segment, offset, record)
            yield from rows
    except CorruptSpool as exc:
        if on_damage != "skip":
            raise
        yield _damage_row(source, exc)
    except OSError as exc:
        # Not damage (its bytes were never read): an error whatever ``on_damage`` says,
        # one line on the driver (command.spool_error_in), not a traceback.
        raise SegmentUnreadable.from_os_error(path, exc) from None
    finally:
        frames.close()
        cursor.close()
    if not framed and source.archive is not None and not fs.exists(path):
        # Retired between the look above and the open: nothing of it was read here.
        yield from _archived_rows(source, on_damage, start, stop, fs)


def _archived_rows(
    source: SegmentSource, on_damage: str, start: int, stop: int | None, fs: FileSystem
) -> Iterator[tuple[Any, ...]]:
    """The rows of a live spool's segment from its archive, where a checkpoint moved it
    (complete there: any bad frame is damage); none if it is not there either."""
    if source.archive is None:
        return
    moved = SegmentSource(
        source.server, source.archive, source.segment, None, (source.segment + 1, 0)
    )
    yield from segment_rows(moved, on_damage=on_damage, start=start, stop=stop, fs=fs)


def readable_end(source: SegmentSource, start: int = 0, fs: FileSystem | None = None) -> int:
    """The offset after the last whole frame of the segment from ``start`` on: where a
    reader following a live spool has read up to (a torn or half-written frame at the end
    is not counted; the next look reads it once it is whole). Damage ends the look too;
    reading the rows reports it."""
    fs = fs or FileSystem()
    cursor = _cursor(fs, source, start)
    end = Position(source.segment + 1, 0)
    offset = start
    try:
        while (item := cursor.next(end)) is not None:
            pos, frame = item
            offset = pos.offset + frame.size
    except CorruptSpool:
        pass
    finally:
        cursor.close()
    return offset


def _cursor(fs: FileSystem, source: SegmentSource, start: int) -> LogCursor:
    return LogCursor(
        fs,
        source.log_dir,
        Position(source.segment, start),
        durable_end=Position(*source.durable_end) if source.durable_end else None,
        newest_segment=source.newest,
        skip_bodies=True,
        beside_owner=True,
    )


def _damage_row(source: SegmentSource, exc: CorruptSpool) -> tuple[Any, ...]:
    return (
        source.server, source.segment, exc.offset, None, None, "damage", "damaged",
        None, None, None, f"{exc.path} at {exc.offset}: {exc.reason}", None, None, None, None, None,
    )  # fmt: skip


def record_rows(server: str, seg: int, off: int, record: rec.Record) -> list[tuple[Any, ...]]:
    """The rows of one record (see ``COLUMNS``) at byte ``off`` of segment ``seg`` (a
    list: cheaper than a generator for the one row most records have)."""
    if isinstance(record, rec.Delta):
        kind = kind_of(record.status, record.reply)
        status, reply, at, msg_id = record.status, record.reply, record.at, record.msg_id
        return [
            (
                server, seg, off, at, msg_id, "delta", kind,
                None, r, status, reply, None, None, None, None, None,
            )
            for r in record.recipients
        ]  # fmt: skip
    if isinstance(record, rec.Envelope):
        kind = "requeued" if record.supersedes is not None else "accepted"
        return [
            (
                server, seg, off, record.written_at, record.msg_id, "envelope", kind,
                record.sender, r, None, record.last_reply, record.attempts, record.klass,
                record.held, record.body.size, record.accepted_at,
            )
            for r in record.recipients
        ]  # fmt: skip
    if isinstance(record, rec.Start):
        return [(
            server, seg, off, record.at, record.msg_id, "start", "started",
            None, None, None, None, None, record.klass, None, None, None,
        )]  # fmt: skip
    if isinstance(record, rec.Finish):
        if not record.outcomes:
            # A finish naming no recipient (recovery's, when damage took the one that
            # named them: docs/design.md, R5 and R6): one row, its reason in ``reply``, so
            # that the message is still seen to have left the queue.
            return [(
                server, seg, off, record.at, record.msg_id, "finish", "finished",
                record.sender, None, None, record.reason or None, None, None,
                None, record.body.size, record.accepted_at,
            )]  # fmt: skip
        return [
            (
                server, seg, off, record.at, record.msg_id, "finish", "finished",
                record.sender, o.recipient, kind_of(o.status, o.reply), o.reply, None, None,
                None, record.body.size, record.accepted_at,
            )
            for o in record.outcomes
        ]  # fmt: skip
    assert isinstance(record, rec.Control), record
    return [(
        server, seg, off, record.at, record.target or None, "control", record.action,
        None, None, None, record.why or None, None, None, None, None, None,
    )]  # fmt: skip
