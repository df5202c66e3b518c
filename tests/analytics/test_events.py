"""The log as rows, without Spark: sources, torn tails, damage, archives."""

from __future__ import annotations

import collections
import errno
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from crc32c import crc32c

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.analytics.events import (
    COLUMNS,
    SegmentSource,
    _cursor,
    _damage_row,
    parse_source,
    plan_segments,
    readable_end,
    record_rows,
    segment_rows,
)
from spool.errors import CorruptSpool, NotASpool, SegmentUnreadable
from spool.framing import Frame, encode_frame
from spool.fs import FileSystem
from spool.reader import LogCursor
from spool.records import Position
from spool.segment_header import segment_header
from spool.testing import FakeClock, deliver_all
from spool.testing.doubles import FaultFS

KIND = [name for name, _ in COLUMNS].index("kind")


def _rows(sources: list[str], **options: str) -> list[tuple[object, ...]]:
    return [row for s in plan_segments(sources) for row in segment_rows(s, **options)]


def _spool(root: Path, messages: int = 3) -> list[str]:
    with Spool.open(root, clock=FakeClock()) as sp:
        ids = [sp.accept("a@example.org", ["b@example.net"], b"hi %d" % n) for n in range(messages)]
        deliver_all(sp)
    return ids


def _archiving_spool(root: Path) -> None:
    """A spool whose small segments, all settled, were retired into ``../archive``."""
    with Spool.open(root, clock=FakeClock(), archive_dir="../archive", segment_size=4096) as sp:
        for n in range(40):
            sp.accept("a@example.org", ["b@example.net"], b"x" * 300 + b"%d" % n)
        deliver_all(sp)
        sp.checkpoint()


def test_a_spool_reads_as_one_row_per_record_and_recipient(tmp_path: Path) -> None:
    ids = _spool(tmp_path / "mx")
    rows = _rows([str(tmp_path / "mx")])
    kinds = collections.Counter(r[KIND] for r in rows)
    assert kinds == {"accepted": 3, "started": 3, "delivered": 3, "finished": 3}
    assert {r[4] for r in rows} == set(ids)
    assert {r[0] for r in rows} == {"mx"}  # the server is the directory's name


def test_a_source_may_be_named(tmp_path: Path) -> None:
    assert parse_source(f"edge1={tmp_path}") == ("edge1", str(tmp_path))
    assert parse_source(str(tmp_path / "mx")) == ("mx", str(tmp_path / "mx"))


def test_paths_that_are_not_spools_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(NotASpool, match="no such directory"):
        plan_segments([str(tmp_path / "missing")])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    with pytest.raises(NotASpool, match="not a spool directory"):
        plan_segments([str(tmp_path / "notes")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotASpool, match="an empty directory"):
        plan_segments([str(tmp_path / "empty")])  # an unmounted file system, say
    with pytest.raises(NotASpool, match="not a directory"):
        plan_segments([str(tmp_path / "notes" / "readme.txt")])


def test_history_given_twice_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "mx"
    _archiving_spool(root)
    _spool(tmp_path / "other")
    with pytest.raises(NotASpool, match="give each once"):
        plan_segments([str(root), str(root)])
    with pytest.raises(NotASpool, match="give each once"):
        plan_segments([str(root), str(tmp_path / "archive")])  # read with the spool already
    with pytest.raises(NotASpool, match="name them apart"):
        plan_segments([f"mx={root}", f"mx={tmp_path / 'other'}"])


def test_a_torn_tail_ends_the_rows_quietly(tmp_path: Path) -> None:
    _spool(tmp_path / "mx")
    before = _rows([str(tmp_path / "mx")])
    [seg] = sorted((tmp_path / "mx" / fmt.LOG_DIR).iterdir())
    with open(seg, "ab") as f:  # half a frame: what a writer leaves mid-write
        f.write(b"\x01\x02\x03\x04\x40\x00\x00")
    assert _rows([str(tmp_path / "mx")]) == before


def test_damage_names_file_and_offset_or_is_skipped_when_asked(tmp_path: Path) -> None:
    _spool(tmp_path / "mx", messages=20)
    with Spool.open(tmp_path / "mx", clock=FakeClock()) as sp:
        sp.checkpoint()  # the whole log durable: damage in it cannot be a torn tail
    [seg] = sorted((tmp_path / "mx" / fmt.LOG_DIR).iterdir())
    data = bytearray(seg.read_bytes())
    data[fmt.SEGMENT_HEADER_SIZE + 40] ^= 0x10
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptSpool, match=str(seg)):
        _rows([str(tmp_path / "mx")])
    rows = _rows([str(tmp_path / "mx")], on_damage="skip")
    assert [r[KIND] for r in rows] == ["damaged"]
    assert str(seg) in str(rows[0][10])


def test_a_segment_of_another_format_version_is_damage_named_in_one_line(
    tmp_path: Path,
) -> None:
    _spool(tmp_path / "mx")
    [seg] = sorted((tmp_path / "mx" / fmt.LOG_DIR).iterdir())
    data = bytearray(seg.read_bytes())
    magic, _version, size, number, salt, _crc = fmt.SEGMENT_HEADER.unpack_from(data)
    header = fmt.SEGMENT_HEADER.pack(magic, 99, size, number, salt, 0)[:-4]
    data[: fmt.SEGMENT_HEADER_SIZE] = header + crc32c(header).to_bytes(4, "little")
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptSpool, match=f"{seg} at offset 0: format version 99"):
        _rows([str(tmp_path / "mx")])
    assert [r[KIND] for r in _rows([str(tmp_path / "mx")], on_damage="skip")] == ["damaged"]


def test_a_segment_that_cannot_be_read_is_one_line_naming_it(tmp_path: Path) -> None:
    # Root reads any file, so the refusals come from the file-system seam. An open this
    # user may not make (EACCES: another user's segment of mode 0600) and a read that
    # fails (EIO: the disk) are not damage to skip, as none of the segment's bytes were
    # read: an error whatever ``on_damage`` says.
    _spool(tmp_path / "mx")
    [source] = plan_segments([str(tmp_path / "mx")])
    for on_damage in ("error", "skip"):
        fs = FaultFS()
        fs.fail("open", err=errno.EACCES)
        with pytest.raises(SegmentUnreadable, match="Permission denied; its owner or mode"):
            list(segment_rows(source, on_damage=on_damage, fs=fs))
        fs = FaultFS()
        fs.fail("pread", err=errno.EIO)
        with pytest.raises(SegmentUnreadable, match="Input/output error; the device failed"):
            list(segment_rows(source, on_damage=on_damage, fs=fs))
    # A directory under a segment's name is read as what it is: not a segment file.
    (tmp_path / "mx" / fmt.LOG_DIR / fmt.segment_name(2)).mkdir()
    with pytest.raises(CorruptSpool, match="not a segment file"):
        _rows([str(tmp_path / "mx")])


def test_files_in_the_log_directory_not_named_as_segments_are_not_read(tmp_path: Path) -> None:
    _spool(tmp_path / "mx")
    before = _rows([str(tmp_path / "mx")])
    log = tmp_path / "mx" / fmt.LOG_DIR
    [seg] = sorted(log.iterdir())
    (log / "README").write_text("the operator's notes")
    (log / (seg.name + ".bak")).write_bytes(seg.read_bytes())  # a copy: not read twice
    (log / "1.seg").write_bytes(b"not twenty digits")
    assert _rows([str(tmp_path / "mx")]) == before


def test_archived_segments_are_read_with_the_live_log(tmp_path: Path) -> None:
    root = tmp_path / "mx"
    _archiving_spool(root)
    archived = sorted((tmp_path / "archive").iterdir())
    assert archived, "the test needs retired segments in the archive"
    rows = _rows([str(root)])
    kinds = collections.Counter(r[KIND] for r in rows)
    assert kinds["accepted"] == kinds["delivered"] == kinds["finished"] == 40
    # The archive alone is a source too: what it holds, no more.
    alone = _rows([str(tmp_path / "archive")])
    assert 0 < len(alone) < len(rows)


def test_readable_end_stops_before_a_half_written_frame(tmp_path: Path) -> None:
    _spool(tmp_path / "mx")
    [source] = plan_segments([str(tmp_path / "mx")])
    [seg] = sorted((tmp_path / "mx" / fmt.LOG_DIR).iterdir())
    size = seg.stat().st_size
    end = readable_end(source)
    assert 0 < end <= size
    with open(seg, "ab") as f:
        f.write(b"\x01\x02\x03")
    assert readable_end(source) == end
    assert readable_end(source, end) == end  # looking on from there finds nothing new
    assert list(segment_rows(source, start=end)) == []


def test_the_core_and_the_command_line_import_no_spark() -> None:
    import subprocess
    import sys

    code = "import sys, spool, spool.cli; sys.exit('pyspark' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_segment_retired_into_the_archive_after_planning_is_read_there(tmp_path: Path) -> None:
    # A live spool's checkpoint may move a planned segment to its archive before a Spark
    # task reads it: the rows come from the archive, not silently nothing.
    root = tmp_path / "mx"
    with Spool.open(root, clock=FakeClock(), archive_dir="../archive", segment_size=4096) as sp:
        ids = [
            sp.accept("a@example.org", ["b@example.net"], b"x" * 300 + b"%d" % n) for n in range(40)
        ]
        plan = plan_segments([str(root)])  # while every segment is live
        deliver_all(sp)
        sp.checkpoint()  # retires the settled segments into the archive
    assert any(not (root / fmt.LOG_DIR / fmt.segment_name(s.segment)).exists() for s in plan)
    rows = [row for s in plan for row in segment_rows(s)]
    accepted = {r[4] for r in rows if r[KIND] == "accepted"}
    assert accepted == set(ids)


def _rows_by_cursor(source: SegmentSource, on_damage: str) -> list[tuple[object, ...]]:
    """The rows as ``LogCursor`` alone reads them, frame by frame: the reading that
    ``segment_rows``'s whole-segment loop must match (it hands over to the cursor at the
    first frame that is not whole and checked)."""
    path = os.path.join(source.log_dir, fmt.segment_name(source.segment))
    cursor = _cursor(FileSystem(), source, 0)
    end = Position(source.segment, os.path.getsize(path))
    rows: list[tuple[object, ...]] = []
    try:
        while (item := cursor.next(end)) is not None:
            pos, frame = item
            if isinstance(frame, Frame) and frame.type not in (fmt.T_BODY, fmt.T_PAD):
                record = rec.decode_stored(frame.type, frame.payload, path, pos.offset)
                rows.extend(record_rows(source.server, *pos, record))
    except CorruptSpool as exc:
        if on_damage != "skip":
            raise
        rows.append(_damage_row(source, exc))
    finally:
        cursor.close()
    return rows


def _outcome(read: Callable[..., list[tuple[object, ...]]], *args: object) -> object:
    try:
        return read(*args)
    except CorruptSpool as exc:
        return ("CorruptSpool", exc.path, exc.offset)


def _fast(source: SegmentSource, on_damage: str) -> list[tuple[object, ...]]:
    return list(segment_rows(source, on_damage=on_damage))


@pytest.mark.parametrize("durable", [True, False], ids=["all durable", "newest may be torn"])
def test_the_whole_segment_loop_reads_every_damaged_copy_as_the_cursor_does(
    tmp_path: Path, durable: bool
) -> None:
    # One byte flipped at a time, and the file cut at a time, all through a segment with
    # every kind of record: the same rows, the same torn tail, the same damage (file and
    # offset) as the frame-by-frame reader gives.
    root = tmp_path / "mx"
    clock = FakeClock()
    with Spool.open(root, clock=clock, retry_intervals=[60]) as sp:
        for n in range(6):
            sp.accept("a@example.org", ["b@example.net", "c@example.com"], b"body %d" % n)
        while (attempt := sp.claim()) is not None:
            with attempt:
                attempt.delivered(["b@example.net"], "250 2.0.0 ok")
                attempt.deferred(["c@example.com"], "451 4.7.1 greylisted")
        held = sp.accept("a@example.org", ["d@example.net"], b"held")
        sp.hold(held)
        if durable:
            sp.checkpoint()
    [seg] = sorted((root / fmt.LOG_DIR).iterdir())
    good = seg.read_bytes()
    [source] = plan_segments([str(root)])
    assert _outcome(_fast, source, "error") == _rows_by_cursor(source, "error")
    changes = [("flip", at) for at in range(fmt.SEGMENT_HEADER_SIZE, len(good), 5)]
    changes += [("cut", at) for at in range(fmt.SEGMENT_HEADER_SIZE, len(good), 37)]
    for change, at in changes:
        if change == "flip":
            damaged = bytearray(good)
            damaged[at] ^= 0x04
            seg.write_bytes(bytes(damaged))
        else:
            seg.write_bytes(good[:at])
        for on_damage in ("error", "skip"):
            fast = _outcome(_fast, source, on_damage)
            slow = _outcome(_rows_by_cursor, source, on_damage)
            assert fast == slow, (change, at, on_damage)


def test_a_segment_is_opened_once_and_read_through_that_descriptor(tmp_path: Path) -> None:
    # The whole-segment loop and the reader that takes over at a bad frame share one
    # descriptor: an open that fails once is an error, not retried quietly; a segment
    # retired into the archive while it is read still shows its damage; a slice with
    # nothing in it reads nothing; a ``stop`` past the file reads what there is.
    root = tmp_path / "mx"
    with Spool.open(root, clock=FakeClock(), archive_dir="../archive", segment_size=4096) as sp:
        for n in range(30):  # queued: every segment stays in the log
            sp.accept("a@example.org", ["b@example.net"], b"x" * 300 + b"%d" % n)
    source = plan_segments([str(root)])[0]
    assert source.newest != source.segment
    path = root / fmt.LOG_DIR / fmt.segment_name(source.segment)
    good = list(segment_rows(source))
    assert good and list(segment_rows(source, stop=10**12)) == good
    once = FaultFS()
    once.fail("open", sticky=False)
    with pytest.raises(SegmentUnreadable):
        list(segment_rows(source, fs=once))
    nothing = FaultFS()
    nothing.fail("pread")
    assert list(segment_rows(source, start=100, stop=100, fs=nothing)) == []

    damaged = bytearray(path.read_bytes())
    damaged[1000] ^= 0x10
    path.write_bytes(bytes(damaged))
    archive = tmp_path / "archive"
    archive.mkdir(exist_ok=True)

    class RetiredWhileRead(FileSystem):
        """Moves the segment into the archive (as a checkpoint of its owner would) once
        its bytes have been read."""

        def pread(self, fd: int, size: int, offset: int) -> bytes:
            data = super().pread(fd, size, offset)
            if path.exists() and size > fmt.SEGMENT_HEADER_SIZE:
                os.rename(path, archive / path.name)
            return data

    with pytest.raises(CorruptSpool, match=f"{path} at offset"):
        list(segment_rows(source, fs=RetiredWhileRead()))


@pytest.mark.parametrize("moment", ["file_size", "open"])
def test_a_segment_retired_just_before_it_is_opened_is_read_from_the_archive(
    tmp_path: Path, moment: str
) -> None:
    # The owner's checkpoint may move the segment between the look for it and its open
    # (or the look at its size): its rows come from the archive, not nothing.
    root = tmp_path / "mx"
    with Spool.open(root, clock=FakeClock(), archive_dir="../archive", segment_size=4096) as sp:
        for n in range(30):
            sp.accept("a@example.org", ["b@example.net"], b"x" * 300 + b"%d" % n)
    source = plan_segments([str(root)])[0]
    path = root / fmt.LOG_DIR / fmt.segment_name(source.segment)
    expected = list(segment_rows(source))
    archive = tmp_path / "archive"
    archive.mkdir(exist_ok=True)

    class RetiredAtThatMoment(FileSystem):
        def _retire(self, at: str) -> None:
            if at == moment and path.exists():
                os.rename(path, archive / path.name)

        def file_size(self, p: str) -> int:
            self._retire("file_size")
            return super().file_size(p)

        def open(self, p: str, flags: int, mode: int = 0o600) -> int:
            self._retire("open")
            return super().open(p, flags, mode)

    assert expected and list(segment_rows(source, fs=RetiredAtThatMoment())) == expected
    assert not path.exists()


def test_a_range_ending_inside_a_frame_after_a_body_is_named_as_the_reader_names_it(
    tmp_path: Path,
) -> None:
    """A review found it: the record frames were taken up to the last record, so the
    reader read the body after it again and, its buffer then ending inside the next
    frame, named that frame otherwise than the reader alone did. The reader now goes on
    from the first frame that is not whole. (It never reads past its limit either, since
    bytes there may be zeros written ahead that a batch is about to replace: a frame the
    range cuts is "truncated" wherever its buffer ended.)"""
    salt, number = 0x1234, 5
    envelope = rec.Envelope("6AE6B9F44CDD92C4", "a@b", ("x@y",), 1.0, 1.0, rec.BodyRef("inline", 9))
    data = bytearray(segment_header(number, salt)) + encode_frame(*rec.encode(envelope), salt)
    body_size = 256 * 1024 - 50 - fmt.FRAME_HEADER_SIZE - fmt.MSG_ID_LENGTH  # ends 50 bytes
    data += encode_frame(fmt.T_BODY, rec.encode_body(envelope.msg_id, bytes(body_size)), salt)
    delta_at = len(data)  # before the end of the reader's first chunk, crossing it
    delta = rec.Delta(envelope.msg_id, "delivered", ("x@y",), "250 " + "o" * 200, 2.0)
    data += encode_frame(*rec.encode(delta), salt)
    (tmp_path / fmt.segment_name(number)).write_bytes(data)
    source = SegmentSource("mx1", str(tmp_path), number, None, (number + 1, 0))
    stop = delta_at + 100  # a range that ends inside the delta
    cursor = _cursor(FileSystem(), source, 0)
    with pytest.raises(CorruptSpool) as by_reader:
        while cursor.next(Position(number, stop)) is not None:
            pass
    cursor.close()
    with pytest.raises(CorruptSpool) as by_rows:
        list(segment_rows(source, start=0, stop=stop))
    assert (by_rows.value.offset, by_rows.value.reason) == (delta_at, by_reader.value.reason)
    assert by_reader.value.reason == "truncated frame (100 of 275 bytes)"


def _reader_alone(cursor: LogCursor, stop: int) -> list[object]:
    segment = cursor.position.segment
    got: list[object] = []
    try:
        while (item := cursor.next(Position(segment, stop))) is not None:
            pos, frame = item
            if isinstance(frame, Frame) and frame.type not in (fmt.T_BODY, fmt.T_PAD):
                got.append((pos.offset, frame.type, frame.payload))
        got.append(("end", cursor.torn))
    except CorruptSpool as exc:
        got.append(("damage", exc.offset, exc.reason))
    return got


def _whole_segment(cursor: LogCursor, stop: int) -> list[object]:
    got: list[object] = []
    try:
        got.extend(cursor.segment_frames(stop))
        got.append(("end", cursor.torn))
    except CorruptSpool as exc:
        got.append(("damage", exc.offset, exc.reason))
    return got


def test_segment_frames_give_what_the_reader_alone_gives_for_any_bytes_and_range(
    tmp_path: Path,
) -> None:
    """Records, bodies and padding; flipped bits, cuts, a zeroed sector, garbage after;
    any start, stop, newest segment and durable end: the record frames, the torn tail
    and the damage (its offset and reason) are the reader's own."""
    rng = random.Random(43)
    for case in range(300):
        directory = tmp_path / str(case)
        directory.mkdir()
        salt, number = rng.getrandbits(32) | 1, rng.randint(1, 9)
        data = bytearray(segment_header(number, salt))
        for _ in range(rng.randint(0, 20)):
            kind = rng.random()
            if kind < 0.6:
                reply = "250 " + "o" * rng.randrange(300)
                delta = rec.Delta(f"{rng.getrandbits(64):016X}", "delivered", ("x@y",), reply, 2.0)
                data += encode_frame(*rec.encode(delta), salt)
            elif kind < 0.85:
                size = rng.choice([10, 100, 5000, 262_000])
                data += encode_frame(fmt.T_BODY, rec.encode_body("0" * 16, bytes(size)), salt)
            else:
                data += encode_frame(fmt.T_PAD, bytes(rng.choice([0, 7, 16, 4000])), salt)
        change = rng.random()
        if change < 0.3 and len(data) > 32:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(32, len(data))] ^= 1 << rng.randrange(8)
        elif change < 0.5:
            del data[rng.randrange(32, len(data) + 1) :]
        elif change < 0.6 and len(data) > 600:
            at = rng.randrange(32, len(data) - 512)
            data[at : at + 512] = bytes(512)
        elif change < 0.7:
            data += bytes(rng.randrange(1, 600))
        (directory / fmt.segment_name(number)).write_bytes(data)
        start = rng.choice([0, fmt.SEGMENT_HEADER_SIZE])
        stop = rng.choice([len(data), len(data) + 100, rng.randrange(0, len(data) + 1)])
        newest = rng.choice([None, number, number + 1])
        durable = rng.choice(
            [None, Position(number + 1, 0), Position(number, rng.randrange(0, len(data) + 1))]
        )
        results = []
        for read in (_reader_alone, _whole_segment):
            cursor = LogCursor(
                FileSystem(), str(directory), Position(number, start),
                durable_end=durable, newest_segment=newest, skip_bodies=True,
            )  # fmt: skip
            try:
                results.append(read(cursor, stop))
            finally:
                cursor.close()
        assert results[0] == results[1], (case, start, stop, newest, durable)
