"""Breaks a third adversarial review of ``check --repair`` found (docs/reliability.md,
"Found by running it"): each built, damaged and repaired as the review did, asserting the
contract it broke.

Four of them were one class: the note that a lost START had used up its envelope rode on
the repair's marker of some damaged region after it, and that region could be too small
for it, a whole segment rebuilt from nothing, or an earlier repair's marker. The note is
now a record of its own (``used-up``), appended by the repair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool.check import check_spool, repair_spool
from spool.testing import FakeClock
from tests.contract.repairing import OPTS, T0, claimed_later, flip, kind, records, run_child


def delivered_beside_another(root: Path) -> str:
    """D accepted, claimed, and delivered while E (a BODY frame of 29 bytes) was accepted
    after D's START; E's id. D's START is the one record between its envelope and its
    finish that says the envelope is used up."""
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        d = sp.accept("alice@x.org", ["bob@x.net"], b"d" * 50)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == d
        e = sp.accept("alice@x.org", ["carol@x.net"], b"e" * 4)
        attempt.delivered(["bob@x.net"], "250 ok")
        attempt.close()
    return e


def test_a_lost_start_beside_a_tiny_damaged_body_is_noted(tmp_path: Path) -> None:
    # The note went to the last damaged region after D's envelope that was not padding: a
    # damaged BODY frame of 29 bytes, which no marker carrying the note fits. The repair
    # crashed with an AssertionError.
    root = tmp_path / "spool"
    e = delivered_beside_another(root)
    items = records(root)
    start = next(p for p, r, _ in items if kind(r) == "Start")
    body = next(p for p, _, f in items if f is not None and f.type == fmt.T_BODY and p > start)
    assert next(f.size for p, _, f in items if p == body) == 29
    flip(root, (start.offset + 4, 0x18), (body.offset + 20, 1), (body.offset + 27, 1))
    report = repair_spool(str(root))
    assert report.after.clean
    assert e in {m for m, _ in report.fates}  # its body lost: failed, a bounce says so
    assert claimed_later(root) == []


def test_a_crash_right_after_the_used_up_note_leaves_it_for_recovery(tmp_path: Path) -> None:
    # The repair notes the used-up envelope first (durable on return) and then settles;
    # killed between the two, it leaves its flag and the note in the log after the restart
    # positions. The rerun's open reads the note in recovery (the envelope is used up),
    # and D, delivered, is never handed out again.
    root = tmp_path / "spool"
    e = delivered_beside_another(root)
    items = records(root)
    start = next(p for p, r, _ in items if kind(r) == "Start")
    flip(root, (start.offset + 4, 0x18))
    run_child(f"""
        import os
        from spool import operator
        from spool.check import repair_spool
        noted = operator.OperatorDesk.note_used_up
        def note_then_die(self, envelopes):
            noted(self, envelopes)
            os._exit(0)  # killed right after the note was durable
        operator.OperatorDesk.note_used_up = note_then_die
        repair_spool({str(root)!r})
        raise SystemExit("the repair noted nothing")
    """)
    assert any(kind(r) == "Control" and r.action == "used-up" for _p, r, _f in records(root))
    report = repair_spool(str(root))
    assert report.after.clean
    assert claimed_later(root) == [e]  # E, intact, is still queued; D never again


@pytest.mark.parametrize("how", ["missing", "header and first frame"])
def test_a_lost_start_in_a_whole_lost_segment_is_noted(tmp_path: Path, how: str) -> None:
    # D's START in segment 2, its envelope in 1 and its finish in 3; segment 2 missing (or
    # its salt and first frame unreadable): the rewrite built a fresh marker without the
    # note, and D, delivered, was handed out again.
    root = tmp_path / "spool"
    out = run_child(f"""
        import os
        from spool import Spool
        from spool.testing import FakeClock
        sp = Spool.open({str(root)!r}, clock=FakeClock({T0}), segment_size=4096, **{OPTS!r})
        fillers = []
        for i in range(6):  # batches of 512 bytes each: D's envelope ends segment 1
            fillers.append(sp.accept("alice@x.org", [f"f{{i}}@x.net"], b"f" * 50))
            sp.sync()
        d = sp.accept("alice@x.org", ["bob@x.net"], b"d" * 50)
        sp.sync()
        first = [sp.claim() for _ in fillers]
        attempt = sp.claim()
        assert attempt.msg_id == d
        for other in first:
            other.close()  # deferred
        for i in range(8):  # and as many fill segment 2
            sp.accept("alice@x.org", [f"g{{i}}@x.net"], b"g" * 50)
            sp.sync()
        attempt.delivered(["bob@x.net"], "250 ok")
        attempt.close()
        sp.sync()
        print(d)
        os._exit(0)
    """)
    d = out.split()[0]
    log = root / fmt.LOG_DIR
    where = {(kind(r), r.msg_id): p.segment for p, r, _ in records(root) if r is not None}
    assert (where[("Envelope", d)], where[("Start", d)], where[("Finish", d)]) == (1, 2, 3)
    if how == "missing":
        os.unlink(log / fmt.segment_name(2))
    else:
        flip(root, (24, 1), (28, 1), (fmt.SEGMENT_HEADER_SIZE + 4, 0x18), segment=2)
    report = repair_spool(str(root))
    assert report.after.clean
    assert d not in claimed_later(root)


def test_a_lost_start_after_an_earlier_repairs_marker_is_noted(tmp_path: Path) -> None:
    # X's body set aside by a first repair; then D's START damaged. The note went to the
    # earlier marker (the last damaged region after D's envelope), where nothing writes
    # it: D, delivered, was handed out again.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        d = sp.accept("alice@x.org", ["bob@x.net"], b"d" * 50)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == d
        x = sp.accept("alice@x.org", ["xav@x.net"], b"x" * 60)
        attempt.delivered(["bob@x.net"], "250 ok")
        attempt.close()
    items = records(root)
    start = next(p for p, r, _ in items if kind(r) == "Start")
    body = next(p for p, _, f in items if f is not None and f.type == fmt.T_BODY and p > start)
    flip(root, (body.offset + 30, 1), (body.offset + 50, 1))
    first = repair_spool(str(root))
    assert first.after.clean and x in {m for m, _ in first.fates}
    flip(root, (start.offset + 4, 0x18))
    assert repair_spool(str(root)).after.clean
    assert claimed_later(root) == []


def test_giving_back_a_start_after_its_message_finished_keeps_its_note(tmp_path: Path) -> None:
    # D's START unreadable, X's taken exactly; X finishing before D. D's finish gave back
    # X's start, and with it the note for X's envelope: X, delivered, was handed out again.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        d = sp.accept("alice@x.org", ["bob@x.net"], b"d" * 50)
        x = sp.accept("alice@x.org", ["xav@x.net"], b"x" * 50)
        first = sp.claim()
        assert first is not None and first.msg_id == d
        sp.sync()
        second = sp.claim()
        assert second is not None and second.msg_id == x
        sp.sync()
        for attempt, rcpt in ((second, "xav@x.net"), (first, "bob@x.net")):
            attempt.delivered([rcpt], "250 ok")
            attempt.close()
            sp.sync()
    starts = {r.msg_id: p for p, r, _ in records(root) if kind(r) == "Start"}
    flip(
        root,
        (starts[d].offset + 4, 0x18),  # D's START: its length, unreadable
        (starts[x].offset, 1),  # X's: two bits of its stored CRC, still decoding
        (starts[x].offset + 1, 1),
    )
    assert repair_spool(str(root)).after.clean
    assert claimed_later(root) == []


@pytest.mark.parametrize("where", [fmt.BODY_DIR, fmt.INCOMING_DIR])
def test_a_fifo_in_place_of_a_body_file_neither_hangs_check_nor_repair(
    tmp_path: Path, where: str
) -> None:
    # open() of a FIFO blocks until a writer comes: check and repair hung for ever.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 500)
        n = sp.accept("alice@x.org", ["carol@x.net"], b"n" * 500)
    if where == fmt.BODY_DIR:
        os.unlink(root / fmt.BODY_DIR / m)
    os.mkfifo(root / where / m)
    code = f"""
        import sys
        from spool.check import check_spool, repair_spool
        if check_spool({str(root)!r}).clean:
            sys.exit("check called the spool clean")
        report = repair_spool({str(root)!r})
        if not report.after.clean:
            sys.exit("not clean after the repair")
    """
    run_child(code, timeout=60)
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        live = {e.msg_id for e in sp.list()}
        if where == fmt.INCOMING_DIR:
            # The FIFO stood beside the settled file: the message is intact.
            assert live == {m, n}
            attempt = sp.claim()
            assert attempt is not None and attempt.read_data() == b"m" * 500
            attempt.close()
        else:
            assert live == {n}  # m's body lost: its recipient failed
    assert not any(p.is_fifo() for p in (root / where).iterdir())


def test_a_damaged_hold_in_flight_with_its_target_hit_holds_on_the_second_check(
    tmp_path: Path,
) -> None:
    # An operator's hold of M in flight, its CONTROL record hit in the CRC and in one
    # character of the target id (no longer hex). The first check held every live message;
    # its marker kept the damaged id, and the second check (which the repair settles from)
    # found no target in flight: nobody was held, and M was claimed a day later.
    root = tmp_path / "spool"
    out = run_child(f"""
        import os
        from spool import Spool
        from spool.testing import FakeClock
        sp = Spool.open({str(root)!r}, clock=FakeClock({T0}), **{OPTS!r})
        m = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
        attempt = sp.claim()
        assert attempt.msg_id == m
        sp.hold(m, "wait for the customer")
        sp.sync()
        print(m)
        os._exit(0)  # a crash with the attempt open
    """)
    m = out.split()[0]
    items = records(root)
    control = next(p for p, r, _ in items if kind(r) == "Control")
    seg = root / fmt.LOG_DIR / fmt.segment_name(control.segment)
    data = bytearray(seg.read_bytes())
    at = data.index(m.encode(), control.offset)
    data[at + 3] = ord("z")  # one character of the target: no longer an id
    data[control.offset] ^= 1  # and its CRC
    seg.write_bytes(bytes(data))
    assert not check_spool(str(root)).clean
    assert repair_spool(str(root)).after.clean
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        (entry,) = sp.list()
    assert entry.msg_id == m and entry.held
    assert m not in claimed_later(root)
