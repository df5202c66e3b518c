"""The owner's delivery workers: started, watched, restarted, killed at their lease.

Each worker slot holds one ``python -m spool.worker`` process. A worker that exits after
its ``max_use`` attempts (status 0) is replaced at once; one that dies otherwise is
replaced after a backoff that doubles from 1 s to 60 s and starts again at 1 s once a
worker has lived a minute (as master(8) throttles a crashing service). A worker whose
oldest attempt is older than ``attempt_timeout`` is killed (SIGKILL) and replaced: the
spool has closed that attempt as deferred already (its lease), and the kill drops the
connection, which closes whatever else it held.

The supervisor runs in its own thread and never waits on a worker: it polls. The same
slots (``ProcessGroup``) run the SMTP front-end processes (``smtp_process.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Final

import attrs

from spool.owner import ControlServer

BACKOFF_FIRST: Final = 1.0
BACKOFF_MAX: Final = 60.0
STABLE_AFTER: Final = 60.0  # a worker that lived this long resets the backoff
POLL: Final = 0.1
STOP_GRACE: Final = 10.0  # seconds a worker gets to settle its message on SIGTERM

log = logging.getLogger("spool.supervisor")


@attrs.define
class Slot:
    number: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    next_start: float = 0.0
    backoff: float = BACKOFF_FIRST
    restarts: int = 0


class ProcessGroup:
    """Slots of child processes, each started, watched and restarted with a backoff, in a
    thread of its own that polls (never waits on a child). ``_command`` says what each
    slot runs; ``kind`` names them in the log."""

    kind = "process"

    def __init__(self, count: int) -> None:
        self.slots = [Slot(n) for n in range(count)]
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.kind, daemon=True)

    def start(self) -> None:
        if self.slots:
            self._thread.start()

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _popen(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self._command(), stdin=subprocess.DEVNULL)

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            now = time.monotonic()
            for slot in self.slots:
                self._tend(slot, now)
            self._after_tending()

    def _after_tending(self) -> None:
        """What else a look does, after each slot was tended."""

    def _tend(self, slot: Slot, now: float) -> None:
        process = slot.process
        if process is not None:
            status = process.poll()
            if status is None:
                return
            lived = now - slot.started
            slot.process = None
            slot.restarts += 1
            self.restarts += 1
            if status == 0:
                slot.next_start, slot.backoff = now, BACKOFF_FIRST
                log.info("%s %d (pid %d) exited after its %s", self.kind, slot.number,
                         process.pid, self._done)  # fmt: skip
            else:
                if lived >= STABLE_AFTER:
                    slot.backoff = BACKOFF_FIRST
                slot.next_start = now + slot.backoff
                log.warning(
                    "%s %d (pid %d) died (%s); restart in %.0f s",
                    self.kind, slot.number, process.pid, _how(status), slot.backoff,
                )  # fmt: skip
                slot.backoff = min(BACKOFF_MAX, slot.backoff * 2)
        if slot.process is None and now >= slot.next_start and not self._stop.is_set():
            try:
                slot.process = self._popen()
            except OSError as e:  # out of processes or descriptors: try again later
                log.error("cannot start %s %d: %s; retry in %.0f s", self.kind, slot.number,
                          e, slot.backoff)  # fmt: skip
                slot.next_start = now + slot.backoff
                slot.backoff = min(BACKOFF_MAX, slot.backoff * 2)
                return
            slot.started = now
            log.info("%s %d started (pid %d)", self.kind, slot.number, slot.process.pid)

    _done = "work"  # what a child that exits 0 has finished, for the log

    def pids(self) -> list[int]:
        """The running children's pids."""
        return [s.process.pid for s in self.slots if s.process is not None]

    def stop(self) -> None:
        """SIGTERM every child, give them ``STOP_GRACE`` to finish, then SIGKILL."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        running = [s.process for s in self.slots if s.process is not None]
        for process in running:
            _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(process, signal.SIGKILL)
                process.wait()


class Supervisor(ProcessGroup):
    """The delivery workers: a ``python -m spool.worker`` per slot, each killed and
    replaced at its lease."""

    kind = "worker"
    _done = "attempts"

    def __init__(
        self,
        directory: str,
        agent: str,
        workers: int,
        max_use: int,
        attempt_timeout: float,
        server: ControlServer,
        concurrency: int = 4,
    ) -> None:
        super().__init__(workers)
        self.directory = directory
        self.agent = agent
        self.max_use = max_use
        self.concurrency = concurrency
        self.attempt_timeout = attempt_timeout
        self.server = server
        self.lease_kills = 0
        self._thread.name = "supervisor"

    def _command(self) -> list[str]:
        return [
            sys.executable, "-m", "spool.worker", self.directory,
            "--agent", self.agent, "--max-use", str(self.max_use),
            "--concurrency", str(self.concurrency),
        ]  # fmt: skip

    def _after_tending(self) -> None:
        self._enforce_leases()

    def _enforce_leases(self) -> None:
        pids = {s.process.pid: s for s in self.slots if s.process is not None}
        for session in self.server.sessions():
            slot = pids.get(session.peer.pid)
            age = session.oldest_claim()
            if slot is None or age is None or age <= self.attempt_timeout:
                continue
            assert slot.process is not None
            log.warning(
                "worker %d (pid %d) held an attempt %.0f s, past its lease: killed",
                slot.number, slot.process.pid, age,
            )  # fmt: skip
            self.lease_kills += 1
            session.end_leases()  # deferred, not counted as crashes
            slot.process.kill()
            self.server.drop(slot.process.pid)

    def workers(self) -> list[dict[str, Any]]:
        """Each slot's worker: pid (None between restarts), started (seconds ago), its
        attempts done and the messages it holds."""
        sessions = {s.peer.pid: s for s in self.server.sessions()}
        now = time.monotonic()
        out = []
        for slot in self.slots:
            process = slot.process
            session = sessions.get(process.pid) if process is not None else None
            out.append({
                "slot": slot.number,
                "pid": None if process is None else process.pid,
                "up": None if process is None else now - slot.started,
                "restarts": slot.restarts,
                "attempts_done": 0 if session is None else session.peer.attempts_done,
                "in_flight": [] if session is None else session.in_flight(),
            })  # fmt: skip
        return out


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, sig)


def _how(status: int) -> str:
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    return f"status {status}"
