"""Test support that ships with the package: file-system seams and a controllable clock.

``CountingFS`` counts every call per operation (the group-commit tests count fdatasyncs);
``FaultFS`` fails the n-th call of chosen operations, once or from then on (I/O error
tests); ``FakeClock`` is a clock the tests move by hand; ``deliver_all`` empties a queue.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import threading
import time
from typing import TYPE_CHECKING

from spool.fs import FileSystem

if TYPE_CHECKING:
    from spool.spool import Spool


class FakeClock:
    """A clock for ``Spool.open(clock=...)`` that moves only when told. Thread-safe.

    ``advance`` lets time pass (both clocks move); ``step`` sets the wall clock forward or
    back without time passing, as an administrator or a time daemon stepping it does.
    Calling the clock reads its wall clock.
    """

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._elapsed = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.wall()

    def wall(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._elapsed

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self._elapsed += seconds

    def step(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class CountingFS(FileSystem):
    """Counts calls by operation name (and ``bytes_read``); ``sync_delay`` seconds are added
    to each fdatasync (to model a slower disk so that concurrent callers overlap
    deterministically)."""

    def __init__(self, sync_delay: float = 0.0) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._sync_delay = sync_delay
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._count("open")
        return super().open(path, flags, mode)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._count("pread")
        data = super().pread(fd, size, offset)
        with self._lock:
            self.calls["bytes_read"] += len(data)
        return data

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        self._count("pwrite")
        super().pwrite(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        self._count("fdatasync")
        super().fdatasync(fd)
        if self._sync_delay:
            time.sleep(self._sync_delay)

    def fsync(self, fd: int) -> None:
        self._count("fsync")
        super().fsync(fd)

    def fsync_dir(self, path: str) -> None:
        self._count("fsync_dir")
        super().fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        self._count("rename")
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self._count("unlink")
        super().unlink(path)


class SmallDiskFS(FileSystem):
    """A file system of ``capacity`` bytes holding ``root``, for disk-full tests where no
    small real one can be mounted: the files are real, their sizes count against the
    capacity, and a write past it fails with ENOSPC as a full disk's does."""

    def __init__(self, root: str, capacity: int) -> None:
        self._root = root
        self.capacity = capacity
        self._lock = threading.Lock()

    def used(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self._root):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
        return total

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        with self._lock:
            growth = max(0, offset + len(data) - os.fstat(fd).st_size)
            if growth and self.used() + growth > self.capacity:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            super().pwrite(fd, data, offset)

    def free_bytes(self, path: str) -> int:
        return max(0, self.capacity - self.used())


class FaultFS(FileSystem):
    """Fails operations on demand with an OSError of ``err``.

    ``fail(op, after=n, sticky=...)`` makes the (n+1)-th later call of ``op`` fail (and,
    if sticky, every call after it). ``free`` overrides ``free_bytes``.
    """

    def __init__(self) -> None:
        self._plans: dict[str, tuple[int, bool, int]] = {}
        self._lock = threading.Lock()
        self.free: int | None = None
        self.failures = 0

    def fail(self, op: str, *, after: int = 0, sticky: bool = True, err: int = errno.EIO) -> None:
        with self._lock:
            self._plans[op] = (after, sticky, err)

    def _maybe_fail(self, op: str) -> None:
        with self._lock:
            plan = self._plans.get(op)
            if plan is None:
                return
            left, sticky, err = plan
            if left > 0:
                self._plans[op] = (left - 1, sticky, err)
                return
            if not sticky:
                del self._plans[op]
            self.failures += 1
        raise OSError(err, os.strerror(err))

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._maybe_fail("open")
        return super().open(path, flags, mode)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._maybe_fail("pread")
        return super().pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        self._maybe_fail("pwrite")
        super().pwrite(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync")
        super().fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        self._maybe_fail("fsync_dir")
        super().fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        self._maybe_fail("rename")
        super().rename(src, dst)

    def free_bytes(self, path: str) -> int:
        return self.free if self.free is not None else super().free_bytes(path)


def tree_snapshot(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> content): 'changes nothing' checks."""
    snap: dict[str, bytes] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                snap[os.path.relpath(full, root)] = f.read()
    return snap


def deliver_all(sp: Spool) -> list[str]:
    """Claim everything due and report every recipient delivered; the ids, in claim order.

    For tests and tools that need a spool whose due mail is all settled (to make segments
    deletable, for instance)."""
    claimed = []
    while (attempt := sp.claim()) is not None:
        with attempt:
            attempt.delivered(attempt.envelope.recipients, "250 2.0.0 ok")
        claimed.append(attempt.msg_id)
    return claimed
