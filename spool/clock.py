"""The spool's time: wall-clock stamps, monotonic scheduling, and stamps from other clocks.

The rule (docs/design.md, "Time"):

- Within an open, the spool's time is the wall clock read at open, advanced by the monotonic
  clock. A step of the wall clock while the spool is open (a host corrected by a day, a
  clock that jumps ten days ahead for a moment) changes nothing: retry intervals, expiry
  and attempt leases keep running in real elapsed time. The stamps the spool writes are
  this time, so within an open they never go back. ``Spool.statistics()["clock_skew"]``
  shows how far the wall clock has moved away since the open; the next open reads it again.
- Across a restart the wall clock is the only clock there is. An envelope written before
  this open and stamped later than the open's time (the clock went back across the restart)
  is due at once (when it was really written is unknown; its attempt rewrites it with a true
  stamp), and is aged as if accepted at the open, so it never expires earlier than it would
  have. An envelope stamped in the
  past is simply due; its age counts the time the spool was down, as Postfix counts a
  message's time in the queue from its arrival.
- Every envelope written has ``accepted_at <= written_at``: a rewritten envelope whose
  acceptance was stamped in the future carries the rewrite's time instead.

Tests and simulations pass a ``Clock`` they move by hand (``spool.testing.FakeClock``), or a
plain callable, which is a wall clock that never steps (it serves as both clocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from spool.records import Envelope, Position


@runtime_checkable
class Clock(Protocol):
    """A wall clock (seconds since the epoch) and a monotonic clock (any origin)."""

    def wall(self) -> float: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The host's clocks: ``time.time`` and ``time.monotonic``."""

    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class _SteadyClock:
    """A plain callable as a clock: its one reading serves as both, so it never steps."""

    def __init__(self, read: Callable[[], float]) -> None:
        self._read = read

    def wall(self) -> float:
        return self._read()

    def monotonic(self) -> float:
        return self._read()


def as_clock(clock: Clock | Callable[[], float]) -> Clock:
    """``clock`` as a ``Clock``: a callable becomes a clock that never steps."""
    if isinstance(clock, Clock):
        return clock
    return _SteadyClock(clock)


class SpoolTime:
    """The time of one open of a spool (the module docstring gives the rule).

    ``opened_at`` is the wall clock read at open; ``epoch`` the first position written in
    this open (everything before it was written by an earlier open, under another reading
    of the wall clock).
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.opened_at = clock.wall()
        self._mono_at_open = clock.monotonic()
        self._last = self.opened_at
        self.epoch: Position | None = None

    def now(self) -> float:
        """The spool's time: never earlier than any time it returned before."""
        elapsed = self._clock.monotonic() - self._mono_at_open
        now = self.opened_at + elapsed
        if now < self._last:
            now = self._last  # a monotonic clock never goes back; a hand-moved one might
        self._last = now
        return now

    def skew(self) -> float:
        """How far the wall clock stands from the spool's time (positive: ahead)."""
        return self._clock.wall() - self.now()

    def written_at(self, pos: Position, env: Envelope) -> float:
        """When ``env`` (at ``pos``) counts as written, for its retry schedule."""
        if self.epoch is not None and pos < self.epoch and env.written_at > self.opened_at:
            # Stamped in the future by an earlier open: when it was really written is
            # unknown, so it is due now; its attempt rewrites it with a true stamp. (Due
            # one interval after the open instead, it would never come due in opens
            # shorter than its interval: a queue run from cron.)
            return float("-inf")
        return env.written_at

    def accepted_at(self, pos: Position, env: Envelope) -> float:
        """When ``env`` (at ``pos``) counts as accepted, for its lifetime."""
        if env.accepted_at > self.opened_at and (self.epoch is None or pos < self.epoch):
            return self.opened_at  # stamped in the future by an earlier open
        return env.accepted_at
