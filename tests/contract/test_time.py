"""A wall clock that steps, within an open and across a restart (docs/design.md, "Time").

Goal: neither a forward nor a backward step of the wall clock, while the spool is open or
between two opens, expires mail early, wedges fresh mail behind an envelope stamped in the
future, or holds a deferred message back longer than its retry interval. Each test failed
before the rule (the spool's time followed the wall clock and never went back).
"""

from __future__ import annotations

from pathlib import Path

from spool import Spool
from spool.testing import FakeClock

DAY = 86_400.0
INTERVALS = (300.0,)  # every deferral waits five minutes
OPTIONS = {"retry_intervals": INTERVALS, "max_lifetime": 5 * DAY, "checkpoint_interval": 10**6}
START = 1_800_000_000.0


def open_spool(root: Path, clock: FakeClock) -> Spool:
    return Spool.open(root, clock=clock, **OPTIONS)  # type: ignore[arg-type]


def accept(sp: Spool, name: str) -> str:
    return sp.accept("from@example.org", [f"{name}@example.net"], b"Subject: x\r\n\r\nbody\r\n")


def deliver_due(sp: Spool) -> list[str]:
    """Deliver everything due now; the ids in the order the spool handed them out."""
    ids = []
    while (attempt := sp.claim(timeout=0)) is not None:
        ids.append(attempt.msg_id)
        with attempt:
            attempt.delivered(attempt.envelope.recipients, "250 2.0.0 ok")
    return ids


def claim_one(sp: Spool, msg_id: str) -> None:
    """Claim ``msg_id`` (the only message due) and defer it, as greylisting does."""
    attempt = sp.claim(timeout=0)
    assert attempt is not None and attempt.msg_id == msg_id
    attempt.deferred(attempt.envelope.recipients, "450 4.7.1 greylisted, try again in 5 minutes")
    attempt.close()


def test_a_forward_step_for_a_moment_within_an_open_expires_nothing_and_delays_nothing(
    tmp_path: Path,
) -> None:
    clock = FakeClock(START)
    with open_spool(tmp_path / "spool", clock) as sp:
        greylisted = accept(sp, "grey")
        claim_one(sp, greylisted)  # deferred: due again in 300 s (class 1)
        clock.advance(60)
        fresh = accept(sp, "fresh")  # accepted a minute before the step
        clock.step(10 * DAY)  # the clock jumps ten days ahead ...
        attempt = sp.claim(timeout=0)
        assert attempt is not None and attempt.msg_id == fresh  # ... and it did not expire
        assert sp.statistics().expired == 0
        assert abs(sp.statistics().clock_skew - 10 * DAY) < 1
        attempt.deferred(attempt.envelope.recipients, "450 greylisted")  # deferred during the step
        attempt.close()
        clock.step(-10 * DAY)  # ... and is corrected
        clock.advance(300)
        # Both are due after their interval of real time, not ten days later.
        assert sorted(deliver_due(sp)) == sorted([greylisted, fresh])
        assert sp.statistics().expired == 0


def test_a_backward_step_within_an_open_neither_stalls_fresh_mail_nor_retries(
    tmp_path: Path,
) -> None:
    clock = FakeClock(START)
    with open_spool(tmp_path / "spool", clock) as sp:
        first = accept(sp, "first")
        claim_one(sp, first)
        clock.step(-DAY)  # a host a day fast, corrected while the spool runs
        fresh = accept(sp, "fresh")
        assert deliver_due(sp) == [fresh]
        clock.advance(300)
        assert deliver_due(sp) == [first]


def test_a_clock_set_back_across_a_restart_does_not_stall_fresh_mail(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    clock = FakeClock(START + DAY)  # a day fast
    with open_spool(root, clock) as sp:
        deferred = accept(sp, "deferred")
        claim_one(sp, deferred)
        waiting = accept(sp, "waiting")  # never claimed before the restart
    clock.step(-DAY)  # corrected while the spool was down
    opened_at = clock.wall()
    with open_spool(root, clock) as sp:
        fresh = accept(sp, "fresh")
        # Before: runner 0 stopped at "waiting", stamped a day ahead, and "fresh" behind
        # it waited a day. The deferred one, stamped in the future, is due at once too.
        handed = []
        while (attempt := sp.claim(timeout=0)) is not None:
            handed.append(attempt.msg_id)
            with attempt:
                if attempt.msg_id == deferred:
                    attempt.deferred(attempt.envelope.recipients, "451 still greylisted")
                else:
                    attempt.delivered(attempt.envelope.recipients, "250 ok")
        assert sorted(handed) == sorted([waiting, fresh, deferred])
        (entry,) = sp.list()
        # Rewritten, it is no longer accepted in the future: its lifetime runs from the open.
        assert entry.accepted_at == opened_at
        assert deliver_due(sp) == []  # and its new stamp is true: due in 300 s
    clock.advance(5 * DAY - 1)
    with open_spool(root, clock) as sp:
        assert deliver_due(sp) == [deferred]  # not expired a second early
        assert sp.statistics().expired == 0


def test_a_message_stamped_in_the_future_expires_when_its_lifetime_from_the_open_is_over(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    clock = FakeClock(START + DAY)
    with open_spool(root, clock) as sp:
        deferred = accept(sp, "deferred")
        claim_one(sp, deferred)
    clock.step(-DAY)
    with open_spool(root, clock) as sp:
        clock.advance(5 * DAY - 300)
        claim_one(sp, deferred)  # still alive
        clock.advance(300)  # five days after this open, not six
        assert deliver_due(sp) == []
        assert sp.statistics().expired == 1


def test_a_clock_set_forward_across_a_restart_then_corrected_wedges_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    clock = FakeClock(START)
    with open_spool(root, clock) as sp:
        deferred = accept(sp, "deferred")
        claim_one(sp, deferred)
    clock.step(DAY)  # the spool restarts while the clock is a day ahead
    with open_spool(root, clock) as sp:
        # The time the spool was down (as far as the clock can tell) has passed: due now.
        assert deliver_due(sp) == [deferred]
        clock.step(-DAY)  # corrected while the spool runs: its time goes on unchanged
        fresh = accept(sp, "fresh")
        assert deliver_due(sp) == [fresh]
        grey = accept(sp, "grey")
        claim_one(sp, grey)  # deferred, stamped a day in the future
        later = accept(sp, "later")  # stamped a day in the future
    with open_spool(root, clock) as sp:  # restarted under the corrected clock
        newest = accept(sp, "newest")
        # Stamped a day ahead, the envelopes of the fast open are all due at once.
        assert sorted(deliver_due(sp)) == sorted([later, newest, grey])
        assert sp.statistics().expired == 0


def test_after_a_clock_correction_short_opens_still_retry_deferred_mail(tmp_path: Path) -> None:
    # Before: each open counted a future-stamped envelope as written at the open, due one
    # interval later; opens shorter than the interval (a queue run from cron) never got
    # there, and the message waited a day while its segment pinned the log.
    root = tmp_path / "spool"
    clock = FakeClock(START + DAY)
    with open_spool(root, clock) as sp:
        deferred = accept(sp, "deferred")
        claim_one(sp, deferred)
    clock.step(-DAY)
    for _minute in range(10):
        with open_spool(root, clock) as sp:
            handed = deliver_due(sp)
            clock.advance(20)
        if handed:
            break
        clock.advance(40)
    assert handed == [deferred]
