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

Memory: one envelope of look-ahead per runner. The queue itself stays on disk.
Not thread-safe: the spool calls runners with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from spool import format as fmt
from spool import records as rec
from spool.framing import Frame
from spool.fs import FileSystem
from spool.reader import LogCursor
from spool.records import Envelope, Position


@attrs.frozen
class NotDue:
    """The runner's next envelope becomes due at ``at`` (clock time)."""

    at: float


IDLE = None  # the runner is at the durable end of the log


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
        self.skipped_to_head = 0

    @property
    def cursor(self) -> Position:
        """The next record this runner has not dealt with."""
        return self._peek[0] if self._peek is not None else self._reader.position

    def close(self) -> None:
        self._reader.close()

    def owns(self, env: Envelope) -> bool:
        return env.klass == self.klass or (self.last and env.klass > self.klass)

    def appended(self) -> None:
        """The spool appended an envelope of this runner's class (ahead of its cursor)."""
        if self.owned_pending is not None:
            self.owned_pending += 1

    def next_due(
        self,
        now: float,
        limit: Position,
        superseded: set[Position],
        pending_past: Callable[[int, Position], int] | None = None,
    ) -> tuple[Position, Envelope, int] | NotDue | None:
        """The next due, live envelope of this runner's class, ``NotDue``, or ``IDLE``.

        Returns (position, envelope, frame size). The runner moves past what it returns:
        the caller must act on it (start an attempt, re-append it, or expire it).
        ``pending_past(klass, limit)`` counts this class's envelopes appended at or after
        ``limit`` (not yet durable); it seeds ``owned_pending`` when the walk ends.
        """
        while True:
            if self._peek is None:
                if self.owned_pending == 0 and self._reader.position < limit:
                    # Nothing of this class between the cursor and the tail: skip to the
                    # durable end (a frame boundary) without reading what lies between.
                    self._reader.position = limit
                    self.skipped_to_head += 1
                item = self._reader.next(limit)
                if item is None:
                    if (
                        self.owned_pending is None
                        and pending_past is not None
                        and self._reader.position >= limit
                    ):
                        self.owned_pending = pending_past(self.klass, limit)
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
                        self.owned_pending = None
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
