"""What every piece of an open spool shares: its directory, options, clock, writer, lock.

An open ``Spool`` (``spool.py``) is cut into pieces, one concern each: scheduling
(``scheduling.py``), bodies (``body_keeping.py``), attempts (``attempts.py``), checkpoints
(``checkpoints.py``), operator actions (``operator.py``) and outcomes
(``outcome_desk.py``). They share one ``SpoolState``: the facade makes it, and the lock in
it is the spool's one lock. Every piece says which of its methods run under it ("Lock
held"); none takes another lock while holding it, except the checkpoint lock, which is
always taken first.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable

import attrs

from spool import format as fmt
from spool import records as rec
from spool.clock import SpoolTime
from spool.errors import SpoolClosed, SpoolMisuse
from spool.fs import FileSystem
from spool.options import SpoolOptions
from spool.records import Position
from spool.segment_files import SegmentFiles
from spool.writer import LogWriter


class ListenedCondition(threading.Condition):
    """The spool's condition: ``notify_all`` (something changed: a batch became durable,
    an attempt closed, an operator acted) also calls each of ``listeners``. An awaited
    claim on an asyncio loop cannot wait on a thread condition; its listener wakes the
    loop instead (``async_spool.py``). Listeners run with the spool's lock held: they must
    be quick and take no lock of the spool's."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.listeners: list[Callable[[], None]] = []

    def notify_all(self) -> None:
        super().notify_all()
        for listener in self.listeners:
            listener()


class SpoolState:
    """The shared state of one open spool. The lock guards everything mutable in the
    pieces; ``cond`` (on the same lock) wakes claims, outcome readers and the
    checkpoint thread."""

    writer: LogWriter  # set by the facade once the pieces it calls back exist

    def __init__(
        self,
        path: str,
        fs: FileSystem,
        options: SpoolOptions,
        time: SpoolTime,
        archive_path: str | None,
    ) -> None:
        self.path = path
        self.fs = fs
        self.options = options
        self.time = time
        self.archive_path = archive_path
        self.pid = os.getpid()
        self.log_dir = os.path.join(path, fmt.LOG_DIR)
        self.body_dir = os.path.join(path, fmt.BODY_DIR)
        self.incoming_dir = os.path.join(path, fmt.INCOMING_DIR)
        # Read descriptors of the segments, for bodies read one at a time.
        self.segment_files = SegmentFiles(fs, self.log_dir)
        self.lock = threading.RLock()
        self.cond = ListenedCondition(self.lock)
        self.counts: collections.Counter[str] = collections.Counter()
        self.closed = False
        self.closing = False  # close() has begun: no attempt starts from now on
        # Set when ``checkpoint_every`` records were appended, or the spool closes: wakes
        # the checkpoint thread (``checkpoints.py``).
        self.checkpoint_due = threading.Event()

    def check_process(self) -> None:
        """Refuse use from a forked child: parent and child would append at the same
        offsets with the same message ids, and one of them would overwrite mail the other
        had acknowledged. Checked before any lock is taken (a fork may copy a held lock)."""
        if os.getpid() != self.pid:
            raise SpoolMisuse(
                f"spool {self.path} was opened by process {self.pid}; process "
                f"{os.getpid()} is a fork of it and must not use it. Open spools after "
                "forking, in the one process that owns them, and talk to that owner"
            )

    def check_open(self) -> None:
        if self.closed:
            raise SpoolClosed(f"spool {self.path} is closed; open it again to continue")

    def now(self) -> float:
        """The spool's time (``clock.py``): it never goes back within an open."""
        return self.time.now()

    def accepted_as_of_now(self, pos: Position, env: rec.Envelope) -> rec.Envelope:
        """``env`` as its rewrite carries it: an acceptance an earlier open stamped in the
        future counts from this open (``clock.py``), here and in every later envelope."""
        accepted_at = self.time.accepted_at(pos, env)
        if accepted_at == env.accepted_at:
            return env
        return attrs.evolve(env, accepted_at=accepted_at)
