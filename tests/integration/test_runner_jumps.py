"""Queue runners jump from one envelope of their class to the next (``runners.py``).

Before, a runner with mail of its class pending read and checked every frame between its
cursor and the durable end, and decoded every envelope there (other classes' included),
once per runner. These tests look at what the runners decoded, and at every message
being handed out all the same, in the cases where the positions are known, not known,
given up, and wrong.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool import runners as runners_module
from spool.records import Position
from spool.runners import PositionQueue, Runner
from spool.testing import FakeClock

INTERVALS = (60.0,)
ROOT = str(Path(__file__).resolve().parents[2])
DATA = b"Subject: jumps\r\n\r\nbody\r\n"


def runners_of(sp: Spool) -> list[Runner]:
    return sp._opened.scheduler.runners  # type: ignore[no-any-return]


def accept(sp: Spool, n: int) -> set[str]:
    return {sp.accept("a@example.org", ["b@example.net", "c@example.net"], DATA) for _ in range(n)}


def drain(sp: Spool, clock: FakeClock) -> list[str]:
    """First attempts deliver b and defer c; then the retries (due) deliver c. Returns
    the message ids of the attempts, in order."""
    seen = []
    for retries in (False, True):
        if retries:
            clock.advance(INTERVALS[0] + 1)
        while (attempt := sp.claim()) is not None:
            seen.append(attempt.msg_id)
            with attempt:
                if retries:
                    attempt.delivered(["c@example.net"], "250 ok")
                else:
                    attempt.delivered(["b@example.net"], "250 ok")
                    attempt.deferred(["c@example.net"], "451 later")
    return seen


def test_each_runner_decodes_only_the_envelopes_of_its_class(tmp_path: Path) -> None:
    clock = FakeClock()
    with Spool.open(str(tmp_path / "s"), clock=clock, retry_intervals=INTERVALS) as sp:
        ids = accept(sp, 40)
        seen = drain(sp, clock)
        assert sorted(seen) == sorted(list(ids) * 2)  # each message: a first try, a retry
        assert list(sp.list()) == []
        fresh, retry = runners_of(sp)
        # Before: the retry runner decoded the 40 fresh envelopes too (80), as it walked.
        assert (fresh.envelopes_seen, retry.envelopes_seen) == (40, 40)
        assert fresh.jumps >= 39 and retry.jumps >= 39  # all but where it walked first


def test_a_new_spool_knows_its_runners_counts_before_the_first_claim(tmp_path: Path) -> None:
    """Mail accepted before the first claim is jumped between too: the count is learnt at
    the open (``Runner.prime``), not at the first walk to the end of the log."""
    clock = FakeClock()
    with Spool.open(str(tmp_path / "s"), clock=clock, retry_intervals=INTERVALS) as sp:
        assert [r.owned_pending for r in runners_of(sp)] == [0, 0]
        accept(sp, 5)
        assert runners_of(sp)[0].owned_ahead is not None
        assert len(runners_of(sp)[0].owned_ahead or ()) == 5


def test_a_reopened_backlog_is_walked_first_and_jumped_after(tmp_path: Path) -> None:
    """After a restart the runners know no positions (the queue stays on disk): they walk
    to the end once, then jump. Every message is handed out once per attempt."""
    clock = FakeClock()
    root = str(tmp_path / "s")
    with Spool.open(root, clock=clock, retry_intervals=INTERVALS) as sp:
        ids = accept(sp, 20)
    with Spool.open(root, clock=clock, retry_intervals=INTERVALS) as sp:
        fresh = runners_of(sp)[0]
        assert fresh.owned_pending is None  # an envelope lies ahead: not taken by prime
        ids |= accept(sp, 20)
        seen = drain(sp, clock)
        assert sorted(seen) == sorted(list(ids) * 2)
        assert list(sp.list()) == []
        assert fresh.owned_pending == 0
        assert fresh.owned_ahead is not None and len(fresh.owned_ahead) == 0


def test_too_many_positions_fall_back_to_the_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runners_module, "AHEAD_MAX", 3)
    clock = FakeClock()
    with Spool.open(str(tmp_path / "s"), clock=clock, retry_intervals=INTERVALS) as sp:
        fresh = runners_of(sp)[0]
        ids = accept(sp, 10)
        assert fresh.owned_ahead is None and fresh.owned_pending == 10
        seen = drain(sp, clock)
        assert sorted(seen) == sorted(list(ids) * 2)
        assert list(sp.list()) == []
        # The count fell to zero: the positions are known again (none), and used.
        assert fresh.owned_ahead is not None and len(fresh.owned_ahead) == 0
        more = accept(sp, 2)
        assert {a.msg_id for a in (sp.claim(), sp.claim()) if a is not None} == more


def test_a_position_short_of_the_envelope_makes_the_runner_walk(tmp_path: Path) -> None:
    """A position (a frame boundary) before the runner's next envelope that is not it (a
    bug; none is known) costs no message: the runner reads the frame there, finds it is
    not its envelope, forgets the positions and walks. (A position past its envelope
    would skip it, as an uncounted append would: the crash explorer's mutants
    ``replacement_position_past_it`` and ``uncounted_replacement``.)"""
    clock = FakeClock()
    with Spool.open(str(tmp_path / "s"), clock=clock, retry_intervals=INTERVALS) as sp:
        first = accept(sp, 1)
        fresh, retry = runners_of(sp)
        assert fresh.owned_ahead is not None
        wrong = fresh.owned_ahead.first()  # the fresh envelope, ahead of the retry's own
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id in first
        with attempt:
            attempt.deferred(["b@example.net", "c@example.net"], "451 later")
        ids = accept(sp, 3)
        sp.sync()
        assert retry.owned_ahead is not None and len(retry.owned_ahead) == 1
        own = retry.owned_ahead.first()
        assert wrong < own
        retry.owned_ahead = PositionQueue([wrong, own])
        retry.owned_pending = (retry.owned_pending or 0) + 1
        clock.advance(INTERVALS[0] + 1)
        handed = []
        while (a := sp.claim()) is not None:
            handed.append(a.msg_id)
            with a:
                a.delivered(list(a.envelope.recipients), "250 ok")
        assert sorted(handed) == sorted(first | ids)
        assert retry.owned_ahead is None  # it walks on: the count raised with it is too high


def test_the_positions_kept_cost_16_bytes_each_and_are_given_back() -> None:
    queue = PositionQueue()
    for i in range(5000):
        queue.append(Position(1 + i // 1000, 32 + i))
    for i in range(4990):
        assert queue.first() == Position(1 + i // 1000, 32 + i)
        queue.pop_first()
    assert len(queue) == 10 and queue.first() == Position(5, 32 + 4990)
    assert len(queue._segments) < 5000  # the space of those taken was given back


def test_a_backlog_costs_a_runner_little_memory(tmp_path: Path) -> None:
    """Contract 8: memory is bounded by the work in flight. The positions a runner keeps
    grow with its class's backlog up to ``AHEAD_MAX``: 16 bytes each (before the review:
    about 105, 1.7 MiB a runner, of up to 65 runners)."""
    clock = FakeClock()
    with Spool.open(str(tmp_path / "s"), clock=clock, retry_intervals=INTERVALS) as sp:
        accept(sp, 200)  # warm: first segment, caches
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            accept(sp, 4000)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert len(runners_of(sp)[0].owned_ahead or ()) == 4200
        assert grown < 4000 * 40, f"{grown / 4000:.0f} bytes a queued message"


def test_damage_a_runner_steps_over_is_found_by_spool_check(tmp_path: Path) -> None:
    """A busy runner does not check the frames it steps over (review of the jumps): a
    damaged start record between its envelopes does not stop the next claim, and
    ``spool check`` finds it (as it finds damage in a BODY frame no claim has read)."""
    root = str(tmp_path / "s")
    clock = FakeClock()
    sp = Spool.open(root, clock=clock, retry_intervals=INTERVALS)
    try:
        ids = accept(sp, 3)
        first = sp.claim()
        assert first is not None
        sp.sync()
        at = sp._opened.book.in_flight[first.msg_id].start_at
        path = os.path.join(root, fmt.LOG_DIR, fmt.segment_name(at.segment))
        with open(path, "r+b") as f:
            f.seek(at.offset + 12)
            byte = f.read(1)
            f.seek(at.offset + 12)
            f.write(bytes([byte[0] ^ 0xFF]))
        second = sp.claim()
        assert second is not None and second.msg_id in ids - {first.msg_id}
        first.close()
        second.close()
    finally:
        sp.close()
    checked = subprocess.run(
        [sys.executable, "-m", "spool.cli", "check", root],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert checked.returncode != 0
    assert f"{fmt.segment_name(at.segment)}" in checked.stdout + checked.stderr
