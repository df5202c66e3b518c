"""Zeros written ahead of the log (writer invariant W6; docs/format.md, "Zeros written
ahead"): the newest segment of a running spool goes on with zeros after its last frame, so
that later batches overwrite blocks that exist instead of growing the file. Every reader
stops at them as at a torn tail, a clean close cuts them, and recovery after a kill cuts
them without calling them torn bytes."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool.check import _fingerprint as check_fingerprint
from spool.check import check_spool
from spool.errors import CorruptSpool, SpoolMisuse
from spool.framing import Frame
from spool.fs import FileSystem
from spool.reader import LogCursor, list_segments
from spool.records import Position
from spool.testing import CountingFS
from spool.writer import DEFAULT_WRITE_AHEAD as WRITE_AHEAD
from spool.writer import FIRST_AHEAD, LogWriter, Part

ROOT = Path(__file__).resolve().parents[2]


def _frame(i: int, size: int = 40) -> list[Part]:
    return [(fmt.T_CONTROL, f"frame {i} ".encode().ljust(size, b"."))]


def _segment(log_dir: Path, number: int = 1) -> Path:
    return log_dir / fmt.segment_name(number)


def test_a_batch_writes_zeros_ahead_and_later_batches_overwrite_them(tmp_path: Path) -> None:
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=64 << 20)
    w.append(_frame(0), durable=True)
    first_end = w.durable.offset
    path = _segment(tmp_path)
    assert path.stat().st_size == first_end + FIRST_AHEAD
    for i in range(1, 50):
        w.append(_frame(i), durable=True)
    # Fifty batches later the file has not grown: they overwrote the zeros.
    assert path.stat().st_size == first_end + FIRST_AHEAD
    end = w.durable.offset
    data = path.read_bytes()
    assert not data[end:].strip(b"\0") and len(data) - end == first_end + FIRST_AHEAD - end
    # A reader of the live log stops at the zeros as at a torn tail, after every frame.
    cursor = LogCursor(fs, str(tmp_path), Position(1, 0))
    frames = [f.payload for _, f in cursor if isinstance(f, Frame) and f.type != fmt.T_PAD]
    cursor.close()
    assert len(frames) == 50 and cursor.torn is not None and cursor.torn.at == Position(1, end)
    w.close()
    # A clean close cuts them: the log ends where its frames do, on a sector boundary.
    assert path.stat().st_size == end and end % fmt.SECTOR == 0


def test_the_runs_of_zeros_double_up_to_write_ahead(tmp_path: Path) -> None:
    # Few zeros for an open or a spool that writes little (a restart cuts them and syncs
    # that), one file-size change a megabyte for a busy one.
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=64 << 20)
    path = _segment(tmp_path)
    runs = []
    size = 0
    while len(runs) < 7:
        w.append(_frame(len(runs), 4000), durable=True)
        if path.stat().st_size != size:
            size = path.stat().st_size
            runs.append(size - w.durable.offset)
    w.close()
    k = FIRST_AHEAD
    assert runs == [k, 2 * k, 4 * k, 8 * k, WRITE_AHEAD, WRITE_AHEAD, WRITE_AHEAD]


def test_zeros_are_never_written_past_the_segment_size(tmp_path: Path) -> None:
    segment_size = 8192
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=segment_size)
    w.append(_frame(0), durable=True)
    assert _segment(tmp_path).stat().st_size == segment_size
    for i in range(1, 400):
        w.append(_frame(i, 200), durable=True)
    w.close()
    segments = list_segments(CountingFS(), str(tmp_path))
    assert len(segments) > 3
    # Every segment ends in its last frame: the rollover came only once its frames had
    # passed the furthest zero written ahead (zeros in a segment before the newest would
    # be corruption to the reader), and the close cut the newest one's.
    assert all(
        (tmp_path / fmt.segment_name(n)).stat().st_size >= segment_size for n in segments[:-1]
    )
    cursor = LogCursor(CountingFS(), str(tmp_path), Position(1, 0))
    frames = [f for _, f in cursor if isinstance(f, Frame) and f.type != fmt.T_PAD]
    cursor.close()
    assert len(frames) == 400 and cursor.torn is None


def test_a_runner_that_read_to_the_durable_end_sees_the_frames_written_over_the_zeros(
    tmp_path: Path,
) -> None:
    # The cursor must not keep zeros it read past its limit: the next batch replaces them.
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=64 << 20)
    cursor = LogCursor(fs, str(tmp_path), Position(1, 0), live=True, chunk_size=1 << 16)
    seen = []
    for i in range(20):
        w.append(_frame(i), durable=True)
        while (item := cursor.next(w.durable)) is not None:
            _pos, frame = item
            if isinstance(frame, Frame) and frame.type != fmt.T_PAD:
                seen.append(frame.payload)
    assert seen == [_frame(i)[0][1] for i in range(20)] and cursor.torn is None
    cursor.close()
    w.close()


def test_a_live_spool_checks_clean_with_no_torn_tail_noted(tmp_path: Path) -> None:
    with Spool.open(tmp_path / "q") as sp:
        sp.accept("a@example.org", ["b@example.net"], b"hello")
        report = check_spool(str(tmp_path / "q"))
    assert report.clean, report.problems
    assert not [n for n in report.notes if "torn" in n], report.notes


KILLED_OWNER = textwrap.dedent(
    """
    import os, sys
    from spool import Spool
    sp = Spool.open(sys.argv[1])
    for i in range(30):
        sp.accept("a@example.org", [f"r{i}@example.net"], b"body %d" % i)
    print("accepted", flush=True)
    sys.stdin.read()  # killed here, the zeros ahead still on disk
    """
)


def killed_owner(root: Path) -> None:
    """A spool at ``root`` whose owner accepted 30 messages, then was killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_OWNER, str(root)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "accepted"
    child.send_signal(signal.SIGKILL)
    child.wait()


def test_a_kill_leaves_zeros_that_recovery_cuts_without_calling_them_torn(
    tmp_path: Path,
) -> None:
    root = tmp_path / "q"
    killed_owner(root)
    log_dir = root / fmt.LOG_DIR
    newest = list_segments(CountingFS(), str(log_dir))[-1]
    data = _segment(log_dir, newest).read_bytes()
    end = len(data.rstrip(b"\0"))
    assert len(data) - end > FIRST_AHEAD // 2  # the zeros written ahead
    with Spool.open(root) as sp:
        assert sp.recovery.torn_bytes_cut == 0
        assert sp.recovery.torn_at is not None
        assert len(list(sp.list())) == 30
        # Cut back to the last batch: that segment now ends where its frames do.
        assert _segment(log_dir, newest).stat().st_size == sp.recovery.torn_at.offset
    assert not (root / fmt.CORRUPT_DIR).exists()  # zeros are not a tear to keep


def test_a_reader_beside_the_writer_reads_on_past_where_the_zeros_stopped_it(
    tmp_path: Path,
) -> None:
    # A reader of the whole file (a view beside a running owner) stops at the zeros as at
    # a torn tail; asked again after more batches, it reads them from the disk anew.
    fs = CountingFS()
    w = LogWriter(fs, str(tmp_path), first_segment=1, segment_size=64 << 20)
    cursor = LogCursor(fs, str(tmp_path), Position(1, 0))
    seen = []
    for i in range(5):
        w.append(_frame(i), durable=True)
        while (item := cursor.next()) is not None:
            if isinstance(item[1], Frame) and item[1].type != fmt.T_PAD:
                seen.append(item[1].payload)
        assert cursor.torn is not None and cursor.torn.at == w.durable
    assert seen == [_frame(i)[0][1] for i in range(5)]
    cursor.close()
    w.close()


def test_write_ahead_zero_turns_it_off_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    with Spool.open(tmp_path / "q", write_ahead=0) as sp:
        for i in range(3):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"hello")
        data = (tmp_path / "q" / fmt.LOG_DIR / fmt.segment_name(1)).read_bytes()
        assert len(data) % fmt.SECTOR == 0 and data[-fmt.SECTOR :].strip(b"\0")  # no zeros
    for bad in (-1, 1.5, True, (8 << 20) + 1):  # more would make a restart read it
        with pytest.raises(SpoolMisuse, match="write_ahead"):
            Spool.open(tmp_path / "r", write_ahead=bad)
    assert not (tmp_path / "r").exists()


class NoRoomForZeros(FileSystem):
    """A disk with room for the batches but not for the zeros after them."""

    def __init__(self) -> None:
        self.refused = 0

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        if len(data) > fmt.SECTOR and not data.strip(b"\0"):
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().pwrite(fd, data, offset)


def test_no_room_for_the_zeros_costs_only_the_speed_up(tmp_path: Path) -> None:
    # Found by the full-disk test: with the zeros in the batch's own write, a disk with
    # room for the batch but not the zeros failed an accept whose frames were on disk.
    fs = NoRoomForZeros()
    with Spool.open(tmp_path / "q", fs=fs) as sp:
        ids = [sp.accept("a@example.org", [f"r{i}@example.net"], b"hello") for i in range(3)]
        assert fs.refused >= 3  # each batch passed the end and tried again
        (seg,) = (tmp_path / "q" / fmt.LOG_DIR).iterdir()
        assert seg.stat().st_size % fmt.SECTOR == 0 and seg.read_bytes()[-fmt.SECTOR :].strip(b"\0")
    with Spool.open(tmp_path / "q") as sp:
        assert sorted(e.msg_id for e in sp.list()) == sorted(ids)


class MidWriteFS(CountingFS):
    """Reads as a reader beside a running owner may: the first read that covers ``cut``
    sees zeros from there on (the owner's ``pwrite`` had not yet copied those bytes over
    the zeros written ahead), every later read the file as it is."""

    def __init__(self, cut: int) -> None:
        super().__init__()
        self.cut: int | None = cut

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        data = super().pread(fd, size, offset)
        if self.cut is not None and offset <= self.cut < offset + len(data):
            keep = self.cut - offset
            data = data[:keep] + bytes(len(data) - keep)
            self.cut = None
        return data


def test_a_frame_read_while_the_owner_writes_it_is_a_tail_not_damage(tmp_path: Path) -> None:
    # Found by review: `spool dump` beside a running owner read a frame half copied over
    # the zeros; read again to judge it, the frame was whole, so it was called damage.
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=64 << 20)
    starts = [w.append(_frame(i, 700), durable=True) for i in range(3)]
    fs = MidWriteFS(starts[2].offset + 600)  # the last frame, half there
    cursor = LogCursor(fs, str(tmp_path), Position(1, 0))
    frames = [f.payload for _, f in cursor if isinstance(f, Frame) and f.type != fmt.T_PAD]
    assert len(frames) == 2 and cursor.torn is not None and cursor.torn.at == starts[2]
    # Asked again, it reads the frame as it is now.
    item = cursor.next()
    assert item is not None and item[0] == starts[2] and isinstance(item[1], Frame)
    cursor.close()
    w.close()


@pytest.mark.parametrize("at", [0, 3, 8, 9, 100, 508])
def test_a_burst_in_the_zeros_after_a_kill_holds_no_mail(tmp_path: Path, at: int) -> None:
    # Found by review: one flipped bit in the first zero sector after the log's end made
    # the open refuse the spool, and its repair held every queued message.
    root = tmp_path / "q"
    killed_owner(root)
    log_dir = root / fmt.LOG_DIR
    newest = _segment(log_dir, list_segments(CountingFS(), str(log_dir))[-1])
    data = bytearray(newest.read_bytes())
    end = len(data.rstrip(b"\0"))
    end += -end % fmt.SECTOR  # the log ends on a sector boundary (its last batch's PAD)
    data[end + at] ^= 0x10
    data[end + at + 3] ^= 0x81 if at + 3 < fmt.SECTOR else 0  # a run of four bytes
    newest.write_bytes(bytes(data))
    assert check_spool(str(root)).clean
    with Spool.open(root) as sp:
        assert len(list(sp.list())) == 30 and sp.claim(timeout=0) is not None


class SlowWriteFS(MidWriteFS):
    """As ``MidWriteFS``, but the owner's copy stands still for ``reads`` reads."""

    def __init__(self, cut: int, reads: int) -> None:
        super().__init__(cut)
        self.reads = reads

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        cut = self.cut
        data = super().pread(fd, size, offset)
        if cut is not None and self.cut is None and self.reads > 1:
            self.reads -= 1
            self.cut = cut  # the next read covering it sees the same half-copied bytes
        return data


@pytest.mark.parametrize("beside_owner", [True, False])
def test_a_reader_beside_an_owner_waits_and_reads_a_copy_in_progress_again(
    tmp_path: Path, beside_owner: bool
) -> None:
    # Found by review: the first re-read may come before the owner's copy moved on.
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=64 << 20)
    starts = [w.append(_frame(i, 700), durable=True) for i in range(3)]
    fs = SlowWriteFS(starts[2].offset + 600, reads=2)
    cursor = LogCursor(fs, str(tmp_path), Position(1, 0), beside_owner=beside_owner)
    if beside_owner:
        frames = [f for _, f in cursor if isinstance(f, Frame) and f.type != fmt.T_PAD]
        assert len(frames) == 2 and cursor.torn is not None and cursor.torn.at == starts[2]
    else:  # a reader alone with the spool (recovery) never sees bytes change
        with pytest.raises(CorruptSpool):
            list(cursor)
    cursor.close()
    w.close()


def test_a_check_pass_stands_only_if_the_newest_segments_bytes_did_not_change(
    tmp_path: Path,
) -> None:
    # Found by review: batches overwrite the zeros without changing the file's size, so
    # `spool check` took a pass that read a batch half copied for one beside no writer.
    with Spool.open(tmp_path / "q") as sp:
        sp.accept("a@example.org", ["b@example.net"], b"one")
        before = check_fingerprint(FileSystem(), str(tmp_path / "q"))
        sp.accept("a@example.org", ["b@example.net"], b"two")
        after = check_fingerprint(FileSystem(), str(tmp_path / "q"))
    assert before[1] == after[1]  # the same segments, the same sizes
    assert before != after
