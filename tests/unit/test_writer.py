"""The log writer: group commit, sector padding, segment rollover, sticky failure."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from spool import format as fmt
from spool.errors import SpoolFailed
from spool.framing import Frame
from spool.reader import LogCursor, list_segments
from spool.records import Position
from spool.testing import CountingFS, FaultFS
from spool.writer import LogWriter, Part


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
