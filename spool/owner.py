"""The owner process behind ``spool serve``: the spool, its control socket, its workers.

The owner opens the spool (recovery), serves the control socket (``control.py`` answers
each request, ``protocol.py`` frames them) and supervises the delivery workers
(``supervisor.py``). One thread accepts connections; each connection has a reader thread
and up to ``REQUESTS_IN_FLIGHT`` requests served at once by its own pool of threads, so a
slow or stuck client holds up only itself: the owner never blocks on a worker.

Security: the socket is made 0600 before it takes its name (bound under a temporary name,
then renamed), and every connection's peer uid (``SO_PEERCRED``) must be the owner's or
root's, else it gets one error frame and is closed.

Crash safety: the owner writes nothing but through the spool, plus the socket file, which
is not state: a stale socket left by a killed owner is removed by the next one (it holds
the spool's lock, so no other owner can be serving it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Final

import attrs

from spool import format as fmt
from spool.client import UnixAddress, socket_path
from spool.control import Peer, Session
from spool.errors import PeerRefused, ProtocolError, SpoolError
from spool.protocol import DEFAULT_MAX_FRAME, Decoder, ErrorReply, Reply, Request, encode
from spool.smtp_tally import SmtpTallies
from spool.spool import Spool

ACCEPT_RETRY: Final = 0.1  # seconds before accepting again after a failure (EMFILE)
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
    sock: socket.socket
    session: Session
    thread: threading.Thread | None = None


class ControlServer:
    """Serves the control socket of an open spool until ``stop``."""

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
        self._acceptor = threading.Thread(target=self._accept_loop, name="control-accept")

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
        self._acceptor.start()

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
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._acceptor.ident is not None:  # started (a start that failed before it: not)
            self._acceptor.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            connections = list(self._connections.values())
        for c in connections:
            _shut(c.sock)
        deadline = time.monotonic() + STOP_JOIN  # for all of them, not each in turn
        for c in connections:
            if c.thread is not None:
                c.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def drop(self, pid: int) -> None:
        """Drop the connections of process ``pid`` (a worker killed for its lease)."""
        with self._lock:
            connections = [c for c in self._connections.values() if c.session.peer.pid == pid]
        for c in connections:
            _shut(c.sock)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._stopping.is_set():
                    return
                # Out of descriptors (EMFILE) or the like: say so, wait, go on serving.
                log.error("accepting a connection failed: %s; retrying", e)
                self._stopping.wait(ACCEPT_RETRY)
                continue
            try:
                threading.Thread(target=self._serve, args=(sock,), daemon=True).start()
            except RuntimeError as e:  # no thread to be had: refuse this one, keep going
                log.error("cannot serve a connection: %s", e)
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            peer = peer_of(sock)
        except OSError as e:  # the peer already gone: nothing to serve
            log.warning("a connection ended before it could be identified: %s", e)
            sock.close()
            return
        if not peer_allowed(peer.uid, self._allowed_uid):
            log.warning("refused a connection from uid %d (pid %d)", peer.uid, peer.pid)
            error = PeerRefused(
                f"uid {peer.uid} may not use this spool: only its owner's user "
                f"(uid {self._allowed_uid}) and root may"
            )
            _send(sock, threading.Lock(), ErrorReply(0, type(error).__name__, str(error)))
            sock.close()
            return
        session = Session(self.spool, peer, self._owner_info, self._stopping, self.tallies)
        connection = Connection(sock, session, threading.current_thread())
        with self._lock:
            self._connections[id(connection)] = connection
        try:
            self._read_requests(sock, session)
        finally:
            with self._lock:
                self._connections.pop(id(connection), None)
            session.close(crashed=not self._stopping.is_set())
            sock.close()

    def _read_requests(self, sock: socket.socket, session: Session) -> None:
        decoder = Decoder(self._max_frame)
        send_lock = threading.Lock()
        slots = threading.BoundedSemaphore(REQUESTS_IN_FLIGHT)
        large = threading.BoundedSemaphore(LARGE_REPLIES_IN_FLIGHT)
        # The connection's request threads, started as needed and kept for its next
        # requests (a thread per request cost the owner more than the request itself).
        pool = RequestThreads(REQUESTS_IN_FLIGHT)
        try:
            # Read until the connection ends (``stop`` shuts it), not until the stop
            # begins: a worker settles the message in hand during its grace, and a report
            # left unread would defer a recipient its agent had delivered.
            while True:
                try:
                    data = sock.recv(1 << 20)
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
                    _send(sock, send_lock, ErrorReply(0, "ProtocolError", str(e)))
                    return
                for message in messages:
                    assert isinstance(message, Request)
                    held = [slots] + ([large] if message.op in LARGE_REPLY_OPS else [])
                    for semaphore in held:
                        semaphore.acquire()
                    pool.run(functools.partial(
                        self._answer, sock, send_lock, held, session, message
                    ))  # fmt: skip
        finally:
            # Requests already taken are answered (or their attempts recorded) before the
            # session closes its attempts, so no claim outlives its connection.
            pool.finish()

    def _answer(
        self,
        sock: socket.socket,
        send_lock: threading.Lock,
        held: list[threading.BoundedSemaphore],
        session: Session,
        request: Request,
    ) -> None:
        """Answer one request, then give back the places it ``held`` (once its reply is
        sent: a reply the client does not read keeps its place)."""
        try:
            try:
                answer: Reply | ErrorReply = Reply(
                    request.id, session.handle(request.op, request.args)
                )
            except SpoolError as e:
                answer = ErrorReply(request.id, type(e).__name__, str(e))
            except Exception as e:  # a bug: answer it, log it, keep the owner up
                log.error("request %s failed:\n%s", request.op, traceback.format_exc())
                answer = ErrorReply(request.id, "SpoolError", f"internal error: {e!r}")
            _send(sock, send_lock, answer)
        finally:
            for semaphore in held:
                semaphore.release()


class RequestThreads:
    """One connection's request threads: started as requests need them, up to ``most``,
    and kept for the next ones. Daemon threads, as a stuck request must never hold up the
    owner's exit (a pool of the standard library's joins its threads at exit)."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, task: Callable[[], None]) -> None:
        """Run ``task`` on an idle thread, or a new one (the caller bounds how many run)."""
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._most:
                thread = threading.Thread(target=self._serve, name="control-request", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._tasks.put(task)

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            task()
            with self._lock:
                self._idle += 1

    def finish(self) -> None:
        """Wait for the tasks given, then end the threads."""
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()


def _send(sock: socket.socket, lock: threading.Lock, message: Reply | ErrorReply) -> None:
    try:
        frame = encode(message)
    except Exception as e:  # a result the codec cannot carry: a bug, answered as one
        frame = encode(ErrorReply(message.id, "SpoolError", f"internal error: {e!r}"))
    try:
        with lock:
            sock.sendall(frame)
    except OSError:
        pass  # the peer went away; its reader sees the end and closes the session


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
