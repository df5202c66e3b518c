"""Queue runners, fairness, expiry, outcomes and operator actions, driven by a fake clock."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spool import Attempt, Spool, SpoolError
from spool import format as fmt
from spool.spool import DELETED_REPLY, EXPIRED_REPLY
from spool.testing import FakeClock

RCPTS = ["bob@example.net", "carol@example.com"]
DATA = b"Subject: queue test\r\n\r\nbody\r\n"


def defer_all(sp: Spool) -> str:
    attempt = sp.claim()
    assert attempt is not None
    with attempt:
        attempt.deferred(attempt.envelope.recipients, "451 4.3.0 later")
    return attempt.msg_id


def test_claim_alternates_between_fresh_and_deferred_mail(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[60]) as sp:
        old = [sp.accept("a@example.org", [f"old{i}@example.net"], DATA) for i in range(3)]
        for _ in old:
            defer_all(sp)
        sp.sync()
        clock.advance(61)
        new = [sp.accept("a@example.org", [f"new{i}@example.net"], DATA) for i in range(3)]
        order = []
        while (attempt := sp.claim()) is not None:
            order.append("new" if attempt.msg_id in new else "old")
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
    assert sorted(order) == ["new"] * 3 + ["old"] * 3
    assert all(a != b for a, b in itertools.pairwise(order)), order


def test_max_in_flight_bounds_the_attempts_handed_out(spool_dir: str) -> None:
    with Spool.open(spool_dir, max_in_flight=2) as sp:
        for i in range(5):
            sp.accept("a@example.org", [f"r{i}@example.net"], DATA)
        first, second = sp.claim(), sp.claim()
        assert first is not None and second is not None
        assert sp.claim() is None
        first.close()
        third = sp.claim()
        assert third is not None
        second.close()
        third.close()


def test_concurrent_claims_never_share_a_message(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        for i in range(200):
            sp.accept("a@example.org", [f"r{i}@example.net"], DATA)
        seen: list[str] = []
        lock = threading.Lock()

        def worker() -> None:
            while (attempt := sp.claim()) is not None:
                with attempt:
                    with lock:
                        seen.append(attempt.msg_id)
                    attempt.delivered(attempt.envelope.recipients, "250 ok")

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(seen) == 200 and len(set(seen)) == 200


def test_claim_with_timeout_wakes_when_mail_arrives(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        timer = threading.Timer(0.2, sp.accept, ("a@example.org", ["b@example.net"], DATA))
        timer.start()
        attempt = sp.claim(timeout=10)
        timer.join()
        assert attempt is not None
        attempt.close()


def test_attempts_iterator_ends_when_the_spool_closes(spool_dir: str) -> None:
    sp = Spool.open(spool_dir)
    sp.accept("a@example.org", ["b@example.net"], DATA)
    got = []

    def loop() -> None:
        for attempt in sp.attempts(poll=0.05):
            got.append(attempt.msg_id)
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()

    t = threading.Thread(target=loop)
    t.start()
    threading.Event().wait(0.3)
    sp.close()
    t.join(timeout=10)
    assert not t.is_alive() and len(got) == 1


def test_messages_past_max_lifetime_fail_with_a_reply_that_says_so(
    spool_dir: str, clock: FakeClock
) -> None:
    with Spool.open(
        spool_dir, clock=clock, retry_intervals=[3600], max_lifetime=5000, outcomes=True
    ) as sp:
        msg_id = sp.accept("a@example.org", RCPTS, DATA)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            attempt.delivered(["bob@example.net"], "250 ok")
            attempt.deferred(["carol@example.com"], "451 later")
        sp.sync()
        clock.advance(3601)
        assert sp.claim() is not None  # still within the lifetime: attempted
        sp.close()
    clock.advance(3601)
    with Spool.open(
        spool_dir, clock=clock, retry_intervals=[3600], max_lifetime=5000, outcomes=True
    ) as sp:
        assert sp.claim() is None  # expired on the runner's pass, not handed out
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.msg_id == msg_id
        statuses = {o.recipient: (o.status, o.reply) for o in outcome.recipients}
        assert statuses == {
            "bob@example.net": ("delivered", "250 ok"),
            "carol@example.com": ("failed", EXPIRED_REPLY),
        }
        assert sp.statistics().expired == 1


def test_outcomes_survive_a_restart_until_acknowledged(spool_dir: str) -> None:
    with Spool.open(spool_dir, outcomes=True) as sp:
        ids = [sp.accept("a@example.org", RCPTS, DATA) for _ in range(3)]
        while (attempt := sp.claim()) is not None:
            with attempt:
                attempt.delivered(["bob@example.net"], "250 ok")
                attempt.failed(["carol@example.com"], "550 5.1.1 unknown user")
        sp.sync()
        first = sp.next_outcome()
        assert first is not None
        assert [o.recipient for o in first.failed] == ["carol@example.com"]
        sp.ack_outcome(first.msg_id)
        second = sp.next_outcome()
        assert second is not None  # handed out, never acknowledged
        with pytest.raises(KeyError):
            sp.ack_outcome("0000000000000000")
    with Spool.open(spool_dir, outcomes=True) as sp:
        again = [o.msg_id for o in iter(sp.next_outcome, None)]
    assert sorted(again) == sorted(set(ids) - {first.msg_id})


def test_outcomes_need_to_be_switched_on(sp: Spool) -> None:
    with pytest.raises(SpoolError, match="outcomes=True"):
        sp.next_outcome()


def test_list_and_show_describe_the_live_queue(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[300]) as sp:
        fresh = sp.accept("a@example.org", RCPTS, DATA)
        deferred = sp.accept("", ["x@example.net"], DATA)
        done = sp.accept("a@example.org", ["y@example.net"], DATA)
        attempts = {a.msg_id: a for a in iter(sp.claim, None)}
        assert set(attempts) == {fresh, deferred, done}
        with attempts[deferred] as a:
            a.deferred(a.envelope.recipients, "451 greylisted")
        with attempts[done] as a:
            a.delivered(a.envelope.recipients, "250 ok")
        # attempts[fresh] stays in flight
        entries = {e.msg_id: e for e in sp.list()}
        assert set(entries) == {fresh, deferred}
        assert entries[fresh].state == "active"
        d = entries[deferred]
        assert (d.state, d.attempts, d.klass, d.recipients) == (
            "deferred",
            1,
            1,
            ("x@example.net",),
        )
        assert d.next_attempt_at == pytest.approx(clock() + 300)
        assert d.last_reply == "451 greylisted" and d.body_size == len(DATA)
        kinds = [type(r).__name__ for _, r in sp.show(deferred)]
        assert kinds == ["Envelope", "Start", "Delta", "Envelope"]
        with pytest.raises(KeyError):
            sp.show("FFFFFFFFFFFFFFFF")


def test_hold_release_delete_and_retry_now(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[600], outcomes=True) as sp:
        held = sp.accept("a@example.org", ["h@example.net"], DATA)
        gone = sp.accept("a@example.org", ["g@example.net"], DATA)
        later = sp.accept("a@example.org", ["l@example.net"], DATA)
        sp.hold(held)
        sp.hold(held)  # idempotent
        sp.delete(gone)
        claimed = sp.claim()
        assert claimed is not None and claimed.msg_id == later  # held and deleted skipped
        with claimed:
            claimed.deferred(["l@example.net"], "451 later")
        assert sp.claim() is None
        assert sp.retry_now(later) == 1
        again = sp.claim()
        assert again is not None and again.msg_id == later
        again.delivered(["l@example.net"], "250 ok")
        again.close()
        states = {e.msg_id: (e.state, e.held) for e in sp.list()}
        assert states == {held: ("held", "held by the operator")}
        not_held = sp.accept("a@example.org", ["n@example.net"], DATA)
        with pytest.raises(ValueError, match="not held"):
            sp.release(not_held)
        sp.release(held)
        due = set()
        while (attempt := sp.claim()) is not None:
            due.add(attempt.msg_id)
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
        assert due == {held, not_held}  # released: due at once
        with pytest.raises(KeyError):
            sp.hold("FFFFFFFFFFFFFFFF")
        outcomes = {}
        while (o := sp.next_outcome()) is not None:
            outcomes[o.msg_id] = o.recipients[0].reply
        assert outcomes[gone] == DELETED_REPLY


def test_operator_actions_on_a_message_in_flight_apply_when_it_ends(
    spool_dir: str, clock: FakeClock
) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[60]) as sp:
        msg = sp.accept("a@example.org", RCPTS, DATA)
        attempt = sp.claim()
        assert attempt is not None
        sp.hold(msg)
        with attempt:
            attempt.deferred(["bob@example.net"], "451 later")
        entry = next(iter(sp.list()))
        assert (entry.msg_id, entry.state) == (msg, "held")
        sp.release(msg)
        attempt = sp.claim()
        assert attempt is not None
        sp.delete(msg)
        with attempt:
            attempt.delivered(["bob@example.net"], "250 ok")
        assert list(sp.list()) == []
        assert sp.statistics().delivered == 1


def test_retry_now_all_makes_every_deferred_message_due(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[3600]) as sp:
        for i in range(4):
            sp.accept("a@example.org", [f"r{i}@example.net"], DATA)
        for _ in range(4):
            defer_all(sp)
        assert sp.claim() is None
        assert sp.retry_now() == 4
        count = 0
        while (attempt := sp.claim()) is not None:
            count += 1
            attempt.close()
        assert count == 4


def test_held_and_long_deferred_mail_do_not_pin_old_segments(
    spool_dir: str, clock: FakeClock
) -> None:
    """A held message and one deferred to the last class, with 1000 others flowing:
    after the longest retry interval every segment older than it has been deleted."""
    intervals = [10.0, 100.0]
    with Spool.open(
        spool_dir,
        clock=clock,
        retry_intervals=intervals,
        segment_size=16 * 1024,
        checkpoint_interval=3600,
    ) as sp:
        held = sp.accept("a@example.org", ["held@example.net"], b"H" * 3000)
        sp.hold(held)
        slow = sp.accept("a@example.org", ["slow@example.net"], b"S" * 3000)
        for _ in range(3):  # fresh -> class 1 -> class 2 (the last) -> class 2
            attempt = sp.claim()
            assert attempt is not None and attempt.msg_id == slow
            with attempt:
                attempt.deferred(["slow@example.net"], "451 later")
            sp.sync()
            clock.advance(101)
        log_dir = os.path.join(spool_dir, fmt.LOG_DIR)
        early = set(os.listdir(log_dir))
        for i in range(1000):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 500)
            if i % 50 == 49:
                while (attempt := sp.claim()) is not None:
                    with attempt:
                        if attempt.msg_id == slow:
                            attempt.deferred(["slow@example.net"], "451 still later")
                        else:
                            attempt.delivered(attempt.envelope.recipients, "250 ok")
                sp.checkpoint()
                clock.advance(10)
        remaining = set(os.listdir(log_dir))
        assert early.isdisjoint(remaining), sorted(early & remaining)
        live = {e.msg_id: e for e in sp.list()}
        assert set(live) == {held, slow}
        assert live[held].body_kind == "file" and live[slow].body_kind == "file"
        sp.release(held)
        got = {}
        while (attempt := sp.claim()) is not None:
            got[attempt.msg_id] = attempt.read_data()
            attempt.close()
        assert got[held] == b"H" * 3000


def test_deleting_a_held_message_the_last_runner_waits_at_does_not_revive_it(
    spool_dir: str, clock: FakeClock
) -> None:
    """Regression (found by the model test): the runner had already looked at the held
    envelope before the delete superseded it, and re-appended it once it came due."""
    with Spool.open(spool_dir, clock=clock, retry_intervals=[10, 40]) as sp:
        msg_id = sp.accept("a@example.org", ["r@example.net"], DATA)
        sp.hold(msg_id)
        assert sp.claim() is None  # the last runner now waits at the held envelope
        clock.advance(41)
        sp.delete(msg_id)
        assert sp.claim() is None
        assert list(sp.list()) == []


def test_delete_is_silent_and_bounce_gives_up_with_a_bounce(spool_dir: str) -> None:
    # Before: delete failed every pending recipient with a 554 reply, so an agent sending
    # bounces from the outcomes bounced an operator's deletion.
    rcpts = ["x@example.net", "y@example.net"]
    with Spool.open(spool_dir, outcomes=True) as sp:
        quiet, loud, busy = (sp.accept("a@example.org", rcpts, DATA) for _ in range(3))
        sp.delete(quiet)
        sp.bounce(loud, "554 5.7.1 relaying to them stopped")
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == busy
        sp.delete(busy)  # in flight: applied when the attempt ends
        with attempt:
            attempt.delivered(["x@example.net"], "250 ok")
        sp.sync()
        outcomes = {o.msg_id: o for o in iter(sp.next_outcome, None)}
    assert outcomes[quiet].failed == () and len(outcomes[quiet].deleted) == 2
    assert [o.reply for o in outcomes[loud].failed] == ["554 5.7.1 relaying to them stopped"] * 2
    assert outcomes[loud].deleted == ()
    statuses = {o.recipient: o.status for o in outcomes[busy].recipients}
    assert statuses == {"x@example.net": "delivered", "y@example.net": "deleted"}
    assert outcomes[busy].failed == ()


def test_attempts_closed_as_crashed_trip_the_crash_loop_breaker(tmp_path: Path) -> None:
    """``Attempt.close_crashed`` counts a crash (a worker process died in the attempt); a
    normal close in between starts the count again; at ``crash_limit`` the message is held."""
    with Spool.open(tmp_path / "spool", retry_intervals=[0.001], crash_limit=2) as sp:
        msg_id = sp.accept("a@example.org", ["b@example.net"], b"x")

        def attempt() -> Attempt:
            found = sp.claim(timeout=5)
            assert found is not None and found.msg_id == msg_id
            return found

        attempt().close_crashed()
        attempt().close()  # a clean ending: the count starts again
        attempt().close_crashed()
        assert [e.held for e in sp.list()] == [None]
        crashed = attempt()
        crashed.close_crashed()
        crashed.close_crashed()  # idempotent, as close
        (entry,) = sp.list()
        assert entry.held == "crash loop: in flight at 2 crashes" and entry.attempts == 4
        assert sp.claim(timeout=0.05) is None
    with Spool.open(tmp_path / "spool") as sp:  # the hold is durable
        assert [e.held for e in sp.list()] == ["crash loop: in flight at 2 crashes"]


def test_a_close_with_a_deferral_pending_leaves_nothing_for_the_next_open_to_write(
    spool_dir: str,
) -> None:
    # Before: the last checkpoint named the log's end short of the padding its own flush
    # wrote after the pending replacement, so the next open found a suffix to recover and
    # started a new segment (and rewrote the positions) though nothing had happened.
    from spool.testing import tree_snapshot

    with Spool.open(spool_dir, retry_intervals=[300]) as sp:
        sp.accept("a@example.org", RCPTS, DATA)
        defer_all(sp)  # its replacement pending at the close
    before = tree_snapshot(spool_dir)
    Spool.open(spool_dir, retry_intervals=[300]).close()
    after = tree_snapshot(spool_dir)
    assert after.pop(fmt.LOCK_NAME) and before.pop(fmt.LOCK_NAME)  # the last pid to lock it
    assert after == before


@pytest.mark.parametrize("seed", range(24))
def test_an_empty_claim_never_misses_mail_a_flush_would_show(tmp_path: Path, seed: int) -> None:
    # Accepts, attempts deferred or partly delivered, holds, releases, retries, clock
    # advances and reopens with the clock stepped, at random: whenever a claim finds
    # nothing, a flush of the log must show nothing either (R1). The group commit's own
    # timer is far off, so only the claim's flushes make the replacements durable.
    import random

    from spool.errors import SpoolMisuse, UnknownMessage

    rnd = random.Random(seed)
    clock = FakeClock()
    options = {
        "clock": clock,
        "retry_intervals": rnd.choice([[10], [5, 20], [3, 7, 30], [1, 2, 4]]),
        "sync_interval": 10_000,
        "max_in_flight": rnd.choice([1, 2, 100]),
    }
    sp = Spool.open(tmp_path / "spool", **options)  # type: ignore[arg-type]
    attempts: list[Attempt] = []
    ids: list[str] = []
    for _ in range(250):
        op = rnd.random()
        if op < 0.15:
            ids.append(sp.accept("a@example.org", RCPTS, DATA))
        elif op < 0.45:
            attempt = sp.claim(timeout=0)
            if attempt is None:
                sp.sync()
                assert sp.claim(timeout=0) is None, "a due message the claim did not see"
            else:
                attempts.append(attempt)
        elif op < 0.7 and attempts:
            attempt = attempts.pop(rnd.randrange(len(attempts)))
            rcpts = list(attempt.envelope.recipients)
            if rnd.random() < 0.6:
                attempt.deferred(rcpts, "451 4.3.0 later")
            elif rnd.random() < 0.5:
                attempt.delivered(rcpts[:1], "250 2.0.0 ok")
            attempt.close()
        elif op < 0.8:
            clock.advance(rnd.choice([0.5, 1, 3, 5, 10, 30]))
        elif op < 0.85 and ids:
            act = rnd.choice([sp.hold, sp.release, sp.retry_now])
            with contextlib.suppress(SpoolMisuse, UnknownMessage):
                act(rnd.choice(ids))
        elif op < 0.87:
            for attempt in attempts:
                attempt.close()
            attempts.clear()
            sp.close()
            clock.step(rnd.choice([-100, -5, 0, 100]))
            sp = Spool.open(tmp_path / "spool", **options)  # type: ignore[arg-type]
    for attempt in attempts:
        attempt.close()
    sp.close()


def test_a_claim_keeps_its_timeout_while_others_take_what_it_flushes(tmp_path: Path) -> None:
    # Found by review: once a claim had flushed for a due replacement, another worker
    # could take it before the claim looked, and that worker's close append the next due
    # one: the claim flushed again and again, past its timeout. Here every flush of the
    # claiming thread lets such a worker in (the file system's fdatasync hook).
    from spool.fs import FileSystem

    class Hooked(FileSystem):
        hook: Callable[[], None] | None = None

        def fdatasync(self, fd: int) -> None:
            super().fdatasync(fd)
            if self.hook is not None:
                self.hook()

    clock, fs = FakeClock(), Hooked()
    sp = Spool.open(
        tmp_path / "spool", clock=clock, fs=fs, retry_intervals=[1], sync_interval=10_000,
        checkpoint_interval=10_000,
    )  # fmt: skip
    st, writer = sp._state, sp._state.writer
    sp.accept("a@example.org", ["b@example.net"], DATA)
    defer_all(sp)  # its replacement: not durable, due in 1 s
    clock.advance(1)
    rounds, main = [0], threading.main_thread()

    def other_worker(durable_before: Any, entered: threading.Event) -> None:
        with st.lock:  # in before the claiming thread looks again ...
            entered.set()
            while writer.durable == durable_before:  # ... once its flush has landed
                time.sleep(0.0005)
            taken = sp.claim(timeout=0)
            assert taken is not None
            with taken:
                taken.deferred(list(taken.envelope.recipients), "451 4.3.0 later")
            clock.advance(1)  # the new replacement is due, and not durable

    def hook() -> None:
        if threading.current_thread() is not main or rounds[0] >= 20:
            return
        rounds[0] += 1
        entered = threading.Event()
        threading.Thread(target=other_worker, args=(writer.durable, entered)).start()
        entered.wait()

    fs.hook = hook
    try:
        assert sp.claim(timeout=0) is None
        assert rounds[0] == 1, f"{rounds[0]} flushes for one claim(timeout=0)"
    finally:
        fs.hook = None
        sp.close()


def test_a_claim_waiting_when_the_spool_closes_is_handed_nothing(tmp_path: Path) -> None:
    # Found by review (older than the claim's new flushing): close() freed the slot of the
    # attempt it closed, then let go of the lock for its last checkpoint; a claim waiting
    # for a slot took it, and its attempt was left open: a crash to the next open (held
    # for a crash loop with crash_limit=1; attempted again otherwise).
    root = tmp_path / "spool"
    sp = Spool.open(root, max_in_flight=1, crash_limit=1)
    for name in ("x", "y"):
        sp.accept("a@example.org", [f"{name}@example.net"], DATA)
    first = sp.claim(timeout=0)
    assert first is not None
    got: list[object] = []

    def claim() -> None:
        try:
            got.append(sp.claim(timeout=5))
        except SpoolError as exc:
            got.append(exc)

    waiter = threading.Thread(target=claim)
    waiter.start()
    time.sleep(0.3)  # waiting for the slot `first` holds
    sp.close()
    waiter.join()
    assert not isinstance(got[0], Attempt), "an attempt handed out by a closing spool"
    with Spool.open(root) as sp:
        entries = list(sp.list())
    assert len(entries) == 2 and all(e.held is None for e in entries)
