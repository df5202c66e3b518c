"""The owner lock: one process owns a spool at a time (``fcntl.flock`` on ``lock``).

The lock belongs to the open file description, so a second ``Spool.open`` of the same
directory fails even inside the owning process. The owner's pid is written into the file
after the lock is taken, so a refused opener can name it.

Crash safety:
    The kernel drops a flock when its holder dies, so a crash never leaves a stale lock.
    The pid inside the file is advisory text, never trusted for locking; a crash while
    writing it leaves a short or empty pid, which only makes the error message vaguer.

Errors:
    ``SpoolLocked(path, pid)`` when another open file description holds the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from spool.errors import BadSpoolDirectory, SpoolLocked
from spool.fs import FileSystem, read_file


def read_owner_pid(lock_path: str, fs: FileSystem | None = None) -> int | None:
    """The pid recorded in a lock file, or None if absent or unreadable."""
    try:
        text = read_file(fs or FileSystem(), lock_path)[:32].decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class OwnerLock:
    """An exclusive, non-blocking flock on ``<spool>/lock``."""

    def __init__(self, fs: FileSystem, lock_path: str, spool_path: str) -> None:
        self._fs = fs
        self.path = lock_path
        try:
            fd = fs.open(lock_path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise BadSpoolDirectory(
                spool_path, f"cannot open its lock file: {exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fs.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SpoolLocked(spool_path, read_owner_pid(lock_path, fs)) from None
            raise
        self._fd: int | None = fd
        # Advisory only (see module docstring); not fsynced on purpose, and a failure to
        # write it only makes a refused opener's message vaguer.
        with contextlib.suppress(OSError):
            fs.ftruncate(fd, 0)
            fs.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (idempotent). The pid text stays; it is only read after a refusal."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._fs.close(fd)
