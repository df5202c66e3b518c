"""Operator actions on queued messages: hold, release, delete, bounce, retry now.

An action on a queued message supersedes its live envelope with a new one (held, released,
due now) or ends it (delete: its pending recipients end ``deleted``, no bounce; bounce:
they fail, so a bounce goes out). An action on a message in flight is a control record,
durable on return, that the attempt's end applies (``attempts.py``) and that recovery
applies if a crash ends the attempt first.

Bulk actions walk the log once (``queue_view.py``) and act on each message under the
spool's lock on its own, so deliveries go on meanwhile; one fsync covers them all.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import attrs

from spool import delivery_log
from spool import format as fmt
from spool import records as rec
from spool.arguments import check_msg_id, check_text
from spool.attempts import AttemptBook, InFlight
from spool.bodies import body_file_paths, read_body_file, write_body_file
from spool.body_keeping import BodyKeeper
from spool.errors import CorruptSpool, SpoolMisuse, UnknownMessage
from spool.queue_view import QueueEntry, live_messages
from spool.reader import read_frame_at
from spool.records import Position
from spool.recovery import finish_acknowledged, resolve_body
from spool.scheduling import Scheduler, encode_checked
from spool.state import SpoolState

DELETED_REPLY: Final = "message deleted by the operator (no bounce)"
BOUNCED_REPLY: Final = "554 5.0.0 delivery cancelled by the operator"
HELD_REASON: Final = "held by the operator"
LOCATE_RETRIES: Final = 20  # walks of the log before a message that keeps moving is refused


# Positions per ``used-up`` note: about 10 bytes each, far inside one frame.
USED_UP_PER_NOTE: Final = 4096


class OperatorAction(enum.Enum):
    """What an operator can do to a queued message (``hold``, ``release``, ...)."""

    HOLD = "hold"
    RELEASE = "release"
    DELETE = "delete"  # silently: no bounce (postsuper -d, exim -Mrm)
    BOUNCE = "bounce"  # give up: the pending recipients fail, a bounce goes out (exim -Mg)
    RETRY = "retry"


# What an ended message's pending recipients become, with the reply a reason defaults to.
ENDINGS: Final = {
    OperatorAction.DELETE: (rec.DELETED, DELETED_REPLY),
    OperatorAction.BOUNCE: (rec.FAILED, BOUNCED_REPLY),
}


# The control record that makes an action on a message in flight durable.
IN_FLIGHT: Final = {
    OperatorAction.HOLD: rec.IN_FLIGHT_HOLD,
    OperatorAction.RELEASE: rec.IN_FLIGHT_RELEASE,
    OperatorAction.DELETE: rec.IN_FLIGHT_DELETE,
    OperatorAction.BOUNCE: rec.IN_FLIGHT_BOUNCE,
}


@attrs.frozen
class ActionResult:
    """What ``Spool.act`` did, message by message (ids in the order they were given)."""

    changed: tuple[str, ...]  # the action took effect (durable)
    unchanged: tuple[str, ...]  # nothing to do: already held, not deferred, ...
    unknown: tuple[str, ...]  # not in the spool (never was, or finished)
    refused: dict[str, str]  # the action does not apply (a release of mail not held): why


@attrs.define
class _ActionTally:
    changed: list[str] = attrs.Factory(list)
    unchanged: list[str] = attrs.Factory(list)
    unknown: list[str] = attrs.Factory(list)
    refused: dict[str, str] = attrs.Factory(dict)

    def add(self, msg_id: str, changed: bool | int) -> None:
        (self.changed if changed else self.unchanged).append(msg_id)

    def freeze(self) -> ActionResult:
        return ActionResult(
            tuple(self.changed), tuple(self.unchanged), tuple(self.unknown), dict(self.refused)
        )


def not_held(msg_id: str) -> str:
    """Why a release of ``msg_id`` does not apply (the CLI counts it as a no-op)."""
    return f"{msg_id} is not held"


def default_reason(action: OperatorAction, reason: str | None) -> str | None:
    """The reason an action records: the one given (checked), or the action's default.
    ``SpoolMisuse`` for a reason an action does not take or that is not a valid text."""
    if not isinstance(action, OperatorAction):
        raise SpoolMisuse(f"action must be an OperatorAction, not {action!r}")
    if reason is None:
        if action is OperatorAction.HOLD:
            return HELD_REASON
        return ENDINGS[action][1] if action in ENDINGS else None
    if action is OperatorAction.HOLD or action in ENDINGS:
        return check_text(reason, f"{action.value} reason")
    raise SpoolMisuse(f"{action.value} takes no reason")


class OperatorDesk:
    """Applies operator actions to the messages of one open spool."""

    def __init__(
        self, state: SpoolState, scheduler: Scheduler, bodies: BodyKeeper, book: AttemptBook
    ) -> None:
        self.state = state
        self.scheduler = scheduler
        self.bodies = bodies
        self.book = book

    def listing(self) -> Iterator[QueueEntry]:
        """``Spool.list``: the live messages, oldest first, those in flight shown active.
        Syncs first (the walk reads the durable log), then walks without the lock."""
        state = self.state
        state.check_process()
        state.check_open()
        state.writer.sync()
        entries = live_messages(state.fs, state.path, state.options.class_intervals())
        with state.lock:
            active = set(self.book.in_flight)
        for entry in sorted(entries.values(), key=lambda e: (e.accepted_at, e.msg_id)):
            if entry.msg_id in active and entry.state != "active":
                entry = attrs.evolve(entry, state="active")
            yield entry

    def act(
        self,
        action: OperatorAction,
        msg_ids: Iterable[str] | None,
        where: Callable[[QueueEntry], bool] | None,
        reason: str | None,
    ) -> ActionResult:
        """``Spool.act``: the arguments are checked before anything is written. Takes the
        lock once per message; waits for one fsync at the end."""
        state = self.state
        state.check_process()
        reason = default_reason(action, reason)
        wanted: list[str] | None = None
        if msg_ids is not None:
            if isinstance(msg_ids, str | bytes):
                raise SpoolMisuse("msg_ids must be a list of message ids, not one string")
            wanted = [check_msg_id(m) for m in msg_ids]
        if where is not None and not callable(where):
            raise SpoolMisuse(f"where must be a test of a QueueEntry, not {where!r}")
        result = _ActionTally()
        todo: list[str] = []
        end: Position | None = None
        for _ in range(LOCATE_RETRIES):
            state.check_open()
            state.writer.sync()
            entries = live_messages(state.fs, state.path, state.options.class_intervals())
            names, todo = (list(entries) if wanted is None else wanted), []
            for msg_id in dict.fromkeys(names):  # each once, in the order given
                entry = entries.get(msg_id)
                with state.lock:
                    state.check_open()
                    flight = self.book.in_flight.get(msg_id)
                    if where is not None and (entry is None or not where(entry)):
                        if entry is None and flight is None:
                            result.unknown.append(msg_id)
                        continue
                    try:
                        if flight is not None:
                            written = self._mark_in_flight(flight, action, reason)
                        elif entry is None:
                            result.unknown.append(msg_id)
                            continue
                        elif not self._still_live(entry):
                            todo.append(msg_id)  # a runner took it meanwhile: look again
                            continue
                        else:
                            written = self._supersede(entry, action, reason)
                    except SpoolMisuse as exc:
                        if msg_ids is None:
                            result.unchanged.append(msg_id)  # not named: it does not apply
                        else:
                            result.refused[msg_id] = str(exc)
                        continue
                if written is not None:
                    end = written
                result.add(msg_id, written is not None)
            if not todo:
                break
            wanted = todo
        for msg_id in todo:
            result.refused[msg_id] = "it kept changing under the operator action; try again"
        if end is not None:
            state.writer.wait_durable(end)
        return result.freeze()

    def one(self, msg_id: str, action: OperatorAction, reason: str | None) -> int:
        """One message's action (``hold``, ...): 1 if something changed, else 0."""
        check_msg_id(msg_id)
        result = self.act(action, [msg_id], None, reason)
        if result.unknown:
            raise UnknownMessage(msg_id)
        if result.refused:
            raise SpoolMisuse(result.refused[msg_id])
        return len(result.changed)

    def _still_live(self, entry: QueueEntry) -> bool:
        """Whether ``entry`` is still the message's live envelope. Lock held."""
        if entry.state == "active" or entry.envelope_at in self.scheduler.superseded:
            return False
        return self.scheduler.runner_of(entry.klass).cursor <= entry.envelope_at

    def _mark_in_flight(
        self, flight: InFlight, action: OperatorAction, reason: str | None
    ) -> Position | None:
        """Record an action on a message in flight; return the end to wait for (None: nothing
        to do). The attempt's end applies it (``AttemptBook.settle``); until then a control
        record makes it durable, and recovery applies it if a crash ends the attempt first.
        Lock held."""
        if action is OperatorAction.RETRY:
            return None  # it is being attempted right now
        if action is OperatorAction.RELEASE and flight.hold is None:
            raise SpoolMisuse(not_held(flight.envelope.msg_id))
        part = encode_checked(
            rec.Control(
                IN_FLIGHT[action], flight.envelope.msg_id, self.state.now(), why=reason or ""
            )
        )
        # A crash before this record is durable loses the action with the call that
        # asked for it (it had not returned); the attempt's own records settle as usual.
        _, end = self.scheduler.append([part], None)
        if action is OperatorAction.HOLD:
            flight.hold = reason
        elif action in ENDINGS:
            assert reason is not None
            flight.delete = (ENDINGS[action][0], reason)
        else:
            flight.hold = None
        return end

    def _supersede(
        self, entry: QueueEntry, action: OperatorAction, reason: str | None
    ) -> Position | None:
        """Write the record(s) an operator action needs; return the end to wait for.

        Everything the action writes is built and encoded before the envelope is marked
        superseded or a body pin is released, so a refused record changes nothing.
        Lock held.
        """
        state = self.state
        pos = entry.envelope_at
        env, size = self._read_envelope(pos)
        now = state.now()
        last_class = state.options.last_class
        if action in ENDINGS:
            assert reason is not None
            flight = self.book.start(pos, env, size, now)
            self.scheduler.superseded.add(pos)
            flight.delete = (ENDINGS[action][0], reason)
            self.book.settle(flight, now, f"{action.value}d by the operator")
            state.counts["deleted"] += 1
            return state.writer.tail
        if action is OperatorAction.HOLD:
            if env.held is not None:
                return None
            new = attrs.evolve(env, held=reason, klass=last_class)
        elif action is OperatorAction.RELEASE:
            if env.held is None:
                raise SpoolMisuse(not_held(env.msg_id))
            new = attrs.evolve(env, held=None, klass=0, crashes=0)
        else:
            if env.held is not None or env.klass == 0:
                return None  # held, or already due now
            new = attrs.evolve(env, klass=0)
        old = resolve_body(env, pos, size)
        body, promoted = old, None
        if new.held is not None:
            body, promoted = self.bodies.promote(env, old, new.klass, new.held, now)
        new = attrs.evolve(new, written_at=now, supersedes=pos, body=body, promoted_from=promoted)
        part = encode_checked(new)
        self.scheduler.superseded.add(pos)
        _, end = self.scheduler.append([part], new.klass)
        if promoted is not None:
            self.bodies.promoted(old, env.msg_id, end)
        state.cond.notify_all()
        if action is OperatorAction.HOLD:
            delivery_log.held(env.msg_id, reason or "", by_operator=True)
        elif action is OperatorAction.RELEASE:
            delivery_log.released(env.msg_id)
        else:
            delivery_log.made_due(env.msg_id)
        return end

    def _read_envelope(self, pos: Position) -> tuple[rec.Envelope, int]:
        """The live envelope at ``pos`` (its accept time as of now) and its frame's size."""
        state = self.state
        frame = read_frame_at(state.fs, state.log_dir, pos)
        path = os.path.join(state.log_dir, fmt.segment_name(pos.segment))
        env = rec.decode_stored(frame.type, frame.payload, path, pos.offset)
        if not isinstance(env, rec.Envelope):
            raise CorruptSpool(
                path, pos.offset, "the queue view named a record that is not an envelope"
            )
        return state.accepted_as_of_now(pos, env), frame.size

    def rebind_body(self, msg_id: str) -> bool:
        """Point the live envelope of ``msg_id`` at the copy of its body in a body file.

        For ``spool check --repair`` only: the envelope names an inline body in a segment
        that is no longer on disk (the replacement that named the body's promoted copy was
        damaged and set aside, and the pin on the segment went with the promotion). The
        copy is read and checked first; the replacement keeps everything else (held or
        not, class, attempts). Returns False if the message is not queued or its body is
        where its envelope says. ``CorruptSpool`` if the copy is missing or damaged (the
        repair then fails its recipients). Durable on return.
        """
        state = self.state
        state.check_process()
        state.check_open()
        state.writer.sync()
        entry = live_messages(state.fs, state.path, state.options.class_intervals()).get(msg_id)
        if entry is None:
            return False
        data = read_body_file(state.fs, state.path, msg_id)
        staged = state.fs.exists(body_file_paths(state.path, msg_id)[0])
        with state.lock:
            state.check_open()
            if msg_id in self.book.in_flight or not self._still_live(entry):
                raise SpoolMisuse(f"{msg_id} changed during the repair; run it again")
            pos = entry.envelope_at
            env, size = self._read_envelope(pos)
            old = resolve_body(env, pos, size)
            if (
                old.kind != rec.BODY_INLINE
                or old.at is None
                or state.fs.exists(os.path.join(state.log_dir, fmt.segment_name(old.at.segment)))
            ):
                return False
            if len(data) != old.size:
                path = body_file_paths(state.path, msg_id)[0 if staged else 1]
                raise CorruptSpool(path, 0, f"holds {len(data)} bytes, its body {old.size}")
            new = attrs.evolve(
                env,
                written_at=state.now(),
                supersedes=pos,
                body=rec.BodyRef(rec.BODY_FILE, len(data)),
                promoted_from=None,
            )
            part = encode_checked(new)
            self.scheduler.superseded.add(pos)
            # The file is durable already (it was the promotion's copy): a crash before
            # this record is durable leaves the spool as it was, and the repair runs again.
            _, end = self.scheduler.append([part], new.klass)
            if staged:
                self.bodies.staged[msg_id] = end  # the next checkpoint moves it to bodies/
            self.bodies.release_body(old, msg_id)
        state.writer.wait_durable(end)
        return True

    def note_used_up(self, envelopes: Iterable[Position]) -> None:
        """Append a ``used-up`` note naming ``envelopes``, and pass them from now on.

        For ``spool check --repair`` only: each is the envelope of a message that finished
        after a START lost to damage, so nothing else in the log says it is used up, and
        the runner of its class would hand it out again. Durable on return."""
        state = self.state
        state.check_process()
        state.check_open()
        sup = tuple(envelopes)
        if not sup:
            return
        chunks = [sup[i : i + USED_UP_PER_NOTE] for i in range(0, len(sup), USED_UP_PER_NOTE)]
        parts = [encode_checked(rec.Control(rec.USED_UP, "", state.now(), sup=c)) for c in chunks]
        with state.lock:
            state.check_open()
            self.scheduler.superseded.update(sup)
            _, end = self.scheduler.append(parts, None)
        # (W) A crash before this returns loses the note or keeps it; the repair's flag
        # keeps the spool for the repair's rerun, which notes again what is not noted.
        state.writer.wait_durable(end)

    def finish_acknowledged(self, msg_id: str, envelope_at: Position) -> None:
        """Append again the finish of ``msg_id``, which the log shows queued on the
        envelope at ``envelope_at`` though an acknowledgement of its outcome follows: its
        start and finish were lost to damage (the queued form of R6, which recovery cannot
        see). It releases the message's body as the lost finish did: an inline body's pin
        (replayed by every later scan). No outcome is handed out for it (the reader counts
        it acknowledged). For ``spool check --repair`` only, after its ``used-up`` note
        passed the envelope. Durable on return."""
        state = self.state
        state.check_process()
        state.check_open()
        with state.lock:
            state.check_open()
            env, size = self._read_envelope(envelope_at)
            if env.msg_id != msg_id:
                path = os.path.join(state.log_dir, fmt.segment_name(envelope_at.segment))
                raise CorruptSpool(path, envelope_at.offset, f"not an envelope of {msg_id}")
            body = resolve_body(env, envelope_at, size)
            finish = finish_acknowledged(msg_id, state.now(), body, env)
            part = encode_checked(finish)
            self.scheduler.superseded.add(envelope_at)
            _, end = self.scheduler.append([part], None)
            self.bodies.finished(finish, end, body)
        # (W) A crash before this is durable leaves the message as the note left it (used
        # up, its finish missing); the repair's flag keeps the spool for its rerun, which
        # names it again and writes the finish.
        state.writer.wait_durable(end)

    def restore_envelope(
        self, env: rec.Envelope, data: bytes, replaces: Position, reason: str
    ) -> None:
        """Queue ``env`` again, held with ``reason``, its body ``data`` in a body file.

        For ``spool check --repair`` only: ``env`` was read from a record that failed its
        check (``replaces`` is where the repair's marker now stands) and nothing after it
        carries the message on. It may hold the damage, so it waits, held, for the
        operator. It supersedes what ``env`` superseded (so no earlier envelope comes back
        to life, and the attempt it closed is settled), or the marker for a first envelope.
        If the message is still queued on another envelope, ``env`` must name that one
        (its damage may have hit its id or what it superseded): otherwise restoring it
        would leave two live envelopes, and ``SpoolMisuse`` is raised, nothing written.
        The body goes to a file so that no segment pin is involved (the pin of a body
        whose first envelope was lost was never counted); a body that was in a file (the
        caller read ``data`` from it, checked) stays in that file. Durable on return.
        """
        state = self.state
        state.check_process()
        reason = check_text(reason, "hold reason")
        state.check_open()
        state.writer.sync()
        queued = live_messages(state.fs, state.path, state.options.class_intervals())
        earlier = queued.get(env.msg_id)
        staged_path = body_file_paths(state.path, env.msg_id)[0]
        if env.body.kind == rec.BODY_FILE:
            # Named as it is, never written again: truncating the only copy to rewrite
            # it would lose the message to a crash in between.
            body, staged = rec.BodyRef(rec.BODY_FILE, len(data)), state.fs.exists(staged_path)
        else:
            # (B1) Durable before the envelope naming it is appended. Its source is the
            # log: a crash midway leaves a partial file that the repair writes again.
            body = write_body_file(state.fs, state.incoming_dir, env.msg_id, data, replace=True)
            staged = True
        with state.lock:
            state.check_open()
            supersedes, old = env.supersedes or replaces, None
            if earlier is not None and env.msg_id not in self.book.in_flight:
                if not self._still_live(earlier):
                    raise SpoolMisuse(f"{env.msg_id} changed during the repair; run it again")
                if earlier.envelope_at != supersedes:
                    raise SpoolMisuse(
                        f"{env.msg_id} is queued on an envelope at {earlier.envelope_at} that "
                        "the damaged one does not name: not restored over it"
                    )
                queued_env, size = self._read_envelope(supersedes)
                old = resolve_body(queued_env, supersedes, size)
            new = attrs.evolve(
                env,
                body=body,
                held=reason,
                klass=state.options.last_class,
                written_at=state.now(),
                crashes=0,
                supersedes=supersedes,
                promoted_from=None,
            )
            part = encode_checked(new)
            self.scheduler.superseded.add(supersedes)  # ahead of its runner, maybe
            _, end = self.scheduler.append([part], new.klass)
            if staged:
                self.bodies.staged[env.msg_id] = end  # the next checkpoint moves it to bodies/
            if old is not None and old.kind == rec.BODY_INLINE:
                self.bodies.release_body(old, env.msg_id)  # a file is replaced by the new one
        state.writer.wait_durable(end)
