"""The queueing systems under test, behind one small interface.

Every system keeps its data under the directory it is given (the benchmark puts it on
the spool's own file system) and writes to disk the honest durable way:

* ``accept`` returns only once the message is on stable storage;
* ``end_attempt`` returns only once the delivered recipients are on stable storage (they
  are never attempted again); what is merely deferred may be written without waiting,
  because losing it only makes the message due again sooner, exactly as in spool;
* claims are held in memory by every system (spool's start records are not waited for
  either): a crash makes an in-flight message due again.

So every system pays the same durable points per message (accept, the attempt's
deliveries, the retry's delivery) and differs only in how it pays them. The peers:

``FileSpool``
    one file per message, the way Postfix and Exim queue durably: write a temp file,
    fsync it, rename it into ``incoming/``, fsync the directory. A delivered recipient
    is marked in place (Postfix rewrites the recipient record's type byte) and the file
    fdatasynced; a deferred message is renamed into ``deferred/``; a finished one is
    unlinked and the directory fsynced.
``SQLiteQueue``
    SQLite in WAL mode with ``synchronous=FULL``, one transaction per durable step, one
    connection per thread (SQLite serialises the writers itself).
``PersistQueue``
    persist-queue's ``SQLiteAckQueue`` used as its documentation shows: ``put``, ``get``,
    ``ack``; deferred recipients are put on a second ack queue before the first item is
    acked (put-then-ack: at least once). Its label states what it really does on disk.
``SpoolSystem``
    this project's spool, with a ``FakeClock`` so deferred mail can be made due at once.
"""

from __future__ import annotations

import abc
import collections
import itertools
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

from spool import Spool
from spool.testing import CountingFS, FakeClock

# Seconds before a deferred recipient is retried. The workloads move the fake clock past it.
RETRY_INTERVAL = 300.0
DELIVERED_REPLY = "250 2.0.0 ok: delivered"
DEFERRED_REPLY = "451 4.3.0 try again later"


@dataclass(frozen=True)
class Message:
    """One test message: the sender, three recipients and a body of the chosen size."""

    sender: str
    recipients: tuple[str, ...]
    body: bytes

    @classmethod
    def sample(cls, body_size: int) -> Message:
        """The benchmark's message: a short header and ``body_size`` bytes in all."""
        head = b"From: sender@example.org\r\nSubject: benchmark\r\n\r\n"
        return cls(
            "sender@example.org",
            ("alice@example.net", "bob@example.com", "carol@example.org"),
            head + b"x" * max(0, body_size - len(head)),
        )

    def serialized(self) -> bytes:
        """The message as the file spool stores it (also the raw limit's record size)."""
        return render_queue_file(self)


@dataclass
class Claimed:
    """A message handed to a delivery agent: its pending recipients and its data."""

    key: Any
    recipients: tuple[str, ...]
    data: bytes


class QueueSystem(abc.ABC):
    """What a workload needs of a system. Every method may be called from any thread."""

    name: ClassVar[str]

    @abc.abstractmethod
    def label(self) -> str:
        """A one-line description including the durability the system really gives."""

    @abc.abstractmethod
    def accept(self, msg: Message) -> None:
        """Queue ``msg``; return only once it is on stable storage."""

    @abc.abstractmethod
    def claim(self) -> Claimed | None:
        """The next due message, or None if none is due now."""

    @abc.abstractmethod
    def end_attempt(
        self, claimed: Claimed, delivered: Sequence[str], deferred: Sequence[str]
    ) -> None:
        """Report the attempt; ``delivered`` must be durable on return."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release files and connections."""

    def counted_fsyncs(self) -> int | None:
        """Sync calls counted in process (None: count them from outside, with strace)."""
        return None


# --- file per message -----------------------------------------------------------------


def render_queue_file(msg: Message) -> bytes:
    """Queue file layout: ``S sender``, one ``RP addr`` line per recipient, blank, body.

    The byte after ``R`` is the recipient's status (``P`` pending, ``D`` done), rewritten
    in place when it is delivered, as Postfix marks a recipient record done.
    """
    lines = [f"S {msg.sender}\n"] + [f"RP {r}\n" for r in msg.recipients] + ["\n"]
    return "".join(lines).encode() + msg.body


def parse_queue_file(data: bytes) -> tuple[dict[str, int], bytes]:
    """Pending recipients (with the offset of their status byte) and the body."""
    pending: dict[str, int] = {}
    offset = 0
    while True:
        end = data.index(b"\n", offset)
        line = data[offset:end]
        if not line:
            return pending, data[end + 1 :]
        if line.startswith(b"RP "):
            pending[line[3:].decode()] = offset + 1
        offset = end + 1


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (creates, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSpool(QueueSystem):
    """One file per message, durable the way Postfix and Exim do it (see module doc)."""

    name = "file-per-message"

    def __init__(self, directory: str, clock: FakeClock) -> None:
        self._clock = clock
        self._dirs = {d: os.path.join(directory, d) for d in ("tmp", "incoming", "deferred")}
        for d in self._dirs.values():
            os.makedirs(d, exist_ok=True)
        fsync_dir(directory)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # The queue manager's in-memory view (Postfix's qmgr learns of new mail from
        # cleanup and of deferred mail from its scan): ids due now, and (due, id) pairs.
        self._due: collections.deque[str] = collections.deque()
        self._deferred: collections.deque[tuple[float, str]] = collections.deque()
        self._fsyncs = 0

    def label(self) -> str:
        return "file per message (temp file, fsync, rename, dir fsync; unlink + dir fsync)"

    def _count(self, n: int) -> None:
        with self._lock:
            self._fsyncs += n

    def accept(self, msg: Message) -> None:
        msg_id = f"{next(self._ids):012d}"
        tmp = os.path.join(self._dirs["tmp"], msg_id)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = memoryview(render_queue_file(msg))
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(self._dirs["incoming"], msg_id))
        fsync_dir(self._dirs["incoming"])
        self._count(2)
        with self._lock:
            self._due.append(msg_id)

    def claim(self) -> Claimed | None:
        with self._lock:
            if self._due:
                msg_id, where = self._due.popleft(), "incoming"
            elif self._deferred and self._deferred[0][0] <= self._clock():
                msg_id, where = self._deferred.popleft()[1], "deferred"
            else:
                return None
        path = os.path.join(self._dirs[where], msg_id)
        with open(path, "rb") as f:
            data = f.read()
        pending, body = parse_queue_file(data)
        return Claimed((msg_id, where, pending), tuple(pending), body)

    def end_attempt(
        self, claimed: Claimed, delivered: Sequence[str], deferred: Sequence[str]
    ) -> None:
        msg_id, where, pending = claimed.key
        path = os.path.join(self._dirs[where], msg_id)
        if not deferred:
            # Finished: the unlink is the durable record that every recipient is done.
            os.unlink(path)
            fsync_dir(self._dirs[where])
            self._count(1)
            return
        fd = os.open(path, os.O_WRONLY)
        try:
            for rcpt in delivered:
                os.pwrite(fd, b"D", pending[rcpt])
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self._count(1)
        if where != "deferred":
            # Not synced: if the rename is lost the message is retried from incoming/.
            os.rename(path, os.path.join(self._dirs["deferred"], msg_id))
        with self._lock:
            self._deferred.append((self._clock() + RETRY_INTERVAL, msg_id))

    def close(self) -> None:
        pass

    def counted_fsyncs(self) -> int | None:
        return self._fsyncs


# --- SQLite -----------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS queue (
    id INTEGER PRIMARY KEY,
    sender TEXT NOT NULL,
    pending TEXT NOT NULL,      -- recipients still to deliver, one per line
    done TEXT NOT NULL,         -- 'recipient reply' lines of settled recipients
    body BLOB NOT NULL,
    due REAL NOT NULL,
    attempts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS queue_due ON queue (due, id);
"""


class SQLiteQueue(QueueSystem):
    """SQLite in WAL mode, ``synchronous=FULL``, one transaction per durable step."""

    name = "sqlite-wal"

    def __init__(self, directory: str, clock: FakeClock) -> None:
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, "queue.db")
        self._clock = clock
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._conn().executescript(_SCHEMA)

    def label(self) -> str:
        return f"SQLite {sqlite3.sqlite_version} WAL, synchronous=FULL, 1 transaction per step"

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self._path, timeout=120.0, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def accept(self, msg: Message) -> None:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO queue (sender, pending, done, body, due, attempts)"
            " VALUES (?, ?, '', ?, ?, 0)",
            (msg.sender, "\n".join(msg.recipients), msg.body, self._clock()),
        )
        conn.execute("COMMIT")

    def claim(self) -> Claimed | None:
        conn = self._conn()
        with self._lock:
            busy = tuple(self._in_flight)
            marks = ",".join("?" * len(busy))
            row = conn.execute(
                f"SELECT id, pending, body FROM queue WHERE due <= ? AND id NOT IN ({marks})"
                " ORDER BY due, id LIMIT 1",
                (self._clock(), *busy),
            ).fetchone()
            if row is None:
                return None
            self._in_flight.add(row[0])
        return Claimed(row[0], tuple(row[1].split("\n")), row[2])

    def end_attempt(
        self, claimed: Claimed, delivered: Sequence[str], deferred: Sequence[str]
    ) -> None:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        if deferred:
            conn.execute(
                "UPDATE queue SET pending = ?, done = done || ?, due = ?,"
                " attempts = attempts + 1 WHERE id = ?",
                (
                    "\n".join(deferred),
                    "".join(f"{r} {DELIVERED_REPLY}\n" for r in delivered),
                    self._clock() + RETRY_INTERVAL,
                    claimed.key,
                ),
            )
        else:
            conn.execute("DELETE FROM queue WHERE id = ?", (claimed.key,))
        conn.execute("COMMIT")
        with self._lock:
            self._in_flight.discard(claimed.key)

    def close(self) -> None:
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()


# --- persist-queue ----------------------------------------------------------------------


def _sqlite_default_synchronous(db_path: str) -> str:
    """The ``synchronous`` level a new WAL connection gets (persist-queue never sets it)."""
    conn = sqlite3.connect(db_path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        level = int(conn.execute("PRAGMA synchronous").fetchone()[0])
    finally:
        conn.close()
    return {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(level, str(level))


class PersistQueue(QueueSystem):
    """persist-queue's ``SQLiteAckQueue`` with its defaults (auto_commit=True)."""

    name = "persist-queue"

    def __init__(self, directory: str, clock: FakeClock) -> None:
        from persistqueue import SQLiteAckQueue

        self._clock = clock
        self._fresh = SQLiteAckQueue(directory, name="fresh", multithreading=True, timeout=120)
        self._retry = SQLiteAckQueue(directory, name="retry", multithreading=True, timeout=120)
        self._sync = _sqlite_default_synchronous(os.path.join(directory, "data.db"))
        self._lock = threading.Lock()
        self._retry_due: collections.deque[float] = collections.deque()

    def label(self) -> str:
        version = metadata.version("persist-queue")
        return (
            f"persist-queue {version} SQLiteAckQueue: WAL, synchronous={self._sync} "
            "(SQLite's default; the library sets none), auto_commit: a commit per put/get/ack"
        )

    def accept(self, msg: Message) -> None:
        self._fresh.put({"sender": msg.sender, "rcpts": msg.recipients, "body": msg.body})

    def claim(self) -> Claimed | None:
        from persistqueue.exceptions import Empty

        queue = self._fresh
        with self._lock:
            if self._retry_due and self._retry_due[0] <= self._clock():
                self._retry_due.popleft()
                queue = self._retry
        try:
            item = queue.get(block=False, raw=True)
        except Empty:
            return None
        data = item["data"]
        return Claimed((queue, item["pqid"], data), tuple(data["rcpts"]), data["body"])

    def end_attempt(
        self, claimed: Claimed, delivered: Sequence[str], deferred: Sequence[str]
    ) -> None:
        queue, pqid, data = claimed.key
        if deferred:
            due = self._clock() + RETRY_INTERVAL
            self._retry.put({**data, "rcpts": tuple(deferred), "due": due})
            with self._lock:
                self._retry_due.append(due)
        queue.ack(id=pqid)

    def close(self) -> None:
        self._fresh.close()
        self._retry.close()


# --- spool ------------------------------------------------------------------------------


class SpoolSystem(QueueSystem):
    """This project's spool; its sync calls are counted through the file-system seam."""

    name = "spool"

    def __init__(self, directory: str, clock: FakeClock) -> None:
        self._fs = CountingFS()
        self._sp = Spool.open(
            directory, clock=clock, retry_intervals=(RETRY_INTERVAL,), fs=self._fs
        )

    def label(self) -> str:
        return "spool (log, group commit: fdatasync per batch)"

    def accept(self, msg: Message) -> None:
        self._sp.accept(msg.sender, msg.recipients, msg.body)

    def claim(self) -> Claimed | None:
        attempt = self._sp.claim()
        if attempt is None:
            return None
        return Claimed(attempt, attempt.envelope.recipients, attempt.read_data())

    def end_attempt(
        self, claimed: Claimed, delivered: Sequence[str], deferred: Sequence[str]
    ) -> None:
        attempt = claimed.key
        if delivered:
            attempt.delivered(delivered, DELIVERED_REPLY)
        if deferred:
            attempt.deferred(deferred, DEFERRED_REPLY)
        attempt.close()

    def close(self) -> None:
        self._sp.close()

    def counted_fsyncs(self) -> int | None:
        calls = self._fs.calls
        return calls["fdatasync"] + calls["fsync"] + calls["fsync_dir"]


# Each system is built from (directory, clock).
SYSTEMS: dict[str, Callable[[str, FakeClock], QueueSystem]] = {
    cls.name: cls for cls in (FileSpool, SQLiteQueue, PersistQueue, SpoolSystem)
}
