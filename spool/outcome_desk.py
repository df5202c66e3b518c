"""Outcomes: finished messages handed out for bounces and acknowledged (outcomes=True).

The outcome reader (``outcomes.py``) walks the durable log for finish records behind the
outcome front; this desk hands them out, writes the acknowledgements (durable on return)
and keeps the body a bounce returns until its outcome is acknowledged.
"""

from __future__ import annotations

import time

from spool import records as rec
from spool.arguments import check_msg_id, check_seconds
from spool.bodies import read_body
from spool.body_keeping import BodyKeeper
from spool.errors import BodyGone, CorruptSpool, SpoolMisuse, UnknownMessage
from spool.outcomes import MessageOutcome, OutcomeReader
from spool.recovery import BODY_LOST_REASON, ENVELOPE_LOST_REASON
from spool.scheduling import Scheduler, encode_checked
from spool.state import SpoolState
from spool.writer import WAIT_MAX


class OutcomeDesk:
    """Hands out and acknowledges the outcomes of one open spool."""

    def __init__(
        self, state: SpoolState, scheduler: Scheduler, bodies: BodyKeeper, reader: OutcomeReader
    ) -> None:
        self.state = state
        self.scheduler = scheduler
        self.bodies = bodies
        self.reader = reader

    def _check_tracked(self) -> None:
        if not self.state.options.outcomes:
            raise SpoolMisuse(
                f"outcomes are not tracked in {self.state.path}: open it with outcomes=True "
                "once (the setting is recorded in the spool)"
            )

    def next(self, timeout: float | None) -> MessageOutcome | None:
        """``Spool.next_outcome``. Takes the lock."""
        state = self.state
        state.check_process()
        self._check_tracked()
        deadline = time.monotonic() + check_seconds(timeout, "timeout")
        while True:
            with state.lock:
                state.check_open()
                outcome = self.reader.next(state.writer.durable)
                behind = state.writer.durable < state.writer.tail
                left = deadline - time.monotonic()
                if outcome is not None:
                    return outcome
                if not behind:
                    if left <= 0:
                        return None
                    state.cond.wait(min(left, WAIT_MAX))
                    continue
            # Finish records are bookkeeping, written without waiting; an outcome is
            # handed out only once its finish is durable, so flush them now.
            state.writer.sync()

    def ack(self, msg_id: str) -> None:
        """``Spool.ack_outcome``: durable on return. Takes the lock."""
        state = self.state
        state.check_process()
        self._check_tracked()
        check_msg_id(msg_id)
        with state.lock:
            state.check_open()
            if not self.reader.waiting(msg_id):
                raise UnknownMessage(msg_id, "the outcomes waiting for an acknowledgement")
            part = encode_checked(rec.Control(rec.OUTCOME_ACK, msg_id, state.now()))
            body = self.reader.ack(msg_id)
            _, end = self.scheduler.append([part], None)
            if body.kind == rec.BODY_FILE:
                # Unlinked at the next checkpoint, after the acknowledgement is durable; a
                # crash first leaves the file for recovery, which removes the bodies of
                # acknowledgements it scans.
                self.bodies.doomed.append(msg_id)
        state.writer.wait_durable(end)

    def body(self, outcome: MessageOutcome) -> bytes:
        """``Spool.outcome_body``. Takes the lock."""
        state = self.state
        state.check_process()
        self._check_tracked()
        if not isinstance(outcome, MessageOutcome):
            raise SpoolMisuse(f"outcome must be a MessageOutcome, not {outcome!r}")
        body = outcome.body
        if body is None or outcome.reason == ENVELOPE_LOST_REASON:
            raise BodyGone(outcome.msg_id, "it was lost with its envelope")
        if outcome.reason == BODY_LOST_REASON:
            raise BodyGone(outcome.msg_id, "it was lost to disk damage")
        with state.lock:
            state.check_open()
            kept = self.reader.waiting(outcome.msg_id)
        try:
            return read_body(state.fs, state.path, outcome.msg_id, body, state.segment_files)
        except CorruptSpool as exc:
            if kept and body.kind == rec.BODY_FILE:
                raise  # it must be there: damage, not age
            why = "its outcome was acknowledged" if not kept else "its log segment was removed"
            raise BodyGone(outcome.msg_id, why) from exc
