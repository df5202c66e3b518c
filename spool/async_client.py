"""Awaitable forms of the client's calls, for asyncio embedders (aiosmtpd handlers).

``await spool.aconnect(DIR)`` gives an ``AsyncClient``: the calls of ``spool.Client`` as
coroutines. A call sends its request and awaits the future the client's reader thread
completes when the reply comes (``asyncio.wrap_future``): no thread waits per call, so a
thousand SMTP sessions awaiting ``accept`` share one connection and, at the owner, one
group commit. ``accept`` returns once the message is durable, as in process.

The send itself runs in the default executor's threads: it returns at once unless the
owner stopped reading (32 requests of this connection in hand), and then it is a worker
thread that waits (back-pressure), never the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import time
from collections.abc import Iterable
from typing import Any

from spool import records as rec
from spool.arguments import check_seconds
from spool.attempts import MessageEnvelope
from spool.client import (
    Client,
    _entry,
    _envelope,
    _texts,
    action_result,
    check_attempt_open,
    connect,
    raise_for_one,
    recorded_history,
)
from spool.operator import BOUNCED_REPLY, DELETED_REPLY, HELD_REASON, ActionResult, OperatorAction
from spool.protocol import CLAIM_WAIT_MAX
from spool.queue_view import QueueEntry
from spool.records import Position
from spool.statistics import SpoolStatistics


async def aconnect(directory: str | os.PathLike[str], timeout: float = 5.0) -> AsyncClient:
    """``spool.connect`` for asyncio (the connect itself runs in a thread, once)."""
    return AsyncClient(await asyncio.to_thread(connect, directory, timeout))


class AsyncClient:
    """The calls of ``spool.Client``, awaitable. Create with ``await spool.aconnect(DIR)``."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def _call(self, op: str, **args: Any) -> Any:
        # The send runs in a worker thread: a socket the owner stops reading (32 requests
        # of this connection in hand) blocks that thread, never the event loop.
        sent = await asyncio.to_thread(self.client._request, op, **args)
        return await asyncio.wrap_future(sent)

    async def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str:
        """The id, once the message is durable (answer 250 then)."""
        msg_id: str = await self._call(
            "accept", sender=sender, recipients=_texts(recipients), data=bytes(data)
        )
        return msg_id

    async def smtp_tally(self, counts: dict[str, int]) -> None:
        """Give the owner this SMTP front-end process's figures (smtp_tally.py)."""
        await self._call("smtp_tally", counts=dict(counts))

    async def claim(self, timeout: float | None = None) -> AsyncAttempt | None:
        found = await self.claim_many(1, timeout)
        return found[0] if found else None

    async def claim_many(
        self, most: int, timeout: float | None = None, *, with_data: bool = False
    ) -> builtins.list[AsyncAttempt]:
        """As ``Client.claim_many``: up to ``most`` due attempts, waiting ``timeout`` for
        the first (several requests when it is longer than ``CLAIM_WAIT_MAX``), the bodies
        with them when ``with_data`` (up to 1 MiB in all)."""
        wait = check_seconds(timeout, "timeout")
        deadline = time.monotonic() + wait
        while True:
            step = min(wait, CLAIM_WAIT_MAX)
            found = await self._call("claim", timeout=step, max=most, data=with_data)
            wait = deadline - time.monotonic()
            if found or wait <= 0:
                return [
                    AsyncAttempt(self, MessageEnvelope(**_envelope(e)), e.get("data"))
                    for e in found
                ]

    async def list(self) -> builtins.list[QueueEntry]:
        return [_entry(e) for e in await self._call("list")]

    async def act(
        self,
        action: OperatorAction,
        msg_ids: Iterable[str] | None = None,
        *,
        reason: str | None = None,
    ) -> ActionResult:
        ids = None if msg_ids is None else _texts(msg_ids)
        r = await self._call("act", action=OperatorAction(action).value, msg_ids=ids, reason=reason)
        return action_result(r)

    async def _one(self, action: OperatorAction, msg_id: str, reason: str | None) -> None:
        raise_for_one(await self.act(action, [msg_id], reason=reason), msg_id)

    async def hold(self, msg_id: str, reason: str = HELD_REASON) -> None:
        await self._one(OperatorAction.HOLD, msg_id, reason)

    async def release(self, msg_id: str) -> None:
        await self._one(OperatorAction.RELEASE, msg_id, None)

    async def delete(self, msg_id: str, reason: str = DELETED_REPLY) -> None:
        await self._one(OperatorAction.DELETE, msg_id, reason)

    async def bounce(self, msg_id: str, reason: str = BOUNCED_REPLY) -> None:
        await self._one(OperatorAction.BOUNCE, msg_id, reason)

    async def retry_now(self, msg_id: str | None = None) -> int:
        changed: int = await self._call("retry_now", msg_id=msg_id)
        return changed

    async def show(self, msg_id: str) -> builtins.list[tuple[Position, rec.Record]]:
        """As ``Client.show``: the message's records, read from the files (in a thread:
        never on the event loop) once the owner synced."""
        await self.sync()
        return await asyncio.to_thread(recorded_history, self.client.path, msg_id)

    async def statistics(self) -> SpoolStatistics:
        return SpoolStatistics(**await self._call("statistics"))

    async def status(self) -> dict[str, Any]:
        """As ``Client.status``: the owner, its workers and their attempts, its options."""
        result: dict[str, Any] = await self._call("status")
        return result

    async def sync(self) -> None:
        await self._call("sync")

    async def checkpoint(self) -> dict[str, Any]:
        """As ``Client.checkpoint``: restart positions written now."""
        result: dict[str, Any] = await self._call("checkpoint")
        return result

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncAttempt:
    """An attempt over the socket, awaitable; ``async with`` closes it."""

    def __init__(
        self, client: AsyncClient, envelope: MessageEnvelope, data: bytes | None = None
    ) -> None:
        self._client = client
        self.envelope = envelope
        self._data = data  # the body, when it came with the claim
        self._closed = False

    @property
    def msg_id(self) -> str:
        return self.envelope.msg_id

    async def read_data(self) -> bytes:
        self._check_open()
        if self._data is not None:
            return self._data
        data: bytes = await self._client._call("read_data", msg_id=self.msg_id)
        return data

    async def delivered(self, recipients: Iterable[str], reply: str) -> None:
        """Durable on return."""
        await self._report("delivered", recipients, reply)

    async def failed(self, recipients: Iterable[str], reply: str) -> None:
        """Durable on return."""
        await self._report("failed", recipients, reply)

    async def deferred(self, recipients: Iterable[str], reply: str) -> None:
        await self._report("deferred", recipients, reply)

    async def _report(self, status: str, recipients: Iterable[str], reply: str) -> None:
        self._check_open()
        await self._client._call(
            "report", msg_id=self.msg_id, status=status, recipients=_texts(recipients), reply=reply
        )

    async def settle(self, reports: Iterable[tuple[str, Iterable[str], str]]) -> None:
        """As ``RemoteAttempt.settle``: each ``(status, recipients, reply)`` reported, then
        the attempt closed, in one round trip; the delivered and failed ones durable on
        return. On a refused report the attempt stays open."""
        self._check_open()
        groups = [[status, _texts(recipients), reply] for status, recipients, reply in reports]
        await self._client._call("settle", msg_id=self.msg_id, reports=groups)
        self._closed = True

    def _check_open(self) -> None:
        check_attempt_open(self._closed, self.msg_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._client.client.closed:
            await self._client._call("close_attempt", msg_id=self.msg_id)

    async def __aenter__(self) -> AsyncAttempt:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
