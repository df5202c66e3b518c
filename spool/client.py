"""The spool over its control socket: the in-process API, served by a running owner.

``spool.connect(DIR)`` returns a ``Client`` with the shape of ``Spool``: ``accept``,
``claim``/``attempts`` (each a ``RemoteAttempt`` with ``read_data``, ``delivered``,
``failed``, ``deferred``, ``close``), the operator actions and ``statistics``. The same
calling code runs in process (``Spool.open``) or against ``spool serve``. The commit
points are the owner's: ``accept``, ``delivered`` and ``failed`` return once durable.

A ``Client`` is thread-safe: requests from many threads share the one connection, each
waiting for its own reply (docs/protocol.md). If the owner goes away, every call raises
``OwnerUnreachable``; a call that was in flight then may or may not have been done (an
``accept`` whose answer was lost may have queued the message, as an SMTP client that lost
the connection after DATA cannot know either).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import copy
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from spool import format as fmt
from spool import records as rec
from spool.arguments import check_seconds
from spool.attempts import MessageEnvelope
from spool.errors import (
    OwnerUnreachable,
    ProtocolError,
    SpoolClosed,
    SpoolMisuse,
    UnknownMessage,
    remote_error,
)
from spool.fs import FileSystem
from spool.operator import BOUNCED_REPLY, DELETED_REPLY, HELD_REASON, ActionResult, OperatorAction
from spool.protocol import CLAIM_WAIT_MAX, VERSION, Decoder, ErrorReply, Reply, Request, encode
from spool.queue_view import QueueEntry, history
from spool.records import Position
from spool.statistics import SpoolStatistics

# sun_path holds 108 bytes on Linux; a longer spool path is reached through its directory's
# file descriptor (/proc/self/fd/N/control.sock), which bind and connect both accept.
_SUN_PATH_MAX: Final = 107


def socket_path(directory: str) -> str:
    """Where a spool's owner serves (it may not be running)."""
    return os.path.join(directory, fmt.SOCKET_NAME)


class UnixAddress:
    """A socket path usable with bind/connect whatever the directory's length."""

    def __init__(self, directory: str, name: str = fmt.SOCKET_NAME) -> None:
        full = os.path.join(directory, name)
        self._fd: int | None = None
        if len(os.fsencode(full)) <= _SUN_PATH_MAX:
            self.address = full
        else:
            self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            self.address = f"/proc/self/fd/{self._fd}/{name}"

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> str:
        return self.address

    def __exit__(self, *exc: object) -> None:
        self.close()


def owner_running(directory: str) -> bool:
    """Whether an owner answers on ``directory``'s control socket right now."""
    try:
        connect(directory).close()
    except OwnerUnreachable:
        return False
    return True


def recorded_history(path: str, msg_id: str) -> builtins.list[tuple[Position, rec.Record]]:
    """A message's records read from the spool's files (``show`` over the socket, once the
    owner synced: the same user may read them); ``UnknownMessage`` if there are none."""
    found = history(FileSystem(), path, msg_id)
    if not found:
        raise UnknownMessage(msg_id)
    return found


def connect(directory: str | os.PathLike[str], timeout: float = 5.0) -> Client:
    """Connect to the owner serving ``directory`` (``spool serve``).

    ``OwnerUnreachable`` when none runs; ``PeerRefused`` when the owner refuses this user.
    """
    path = os.fspath(directory)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with UnixAddress(path) as address:
            sock.connect(address)
        sock.settimeout(None)
    except OSError as e:
        sock.close()
        if isinstance(e, FileNotFoundError):
            why = "it has no control socket (start one with `spool serve`)"
        elif isinstance(e, ConnectionRefusedError):
            why = "its control socket is stale (the owner that made it is gone)"
        else:
            why = str(e.strerror or e)
        raise OwnerUnreachable(f"no owner serves {path}: {why}") from None
    client = Client(path, sock)
    try:
        try:
            client.owner = client._request("hello", version=VERSION).result(timeout)
        except concurrent.futures.TimeoutError:
            raise OwnerUnreachable(
                f"the owner of {path} does not answer (stopped or overloaded; its pid is in "
                f"{os.path.join(path, fmt.LOCK_NAME)})"
            ) from None
    except BaseException:
        client.close()
        raise
    return client


class Client:
    """A connection to a spool's owner. Create with ``spool.connect(DIR)``."""

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path = path
        self.owner: dict[str, Any] = {}
        self._sock = sock
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._pending_lock = threading.Lock()
        # Why the connection ended, raised by every later call (None while it is up).
        self._gone: Exception | None = None
        self._reader = threading.Thread(target=self._read_replies, daemon=True)
        self._reader.start()

    # --- the connection ---------------------------------------------------------------

    def _call(self, op: str, **args: Any) -> Any:
        """Send a request and wait for its result (raising its error)."""
        return self._request(op, **args).result()

    def _request(self, op: str, **args: Any) -> concurrent.futures.Future[Any]:
        """Send a request; the future completes when its reply comes (``async_client.py``
        awaits it without a thread)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._pending_lock:
            if self._gone is not None:
                raise copy.copy(self._gone)
            request_id = next(self._ids)
            self._pending[request_id] = future
        frame = encode(Request(request_id, op, args))
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as e:
            # The owner may have said why before it closed (a refused user): let the
            # reader take that error frame first, then fail whatever is left.
            self._reader.join(timeout=1.0)
            self._lose(f"the connection to the owner of {self.path} broke: {e}")
        return future

    def _read_replies(self) -> None:
        # The owner is trusted: its replies (a large body, a long listing) may be as large
        # as a frame can say.
        decoder = Decoder(max_frame=2**32 - 1)
        why = f"the owner of {self.path} closed the connection"
        try:
            while True:
                data = self._sock.recv(1 << 20)
                if not data:
                    break
                for message in decoder.feed(data):
                    if isinstance(message, Request):
                        raise ProtocolError("the owner sent a request")
                    if message.id == 0:
                        assert isinstance(message, ErrorReply)
                        why = f"the owner closed the connection: {message.message}"
                        self._lose(why, remote_error(message.error, message.message))
                        return
                    with self._pending_lock:
                        future = self._pending.pop(message.id, None)
                    if future is None:
                        raise ProtocolError(f"a reply to no request (id {message.id})")
                    if isinstance(message, Reply):
                        future.set_result(message.result)
                    else:
                        future.set_exception(remote_error(message.error, message.message))
        except (OSError, ProtocolError) as e:
            why = f"the connection to the owner of {self.path} broke: {e}"
        self._lose(why)

    def _lose(self, why: str, error: Exception | None = None) -> None:
        """Fail every request waiting for a reply, and every later one."""
        with self._pending_lock:
            if self._gone is None:
                self._gone = error or OwnerUnreachable(why)
            pending, self._pending = list(self._pending.values()), {}
            gone = self._gone
        for future in pending:
            if not future.done():
                future.set_exception(copy.copy(gone))

    @property
    def closed(self) -> bool:
        return self._gone is not None

    def close(self) -> None:
        """Close the connection. Attempts still open are closed by the owner (their
        unreported recipients deferred)."""
        self._lose(f"the connection to {self.path} was closed")
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the spool's API --------------------------------------------------------------

    def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str:
        """As ``Spool.accept``: the id, once the message is durable."""
        result: str = self._call(
            "accept", sender=sender, recipients=_texts(recipients), data=bytes(data)
        )
        return result

    def claim(self, timeout: float | None = None) -> RemoteAttempt | None:
        """As ``Spool.claim``."""
        found = self.claim_many(1, timeout)
        return found[0] if found else None

    def claim_many(
        self, most: int, timeout: float | None = None, *, with_data: bool = False
    ) -> builtins.list[RemoteAttempt]:
        """Up to ``most`` due attempts in one round trip (waiting ``timeout`` for the first).
        The owner waits at most ``CLAIM_WAIT_MAX`` per request; a longer wait is several.
        ``with_data``: the bodies come with the attempts (up to 1 MiB in all), so that
        ``read_data`` needs no round trip of its own."""
        wait = check_seconds(timeout, "timeout")
        deadline = time.monotonic() + wait
        while True:
            step = min(wait, CLAIM_WAIT_MAX)
            found = self._call("claim", timeout=step, max=most, data=with_data)
            wait = deadline - time.monotonic()
            if found or wait <= 0:
                return [
                    RemoteAttempt(self, MessageEnvelope(**_envelope(e)), e.get("data"))
                    for e in found
                ]

    def attempts(self, poll: float = 1.0) -> Iterator[RemoteAttempt]:
        """Attempts for ever, until the connection ends (for worker loops)."""
        check_seconds(poll, "poll")

        def generate() -> Iterator[RemoteAttempt]:
            while True:
                try:
                    attempt = self.claim(poll)
                except OwnerUnreachable:
                    return
                if attempt is not None:
                    yield attempt

        return generate()

    def list(self) -> Iterator[QueueEntry]:
        """As ``Spool.list``: the live messages."""
        return iter([_entry(e) for e in self._call("list")])

    def show(self, msg_id: str) -> builtins.list[tuple[Position, rec.Record]]:
        """As ``Spool.show``: read from the files (the same user's) once the owner synced."""
        self._call("sync")
        return recorded_history(self.path, msg_id)

    def hold(self, msg_id: str, reason: str = HELD_REASON) -> None:
        self._one(OperatorAction.HOLD, msg_id, reason)

    def release(self, msg_id: str) -> None:
        self._one(OperatorAction.RELEASE, msg_id, None)

    def delete(self, msg_id: str, reason: str = DELETED_REPLY) -> None:
        self._one(OperatorAction.DELETE, msg_id, reason)

    def bounce(self, msg_id: str, reason: str = BOUNCED_REPLY) -> None:
        self._one(OperatorAction.BOUNCE, msg_id, reason)

    def retry_now(self, msg_id: str | None = None) -> int:
        """As ``Spool.retry_now``: how many messages became due."""
        changed: int = self._call("retry_now", msg_id=msg_id)
        return changed

    def act(
        self,
        action: OperatorAction,
        msg_ids: Iterable[str] | None = None,
        *,
        where: Callable[[QueueEntry], bool] | None = None,
        reason: str | None = None,
    ) -> ActionResult:
        """As ``Spool.act``. A ``where`` test runs here on the owner's listing; the owner
        then applies the selection as its own ``where`` (so, as in process, a selected
        message that finished meanwhile is skipped, not reported unknown)."""
        ids = None if msg_ids is None else _texts(msg_ids)
        selected = None if where is None else [e.msg_id for e in self.list() if where(e)]
        r = self._call(
            "act",
            action=OperatorAction(action).value,
            msg_ids=ids,
            where_ids=selected,
            reason=reason,
        )
        return action_result(r)

    def statistics(self) -> SpoolStatistics:
        return SpoolStatistics(**self._call("statistics"))

    def status(self) -> dict[str, Any]:
        """The owner: pid, start time, its workers and their attempts, its options."""
        result: dict[str, Any] = self._call("status")
        return result

    def sync(self) -> None:
        self._call("sync")

    def checkpoint(self) -> dict[str, Any]:
        """Write restart positions now: ``written`` (False: nothing new), ``consistent``
        and ``front`` as [segment, offset]."""
        result: dict[str, Any] = self._call("checkpoint")
        return result

    def _one(self, action: OperatorAction, msg_id: str, reason: str | None) -> None:
        """One message, raising as ``Spool.hold`` and its kin do."""
        raise_for_one(self.act(action, [msg_id], reason=reason), msg_id)


class RemoteAttempt:
    """An attempt the owner keeps for this connection; the shape of ``spool.Attempt``."""

    def __init__(
        self, client: Client, envelope: MessageEnvelope, data: bytes | None = None
    ) -> None:
        self._client = client
        self.envelope = envelope
        self._data = data  # the body, when it came with the claim
        self._closed = False

    @property
    def msg_id(self) -> str:
        return self.envelope.msg_id

    def read_data(self) -> bytes:
        check_attempt_open(self._closed, self.msg_id)
        if self._data is not None:
            return self._data
        data: bytes = self._client._call("read_data", msg_id=self.msg_id)
        return data

    def delivered(self, recipients: Iterable[str], reply: str) -> None:
        """Durable on return, as in process."""
        self._report("delivered", recipients, reply)

    def failed(self, recipients: Iterable[str], reply: str) -> None:
        """Durable on return, as in process."""
        self._report("failed", recipients, reply)

    def deferred(self, recipients: Iterable[str], reply: str) -> None:
        self._report("deferred", recipients, reply)

    def _report(self, status: str, recipients: Iterable[str], reply: str) -> None:
        check_attempt_open(self._closed, self.msg_id)
        self._client._call(
            "report", msg_id=self.msg_id, status=status, recipients=_texts(recipients), reply=reply
        )

    def settle(self, reports: Iterable[tuple[str, Iterable[str], str]]) -> None:
        """Each ``(status, recipients, reply)`` reported, then the attempt closed, in one
        round trip (socket only: in process each call is its own). The delivered and
        failed ones are durable on return. On a refused report the attempt stays open."""
        check_attempt_open(self._closed, self.msg_id)
        groups = [[status, _texts(recipients), reply] for status, recipients, reply in reports]
        self._client._call("settle", msg_id=self.msg_id, reports=groups)
        self._closed = True

    def close(self) -> None:
        """End the attempt (idempotent; a lost connection ends it too, at the owner)."""
        if self._closed:
            return
        self._closed = True
        if not self._client.closed:
            self._client._call("close_attempt", msg_id=self.msg_id)

    def __enter__(self) -> RemoteAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_attempt_open(closed: bool, msg_id: str) -> None:
    """``SpoolClosed`` for a call on an attempt this side closed (or settled): the owner
    knows attempts by message id, so a stale handle must not speak for a later attempt
    of the same message."""
    if closed:
        raise SpoolClosed(f"the attempt of {msg_id} was closed")


def action_result(answer: dict[str, Any]) -> ActionResult:
    """An ``act`` answer as the ``ActionResult`` ``Spool.act`` returns."""
    return ActionResult(
        tuple(answer["changed"]),
        tuple(answer["unchanged"]),
        tuple(answer["unknown"]),
        dict(answer["refused"]),
    )


def raise_for_one(result: ActionResult, msg_id: str) -> None:
    """Raise as ``Spool.hold`` and its kin do for the one message an action named."""
    if result.unknown:
        raise UnknownMessage(msg_id)
    if result.refused:
        raise SpoolMisuse(result.refused[msg_id])


def _texts(values: Iterable[str]) -> builtins.list[str]:
    if isinstance(values, str | bytes):
        raise SpoolMisuse("give a list of addresses, not one string")
    return builtins.list(values)


def _envelope(fields: dict[str, Any]) -> dict[str, Any]:
    """A claimed attempt's ``MessageEnvelope`` fields (without the body it may carry)."""
    return {
        **{k: v for k, v in fields.items() if k != "data"},
        "recipients": tuple(fields["recipients"]),
    }


def _entry(fields: dict[str, Any]) -> QueueEntry:
    return QueueEntry(
        **{
            **fields,
            "recipients": tuple(fields["recipients"]),
            "replies": tuple(fields.get("replies", ())),
            "envelope_at": Position(*fields["envelope_at"]),
        }
    )
