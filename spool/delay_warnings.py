"""The owner's delay warnings: a sender hears when a message is still queued after a while.

``spool serve --delay-warning 4h`` (Postfix's ``delay_warning_time``; off by default, as
there) starts a thread that looks through the queue every ``min(CHECK_EVERY, delay)``
seconds. A message queued for longer than the delay, not held, from a sender that is not
the null sender ``<>``, gets one RFC 3464 report with ``Action: delayed`` for each of its
pending recipients (``dsn.delay_warning``), queued from ``<>`` to its sender.

"Once" is kept on disk: the id of each warned message is appended to ``delay-warned`` in
the spool directory (docs/format.md), after the warning is accepted (durable). So:

- **at least once, twice at worst.** A crash between the accept and the append's
  ``fdatasync`` sends the warning again after the restart (Postfix's qmgr has the same
  window between the warning and the queue file's updated warning time); a crash never
  loses one that was due.
- **a full disk waits.** A warning refused for space is tried at the next look; a mark
  that cannot be written is logged (the message counts as warned until the next start).
- The file only grows by the ids of warned messages; each start, and each look that finds
  more stale ids than ``PRUNE_AFTER``, rewrites it with the ids still queued.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Final

from spool import format as fmt
from spool.background import BackgroundLoop
from spool.dsn import delay_warning
from spool.errors import (
    BadSpoolDirectory,
    DiskFull,
    InvalidMessage,
    MessageTooLarge,
)
from spool.fs import FileSystem
from spool.queue_view import QueueEntry
from spool.spool import Spool

log = logging.getLogger("spool.delay_warning")
CHECK_EVERY: Final = 60.0  # seconds between looks through the queue, at most
PRUNE_AFTER: Final = 1000  # stale ids in the file before a look rewrites it


class DelayWarner(BackgroundLoop):
    """Sends the delay warnings of one open spool, in a thread, until ``stop`` (which
    waits for the warning in hand: its accept and its mark, or neither)."""

    name = "spool-delay-warner"

    def __init__(
        self,
        spool: Spool,
        directory: str,
        reporting_mta: str,
        delay: float,
        fs: FileSystem | None = None,
    ) -> None:
        if not delay > 0:
            raise ValueError("the delay warning time must be more than 0 seconds")
        super().__init__(log)
        self.first_pause = min(CHECK_EVERY, delay)
        self.spool = spool
        self.reporting_mta = reporting_mta
        self.delay = delay
        self.sent = 0
        self._path = os.path.join(directory, fmt.DELAY_WARNED_NAME)
        self._fs = fs or FileSystem()
        self._warned: set[str] = set()

    def start(self) -> None:
        """Read the warned ids (keeping those still queued), then look in a thread.
        ``BadSpoolDirectory`` if the file cannot be read (a directory there, say): the
        owner does not start rather than warn every sender again."""
        try:
            self._warned = read_warned(self._fs, self._path)
        except OSError as e:
            raise BadSpoolDirectory(
                self._path,
                f"cannot be read ({e.strerror or e}): move it out of the spool directory "
                "(each late message then warns its sender once more), or start without "
                "--delay-warning",
            ) from None
        # Rewritten at each start: gone are the ids no longer queued, and a torn last
        # line, which the next append would otherwise run on from.
        try:
            self._rewrite({e.msg_id for e in self.spool.list()})
        except OSError as e:  # a full disk, say: the file is kept as it is, appended to
            log.error("cannot rewrite %s (%s): kept as it is", self._path, e.strerror or e)
        super().start()

    def step(self) -> float:
        """One look through the queue."""
        try:
            self.look()
        except OSError as exc:  # the file: the next look tries again
            log.error("delay warnings: %s: %s", self._path, exc.strerror or exc)
        return self.first_pause

    def look(self, now: float | None = None) -> int:
        """Warn the sender of each message due a warning; the number warned."""
        now = time.time() if now is None else now
        live: set[str] = set()
        warned = 0
        complete = True  # whether ``live`` holds the whole queue, for the prune
        for entry in self.spool.list():
            live.add(entry.msg_id)
            if self.stopping:
                complete = False
                break
            if entry.msg_id in self._warned or not self._due(entry, now):
                continue
            if not self._warn(entry):
                complete = False
                break  # the disk is full: the next look tries again
            warned += 1
        if complete and len(self._warned - live) > PRUNE_AFTER:
            self._rewrite(live)
        return warned

    def _due(self, entry: QueueEntry, now: float) -> bool:
        return (
            bool(entry.sender)  # never a warning of a bounce (or of another warning)
            and entry.held is None  # the operator's doing, not a delay
            and now - entry.accepted_at >= self.delay
        )

    def _warn(self, entry: QueueEntry) -> bool:
        replies = entry.replies or (entry.last_reply,) * len(entry.recipients)
        lifetime = self.spool.max_lifetime
        notice = delay_warning(
            entry.msg_id,
            entry.sender,
            entry.accepted_at,
            list(zip(entry.recipients, replies, strict=True)),
            reporting_mta=self.reporting_mta,
            retry_until=entry.accepted_at + lifetime if lifetime else None,
        )
        try:
            warning_id = self.spool.accept("", [entry.sender], notice)
        except DiskFull as exc:
            log.warning("%s: delay warning waits for disk space: %s", entry.msg_id, exc)
            return False
        except (InvalidMessage, MessageTooLarge) as exc:  # not expected: checked at accept
            log.error("%s: no delay warning can be queued (%s): none sent", entry.msg_id, exc)
            warning_id = None
        # Marked only once the warning is durable: a crash before this append's fdatasync
        # sends it again after the restart (twice at worst), never not at all.
        self._mark(entry.msg_id)
        if warning_id is not None:
            self.sent += 1
            log.info(
                "%s: sender delay notification: %s (%d pending)",
                entry.msg_id, warning_id, len(entry.recipients),
            )  # fmt: skip
        return True

    def _mark(self, msg_id: str) -> None:
        # Known warned in memory first: a mark that cannot be written (EIO, ENOSPC) costs
        # at most one more warning after the next start, not one every look.
        self._warned.add(msg_id)
        try:
            fd = self._fs.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
            try:
                # A crash mid-write leaves a torn last line, which ``read_warned`` skips:
                # that message is warned again, the lines before it stand.
                self._fs.pwrite(fd, msg_id.encode() + b"\n", self._fs.size(fd))
                self._fs.fdatasync(fd)
            finally:
                self._fs.close(fd)
        except OSError as e:
            log.error("%s: cannot mark as warned in %s (%s): warned again after a restart",
                      msg_id, self._path, e.strerror or e)  # fmt: skip

    def _rewrite(self, live: set[str]) -> None:
        """Keep only the warned ids still queued: a new file renamed over the old one."""
        keep = sorted(self._warned & live)
        tmp = self._path + ".tmp"
        fd = self._fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        try:
            # A crash before the rename leaves the old file (and a stale .tmp, replaced by
            # the next rewrite): every id in it is still a warned one.
            self._fs.pwrite(fd, b"".join(i.encode() + b"\n" for i in keep), 0)
            self._fs.fsync(fd)
        finally:
            self._fs.close(fd)
        self._fs.rename(tmp, self._path)
        # The rename durable: a crash before this may bring the old file back, a superset.
        self._fs.fsync_dir(os.path.dirname(self._path) or ".")
        self._warned = set(keep)


def read_warned(fs: FileSystem, path: str) -> set[str]:
    """The ids in a ``delay-warned`` file (none if there is none); a line that is not an
    id and a newline (a torn append) is skipped."""
    if not fs.exists(path):
        return set()
    fd = fs.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = fs.pread(fd, fs.size(fd), 0)
    finally:
        fs.close(fd)
    lines = data.decode("ascii", errors="replace").split("\n")[:-1]  # the last: torn or ""
    return {line for line in lines if fmt.is_message_id(line)}
