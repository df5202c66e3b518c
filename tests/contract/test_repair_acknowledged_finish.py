"""A finish lost to damage while an acknowledgement of its outcome survives.

An outcome is handed out only once its finish is durable, and acknowledged only after
that (outcome_desk.py), so an acknowledgement proves its message finished. Recovery used to
decide the attempt again from its start and deltas, queueing the message a second time
although the acknowledgement had let its body file go: every open after the repair then
failed ("body file is missing"). Found by the crash pieces (seed 21149,
tests/crash/test_regressions.py); these pin each form of it with the public API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spool import Spool
from spool import records as rec
from spool.check import check_spool, repair_spool
from spool.damage import Verdict
from spool.fs import FileSystem
from spool.positions import load_positions
from spool.testing import FakeClock
from tests.contract.repairing import OPTS, T0, claimed_later, flip, records


def finished_and_acknowledged(root: Path, body: bytes, *, deliver: bool = True) -> str:
    """A message attempted once (each recipient delivered, or failed), finished, its outcome
    handed out and acknowledged; then a second message accepted behind it."""
    with Spool.open(root, clock=FakeClock(T0), outcomes=True, **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net", "carol@x.net"], body)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == m
        with attempt:
            if deliver:
                attempt.delivered(["bob@x.net", "carol@x.net"], "250 2.0.0 ok")
            else:
                attempt.failed(["bob@x.net", "carol@x.net"], "550 5.1.1 no such user")
        outcome = sp.next_outcome(timeout=1)
        assert outcome is not None and outcome.msg_id == m
        sp.ack_outcome(m)
        sp.accept("alice@x.org", ["dave@x.net"], b"n" * 500)
    return m


def record_of(root: Path, kind: type, msg_id: str) -> Any:
    """(position, record, frame) of the one record of ``kind`` of ``msg_id``."""
    (found,) = [
        (pos, r, frame)
        for pos, r, frame in records(root)
        if isinstance(r, kind) and getattr(r, "msg_id", None) == msg_id
    ]
    return found


def damage_records(root: Path, msg_id: str, *kinds: type) -> None:
    """A burst in each record of ``msg_id`` of the given kinds (found before any is hit)."""
    hit = [record_of(root, kind, msg_id) for kind in kinds]
    for pos, _record, frame in hit:
        damage_payload(root, pos, frame)


def damage_payload(root: Path, pos: Any, frame: Any, back: int = 8) -> None:
    """A burst over four bytes of a record's payload, ``back`` bytes before its end (its
    reply or reason text): more than a flipped bit, which the repair would set right."""
    at = pos.offset + frame.size - back
    flip(root, *[(at + i, 0xA5) for i in range(4)], segment=pos.segment)


def test_a_damaged_finish_of_an_acknowledged_message_is_named_not_queued_again(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"m" * 500, deliver=False)  # a body file
    # Its finish and the delta that failed its recipients: decided again from what is
    # left, it would go back to the queue without the body file its acknowledgement let go.
    damage_records(root, m, rec.Delta, rec.Finish)
    before = check_spool(str(root))
    assert not before.clean
    assert {(a.msg_id, a.verdict) for a in before.affected} == {(m, Verdict.FINISH_LOST)}
    report = repair_spool(str(root))
    assert report.after.clean, report.after.problems
    fate = dict(report.fates)[m]
    assert fate.startswith("finish lost at ") and "nothing to settle" in fate
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        assert m not in {e.msg_id for e in sp.list()}
        assert sp.next_outcome(timeout=0) is None  # its outcome was acknowledged once
    assert m not in claimed_later(root)
    assert check_spool(str(root)).clean


def test_an_acknowledged_message_whose_start_and_finish_were_damaged_is_not_handed_out(
    tmp_path: Path,
) -> None:
    # It would look queued on its envelope: the repair notes the envelope used up.
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"m" * 500)
    damage_records(root, m, rec.Start, rec.Finish)
    assert not check_spool(str(root)).clean
    report = repair_spool(str(root))
    assert report.after.clean, report.after.problems
    assert m in dict(report.fates)
    assert m not in claimed_later(root)
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        assert m not in {e.msg_id for e in sp.list()}


def test_the_inline_body_of_an_acknowledged_message_whose_finish_was_lost_frees_its_segment(
    tmp_path: Path,
) -> None:
    # The lost finish would have released the pin its inline body holds on segment 1:
    # recovery releases it from the acknowledgement, or the segment is kept for ever (and
    # every segment after it with it).
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"i" * 40)  # inline: within inline_body_max
    env_pos, env, _frame = record_of(root, rec.Envelope, m)
    assert env.body.kind == rec.BODY_INLINE
    damage_records(root, m, rec.Delta, rec.Finish)
    report = repair_spool(str(root))
    assert report.after.clean, report.after.problems
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        sp.checkpoint()
    positions = load_positions(FileSystem(), str(root))
    assert positions is not None
    assert env_pos.segment not in positions.body_refs, positions.body_refs


def test_a_lost_finish_with_no_acknowledgement_is_still_decided_again(tmp_path: Path) -> None:
    # The acknowledgement is what proves the finish: without one, recovery decides the
    # attempt again from its start and deltas, as before (the deltas settle both
    # recipients: nothing is attempted twice).
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), outcomes=True, **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net", "carol@x.net"], b"m" * 500)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            attempt.delivered(["bob@x.net", "carol@x.net"], "250 2.0.0 ok")
        sp.accept("alice@x.org", ["dave@x.net"], b"n" * 500)
    pos, _finish, frame = record_of(root, rec.Finish, m)
    damage_payload(root, pos, frame)
    assert all(a.verdict is not Verdict.FINISH_LOST for a in check_spool(str(root)).affected)
    report = repair_spool(str(root))
    assert report.after.clean, report.after.problems
    assert m not in claimed_later(root)
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        outcome = sp.next_outcome(timeout=1)
        assert outcome is not None and outcome.msg_id == m
        assert {o.status for o in outcome.recipients} == {rec.DELIVERED}
