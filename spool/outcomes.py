"""Final outcomes of finished messages, for bounces (DSNs): read from the log, acked durably.

A finish record carries every recipient's final status and last reply. When the spool is
opened with ``outcomes=True``, an outcome reader walks the log like a queue runner and
hands each finish to the agent (``Spool.next_outcome``); the agent acknowledges it
(``Spool.ack_outcome``) once it has sent its bounce. Acknowledgements are control records,
durable when ``ack_outcome`` returns.

The outcome front is the earliest finish handed out but not acknowledged (or the reader's
cursor). The restart positions record it together with the ids acknowledged ahead of it,
so after a crash every unacknowledged outcome is handed out again and no acknowledged one
is. Segments behind the front are kept, as they must be: an agent that never reads its
outcomes pins the log, which is why tracking is opt-in.

The finish also carries the sender, the acceptance time and where the body is, and with
tracking the body outlives the message until the bounce is sent: a body file is removed
when its outcome is acknowledged (not when the message finishes), and the inline body of a
message whose outcome names a failed recipient is copied to a file as it finishes
(``BodyKeeper.finish_body``), so a bounce can always return the message.

Not thread-safe: the spool calls it under its lock.
"""

from __future__ import annotations

import attrs

from spool import format as fmt
from spool import records as rec
from spool.framing import Frame
from spool.fs import FileSystem
from spool.reader import LogCursor
from spool.records import Position


@attrs.frozen
class MessageOutcome:
    """The final result of one message: what a bounce (an RFC 3464 notice) needs.

    ``recipients`` holds every recipient's final status, reply and time; ``sender`` (the
    bounce's recipient; "" for the null sender) and ``accepted_at`` come from the envelope
    (None only for messages finished by an older version); ``body`` says where the message
    is: a file in ``bodies/``, or an inline BODY frame at ``body.at`` in the log.
    ``Spool.outcome_body`` reads it while it exists (``BodyGone`` after).
    """

    msg_id: str
    finished_at: float
    reason: str
    recipients: tuple[rec.Outcome, ...]
    sender: str | None = None
    accepted_at: float | None = None
    body: rec.BodyRef | None = None

    @property
    def failed(self) -> tuple[rec.Outcome, ...]:
        """The recipients a bounce must name."""
        return tuple(o for o in self.recipients if o.status == rec.FAILED)

    @property
    def deleted(self) -> tuple[rec.Outcome, ...]:
        """The recipients an operator deleted: no bounce names them."""
        return tuple(o for o in self.recipients if o.status == rec.DELETED)


class OutcomeReader:
    """Walks finish records from the outcome front; tracks what is handed out and acked."""

    def __init__(self, fs: FileSystem, log_dir: str, front: Position, acked: set[str]) -> None:
        self._cursor = LogCursor(
            fs, log_dir, front, skip_bodies=True, chunk_size=64 * 1024, live=True
        )
        self._pending: dict[str, tuple[Position, rec.BodyRef]] = {}
        self._acked_ahead: dict[str, Position | None] = dict.fromkeys(acked)

    def close(self) -> None:
        self._cursor.close()

    def next(self, limit: Position) -> MessageOutcome | None:
        """The next unacknowledged outcome before ``limit``, or None."""
        while (item := self._cursor.next(limit)) is not None:
            pos, frame = item
            if not isinstance(frame, Frame) or frame.type != fmt.T_FINISH:
                continue
            record = rec.decode_stored(
                frame.type, frame.payload, self._cursor.path(pos.segment), pos.offset
            )
            assert isinstance(record, rec.Finish)
            if record.msg_id in self._acked_ahead:
                # Acknowledged before a restart: not handed out again. Keep the id, now with
                # its position, until the front passes it: the next positions must still
                # carry it while an earlier outcome holds the front back.
                self._acked_ahead[record.msg_id] = pos
                continue
            self._pending[record.msg_id] = (pos, record.body)
            return MessageOutcome(
                record.msg_id,
                record.at,
                record.reason,
                record.outcomes,
                record.sender,
                record.accepted_at,
                record.body,
            )
        return None

    def waiting(self, msg_id: str) -> bool:
        """Whether the outcome of ``msg_id`` was handed out and awaits its acknowledgement."""
        return msg_id in self._pending

    def ack(self, msg_id: str) -> rec.BodyRef:
        """Record an acknowledgement (the caller checked ``waiting`` and writes the control
        record); returns where the message's body is, which is no longer needed."""
        pos, body = self._pending.pop(msg_id)
        self._acked_ahead[msg_id] = pos
        return body

    def front(self) -> Position:
        """Finish records before this position have all been acknowledged."""
        return min((pos for pos, _ in self._pending.values()), default=self._cursor.position)

    def acked_ahead(self) -> frozenset[str]:
        """Acked messages whose finish lies at or after ``front()`` (pruned here)."""
        front = self.front()
        self._acked_ahead = {m: p for m, p in self._acked_ahead.items() if p is None or p >= front}
        return frozenset(self._acked_ahead)
