"""Awaitable forms of the in-process calls that wait, for asyncio embedders (aiosmtpd).

An SMTP server answers 250 only once ``accept`` is durable, and must not block its event
loop on the fdatasync meanwhile. ``AsyncSpool`` wraps an open ``Spool``: the calls that
wait for the disk stage their records exactly as the blocking forms do (same checks, same
lock, same records), then await a future that the log writer completes when the group
commit covering them is durable (``LogWriter.durable_future``). No thread waits per call:
a thousand sessions awaiting ``accept`` share fsyncs with each other and with threads
calling the blocking forms, and ``accept`` returns when the message is durable, as in
process.

What still runs in a worker thread (``asyncio.to_thread``), named so nobody is surprised:
the body of a message larger than ``inline_body_max`` (written to its own file, with that
file's fsyncs), ``open`` and ``close`` (recovery, the last checkpoint), and the operator
actions and ``list``/``show``/``statistics`` (a walk of the log each; not hot paths).
Every call takes the spool's lock as the blocking forms do (held for microseconds, a
segment walk at most).

``claim`` with a timeout waits on the loop without a thread: the spool's condition calls a
listener (``state.ListenedCondition``) that wakes the loop when anything changes (a batch
durable, an attempt closed, an operator's action), and the claim looks again then, or
when the next deferred message is due, whichever comes first.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any, Final

from spool import records as rec
from spool.arguments import check_seconds
from spool.attempts import Attempt, MessageEnvelope
from spool.operator import BOUNCED_REPLY, DELETED_REPLY, HELD_REASON, ActionResult, OperatorAction
from spool.queue_view import QueueEntry
from spool.records import Position
from spool.spool import Spool
from spool.statistics import SpoolStatistics

# The longest a waiting claim sleeps without looking again (a change missed can cost no
# more than this; none should be missed).
CLAIM_LOOK_MAX: Final = 1.0


class _Changes:
    """What wakes the claims awaited on one loop: a future completed, on that loop, each
    time the spool's condition is notified. Listens only while a claim of that loop looks
    or waits (``AsyncSpool._claims_waiting``), so loops that are done leave nothing."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.next: asyncio.Future[None] = loop.create_future()
        self.waiting = 0  # claims that look or wait now (only the loop changes it)

    def listener(self) -> None:
        """The spool's condition was notified (any thread, the spool's lock held)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        fired, self.next = self.next, self._loop.create_future()
        if not fired.done():
            fired.set_result(None)


class AsyncSpool:
    """An open ``Spool`` with awaitable calls. ``await AsyncSpool.open(DIR, **options)``,
    or ``AsyncSpool(spool)`` around a spool already open (the blocking calls stay usable
    from other threads; both share one group commit)."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self._changes: dict[asyncio.AbstractEventLoop, _Changes] = {}

    @contextlib.contextmanager
    def _claims_waiting(self) -> Iterator[_Changes]:
        """The waker of this loop's claims, listening to the spool from the first claim
        that looks until the last one is done."""
        loop = asyncio.get_running_loop()
        changes = self._changes.get(loop)
        st = self.spool._state
        if changes is None:
            changes = self._changes[loop] = _Changes(loop)
            with st.lock:
                st.cond.listeners.append(changes.listener)
        changes.waiting += 1
        try:
            yield changes
        finally:
            changes.waiting -= 1
            if not changes.waiting:
                self._changes.pop(loop, None)
                with st.lock, contextlib.suppress(ValueError):
                    st.cond.listeners.remove(changes.listener)

    @classmethod
    async def open(cls, directory: str | os.PathLike[str], **options: Any) -> AsyncSpool:
        """``Spool.open`` (recovery included) in a worker thread."""
        return cls(await asyncio.to_thread(Spool.open, directory, **options))

    async def _durable(self, end: Position) -> None:
        """Until the log is durable past ``end``, without blocking the loop."""
        await asyncio.wrap_future(self.spool._state.writer.durable_future(end))

    async def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str:
        """``Spool.accept``: the id, once the message is durable (answer 250 then)."""
        acceptor = self.spool._acceptor
        if isinstance(data, bytes) and len(data) > self.spool.options.inline_body_max:
            # Not ``waited``: if this task is cancelled (an SMTP client hanging up) while
            # the thread writes the body, the thread still queues the envelope and nobody
            # waits for it; the flusher, woken, writes it within ``sync_interval``.
            stage = functools.partial(acceptor.stage, waited=False)
            staged = await asyncio.to_thread(stage, sender, recipients, data)
        else:
            staged = acceptor.stage(sender, recipients, data)
        await self._durable(staged.end)
        return staged.durable()

    async def claim(self, timeout: float | None = None) -> AsyncSpoolAttempt | None:
        """``Spool.claim``: the next due message, waiting up to ``timeout`` seconds."""
        book, st = self.spool._book, self.spool._state
        st.check_process()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + check_seconds(timeout, "timeout")
        synced = False
        # Listening before the first look: a change after it must wake the wait.
        with self._claims_waiting() as changes:
            while True:
                changed = changes.next
                with st.lock:
                    st.check_open()
                    book.close_abandoned()
                    found = book.claim_next()
                    if isinstance(found, Attempt):
                        return AsyncSpoolAttempt(self, found)
                    tail = st.writer.tail
                    behind = st.writer.durable < tail
                    wake = None if found is None else max(0.0, found - st.now())
                if behind and not synced:
                    # Runners read only the durable log (as ``Spool.claim``): flush once.
                    await self._durable(tail)
                    synced = True
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    return None
                sleep = min(left, CLAIM_LOOK_MAX, CLAIM_LOOK_MAX if wake is None else wake)
                await asyncio.wait([changed], timeout=sleep)

    async def sync(self) -> None:
        """``Spool.sync``: everything written so far durable."""
        self.spool._state.check_open()
        await self._durable(self.spool._state.writer.tail)

    async def list(self) -> builtins.list[QueueEntry]:
        return await asyncio.to_thread(lambda: builtins.list(self.spool.list()))

    async def show(self, msg_id: str) -> builtins.list[tuple[Position, rec.Record]]:
        return await asyncio.to_thread(self.spool.show, msg_id)

    async def hold(self, msg_id: str, reason: str = HELD_REASON) -> None:
        await asyncio.to_thread(self.spool.hold, msg_id, reason)

    async def release(self, msg_id: str) -> None:
        await asyncio.to_thread(self.spool.release, msg_id)

    async def delete(self, msg_id: str, reason: str = DELETED_REPLY) -> None:
        await asyncio.to_thread(self.spool.delete, msg_id, reason)

    async def bounce(self, msg_id: str, reason: str = BOUNCED_REPLY) -> None:
        await asyncio.to_thread(self.spool.bounce, msg_id, reason)

    async def retry_now(self, msg_id: str | None = None) -> int:
        return await asyncio.to_thread(self.spool.retry_now, msg_id)

    async def act(
        self,
        action: OperatorAction,
        msg_ids: Iterable[str] | None = None,
        *,
        reason: str | None = None,
    ) -> ActionResult:
        return await asyncio.to_thread(self.spool.act, action, msg_ids, reason=reason)

    async def statistics(self) -> SpoolStatistics:
        return await asyncio.to_thread(self.spool.statistics)

    async def close(self) -> None:
        """``Spool.close`` in a worker thread."""
        await asyncio.to_thread(self.spool.close)

    async def __aenter__(self) -> AsyncSpool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSpoolAttempt:
    """An ``Attempt`` with awaitable reports: ``delivered`` and ``failed`` return once
    durable, as in process; ``async with`` closes it."""

    def __init__(self, owner: AsyncSpool, attempt: Attempt) -> None:
        self._owner = owner
        self.attempt = attempt
        self.envelope: MessageEnvelope = attempt.envelope

    @property
    def msg_id(self) -> str:
        return self.attempt.msg_id

    async def read_data(self) -> bytes:
        """The message body; a body in its own file is read in a worker thread."""
        if self.attempt._flight.body.kind == rec.BODY_FILE:
            return await asyncio.to_thread(self.attempt.read_data)
        return self.attempt.read_data()

    async def delivered(self, recipients: Iterable[str], reply: str) -> None:
        """Durable on return: never attempted again."""
        await self._report(rec.DELIVERED, recipients, reply)

    async def failed(self, recipients: Iterable[str], reply: str) -> None:
        """Durable on return."""
        await self._report(rec.FAILED, recipients, reply)

    async def deferred(self, recipients: Iterable[str], reply: str) -> None:
        """Retried later (nothing to wait for: a deferral needs no fsync)."""
        await self._report(rec.DEFERRED, recipients, reply)

    async def _report(self, status: str, recipients: Iterable[str], reply: str) -> None:
        book = self.attempt._book
        end, logged = book.stage_report(self.attempt._flight, status, recipients, reply)
        if end is not None:
            await self._owner._durable(end)
        logged()

    async def close(self) -> None:
        """End the attempt (its replacement or finish is written without waiting)."""
        self.attempt.close()

    async def __aenter__(self) -> AsyncSpoolAttempt:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
