"""``maildir:PATH``: local delivery into ``PATH/<recipient>/new/`` (Maildir).

Each recipient gets its own copy, written as Maildir requires: into ``tmp/`` under a unique
name, fsynced, renamed into ``new/``, and ``new/`` fsynced; only then is the recipient
delivered (a 250 reply). A crash before that leaves at most a file in ``tmp/`` (which
Maildir readers ignore and clean up) or, after the rename, a delivered copy whose report
was lost: the recipient is attempted again, a duplicate, as with any agent whose delivery
outran its report. ``Return-Path:`` and ``Delivered-To:`` are prepended, as local delivery
agents do.

The mailbox directory is the recipient address with ``/`` written as ``%2F`` and a leading
dot as ``%2E`` (so no address names a path outside ``PATH``). A mailbox directory this
process has not yet made durable is, with its ``tmp/``, ``new/`` and ``cur/``: each
directory it creates is fsynced in its parent before the first delivery into it counts
(else a power cut could take a first message's mailbox, and the message with it, after
its 250). Mapping: written -> 250; disk full or quota (ENOSPC, EDQUOT) -> 452 4.2.2,
deferred; a name too long for a directory (ENAMETOOLONG: no retry makes it fit) -> 550
5.1.3, failed; any other OS error -> 451 4.3.0, deferred (a permissions slip is fixed by
the operator, and the mail waits).
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time

from spool.agents import Replies
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse
from spool.fs import FileSystem

DELIVERED = "250 2.0.0 delivered to maildir"


def mailbox_name(recipient: str) -> str:
    """The directory name of a recipient's Maildir (one path component, never ``..``)."""
    name = recipient.replace("%", "%25").replace("/", "%2F")
    return "%2E" + name[1:] if name.startswith(".") else name


class MaildirAgent:
    def __init__(self, root: str) -> None:
        self.root = root
        self._host = socket.gethostname().replace("/", "\\057").replace(":", "\\072")
        self._count = itertools.count(1)
        self._durable: set[str] = set()  # mailbox directories known durable
        self._fs = FileSystem()

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        replies: dict[str, str] = {}
        for rcpt in envelope.recipients:
            try:
                self._write(rcpt, envelope.sender, data)
            except OSError as e:
                if e.errno == errno.ENAMETOOLONG:
                    replies[rcpt] = "550 5.1.3 mailbox name too long for a directory"
                    continue
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                code = "452 4.2.2 mailbox full" if full else "451 4.3.0 local delivery failed"
                replies[rcpt] = f"{code}: {e.strerror or e}"
            else:
                replies[rcpt] = DELIVERED
        return replies

    def _write(self, rcpt: str, sender: str, data: bytes) -> None:
        box = os.path.join(self.root, mailbox_name(rcpt))
        if box not in self._durable:
            self._make_durable(box)
        now = time.time()
        unique = f"{int(now)}.M{int(now % 1 * 1e6)}P{os.getpid()}Q{next(self._count)}.{self._host}"
        tmp = os.path.join(box, "tmp", unique)
        head = f"Return-Path: <{sender}>\r\nDelivered-To: {rcpt}\r\n".encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # A crash here leaves a file in tmp/ only: not delivered, attempted again.
            os.write(fd, head)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        new_dir = os.path.join(box, "new")
        os.rename(tmp, os.path.join(new_dir, unique))
        # Delivered once the rename is durable: fsync the directory that now names it. If
        # this fsync fails the file is in new/ but the recipient is deferred: a possible
        # duplicate, never a loss (the mailbox owner may see the copy before the retry).
        self._fs.fsync_dir(new_dir)

    def _make_durable(self, box: str) -> None:
        """Create ``box`` and its three directories where missing, and make their names
        durable: each parent (up to the root's own) fsynced once its entries exist. Done
        once per mailbox per process, whoever created them (another worker's mkdir may
        not be synced yet)."""
        os.makedirs(self.root, 0o700, exist_ok=True)
        for sub in ("tmp", "new", "cur"):
            os.makedirs(os.path.join(box, sub), 0o700, exist_ok=True)
        # A crash before these fsyncs: the directories may vanish, but nothing in them was
        # reported delivered yet.
        for directory in (box, self.root, os.path.dirname(os.path.abspath(self.root))):
            self._fs.fsync_dir(directory)
        self._durable.add(box)

    def close(self) -> None:
        pass


def make(argument: str) -> MaildirAgent:
    if not argument:
        raise SpoolMisuse("give the Maildir root: --agent maildir:PATH")
    return MaildirAgent(argument)
