"""Outcomes carry what a bounce needs, and an operator's action in flight is durable.

An agent builds an RFC 3464 notice from the outcome alone: the sender, the acceptance time,
each recipient's final reply, and the message itself (kept, with outcome tracking, until
the outcome is acknowledged). Real spools in temporary directories; crashes are child
processes that end with ``os._exit``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spool import BodyGone, Spool, SpoolMisuse
from spool import format as fmt
from spool import records as rec
from spool.check import check_spool, repair_spool
from spool.testing import FakeClock
from tests.contract.test_lost_or_wedged_mail import run_child

SMALL = b"Subject: small\r\n\r\n" + b"s" * 60
LARGE = b"Subject: large\r\n\r\n" + b"L" * 3000


def open_tracked(root: Path, clock: FakeClock, **options: object) -> Spool:
    return Spool.open(str(root), clock=clock, outcomes=True, inline_body_max=1000, **options)


def bounce_one(sp: Spool, data: bytes) -> str:
    """Accept ``data`` for two recipients; deliver one, fail the other."""
    msg = sp.accept("alice@example.org", ["ok@example.net", "gone@example.net"], data)
    attempt = sp.claim()
    assert attempt is not None and attempt.msg_id == msg
    with attempt:
        attempt.delivered(["ok@example.net"], "250 2.0.0 queued as 1234")
        attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
    return msg


def body_files(root: Path) -> list[str]:
    return sorted(os.listdir(root / fmt.BODY_DIR))


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["inline", "file"])
def test_an_outcome_carries_the_sender_the_acceptance_every_reply_and_the_body(
    tmp_path: Path, data: bytes
) -> None:
    # Before: an outcome held the recipients' replies only; the sender, the acceptance
    # time and the message had to be looked up, and were gone once it finished.
    clock = FakeClock(1.8e9)
    with open_tracked(tmp_path / "spool", clock) as sp:
        accepted = clock.wall()
        msg = bounce_one(sp, data)
        clock.advance(5)
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.msg_id == msg
        assert outcome.sender == "alice@example.org"
        assert outcome.accepted_at == accepted
        replies = {o.recipient: (o.status, o.reply) for o in outcome.recipients}
        assert replies == {
            "ok@example.net": (rec.DELIVERED, "250 2.0.0 queued as 1234"),
            "gone@example.net": (rec.FAILED, "550 5.1.1 no such user"),
        }
        # A bounce returns the message: a small one was copied out of the log to a file.
        assert outcome.body is not None and outcome.body.kind == rec.BODY_FILE
        assert sp.outcome_body(outcome) == data


def test_a_bounced_body_outlives_its_segment_and_goes_with_the_acknowledgement(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    clock = FakeClock(1.8e9)
    with open_tracked(root, clock, segment_size=4096, retry_intervals=[60]) as sp:
        msg = sp.accept("alice@example.org", ["gone@example.net"], SMALL)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg
        with attempt:
            attempt.deferred(["gone@example.net"], "451 4.2.0 try later")
        for i in range(80):  # fill and finish several segments after it
            sp.accept("a@example.org", [f"r{i}@example.net"], SMALL)
        while (attempt := sp.claim()) is not None:
            with attempt:
                attempt.delivered(attempt.envelope.recipients, "250 ok")
        while (other := sp.next_outcome()) is not None:
            sp.ack_outcome(other.msg_id)
        clock.advance(61)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg
        with attempt:  # it finishes far from the segment that holds its body
            attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.msg_id == msg
        clock.advance(61)
        assert sp.claim() is None  # the runners pass the head
        sp.checkpoint()
        assert sp.statistics().segments_deleted > 0, "the message's segment must be gone"
        assert body_files(root) == [msg]
        report = check_spool(str(root))
        assert report.clean and not report.orphan_bodies, "a body kept for a bounce is no orphan"
        assert any("kept until their outcome is acknowledged" in n for n in report.notes)
        assert sp.outcome_body(outcome) == SMALL
        sp.ack_outcome(msg)
        sp.checkpoint()
        assert body_files(root) == []
        with pytest.raises(BodyGone, match="acknowledged"):
            sp.outcome_body(outcome)


def test_a_delivered_message_keeps_its_body_inline_and_says_so(tmp_path: Path) -> None:
    # Only an outcome that asks for a bounce costs a copy; the others name the inline body,
    # readable while its segment lasts.
    with open_tracked(tmp_path / "spool", FakeClock(1.8e9)) as sp:
        sp.accept("a@example.org", ["ok@example.net"], SMALL)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            attempt.delivered(["ok@example.net"], "250 ok")
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.body is not None
        assert outcome.body.kind == rec.BODY_INLINE and outcome.body.at is not None
        assert sp.outcome_body(outcome) == SMALL
    assert body_files(tmp_path / "spool") == []


def test_without_outcome_tracking_a_finished_body_file_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    with Spool.open(str(root), inline_body_max=1000) as sp:
        bounce_one(sp, LARGE)
        sp.checkpoint()
    assert body_files(root) == []


def test_recovery_removes_the_body_of_an_outcome_acknowledged_before_a_crash(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        from spool import Spool
        sp = Spool.open({str(root)!r}, outcomes=True, inline_body_max=1000,
                        checkpoint_interval=1e9)
        msg = sp.accept("a@example.org", ["gone@example.net"], b"L" * 3000)
        attempt = sp.claim()
        attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
        attempt.close()
        sp.checkpoint()
        outcome = sp.next_outcome()
        sp.ack_outcome(outcome.msg_id)   # durable; the file goes at the next checkpoint
        os._exit(0)                      # crash first
        """
    )
    assert len(body_files(root)) == 1
    with Spool.open(str(root)) as sp:
        assert sp.next_outcome(timeout=0) is None
    assert body_files(root) == [], "the acknowledged outcome's body file was left behind"
    assert check_spool(str(root)).clean


def test_an_outcome_not_acknowledged_before_a_crash_keeps_its_body(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        from spool import Spool
        sp = Spool.open({str(root)!r}, outcomes=True, inline_body_max=1000)
        msg = sp.accept("a@example.org", ["gone@example.net"], b"s" * 60)
        attempt = sp.claim()
        attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
        attempt.close()
        sp.sync()
        os._exit(0)
        """
    )
    with Spool.open(str(root)) as sp:
        outcome = sp.next_outcome(timeout=0)
        assert outcome is not None and outcome.sender == "a@example.org"
        assert sp.outcome_body(outcome) == b"s" * 60
        sp.ack_outcome(outcome.msg_id)
    assert body_files(root) == []


def test_an_outcome_body_needs_an_outcome(tmp_path: Path) -> None:
    with (
        open_tracked(tmp_path / "spool", FakeClock(1.8e9)) as sp,
        pytest.raises(SpoolMisuse, match="MessageOutcome"),
    ):
        sp.outcome_body("6B49D200601C512B")  # type: ignore[arg-type]


# --- operator actions on a message in flight ---------------------------------------------


@pytest.mark.parametrize("action", ["delete", "bounce", "hold", "hold-release"])
def test_an_operator_action_on_a_message_in_flight_survives_a_crash(
    tmp_path: Path, action: str
) -> None:
    # Before: the action lived in memory until the attempt ended; a crash first brought
    # the message back, due, as if the operator had done nothing.
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        from spool import Spool
        sp = Spool.open({str(root)!r}, outcomes=True)
        msg = sp.accept("a@example.org", ["x@example.net", "y@example.net"], b"hi")
        attempt = sp.claim()
        attempt.delivered(["x@example.net"], "250 ok")
        action = {action!r}
        if action == "delete":
            sp.delete(msg, "spam, removed")
        elif action == "bounce":
            sp.bounce(msg, "554 5.7.1 relaying to them stopped")
        else:
            sp.hold(msg, "quarantine")
            if action == "hold-release":
                sp.release(msg)
        os._exit(0)                 # crash with the attempt still open
        """
    )
    with Spool.open(str(root)) as sp:
        queue = list(sp.list())
        outcome = sp.next_outcome(timeout=0)
    if action in ("delete", "bounce"):
        assert queue == []
        assert outcome is not None
        statuses = {o.recipient: (o.status, o.reply) for o in outcome.recipients}
        assert statuses["x@example.net"] == (rec.DELIVERED, "250 ok")
        expected = (
            (rec.DELETED, "spam, removed")
            if action == "delete"
            else (rec.FAILED, "554 5.7.1 relaying to them stopped")
        )
        assert statuses["y@example.net"] == expected
        assert outcome.reason == f"{action}d by the operator"
    else:
        assert [e.recipients for e in queue] == [("y@example.net",)]
        assert queue[0].held == ("quarantine" if action == "hold" else None)
        assert outcome is None


# --- found by an adversarial review of the above -----------------------------------------


def traffic_through(sp: Spool, count: int, *, ack: bool) -> None:
    """Deliver ``count`` small messages, a checkpoint after each (outcomes acked if asked)."""
    for i in range(count):
        sp.accept("a@example.org", [f"t{i}@example.net"], SMALL)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            attempt.delivered(attempt.envelope.recipients, "250 ok")
        while ack and (done := sp.next_outcome(timeout=0)) is not None:
            sp.ack_outcome(done.msg_id)
        sp.checkpoint()


def test_a_bounce_copied_before_a_crash_does_not_pin_its_segment_for_ever(
    tmp_path: Path,
) -> None:
    # Before: the live spool released the inline body's segment when it copied the body
    # for the bounce, but recovery, replaying that finish, kept it pinned: the garbage
    # front stopped there and the log grew without bound.
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        from spool import Spool
        sp = Spool.open({str(root)!r}, outcomes=True, inline_body_max=1000,
                        segment_size=4096, checkpoint_interval=1e9)
        sp.accept("a@example.org", ["gone@example.net"], {SMALL!r})
        attempt = sp.claim()
        attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
        attempt.close()            # the finish names the copy
        sp.sync()
        os._exit(0)                # no checkpoint since
        """
    )
    with Spool.open(str(root), checkpoint_interval=1e9) as sp:
        traffic_through(sp, 60, ack=True)
        assert sp.statistics().segments_deleted > 0, "the bounced body's segment stays pinned"


def test_a_bounce_finished_by_recovery_keeps_its_body_until_acknowledged(
    tmp_path: Path,
) -> None:
    # Before: a finish written by recovery (the attempt's failed() was durable, its close
    # never came) kept the body inline, and its segment went before the bounce was sent.
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        from spool import Spool
        sp = Spool.open({str(root)!r}, outcomes=True, inline_body_max=1000,
                        segment_size=4096, checkpoint_interval=1e9)
        sp.accept("a@example.org", ["gone@example.net"], {SMALL!r})
        attempt = sp.claim()
        attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
        os._exit(0)                # before the attempt closes
        """
    )
    with Spool.open(str(root), checkpoint_interval=1e9) as sp:
        outcome = sp.next_outcome(timeout=0)
        assert outcome is not None and outcome.body is not None
        assert outcome.body.kind == rec.BODY_FILE
        traffic_through(sp, 60, ack=False)
        assert sp.outcome_body(outcome) == SMALL


def test_a_repair_of_the_settings_keeps_the_bodies_kept_for_bounces(tmp_path: Path) -> None:
    # Before: with the settings file damaged, `check --repair` could not tell that outcomes
    # were tracked, called the kept bodies orphans and moved them to corrupt/.
    root = tmp_path / "spool"
    with open_tracked(root, FakeClock(1.8e9)) as sp:
        bounce_one(sp, LARGE)
    settings = root / fmt.SETTINGS_NAME
    raw = bytearray(settings.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    settings.write_bytes(bytes(raw))
    report = repair_spool(str(root))
    assert report.after.clean and not report.before.orphan_bodies
    with Spool.open(str(root)) as sp:
        outcome = sp.next_outcome(timeout=0)
        assert outcome is not None and sp.outcome_body(outcome) == LARGE


def test_a_repair_names_where_a_lost_body_file_went_in_the_bounce(tmp_path: Path) -> None:
    # Before: a damaged or missing body file was reported "at 0:0 (0 bytes)", and the
    # bounce said its damaged bytes were kept as "corrupt/ (the copy of segment 0)": a
    # copy that does not exist; the damaged file had gone to corrupt/body.ID.*.bad, and a
    # missing file left nothing to keep.
    root = tmp_path / "spool"
    with open_tracked(root, FakeClock(1.8e9)) as sp:
        damaged = sp.accept("a@example.org", ["d@example.net"], LARGE)
        missing = sp.accept("a@example.org", ["m@example.net"], LARGE + b"!")
        sp.checkpoint()  # the body files move to bodies/
    raw = bytearray((root / fmt.BODY_DIR / damaged).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (root / fmt.BODY_DIR / damaged).write_bytes(bytes(raw))
    (root / fmt.BODY_DIR / missing).unlink()
    where = {a.msg_id: str(a.region) for a in check_spool(str(root)).affected}
    assert where == {
        damaged: f"{fmt.BODY_DIR}/{damaged}",
        missing: f"{fmt.BODY_DIR}/{missing}",
    }
    report = repair_spool(str(root))
    assert report.after.clean
    (kept,) = os.listdir(root / fmt.CORRUPT_DIR)
    assert kept.startswith(f"body.{damaged}.") and kept.endswith(".bad")
    with Spool.open(str(root)) as sp:
        replies = {}
        for _ in range(2):
            outcome = sp.next_outcome(timeout=0)
            assert outcome is not None
            (failed,) = outcome.failed
            replies[outcome.msg_id] = failed.reply
            sp.ack_outcome(outcome.msg_id)
    assert replies[damaged].endswith(f"kept as {fmt.CORRUPT_DIR}/{kept}")
    assert replies[missing].startswith("554 5.3.0") and "body file was missing" in replies[missing]


@pytest.mark.parametrize("crash", ["before the positions", "none"])
def test_turning_tracking_on_tracks_the_mail_that_finishes_from_then_on(
    tmp_path: Path, crash: str
) -> None:
    # Before: mail that finished while tracking was off, in the part of the log a crash
    # left after the positions, was handed out as an outcome once tracking was turned on;
    # its body file was already gone, so outcome_body raised CorruptSpool.
    root = tmp_path / "spool"
    run_child(
        f"""
        import os
        import spool.checkpoints
        from spool import Spool
        sp = Spool.open({str(root)!r}, inline_body_max=1000, checkpoint_interval=1e9)
        sp.accept("a@example.org", ["gone@example.net"], {LARGE!r})
        attempt = sp.claim()
        attempt.failed(["gone@example.net"], "550 5.1.1 no such user")
        attempt.close()
        if {crash!r} != "none":
            # The crash: the checkpoint removed the finished body file, then died.
            spool.checkpoints.store_positions = lambda *args: os._exit(0)
        sp.close()
        os._exit(0)
        """
    )
    with open_tracked(root, FakeClock(1.8e9)) as sp:
        assert sp.next_outcome(timeout=0) is None, "an outcome of mail finished untracked"
        msg = bounce_one(sp, LARGE)
        outcome = sp.next_outcome(timeout=0)
        assert outcome is not None and outcome.msg_id == msg
        assert sp.outcome_body(outcome) == LARGE
    assert check_spool(str(root)).clean
