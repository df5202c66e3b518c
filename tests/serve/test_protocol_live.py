"""Bad frames and foreign users against a live owner: an error or a close, never a changed
spool and never a dead owner."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spool import Spool
from spool.client import connect, socket_path
from spool.errors import PeerRefused, ProtocolError
from spool.owner import ControlServer, peer_allowed, peer_of
from spool.protocol import HEADER, Decoder, ErrorReply, Reply, Request, encode
from tests.serve.running import owner

SAFE_REQUESTS = [
    Request(1, "hello", {"version": 1}),
    Request(2, "statistics", {}),
    Request(3, "list", {}),
    Request(4, "status", {}),
    Request(5, "read_data", {"msg_id": "6B06814FD9D372D3"}),
    Request(6, "report", {"msg_id": "X", "status": "delivered", "recipients": [], "reply": "2"}),
    Request(7, "close_attempt", {"msg_id": "X"}),
    Request(8, "act", {"action": "hold", "msg_ids": ["6B06814FD9D372D3"], "reason": None}),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = str(tmp_path_factory.mktemp("live") / "spool")
    Spool.open(d).close()
    with owner(d), connect(d) as client:
        client.accept("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nkept\r\n")
        yield d


def exchange(d: str, data: bytes) -> list[object]:
    """Send ``data`` and read what comes back until the owner closes or goes quiet."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2.0)
        s.connect(socket_path(d))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the owner closed first: fine
        decoder, got = Decoder(), []
        try:
            while chunk := s.recv(65536):
                got += decoder.feed(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def unchanged(d: str) -> None:
    with connect(d) as client:
        assert [e.recipients for e in client.list()] == [("b@example.net",)]
        stats = client.statistics()
        assert (stats.accepted, stats.delivered, stats.in_flight) == (1, 0, 0)


def test_a_bad_frame_gets_an_error_of_id_0_and_a_close(live: str) -> None:
    got = exchange(live, HEADER.pack(5, 9) + b"xxxxx")
    assert len(got) == 1 and isinstance(got[0], ErrorReply) and got[0].id == 0
    assert got[0].error == "ProtocolError"
    unchanged(live)


def test_a_frame_over_the_limit_is_refused_on_its_header(live: str) -> None:
    got = exchange(live, HEADER.pack(2**32 - 1, 1))
    assert isinstance(got[0], ErrorReply) and "over the limit" in got[0].message
    unchanged(live)


def test_replies_from_a_client_and_unknown_operations_are_refused(live: str) -> None:
    got = exchange(live, encode(Reply(1, None)))
    assert isinstance(got[0], ErrorReply) and got[0].id == 0
    got = exchange(live, encode(Request(9, "format_disk", {})) + encode(SAFE_REQUESTS[1]))
    by_id = {m.id: m for m in got}  # type: ignore[attr-defined]
    assert isinstance(by_id[9], ErrorReply) and "unknown operation" in by_id[9].message
    assert isinstance(by_id[2], Reply)  # the connection goes on after a request's error


@pytest.mark.parametrize(
    "args",
    [
        {"sender": "a@example.org", "recipients": "b@example.net", "data": b"x"},
        {"sender": "a@example.org", "recipients": [1], "data": b"x"},
        {"sender": b"a@example.org", "recipients": ["b@example.net"], "data": b"x"},
        {"sender": "a@example.org", "recipients": ["b@example.net"], "data": "text"},
        {"sender": "a@example.org", "recipients": ["b@example.net"]},
    ],
)
def test_mistyped_arguments_change_nothing(live: str, args: dict[str, object]) -> None:
    got = exchange(live, encode(Request(3, "accept", args)))
    assert len(got) == 1 and isinstance(got[0], ErrorReply) and got[0].id == 3
    assert got[0].error == "ProtocolError"
    unchanged(live)


def test_claim_arguments_are_checked(live: str) -> None:
    for args in ({"timeout": 0, "max": 0}, {"timeout": -1, "max": 1}, {"timeout": 0}):
        got = exchange(live, encode(Request(3, "claim", args)))
        assert isinstance(got[0], ErrorReply), args
    unchanged(live)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.one_of(st.binary(max_size=200), st.sampled_from(SAFE_REQUESTS)), st.data())
def test_random_and_mutated_frames_never_change_the_spool_or_kill_the_owner(
    live: str, seed: object, data: st.DataObject
) -> None:
    raw = bytearray(seed if isinstance(seed, bytes) else encode(seed))  # type: ignore[arg-type]
    if raw and not isinstance(seed, bytes):
        for _ in range(data.draw(st.integers(0, 3))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    for message in exchange(live, bytes(raw)):
        assert isinstance(message, Reply | ErrorReply)
    unchanged(live)


def test_many_requests_in_flight_on_one_connection(live: str) -> None:
    frames = b"".join(encode(Request(i, "statistics", {})) for i in range(1, 201))
    got = exchange(live, frames)
    assert sorted(m.id for m in got) == list(range(1, 201))  # type: ignore[attr-defined]


def test_only_the_spools_user_and_root_are_allowed() -> None:
    assert peer_allowed(1000, 1000) and peer_allowed(0, 1000)
    assert not peer_allowed(1001, 1000) and not peer_allowed(65534, 0)


def test_a_connection_from_another_uid_is_refused_with_nothing_done(tmp_path: Path) -> None:
    """The owner serves a spool of uid U; this process runs as another uid (an owner made
    to believe so, the real SO_PEERCRED check on a real connection): refused."""
    d = str(tmp_path / "spool")
    sp = Spool.open(d)
    other = os.getuid() + 4242 if os.getuid() != 0 else 4242
    server = ControlServer(sp, dict, allowed_uid=other)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            me = peer_of(s)
            assert me.pid == os.getpid()
            s.sendall(encode(Request(1, "accept", {"sender": "", "recipients": ["b@e.net"],
                                                  "data": b"x"})))  # fmt: skip
            got = Decoder().feed(s.recv(65536))
        if os.getuid() == 0:
            assert isinstance(got[0], Reply)  # root is let in whatever the spool's user
        else:
            assert isinstance(got[0], ErrorReply) and got[0].error == "PeerRefused"
    finally:
        server.stop()
        sp.close()


def test_a_dropped_privilege_child_is_refused(tmp_path: Path) -> None:
    """As root: a client in a child that dropped to another uid gets ``PeerRefused``
    (the socket made reachable for it, so that the uid check itself is what refuses)."""
    if os.getuid() != 0:
        pytest.skip("needs root to drop privileges")
    base = tempfile.mkdtemp(prefix="spool-peer-", dir="/tmp")  # reachable by nobody
    os.chmod(base, 0o755)
    d = os.path.join(base, "spool")
    sp = Spool.open(d)
    os.chmod(d, 0o755)
    server = ControlServer(sp, dict)
    server.start()
    os.chmod(server.path, 0o666)  # let the foreign uid reach the check itself
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, connect, say what happened
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            connect(d).close()
            os.write(write, b"connected")
        except PeerRefused as e:
            os.write(write, f"PeerRefused: {e}".encode())
        except BaseException as e:
            os.write(write, repr(e).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 1000).decode()
        os.waitpid(pid, 0)
        os.close(read)
    finally:
        server.stop()
        stats = sp.statistics()
        sp.close()
        shutil.rmtree(base)
    assert answer.startswith("PeerRefused: uid 65534 may not use this spool"), answer
    assert stats.accepted == 0


def test_peer_credentials_name_this_process() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        me = peer_of(a)
        assert (me.pid, me.uid) == (os.getpid(), os.getuid())


def test_protocol_error_is_typed() -> None:
    with pytest.raises(ProtocolError):
        Decoder().feed(struct.pack(">IB", 1, 1) + cbor2.dumps(1))


@pytest.mark.parametrize(
    ("op", "args", "error"),
    [
        ("claim", {"timeout": 10**400, "max": 1}, "SpoolMisuse"),
        ("claim", {"timeout": 0, "max": 10**5000}, "SpoolMisuse"),
        ("hello", {"version": 10**5000}, "ProtocolError"),
    ],
)
def test_numbers_too_large_to_convert_get_a_typed_error(
    live: str, op: str, args: dict[str, object], error: str
) -> None:
    got = exchange(live, encode(Request(4, op, args)))
    assert len(got) == 1 and isinstance(got[0], ErrorReply)
    assert (got[0].id, got[0].error) == (4, error)
    unchanged(live)


def test_a_client_that_reads_no_replies_cannot_fill_the_owners_memory(tmp_path: Path) -> None:
    # Before: each of 32 requests in flight on a connection kept its reply in memory
    # until sent, so a client asking for an 8 MB body 32 times and reading nothing grew
    # the owner by about 700 MiB (a few such connections: out of memory); now about 55.
    d = str(tmp_path / "spool")
    Spool.open(d).close()
    body = os.urandom(8 << 20)
    with owner(d) as proc:
        with connect(d) as client:
            msg_id = client.accept("a@example.org", ["b@example.net"], body)
        before = resident_kib(proc.pid)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(socket_path(d))
            s.sendall(encode(Request(1, "hello", {"version": 1})))
            s.sendall(encode(Request(2, "claim", {"timeout": 5.0, "max": 1})))
            decoder, got = Decoder(), []
            while len(got) < 2:
                got += decoder.feed(s.recv(65536))
            assert isinstance(got[1], Reply) and got[1].result[0]["msg_id"] == msg_id
            reads = b"".join(
                encode(Request(i, "read_data", {"msg_id": msg_id})) for i in range(3, 35)
            )
            s.sendall(reads)  # and never read the replies
            time.sleep(3)
            grown = resident_kib(proc.pid) - before
    assert grown < 200 * 1024, f"the owner grew by {grown // 1024} MiB"


def resident_kib(pid: int) -> int:
    """The resident memory of process ``pid`` in KiB (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1])


def test_requests_waiting_for_the_disk_hold_no_thread_each(tmp_path: Path) -> None:
    # The owner answers from one event loop: 32 accepts in hand on one connection, all
    # waiting for a slow fsync, are futures, not 32 threads (the old design's request
    # threads cost the owner more than the requests themselves).
    import threading

    from spool.fs import FileSystem

    class SlowSync(FileSystem):
        def fdatasync(self, fd: int) -> None:
            super().fdatasync(fd)
            time.sleep(0.2)

    sp = Spool.open(str(tmp_path / "spool"), fs=SlowSync())
    server = ControlServer(sp, dict)
    server.start()
    try:
        before = threading.active_count()
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            s.sendall(b"".join(
                encode(Request(i, "accept", {"sender": "", "recipients": [f"r{i}@e.net"],
                                             "data": b"x"}))
                for i in range(1, 33)
            ))  # fmt: skip
            time.sleep(0.1)  # all read and waiting for the disk
            during = threading.active_count()
            decoder, got = Decoder(), []
            s.settimeout(30)
            while len(got) < 32:
                got += decoder.feed(s.recv(65536))
        assert all(isinstance(m, Reply) for m in got)
        assert during - before <= 2, f"{during - before} threads for 32 requests in hand"
    finally:
        server.stop()
        sp.close()


def test_one_connections_slow_requests_never_wait_for_anothers(tmp_path: Path) -> None:
    # Found by review: the loop's one shared pool (6 threads here) ran every
    # connection's slow requests, so a few clients listing a large queue held up the
    # others' large accepts and statistics by seconds. Each connection has its own now.
    import asyncio
    import threading

    from spool.control import Peer, Session

    sp = Spool.open(str(tmp_path / "spool"))
    busy, free = (Session(sp, Peer(pid=n, uid=os.getuid()), dict) for n in (1, 2))
    gate = threading.Event()

    async def run() -> bool:
        stuck = [asyncio.ensure_future(busy.in_thread(gate.wait, 30)) for _ in range(40)]
        await asyncio.sleep(0.2)
        answered = await asyncio.wait_for(free.in_thread(lambda: True), 10)
        gate.set()
        await asyncio.gather(*stuck)
        return answered

    try:
        assert asyncio.run(run())
    finally:
        gate.set()
        for session in (busy, free):
            session.let_threads_go()
        sp.close()


def test_a_claim_left_waiting_by_a_connection_that_ended_takes_nothing(tmp_path: Path) -> None:
    # Found by review (older than the loop): a claim still waiting when its client went
    # away went on waiting, took the next message, and closed it as that client's crash
    # (a step towards the crash-loop hold, for mail that never reached a worker).
    d = str(tmp_path / "spool")
    sp = Spool.open(d)
    server = ControlServer(sp, dict)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            s.sendall(encode(Request(1, "claim", {"timeout": 20, "max": 1})))
            time.sleep(0.3)  # the claim waits for work
        time.sleep(0.3)  # the owner has seen the connection end
        with connect(d) as client:
            client.accept("a@example.org", ["b@example.net"], b"Subject: x\r\n\r\nhi\r\n")
            attempt = client.claim(timeout=10)
            assert attempt is not None, "the message went to the claim of a client gone"
            assert attempt.envelope.attempts == 0
            attempt.close()
    finally:
        server.stop()
        sp.close()
