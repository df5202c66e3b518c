"""Queue runners: one cursor per retry class, walking the log behind its head.

Runner ``k`` trails the head of the log by ``interval[k]``: it stops at the first envelope
of its class that is not yet due (``written_at + interval[k] > now``) and passes everything
else at once, so its cursor marks the oldest envelope it still owes an attempt, and a class
with nothing pending does not hold the garbage front back. It picks up the envelopes of
class ``k`` (the last
runner also takes any higher class, so shrinking ``retry_intervals`` strands nothing) and
steps over everything else: other classes, start/delta/finish records, and BODY frames,
whose payload it never reads. Runner 0 (interval 0) follows the head: fresh mail.

An envelope is *superseded* when a later record replaced it. The runner of its class
passing it is the usual superseder (it writes the start record as it passes); anything
else that supersedes an envelope ahead of its runner (an operator action, recovery)
adds the envelope's position to the shared ``superseded`` set, which runners consult and
which is pruned once every cursor has passed an entry. It is small: bounded by the
operator actions and recoveries of the last longest retry interval.

Skipping idle stretches: a runner would otherwise read every record appended since its
cursor, once per class, even when its class has nothing pending (after a burst of accepts
with no claims, that is the whole burst, for every deferred class). So each runner keeps
``owned_pending``: how many envelopes of its class lie between its cursor and the tail of
the log. The spool counts up as it appends such an envelope; the runner counts down as it
reaches one. When the count is zero the runner jumps straight to the durable end. The count
is unknown (None) after an open, until the runner first reaches the end of the log by
walking; then the spool tells it how many of its envelopes were appended past that point
and not yet durable. An error in the count can only be an overcount (a walk) as long as
every append is counted; the crash explorer's claim-everything check would see a skip.

Jumping between its own envelopes: along with the count, a runner keeps the positions of
those envelopes (``owned_ahead``, in log order), so that it reads only them and steps over
everything between (other classes' envelopes, start/delta/finish records, BODY and PAD
frames) without reading it: about 13 frames a message, visited by every runner with mail
of its class pending, were most of a claim's work. Its next read lands on a frame boundary
(a position the writer gave), as a skip to the head does. The positions are known whenever
the count is, up to ``AHEAD_MAX`` of them; past that the runner walks on the count alone
(as it did before positions were kept) until the count falls to zero, which makes them
known again (none). A position short of the runner's next envelope (a frame that is not
it) makes the runner forget the positions and walk; a position past it would skip it, as an
uncounted append would (the crash explorer's mutant ``replacement_position_past_it``):
every position comes from ``Scheduler.note_envelope``, with the count.

Memory: one envelope of look-ahead per runner, and up to ``AHEAD_MAX`` positions. The
queue itself stays on disk.
Not thread-safe: the spool calls runners with its lock held.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import attrs

from spool import format as fmt
from spool import records as rec
from spool.errors import CorruptSpool
from spool.framing import Frame
from spool.fs import FileSystem
from spool.reader import LogCursor
from spool.records import Envelope, Position


@attrs.frozen
class NotDue:
    """The runner's next envelope becomes due at ``at`` (clock time)."""

    at: float


IDLE = None  # the runner is at the durable end of the log
AHEAD_MAX: Final = 16_384  # positions a runner keeps of its envelopes ahead (256 KiB)
PRIME_FRAMES: Final = 64  # frames ``prime`` steps over at most


class PositionQueue:
    """Positions in log order, first in first out, in 16 bytes each (two arrays of 64-bit
    numbers and the index of the first): a runner may keep ``AHEAD_MAX`` of them, and as
    ``Position`` objects in a deque they took about 105 bytes each (1.7 MiB a runner, and
    a spool may have 65 runners)."""

    def __init__(self, positions: Iterable[Position] = ()) -> None:
        self._segments = array("Q")
        self._offsets = array("Q")
        self._head = 0
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self._segments) - self._head

    def append(self, position: Position) -> None:
        self._segments.append(position.segment)
        self._offsets.append(position.offset)

    def first(self) -> Position:
        """The oldest position (the queue must not be empty)."""
        return Position(self._segments[self._head], self._offsets[self._head])

    def pop_first(self) -> None:
        """Drop the oldest position; the space of those dropped is given back once they
        are half of the arrays (each position is moved at most once on average)."""
        self._head += 1
        if self._head >= 1024 and 2 * self._head >= len(self._segments):
            del self._segments[: self._head]
            del self._offsets[: self._head]
            self._head = 0


class Runner:
    """The cursor of retry class ``klass``."""

    def __init__(
        self,
        fs: FileSystem,
        log_dir: str,
        klass: int,
        interval: float,
        last: bool,
        start: Position,
        written_at: Callable[[Position, Envelope], float],
    ) -> None:
        self.klass = klass
        self._written_at = written_at  # when an envelope counts as written (clock.py)
        self.interval = interval
        self.last = last
        self._reader = LogCursor(
            fs, log_dir, start, skip_bodies=True, chunk_size=64 * 1024, live=True
        )
        self._peek: tuple[Position, Envelope, int] | None = None
        self.envelopes_seen = 0
        self.owned_pending: int | None = None  # see the module docstring
        # The positions of those envelopes, when known (see the module docstring).
        self.owned_ahead: PositionQueue | None = None
        self.skipped_to_head = 0
        self.jumps = 0

    @property
    def cursor(self) -> Position:
        """The next record this runner has not dealt with."""
        return self._peek[0] if self._peek is not None else self._reader.position

    def close(self) -> None:
        self._reader.close()

    def owns(self, env: Envelope) -> bool:
        return env.klass == self.klass or (self.last and env.klass > self.klass)

    def appended(self, at: Position) -> None:
        """The spool appended an envelope of this runner's class at ``at`` (ahead of its
        cursor)."""
        if self.owned_pending is not None:
            self.owned_pending += 1
        ahead = self.owned_ahead
        if ahead is not None:
            if len(ahead) < AHEAD_MAX:
                ahead.append(at)
            else:
                self.owned_ahead = None  # walk on the count; known again when it is zero

    def _seed(self, pending: Sequence[Position]) -> None:
        """The walk reached the end of the log: ``pending`` are this class's envelopes
        appended past it, not yet durable (in log order)."""
        self.owned_pending = len(pending)
        self.owned_ahead = PositionQueue(pending) if len(pending) <= AHEAD_MAX else None

    def prime(
        self, limit: Position, pending_past: Callable[[int, Position], Sequence[Position]]
    ) -> None:
        """At open: learn the count now if nothing of any class lies between the cursor
        and the durable end ``limit`` (a new spool; a runner at the head when the spool
        closed), rather than at the first walk to the end, which a spool that accepts
        before its first claim would make only once it had walked all it accepted.

        Steps over at most ``PRIME_FRAMES`` frames that are not envelopes (as a walk
        would), and stops at an envelope without taking it. Damage there is left where it
        is, for the first claim to meet, as it would without this look: an open that did
        not fail before does not fail now."""
        if self.owned_pending is not None or self._peek is not None:
            return
        start = self._reader.position
        try:
            for _ in range(PRIME_FRAMES):
                item = self._reader.next(limit)
                if item is None:
                    if self._reader.position >= limit:
                        self._seed(pending_past(self.klass, limit))
                    return
                pos, frame = item
                if isinstance(frame, Frame) and frame.type == fmt.T_ENVELOPE:
                    self._reader.position = pos  # not taken: read again by the first walk
                    return
        except CorruptSpool:
            self._reader.position = start

    def next_due(
        self,
        now: float,
        limit: Position,
        superseded: set[Position],
        pending_past: Callable[[int, Position], Sequence[Position]] | None = None,
    ) -> tuple[Position, Envelope, int] | NotDue | None:
        """The next due, live envelope of this runner's class, ``NotDue``, or ``IDLE``.

        Returns (position, envelope, frame size). The runner moves past what it returns:
        the caller must act on it (start an attempt, re-append it, or expire it).
        ``pending_past(klass, limit)`` lists this class's envelopes appended at or after
        ``limit`` (not yet durable); it seeds ``owned_pending`` when the walk ends.
        """
        while True:
            if self._peek is None:
                reader = self._reader
                if self.owned_pending == 0 and reader.position < limit:
                    # Nothing of this class between the cursor and the tail: skip to the
                    # durable end (a frame boundary) without reading what lies between.
                    reader.position = limit
                    self.skipped_to_head += 1
                elif self.owned_ahead and reader.position < (ahead := self.owned_ahead.first()):
                    # Nothing of this class before its next envelope: jump there (a frame
                    # boundary), or to the durable end if that envelope is past it.
                    reader.position = min(ahead, limit)
                    self.jumps += 1
                item = reader.next(limit)
                if item is None:
                    if (
                        self.owned_pending is None
                        and pending_past is not None
                        and reader.position >= limit
                    ):
                        self._seed(pending_past(self.klass, limit))
                    return IDLE
                pos, frame = item
                if not isinstance(frame, Frame) or frame.type != fmt.T_ENVELOPE:
                    continue
                env = rec.decode_stored(
                    frame.type, frame.payload, self._reader.path(pos.segment), pos.offset
                )
                assert isinstance(env, Envelope)
                self.envelopes_seen += 1
                if not self.owns(env):
                    # Not this runner's business, whatever its time: pass it now, so a
                    # runner with nothing of its class to do sits at the head and does
                    # not hold the garbage front back.
                    continue
                if self.owned_pending is not None:
                    # One fewer of ours ahead. Below zero means an append went uncounted:
                    # fall back to walking rather than ever skipping one.
                    self.owned_pending -= 1
                    if self.owned_pending < 0:
                        self.owned_pending = self.owned_ahead = None
                    elif self.owned_ahead is None:
                        if self.owned_pending == 0:
                            self.owned_ahead = PositionQueue()  # known again: none
                    elif self.owned_ahead and self.owned_ahead.first() == pos:
                        self.owned_ahead.pop_first()
                    else:
                        self.owned_ahead = None  # not where it was said to be: walk
                if pos in superseded:
                    continue
                self._peek = (pos, env, frame.size)
            pos, env, size = self._peek
            due = self._written_at(pos, env) + self.interval
            if due > now:
                return NotDue(due)
            self._peek = None
            if pos in superseded:
                continue  # superseded while it waited at the front of this runner
            return pos, env, size
