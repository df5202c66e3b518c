"""Reading the log: torn tail versus corruption is decided by the durable end."""

from __future__ import annotations

from pathlib import Path

import pytest

from spool import format as fmt
from spool.errors import CorruptSpool
from spool.framing import Frame
from spool.reader import LogCursor
from spool.records import Position
from spool.testing import CountingFS
from spool.writer import LogWriter


def _write(tmp_path: Path, n: int) -> list[Position]:
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=1 << 20)
    out = [w.append([(fmt.T_CONTROL, b"x" * 100)], durable=True) for _ in range(n)]
    w.close()
    return out


def _frames(tmp_path: Path, durable_end: Position | None) -> tuple[int, LogCursor]:
    cursor = LogCursor(CountingFS(), str(tmp_path), Position(1, 0), durable_end=durable_end)
    n = sum(1 for _, f in cursor if isinstance(f, Frame) and f.type == fmt.T_CONTROL)
    cursor.close()
    return n, cursor


def test_truncated_trailing_frame_is_a_torn_tail_not_an_error(tmp_path: Path) -> None:
    positions = _write(tmp_path, 3)
    seg = tmp_path / fmt.segment_name(1)
    seg.write_bytes(seg.read_bytes()[: positions[2].offset + 50])
    n, cursor = _frames(tmp_path, durable_end=None)
    assert n == 2
    assert cursor.torn is not None and cursor.torn.at == positions[2]


def test_truncation_at_every_offset_of_the_last_frame_is_torn(tmp_path: Path) -> None:
    positions = _write(tmp_path, 2)
    seg = tmp_path / fmt.segment_name(1)
    data = seg.read_bytes()
    for cut in range(positions[1].offset + 1, positions[1].offset + 109):
        seg.write_bytes(data[:cut])
        n, cursor = _frames(tmp_path, durable_end=None)
        assert n == 1 and cursor.torn is not None, cut


def test_bad_crc_before_the_durable_end_is_reported_as_corruption(tmp_path: Path) -> None:
    positions = _write(tmp_path, 3)
    seg = tmp_path / fmt.segment_name(1)
    data = bytearray(seg.read_bytes())
    data[positions[1].offset + 20] ^= 0x40
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptSpool) as info:
        _frames(tmp_path, durable_end=Position(1, len(data)))
    assert info.value.offset == positions[1].offset
    assert info.value.path.endswith(fmt.segment_name(1))


def test_damaged_frame_in_an_older_segment_is_corruption_even_past_durable_end(
    tmp_path: Path,
) -> None:
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=600)
    for _ in range(10):
        w.append([(fmt.T_CONTROL, b"y" * 100)], durable=True)
    w.close()
    seg = tmp_path / fmt.segment_name(1)
    data = bytearray(seg.read_bytes())
    data[fmt.SEGMENT_HEADER_SIZE + 30] ^= 1
    seg.write_bytes(bytes(data))
    cursor = LogCursor(CountingFS(), str(tmp_path), Position(1, 0), newest_segment=5)
    with pytest.raises(CorruptSpool):
        list(cursor)


def test_bad_segment_header_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    seg = tmp_path / fmt.segment_name(1)
    data = bytearray(seg.read_bytes())
    data[0] = ord("X")
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptSpool, match="header"):
        _frames(tmp_path, durable_end=Position(1, 600))


def test_flip_in_newest_segment_with_later_batches_is_corruption(tmp_path: Path) -> None:
    positions = _write(tmp_path, 4)  # each durable append is its own sector-aligned batch
    seg = tmp_path / fmt.segment_name(1)
    data = bytearray(seg.read_bytes())
    data[positions[1].offset + 40] ^= 0x08
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptSpool, match="not a torn write"):
        _frames(tmp_path, durable_end=None)


def test_unwritten_sector_inside_the_last_batch_is_a_tear(tmp_path: Path) -> None:
    """A batch whose middle sector never reached the disk, while a later sector did."""
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=1 << 20)
    w.append([(fmt.T_CONTROL, b"first")], durable=True)
    starts = [w.append([(fmt.T_CONTROL, b"z" * 300)], durable=False) for _ in range(8)]
    w.close()
    seg = tmp_path / fmt.segment_name(1)
    data = bytearray(seg.read_bytes())
    hole = starts[1].offset - starts[1].offset % fmt.SECTOR + fmt.SECTOR
    data[hole : hole + fmt.SECTOR] = bytes(fmt.SECTOR)
    seg.write_bytes(bytes(data))
    n, cursor = _frames(tmp_path, durable_end=None)
    assert cursor.torn is not None and cursor.torn.at.offset <= hole
    assert 1 <= n < 9


class _SizeCountingFS(CountingFS):
    def size(self, fd: int) -> int:
        self._count("size")
        return super().size(fd)


def test_a_live_cursor_asks_a_whole_segments_size_once_and_never_trusts_an_old_one(
    tmp_path: Path,
) -> None:
    # A runner reading behind the segment the durable end is in: that segment no longer
    # grows (W3), so its size is asked once, not at every frame. A size taken while the
    # segment was still the newest is asked again once it is whole.
    # No zeros written ahead: the newest segment's file grows with its frames.
    w = LogWriter(CountingFS(), str(tmp_path), first_segment=1, segment_size=4096, write_ahead=0)
    for _ in range(5):
        w.append([(fmt.T_CONTROL, b"a" * 100)], durable=True)
    fs = _SizeCountingFS()
    cursor = LogCursor(fs, str(tmp_path), Position(1, 0), live=True)

    def records(limit: Position) -> int:
        n = 0
        while (item := cursor.next(limit)) is not None:
            n += isinstance(item[1], Frame) and item[1].type == fmt.T_CONTROL
        return n

    seen = records(w.durable)  # the newest segment, part written
    assert seen == 5
    while w.durable.segment < 3:  # the rest of segment 1, then 2 and some of 3
        w.append([(fmt.T_CONTROL, b"b" * 100)], durable=True)
    total = sum(
        isinstance(f, Frame) and f.type == fmt.T_CONTROL
        for _, f in LogCursor(CountingFS(), str(tmp_path), Position(1, 0))
    )
    sizes = fs.calls["size"]
    seen += records(w.durable)
    assert seen == total, "the cursor stopped at a size taken before the segment was whole"
    assert fs.calls["size"] - sizes <= 6, f"{fs.calls['size'] - sizes} size calls"
    cursor.close()
    w.close()
