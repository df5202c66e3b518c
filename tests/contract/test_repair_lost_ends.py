"""A segment that lost its end, or the whole of it, under a message in flight.

Found by the review of the bulk repair: a segment before the newest cut short (at 3,026
of its 4,096 bytes) while a message accepted in its lost part was in flight (its start in
the next segment). ``check --repair`` set the truncated frame aside and then raised in its
own open ("no frame header here" where the start named the envelope), leaving the spool
refused to every open; cut at a batch's start, the repair changed nothing and the spool
stayed refused. A missing segment did the same. A record that names a place past the end of its
segment now shows that the segment lost its end: those bytes are records possibly lost,
the repair's marker fills them, and recovery finishes the message in flight from what
survived (R5), named in the report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool.check import check_spool, repair_spool
from spool.records import Position
from tests.contract.repairing import claimed_later, records, run_child

CHILD = """
    import json, os, sys
    from spool import Spool
    from spool.testing import FakeClock
    sp = Spool.open(sys.argv[1] if len(sys.argv) > 1 else {root!r}, clock=FakeClock(1.8e9),
                    segment_size=2048, inline_body_max=100, retry_intervals=(60.0, 600.0))
    early = [sp.accept("a@example.org", [f"e{{i}}@example.net"], b"e" * 80) for i in range(9)]
    body = b"v" * (500 if {deferred} else 80)  # a body file, or inline (in the lost bytes)
    victim = sp.accept("v@example.org", ["v1@example.net", "v2@example.net"], body)
    others = [sp.accept("b@example.org", [f"o{{i}}@example.net"], b"o" * 80) for i in range(9)]
    while (attempt := sp.claim(timeout=0)) is not None and attempt.msg_id != victim:
        attempt.deferred(list(attempt.envelope.recipients), "451 4.3.0 later")
        attempt.close()
    assert attempt is not None
    attempt.delivered(["v1@example.net"], "250 ok")
    if {deferred}:
        attempt.deferred(["v2@example.net"], "451 4.3.0 later")
        attempt.close()
    sp.sync()
    print(json.dumps({{"early": early, "victim": victim, "others": others}}))
    sys.stdout.flush()
    os._exit(0)  # a crash (with the victim in flight, unless deferred)
"""


def in_flight_from_a_segment(
    root: Path, deferred: bool = False
) -> tuple[dict[str, list[str] | str], Position]:
    """The child's spool: its messages, and where the victim's envelope is (its start is
    in a later segment, two on)."""
    ids = json.loads(run_child(CHILD.format(root=str(root), deferred=deferred)))
    found = {
        (type(record).__name__, pos.segment): pos
        for pos, record, _frame in records(root)
        if getattr(record, "msg_id", "") == ids["victim"]
    }
    envelope = min(pos for (kind, _seg), pos in found.items() if kind == "Envelope")
    start = max(pos for (kind, _seg), pos in found.items() if kind == "Start")
    assert start.segment > envelope.segment + 1
    return ids, envelope


def segment_of(root: Path) -> dict[str, int]:
    """The segment of each message's first envelope."""
    first: dict[str, int] = {}
    for pos, record, _frame in records(root):
        if type(record).__name__ == "Envelope":
            first.setdefault(record.msg_id, pos.segment)
    return first


@pytest.mark.parametrize(
    "loss",
    [
        "cut-at-the-envelope",
        "cut-in-the-envelope",
        "cut-after-the-envelope",
        "missing",
        "missing-with-the-next",
    ],
)
def test_a_segment_that_lost_its_end_under_a_message_in_flight_is_repaired(
    tmp_path: Path, loss: str
) -> None:
    root = tmp_path / "spool"
    ids, at = in_flight_from_a_segment(root)
    first = segment_of(root)
    segment = root / fmt.LOG_DIR / fmt.segment_name(at.segment)
    if loss.startswith("missing"):
        segment.unlink()
        if loss == "missing-with-the-next":
            # Found by the review of this fix: only the last of two missing segments in a
            # row knew its size, and the repair's own open raised.
            (root / fmt.LOG_DIR / fmt.segment_name(at.segment + 1)).unlink()
    else:
        cut = at.offset + {"cut-at-the-envelope": 0, "cut-in-the-envelope": 40}.get(loss, 0)
        if loss == "cut-after-the-envelope":  # its BODY frame lost whole, nothing else
            cut = next(
                pos.offset
                for pos, record, _frame in records(root)
                if pos.segment == at.segment and pos.offset > at.offset
            )
        with open(segment, "r+b") as f:
            f.truncate(cut)
    report = check_spool(str(root))
    assert not report.clean, "a spool that lost records was called clean"
    repaired = repair_spool(str(root))
    assert repaired.after.clean, repaired.after.problems
    fates = dict(repaired.fates)
    assert ids["victim"] in fates, fates
    if loss != "cut-after-the-envelope":
        assert "recovery finishes it" in fates[ids["victim"]]
    # Messages accepted in the lost bytes that nothing names are gone unnamed, as with any
    # segment lost whole (docs/reliability.md). Everything in earlier segments is there.
    with Spool.open(root) as sp:
        queued = {e.msg_id for e in sp.list()}
    assert {m for m in ids["early"] if first[m] < at.segment} <= queued
    assert ids["victim"] not in queued  # finished with what survived (R5)
    assert set(claimed_later(root)) <= queued


def test_an_attempt_from_a_lost_envelope_that_ended_with_a_replacement_is_queued(
    tmp_path: Path,
) -> None:
    # Found by the review of this fix: the victim's first envelope in the lost end, its
    # attempt (start, a delivery, a deferral) and the replacement that ended it intact,
    # its body in a body file. The repair said "recovery finishes it" while it stayed
    # queued, and every later check named it again: the replacement re-establishes it.
    root = tmp_path / "spool"
    ids, at = in_flight_from_a_segment(root, deferred=True)
    segment = root / fmt.LOG_DIR / fmt.segment_name(at.segment)
    with open(segment, "r+b") as f:
        f.truncate(at.offset)
    repaired = repair_spool(str(root))
    assert repaired.after.clean, repaired.after.problems
    fate = dict(repaired.fates).get(ids["victim"], "")
    assert "finishes it" not in fate, fate
    assert check_spool(str(root)).affected == ()
    with Spool.open(root) as sp:
        queued = {e.msg_id: e.recipients for e in sp.list()}
    assert queued[ids["victim"]] == ("v2@example.net",)
