"""The read descriptors an open spool keeps for bodies read one at a time: the same frames
and errors as a read that opens the segment, few descriptors, and none kept for a segment
the checkpoint retires (a deleted file held open keeps its space)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool.errors import CorruptSpool
from spool.fs import FileSystem
from spool.reader import read_frame_at
from spool.records import Position
from spool.segment_files import KEEP_OPEN, SegmentFiles
from spool.testing import CountingFS
from spool.writer import LogWriter


def _log(tmp_path: Path, sizes: list[int], segment_size: int = 4096) -> list[Position]:
    """Control frames of ``sizes`` bytes, each durable, over segments of ``segment_size``."""
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=segment_size)
    out = [
        w.append([(fmt.T_CONTROL, bytes([i % 251]) * n)], durable=True) for i, n in enumerate(sizes)
    ]
    w.close()
    return out


class _TrackingFS(FileSystem):
    """Counts opens and closes of descriptors."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        self.opened += 1
        return fd

    def close(self, fd: int) -> None:
        self.closed += 1
        super().close(fd)


def _files_held(root: Path | str) -> list[str]:
    """Files under ``root`` this process holds open (`` (deleted)`` after the deleted)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root) + os.sep):
            held.append(target)
    return held


def _deleted_segments_held(root: Path) -> list[str]:
    """Segment files under ``root`` this process holds open after they were deleted."""
    return [t for t in _files_held(root) if t.endswith(" (deleted)")]


def test_frames_read_through_kept_descriptors_are_those_an_opening_read_finds(
    tmp_path: Path,
) -> None:
    positions = _log(tmp_path, [100, 3000, 21_000, 10, 33_000])
    fs = _TrackingFS()
    files = SegmentFiles(fs, str(tmp_path))
    for at in positions + positions:
        assert files.read_frame(at) == read_frame_at(fs, str(tmp_path), at)
    segments = {at.segment for at in positions}
    assert len(segments) > 1
    # One open per segment through the kept descriptors, plus one per opening read.
    assert fs.opened == len(segments) + 2 * len(positions)
    for at in positions:
        for hint in (1, 500, 25_000, 10**9):  # a hint too short or too long: the same frame
            assert files.read_frame(at, hint) == read_frame_at(fs, str(tmp_path), at, hint)
    files.close()
    assert files.open_count == 0 and fs.closed == fs.opened


def test_no_more_than_keep_open_descriptors_and_the_least_recently_used_goes(
    tmp_path: Path,
) -> None:
    positions = _log(tmp_path, [4100] * 12)  # one frame a segment
    assert len({at.segment for at in positions}) == 12
    fs = _TrackingFS()
    files = SegmentFiles(fs, str(tmp_path))
    for at in positions[:KEEP_OPEN]:
        files.read_frame(at)
    files.read_frame(positions[0])  # now the most recently used
    files.read_frame(positions[KEEP_OPEN])  # evicts the least recently used: the second
    assert files.open_count == KEEP_OPEN
    opened = fs.opened
    files.read_frame(positions[0])
    assert fs.opened == opened
    files.read_frame(positions[1])
    assert fs.opened == opened + 1
    files.close()
    assert fs.closed == fs.opened


def test_a_retired_segment_keeps_no_descriptor_and_reads_of_it_open_it_alone(
    tmp_path: Path,
) -> None:
    positions = _log(tmp_path, [4100] * 4)
    fs = _TrackingFS()
    files = SegmentFiles(fs, str(tmp_path))
    for at in positions:
        files.read_frame(at)
    files.retire_below(positions[2].segment)
    assert files.open_count == 2
    assert fs.closed == 2
    files.read_frame(positions[0])  # retired, still there: opened and closed again
    assert files.open_count == 2 and fs.closed == 3
    os.unlink(tmp_path / fmt.segment_name(positions[0].segment))
    with pytest.raises(CorruptSpool, match="segment file is missing"):
        files.read_frame(positions[0])
    files.close()
    assert fs.closed == fs.opened


class _PausingFS(FileSystem):
    """Its preads of frames wait for ``go`` once ``pause`` is set."""

    def __init__(self) -> None:
        self.pause = False
        self.reading = threading.Event()
        self.go = threading.Event()
        self.closed: list[int] = []

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        if self.pause and offset >= fmt.SEGMENT_HEADER_SIZE:
            self.reading.set()
            self.go.wait(10)
        return super().pread(fd, size, offset)

    def close(self, fd: int) -> None:
        self.closed.append(fd)
        super().close(fd)


@pytest.mark.parametrize("how", ["retire", "close"])
def test_a_descriptor_in_use_is_closed_when_its_read_ends(tmp_path: Path, how: str) -> None:
    # Closed under a read, its number could be reused for another file and the read
    # would go on in that file.
    (at,) = _log(tmp_path, [500])
    fs = _PausingFS()
    files = SegmentFiles(fs, str(tmp_path))
    files.read_frame(at)
    fs.pause = True
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(files.read_frame(at)))
    reader.start()
    assert fs.reading.wait(10)
    if how == "retire":
        files.retire_below(at.segment + 1)
    else:
        files.close()
    assert fs.closed == [] and files.open_count == 0
    fs.go.set()
    reader.join(10)
    assert got and got[0] == read_frame_at(FileSystem(), str(tmp_path), at)
    assert len(fs.closed) == 1


def test_damage_reads_as_it_does_without_kept_descriptors(tmp_path: Path) -> None:
    positions = _log(tmp_path, [200, 200])
    path = tmp_path / fmt.segment_name(positions[1].segment)
    files = SegmentFiles(FileSystem(), str(tmp_path))
    files.read_frame(positions[0])  # the descriptor is kept open
    with open(path, "r+b") as f:
        f.seek(positions[1].offset + fmt.FRAME_HEADER_SIZE + 10)
        f.write(b"\xff")
    with pytest.raises(CorruptSpool, match="checksum") as kept:
        files.read_frame(positions[1])
    with pytest.raises(CorruptSpool) as opened:
        read_frame_at(FileSystem(), str(tmp_path), positions[1])
    assert str(kept.value) == str(opened.value)
    with pytest.raises(CorruptSpool, match=r"no frame header here|unknown frame type|frame length"):
        files.read_frame(Position(positions[1].segment, positions[1].offset + 1))
    files.close()


def test_concurrent_reads_retirements_and_evictions_read_right_and_leak_nothing(
    tmp_path: Path,
) -> None:
    positions = _log(tmp_path, [1500 + 97 * i for i in range(30)], segment_size=4096)
    expected = {at: read_frame_at(FileSystem(), str(tmp_path), at) for at in positions}
    fs = _TrackingFS()
    files = SegmentFiles(fs, str(tmp_path), keep_open=2)
    errors: list[BaseException] = []
    live = positions[len(positions) // 2 :]

    def read(k: int) -> None:
        try:
            for i in range(400):
                at = live[(i * 7 + k) % len(live)]
                assert files.read_frame(at) == expected[at]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for at in positions[: len(positions) // 2]:
        files.retire_below(at.segment)
    for t in threads:
        t.join()
    assert not errors, errors[0]
    files.close()
    assert fs.closed == fs.opened


def test_an_open_spool_holds_no_deleted_segment_open(tmp_path: Path) -> None:
    # Contract 6: the space of delivered mail is given back. Bodies read through kept
    # descriptors while the checkpoints delete segment after segment.
    root = tmp_path / "spool"
    body = b"Subject: s\r\n\r\n" + b"x" * 2000
    with Spool.open(root, segment_size=16 * 1024, checkpoint_every=50) as sp:
        for _ in range(30):
            for _ in range(10):
                sp.accept("a@example.org", ["b@example.net"], body)
            while (attempt := sp.claim(timeout=0)) is not None:
                with attempt:
                    assert attempt.read_data() == body
                    attempt.delivered(["b@example.net"], "250 ok")
            sp.checkpoint()
        assert sp.statistics().segments_deleted > 5
        assert _deleted_segments_held(root) == []
        assert sp._state.segment_files.open_count <= KEEP_OPEN
    assert _deleted_segments_held(root) == []


def test_a_failed_open_keeps_no_segment_open(tmp_path: Path) -> None:
    # Found by review: recovery read an inline body through the kept descriptors (the
    # body of a failed recipient, copied for its bounce), then the open failed at its first
    # checkpoint (a full disk) and left the descriptor open; a later open deleted the
    # segment, and this process held its blocks.
    import errno
    import subprocess
    import sys

    from spool.errors import DiskFull
    from spool.testing import FaultFS

    root = str(tmp_path / "spool")
    child = (
        "import os, sys\n"
        "from spool import Spool\n"
        "sp = Spool.open(sys.argv[1], outcomes=True, segment_size=4096)\n"
        "sp.accept('a@example.org', ['b@example.net'], b'Subject: x\\r\\n\\r\\n' + b'x' * 1000)\n"
        "a = sp.claim(timeout=1)\n"
        "a.failed(['b@example.net'], '550 5.1.1 no such user')\n"
        "os._exit(0)\n"  # a crash before the finish record
    )
    subprocess.run([sys.executable, "-c", child, root], check=True)
    fs = FaultFS()
    fs.fail("rename", err=errno.ENOSPC)
    with pytest.raises(DiskFull):
        Spool.open(root, fs=fs)
    assert _files_held(root) == []
