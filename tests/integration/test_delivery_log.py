"""The delivery log: one maillog-style line per accepted message, recipient outcome and
operator action, through Python's logging (in process), and in ``spool serve``'s log file."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spool import Spool, connect
from spool.delivery_log import dsn_of
from spool.testing import FakeClock
from tests.serve.running import owner

ID = r"[0-9A-F]{16}"


class Lines(logging.Handler):
    """Every line the spool's loggers emit, as (logger, text)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.name, record.getMessage()))

    def of(self, logger: str) -> list[str]:
        return [text for name, text in self.lines if name == logger]


@pytest.fixture
def log() -> Iterator[Lines]:
    handler = Lines()
    spool_logger = logging.getLogger("spool")
    level = spool_logger.level
    spool_logger.addHandler(handler)
    spool_logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        spool_logger.removeHandler(handler)
        spool_logger.setLevel(level)


def test_an_attempt_logs_a_line_per_recipient_as_maillog(spool_dir: str, log: Lines) -> None:
    clock = FakeClock()
    with Spool.open(spool_dir, clock=clock) as sp:
        msg_id = sp.accept(
            "alice@example.org",
            ["bob@example.net", "carol@example.net", "dave@example.net"],
            b"Subject: x\r\n\r\nhello\r\n",
        )
        clock.advance(2.0)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            clock.advance(0.5)
            attempt.delivered(["bob@example.net"], "250 2.0.0 Ok: queued as 4711")
            attempt.failed(["carol@example.net"], "550 5.1.1 no such user")
            # dave is not reported: the close defers him
    assert log.of("spool.accept") == [f"{msg_id}: from=<alice@example.org>, size=21, nrcpt=3"]
    assert log.of("spool.delivery") == [
        f"{msg_id}: to=<bob@example.net>, delay=2.50, delays=2.00/0.50, dsn=2.0.0, "
        "status=sent (250 2.0.0 Ok: queued as 4711)",
        f"{msg_id}: to=<carol@example.net>, delay=2.50, delays=2.00/0.50, dsn=5.1.1, "
        "status=bounced (550 5.1.1 no such user)",
        f"{msg_id}: to=<dave@example.net>, delay=2.50, delays=2.00/0.50, dsn=4.4.0, "
        "status=deferred (451 4.4.0 delivery attempt ended without a result)",
    ]
    assert log.of("spool.queue") == []  # dave keeps it queued


def test_expiry_operator_actions_and_removal_are_logged(spool_dir: str, log: Lines) -> None:
    clock = FakeClock()
    with Spool.open(spool_dir, clock=clock, max_lifetime=3600) as sp:
        old = sp.accept("a@example.org", ["b@example.net"], b"x")
        kept = sp.accept("a@example.org", ["c@example.net"], b"y")
        sp.hold(kept, "their MX is down")
        clock.advance(3601)
        assert sp.claim(timeout=0) is None  # the old message expires instead of an attempt
        sp.release(kept)
        gone = sp.accept("a@example.org", ["d@example.net"], b"z")
        sp.delete(gone, "spam")
    delivery = log.of("spool.delivery")
    assert any(
        re.fullmatch(rf"{old}: to=<b@example.net>, .*dsn=5\.4\.7, status=expired \(.*\)", line)
        for line in delivery
    ), delivery
    assert any(f"{gone}: to=<d@example.net>" in s and "status=deleted" in s for s in delivery)
    assert log.of("spool.operator") == [
        f"{kept}: placed on hold (their MX is down)",
        f"{kept}: released from hold",
    ]
    removed = log.of("spool.queue")
    assert f"{old}: removed (expired)" in removed
    assert f"{gone}: removed (deleted by the operator)" in removed


def test_dsn_comes_from_the_enhanced_code_or_the_basic_one() -> None:
    assert dsn_of("250 2.1.5 Ok") == "2.1.5"
    assert dsn_of("421 mx.example.net closing") == "4.0.0"
    assert dsn_of("554 no") == "5.0.0"
    assert dsn_of("connection refused") == "4.0.0"


def test_spool_serve_writes_the_delivery_log_to_its_log_file(tmp_path: Path) -> None:
    d, log_file = str(tmp_path / "spool"), tmp_path / "maillog"
    agent = "python:tests.serve.agents_for_tests:by_local_part"
    args = ("--agent", agent, "--workers", "1", "--log-file", str(log_file))
    with owner(d, *args, "--log-format", "json"), connect(d) as client:
        msg_id = client.accept("a@example.org", ["ok1@example.net", "nouser@example.net"], b"x")
        deadline = time.monotonic() + 30
        while "removed" not in (log_file.read_text() if log_file.exists() else ""):
            assert time.monotonic() < deadline, log_file.read_text()
            time.sleep(0.1)
    rows = [json.loads(line) for line in log_file.read_text().splitlines()]
    by_logger = {}
    for row in rows:
        by_logger.setdefault(row["logger"], []).append(row["message"])
    assert by_logger["spool.accept"] == [f"{msg_id}: from=<a@example.org>, size=1, nrcpt=2"]
    sent, bounced = sorted(by_logger["spool.delivery"], key=lambda m: "nouser" in m)
    assert re.fullmatch(rf"{ID}: to=<ok1@example.net>, .*, dsn=2\.0\.0, status=sent \(.*\)", sent)
    assert "to=<nouser@example.net>" in bounced and "status=bounced" in bounced
    assert f"{msg_id}: removed (all recipients settled)" in by_logger["spool.queue"]


def test_a_handler_that_raises_never_fails_a_recorded_outcome(spool_dir: str) -> None:
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("the embedder's handler is broken")

    broken = Broken()
    spool_logger = logging.getLogger("spool")
    level = spool_logger.level
    spool_logger.addHandler(broken)
    spool_logger.setLevel(logging.INFO)
    try:
        with Spool.open(spool_dir) as sp:
            sp.accept("a@example.org", ["b@example.net"], b"x")
            attempt = sp.claim()
            assert attempt is not None
            with attempt:
                attempt.delivered(["b@example.net"], "250 2.0.0 ok")
            assert list(sp.list()) == []
    finally:
        spool_logger.removeHandler(broken)
        spool_logger.setLevel(level)
