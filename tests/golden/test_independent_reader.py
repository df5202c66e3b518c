"""docs/format.md is enough to read a spool: a reader written from it alone reads real traffic.

Goal: prove the format specification complete and correct. The reader below is written
only from docs/format.md, with ``struct``, ``cbor2`` and ``crc32c``; it imports nothing of
the spool's framing, record or reader code (the spool is used only to produce the data,
through its public API). Method: real traffic on a real spool in a temporary directory
(inline and file bodies, deliveries, failures, deferrals and retries, a hold, segment
rollovers, retired segments moved to an archive), then every segment file parsed, every
CRC checked, every record decoded and compared with what the API was told, every body read
back, and the restart-positions file parsed. A second part damages copies of the log and
checks that the reader's torn-tail-versus-corruption rules agree with the spool's recovery.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
import pytest
from crc32c import crc32c

from spool import Spool
from spool.testing import FakeClock

# --- the independent reader: every number below is from docs/format.md ------------------

SECTOR = 512
SEGMENT_HEADER = struct.Struct("<8sIIQII")  # magic version header_size number salt crc
VERSIONS = {1, 2}  # a version 1 segment's salt is 0
SEGMENT_HEADER_SIZE = 32
FRAME_HEADER = struct.Struct("<IIB")  # crc length type
FRAME_HEADER_SIZE = 9
FRAME_PAYLOAD_MAX = 8 * 1024 * 1024
BODY_HEADER = struct.Struct("<8sIIQII")  # magic version reserved length data_crc crc
BODY_HEADER_SIZE = 32
MSG_ID_LENGTH = 16
ENVELOPE, BODY, START, DELTA, FINISH, CONTROL, PAD = 1, 2, 3, 4, 5, 6, 15
FRAME_TYPES = {ENVELOPE, BODY, START, DELTA, FINISH, CONTROL, PAD}

Pos = tuple[int, int]  # (segment number, offset in the segment file)


class Damage(Exception):
    """Bad bytes that the rules of docs/format.md classify as corruption."""


@dataclass(frozen=True)
class RawFrame:
    """One frame as found on disk, CRC checked unless it is a skipped BODY frame."""

    at: Pos
    type: int
    length: int
    payload: bytes | None  # None: a BODY frame stepped over without reading it

    @property
    def end(self) -> Pos:
        return (self.at[0], self.at[1] + FRAME_HEADER_SIZE + self.length)


@dataclass
class Log:
    """What the reader found: frames in order, and where a torn tail starts (if any)."""

    frames: list[RawFrame] = field(default_factory=list)
    torn_at: Pos | None = None
    segments: list[int] = field(default_factory=list)

    def records(self) -> Iterator[tuple[RawFrame, dict[str, Any]]]:
        """Every record frame with its decoded CBOR map (BODY and PAD frames left out)."""
        for frame in self.frames:
            if frame.type in (BODY, PAD):
                continue
            assert frame.payload is not None
            obj = cbor2.loads(frame.payload)
            assert isinstance(obj, dict) and all(isinstance(k, str) for k in obj)
            yield frame, obj


def segment_number(name: str) -> int | None:
    """The number of a segment file name (20 digits + ``.seg``), else None."""
    stem, dot, ext = name.partition(".")
    if dot and ext == "seg" and len(stem) == 20 and stem.isdigit() and int(stem) > 0:
        return int(stem)
    return None


def segment_files(*dirs: Path) -> dict[int, Path]:
    """Segment number -> file, over ``log/`` and an archive directory."""
    found: dict[int, Path] = {}
    for d in dirs:
        for name in os.listdir(d):
            number = segment_number(name)
            if number is not None:
                found[number] = d / name
    return found


def check_segment_header(data: bytes, number: int) -> str | None:
    """None for a valid header of segment ``number``, else what is wrong."""
    if len(data) < SEGMENT_HEADER_SIZE:
        return "short header"
    magic, version, size, seg, _salt, crc = SEGMENT_HEADER.unpack_from(data)
    if crc32c(data[:28]) != crc:
        return "header CRC"
    if magic != b"SPOOLLOG" or version not in VERSIONS:
        return "header fields"
    if size != SEGMENT_HEADER_SIZE or seg != number:
        return "header fields"
    return None


def salt_of(data: bytes) -> int:
    """The salt a segment's frame CRCs start from (0 for version 1)."""
    _magic, version, _size, _seg, salt, _crc = SEGMENT_HEADER.unpack_from(data)
    return 0 if version == 1 else int(salt)


def frame_at(data: bytes, offset: int, salt: int) -> tuple[int, int, bytes] | None:
    """(type, length, payload) of a valid frame at ``offset``, or None for bad bytes."""
    if offset + FRAME_HEADER_SIZE > len(data):
        return None
    crc, length, ftype = FRAME_HEADER.unpack_from(data, offset)
    end = offset + FRAME_HEADER_SIZE + length
    if ftype not in FRAME_TYPES or length > FRAME_PAYLOAD_MAX or end > len(data):
        return None
    if crc32c(data[offset + 4 : end], salt) != crc:  # length, type and payload, salted
        return None
    return ftype, length, data[offset + FRAME_HEADER_SIZE : end]


def looks_torn(data: bytes, offset: int, salt: int) -> bool:
    """Rules 4 and 5 of "Torn tail or corruption": a valid frame at a later sector boundary
    (before an all-zero sector) means damage; otherwise the bad frame must show a tear."""
    b = offset - offset % SECTOR
    while b < len(data) and data[b : b + SECTOR].strip(b"\0"):
        if b > offset and frame_at(data, b, salt) is not None:
            return False
        b += SECTOR
    if offset + FRAME_HEADER_SIZE > len(data) or zero_sector(data, offset, 9):
        return True
    length = FRAME_HEADER.unpack_from(data, offset)[1]
    if length > FRAME_PAYLOAD_MAX:
        return False
    end = offset + FRAME_HEADER_SIZE + length
    inside = range(offset + 1, min(end, len(data)))
    if any(frame_at(data, o, salt) is not None for o in inside):
        return False
    return end > len(data) or zero_sector(data, offset, end - offset)


def zero_sector(data: bytes, offset: int, size: int) -> bool:
    """Whether a sector overlapping ``size`` bytes at ``offset`` is all zero from ``offset``."""
    b = offset - offset % SECTOR
    while b < min(offset + size, len(data)):
        if not data[max(b, offset) : b + SECTOR].strip(b"\0"):
            return True
        b += SECTOR
    return False


def classify(at: Pos, why: str, data: bytes, salt: int, durable: Pos, newest: bool) -> None:
    """Return quietly if bad bytes at ``at`` are a torn tail; raise ``Damage`` if not."""
    if at < durable or not newest:
        raise Damage(f"{at}: {why}")
    if at[1] < SEGMENT_HEADER_SIZE and data[:SECTOR].strip(b"\0"):
        raise Damage(f"{at}: {why}, in a header sector that was written")
    if at[1] >= SEGMENT_HEADER_SIZE and not looks_torn(data, at[1], salt):
        raise Damage(f"{at}: {why}, and valid frames follow")


def read_log(files: dict[int, Path], durable_end: Pos | None) -> Log:
    """Read every frame of every segment, checking every CRC (rules 1-4 on bad bytes)."""
    numbers = sorted(files)
    assert numbers == list(range(numbers[0], numbers[-1] + 1)), "segment numbers have a gap"
    durable = durable_end if durable_end is not None else (numbers[0], 0)
    log = Log(segments=numbers)
    for number in numbers:
        data = files[number].read_bytes()
        newest = number == numbers[-1]
        problem = check_segment_header(data, number)
        if problem is not None:
            classify((number, 0), problem, data, 0, durable, newest)
            log.torn_at = (number, 0)
            break
        salt = salt_of(data)
        offset = SEGMENT_HEADER_SIZE
        while offset < len(data):
            found = frame_at(data, offset, salt)
            if found is None:
                classify((number, offset), "bad frame", data, salt, durable, newest)
                log.torn_at = (number, offset)
                break
            ftype, length, payload = found
            log.frames.append(RawFrame((number, offset), ftype, length, payload))
            offset += FRAME_HEADER_SIZE + length
    return log


def frames_skipping_bodies(files: dict[int, Path]) -> Iterator[RawFrame]:
    """Walk the log reading only frame headers for BODY frames ("Stepping over BODY frames")."""
    for number in sorted(files):
        with open(files[number], "rb") as f:
            size = os.fstat(f.fileno()).st_size
            salt = salt_of(f.read(SEGMENT_HEADER_SIZE))
            offset = SEGMENT_HEADER_SIZE
            while offset < size:
                f.seek(offset)
                header = f.read(FRAME_HEADER_SIZE)
                crc, length, ftype = FRAME_HEADER.unpack(header)
                assert ftype in FRAME_TYPES and length <= FRAME_PAYLOAD_MAX
                assert offset + FRAME_HEADER_SIZE + length <= size
                if ftype == BODY:
                    yield RawFrame((number, offset), ftype, length, None)
                else:
                    payload = f.read(length)
                    assert crc32c(header[4:] + payload, salt) == crc
                    yield RawFrame((number, offset), ftype, length, payload)
                offset += FRAME_HEADER_SIZE + length


def read_body_file(path: Path) -> bytes:
    """The data of a body file, after checking its header and data CRCs."""
    raw = path.read_bytes()
    magic, version, _reserved, length, data_crc, crc = BODY_HEADER.unpack_from(raw)
    assert crc32c(raw[:28]) == crc and magic == b"SPOOLBDY" and version in VERSIONS
    data = raw[BODY_HEADER_SIZE:]
    assert len(data) == length and crc32c(data) == data_crc
    return data


def read_positions(path: Path) -> dict[str, Any]:
    """The restart positions: two ASCII lines, JSON then ``crc32c <8 hex>``."""
    line, crc_line, rest = path.read_bytes().decode("ascii").split("\n", 2)
    assert rest == "" and crc_line == f"crc32c {crc32c(line.encode()):08x}"
    obj = json.loads(line)
    assert isinstance(obj, dict) and obj["version"] == 1
    return obj


def pos(obj: Any) -> Pos:
    """A position from its CBOR/JSON form ``[segment, offset]``."""
    assert isinstance(obj, list) and len(obj) == 2
    return (int(obj[0]), int(obj[1]))


# --- producing a spool with real traffic ------------------------------------------------

INLINE_MAX = 4096
INTERVALS = (60.0, 300.0)


@dataclass
class Expected:
    """What the API was told, per message."""

    sender: str
    recipients: tuple[str, ...]
    data: bytes
    deltas: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)
    final: dict[str, tuple[str, str]] = field(default_factory=dict)
    held: str | None = None
    claims: int = 0


def body_for(i: int) -> bytes:
    """Message data; every third message is larger than ``inline_body_max``."""
    size = 10_000 + 997 * i if i % 3 == 0 else 100 + 37 * i
    return bytes((i * 131 + j * 7) % 256 for j in range(size))


def produce(root: Path) -> dict[str, Expected]:
    """Run traffic through the public API and return what it was told."""
    clock = FakeClock()
    expected: dict[str, Expected] = {}
    with Spool.open(
        root / "spool",
        clock=clock,
        segment_size=4096,
        inline_body_max=INLINE_MAX,
        retry_intervals=INTERVALS,
        archive_dir=root / "archive",
    ) as sp:
        for i in range(12):
            rcpts = tuple(f"r{i}.{k}@example.net" for k in range(1 + i % 3))
            sender = "" if i == 5 else f"sender{i}@example.org"
            data = body_for(i)
            expected[sp.accept(sender, rcpts, data)] = Expected(sender, rcpts, data)
            clock.advance(0.25)
        ids = list(expected)
        held_id = ids[4]
        sp.hold(held_id, "held for the format test")
        expected[held_id].held = "held for the format test"
        # Round 1: the first recipient delivered, the second failed, the third deferred;
        # messages 0 and 9 (file bodies) are deferred whole.
        while (attempt := sp.claim()) is not None:
            e = expected[attempt.msg_id]
            e.claims += 1
            with attempt:
                rcpts = attempt.envelope.recipients
                if attempt.msg_id in (ids[0], ids[9]):
                    plan = [("deferred", rcpts, "451 4.7.1 greylisted, try again later")]
                else:
                    plan = [
                        ("delivered", rcpts[:1], f"250 2.0.0 ok queued as Q{attempt.msg_id}"),
                        ("failed", rcpts[1:2], "550 5.1.1 no such user"),
                        ("deferred", rcpts[2:], "421 4.4.2 connection timed out"),
                    ]
                for status, who, reply in plan:
                    if not who:
                        continue
                    getattr(attempt, status)(list(who), reply)
                    e.deltas.append((status, tuple(who), reply))
                    if status != "deferred":
                        e.final.update(dict.fromkeys(who, (status, reply)))
        # Round 2, once the first retry interval has passed: deliver what was deferred,
        # except message 0, which is deferred again and stays live with its body file.
        clock.advance(INTERVALS[0] + 1)
        while (attempt := sp.claim()) is not None:
            e = expected[attempt.msg_id]
            e.claims += 1
            with attempt:
                who = attempt.envelope.recipients
                if attempt.msg_id == ids[0]:
                    status, reply = "deferred", "452 4.2.2 mailbox full"
                else:
                    status, reply = "delivered", "250 2.0.0 ok on retry"
                getattr(attempt, status)(list(who), reply)
                e.deltas.append((status, tuple(who), reply))
                if status != "deferred":
                    e.final.update(dict.fromkeys(who, (status, reply)))
    return expected


# --- the tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Expected]]:
    """One spool with traffic, shared by the tests of this module (they only read it)."""
    root = tmp_path_factory.mktemp("independent")
    return root, produce(root)


def read_all(root: Path) -> tuple[Log, dict[int, Path], dict[str, Any]]:
    """The whole log (archive and ``log/``) read up to the positions' durable end."""
    positions = read_positions(root / "spool" / "positions")
    files = segment_files(root / "archive", root / "spool" / "log")
    return read_log(files, pos(positions["consistent"])), files, positions


def test_every_segment_parses_and_every_frame_crc_verifies(
    traffic: tuple[Path, dict[str, Expected]],
) -> None:
    root, _ = traffic
    log, files, _ = read_all(root)
    assert log.torn_at is None
    assert len(log.segments) >= 3, "the small segment_size should have rolled the log over"
    assert os.listdir(root / "archive"), "retired segments should have been archived"
    newest = files[log.segments[-1]]
    assert newest.stat().st_size % SECTOR == 0
    for frame in log.frames:
        assert frame.payload is not None
        if frame.type == PAD:
            assert frame.payload == bytes(frame.length)
            assert frame.end[1] % SECTOR == 0, "a PAD frame ends a batch on a sector boundary"
    # Each segment's frames tile the file exactly from offset 32 to its end.
    for number in log.segments:
        ends = [f.end[1] for f in log.frames if f.at[0] == number]
        starts = [f.at[1] for f in log.frames if f.at[0] == number]
        assert starts == [SEGMENT_HEADER_SIZE, *ends[:-1]]
        assert ends[-1] == files[number].stat().st_size


def test_stepping_over_body_frames_by_their_length_finds_the_same_records(
    traffic: tuple[Path, dict[str, Expected]],
) -> None:
    root, _ = traffic
    log, files, _ = read_all(root)
    skipped = list(frames_skipping_bodies(files))
    assert [(f.at, f.type, f.length) for f in skipped] == [
        (f.at, f.type, f.length) for f in log.frames
    ]
    assert [f.payload for f in skipped if f.type != BODY] == [
        f.payload for f in log.frames if f.type != BODY
    ]
    assert any(f.type == BODY for f in skipped)


def test_decoded_records_match_what_the_api_was_told(
    traffic: tuple[Path, dict[str, Expected]],
) -> None:
    root, expected = traffic
    log, _, _ = read_all(root)
    by_pos = {f.at: obj for f, obj in log.records()}
    frames = {f.at: f for f in log.frames}
    first: dict[str, dict[str, Any]] = {}
    deltas: dict[str, list[tuple[str, tuple[str, ...], str]]] = {m: [] for m in expected}
    starts: dict[str, int] = dict.fromkeys(expected, 0)
    finishes: dict[str, dict[str, Any]] = {}
    for frame, obj in log.records():
        msg_id: str = obj.get("id", "")
        if frame.type == ENVELOPE:
            e = expected[msg_id]
            assert obj["from"] == e.sender and obj["acc"] > 0 and obj["ts"] >= obj["acc"]
            assert obj["id"][:8] == f"{int(obj['acc']) & 0xFFFFFFFF:08X}"
            assert set(obj["to"]) <= set(e.recipients)
            if "sup" not in obj:
                assert msg_id not in first and obj["att"] == 0 and obj["cls"] == 0
                assert tuple(obj["to"]) == e.recipients
                first[msg_id] = obj
            else:
                superseded = by_pos[pos(obj["sup"])]
                assert frames[pos(obj["sup"])].type == ENVELOPE and superseded["id"] == msg_id
            if "held" in obj:
                assert obj["held"] == e.held and obj["cls"] == len(INTERVALS)
        elif frame.type == START:
            starts[msg_id] += 1
            env_at = pos(obj["env"])
            assert frames[env_at].type == ENVELOPE and by_pos[env_at]["id"] == msg_id
        elif frame.type == DELTA:
            deltas[msg_id].append((obj["st"], tuple(obj["to"]), obj["reply"]))
        elif frame.type == FINISH:
            finishes[msg_id] = obj
        else:
            assert frame.type == CONTROL, frame
    assert set(first) == set(expected)
    for msg_id, e in expected.items():
        assert deltas[msg_id] == e.deltas, msg_id
        assert starts[msg_id] == e.claims, msg_id
        if msg_id in finishes:
            out = {r: (st, reply) for r, st, reply, _at in finishes[msg_id]["out"]}
            assert out == e.final and set(out) == set(e.recipients)
            assert finishes[msg_id]["why"] == "all recipients settled"
    live = set(expected) - set(finishes)
    held = {m for m, e in expected.items() if e.held}
    assert held <= live and len(live) == 2, "the held message and message 0 stay queued"
    statuses = {st for e in expected.values() for st, _, _ in e.deltas}
    assert statuses == {"delivered", "failed", "deferred"}


def test_bodies_read_back_equal_the_accepted_data(
    traffic: tuple[Path, dict[str, Expected]],
) -> None:
    root, expected = traffic
    log, _, _ = read_all(root)
    frames = {f.at: f for f in log.frames}
    latest: dict[str, dict[str, Any]] = {}
    finished: set[str] = set()
    kinds: set[str] = set()
    for frame, obj in log.records():
        if frame.type == ENVELOPE:
            latest[obj["id"]] = obj
            if "sup" not in obj:
                body = obj["body"]
                e = expected[obj["id"]]
                assert body["n"] == len(e.data)
                assert body["k"] == ("inline" if len(e.data) <= INLINE_MAX else "file")
                kinds.add(body["k"])
                if body["k"] == "inline":
                    nxt = frames[frame.end]  # the BODY frame follows its first envelope
                    assert nxt.type == BODY and nxt.payload is not None
                    assert nxt.payload[:MSG_ID_LENGTH] == obj["id"].encode("ascii")
                    assert nxt.payload[MSG_ID_LENGTH:] == e.data
            if "prom" in obj:  # promoted: the old BODY frame still holds the same data
                promoted = frames[pos(obj["prom"])]
                assert promoted.type == BODY and promoted.payload is not None
                assert promoted.payload[MSG_ID_LENGTH:] == expected[obj["id"]].data
        elif frame.type == FINISH:
            finished.add(obj["id"])
    assert kinds == {"inline", "file"}
    body_dir = root / "spool" / "bodies"
    for msg_id, env in latest.items():
        body = env["body"]
        if msg_id in finished:
            assert not (body_dir / msg_id).exists(), "a finished message's body file is gone"
        elif body["k"] == "file":
            assert read_body_file(body_dir / msg_id) == expected[msg_id].data
        else:
            frame = frames[pos(body["at"])]
            assert frame.payload is not None
            assert frame.payload[MSG_ID_LENGTH:] == expected[msg_id].data
    assert sorted(os.listdir(body_dir)) == sorted(
        m for m, env in latest.items() if m not in finished and env["body"]["k"] == "file"
    )


def test_restart_positions_parse_and_point_into_the_log(
    traffic: tuple[Path, dict[str, Expected]],
) -> None:
    root, _ = traffic
    log, _, positions = read_all(root)
    frame_starts = {f.at for f in log.frames} | {log.frames[-1].end}
    assert pos(positions["consistent"]) in frame_starts
    assert len(positions["cursors"]) == len(INTERVALS) + 1
    assert positions["retry_intervals"] == list(INTERVALS)
    log_segments = {segment_number(n) for n in os.listdir(root / "spool" / "log")}
    assert pos(positions["front"])[0] <= min(s for s in log_segments if s is not None)
    for key in ("working_start", "front", "outcome_front"):
        assert pos(positions[key]) <= pos(positions["consistent"])
    for p in positions["superseded"]:
        assert pos(p) in frame_starts
    assert all(int(seg) in log.segments and n > 0 for seg, n in positions["body_refs"].items())
    lock = (root / "spool" / "lock").read_text()
    assert lock == "" or lock.strip().isdigit()


def copy_spool(root: Path, to: Path) -> Path:
    """A copy of the produced spool with every segment in ``log/`` (archive put back)."""
    shutil.copytree(root / "spool", to)
    for name in os.listdir(root / "archive"):
        shutil.copy(root / "archive" / name, to / "log" / name)
    return to


def test_a_torn_last_batch_is_found_where_recovery_cuts_it(
    traffic: tuple[Path, dict[str, Expected]], tmp_path: Path
) -> None:
    root, _ = traffic
    copy = copy_spool(root, tmp_path / "torn")
    files = segment_files(copy / "log")
    newest = files[max(files)]
    torn_at = newest.stat().st_size
    # An interrupted batch: its first sector written (a frame header promising more than
    # that sector holds, and the start of the payload), its second sector not (zeros).
    partial = (FRAME_HEADER.pack(0x12345678, 900, ENVELOPE) + b"\xa8partial" * 63)[:SECTOR]
    assert len(partial) == SECTOR
    with open(newest, "ab") as f:
        f.write(partial + bytes(SECTOR))
    durable = pos(read_positions(copy / "positions")["consistent"])
    log = read_log(files, durable)
    assert log.torn_at == (max(files), torn_at)
    with Spool.open(copy, clock=FakeClock(), retry_intervals=INTERVALS) as sp:
        cut = sp.recovery.torn_at
        assert cut is not None and (cut.segment, cut.offset) == log.torn_at
    assert newest.stat().st_size == torn_at
    quarantined = (copy / "corrupt" / f"{newest.name}.{torn_at}.torn").read_bytes()
    assert quarantined.startswith(partial)


def test_damage_before_the_durable_end_or_in_an_older_segment_is_corruption(
    traffic: tuple[Path, dict[str, Expected]], tmp_path: Path
) -> None:
    root, _ = traffic
    copy = copy_spool(root, tmp_path / "flipped")
    files = segment_files(copy / "log")
    log = read_log(files, None)
    victim = next(f for f in log.frames if f.type == ENVELOPE)
    assert victim.at[0] < max(files)
    path = files[victim.at[0]]
    original = path.read_bytes()
    path.write_bytes(flip(original, victim.at[1] + FRAME_HEADER_SIZE + 3))
    with pytest.raises(Damage):
        read_log(files, None)  # in an older segment: corruption even with no durable end
    path.write_bytes(original)
    newest = files[max(files)]
    last_record = [f for f in log.frames if f.at[0] == max(files) and f.type != PAD][-1]
    durable = pos(read_positions(copy / "positions")["consistent"])
    assert last_record.at < durable
    newest.write_bytes(flip(newest.read_bytes(), last_record.at[1] + FRAME_HEADER_SIZE))
    with pytest.raises(Damage):
        read_log(files, durable)  # in the newest segment but before the durable end


def flip(data: bytes, offset: int) -> bytes:
    """``data`` with one bit flipped at ``offset``."""
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1 :]
