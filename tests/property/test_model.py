"""The spool against a plain in-memory model of a mail queue (Hypothesis stateful testing).

Goal: under any sequence of accept / claim / deliver / fail / defer / close / hold /
release / delete / retry-now / advance-clock / reopen steps, every recipient ends exactly
once in delivered, failed or still queued; no attempt comes before its retry time;
nothing is handed out twice at once; and claim finds due mail whenever the model has some.
Method: the model is a dict of recipient sets per message with a due time; each rule
does the same thing to both and compares.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from spool import Attempt, Spool, runners
from spool.testing import FakeClock

INTERVALS = (10.0, 40.0)
ADDRS = [f"r{i}@example.net" for i in range(4)]


@attrs.define
class ModelMessage:
    pending: set[str]
    delivered: set[str] = attrs.field(factory=set)
    failed: set[str] = attrs.field(factory=set)
    attempts: int = 0
    due: float = 0.0
    held: bool = False
    in_flight: bool = False
    hold_on_close: bool = False
    delete_on_close: bool = False


class SpoolMatchesModel(RuleBasedStateMachine):
    messages = Bundle("messages")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="spool-model-")
        self.clock = FakeClock()
        self.sp = self._open()
        self.model: dict[str, ModelMessage] = {}
        self.open: dict[str, tuple[Attempt, set[str]]] = {}

    def _open(self) -> Spool:
        return Spool.open(
            self.dir, clock=self.clock, retry_intervals=INTERVALS, checkpoint_interval=3600
        )

    def teardown(self) -> None:
        self.sp.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _interval(self, attempts: int) -> float:
        return INTERVALS[min(attempts, len(INTERVALS)) - 1]

    @rule(target=messages, rcpts=st.lists(st.sampled_from(ADDRS), min_size=1, unique=True))
    def accept(self, rcpts: list[str]) -> str:
        msg_id = self.sp.accept("a@example.org", rcpts, b"data")
        self.model[msg_id] = ModelMessage(set(rcpts), due=self.clock())
        return msg_id

    @rule()
    def claim(self) -> None:
        attempt = self.sp.claim()
        now = self.clock()
        due = [
            m
            for m, s in self.model.items()
            if s.pending and not s.in_flight and not s.held and s.due <= now
        ]
        if attempt is None:
            assert not due, f"claim found nothing but {due} are due"
            return
        state = self.model[attempt.msg_id]
        assert not state.in_flight, "handed out twice at once"
        assert not state.held and state.due <= now, "attempted before its time"
        assert set(attempt.envelope.recipients) == state.pending
        state.in_flight = True
        self.open[attempt.msg_id] = (attempt, set(state.pending))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), kind=st.sampled_from(["delivered", "failed", "deferred"]))
    def report(self, data: st.DataObject, kind: str) -> None:
        msg_id = data.draw(st.sampled_from(list(self.open)))
        attempt, unreported = self.open[msg_id]
        if not unreported:
            return
        rcpts = data.draw(st.lists(st.sampled_from(sorted(unreported)), min_size=1, unique=True))
        getattr(attempt, kind)(rcpts, f"reply {kind}")
        unreported.difference_update(rcpts)
        state = self.model[msg_id]
        if kind != "deferred":
            state.pending.difference_update(rcpts)
            getattr(state, kind).update(rcpts)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def close_attempt(self, data: st.DataObject) -> None:
        msg_id = data.draw(st.sampled_from(list(self.open)))
        attempt, _ = self.open.pop(msg_id)
        attempt.close()
        self._model_close(msg_id)

    def _model_close(self, msg_id: str) -> None:
        state = self.model[msg_id]
        state.in_flight = False
        if state.delete_on_close:
            state.failed |= state.pending
            state.pending.clear()
        if state.pending:
            state.attempts += 1
            state.held = state.hold_on_close
            state.due = self.clock() + self._interval(state.attempts)
        state.hold_on_close = state.delete_on_close = False

    @rule(msg_id=messages)
    def hold(self, msg_id: str) -> None:
        state = self.model[msg_id]
        try:
            self.sp.hold(msg_id)
        except KeyError:
            assert not state.pending
            return
        if state.in_flight:
            state.hold_on_close = True
        else:
            state.held = True

    @rule(msg_id=messages)
    def release(self, msg_id: str) -> None:
        state = self.model[msg_id]
        try:
            self.sp.release(msg_id)
        except KeyError:
            assert not state.pending
            return
        except ValueError:
            assert not state.held and not state.hold_on_close
            return
        if state.in_flight:
            state.hold_on_close = False
        else:
            state.held = False
            state.due = self.clock()

    @rule(msg_id=consumes(messages))
    def delete(self, msg_id: str) -> None:
        state = self.model[msg_id]
        try:
            self.sp.delete(msg_id)
        except KeyError:
            assert not state.pending
            return
        if state.in_flight:
            state.delete_on_close = True
        else:
            state.failed |= state.pending
            state.pending.clear()

    @rule(msg_id=messages)
    def retry_now(self, msg_id: str) -> None:
        state = self.model[msg_id]
        try:
            changed = self.sp.retry_now(msg_id)
        except KeyError:
            assert not state.pending
            return
        if changed:
            assert not state.held and not state.in_flight and state.attempts > 0
            state.due = self.clock()

    @rule(seconds=st.sampled_from([1.0, 5.0, 11.0, 41.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def reopen(self) -> None:
        for msg_id, (attempt, _) in sorted(self.open.items()):
            attempt.close()
            self._model_close(msg_id)
        self.open.clear()
        self.sp.close()
        self.sp = self._open()

    @invariant()
    def every_recipient_is_in_exactly_one_place(self) -> None:
        for state in self.model.values():
            assert not (state.pending & state.delivered)
            assert not (state.pending & state.failed)
            assert not (state.delivered & state.failed)

    @invariant()
    def the_spool_queue_matches_the_model(self) -> None:
        live = {e.msg_id: e for e in self.sp.list()}
        expected = {m for m, s in self.model.items() if s.pending or s.in_flight}
        assert set(live) == expected
        for msg_id, entry in live.items():
            state = self.model[msg_id]
            if not state.in_flight:
                assert set(entry.recipients) == state.pending, msg_id
                assert (entry.held is not None) == state.held, msg_id


SpoolMatchesModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("SPOOL_MODEL_EXAMPLES", "60")),
    stateful_step_count=30,
    deadline=None,
)
test_spool_matches_the_model = SpoolMatchesModel.TestCase


class SpoolWithFewPositionsMatchesModel(SpoolMatchesModel):
    """The same, with queue runners that may keep only two positions of their envelopes
    ahead (``runners.AHEAD_MAX``): they go from jumping to walking on their count and
    back all the time, and must still hand out every due message."""

    def __init__(self) -> None:
        self._ahead_max = runners.AHEAD_MAX
        runners.AHEAD_MAX = 2
        super().__init__()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            runners.AHEAD_MAX = self._ahead_max


SpoolWithFewPositionsMatchesModel.TestCase.settings = SpoolMatchesModel.TestCase.settings
test_spool_with_few_runner_positions_matches_the_model = SpoolWithFewPositionsMatchesModel.TestCase
