"""Bounces: the RFC 3464 notice (``dsn.py``) and the bouncer that queues it (``bouncing.py``),
on a real spool."""

from __future__ import annotations

import email
import email.policy
from email.message import EmailMessage
from pathlib import Path

import pytest

from spool import Spool
from spool import records as rec
from spool.bouncing import Bouncer
from spool.dsn import delivery_status_notification, header_section, seven_bit, status_of
from spool.outcomes import MessageOutcome

ORIGINAL = b"Subject: hi\r\nFrom: a@example.org\r\nMessage-ID: <1@example.org>\r\n\r\nbody\r\n"


def outcome(*recipients: rec.Outcome, sender: str = "a@example.org") -> MessageOutcome:
    return MessageOutcome("6B49D20000000001", 1.8e9, "failed", recipients, sender, 1.79e9)


def parse(data: bytes) -> EmailMessage:
    msg = email.message_from_bytes(data, policy=email.policy.default)
    assert isinstance(msg, EmailMessage)
    return msg


def test_a_notice_is_a_delivery_status_report_naming_each_failed_recipient() -> None:
    notice = delivery_status_notification(
        outcome(
            rec.Outcome("nouser@example.net", rec.FAILED, "550 5.1.1 no such user", 1.8e9),
            rec.Outcome("ok@example.net", rec.DELIVERED, "250 ok", 1.8e9),
            rec.Outcome("late@example.net", rec.FAILED, "554 5.4.7 message expired", 1.8e9),
            rec.Outcome("gone@example.net", rec.DELETED, "deleted by the operator", 1.8e9),
        ),
        ORIGINAL,
        reporting_mta="mx.example.org",
    )
    msg = parse(notice)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert msg["To"].addresses[0].addr_spec == "a@example.org"
    assert msg["Auto-Submitted"] == "auto-replied"
    assert "MAILER-DAEMON@mx.example.org" in msg["From"]
    text, status, headers = msg.iter_parts()
    assert text.get_content_type() == "text/plain"
    assert "<nouser@example.net>: 550 5.1.1 no such user" in text.get_content()
    assert status.get_content_type() == "message/delivery-status"
    per_message, *blocks = status.get_payload()
    assert per_message["Reporting-MTA"] == "dns; mx.example.org"
    assert per_message["X-Spool-Queue-ID"] == "6B49D20000000001"
    fields = ("Final-Recipient", "Action", "Status", "Diagnostic-Code")
    assert [tuple(b[f] for f in fields) for b in blocks] == [
        ("rfc822; nouser@example.net", "failed", "5.1.1", "smtp; 550 5.1.1 no such user"),
        ("rfc822; late@example.net", "failed", "5.4.7", "smtp; 554 5.4.7 message expired"),
    ]  # fmt: skip
    assert headers.get_content_type() == "text/rfc822-headers"
    assert "Message-ID: <1@example.org>" in headers.get_content()
    assert b"body\r\n" not in notice.split(b"text/rfc822-headers")[1]  # headers only


def test_statuses_non_ascii_recipients_and_a_lost_original() -> None:
    assert status_of("550 5.1.1 no such user") == "5.1.1"
    assert status_of("452 4.2.2 mailbox full") == "5.2.2"  # failed for good: class 5
    assert status_of("550 no such user") == status_of("garbage") == "5.0.0"
    assert seven_bit("dörte@exämple.net") == "d\\x{F6}rte@ex\\x{E4}mple.net"
    assert seven_bit("a\\b@example.net") == "a\\x{5C}b@example.net"
    assert header_section(b"A: 1\nB: 2\n\nbody") == b"A: 1\r\nB: 2\r\n"
    notice = delivery_status_notification(
        outcome(rec.Outcome("dörte@exämple.net", rec.FAILED, "550 5.1.1 unknown", 1.8e9)),
        None,
        reporting_mta="mx.example.org",
    )
    msg = parse(notice)
    assert [p.get_content_type() for p in msg.iter_parts()] == [
        "text/plain", "message/delivery-status",
    ]  # fmt: skip
    (_, block) = list(msg.iter_parts())[1].get_payload()
    assert block["Final-Recipient"] == "utf-8; d\\x{F6}rte@ex\\x{E4}mple.net"
    assert notice.isascii()
    with pytest.raises(ValueError):
        delivery_status_notification(
            outcome(rec.Outcome("b@example.net", rec.FAILED, "550", 1.8e9), sender=""),
            None,
            reporting_mta="mx.example.org",
        )


def _finish(sp: Spool, sender: str, failed: str, delivered: str | None = None) -> str:
    rcpts = [failed] + ([delivered] if delivered else [])
    msg_id = sp.accept(sender, rcpts, ORIGINAL)
    attempt = sp.claim()
    assert attempt is not None and attempt.msg_id == msg_id
    with attempt:
        attempt.failed([failed], "550 5.1.1 no such user")
        if delivered:
            attempt.delivered([delivered], "250 ok")
    return msg_id


def test_the_bouncer_queues_one_bounce_and_never_bounces_a_bounce(tmp_path: Path) -> None:
    with Spool.open(tmp_path / "spool", outcomes=True) as sp:
        bouncer = Bouncer(sp, "mx.example.org")
        original = _finish(sp, "a@example.org", "nouser@example.net", "ok@example.net")
        found = sp.next_outcome()
        assert found is not None and found.msg_id == original
        assert bouncer.handle(found)
        (bounce,) = sp.list()
        assert bounce.sender == "" and bounce.recipients == ("a@example.org",)
        assert sp.next_outcome() is None  # acknowledged
        # The bounce itself fails: logged and dropped, never bounced.
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == bounce.msg_id
        notice = attempt.read_data()
        with attempt:
            attempt.failed(["a@example.org"], "550 5.1.1 gone")
        found = sp.next_outcome()
        assert found is not None and found.msg_id == bounce.msg_id
        assert bouncer.handle(found)
        assert list(sp.list()) == [] and sp.next_outcome() is None and bouncer.sent == 1
    assert b"Final-Recipient: rfc822; nouser@example.net" in notice
    assert b"ok@example.net" not in notice.split(b"message/delivery-status")[1]


def test_the_bouncer_thread_sends_what_the_spool_tracks_and_stops(tmp_path: Path) -> None:
    import time

    with Spool.open(tmp_path / "spool", outcomes=True) as sp:
        ids = [_finish(sp, "a@example.org", f"nouser{i}@example.net") for i in range(5)]
        bouncer = Bouncer(sp, "mx.example.org")
        bouncer.start()
        try:
            deadline = time.monotonic() + 30
            while bouncer.sent < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            bouncer.stop()
        bounces = list(sp.list())
    assert bouncer.sent == 5 and len(bounces) == 5 and len(ids) == 5
    assert all(b.sender == "" and b.recipients == ("a@example.org",) for b in bounces)
