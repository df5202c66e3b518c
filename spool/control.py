"""What the owner does for each request on its control socket (docs/protocol.md, "Operations").

One ``Session`` per connection: it maps a request's operation to a call on the owner's
``Spool`` and keeps the attempts that connection claimed, so that a connection that drops
closes them (their unreported recipients deferred, as an attempt that is closed without
reports is). Every argument is checked for its type here, before the spool sees it; the
spool then checks values as it does for an embedder, so a bad request changes nothing.

Thread-safe: the owner serves the requests of one connection from several threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import attrs

from spool import records as rec
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
REPORT_STATUSES: Final = (rec.DELIVERED, rec.FAILED, rec.DEFERRED)
REPORT_FIELDS: Final = ("status", "recipients", "reply")  # a settle group's order


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
    ) -> None:
        self.spool = spool
        self.peer = peer
        self._owner_info = owner_info
        self._tallies = tallies if tallies is not None else SmtpTallies()
        self._stopping = stopping or threading.Event()  # set when the owner's stop begins
        self._lock = threading.Lock()
        self._attempts: dict[str, Attempt] = {}
        self._claimed_at: dict[str, float] = {}  # time.monotonic() of each claim
        self._ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "hello": self._hello,
            "accept": self._accept,
            "claim": self._claim,
            "read_data": self._read_data,
            "report": self._report,
            "close_attempt": self._close_attempt,
            "settle": self._settle,
            "list": self._list,
            "act": self._act,
            "retry_now": self._retry_now,
            "statistics": self._statistics,
            "sync": self._sync,
            "checkpoint": self._checkpoint,
            "status": self._status,
            "smtp_tally": self._smtp_tally,
        }

    def handle(self, op: str, args: dict[str, Any]) -> Any:
        """The result of ``op``; a ``SpoolError`` if it cannot be done (nothing changed)."""
        serve = self._ops.get(op)
        if serve is None:
            raise ProtocolError(f"unknown operation {op!r}")
        return serve(args)

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

    def _accept(self, args: dict[str, Any]) -> str:
        sender = _arg(args, "sender", str)
        recipients = _texts(args, "recipients")
        data = _arg(args, "data", bytes)
        return self.spool.accept(sender, recipients, data)

    def _claim(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        wait = _seconds(args, "timeout", CLAIM_WAIT_MAX)
        most = _arg(args, "max", int)
        if not 1 <= most <= CLAIM_BATCH_MAX:  # (never printed: it may be any size)
            raise SpoolMisuse(f"max must be 1 to {CLAIM_BATCH_MAX}")
        with_data = _arg(args, "data", bool) if "data" in args else False
        claimed: list[Attempt] = []
        first = self._first_claim(CLAIM_WAIT_MAX if wait is None else wait)
        while first is not None:
            claimed.append(first)
            first = self.spool.claim() if len(claimed) < most else None
        now = time.monotonic()
        with self._lock:
            for attempt in claimed:
                self._attempts[attempt.msg_id] = attempt
                self._claimed_at[attempt.msg_id] = now
        return _with_data(claimed) if with_data else [attrs.asdict(a.envelope) for a in claimed]

    def _first_claim(self, wait: float) -> Attempt | None:
        """``Spool.claim(wait)``, but none once the owner's stop begins: a claim waiting
        for work looks every ``STOP_CHECK`` seconds, so that it does not hold the stop
        up for the rest of its wait (up to ``CLAIM_WAIT_MAX``)."""
        deadline = time.monotonic() + wait
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            attempt = self.spool.claim(max(0.0, min(left, STOP_CHECK)))
            if attempt is not None or left <= STOP_CHECK:
                return attempt
        return None

    def _attempt(self, args: dict[str, Any]) -> Attempt:
        msg_id = _arg(args, "msg_id", str)
        with self._lock:
            attempt = self._attempts.get(msg_id)
        if attempt is None:
            raise UnknownMessage(msg_id, "this connection's attempts")
        return attempt

    def _read_data(self, args: dict[str, Any]) -> bytes:
        return self._attempt(args).read_data()

    def _report(self, args: dict[str, Any]) -> None:
        attempt = self._attempt(args)
        status, recipients, reply = _report_group(args)
        report = {
            rec.DELIVERED: attempt.delivered,
            rec.FAILED: attempt.failed,
            rec.DEFERRED: attempt.deferred,
        }[status]
        report(recipients, reply)

    def _settle(self, args: dict[str, Any]) -> None:
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
        book, flight = attempt._book, attempt._flight  # as AsyncSpool stages its reports
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
                book.state.writer.wait_durable(max(ends))  # the commit point of them all
            for logged in logs:
                logged()
        self._close_attempt(args)

    def _close_attempt(self, args: dict[str, Any]) -> None:
        attempt = self._attempt(args)
        attempt.close()
        with self._lock:
            self._attempts.pop(attempt.msg_id, None)
            self._claimed_at.pop(attempt.msg_id, None)
            self.peer.attempts_done += 1

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

    def _sync(self, args: dict[str, Any]) -> None:
        self.spool.sync()

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
