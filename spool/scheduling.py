"""Scheduling: the queue runners, fairness between them, and the one way into the log.

Every record an open spool writes reaches the writer through ``Scheduler.append``: it
counts records toward the next checkpoint, and counts each appended envelope for the
runner of its class, which lets a runner skip to the head when its class is idle, and jump
from one of its envelopes to the next (``runners.py``); an envelope appended any other way
could be skipped and its message never handed out.

Fairness: claims alternate between fresh mail (runner 0) and deferred mail, and go round
the deferred classes in turn, so neither a flood of new mail nor a backlog of retries
starves the other.

Not thread-safe on its own: every method runs with the spool's lock held (``state.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from spool import format as fmt
from spool import records as rec
from spool.errors import SpoolMisuse
from spool.records import Position
from spool.runners import Runner
from spool.state import SpoolState
from spool.writer import Part


def encode_checked(record: rec.Record) -> Part:
    """``record`` encoded (frame type and payload), checked to fit one frame.

    Every call encodes what it writes before it changes any state, so a record that cannot
    be written refuses the call and changes nothing. The limits on what callers give
    (options.py: recipients, text sizes) keep every record inside a frame; this check makes
    sure, with a typed error rather than an assertion. An envelope whose acceptance was
    stamped after this write (by an earlier open's clock) is written with the write's time
    as its acceptance (``clock.py``).
    """
    if isinstance(record, rec.Envelope) and record.accepted_at > record.written_at:
        record = attrs.evolve(record, accepted_at=record.written_at)
    ftype, payload = rec.encode(record)
    if len(payload) > fmt.FRAME_PAYLOAD_MAX:
        subject = record.target if isinstance(record, rec.Control) else record.msg_id
        raise SpoolMisuse(
            f"the {fmt.TYPE_NAMES[ftype]} record of {subject} needs {len(payload)} bytes, "
            f"over the frame limit ({fmt.FRAME_PAYLOAD_MAX})"
        )
    return ftype, payload


class Scheduler:
    """The runners of one open spool and everything appended through it. Lock held."""

    def __init__(
        self, state: SpoolState, runners: list[Runner], superseded: Iterable[Position]
    ) -> None:
        self.state = state
        self.runners = runners
        # Envelopes superseded ahead of their runner (runners.py), pruned at checkpoints.
        self.superseded: set[Position] = set(superseded)
        self.since_checkpoint = 0  # records appended since the last checkpoint
        # Envelopes appended but not yet durable, by owning runner (see ``note_envelope``).
        self._fresh_envelopes: list[tuple[int, Position]] = []
        self._prefer_incoming = True
        self._deferred_turn = 0

    def enqueue(self, record: rec.Record, *, waited: bool = False) -> tuple[Position, Position]:
        """Encode and queue one record (``waited``: see ``LogWriter.enqueue``)."""
        part = encode_checked(record)
        klass = record.klass if isinstance(record, rec.Envelope) else None
        return self.append([part], klass, waited=waited)

    def append(
        self, parts: list[Part], envelope_class: int | None, *, waited: bool = False
    ) -> tuple[Position, Position]:
        """Queue encoded records; every record reaches the writer through here. Counts
        toward the next checkpoint, and counts an envelope (``envelope_class``) for its
        runner. ``waited``: the caller waits for their end next (``LogWriter.enqueue``)."""
        self.since_checkpoint += 1
        if self.since_checkpoint == self.state.options.checkpoint_every:
            self.state.checkpoint_due.set()
        start, end = self.state.writer.enqueue(parts, waited=waited)
        if envelope_class is not None:
            self.note_envelope(envelope_class, start)
        return start, end

    def note_envelope(self, klass: int, at: Position) -> None:
        """Count an appended envelope for the runner of its class (runners.py: idle runners
        skip to the head). Every envelope appended must come through here."""
        owner = min(klass, self.state.options.last_class)
        self.runners[owner].appended(at)
        self._fresh_envelopes.append((owner, at))

    def pending_past(self, owner: int, limit: Position) -> list[Position]:
        """The envelopes of runner ``owner`` appended at or after ``limit``, in log order
        (only not-yet-durable ones are still listed; older ones are behind it)."""
        return [at for k, at in self._fresh_envelopes if k == owner and at >= limit]

    def on_durable(self, end: Position) -> None:
        """The writer's callback: the log is durable up to ``end``. Takes the lock."""
        with self.state.lock:
            # Envelopes before the durable end are behind any idle runner's skip point.
            self._fresh_envelopes = [(k, at) for k, at in self._fresh_envelopes if at >= end]
            self.state.cond.notify_all()

    def runner_order(self) -> list[Runner]:
        """Alternate fresh and deferred mail; round-robin among the deferred classes."""
        deferred = self.runners[1:]
        k = self._deferred_turn % len(deferred)
        rotated = deferred[k:] + deferred[:k]
        if self._prefer_incoming:
            return [self.runners[0], *rotated]
        return [*rotated, self.runners[0]]

    def took(self, runner: Runner) -> None:
        """``runner`` handed out an attempt: the next claim looks at the others first."""
        if runner.klass == 0:
            self._prefer_incoming = False
        else:
            self._prefer_incoming = True
            self._deferred_turn = runner.klass

    def runner_of(self, klass: int) -> Runner:
        """The runner that owns envelopes of class ``klass``."""
        return self.runners[min(klass, self.state.options.last_class)]

    def cursors(self) -> tuple[Position, ...]:
        return tuple(r.cursor for r in self.runners)

    def prune_superseded(self, low: Position) -> None:
        """Forget superseded positions every runner has passed (``low``: the lowest
        cursor); at a checkpoint."""
        self.superseded = {p for p in self.superseded if p >= low}

    def close(self) -> None:
        for runner in self.runners:
            runner.close()
