"""Edges of recovery: damage no crash explains, and records only a crash leaves behind.

Each test builds a real spool with ``Spool``, then appends frames by hand to a segment file
the way the writer does (one write at the end of the file, padded to a sector, then
fdatasync), and opens the spool again. Checked frames that make no sense must stop the
open with ``CorruptSpool`` naming the file and offset, and leave the log as it was; what a
crash can leave (a torn tail, a durable record the positions do not know yet) is recovered.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import attrs
import cbor2
import pytest

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.errors import CorruptSpool
from spool.framing import Frame, encode_frame, padding_for
from spool.fs import FileSystem
from spool.options import SpoolOptions, store_settings
from spool.positions import load_positions, store_positions
from spool.reader import LogCursor, SkippedBody
from spool.records import Position
from spool.recovery import FINISH_LOST_REASON, RecoveredState, _incoming_files, recover
from spool.segment_header import segment_header, segment_salt
from spool.testing import FakeClock

FS = FileSystem()
LONE_ID = "6B0357990E172DB3"  # the id of a message that was never accepted here


def segment_path(spool_dir: str, number: int) -> str:
    return os.path.join(spool_dir, fmt.LOG_DIR, fmt.segment_name(number))


def newest_segment(spool_dir: str) -> int:
    names = os.listdir(os.path.join(spool_dir, fmt.LOG_DIR))
    return max(n for n in map(fmt.parse_segment_name, names) if n is not None)


def salt_of(path: str) -> int:
    """The salt of an existing segment's frames."""
    with open(path, "rb") as f:
        return segment_salt(f.read(fmt.SEGMENT_HEADER_SIZE))


def frame_of(record: rec.Record, path: str) -> bytes:
    """``record`` framed for the segment file at ``path`` (with its salt)."""
    return encode_frame(*rec.encode(record), salt_of(path))


def append_batch(path: str, frames: bytes, *, pad: bool = True) -> int:
    """Append ``frames`` at the end of a segment file as one synced write; their offset.

    ``pad`` adds the PAD frame the writer ends every batch with; without it the file ends
    right after ``frames``.
    """
    fd = FS.open(path, os.O_WRONLY)
    try:
        offset = FS.size(fd)
        data = frames + (padding_for(offset + len(frames), salt_of(path)) if pad else b"")
        FS.pwrite(fd, data, offset)
        FS.fdatasync(fd)
    finally:
        FS.close(fd)
    return offset


NEW_SALT = 0x5A17F00D  # the salt of segments these tests create


def create_segment(spool_dir: str, number: int, data: bytes = b"") -> str:
    """A new segment file: its header (salt ``NEW_SALT``), then ``data``, synced with its
    directory entry."""
    path = segment_path(spool_dir, number)
    fd = FS.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        FS.pwrite(fd, segment_header(number, NEW_SALT) + data, 0)
        FS.fdatasync(fd)
    finally:
        FS.close(fd)
    FS.fsync_dir(os.path.dirname(path))
    return path


def frames_in(spool_dir: str, segment: int) -> list[tuple[Position, Frame]]:
    """Every frame of one segment, with its position."""
    log_dir = os.path.join(spool_dir, fmt.LOG_DIR)
    cursor = LogCursor(FS, log_dir, Position(segment, 0), newest_segment=segment)
    try:
        out = []
        for pos, frame in cursor:
            if pos.segment != segment:
                break
            assert not isinstance(frame, SkippedBody)
            out.append((pos, frame))
        return out
    finally:
        cursor.close()


def envelope_at(spool_dir: str, segment: int, msg_id: str) -> tuple[Position, Position]:
    """Positions of the first envelope of ``msg_id`` and of the BODY frame after it."""
    for (pos, frame), (body_pos, _body) in itertools.pairwise(frames_in(spool_dir, segment)):
        record = rec.decode(frame.type, frame.payload) if frame.type == fmt.T_ENVELOPE else None
        if isinstance(record, rec.Envelope) and record.msg_id == msg_id:
            return pos, body_pos
    raise AssertionError(f"no envelope of {msg_id} in segment {segment}")


def first_envelope(msg_id: str, clock: FakeClock) -> rec.Envelope:
    """An envelope as ``accept`` writes it: its BODY frame must follow it directly."""
    return rec.Envelope(
        msg_id=msg_id,
        sender="a@example.org",
        recipients=("b@example.net",),
        accepted_at=clock(),
        written_at=clock(),
        body=rec.BodyRef(rec.BODY_INLINE, 5),
    )


def accepted_spool(spool_dir: str, clock: FakeClock, count: int = 1) -> list[str]:
    """A closed spool holding ``count`` accepted messages; their ids."""
    with Spool.open(spool_dir, clock=clock) as sp:
        return [sp.accept("a@example.org", [f"r{i}@example.net"], b"hello") for i in range(count)]


def recover_dry(spool_dir: str, clock: FakeClock) -> RecoveredState:
    return recover(FS, spool_dir, options=SpoolOptions(), clock=clock, dry_run=True)


def assert_corrupt_at(spool_dir: str, clock: FakeClock, path: str, offset: int, why: str) -> None:
    """Opening fails naming ``path`` and ``offset``; the log on disk is left as it was."""
    log = Path(spool_dir, fmt.LOG_DIR)
    before = {p.name: p.read_bytes() for p in log.iterdir()}
    for _ in range(2):  # the failed open released the spool: the next one fails the same way
        with pytest.raises(CorruptSpool) as info:
            Spool.open(spool_dir, clock=clock)
        assert (info.value.path, info.value.offset) == (path, offset)
        assert why in info.value.reason
        assert path in str(info.value) and f"offset {offset}" in str(info.value)
    assert {p.name: p.read_bytes() for p in log.iterdir()} == before


# --- a first envelope without its body -----------------------------------------------------


def test_a_first_envelope_followed_by_a_frame_other_than_its_body_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    accepted_spool(spool_dir, clock)
    path = segment_path(spool_dir, newest_segment(spool_dir))
    # The envelope and the PAD that ends its batch: a tear can lose frames at the end of
    # a batch, never one in the middle, so this is damage even after the durable end.
    at = append_batch(path, frame_of(first_envelope(LONE_ID, clock), path))
    assert_corrupt_at(spool_dir, clock, path, at, "envelope without its body")


def test_a_first_envelope_whose_body_frame_opens_the_next_segment_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    accepted_spool(spool_dir, clock)
    last = newest_segment(spool_dir)
    path = segment_path(spool_dir, last)
    at = append_batch(path, frame_of(first_envelope(LONE_ID, clock), path), pad=False)
    body = encode_frame(fmt.T_BODY, rec.encode_body(LONE_ID, b"hello"), NEW_SALT)
    pad = padding_for(fmt.SEGMENT_HEADER_SIZE + len(body), NEW_SALT)
    create_segment(spool_dir, last + 1, body + pad)
    # An envelope and its body are one piece of one batch: a frame never spans segments.
    assert_corrupt_at(spool_dir, clock, path, at, "envelope without its body")


def test_a_first_envelope_ending_an_older_segment_is_corrupt_not_a_torn_tail(
    spool_dir: str, clock: FakeClock
) -> None:
    accepted_spool(spool_dir, clock)
    last = newest_segment(spool_dir)
    path = segment_path(spool_dir, last)
    at = append_batch(path, frame_of(first_envelope(LONE_ID, clock), path), pad=False)
    # A newer segment whose only batch was torn away (zeros after its header): the older
    # segment was fully synced before it was created (W3), so its last frame is no tear.
    create_segment(spool_dir, last + 1, bytes(fmt.SECTOR - fmt.SEGMENT_HEADER_SIZE))
    assert_corrupt_at(spool_dir, clock, path, at, "envelope without its body")


def test_a_first_envelope_ending_the_log_before_the_durable_end_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    accepted_spool(spool_dir, clock)
    path = segment_path(spool_dir, newest_segment(spool_dir))
    at = append_batch(path, frame_of(first_envelope(LONE_ID, clock), path), pad=False)
    positions = load_positions(FS, spool_dir)
    assert positions is not None and positions.consistent <= Position(newest_segment(spool_dir), at)
    # Positions vouching for the envelope: the log was durable past it, so no crash can
    # have lost its body.
    end = Position(newest_segment(spool_dir), os.path.getsize(path))
    store_positions(FS, spool_dir, attrs.evolve(positions, consistent=end))
    assert_corrupt_at(spool_dir, clock, path, at, "envelope without its body")


def test_a_first_envelope_ending_the_newest_segment_after_the_durable_end_is_a_torn_tail(
    spool_dir: str, clock: FakeClock
) -> None:
    (kept,) = accepted_spool(spool_dir, clock)
    last = newest_segment(spool_dir)
    path = segment_path(spool_dir, last)
    envelope = frame_of(first_envelope(LONE_ID, clock), path)
    at = append_batch(path, envelope, pad=False)
    with Spool.open(spool_dir, clock=clock) as sp:
        # Its accept never returned: the envelope goes with the body the crash lost.
        assert sp.recovery.torn_at == Position(last, at)
        assert sp.recovery.torn_bytes_cut == len(envelope)
        assert [entry.msg_id for entry in sp.list()] == [kept]
    assert os.path.getsize(path) == at


def test_each_torn_tail_is_kept_in_the_corrupt_directory_once_it_exists(
    spool_dir: str, clock: FakeClock
) -> None:
    accepted_spool(spool_dir, clock)
    kept = []
    for msg_id in (LONE_ID, "6B0357990E172DB4"):
        last = newest_segment(spool_dir)
        path = segment_path(spool_dir, last)
        envelope = frame_of(first_envelope(msg_id, clock), path)
        at = append_batch(path, envelope, pad=False)
        with Spool.open(spool_dir, clock=clock) as sp:
            assert sp.recovery.torn_at == Position(last, at)
        kept.append((f"{fmt.segment_name(last)}.{at}.torn", envelope))
    corrupt = Path(spool_dir, fmt.CORRUPT_DIR)
    assert sorted(p.name for p in corrupt.iterdir()) == sorted(name for name, _ in kept)
    for name, data in kept:
        assert (corrupt / name).read_bytes() == data


# --- checked frames that are not records -----------------------------------------------------


@pytest.mark.parametrize(
    ("ftype", "payload", "why"),
    [
        pytest.param(fmt.T_DELTA, b"\xff\xfe", "not CBOR", id="not-cbor"),
        pytest.param(fmt.T_FINISH, cbor2.dumps([1, 2]), "not a CBOR map", id="not-a-map"),
        pytest.param(
            fmt.T_START,
            cbor2.dumps({"id": LONE_ID, "env": "nowhere", "cls": 0, "ts": 1.8e9}),
            "bad position",
            id="bad-field",
        ),
        pytest.param(
            fmt.T_CONTROL,
            cbor2.dumps({"act": "purge", "tgt": LONE_ID, "ts": 1.8e9}),
            "unknown control action",
            id="unknown-action",
        ),
    ],
)
def test_a_frame_that_passes_its_check_but_is_no_record_is_corrupt_at_its_offset(
    spool_dir: str, clock: FakeClock, ftype: int, payload: bytes, why: str
) -> None:
    accepted_spool(spool_dir, clock)
    path = segment_path(spool_dir, newest_segment(spool_dir))
    at = append_batch(path, encode_frame(ftype, payload, salt_of(path)))
    assert_corrupt_at(spool_dir, clock, path, at, why)


# --- outcome acknowledgements ---------------------------------------------------------------


def test_an_outcome_acknowledgement_in_the_scanned_suffix_is_not_handed_out_again(
    spool_dir: str, clock: FakeClock
) -> None:
    with Spool.open(spool_dir, clock=clock, outcomes=True) as sp:
        msg_id = sp.accept("a@example.org", ["b@example.net"], b"hello")
        attempt = sp.claim()
        assert attempt is not None
        attempt.failed(["b@example.net"], "550 no such user")
        attempt.close()
    with Spool.open(spool_dir, clock=clock, outcomes=True) as sp:
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.msg_id == msg_id  # not acknowledged yet
    # The acknowledgement became durable, then the process died before new positions
    # were written: only the scan of the log can know about it.
    path = segment_path(spool_dir, newest_segment(spool_dir))
    append_batch(path, frame_of(rec.Control("outcome-ack", msg_id, clock()), path))
    assert recover_dry(spool_dir, clock).outcome_acked == {msg_id}
    with Spool.open(spool_dir, clock=clock, outcomes=True) as sp:
        assert sp.next_outcome() is None


# --- start records naming no envelope --------------------------------------------------------


def test_a_start_record_naming_another_messages_envelope_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    first, second = accepted_spool(spool_dir, clock, count=2)
    last = newest_segment(spool_dir)
    other, _body = envelope_at(spool_dir, last, second)
    path = segment_path(spool_dir, last)
    append_batch(path, frame_of(rec.Start(first, other, 0, clock()), path))
    path = segment_path(spool_dir, other.segment)
    assert_corrupt_at(spool_dir, clock, path, other.offset, f"start of {first} names no envelope")


def test_a_start_record_naming_itself_is_corrupt(spool_dir: str, clock: FakeClock) -> None:
    (msg_id,) = accepted_spool(spool_dir, clock)
    path = segment_path(spool_dir, newest_segment(spool_dir))
    itself = Position(newest_segment(spool_dir), os.path.getsize(path))
    assert (
        append_batch(path, frame_of(rec.Start(msg_id, itself, 0, clock()), path)) == itself.offset
    )
    assert_corrupt_at(spool_dir, clock, path, itself.offset, f"start of {msg_id} names no envelope")


@pytest.mark.parametrize("target", ["body", "pad"])
def test_a_start_record_naming_a_frame_that_carries_no_record_is_corrupt(
    spool_dir: str, clock: FakeClock, target: str
) -> None:
    (msg_id,) = accepted_spool(spool_dir, clock)
    last = newest_segment(spool_dir)
    envelope, body = envelope_at(spool_dir, last, msg_id)
    if target == "body":
        named = body
    else:
        (named,) = [p for p, f in frames_in(spool_dir, last) if f.type == fmt.T_PAD][-1:]
    assert named != envelope
    newest = segment_path(spool_dir, last)
    append_batch(newest, frame_of(rec.Start(msg_id, named, 0, clock()), newest))
    path = segment_path(spool_dir, named.segment)
    assert_corrupt_at(spool_dir, clock, path, named.offset, f"start of {msg_id} names no envelope")


def test_a_start_record_naming_an_unscanned_envelope_that_does_not_decode_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    (msg_id,) = accepted_spool(spool_dir, clock)
    last = newest_segment(spool_dir)
    path = segment_path(spool_dir, last)
    _, payload = rec.encode(first_envelope(msg_id, clock))
    spoiled = cbor2.dumps({**cbor2.loads(payload), "to": "b@example.net"})
    at = append_batch(path, encode_frame(fmt.T_ENVELOPE, spoiled, salt_of(path)))
    # Positions written after that batch: the scan starts behind the envelope, so only
    # the start record that names it leads recovery to read it.
    positions = load_positions(FS, spool_dir)
    assert positions is not None
    end = Position(last, os.path.getsize(path))
    store_positions(FS, spool_dir, attrs.evolve(positions, consistent=end, working_start=end))
    append_batch(path, frame_of(rec.Start(msg_id, Position(last, at), 0, clock()), path))
    assert_corrupt_at(spool_dir, clock, path, at, f"start of {msg_id} names no envelope")


def test_a_start_record_naming_its_own_envelope_is_recovered_as_an_interrupted_attempt(
    spool_dir: str, clock: FakeClock
) -> None:
    (msg_id,) = accepted_spool(spool_dir, clock)
    last = newest_segment(spool_dir)
    envelope, _body = envelope_at(spool_dir, last, msg_id)
    path = segment_path(spool_dir, last)
    append_batch(path, frame_of(rec.Start(msg_id, envelope, 0, clock()), path))
    with Spool.open(spool_dir, clock=clock) as sp:
        assert sp.recovery.working_found == 1 and sp.recovery.replacements_written == 1
        (entry,) = sp.list()
        assert entry.msg_id == msg_id


def test_an_operator_action_for_no_attempt_in_flight_changes_nothing(
    spool_dir: str, clock: FakeClock
) -> None:
    # A control record of an operator action names an attempt in flight; one whose attempt
    # is not in the scanned suffix (its start lies in a deleted segment after a full scan)
    # is ignored, not applied to a message it never concerned.
    (msg,) = accepted_spool(spool_dir, clock)
    path = segment_path(spool_dir, newest_segment(spool_dir))
    action = rec.Control(rec.IN_FLIGHT_DELETE, msg, clock(), why="gone")
    append_batch(path, frame_of(action, path))
    state = recover_dry(spool_dir, clock)
    assert state.to_write == [] and state.working_at == []
    with Spool.open(spool_dir, clock=clock) as sp:
        assert [e.msg_id for e in sp.list()] == [msg]


def test_a_spool_without_incoming_or_with_damage_keeps_its_body_files(
    spool_dir: str, clock: FakeClock
) -> None:
    accepted_spool(spool_dir, clock)
    incoming = Path(spool_dir, fmt.INCOMING_DIR)
    os.rmdir(incoming)  # a spool an earlier build made: no incoming/ to look in
    assert recover_dry(spool_dir, clock).bodies_to_remove == []
    incoming.mkdir()
    (incoming / "6B49D20054D06D28").write_bytes(b"left by a crash")
    damaged = [(Position(1, fmt.SEGMENT_HEADER_SIZE), 64)]
    # Damage a repair set aside may have held the envelope naming it: kept for `check`.
    assert _incoming_files(FileSystem(), spool_dir, set(), damaged) == ([], [])
    assert _incoming_files(FileSystem(), spool_dir, set(), []) == ([], ["6B49D20054D06D28"])
    assert recover_dry(spool_dir, clock).bodies_to_remove == ["6B49D20054D06D28"]


@pytest.mark.parametrize("hit", ["payload", "length"])
def test_damage_to_the_last_synced_batch_is_corruption_not_a_torn_tail(
    spool_dir: str, clock: FakeClock, hit: str
) -> None:
    # Before: bad bytes in the newest segment past the positions were a torn tail unless a
    # valid frame followed at a later sector boundary, so two flipped bits in the last
    # batch (an accept that had returned) were cut, and the message was gone unreported.
    # A tear leaves whole sectors unwritten; every sector of this frame is there.
    accepted_spool(spool_dir, clock)
    path = segment_path(spool_dir, newest_segment(spool_dir))
    body = encode_frame(fmt.T_BODY, LONE_ID.encode() + b"hello", salt_of(path))
    at = append_batch(path, frame_of(first_envelope(LONE_ID, clock), path) + body)
    data = bytearray(Path(path).read_bytes())
    # Two bits in the payload (beyond correcting), or one in the length field's third
    # byte: the frame then seems to run 64 KiB past the end of the file, as a tear would.
    for offset in (at + 20, at + 30) if hit == "payload" else (at + 6,):
        data[offset] ^= 0x01
    Path(path).write_bytes(bytes(data))
    assert_corrupt_at(spool_dir, clock, path, at, "")


@pytest.mark.parametrize("classes", ["same", "changed"])
def test_damage_to_a_synced_body_frame_is_reported_whatever_the_retry_classes(
    spool_dir: str, clock: FakeClock, classes: str
) -> None:
    # Before (found by the crash explorer, seed 51 of operator-and-restart): an open that
    # recorded other retry classes crashed before its checkpoint, so the next recovery
    # dropped the positions (their cursors no longer fit) and with them the durable end;
    # two flipped bits in the synced BODY frame then looked like a torn tail, were cut,
    # and the acknowledged message was gone with nothing reported.
    (msg,) = accepted_spool(spool_dir, clock)
    if classes == "changed":
        store_settings(FS, spool_dir, SpoolOptions(retry_intervals=(60.0,)))
    path = segment_path(spool_dir, newest_segment(spool_dir))
    data = bytearray(Path(path).read_bytes())
    at = data.rindex(msg.encode())  # the BODY frame (the envelope names the id first)
    data[at + 5] ^= 0x08
    data[at + 19] ^= 0x01
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptSpool), Spool.open(spool_dir, clock=clock) as sp:
        sp.list()  # (walks the log; a reader that skips bodies cannot see the damage)
        attempt = sp.claim()
        assert attempt is not None
        attempt.read_data()


def test_an_acknowledgement_before_the_positions_is_known_and_removes_nothing(
    spool_dir: str, clock: FakeClock
) -> None:
    """An attempt still open keeps the working suffix before an acknowledgement that the
    positions already cover: recovery reads it again, counts the outcome acknowledged, and
    does not name its body again (the checkpoint after the acknowledgement removed it)."""
    sp = Spool.open(spool_dir, clock=clock, outcomes=True)
    try:
        slow = sp.accept("a@example.org", ["r1@example.net"], b"slow")
        quick = sp.accept("a@example.org", ["r2@example.net"], b"quick")
        held_open = sp.claim()
        assert held_open is not None and held_open.msg_id == slow
        with sp.claim() as attempt:
            assert attempt is not None and attempt.msg_id == quick
            attempt.failed(["r2@example.net"], "550 5.1.1 no such user")
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.msg_id == quick
        sp.ack_outcome(quick)
        sp.checkpoint()
        found = recover_dry(spool_dir, clock)
        assert found.working_at and min(found.working_at) < load_positions(FS, spool_dir).consistent
        assert quick in found.outcome_acked
        assert quick not in found.bodies_to_remove
    finally:
        sp.close()


# --- an acknowledgement of an attempt still in flight: its finish was lost ------------------
#
# An outcome is acknowledged only once its finish is durable, so an acknowledgement of an
# attempt recovery finds in flight proves a finish that damage took (a repair set it
# aside): the attempt is not decided again (the acknowledgement let its body file go) but
# finished again (R6), with no outcomes and the body it had, which that finish releases
# (an inline body's pin) as the lost one did.


def start_and_ack(spool_dir: str, clock: FakeClock, msg_id: str, named: Position) -> None:
    """Append a start of ``msg_id`` from the envelope at ``named``, then an outcome
    acknowledgement of it, with no finish between them."""
    path = segment_path(spool_dir, newest_segment(spool_dir))
    start = frame_of(rec.Start(msg_id, named, 0, clock()), path)
    append_batch(path, start + frame_of(rec.Control(rec.OUTCOME_ACK, msg_id, clock()), path))


def envelopes_in(spool_dir: str, segment: int) -> list[tuple[Position, rec.Envelope]]:
    out = []
    for pos, frame in frames_in(spool_dir, segment):
        record = rec.decode(frame.type, frame.payload) if frame.type == fmt.T_ENVELOPE else None
        if isinstance(record, rec.Envelope):
            out.append((pos, record))
    return out


def pins_after_open(spool_dir: str, clock: FakeClock) -> dict[int, int]:
    """The body pins the positions hold after an open and a checkpoint."""
    with Spool.open(spool_dir, clock=clock) as sp:
        sp.checkpoint()
    positions = load_positions(FS, spool_dir)
    assert positions is not None
    return dict(positions.body_refs)


def test_an_acknowledged_attempt_is_finished_again_releasing_its_inline_body(
    spool_dir: str, clock: FakeClock
) -> None:
    msg_id, other = accepted_spool(spool_dir, clock, 2)
    envelope, body = envelope_at(spool_dir, 1, msg_id)
    start_and_ack(spool_dir, clock, msg_id, envelope)
    found = recover_dry(spool_dir, clock)
    (finish,) = found.to_write
    assert isinstance(finish, rec.Finish) and finish.reason == FINISH_LOST_REASON
    assert (finish.msg_id, finish.outcomes, finish.body.at) == (msg_id, (), body)
    assert msg_id in found.outcome_acked  # the reader skips that finish: acknowledged
    assert pins_after_open(spool_dir, clock) == {1: 1}  # the other message's body alone
    assert recover_dry(spool_dir, clock).to_write == []  # written once
    with Spool.open(spool_dir, clock=clock) as sp:
        assert [e.msg_id for e in sp.list()] == [other]
    os.unlink(os.path.join(spool_dir, fmt.POSITIONS_NAME))  # a full scan replays it
    found = recover_dry(spool_dir, clock)
    assert (found.to_write, found.body_refs) == ([], {1: 1})


def test_an_acknowledged_attempt_from_a_replacement_releases_its_first_envelopes_body(
    spool_dir: str, clock: FakeClock
) -> None:
    with Spool.open(spool_dir, clock=clock) as sp:
        msg_id = sp.accept("a@example.org", ["b@example.net"], b"hello")
        with sp.claim() as attempt:
            assert attempt is not None
            attempt.deferred(["b@example.net"], "451 4.3.0 later")
    (replacement,) = [pos for pos, env in envelopes_in(spool_dir, 1) if env.supersedes]
    start_and_ack(spool_dir, clock, msg_id, replacement)
    assert recover_dry(spool_dir, clock).body_refs == {1: 1}
    assert pins_after_open(spool_dir, clock) == {}


def test_an_acknowledged_attempt_that_started_before_the_positions_releases_its_pin(
    spool_dir: str, clock: FakeClock
) -> None:
    # The positions count the pin (nothing released it before them): the finish recovery
    # writes does, once.
    (msg_id,) = accepted_spool(spool_dir, clock)
    envelope, _body = envelope_at(spool_dir, 1, msg_id)
    path = segment_path(spool_dir, 1)
    at = append_batch(path, frame_of(rec.Start(msg_id, envelope, 0, clock()), path))
    positions = load_positions(FS, spool_dir)
    assert positions is not None
    end = Position(1, os.path.getsize(path))
    scan_from = Position(1, at)
    store_positions(FS, spool_dir, attrs.evolve(positions, consistent=end, working_start=scan_from))
    append_batch(path, frame_of(rec.Control(rec.OUTCOME_ACK, msg_id, clock()), path))
    found = recover_dry(spool_dir, clock)
    assert [type(r) for r in found.to_write] == [rec.Finish]
    assert found.body_refs == {1: 1}
    assert pins_after_open(spool_dir, clock) == {}


def test_an_acknowledged_attempt_whose_envelope_segment_is_gone_is_finished_without_a_body(
    spool_dir: str, clock: FakeClock
) -> None:
    (msg_id,) = accepted_spool(spool_dir, clock)
    envelope, _body = envelope_at(spool_dir, 1, msg_id)
    create_segment(spool_dir, 2)
    start_and_ack(spool_dir, clock, msg_id, envelope)
    os.unlink(segment_path(spool_dir, 1))
    os.unlink(os.path.join(spool_dir, fmt.POSITIONS_NAME))
    found = recover_dry(spool_dir, clock)
    (finish,) = found.to_write
    assert isinstance(finish, rec.Finish) and finish.body == rec.BodyRef(rec.BODY_FILE, 0)
    assert found.body_refs == {}


def test_an_acknowledged_attempt_whose_start_names_no_envelope_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    (msg_id,) = accepted_spool(spool_dir, clock)
    _envelope, body = envelope_at(spool_dir, 1, msg_id)
    start_and_ack(spool_dir, clock, msg_id, body)  # its BODY frame: no record at all
    path = segment_path(spool_dir, 1)
    assert_corrupt_at(spool_dir, clock, path, body.offset, f"start of {msg_id} names no")


def test_an_acknowledged_attempt_whose_start_names_another_envelope_is_corrupt(
    spool_dir: str, clock: FakeClock
) -> None:
    msg_id, other = accepted_spool(spool_dir, clock, 2)
    envelope, _body = envelope_at(spool_dir, 1, other)
    start_and_ack(spool_dir, clock, msg_id, envelope)
    path = segment_path(spool_dir, 1)
    assert_corrupt_at(spool_dir, clock, path, envelope.offset, f"start of {msg_id} names no")


def test_an_acknowledged_attempt_with_a_body_file_is_finished_naming_it(
    spool_dir: str, clock: FakeClock
) -> None:
    with Spool.open(spool_dir, clock=clock, inline_body_max=100) as sp:
        msg_id = sp.accept("a@example.org", ["b@example.net"], b"f" * 500)
        small = sp.accept("a@example.org", ["c@example.net"], b"hello")
    envelope = next(pos for pos, env in envelopes_in(spool_dir, 1) if env.msg_id == msg_id)
    start_and_ack(spool_dir, clock, msg_id, envelope)
    found = recover_dry(spool_dir, clock)
    (finish,) = found.to_write
    assert isinstance(finish, rec.Finish) and finish.body == rec.BodyRef(rec.BODY_FILE, 500)
    assert found.body_refs == {1: 1}
    assert msg_id in found.bodies_to_remove  # the acknowledgement let it go
    assert small not in found.bodies_to_remove
    with Spool.open(spool_dir, clock=clock, inline_body_max=100) as sp:
        assert [e.msg_id for e in sp.list()] == [small]
    assert not os.path.exists(os.path.join(spool_dir, fmt.BODY_DIR, msg_id))
