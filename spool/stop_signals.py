"""Stop signals (SIGTERM, SIGINT) recorded without taking a lock.

Python runs a signal's handler on the main thread, between two bytecodes of whatever
that thread is running. If the handler takes a lock the main thread already holds, the
process hangs for good. ``threading.Event.set()`` takes the event's lock, and the main
thread holds that lock for a few bytecodes of every ``Event.wait()``: an owner waiting on
an event for its stop signal stopped on SIGTERM almost always, and hung now and then,
most often when the signal came just after SIGCONT, with the wait's timeout run out.

So the handler here only appends to a list (atomic, no lock), and the main thread polls
it: a stop is seen at most one poll interval late.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any


class StopSignals:
    """The stop signals received since ``install``, in order; see the module's doc."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Record ``signals`` from now on (main thread only, as Python requires)."""
        for s in signals:
            self._previous[s] = signal.signal(s, self._record)

    def ignore(self) -> None:
        """Ignore further stop signals (a stop under way is not cut short)."""
        for s in self._previous:
            signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        """Put back the handlers found at ``install``."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)  # no lock: see the module's doc

    @property
    def stopped(self) -> bool:
        """Whether a stop signal has come."""
        return bool(self.received)

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` unless a stop signal has come; return ``stopped``. The
        sleep runs the handler when a signal comes, and then goes on to its end."""
        if not self.received:
            time.sleep(seconds)
        return bool(self.received)
