"""I/O errors: fail the n-th I/O call of a workload, once or from then on, for every n.

Goal: contract items 2, 3 and 7 under failing disks. A failed write or fsync of the log
stops the spool for good (``SpoolFailed``, sticky, and the failed fsync is never retried);
every affected caller gets a typed error; the next open, on a healthy file system,
recovers with the contract intact: every acknowledged accept is present, no acknowledged
delivery is handed out again, and ``spool.check`` finds no problem.

Method: ``NthFailFS`` counts every call through the file-system seam that changes the
disk (open for writing, pwrite, fdatasync, fsync, directory fsync, rename, unlink,
ftruncate, mkdir) and fails the n-th with EIO. A small deterministic workload (accepts
with inline and file bodies, deliveries, failures, deferrals, a hold, checkpoints) runs
with background flushes and checkpoints pushed out of the way, so the n-th call is the
same call in every run. For every n up to the number of calls of a clean run, in both
modes, the workload runs until its first error, which must be a ``SpoolError``; then the
spool is closed, reopened with the real file system and checked.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import attrs
import pytest

from spool import Spool, SpoolError, SpoolFailed
from spool import format as fmt
from spool.check import check_spool
from spool.fs import FileSystem
from spool.testing import FakeClock, FaultFS

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT
OPTIONS = {
    "retry_intervals": [60.0],
    "inline_body_max": 200,
    "segment_size": 2048,
    "sync_interval": 3600.0,
    "checkpoint_interval": 3600.0,
}


class NthFailFS(FileSystem):
    """Fails the ``fail_at``-th (1-based) disk-changing call with EIO; ``sticky``: every
    later one too. Records which calls failed and what was synced after a failure."""

    def __init__(self, fail_at: int = 0, sticky: bool = False) -> None:
        self.fail_at = fail_at
        self.sticky = sticky
        self.calls = 0
        self.failed: list[tuple[str, str]] = []  # (operation, file)
        self.paths: dict[int, str] = {}
        self.synced_after_failure: list[str] = []
        self._lock = threading.Lock()

    def _tick(self, op: str, target: str) -> None:
        with self._lock:
            self.calls += 1
            if self.failed and op == "fdatasync":
                self.synced_after_failure.append(target)
            if self.calls == self.fail_at or (
                self.sticky and self.fail_at and self.calls > self.fail_at
            ):
                self.failed.append((op, target))
                raise OSError(errno.EIO, os.strerror(errno.EIO))

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if flags & WRITE_FLAGS:
            self._tick("open", path)
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        self._tick("pwrite", self.paths.get(fd, "?"))
        super().pwrite(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        self._tick("fdatasync", self.paths.get(fd, "?"))
        super().fdatasync(fd)

    def fsync(self, fd: int) -> None:
        self._tick("fsync", self.paths.get(fd, "?"))
        super().fsync(fd)

    def fsync_dir(self, path: str) -> None:
        self._tick("fsync_dir", path)
        super().fsync_dir(path)

    def ftruncate(self, fd: int, size: int) -> None:
        self._tick("ftruncate", self.paths.get(fd, "?"))
        super().ftruncate(fd, size)

    def rename(self, src: str, dst: str) -> None:
        self._tick("rename", dst)
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self._tick("unlink", path)
        super().unlink(path)

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        self._tick("mkdir", path)
        super().mkdir(path, mode)


@attrs.define
class Acks:
    accepted: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    settled: set[tuple[str, str]] = attrs.field(factory=set)


def workload(sp: Spool, acks: Acks) -> None:
    """Deterministic traffic; records each acknowledgement after its call returned."""

    def accept(i: int, size: int) -> str:
        rcpts = (f"a{i}@example.net", f"b{i}@example.net")
        msg_id = sp.accept("s@example.org", list(rcpts), bytes([65 + i]) * size)
        acks.accepted[msg_id] = rcpts
        return msg_id

    accept(0, 50)
    accept(1, 1000)  # a body file
    for _ in range(2):
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            first, second = attempt.envelope.recipients
            attempt.delivered([first], "250 ok")
            acks.settled.add((attempt.msg_id, first))
            attempt.deferred([second], "451 later")
    held = accept(2, 100)
    sp.hold(held)
    sp.checkpoint()
    for i in range(3, 9):
        accept(i, 300)  # several segments
    attempt = sp.claim()
    assert attempt is not None
    with attempt:
        first, _second = attempt.envelope.recipients
        attempt.failed([first], "550 no")
        acks.settled.add((attempt.msg_id, first))
    sp.checkpoint()


def clean_run_calls(tmp_path: Path) -> int:
    fs = NthFailFS()
    sp = Spool.open(tmp_path / "clean", fs=fs, clock=FakeClock(), **OPTIONS)  # type: ignore[arg-type]
    workload(sp, Acks())
    sp.close()
    return fs.calls


def check_recovered(spool_dir: Path, acks: Acks) -> None:
    """Reopen on the real file system; the contract must hold."""
    clock = FakeClock(2e9)
    with Spool.open(spool_dir, clock=clock, **OPTIONS) as sp:  # type: ignore[arg-type]
        queued = {e.msg_id: set(e.recipients) for e in sp.list()}
        for entry in sp.list():
            if entry.held is not None:
                sp.release(entry.msg_id)
        for msg_id, rcpts in acks.accepted.items():
            for r in rcpts:
                if (msg_id, r) in acks.settled:
                    assert r not in queued.get(msg_id, set()), f"settled {msg_id} {r} is queued"
        missing = [
            m
            for m, rcpts in acks.accepted.items()
            if m not in queued and not all((m, r) in acks.settled for r in rcpts)
        ]
        # A message with recipients left must be queued unless its attempt finished it.
        handed: set[tuple[str, str]] = set()
        while (attempt := sp.claim()) is not None:
            with attempt:
                for r in attempt.envelope.recipients:
                    key = (attempt.msg_id, r)
                    assert key not in acks.settled, f"acknowledged {key} handed out again"
                    assert key not in handed, f"{key} handed out twice"
                    handed.add(key)
                attempt.delivered(attempt.envelope.recipients, "250 ok")
        for m in missing:
            pending = {r for r in acks.accepted[m] if (m, r) not in acks.settled}
            assert not pending - {r for mm, r in handed if mm == m}, f"{m} lost recipients"
    report = check_spool(str(spool_dir))
    assert report.clean, report.problems


@pytest.mark.parametrize("sticky", [False, True], ids=["once", "from-then-on"])
def test_failing_the_nth_io_call_stops_the_spool_and_reopen_keeps_the_contract(
    tmp_path: Path, sticky: bool
) -> None:
    total = clean_run_calls(tmp_path)
    assert total > 40
    stopped_log = 0
    for n in range(1, total + 1):
        spool_dir = tmp_path / f"n{n}"
        fs = NthFailFS(n, sticky)
        acks = Acks()
        sp: Spool | None = None
        try:
            sp = Spool.open(spool_dir, fs=fs, clock=FakeClock(), **OPTIONS)  # type: ignore[arg-type]
            workload(sp, acks)
        except SpoolError as exc:
            assert fs.failed, f"n={n}: {exc!r} without an injected failure"
            op, target = fs.failed[0]
            in_log = os.path.dirname(target).endswith(fmt.LOG_DIR) and op in ("pwrite", "fdatasync")
            if sp is not None and in_log:
                stopped_log += 1
                with pytest.raises(SpoolFailed):  # sticky: the spool stays stopped
                    sp.accept("s@example.org", ["late@example.net"], b"late")
                assert target not in fs.synced_after_failure, f"n={n}: a failed fsync was retried"
        finally:
            if sp is not None:
                sp.close()  # must finish (and unlock) whatever failed
        assert fs.failed or n > fs.calls, f"n={n}: nothing failed"
        try:
            check_recovered(spool_dir, acks)
        except AssertionError as exc:
            raise AssertionError(f"n={n} ({fs.failed[:1]}): {exc}") from exc
    assert stopped_log > 5


def test_a_failed_checkpoint_is_a_typed_error_and_close_still_finishes(spool_dir: str) -> None:
    fs = FaultFS()
    sp = Spool.open(spool_dir, fs=fs)
    kept = sp.accept("alice@example.org", ["bob@example.net"], b"x")
    sp.sync()
    fs.fail("pwrite", err=errno.ENOSPC)  # the positions file cannot be written
    with pytest.raises(SpoolFailed) as info:
        sp.checkpoint()
    assert info.value.errno == errno.ENOSPC
    sp.close()
    with Spool.open(spool_dir) as again:  # the lock was released; nothing was lost
        assert [e.msg_id for e in again.list()] == [kept]


def test_a_body_promotion_that_finds_no_space_keeps_the_body_inline(spool_dir: str) -> None:
    fs = FaultFS()
    with Spool.open(spool_dir, fs=fs) as sp:
        msg_id = sp.accept("alice@example.org", ["bob@example.net"], b"inline body")
        sp.sync()
        fs.fail("fdatasync", err=errno.ENOSPC, sticky=False)  # the body file's sync fails
        sp.hold(msg_id)  # holding promotes the body to a file of its own
        assert not os.listdir(Path(spool_dir, fmt.BODY_DIR))
        sp.release(msg_id)
        attempt = sp.claim()
        assert attempt is not None and attempt.read_data() == b"inline body"
        attempt.close()


class _SegmentOpenFails(FileSystem):
    """Fails the next read-only open of segment 1 with ``err`` (every one if ``sticky``)."""

    def __init__(self) -> None:
        self.err: int | None = None
        self.sticky = False

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        reading = not flags & (os.O_WRONLY | os.O_RDWR)
        if self.err and reading and path.endswith(fmt.segment_name(1)):
            err = self.err
            if not self.sticky:
                self.err = None
            raise OSError(err, os.strerror(err))
        return super().open(path, flags, mode)


@pytest.mark.parametrize("err", [errno.EIO, errno.EMFILE, errno.EACCES])
def test_a_promotion_that_cannot_read_the_segment_keeps_the_body_inline(
    spool_dir: str, err: int
) -> None:
    # Found by review: a segment that could not be opened (SegmentUnreadable) escaped the
    # promotion of a deferred message's inline body in the middle of the attempt's close:
    # the message stayed in flight (with EACCES for good: every checkpoint failed too), and
    # with max_in_flight=1 nothing else was handed out.
    clock, fs = FakeClock(), _SegmentOpenFails()
    options = {"retry_intervals": [10, 1000], "attempt_timeout": 60, "max_in_flight": 1}
    with Spool.open(spool_dir, clock=clock, fs=fs, **options) as sp:  # type: ignore[arg-type]
        msg_id = sp.accept("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nhello\r\n")
        with sp.claim() as attempt:  # type: ignore[union-attr]
            attempt.deferred(["b@example.net"], "451 4.3.0 later")  # class 1, due in 10 s
        clock.advance(10)
        other = sp.accept("a@example.org", ["c@example.net"], b"Subject: y\r\n\r\nhi\r\n")
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg_id
        attempt.deferred(["b@example.net"], "451 4.3.0 later")
        fs.err, fs.sticky = err, err == errno.EACCES
        attempt.close()  # due in 1000 s, past the longest interval: its body is promoted
        again = sp.claim(timeout=0)
        assert again is not None and again.msg_id == other
        again.delivered(["c@example.net"], "250 2.0.0 ok")
        again.close()
        sp.checkpoint()
        fs.err = None
    with Spool.open(spool_dir, clock=clock, **options) as sp:  # type: ignore[arg-type]
        clock.advance(1000)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg_id
        assert attempt.read_data() == b"Subject: x\r\n\r\nhello\r\n"
        attempt.close()
