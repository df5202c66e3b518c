"""Accepting a message: checks, the id, the body (inline or a file), the commit point.

``accept`` returns after the fdatasync covering the envelope (and its inline body, or
after the body file's own fsyncs) returned: from then on no crash loses the message. Bad
input is refused before anything is written; so is a message that would take the disk
under ``min_free_bytes`` (``body_keeping.py``).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable

import attrs

from spool import delivery_log
from spool import format as fmt
from spool import records as rec
from spool.addresses import check_recipients, check_sender
from spool.body_keeping import BodyKeeper, file_blocks
from spool.errors import InvalidMessage, MessageTooLarge, SpoolMisuse
from spool.records import Position
from spool.scheduling import Scheduler, encode_checked
from spool.state import SpoolState


class Acceptor:
    """Accepts new messages into one open spool. Thread-safe: takes the lock itself."""

    def __init__(self, state: SpoolState, scheduler: Scheduler, bodies: BodyKeeper) -> None:
        self.state = state
        self.scheduler = scheduler
        self.bodies = bodies
        self._ids = itertools.count(secrets.randbits(32))  # next() is atomic in CPython

    def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str:
        """``Spool.accept``: the new message's id, once it is durable."""
        staged = self.stage(sender, recipients, data)
        self.state.writer.wait_durable(staged.end)  # the commit point of accept
        return staged.durable()

    def stage(
        self, sender: str, recipients: Iterable[str], data: bytes, *, waited: bool = True
    ) -> StagedAccept:
        """Everything of ``accept`` but the wait for the log's fsync: checks, the body
        file (with its own fsyncs), the records queued. The message is acknowledged only
        once the writer's durable end passes ``end`` (then call ``durable()``); a crash
        before that may lose it, as a crash inside ``accept`` may. ``waited``: the caller
        waits for ``end`` next, whatever happens (``LogWriter.enqueue``)."""
        st = self.state
        st.check_process()
        options = st.options
        check_sender(sender)
        rcpts = check_recipients(recipients, options.max_recipients)
        if not isinstance(data, bytes):
            raise InvalidMessage(f"data must be bytes, not {type(data).__name__}")
        if len(data) > options.max_message_size:
            raise MessageTooLarge(
                f"message of {len(data)} bytes exceeds max_message_size "
                f"({options.max_message_size} bytes)"
            )
        st.check_open()
        now = st.now()
        # Accept second, then a counter: unique among this owner's messages (2**32 a
        # second); the counter starts at random so that owners in the same second differ.
        msg_id = f"{int(now) & 0xFFFFFFFF:08X}{next(self._ids) & 0xFFFFFFFF:08X}"
        inline = len(data) <= options.inline_body_max
        body = rec.BodyRef(rec.BODY_INLINE if inline else rec.BODY_FILE, len(data))
        env = rec.Envelope(msg_id, sender, rcpts, accepted_at=now, written_at=now, body=body)
        try:
            parts = [encode_checked(env)]  # checked before anything, the body file too, is written
        except SpoolMisuse as exc:
            raise MessageTooLarge(f"{exc}; send fewer recipients per message") from None
        if inline:
            parts.append((fmt.T_BODY, rec.encode_body(msg_id, data)))
        # Its frames (the body, inline or in its file, included) and a batch's padding.
        need = sum(len(p) + fmt.FRAME_HEADER_SIZE for _, p in parts) + 2 * fmt.SECTOR
        if not inline:
            with st.lock:
                self.bodies.reserve_space(need + file_blocks(len(data)))  # before the file
            st.writer.check_usable()  # a failed writer would leave the file an orphan
            self.bodies.write_accepted_body(msg_id, data)
        with st.lock:
            if inline:
                self.bodies.reserve_space(need)  # refused: nothing appended
            start, end = self.scheduler.append(parts, env.klass, waited=waited)
            if inline:
                self.bodies.pin_inline(start.segment)
            else:
                self.bodies.staged[msg_id] = end
            st.counts["accepted"] += 1
        return StagedAccept(msg_id, end, sender, len(data), len(rcpts))


@attrs.frozen
class StagedAccept:
    """An accepted message whose records are queued: durable once the log is past ``end``."""

    msg_id: str
    end: Position
    sender: str
    size: int
    recipients: int

    def durable(self) -> str:
        """Called once the records are durable: the delivery log's line; the id."""
        delivery_log.accepted(self.msg_id, self.sender, self.size, self.recipients)
        return self.msg_id
