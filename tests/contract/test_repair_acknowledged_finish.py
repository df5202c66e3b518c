"""A finish lost to damage while an acknowledgement of its outcome survives.

An outcome is handed out only once its finish is durable, and acknowledged only after
that (outcome_desk.py), so an acknowledgement proves its message finished. Recovery used to
decide the attempt again from its start and deltas, queueing the message a second time
although the acknowledgement had let its body file go: every open after the repair then
failed ("body file is missing"). Found by the crash pieces (seed 21149,
tests/crash/test_regressions.py); these pin each form of it with the public API.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.check import check_spool, repair_spool
from spool.damage import Verdict
from spool.fs import FileSystem
from spool.positions import load_positions
from spool.testing import FakeClock
from tests.contract.repairing import OPTS, T0, claimed_later, flip, records

ROOT = Path(__file__).resolve().parents[2]


def run_spool(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``spool`` command in a real process, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "spool.cli", *args], capture_output=True, text=True, cwd=ROOT
    )


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


def damage_records(root: Path, msg_id: str, kinds: tuple[type, ...], where: str = "end") -> None:
    """A burst of four bytes in each record of ``msg_id`` of the given kinds (all found
    before any is hit): over its CRC field (the payload still decodes, so the record is
    identified), its middle, or near its end (its reply or reason text). More than a
    flipped bit, which the repair would set right."""
    hit = [record_of(root, kind, msg_id) for kind in kinds]
    for pos, _record, frame in hit:
        at = pos.offset + {"crc": 0, "middle": frame.size // 2, "end": frame.size - 8}[where]
        flip(root, *[(at + i, 0xA5) for i in range(4)], segment=pos.segment)


def finishes_of(root: Path, msg_id: str) -> int:
    return sum(isinstance(r, rec.Finish) and r.msg_id == msg_id for _p, r, _f in records(root))


def repaired_once_and_for_all(root: Path) -> dict[str, str]:
    """Repair; the spool is clean after it, and a second repair writes no record more.
    Returns the first repair's fates."""
    report = repair_spool(str(root))
    assert report.after.clean, report.after.problems
    count = len(records(root))
    again = repair_spool(str(root))
    assert again.after.clean and len(records(root)) == count
    return dict(report.fates)


def pins_after_a_checkpoint(root: Path) -> dict[int, int]:
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        sp.checkpoint()
    positions = load_positions(FileSystem(), str(root))
    assert positions is not None
    return dict(positions.body_refs)


def nothing_comes_back(root: Path, m: str) -> None:
    """``m`` is neither listed, nor handed out, nor given out as an outcome again."""
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        assert m not in {e.msg_id for e in sp.list()}
        outcome = sp.next_outcome(timeout=0)
        assert outcome is None or outcome.msg_id != m
    assert m not in claimed_later(root)
    assert check_spool(str(root)).clean


@pytest.mark.parametrize("where", ["end", "middle", "crc"])
def test_a_damaged_finish_of_an_acknowledged_message_in_flight_is_finished_again(
    tmp_path: Path, where: str
) -> None:
    # Its finish and the delta that failed its recipients: decided again from what is
    # left, it would go back to the queue without the body file its acknowledgement let go.
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"m" * 500, deliver=False)  # a body file
    damage_records(root, m, (rec.Delta, rec.Finish), where)
    before = check_spool(str(root))
    assert not before.clean
    assert {(a.msg_id, a.verdict) for a in before.affected} == {(m, Verdict.FINISH_LOST)}
    fate = repaired_once_and_for_all(root)[m]
    assert fate.startswith("finish lost at ") and "nothing to settle" in fate
    assert finishes_of(root, m) == 1  # recovery's (R6)
    nothing_comes_back(root, m)


@pytest.mark.parametrize("where", ["end", "middle", "crc"])
@pytest.mark.parametrize("size", [40, 500])
def test_an_acknowledged_message_whose_start_and_finish_were_damaged_is_finished_by_the_repair(
    tmp_path: Path, where: str, size: int
) -> None:
    # A start that still decodes is identified, and its marker stands for it: recovery
    # finishes the attempt again (R6). One past reading leaves the message looking queued
    # on its envelope: the repair notes the envelope used up and writes its finish again.
    # Either finish releases its body (an inline one's pin on segment 1: without it the
    # segment, and every one after it, would be kept for ever).
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"m" * size)
    damage_records(root, m, (rec.Start, rec.Finish), where)
    assert not check_spool(str(root)).clean
    fate = repaired_once_and_for_all(root)[m]
    done = "finished again" if where == "middle" else "nothing to settle"
    assert fate.startswith("finish lost at ") and done in fate, fate
    assert finishes_of(root, m) == 1
    nothing_comes_back(root, m)
    assert 1 not in pins_after_a_checkpoint(root) or size > OPTS["inline_body_max"]


def test_an_acknowledged_message_whose_envelope_start_and_finish_were_damaged_is_not_restored(
    tmp_path: Path,
) -> None:
    # Each record still decodes (the bursts hit the CRC fields): the damaged envelope
    # would be restored, held, with both delivered recipients pending.
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"m" * 40)
    damage_records(root, m, (rec.Envelope, rec.Start, rec.Finish), "crc")
    before = check_spool(str(root))
    assert {(a.msg_id, a.verdict) for a in before.affected} == {(m, Verdict.FINISH_LOST)}
    repaired_once_and_for_all(root)
    nothing_comes_back(root, m)


def test_the_inline_body_of_an_acknowledged_message_whose_finish_was_lost_frees_its_segment(
    tmp_path: Path,
) -> None:
    # The lost finish would have released the pin its inline body holds on segment 1:
    # recovery's finish (R6) does, or the segment is kept for ever (and every segment
    # after it with it).
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"i" * 40)  # inline: within inline_body_max
    env_pos, env, _frame = record_of(root, rec.Envelope, m)
    assert env.body.kind == rec.BODY_INLINE
    damage_records(root, m, (rec.Delta, rec.Finish))
    repaired_once_and_for_all(root)
    assert env_pos.segment not in pins_after_a_checkpoint(root)


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
    damage_records(root, m, (rec.Finish,))
    assert all(a.verdict is not Verdict.FINISH_LOST for a in check_spool(str(root)).affected)
    report = repair_spool(str(root))
    assert report.after.clean, report.after.problems
    assert m not in claimed_later(root)
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        outcome = sp.next_outcome(timeout=1)
        assert outcome is not None and outcome.msg_id == m
        assert {o.status for o in outcome.recipients} == {rec.DELIVERED}


def test_check_repair_run_again_exits_0_and_names_what_the_first_run_settled(
    tmp_path: Path,
) -> None:
    # Before: every later `spool check --repair` of the repaired spool counted the message
    # the first one had settled as affected again, and exited 1 for ever (an operator's
    # script would alert on every run).
    root = tmp_path / "spool"
    m = finished_and_acknowledged(root, b"y" * 300)
    damage_records(root, m, (rec.Delta, rec.Finish))
    first = run_spool("check", "--repair", str(root))
    assert first.returncode == 1 and f"affected: {m}: finish lost" in first.stdout
    again = run_spool("check", "--repair", str(root))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"settled by an earlier repair: {m}: finish lost" in again.stdout
    assert "repaired:" not in again.stdout and "after repair: clean" in again.stdout
    checked = run_spool("check", str(root))
    assert checked.returncode == 0 and f"note: {m}: finish lost" in checked.stdout
    # A repair that did not finish (its flag left behind, as a crash before its end
    # leaves it) still counts: its messages were never reported.
    (root / fmt.REPAIRING_NAME).write_text("1\n")
    interrupted = run_spool("check", "--repair", str(root))
    assert interrupted.returncode == 1, interrupted.stdout + interrupted.stderr
    assert not (root / fmt.REPAIRING_NAME).exists()
    assert run_spool("check", "--repair", str(root)).returncode == 0
