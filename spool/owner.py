"""The owner process behind ``spool serve``: the spool, its control socket, its workers.

The owner opens the spool (recovery), serves the control socket (``control.py`` answers
each request, ``protocol.py`` frames them) and supervises the delivery workers
(``supervisor.py``). One asyncio loop, in a thread of its own, accepts the connections and
reads their requests; each connection has up to ``REQUESTS_IN_FLIGHT`` requests in hand
(the loop reads no more of it beyond that), so a slow or stuck client holds up only
itself: the owner never blocks on a worker. Requests that wait for the disk await the log
writer's durable futures, so no thread waits per request, and a batch's fsync wakes the
loop once (``control.py`` says which requests run in worker threads).

Security: the socket is made 0600 before it takes its name (bound under a temporary name,
then renamed), and every connection's peer uid (``SO_PEERCRED``) must be the owner's or
root's, else it gets one error frame and is closed.

Crash safety: the owner writes nothing but through the spool, plus the socket file, which
is not state: a stale socket left by a killed owner is removed by the next one (it holds
the spool's lock, so no other owner can be serving it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
import threading
import traceback
from collections.abc import Callable
from typing import Any, Final

import attrs

from spool import format as fmt
from spool.async_spool import AsyncSpool
from spool.client import UnixAddress, socket_path
from spool.control import Peer, Session
from spool.errors import PeerRefused, ProtocolError, SpoolError
from spool.protocol import DEFAULT_MAX_FRAME, Decoder, ErrorReply, Reply, Request, encode
from spool.smtp_tally import SmtpTallies
from spool.spool import Spool

REQUESTS_IN_FLIGHT: Final = 32  # per connection; the reader waits beyond this
STOP_JOIN: Final = 10.0  # seconds a stop waits for the requests in hand, all connections
# Requests whose reply may be as large as a message (a body, the queue's list), answered at
# once per connection: a client that sends many and reads none holds at most this many
# such replies in the owner's memory (the reader waits beyond it), not REQUESTS_IN_FLIGHT.
LARGE_REPLY_OPS: Final = frozenset({"read_data", "list"})
LARGE_REPLIES_IN_FLIGHT: Final = 2
# A frame holds one message and its envelope: the owner's limit is the message size limit
# plus room for the envelope (1,000 recipients of 256 bytes) and the framing.
ENVELOPE_ROOM: Final = 1024 * 1024

log = logging.getLogger("spool.owner")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (``pip install mailspool[serve]``), else
    asyncio's. uvloop (libuv) reads, writes and wakes the loop in C; the loop, the sockets
    and the futures are most of the owner's cost per request, and uvloop's saves about a
    sixth of it (docs/performance.md, "An event loop in C"). Both behave alike for
    everything the owner does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def peer_of(conn: socket.socket) -> Peer:
    """The pid and uid of the process on the other end of a Unix socket."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return Peer(pid=pid, uid=uid)


def peer_allowed(peer_uid: int, owner_uid: int) -> bool:
    """Only the spool's user (and root) may talk to its owner."""
    return peer_uid in (owner_uid, 0)


@attrs.define
class Connection:
    sock: Any  # the connection's socket (asyncio's ``TransportSocket``)
    session: Session
    task: asyncio.Task[None] | None = None


class ControlServer:
    """Serves the control socket of an open spool until ``stop``, from one asyncio loop
    in a thread of its own (``start``)."""

    def __init__(
        self,
        spool: Spool,
        owner_info: Callable[[], dict[str, Any]],
        *,
        allowed_uid: int | None = None,
        tallies: SmtpTallies | None = None,
    ) -> None:
        self.spool = spool
        self._owner_info = owner_info
        self.tallies = tallies if tallies is not None else SmtpTallies()  # SMTP figures
        self._allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self._max_frame = max(DEFAULT_MAX_FRAME, spool.options.max_message_size + ENVELOPE_ROOM)
        self._connections: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.path = socket_path(spool.path)
        self._listener = self._bind()
        self._async_spool = AsyncSpool(spool)  # the sessions' awaitable calls
        self._loop = new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    def _bind(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        temporary = fmt.SOCKET_NAME + f".{os.getpid()}.tmp"
        with UnixAddress(self.spool.path, temporary) as address:
            # Leftovers of a killed owner: we hold the lock, so nobody serves them.
            for stale in (address, self.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            listener.bind(address)
            os.chmod(address, 0o600)  # before it takes the name clients look for
            os.replace(address, self.path)
        listener.listen(128)
        return listener

    def start(self) -> None:
        """Serve from now on (returns once the loop listens)."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_unix_server(self._serve, sock=self._listener, limit=1 << 20)
            )
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def sessions(self) -> list[Session]:
        with self._lock:
            return [c.session for c in self._connections.values()]

    def stopping(self) -> None:
        """From now on connections that end are the owner's doing: their attempts are
        closed without counting crashes (called before the workers are stopped)."""
        self._stopping.set()

    def stop(self) -> None:
        """Stop accepting, drop every connection (their attempts closed), remove the socket."""
        self._stopping.set()
        if self._thread.ident is None or self._server is None:  # never served
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        ended = asyncio.run_coroutine_threadsafe(self._shut_down(), self._loop)
        with contextlib.suppress(Exception):
            ended.result(timeout=STOP_JOIN + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _shut_down(self) -> None:
        """On the loop: close the listener, remove the socket, end every connection and
        wait (``STOP_JOIN`` in all) for the requests in hand to be answered."""
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            connections = list(self._connections.values())
        for c in connections:
            _shut(c.sock)
        tasks = [c.task for c in connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_JOIN)

    def drop(self, pid: int) -> None:
        """Drop the connections of process ``pid`` (a worker killed for its lease)."""
        with self._lock:
            connections = [c for c in self._connections.values() if c.session.peer.pid == pid]
        for c in connections:  # on the loop, where connections are closed (``_shut``)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to shut
                self._loop.call_soon_threadsafe(_shut, c.sock)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            if sock is None:  # uvloop's, for a connection closed before this ran
                raise OSError("the connection closed")
            peer = peer_of(sock)
        except OSError as e:  # the peer already gone: nothing to serve
            log.warning("a connection ended before it could be identified: %s", e)
            writer.close()
            return
        if not peer_allowed(peer.uid, self._allowed_uid):
            log.warning("refused a connection from uid %d (pid %d)", peer.uid, peer.pid)
            error = PeerRefused(
                f"uid {peer.uid} may not use this spool: only its owner's user "
                f"(uid {self._allowed_uid}) and root may"
            )
            await _send(writer, ErrorReply(0, type(error).__name__, str(error)))
            writer.close()
            return
        session = Session(
            self.spool, peer, self._owner_info, self._stopping, self.tallies, self._async_spool
        )
        connection = Connection(sock, session, asyncio.current_task())
        with self._lock:
            self._connections[id(connection)] = connection
        try:
            await self._read_requests(reader, writer, session)
        finally:
            with self._lock:
                self._connections.pop(id(connection), None)
            # Closing its attempts may wait for a batch (a close that applies an
            # operator's mark): not on the loop.
            try:
                crashed = not self._stopping.is_set()
                await session.in_thread(functools.partial(session.close, crashed=crashed))
            finally:
                session.let_threads_go()
                writer.close()

    async def _read_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: Session
    ) -> None:
        decoder = Decoder(self._max_frame)
        slots = asyncio.Semaphore(REQUESTS_IN_FLIGHT)
        large = asyncio.Semaphore(LARGE_REPLIES_IN_FLIGHT)
        answering: set[asyncio.Task[None]] = set()
        claiming: set[asyncio.Task[None]] = set()  # the claims among them
        try:
            # Read until the connection ends (``stop`` shuts it), not until the stop
            # begins: a worker settles the message in hand during its grace, and a report
            # left unread would defer a recipient its agent had delivered.
            while True:
                try:
                    data = await reader.read(1 << 20)
                except OSError:
                    return
                if not data:
                    return
                try:
                    messages = decoder.feed(data)
                    if not all(isinstance(m, Request) for m in messages):
                        raise ProtocolError("a client sends requests only")
                except ProtocolError as e:
                    log.warning("pid %d: %s; connection closed", session.peer.pid, e)
                    await _send(writer, ErrorReply(0, "ProtocolError", str(e)))
                    return
                for message in messages:
                    assert isinstance(message, Request)
                    held = [slots] + ([large] if message.op in LARGE_REPLY_OPS else [])
                    for semaphore in held:
                        await semaphore.acquire()
                    task = asyncio.create_task(self._answer(writer, held, session, message))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
                    if message.op == "claim":
                        claiming.add(task)
                        task.add_done_callback(claiming.discard)
        finally:
            # A claim still waiting for work is called off: nobody will take what it
            # finds (its attempts would close as the crash of a client already gone).
            # Cancelled only where it waits, it holds no attempt it has not recorded.
            for task in claiming:
                task.cancel()
            # The other requests taken are answered (or their attempts recorded) before
            # the session closes its attempts, so no claim outlives its connection.
            if answering:
                await asyncio.wait(list(answering))

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        held: list[asyncio.Semaphore],
        session: Session,
        request: Request,
    ) -> None:
        """Answer one request, then give back the places it ``held`` (once its reply is
        sent: a reply the client does not read keeps its place)."""
        try:
            try:
                answer: Reply | ErrorReply = Reply(
                    request.id, await session.serve(request.op, request.args)
                )
            except SpoolError as e:
                answer = ErrorReply(request.id, type(e).__name__, str(e))
            except Exception as e:  # a bug: answer it, log it, keep the owner up
                log.error("request %s failed:\n%s", request.op, traceback.format_exc())
                answer = ErrorReply(request.id, "SpoolError", f"internal error: {e!r}")
            await _send(writer, answer)
        finally:
            for semaphore in held:
                semaphore.release()


async def _send(writer: asyncio.StreamWriter, message: Reply | ErrorReply) -> None:
    """Write one reply (whole: the loop writes one frame at a time) and wait while the
    client is slow to read it."""
    try:
        frame = encode(message)
    except Exception as e:  # a result the codec cannot carry: a bug, answered as one
        frame = encode(ErrorReply(message.id, "SpoolError", f"internal error: {e!r}"))
    if writer.is_closing():
        return  # the peer went away; its reader sees the end and closes the session
    try:
        writer.write(frame)
        await writer.drain()
    except (OSError, RuntimeError):
        pass  # as above


def _shut(sock: Any) -> None:
    """Shut a connection both ways (its reader then sees the end), through a duplicate of
    its descriptor: uvloop's transport sockets refuse ``shutdown``, asyncio's allow it.

    On the loop's thread only: the loop closes connections, so there a connection's
    descriptor cannot be closed, and its number given to the next connection accepted,
    between reading it and duplicating it (from another thread, a lease kill's ``drop``
    shut other clients' connections now and then). A closed one reads -1."""
    try:
        duplicate = os.dup(sock.fileno())
    except OSError:
        return  # closed already
    try:
        connection = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return
    with connection, contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
