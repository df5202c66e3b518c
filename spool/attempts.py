"""The attempt lifecycle: claim, start, report, settle, expiry, leases.

An attempt starts when a runner hands out a due envelope: a start record supersedes the
envelope, and the attempt is *in flight* (``InFlight``). Its recipients are reported
delivered, failed (both durable on return) or deferred; closing it writes the replacement
envelope for the deferred ones or the finish record (``settle``). Start records, deferred
deltas, replacements and finishes are bookkeeping, written without waiting: a crash that
loses them is repaired by recovery from the start record and the durable deltas
(docs/design.md, the decision table).

An attempt open longer than ``attempt_timeout`` is closed as deferred by the spool (its
*lease* ends), so a hung worker cannot pin the log.

Not thread-safe on its own: the book's methods run with the spool's lock held
(``state.py``) unless they say they take it; ``Attempt`` is the thread-safe handle.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterable
from typing import Final

import attrs

from spool import delivery_log
from spool import records as rec
from spool.addresses import needs_smtputf8
from spool.arguments import check_seconds, check_text
from spool.bodies import read_body
from spool.body_keeping import BodyKeeper
from spool.errors import AttemptExpired, SpoolClosed, SpoolMisuse
from spool.records import Position
from spool.recovery import CRASH_LOOP_HOLD, resolve_body, successor_envelope
from spool.runners import NotDue
from spool.scheduling import Scheduler
from spool.state import SpoolState
from spool.writer import WAIT_MAX

UNREPORTED_REPLY: Final = "451 4.4.0 delivery attempt ended without a result"
EXPIRED_REPLY: Final = "554 5.4.7 message expired: too long in the queue"


@attrs.frozen
class MessageEnvelope:
    """What a delivery agent sees of a message it is attempting. Plain values only."""

    msg_id: str
    sender: str
    recipients: tuple[str, ...]
    attempts: int
    accepted_at: float
    body_size: int

    @property
    def smtputf8_recipients(self) -> tuple[str, ...]:
        """The recipients only an SMTPUTF8-capable next hop can take (RFC 6531): those
        with a non-ASCII local part, or every one when the sender has one. Send the others
        to any hop with their domains in A-labels (``spool.addresses.ascii_form``)."""
        if needs_smtputf8(self.sender):
            return self.recipients
        return tuple(r for r in self.recipients if needs_smtputf8(r))


@attrs.define
class InFlight:
    """Spool-side state of one attempt."""

    envelope: rec.Envelope
    envelope_at: Position
    body: rec.BodyRef
    start_at: Position
    unreported: set[str]
    outcomes: list[rec.Outcome]
    deferred: dict[str, str]
    started_at: float = 0.0  # the spool's time when the attempt started (its lease)
    closed: bool = False
    lease_expired: bool = False  # closed by the spool past ``attempt_timeout``
    hold: str | None = None  # operator hold requested while in flight
    # Operator delete or bounce requested while in flight: (status, reply) for the rest.
    delete: tuple[str, str] | None = None


class Attempt:
    """One delivery attempt on one message, handed out by ``Spool.claim``.

    Report each recipient once: ``delivered`` and ``failed`` are durable when they return,
    ``deferred`` is not (a deferred recipient is retried whatever happens). Leaving the
    ``with`` block (or ``close``) writes the replacement envelope for what remains, or the
    finish record. Recipients not reported by then count as deferred; so do those of an
    attempt that is garbage-collected without being closed. Thread-safe.
    """

    def __init__(self, book: AttemptBook, flight: InFlight) -> None:
        self._book = book
        self._flight = flight
        env = flight.envelope
        self.envelope = MessageEnvelope(
            env.msg_id, env.sender, env.recipients, env.attempts, env.accepted_at, env.body.size
        )

    @property
    def msg_id(self) -> str:
        return self.envelope.msg_id

    def read_data(self) -> bytes:
        """The message body (header and data as accepted)."""
        state = self._book.state
        state.check_process()
        self._book.check_attempt(self._flight)
        return read_body(state.fs, state.path, self.msg_id, self._flight.body, state.segment_files)

    def delivered(self, recipients: Iterable[str], reply: str) -> None:
        """These recipients were delivered. Durable on return: never attempted again."""
        self._book.report(self._flight, rec.DELIVERED, recipients, reply)

    def failed(self, recipients: Iterable[str], reply: str) -> None:
        """These recipients failed permanently (5xx). Durable on return."""
        self._book.report(self._flight, rec.FAILED, recipients, reply)

    def deferred(self, recipients: Iterable[str], reply: str) -> None:
        """These recipients failed temporarily (4xx); they are retried later."""
        self._book.report(self._flight, rec.DEFERRED, recipients, reply)

    def close(self) -> None:
        """End the attempt (idempotent). Called by ``with``; see the class docstring."""
        self._book.state.check_process()
        with self._book.state.lock:
            self._book.close_attempt(self._flight)

    def close_crashed(self) -> None:
        """End the attempt because its delivery process died in it (idempotent).

        As ``close``, and the message's crash count grows as a crash of the spool during
        the attempt would make it grow: at ``crash_limit`` crashes in a row the message is
        held (the crash-loop breaker), so mail that kills its agent cannot kill it for ever.
        ``spool serve`` calls it for the attempts of a worker whose connection dropped.
        """
        self._book.state.check_process()
        with self._book.state.lock:
            self._book.close_attempt(self._flight, crashed=True)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never take locks in a finalizer: hand the attempt to the book, which closes it
        # from a normal thread (next claim, checkpoint or close).
        with contextlib.suppress(Exception):
            if not self._flight.closed:
                self._book.abandoned.append(self._flight)


class AttemptBook:
    """The attempts in flight of one open spool, from start to settlement."""

    def __init__(self, state: SpoolState, scheduler: Scheduler, bodies: BodyKeeper) -> None:
        self.state = state
        self.scheduler = scheduler
        self.bodies = bodies
        self.in_flight: dict[str, InFlight] = {}
        # Attempts garbage-collected unclosed (``Attempt.__del__``): closed from a thread.
        self.abandoned: collections.deque[InFlight] = collections.deque()

    # --- starting ----------------------------------------------------------------------

    def claim(self, timeout: float | None) -> Attempt | None:
        """``Spool.claim``: the next due message as an ``Attempt``, waiting up to
        ``timeout`` seconds for one. Takes the lock itself (and lets go of it to sync)."""
        st = self.state
        st.check_process()
        deadline = time.monotonic() + check_seconds(timeout, "timeout")
        synced = False
        while True:
            with st.lock:
                st.check_open()
                self.close_abandoned()
                attempt_or_wake = self.claim_next()
                if isinstance(attempt_or_wake, Attempt):
                    return attempt_or_wake
                behind = st.writer.durable < st.writer.tail
                left = deadline - time.monotonic()
                # One flush per call is enough for (R1); more would only add fsyncs while
                # other threads keep appending (later flushes wake this wait anyway).
                if not behind or synced:
                    if left <= 0:
                        return None
                    if attempt_or_wake is not None:
                        left = min(left, max(0.001, attempt_or_wake - st.now()))
                    st.cond.wait(min(left, WAIT_MAX))
                    continue
            # Runners read only the durable log. Replacement envelopes are written without
            # waiting; when nothing else is due, flush them so due mail is never missed.
            st.writer.sync()
            synced = True

    def claim_next(self) -> Attempt | float | None:
        """Start an attempt, or return when the next envelope is due (None: no work known).
        Lock held."""
        if len(self.in_flight) >= self.state.options.max_in_flight or self.state.closing:
            return None  # (a closing spool starts no attempt: ``OpenedSpool.close``)
        now = self.state.now()
        limit = self.state.writer.durable
        scheduler = self.scheduler
        wake: float | None = None
        for runner in scheduler.runner_order():
            while True:
                found = runner.next_due(now, limit, scheduler.superseded, scheduler.pending_past)
                if found is None:
                    break
                if isinstance(found, NotDue):
                    wake = found.at if wake is None else min(wake, found.at)
                    break
                pos, env, size = found
                if env.msg_id in self.in_flight:
                    continue
                if env.held is not None:
                    # Held mail waits for release, but must not pin its segment: the
                    # last runner, passing it, re-appends it at the head (envelope only).
                    self._reappend(pos, env, size, now)
                    continue
                flight = self.start(pos, env, size, now)
                if self.state.time.accepted_at(pos, env) + self.state.options.max_lifetime <= now:
                    self._expire(flight, now)
                    continue
                scheduler.took(runner)
                return Attempt(self, flight)
        return wake

    def start(self, pos: Position, env: rec.Envelope, size: int, now: float) -> InFlight:
        """Write the start record (supersedes the envelope) and track the attempt. Lock
        held."""
        env = self.state.accepted_as_of_now(pos, env)
        body = resolve_body(env, pos, size)
        start = rec.Start(env.msg_id, pos, env.klass, now)
        # Not waited for: if a crash loses it, the envelope is still live and is attempted
        # again; deltas that depend on it come later in the log and so are lost with it.
        start_at, _ = self.scheduler.enqueue(start)
        flight = InFlight(env, pos, body, start_at, set(env.recipients), [], {}, now)
        self.in_flight[env.msg_id] = flight
        return flight

    def _expire(self, flight: InFlight, now: float) -> None:
        """Fail every pending recipient of a message past ``max_lifetime``."""
        rcpts = tuple(sorted(flight.unreported))
        self.scheduler.enqueue(
            rec.Delta(flight.envelope.msg_id, rec.FAILED, rcpts, EXPIRED_REPLY, now)
        )
        flight.outcomes.extend(rec.Outcome(r, rec.FAILED, EXPIRED_REPLY, now) for r in rcpts)
        flight.unreported.clear()
        self._log(flight, rcpts, rec.FAILED, EXPIRED_REPLY, now, expired=True)
        self.state.counts["expired"] += 1
        self.state.counts["failed"] += len(rcpts)
        self.settle(flight, now, "expired")

    def _reappend(self, pos: Position, env: rec.Envelope, size: int, now: float) -> None:
        """Copy a held envelope to the head of the log so that its segment can go."""
        env = self.state.accepted_as_of_now(pos, env)
        old = resolve_body(env, pos, size)
        body, promoted_from = self.bodies.promote(env, old, env.klass, env.held, now)
        # Not waited for: if lost, the old envelope is still live and is re-appended again.
        _, end = self.scheduler.enqueue(
            attrs.evolve(
                env, written_at=now, body=body, supersedes=pos, promoted_from=promoted_from
            )
        )
        if promoted_from is not None:
            self.bodies.promoted(old, env.msg_id, end)

    # --- reporting ---------------------------------------------------------------------

    def check_attempt(self, flight: InFlight) -> None:
        self.state.check_open()
        if flight.lease_expired:
            raise AttemptExpired(
                f"the attempt on {flight.envelope.msg_id} ran past attempt_timeout "
                f"({self.state.options.attempt_timeout:g} s) and was closed as deferred; the "
                "message will be attempted again, so report nothing more for this attempt"
            )
        if flight.closed:
            raise SpoolClosed(f"the attempt on {flight.envelope.msg_id} is closed")

    def report(self, flight: InFlight, status: str, recipients: Iterable[str], reply: str) -> None:
        """Record ``status`` for ``recipients``; delivered and failed are durable on
        return. Takes the lock (and waits for the fsync outside it)."""
        end, logged = self.stage_report(flight, status, recipients, reply)
        if end is not None:
            self.state.writer.wait_durable(end)  # the commit point of delivered()/failed()
        logged()

    def stage_report(
        self, flight: InFlight, status: str, recipients: Iterable[str], reply: str
    ) -> tuple[Position | None, Callable[[], None]]:
        """``report`` but the wait: the end the log must be durable past before the report
        counts as made (None for deferred, which need not wait), and the function that
        writes its delivery-log lines then."""
        state = self.state
        state.check_process()
        if isinstance(recipients, str | bytes) or not isinstance(recipients, Iterable):
            raise SpoolMisuse("recipients must be a list of addresses, not one string")
        rcpts = tuple(recipients)
        if not all(isinstance(r, str) for r in rcpts):
            raise SpoolMisuse(f"recipients must be addresses (str): {rcpts!r}")
        check_text(reply, "reply")
        now = state.now()
        with state.lock:
            self.check_attempt(flight)
            if not rcpts:
                raise SpoolMisuse("no recipients given")
            for r in rcpts:
                if r not in flight.unreported:
                    known = r in flight.envelope.recipients
                    why = "was already reported in this attempt" if known else "is not pending"
                    raise SpoolMisuse(f"recipient {r!r} {why} for {flight.envelope.msg_id}")
            if len(set(rcpts)) != len(rcpts):
                raise SpoolMisuse("a recipient is listed twice")
            _, end = self.scheduler.enqueue(
                rec.Delta(flight.envelope.msg_id, status, rcpts, reply, now),
                waited=status != rec.DEFERRED,  # delivered and failed: the caller waits
            )
            flight.unreported.difference_update(rcpts)
            if status == rec.DEFERRED:
                flight.deferred.update(dict.fromkeys(rcpts, reply))
            else:
                flight.outcomes.extend(rec.Outcome(r, status, reply, now) for r in rcpts)
            state.counts[status] += len(rcpts)
        return (None if status == rec.DEFERRED else end), functools.partial(
            self._log, flight, rcpts, status, reply, now
        )

    def _log(
        self,
        flight: InFlight,
        rcpts: tuple[str, ...],
        status: str,
        reply: str,
        now: float,
        *,
        expired: bool = False,
    ) -> None:
        """The delivery log's lines for what was just recorded (``delivery_log.py``)."""
        delivery_log.outcome(
            flight.envelope.msg_id,
            rcpts,
            status,
            reply,
            accepted_at=flight.envelope.accepted_at,
            started_at=flight.started_at,
            now=now,
            expired=expired,
        )

    # --- ending ------------------------------------------------------------------------

    def close_attempt(self, flight: InFlight, *, crashed: bool = False) -> None:
        """End an attempt: its unreported recipients are deferred; ``crashed`` counts the
        ending as a crash (``Attempt.close_crashed``). Lock held."""
        if flight.closed or self.state.closed:
            return
        now = self.state.now()
        if flight.unreported:
            rcpts = tuple(sorted(flight.unreported))
            self.scheduler.enqueue(
                rec.Delta(flight.envelope.msg_id, rec.DEFERRED, rcpts, UNREPORTED_REPLY, now)
            )
            flight.deferred.update(dict.fromkeys(rcpts, UNREPORTED_REPLY))
            flight.unreported.clear()
            self.state.counts["deferred"] += len(rcpts)
            self._log(flight, rcpts, rec.DEFERRED, UNREPORTED_REPLY, now)
        # Not waited for: recovery rebuilds the same outcome from the durable deltas
        # and the operator's control records (an action taken in flight).
        self.settle(flight, now, "all recipients settled", crashed=crashed)

    def settle(self, flight: InFlight, now: float, reason: str, *, crashed: bool = False) -> None:
        """Write the replacement envelope or the finish record; the attempt is over.

        A replacement after an attempt that ``crashed`` carries the crash count one up (and
        is held at ``crash_limit``, as recovery's R3 holds); any other carries it at 0.

        Neither is waited for: until they are durable the start record is unsettled, and
        recovery rebuilds the same outcome from the envelope and the durable deltas.
        Lock held.
        """
        options = self.state.options
        env = flight.envelope
        if flight.delete is not None:
            self._end_rest(flight, *flight.delete, now)
            reason = (
                "deleted by the operator"
                if flight.delete[0] == rec.DELETED
                else "bounced by the operator"
            )
        outcomes = env.outcomes + tuple(flight.outcomes)
        remaining = tuple(r for r in env.recipients if r in flight.deferred)
        if remaining:
            attempts = env.attempts + 1
            crashes = env.crashes + 1 if crashed else 0
            held = flight.hold
            if held is None and crashes >= options.crash_limit:
                held = CRASH_LOOP_HOLD.format(crashes=crashes)
            klass = options.last_class if held else options.class_for_attempts(attempts)
            body, promoted_from = self.bodies.promote(env, flight.body, klass, held, now)
            replacement = successor_envelope(
                env,
                flight.envelope_at,
                remaining=remaining,
                outcomes=outcomes,
                body=body,
                now=now,
                klass=klass,
                held=held,
                crashes=crashes,
                last_reply=flight.deferred[remaining[-1]],
                promoted_from=promoted_from,
            )
            _, end = self.scheduler.enqueue(replacement)
            if promoted_from is not None:
                self.bodies.promoted(flight.body, env.msg_id, end)
            if held is not None and held != flight.hold:
                delivery_log.held(env.msg_id, held, by_operator=False)
        else:
            body, promoted_from = self.bodies.finish_body(env.msg_id, flight.body, outcomes)
            finish = rec.Finish(
                env.msg_id,
                now,
                body,
                outcomes,
                reason,
                env.sender,
                env.accepted_at,
                promoted_from,
            )
            _, end = self.scheduler.enqueue(finish)
            self.bodies.finished(finish, end, flight.body)
            delivery_log.removed(env.msg_id, reason)
        flight.closed = True
        del self.in_flight[env.msg_id]
        self.state.cond.notify_all()

    def _end_rest(self, flight: InFlight, status: str, reply: str, now: float) -> None:
        """End every recipient still pending or deferred in this attempt (operator delete:
        ``deleted``, no bounce; operator bounce: ``failed``)."""
        rcpts = tuple(sorted(flight.unreported | set(flight.deferred)))
        if not rcpts:
            return
        self.scheduler.enqueue(rec.Delta(flight.envelope.msg_id, status, rcpts, reply, now))
        flight.outcomes.extend(rec.Outcome(r, status, reply, now) for r in rcpts)
        flight.unreported.clear()
        flight.deferred.clear()
        self._log(flight, rcpts, status, reply, now)
        if status == rec.FAILED:
            self.state.counts["failed"] += len(rcpts)

    def close_abandoned(self) -> None:
        """Close the attempts dropped without a close. Lock held."""
        while self.abandoned:
            self.close_attempt(self.abandoned.popleft())

    def close_all(self) -> None:
        """Close every attempt in flight (the spool is closing). Lock held."""
        for flight in list(self.in_flight.values()):
            self.close_attempt(flight)
        self.close_abandoned()

    def end_expired_leases(self) -> None:
        """Close every attempt open longer than ``attempt_timeout`` as deferred (its
        unreported recipients deferred, as a close does): a hung worker must not pin the
        log. Later reports on it raise ``AttemptExpired``. Lock held."""
        deadline = self.state.now() - self.state.options.attempt_timeout
        for flight in [f for f in self.in_flight.values() if f.started_at <= deadline]:
            self.close_attempt(flight)
            flight.lease_expired = True
            self.state.counts["leases_expired"] += 1

    # --- recovery's decisions ------------------------------------------------------------

    def append_recovered(self, records: Iterable[rec.Record]) -> Position | None:
        """Append what recovery decided (replacements and finishes of the attempts a crash
        left open); return the end to wait for. Lock held.

        A crash before these are durable leaves the same start records unsettled: the next
        recovery decides them again (decision table, case R1/R2).
        """
        end: Position | None = None
        for r in records:
            if isinstance(r, rec.Envelope) and r.supersedes is not None:
                self.scheduler.superseded.add(r.supersedes)
            if not isinstance(r, rec.Finish):
                _, end = self.scheduler.enqueue(r)
                continue
            # As at the end of an attempt: a bounce's inline body is copied to a file (an
            # orphan in incoming/ if a crash comes before the finish).
            inline = r.body
            body, copied_from = self.bodies.finish_body(r.msg_id, r.body, r.outcomes)
            r = attrs.evolve(r, body=body, promoted_from=copied_from)
            _, end = self.scheduler.enqueue(r)
            if copied_from is not None:
                inline = rec.BodyRef(rec.BODY_INLINE, r.body.size, copied_from)
            self.bodies.finished(r, end, inline)
        return end


__all__ = [
    "EXPIRED_REPLY",
    "UNREPORTED_REPLY",
    "Attempt",
    "AttemptBook",
    "InFlight",
    "MessageEnvelope",
]
