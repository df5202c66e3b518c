"""What the owner does for each request on its control socket (docs/protocol.md, "Operations").

One ``Session`` per connection: it maps a request's operation to a call on the owner's
``Spool`` and keeps the attempts that connection claimed, so that a connection that drops
closes them (their unreported recipients deferred, as an attempt that is closed without
reports is). Every argument is checked for its type here, before the spool sees it; the
spool then checks values as it does for an embedder, so a bad request changes nothing.

The owner serves its connections from one asyncio loop (``owner.py``): ``serve`` answers
the requests that wait for the disk (``accept``, the reports, ``settle``, ``sync``) by
staging their records and awaiting the log writer's durable future, as ``AsyncSpool``
does, so no thread waits per request; what is quick and never waits for the disk is
answered on the loop; what walks the log or writes a file (``list``, ``act``,
``checkpoint``, a body in a file of its own) runs in the connection's own threads, so one
client's slow requests hold up only that client.

Thread-safe: the loop and those threads share a session (its own lock guards its
attempts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import attrs

from spool import records as rec
from spool.async_spool import AsyncSpool
from spool.attempts import Attempt
from spool.errors import ProtocolError, SpoolError, SpoolMisuse, UnknownMessage
from spool.operator import OperatorAction
from spool.protocol import CLAIM_WAIT_MAX, VERSION
from spool.records import Position
from spool.smtp_tally import KEYS as TALLY_KEYS
from spool.smtp_tally import SmtpTallies
from spool.spool import Spool

# The most attempts one ``claim`` hands out (a worker asks for several when many are due).
CLAIM_BATCH_MAX: Final = 64
# A claim with ``data`` carries the bodies of its attempts up to this many bytes in all
# (the others: ``read_data``), so that its reply is never one of the large ones.
CLAIM_DATA_MAX: Final = 1024 * 1024
T = TypeVar("T")
REPORT_STATUSES: Final = (rec.DELIVERED, rec.FAILED, rec.DEFERRED)
REPORT_FIELDS: Final = ("status", "recipients", "reply")  # a settle group's order
# Answered on the owner's loop as they are: quick, and never waiting for the disk (a
# close that applies an operator's mark waits for one batch: rare, and short).
ON_THE_LOOP: Final = frozenset({"hello", "status", "smtp_tally", "close_attempt"})
# The threads of one connection for its requests that walk the log or write a file (the
# owner's ``REQUESTS_IN_FLIGHT`` bounds what one connection has in hand).
THREADS_PER_CONNECTION: Final = 4


def _with_data(claimed: list[Attempt]) -> list[dict[str, Any]]:
    """The attempts' envelopes, each with its body as ``data`` while they fit in
    ``CLAIM_DATA_MAX`` together and read (otherwise without: ``read_data`` then says why,
    as it would have)."""
    room = CLAIM_DATA_MAX
    found = []
    for attempt in claimed:
        fields = attrs.asdict(attempt.envelope)
        if attempt.envelope.body_size <= room:
            with contextlib.suppress(SpoolError):
                fields["data"] = attempt.read_data()
                room -= len(fields["data"])
        found.append(fields)
    return found


# How often a claim waiting for work looks whether the owner's stop began. A worker's
# claims wait about this long anyway (``worker.CLAIM_WAIT``), so they are not cut up.
STOP_CHECK: Final = 1.0


def _arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in args:
        raise ProtocolError(f"argument {name!r} is missing")
    value = args[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # ``type(...) in`` rather than isinstance: True is not an int here.
    if type(value) not in kinds:
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ProtocolError(f"argument {name!r} must be {names}")
    return value


def _texts(args: dict[str, Any], name: str) -> list[str]:
    values: list[str] = _arg(args, name, list)
    if not all(type(v) is str for v in values):
        raise ProtocolError(f"argument {name!r} must be a list of text")
    return values


def _report_group(args: dict[str, Any]) -> tuple[str, list[str], str]:
    """The checked ``status``, ``recipients`` and ``reply`` of one report (a ``report``
    request's, or one group of a ``settle``)."""
    status = _arg(args, "status", str)
    if status not in REPORT_STATUSES:
        raise ProtocolError("status must be delivered, failed or deferred")
    return status, _texts(args, "recipients"), _arg(args, "reply", str)


def _seconds(args: dict[str, Any], name: str, most: float) -> float | None:
    """A wait of 0 to ``most`` seconds, or None; compared before any conversion, so an
    integer too large for a float is refused like any other out of range."""
    value = _arg(args, name, (int, float, type(None)))
    if value is not None and not 0 <= value <= most:
        raise SpoolMisuse(f"{name} must be 0 to {most} seconds or null")
    return None if value is None else float(value)


@attrs.define
class Peer:
    """Who is on the other end (``SO_PEERCRED``)."""

    pid: int
    uid: int
    attempts_done: int = 0


class Session:
    """The owner's side of one connection."""

    def __init__(
        self,
        spool: Spool,
        peer: Peer,
        owner_info: Callable[[], dict[str, Any]],
        stopping: threading.Event | None = None,
        tallies: SmtpTallies | None = None,
        async_spool: AsyncSpool | None = None,
    ) -> None:
        self.spool = spool
        self.peer = peer
        self._owner_info = owner_info
        self._tallies = tallies if tallies is not None else SmtpTallies()
        self._stopping = stopping or threading.Event()  # set when the owner's stop begins
        self._lock = threading.Lock()
        self._attempts: dict[str, Attempt] = {}
        self._claimed_at: dict[str, float] = {}  # time.monotonic() of each claim
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None  # ``in_thread``
        # Blocking: answered on the loop (``ON_THE_LOOP``) or in the connection's threads.
        self._ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "hello": self._hello,
            "close_attempt": self._close_attempt,
            "list": self._list,
            "act": self._act,
            "retry_now": self._retry_now,
            "statistics": self._statistics,
            "checkpoint": self._checkpoint,
            "status": self._status,
            "smtp_tally": self._smtp_tally,
        }
        # One for all the owner's sessions: one listener on the spool while claims wait.
        self._async_spool = async_spool if async_spool is not None else AsyncSpool(spool)
        # Answered on the loop: they wait for the disk only through the writer's futures.
        self._awaited: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]] = {
            "accept": self._accept,
            "claim": self._claim,
            "report": self._report,
            "settle": self._settle,
            "sync": self._sync,
            "read_data": self._read_data,
        }

    async def serve(self, op: str, args: dict[str, Any]) -> Any:
        """The result of ``op``; a ``SpoolError`` if it cannot be done (nothing changed).
        Runs on the owner's event loop, which it never blocks on the disk."""
        awaited = self._awaited.get(op)
        if awaited is not None:
            return await awaited(args)
        blocking = self._ops.get(op)
        if blocking is None:
            raise ProtocolError(f"unknown operation {op!r}")
        if op in ON_THE_LOOP:
            return blocking(args)
        return await self.in_thread(blocking, args)

    async def in_thread(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` in one of this connection's own threads (started as needed, up
        to ``THREADS_PER_CONNECTION``, and kept): one client's slow requests (a long
        listing, a large body) never wait for another's, as they would in a pool that
        every connection shares."""
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                THREADS_PER_CONNECTION, thread_name_prefix="control-request"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(call, *args))

    def let_threads_go(self) -> None:
        """End this connection's threads once their work is done (the connection ended)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    def in_flight(self) -> list[str]:
        """The messages this connection has claimed and not closed."""
        with self._lock:
            return sorted(self._attempts)

    def oldest_claim(self) -> float | None:
        """Seconds since the oldest attempt this connection holds was claimed (its lease)."""
        with self._lock:
            started = min(self._claimed_at.values(), default=None)
        return None if started is None else time.monotonic() - started

    def end_leases(self) -> None:
        """Close this connection's attempts as deferred, not as crashes: its worker is
        about to be killed for holding one past its lease (a hang, not a crash)."""
        self.close(crashed=False)

    def close(self, *, crashed: bool) -> None:
        """The connection ended: close its attempts (unreported recipients deferred). When
        the client went away with attempts open (``crashed``: a worker that died, a client
        that was killed) each counts as a crash for the crash-loop breaker; when the owner
        itself is stopping, not."""
        with self._lock:
            attempts, self._attempts = list(self._attempts.values()), {}
            self._claimed_at.clear()
        for attempt in attempts:
            if crashed:
                attempt.close_crashed()
            else:
                attempt.close()

    # --- operations -------------------------------------------------------------------

    def _hello(self, args: dict[str, Any]) -> dict[str, Any]:
        version = _arg(args, "version", int)
        if version != VERSION:  # (never printed: it may be any size)
            raise ProtocolError(f"this owner speaks protocol version {VERSION} only")
        return {"version": VERSION, **self._owner_info()}

    def _attempt(self, args: dict[str, Any]) -> Attempt:
        msg_id = _arg(args, "msg_id", str)
        with self._lock:
            attempt = self._attempts.get(msg_id)
        if attempt is None:
            raise UnknownMessage(msg_id, "this connection's attempts")
        return attempt

    async def _read_data(self, args: dict[str, Any]) -> bytes:
        """An inline body on the loop (one ``pread``); a body file in the connection's
        threads."""
        attempt = self._attempt(args)
        if attempt._flight.body.kind == rec.BODY_FILE:
            return await self.in_thread(attempt.read_data)
        return attempt.read_data()

    def _close_attempt(self, args: dict[str, Any]) -> None:
        attempt = self._attempt(args)
        attempt.close()
        with self._lock:
            self._attempts.pop(attempt.msg_id, None)
            self._claimed_at.pop(attempt.msg_id, None)
            self.peer.attempts_done += 1

    async def _accept(self, args: dict[str, Any]) -> str:
        sender = _arg(args, "sender", str)
        recipients = _texts(args, "recipients")
        data = _arg(args, "data", bytes)
        if len(data) > self.spool.options.inline_body_max:
            # A body in a file of its own: written and fsynced in this connection's
            # threads, then the envelope waits for its batch there too.
            return await self.in_thread(self.spool.accept, sender, recipients, data)
        return await self._async_spool.accept(sender, recipients, data)

    async def _claim(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Up to ``max`` attempts, waiting up to ``timeout`` for the first (on the loop: the
        spool wakes it when anything changes). With ``data``, their bodies too
        (``_with_data``)."""
        wait = _seconds(args, "timeout", CLAIM_WAIT_MAX)
        most = _arg(args, "max", int)
        if not 1 <= most <= CLAIM_BATCH_MAX:  # (never printed: it may be any size)
            raise SpoolMisuse(f"max must be 1 to {CLAIM_BATCH_MAX}")
        with_data = _arg(args, "data", bool) if "data" in args else False
        claimed: list[Attempt] = []
        first = await self._first_claim(CLAIM_WAIT_MAX if wait is None else wait)
        while first is not None:
            claimed.append(first)
            with self._lock:  # each at once: a later claim that fails must not orphan it
                self._attempts[first.msg_id] = first
                self._claimed_at[first.msg_id] = time.monotonic()
            found = await self._async_spool.claim(0) if len(claimed) < most else None
            first = None if found is None else found.attempt
        if not with_data:
            return [attrs.asdict(a.envelope) for a in claimed]
        if any(a._flight.body.kind == rec.BODY_FILE for a in claimed):
            return await self.in_thread(_with_data, claimed)  # files of their own
        return _with_data(claimed)

    async def _first_claim(self, wait: float) -> Attempt | None:
        """A claim waiting up to ``wait`` seconds, but none once the owner's stop begins:
        it looks every ``STOP_CHECK`` seconds, so that it does not hold the stop up for the
        rest of its wait (up to ``CLAIM_WAIT_MAX``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while not self._stopping.is_set():
            left = deadline - loop.time()
            found = await self._async_spool.claim(max(0.0, min(left, STOP_CHECK)))
            if found is not None or left <= STOP_CHECK:
                return None if found is None else found.attempt
        return None

    async def _report(self, args: dict[str, Any]) -> None:
        attempt = self._attempt(args)
        status, recipients, reply = _report_group(args)
        book = attempt._book
        end, logged = book.stage_report(attempt._flight, status, recipients, reply)
        if end is not None:
            await self._async_spool._durable(end)
        logged()

    async def _settle(self, args: dict[str, Any]) -> None:
        """Report each group of recipients, then close: ``report``s and ``close_attempt``
        in one round trip, the delivered and failed ones durable before the reply (one
        wait for all of them). A refused group is answered as an error once the groups
        before it are durable; the attempt then stays open."""
        attempt = self._attempt(args)
        groups = _arg(args, "reports", list)
        checked = []
        for group in groups:
            if type(group) is not list or len(group) != 3:
                raise ProtocolError("each report is [status, recipients, reply]")
            checked.append(_report_group(dict(zip(REPORT_FIELDS, group, strict=True))))
        book, flight = attempt._book, attempt._flight
        ends: list[Position] = []
        logs = []
        try:
            for status, recipients, reply in checked:
                end, logged = book.stage_report(flight, status, recipients, reply)
                logs.append(logged)
                if end is not None:
                    ends.append(end)
        finally:
            if ends:
                await self._async_spool._durable(max(ends))  # the commit point of them all
            for logged in logs:
                logged()
        self._close_attempt(args)

    async def _sync(self, args: dict[str, Any]) -> None:
        await self._async_spool.sync()

    def _list(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [attrs.asdict(entry, recurse=False) for entry in self.spool.list()]

    def _act(self, args: dict[str, Any]) -> dict[str, Any]:
        name = _arg(args, "action", str)
        try:
            action = OperatorAction(name)
        except ValueError:
            raise ProtocolError(f"unknown action {name!r}") from None
        msg_ids = None if args.get("msg_ids") is None else _texts(args, "msg_ids")
        reason = _arg(args, "reason", (str, type(None))) if "reason" in args else None
        # ``where_ids``: a selection made by the client from a listing, applied as the
        # in-process ``where`` test is (not named: nothing unknown or refused reported).
        where_ids = None if args.get("where_ids") is None else set(_texts(args, "where_ids"))
        where = None if where_ids is None else (lambda e: e.msg_id in where_ids)
        return attrs.asdict(self.spool.act(action, msg_ids, where=where, reason=reason))

    def _retry_now(self, args: dict[str, Any]) -> int:
        msg_id = _arg(args, "msg_id", (str, type(None)))
        return self.spool.retry_now(msg_id)

    def _statistics(self, args: dict[str, Any]) -> dict[str, Any]:
        return attrs.asdict(self.spool.statistics())

    def _checkpoint(self, args: dict[str, Any]) -> dict[str, Any]:
        before = self.spool.statistics().checkpoints
        positions = self.spool.checkpoint()
        return {
            "written": self.spool.statistics().checkpoints > before,
            "consistent": list(positions.consistent),
            "front": list(positions.front),
        }

    def _status(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._owner_info()

    def _smtp_tally(self, args: dict[str, Any]) -> None:
        """A front-end process's figures since it started (smtp_tally.py): kept as its
        last report, by its pid."""
        counts = _arg(args, "counts", dict)
        if not all(
            k in TALLY_KEYS and type(v) is int and 0 <= v < 2**63 for k, v in counts.items()
        ):
            raise ProtocolError(f"counts must map some of {', '.join(TALLY_KEYS)} to integers")
        self._tallies.record(self.peer.pid, counts)
