"""The log writer: group commit, sector padding, segment rollover, sticky failure."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spool import format as fmt
from spool.errors import SpoolClosed, SpoolError, SpoolFailed
from spool.framing import Frame
from spool.reader import LogCursor, list_segments
from spool.records import Position
from spool.testing import CountingFS, FaultFS
from spool.writer import IDLE_LOOK, LogWriter, Part


def _frame(i: int) -> list[Part]:
    return [(fmt.T_CONTROL, f"frame {i}".encode())]


def _read_all(log_dir: str) -> list[bytes]:
    cursor = LogCursor(CountingFS(), log_dir, Position(1, 0))
    out = [f.payload for _, f in cursor if isinstance(f, Frame) and f.type != fmt.T_PAD]
    cursor.close()
    # The log ends in its last frame, or (the writer still open) in the zeros it wrote
    # ahead (W6), which read as a torn tail.
    if cursor.torn is not None:
        torn = cursor.torn.at
        with open(os.path.join(log_dir, fmt.segment_name(torn.segment)), "rb") as f:
            f.seek(torn.offset)
            assert not f.read().strip(b"\0"), cursor.torn
    return out


def test_durable_append_is_written_and_synced_before_return(tmp_path: Path) -> None:
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20)
    start = w.append(_frame(0), durable=True)
    assert start == Position(1, fmt.SEGMENT_HEADER_SIZE)
    assert fs.calls["fdatasync"] == 1 and fs.calls["fsync_dir"] == 1
    assert w.durable.offset % fmt.SECTOR == 0
    assert _read_all(str(tmp_path)) == [b"frame 0"]
    w.close()


def test_concurrent_durable_appends_share_fdatasyncs(tmp_path: Path) -> None:
    fs = CountingFS(sync_delay=0.005)
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 24)
    per_thread, threads = 25, 16

    def work(t: int) -> None:
        for i in range(per_thread):
            w.append(_frame(t * 1000 + i), durable=True)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    total = per_thread * threads
    assert fs.calls["fdatasync"] < total / 4, fs.calls
    assert len(_read_all(str(tmp_path))) == total
    w.close()


def test_non_durable_appends_are_flushed_by_the_next_durable_one(tmp_path: Path) -> None:
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20, sync_interval=60)
    for i in range(5):
        w.append(_frame(i), durable=False)
    assert fs.calls["fdatasync"] == 0
    w.append(_frame(5), durable=True)
    assert fs.calls["fdatasync"] == 1
    assert len(_read_all(str(tmp_path))) == 6
    w.close()


def test_periodic_flush_writes_non_durable_appends(tmp_path: Path) -> None:
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20, sync_every=3)
    for i in range(3):
        w.append(_frame(i), durable=False)
    for _ in range(200):
        if fs.calls["fdatasync"]:
            break
        threading.Event().wait(0.01)
    assert fs.calls["fdatasync"] >= 1
    w.close()


def test_segments_roll_at_the_configured_size_and_stay_readable(tmp_path: Path) -> None:
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=1024)
    for i in range(200):
        w.append(_frame(i), durable=i % 10 == 0)
    w.close()
    segments = list_segments(CountingFS(), str(tmp_path))
    assert len(segments) > 3 and segments == list(range(1, len(segments) + 1))
    assert _read_all(str(tmp_path)) == [f"frame {i}".encode() for i in range(200)]
    # The batch that ends the log is padded to a sector; a segment sealed in the middle
    # of a batch needs no padding (nothing is ever written after it).
    assert os.path.getsize(tmp_path / fmt.segment_name(segments[-1])) % fmt.SECTOR == 0


def test_failed_fsync_is_sticky_and_reaches_every_caller(tmp_path: Path) -> None:
    fs = FaultFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20)
    w.append(_frame(0), durable=True)
    fs.fail("fdatasync", sticky=False)
    with pytest.raises(SpoolFailed, match="Input/output error"):
        w.append(_frame(1), durable=True)
    # The fault was one-shot, but the writer must not retry a failed fsync.
    with pytest.raises(SpoolFailed):
        w.append(_frame(2), durable=False)
    with pytest.raises(SpoolFailed):
        w.sync()
    w.close()


class GatedFS(CountingFS):
    """Each fdatasync waits for a permit (``let_one``), so that a test holds a flush open
    while other callers queue behind it; ``fail_next`` makes the next one fail."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)
        self.syncing = threading.Event()
        self.fail_next = False

    def fdatasync(self, fd: int) -> None:
        self.syncing.set()
        assert self.permits.acquire(timeout=30), "a test forgot a permit"
        self.syncing.clear()
        if self.fail_next:
            raise OSError(5, "Input/output error")
        super().fdatasync(fd)


def _wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def _asleep(w: LogWriter) -> int:
    """How many callers wait on the writer's condition (its flusher has one of its own)."""
    return len(w._cond._waiters)  # type: ignore[attr-defined]


def test_callers_asleep_behind_a_failed_flush_all_get_its_error(tmp_path: Path) -> None:
    fs = GatedFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20)
    fs.permits.release()
    w.append(_frame(0), durable=True)
    errors: list[BaseException] = []

    def durable_append(i: int) -> None:
        try:
            w.append(_frame(i), durable=True)
        except SpoolFailed as e:
            errors.append(e)

    threads = [threading.Thread(target=durable_append, args=(i,)) for i in range(1, 6)]
    threads[0].start()
    _wait_until(fs.syncing.is_set)
    for t in threads[1:]:
        t.start()
    _wait_until(lambda: _asleep(w) == 4)
    fs.fail_next = True
    fs.permits.release()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(errors) == 5
    w.close()


class Interrupted(Exception):
    """What a signal's handler raises in these tests (as Ctrl-C raises KeyboardInterrupt,
    which pytest would take for the user's)."""


def test_a_caller_interrupted_behind_a_flush_strands_nobody(tmp_path: Path) -> None:
    """A caller woken by a flush's end and hit by a signal's exception before it leads
    the next: the others go on at once. (Waking only the first uncovered caller to lead,
    tried and withdrawn, left them asleep until ``sync_interval``, 30 s here.)"""
    fs = GatedFS()
    main_end: list[Position] = []
    kick = threading.Event()

    def on_durable(_end: Position) -> None:
        if kick.is_set():
            kick.clear()
            os.kill(os.getpid(), signal.SIGUSR1)  # after the flush's wake-ups

    def handler(_signum: int, _frame: object) -> None:
        if main_end and w.durable < main_end[0]:
            raise Interrupted

    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20,
                  sync_interval=30.0, on_durable=on_durable)  # fmt: skip
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        fs.permits.release()
        w.append(_frame(0), durable=True)
        first = threading.Thread(target=w.append, args=(_frame(1),), kwargs={"durable": True})
        first.start()
        _wait_until(fs.syncing.is_set)  # the first flush is held open
        main_end.append(w.enqueue(_frame(2))[1])
        done: list[int] = []

        def durable_append(i: int) -> None:
            w.append(_frame(i), durable=True)
            done.append(i)

        others = [threading.Thread(target=durable_append, args=(i,)) for i in (3, 4, 5)]

        def then() -> None:
            _wait_until(lambda: _asleep(w) == 1)  # the main thread, first in line
            for t in others:
                t.start()
            _wait_until(lambda: _asleep(w) == 4)
            kick.set()
            for _ in range(3):
                fs.permits.release()

        threading.Thread(target=then).start()
        with pytest.raises(Interrupted):
            w.wait_durable(main_end[0])  # woken first by the flush's end, to lead
        first.join(30)
        started = time.monotonic()
        for t in others:
            t.join(10)
        assert sorted(done) == [3, 4, 5], "the other callers were left asleep"
        assert time.monotonic() - started < 10
    finally:
        signal.signal(signal.SIGUSR1, previous)
    fs.permits.release()
    w.close()


def test_a_leader_interrupted_mid_batch_fails_the_writer(tmp_path: Path) -> None:
    """Review of the writer (older than the targeted wake-ups): a leader interrupted after
    taking its batch and before writing it dropped the batch; the next durable append was
    written after the hole and acknowledged, and recovery stops at the hole."""
    arm = threading.Event()

    class InterruptedWrite(CountingFS):
        def pwrite(self, fd: int, data: bytes, offset: int) -> None:
            if arm.is_set():
                arm.clear()
                raise Interrupted  # as a handler raising in the leader would
            super().pwrite(fd, data, offset)

    w = LogWriter(InterruptedWrite(), str(tmp_path), first_segment=1, segment_size=1 << 20)
    w.append(_frame(0), durable=True)
    arm.set()
    with pytest.raises(Interrupted):
        w.append(_frame(1), durable=True)
    with pytest.raises(SpoolFailed, match="interrupted"):
        w.append(_frame(2), durable=True)  # before: acknowledged, after a hole
    w.close()
    assert _read_all(str(tmp_path)) == [b"frame 0"]


def test_a_caller_queued_during_close_gets_spool_closed(tmp_path: Path) -> None:
    """Review of the writer (older than the targeted wake-ups): a caller that queued a
    frame while ``close`` flushed, woken after it, led a flush of its own while ``close``
    closed the file outside the lock (EBADF, an assertion, or bytes in another file)."""
    fs = GatedFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20)
    fs.permits.release()
    w.append(_frame(0), durable=True)
    w.enqueue(_frame(1))
    closing = threading.Thread(target=w.close)
    closing.start()
    _wait_until(fs.syncing.is_set)  # close's flush of frame 1 is held open
    outcome: list[object] = []

    def late() -> None:
        try:
            w.append(_frame(2), durable=True)
            outcome.append("acknowledged")
        except SpoolError as e:
            outcome.append(e)

    late_caller = threading.Thread(target=late)
    late_caller.start()
    _wait_until(lambda: _asleep(w) == 1)
    for _ in range(3):
        fs.permits.release()  # close's flush, its cut of the zeros, and one spare
    closing.join(30)
    late_caller.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], SpoolClosed), outcome


def _switches(thread: threading.Thread) -> int:
    """A thread's voluntary context switches so far: one each time it goes to sleep."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in the thread's status")


def test_durable_calls_leave_the_flusher_asleep(tmp_path: Path) -> None:
    """A caller that waits leads its own flush, so the background flusher sleeps through
    it. It was woken twice a durable call (the frame queued, the flush's end), about a
    third of a single producer's accept CPU; a frame nobody waits for still wakes it."""
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=1 << 24)
    w.append(_frame(0), durable=True)
    _wait_until(lambda: w._flusher_idle)
    before, started = _switches(w._flusher), time.monotonic()
    for i in range(1, 201):
        w.append(_frame(i), durable=True)
    looks = (time.monotonic() - started) / IDLE_LOOK + 1  # its looks while idle
    assert _switches(w._flusher) - before <= 2 + looks  # 400 before
    _, end = w.enqueue(_frame(201))  # nobody waits for it: the flusher's
    _wait_until(lambda: _switches(w._flusher) > before)
    w.close()
    assert w.durable >= end and len(_read_all(str(tmp_path))) == 202


def test_frames_queued_behind_a_flush_are_the_flushers_when_it_ends(tmp_path: Path) -> None:
    """The flush's end wakes the flusher when frames wait behind the batch (here enough
    to flush at once: ``sync_every``); without that it slept for ``sync_interval``."""
    fs = GatedFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20,
                  sync_every=1, sync_interval=3600.0)  # fmt: skip
    fs.permits.release()
    w.append(_frame(0), durable=True)
    leader = threading.Thread(target=w.append, args=(_frame(1),), kwargs={"durable": True})
    leader.start()
    _wait_until(fs.syncing.is_set)  # the leader's flush is held open
    _, end = w.enqueue(_frame(2))  # nobody waits for it
    fs.permits.release()  # the leader's
    leader.join(30)
    fs.permits.release()  # the flusher's
    _wait_until(lambda: w.durable >= end)
    fs.permits.release()  # close's cut of the zeros ahead
    w.close()
    assert _read_all(str(tmp_path)) == [b"frame 0", b"frame 1", b"frame 2"]


def test_frames_queued_for_a_wait_that_never_comes_go_with_the_next_batch(tmp_path: Path) -> None:
    """``enqueue(waited=True)`` does not wake the flusher: if its caller never waits (an
    exception in between), the frames go with the next batch, whoever leads it: the
    flusher for the next frame nobody waits for (its interval), or ``close``."""
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=1 << 20, sync_interval=0.05)
    w.append(_frame(0), durable=True)
    _, forsaken = w.enqueue(_frame(1), waited=True)
    _, end = w.enqueue(_frame(2))
    _wait_until(lambda: w.durable >= end)
    assert forsaken <= end
    w.enqueue(_frame(3), waited=True)
    w.close()
    assert _read_all(str(tmp_path)) == [f"frame {i}".encode() for i in range(4)]


def test_the_interval_flush_writes_what_was_queued_after_a_leaders_flush(tmp_path: Path) -> None:
    """A frame queued while the flusher sleeps through an interval that a leader's flush
    emptied is written when that interval ends (the flusher is not idle, so the frame
    does not wake it)."""
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=1 << 20,
                  sync_interval=0.05)  # fmt: skip
    w.append(_frame(0), durable=False)  # wakes the idle flusher: its interval begins
    w.append(_frame(1), durable=True)  # a leader writes both
    _, end = w.enqueue(_frame(2))
    _wait_until(lambda: w.durable >= end)
    w.close()


def test_a_frame_whose_caller_never_waits_is_written_at_the_idle_flushers_look(
    tmp_path: Path,
) -> None:
    """Review of the flusher left asleep: a frame queued ``waited`` whose caller never
    waits, and nothing after it, stayed unwritten until ``WAIT_MAX`` (an hour); a claim
    already waiting did not see its message. The idle flusher looks every ``IDLE_LOOK``."""
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=1 << 20,
                  sync_interval=0.05)  # fmt: skip
    w.append(_frame(0), durable=True)
    _wait_until(lambda: w._flusher_idle)
    _, end = w.enqueue(_frame(1), waited=True)  # its caller stops here
    _wait_until(lambda: w.durable >= end)
    w.close()
