"""An attempt that is never closed must not pin the log (``attempt_timeout``).

Goal: a worker that hangs holding an attempt costs a bounded log and a bounded restart:
past ``attempt_timeout`` the spool closes the attempt as deferred, the message is attempted
again, and the hung worker's late report gets ``AttemptExpired`` and changes nothing.
Before, one attempt held open for a simulated day grew the log fourfold and the next
restart scanned every record of that day.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spool import AttemptExpired, Spool
from spool.testing import FakeClock

HOUR = 3600.0
DATA = b"Subject: traffic\r\n\r\n" + b"y" * 3000 + b"\r\n"
OPTIONS = {
    "retry_intervals": (300.0,),
    "segment_size": 64 * 1024,
    "checkpoint_interval": 10**6,  # checkpoints by hand, at each simulated minute
}


def traffic(sp: Spool, clock: FakeClock, minutes: int) -> None:
    """A message a minute, each delivered at once; a checkpoint every minute."""
    for _ in range(minutes):
        sp.accept("from@example.org", ["to@example.net"], DATA)
        while (attempt := sp.claim(timeout=0)) is not None:
            with attempt:
                attempt.delivered(attempt.envelope.recipients, "250 ok")
        clock.advance(60)
        sp.checkpoint()


def test_a_hung_attempt_is_closed_as_deferred_and_its_late_report_refused(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    with Spool.open(tmp_path / "spool", clock=clock, attempt_timeout=HOUR, **OPTIONS) as sp:  # type: ignore[arg-type]
        msg_id = sp.accept("from@example.org", ["a@example.net", "b@example.net"], DATA)
        hung = sp.claim(timeout=0)
        assert hung is not None
        hung.delivered(["a@example.net"], "250 ok")  # one reported before it hung
        clock.advance(HOUR - 1)
        sp.checkpoint()
        assert sp.statistics().leases_expired == 0  # not yet
        clock.advance(1)
        sp.checkpoint()
        assert sp.statistics().leases_expired == 1
        with pytest.raises(AttemptExpired, match="attempt_timeout"):
            hung.delivered(["b@example.net"], "250 ok")
        with pytest.raises(AttemptExpired):
            hung.read_data()
        hung.close()  # still fine: closing is idempotent
        clock.advance(300)
        again = sp.claim(timeout=0)
        assert again is not None and again.msg_id == msg_id
        assert again.envelope.recipients == ("b@example.net",)  # "a" stays delivered
        again.close()


def test_a_day_with_a_hung_attempt_keeps_the_log_and_the_restart_bounded(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    clock = FakeClock()
    sp = Spool.open(root, clock=clock, attempt_timeout=HOUR, **OPTIONS)  # type: ignore[arg-type]
    sp.accept("from@example.org", ["hung@example.net"], DATA)
    hung = sp.claim(timeout=0)  # a worker takes it and hangs (holding it)
    assert hung is not None
    traffic(sp, clock, minutes=2 * 60)
    segments_after_two_hours = sp.statistics().segments
    traffic(sp, clock, minutes=22 * 60)
    # The log covers about the last lease (and retry interval), not the whole day; and
    # a restart after a crash now would scan from a recent position, not the day's start.
    assert sp.statistics().segments <= segments_after_two_hours
    positions = sp.checkpoint()
    assert positions.working_start.segment >= positions.consistent.segment - 1
    assert positions.front.segment >= positions.consistent.segment - segments_after_two_hours
    assert hung.msg_id  # held to the end
    sp.close()
