"""A read-only view of the queue: the live messages and each message's history.

Walks the log from the oldest segment on disk to its end, so it costs time in proportion
to the live log and memory in proportion to the live messages: meant for operators
(``list``, ``show``, ``stats``) and tests, not for the delivery path. It takes no lock and
writes nothing, so it works beside a running owner: it reads what is on disk, stopping
quietly at a torn or still-being-written tail.

Errors:
    ``CorruptSpool`` when a frame before the tail fails its check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import attrs

from spool import format as fmt
from spool import records as rec
from spool.framing import Frame
from spool.fs import FileSystem
from spool.positions import load_positions, unretired
from spool.reader import LogCursor, list_segments
from spool.records import Position

T = TypeVar("T")

INCOMING = "incoming"
DEFERRED = "deferred"
ACTIVE = "active"
HELD = "held"


@attrs.frozen
class QueueEntry:
    """One live message as ``Spool.list()`` and ``spool list`` show it."""

    msg_id: str
    sender: str
    recipients: tuple[str, ...]
    accepted_at: float
    attempts: int
    klass: int
    next_attempt_at: float
    held: str | None
    state: str
    body_size: int
    body_kind: str
    envelope_at: Position
    last_reply: str | None
    # Each pending recipient's own last reply, in the order of ``recipients`` (None: not
    # yet attempted). From the attempts' records while they are in the log; once a
    # checkpoint freed them, the message's last reply stands for each recipient.
    replies: tuple[str | None, ...] = ()


def walk(
    fs: FileSystem,
    root: str,
    *,
    skip_bodies: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[Position, rec.Record | None, Frame | None]]:
    """Every record of the log in order, as (position, record or None, frame).

    Body and pad frames come back with record None (bodies only when ``skip_bodies`` is
    False; otherwise they are stepped over). Stops quietly at a torn tail; raises
    ``CorruptSpool`` at damage. ``progress(n)`` is told of each n segments passed.
    """
    log_dir = os.path.join(root, fmt.LOG_DIR)
    positions = load_positions(fs, root)
    segments = unretired(list_segments(fs, log_dir), positions)
    if not segments:
        return
    cursor = LogCursor(
        fs,
        log_dir,
        Position(segments[0], 0),
        # Bad bytes before the positions' end are damage, never a tail to stop at quietly.
        durable_end=positions.consistent if positions else None,
        newest_segment=segments[-1],
        skip_bodies=skip_bodies,
        beside_owner=True,
    )
    segment = segments[0]
    try:
        for pos, frame in cursor:
            if progress is not None and pos.segment != segment:
                progress(pos.segment - segment)
                segment = pos.segment
            if not isinstance(frame, Frame):
                continue
            if frame.type in (fmt.T_BODY, fmt.T_PAD):
                yield pos, None, frame
                continue
            record = rec.decode_stored(
                frame.type, frame.payload, cursor.path(pos.segment), pos.offset
            )
            yield pos, record, frame
        if progress is not None:
            progress(segments[-1] - segment + 1)
    finally:
        cursor.close()


# A walk that a concurrent segment deletion overtook is repeated (see live_messages).
WALK_ATTEMPTS = 10


def live_messages(
    fs: FileSystem,
    root: str,
    intervals: tuple[float, ...],
    progress: Callable[[int], None] | None = None,
) -> dict[str, QueueEntry]:
    """The live messages by id. ``intervals[k]`` is retry class k's delay (class 0: 0);
    ``progress`` as ``walk`` tells it."""
    return _stable(fs, root, lambda: _live_messages_once(fs, root, intervals, progress))


def _stable(fs: FileSystem, root: str, walk_once: Callable[[], T]) -> T:
    """Run a walk of the log until no segment vanished under it.

    A checkpoint of a running owner may delete old segments while the walk reads them; a
    walk overtaken that way ends early (a message finished in a deleted segment would look
    live, later ones missing), so it is repeated (at most ``WALK_ATTEMPTS`` times).
    """
    log_dir = os.path.join(root, fmt.LOG_DIR)
    for _ in range(WALK_ATTEMPTS):
        oldest = list_segments(fs, log_dir)[:1]
        result = walk_once()
        if list_segments(fs, log_dir)[:1] == oldest:
            break
    return result


def _live_messages_once(
    fs: FileSystem,
    root: str,
    intervals: tuple[float, ...],
    progress: Callable[[int], None] | None,
) -> dict[str, QueueEntry]:
    live: dict[str, QueueEntry] = {}
    deferrals: dict[str, dict[str, str]] = {}  # msg_id -> recipient -> its last reply
    for pos, record, frame in walk(fs, root, progress=progress):
        if isinstance(record, rec.Envelope):
            assert frame is not None
            replies = deferrals.get(record.msg_id, {})
            fallback = record.last_reply
            live[record.msg_id] = attrs.evolve(
                entry_for(record, pos, frame.size, intervals),
                replies=tuple(replies.get(r, fallback) for r in record.recipients),
            )
        elif isinstance(record, rec.Delta):
            if record.status == rec.DEFERRED:
                got = deferrals.setdefault(record.msg_id, {})
                got.update(dict.fromkeys(record.recipients, record.reply))
        elif isinstance(record, rec.Start):
            entry = live.get(record.msg_id)
            if entry is not None and entry.envelope_at == record.envelope_at:
                live[record.msg_id] = attrs.evolve(entry, state=ACTIVE)
        elif isinstance(record, rec.Finish):
            live.pop(record.msg_id, None)
            deferrals.pop(record.msg_id, None)
        elif isinstance(record, rec.Control) and record.action == rec.OUTCOME_ACK:
            # Only a durable finish is acknowledged: one still live here had its finish
            # lost to damage a repair set aside (recovery settles it the same way).
            live.pop(record.target, None)
            deferrals.pop(record.target, None)
    return live


def entry_for(
    env: rec.Envelope, pos: Position, size: int, intervals: tuple[float, ...]
) -> QueueEntry:
    klass = min(env.klass, len(intervals) - 1)
    if env.held is not None:
        state = HELD
    elif env.attempts == 0 and env.klass == 0:
        state = INCOMING
    else:
        state = DEFERRED
    return QueueEntry(
        msg_id=env.msg_id,
        sender=env.sender,
        recipients=env.recipients,
        accepted_at=env.accepted_at,
        attempts=env.attempts,
        klass=env.klass,
        next_attempt_at=env.written_at + intervals[klass],
        held=env.held,
        state=state,
        body_size=env.body.size,
        body_kind=env.body.kind,
        envelope_at=pos,
        last_reply=env.last_reply,
    )


def history(fs: FileSystem, root: str, msg_id: str) -> list[tuple[Position, rec.Record]]:
    """Every record of ``msg_id`` still in the log, oldest first."""
    return _stable(fs, root, lambda: _history_once(fs, root, msg_id))


def _history_once(fs: FileSystem, root: str, msg_id: str) -> list[tuple[Position, rec.Record]]:
    out = []
    for pos, record, _frame in walk(fs, root):
        if record is None:
            continue
        ident = record.target if isinstance(record, rec.Control) else record.msg_id
        if ident == msg_id:
            out.append((pos, record))
    return out
