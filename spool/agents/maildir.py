"""``maildir:PATH``: local delivery into ``PATH/<recipient>/new/`` (Maildir).

Each recipient gets its own copy, written as Maildir requires: into ``tmp/`` under a unique
name, fsynced, renamed into ``new/``, and ``new/`` fsynced; only then is the recipient
delivered (a 250 reply). A crash before that leaves at most a file in ``tmp/`` (which
Maildir readers ignore and clean up) or, after the rename, a delivered copy whose report
was lost: the recipient is attempted again, a duplicate, as with any agent whose delivery
outran its report. ``Return-Path:`` and ``Delivered-To:`` are prepended, as local delivery
agents do.

The mailbox directory is the recipient address with ``/`` written as ``%2F`` and a leading
dot as ``%2E`` (so no address names a path outside ``PATH``). Mapping: written -> 250;
disk full or quota (ENOSPC, EDQUOT) -> 452 4.2.2, deferred; any other OS error -> 451
4.3.0, deferred (a permissions slip is fixed by the operator, and the mail waits).
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

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        replies: dict[str, str] = {}
        for rcpt in envelope.recipients:
            try:
                self._write(rcpt, envelope.sender, data)
            except OSError as e:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                code = "452 4.2.2 mailbox full" if full else "451 4.3.0 local delivery failed"
                replies[rcpt] = f"{code}: {e.strerror or e}"
            else:
                replies[rcpt] = DELIVERED
        return replies

    def _write(self, rcpt: str, sender: str, data: bytes) -> None:
        box = os.path.join(self.root, mailbox_name(rcpt))
        for sub in ("tmp", "new", "cur"):
            os.makedirs(os.path.join(box, sub), 0o700, exist_ok=True)
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
        dir_fd = os.open(new_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        pass


def make(argument: str) -> MaildirAgent:
    if not argument:
        raise SpoolMisuse("give the Maildir root: --agent maildir:PATH")
    return MaildirAgent(argument)
