"""A thread of the owner that works on its open spool until told to stop.

The bouncer and the delay warner share this skeleton: start, a loop that pauses between
steps (and sees a stop at once), stop after the step in hand, and the same end when the
spool closes or fails under it (the owner's own calls report a failed spool).
"""

from __future__ import annotations

import logging
import threading

from spool.errors import SpoolClosed, SpoolError


class BackgroundLoop:
    """Runs ``step`` in a daemon thread, pausing for what it returns, until ``stop``."""

    name = "spool-background"  # the thread's name
    first_pause = 0.0  # seconds before the first step

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop after the step in hand (each step's work is whole or not begun)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called: a long step checks it to end early."""
        return self._stop.is_set()

    def step(self) -> float:
        """One round of work; the seconds to pause before the next one."""
        raise NotImplementedError

    def _run(self) -> None:
        pause = self.first_pause
        while not self._stop.wait(pause):
            try:
                pause = self.step()
            except SpoolClosed:
                return
            except SpoolError as exc:  # a failed spool: the owner's own calls report it
                self._log.error("%s stopped: %s", self.name, exc)
                return
