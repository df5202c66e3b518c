"""Breaks a second adversarial review of ``check --repair`` found after the fixes of the
first (docs/reliability.md, "Found by running it"): each built, damaged and repaired as
the review did, asserting the contract it broke."""

from __future__ import annotations

import os
from pathlib import Path

from spool import Spool
from spool import format as fmt
from spool.check import check_spool, repair_spool
from spool.testing import FakeClock
from tests.contract.repairing import OPTS, T0, claimed_later, flip, records


def test_a_start_known_exactly_holds_nobody_else(tmp_path: Path) -> None:
    # Its marker, read by the repair's second check, fell through to "records of unknown
    # kind": an intact queued message was held, and the repair said no mail was affected.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        a = sp.accept("alice@x.org", ["bob@x.net"], b"a" * 50)
        b = sp.accept("alice@x.org", ["carol@x.net"], b"b" * 50)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == a
        with attempt:
            attempt.delivered(["bob@x.net"], "250 ok")
    start = next(p for p, r, _ in records(root) if type(r).__name__ == "Start")
    flip(root, (start.offset, 1), (start.offset + 1, 1))  # two bits of its stored CRC
    report = repair_spool(str(root))
    assert report.after.clean and b not in {m for m, _ in report.fates}
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        (entry,) = sp.list()
    assert entry.msg_id == b and not entry.held


def test_a_lost_start_noted_beside_damaged_padding_keeps_its_note(tmp_path: Path) -> None:
    # "This envelope is used up" went to the last damaged region after the envelope, which
    # was padding, rewritten as plain padding: the note was lost, and the delivered
    # message was handed out again.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        d = sp.accept("alice@x.org", ["bob@x.net"], b"d" * 50)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == d
        sp.sync()  # each record in its own batch: padding after each
        attempt.delivered(["bob@x.net"], "250 ok")
        sp.sync()
        attempt.close()
        sp.sync()
    items = records(root)
    start = next(p for p, r, _ in items if type(r).__name__ == "Start")
    delta = next(p for p, r, _ in items if type(r).__name__ == "Delta")
    pad = next(p for p, _, f in items if f is not None and f.type == fmt.T_PAD and p > delta)
    flip(root, (start.offset + 4, 0x18), (pad.offset + 20, 1), (pad.offset + 40, 1))
    assert repair_spool(str(root)).after.clean
    assert claimed_later(root) == []


def test_giving_back_a_start_keeps_the_other_notes_of_its_region(tmp_path: Path) -> None:
    # D's START unreadable, X's taken exactly; D's finish gave back X's start and, with it,
    # dropped the note for D's envelope: D, delivered, was handed out again.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        d = sp.accept("alice@x.org", ["bob@x.net"], b"d" * 50)
        x = sp.accept("alice@x.org", ["xav@x.net"], b"x" * 50)
        first, second = sp.claim(), None
        assert first is not None and first.msg_id == d
        sp.sync()
        second = sp.claim()
        assert second is not None and second.msg_id == x
        sp.sync()
        for attempt, rcpt in ((first, "bob@x.net"), (second, "xav@x.net")):
            attempt.delivered([rcpt], "250 ok")
            attempt.close()
            sp.sync()
    starts = {r.msg_id: p for p, r, _ in records(root) if type(r).__name__ == "Start"}
    flip(
        root,
        (starts[d].offset + 4, 0x18),  # D's START: its length, unreadable
        (starts[x].offset, 1),  # X's: two bits of its stored CRC, still decoding
        (starts[x].offset + 1, 1),
    )
    assert repair_spool(str(root)).after.clean
    assert claimed_later(root) == []


def test_a_directory_in_place_of_a_settled_body_file_names_its_message(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 500)
        n = sp.accept("alice@x.org", ["carol@x.net"], b"n" * 500)
    os.unlink(root / fmt.BODY_DIR / m)
    os.mkdir(root / fmt.BODY_DIR / m)
    assert not check_spool(str(root)).clean
    report = repair_spool(str(root))
    assert report.after.clean and m in {msg for msg, _ in report.fates}
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        assert [e.msg_id for e in sp.list()] == [n]


def test_a_damaged_outcome_acknowledgement_holds_no_queued_mail(tmp_path: Path) -> None:
    # The marker of a lost acknowledgement was taken for an operator's action in flight,
    # and every live message was held (the repair saying no mail was affected).
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), outcomes=True, **OPTS) as sp:
        n = sp.accept("alice@x.org", ["bob@x.net"], b"n" * 500)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            attempt.failed(["bob@x.net"], "550 5.1.1 no such user")
        q = sp.accept("alice@x.org", ["carol@x.net"], b"q" * 50)
        outcome = sp.next_outcome(timeout=0.1)
        assert outcome is not None and outcome.msg_id == n
        sp.ack_outcome(n)
    ack = next(
        p
        for p, r, _ in records(root)
        if type(r).__name__ == "Control" and r.action == "outcome-ack"
    )
    flip(root, (ack.offset, 1), (ack.offset + 1, 1))
    report = repair_spool(str(root))
    assert report.after.clean and q not in {m for m, _ in report.fates}
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        entries = {e.msg_id: e for e in sp.list()}
    assert not entries[q].held
