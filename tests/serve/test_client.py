"""The in-process API over the control socket: ``spool.connect`` against a real owner."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

import spool.client
from spool import (
    MessageTooLarge,
    OperatorAction,
    Spool,
    SpoolClosed,
    SpoolMisuse,
    UnknownMessage,
    records,
)
from spool.client import RemoteAttempt, connect, owner_running, socket_path
from spool.errors import InvalidAddress, OwnerUnreachable
from tests.serve.running import owner

BODY = b"Subject: over the socket\r\n\r\nhello\r\n"


def make_spool(path: str) -> str:
    Spool.open(path, retry_intervals=[0.2, 0.5], max_message_size=100_000).close()
    return path


def test_accept_claim_report_close_over_the_socket(tmp_path: Path) -> None:
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client:
        mode = os.stat(socket_path(d)).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        msg_id = client.accept("a@example.org", ["b@example.net", "c@example.net"], BODY)
        attempt = client.claim(timeout=5)
        assert isinstance(attempt, RemoteAttempt) and attempt.msg_id == msg_id
        assert attempt.envelope.recipients == ("b@example.net", "c@example.net")
        assert attempt.envelope.body_size == len(BODY)
        assert attempt.read_data() == BODY
        with attempt:
            attempt.delivered(["b@example.net"], "250 2.0.0 ok")
            attempt.failed(["c@example.net"], "550 5.1.1 no such user")
        assert client.claim() is None
        stats = client.statistics()
        assert (stats.accepted, stats.delivered, stats.failed) == (1, 1, 1)
        kinds = [type(r) for _, r in client.show(msg_id)]
        assert records.Finish in kinds
        assert list(client.list()) == []
    # The owner stopped cleanly: nothing in flight for the next open, socket removed.
    assert not os.path.exists(socket_path(d))
    with Spool.open(d) as sp:
        assert sp.recovery.working_found == 0


def test_typed_errors_cross_the_socket_and_change_nothing(tmp_path: Path) -> None:
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client:
        with pytest.raises(InvalidAddress):
            client.accept("not an address", ["b@example.net"], BODY)
        with pytest.raises(MessageTooLarge):
            client.accept("a@example.org", ["b@example.net"], b"x" * 100_001)
        with pytest.raises(UnknownMessage):
            client.hold("6B06814FD9D372D3")
        msg_id = client.accept("a@example.org", ["b@example.net"], BODY)
        with pytest.raises(SpoolMisuse):
            client.release(msg_id)  # not held
        with pytest.raises(SpoolMisuse):
            client.hold(msg_id, reason="")
        with pytest.raises(SpoolMisuse):
            client.claim(timeout=-1)
        attempt = client.claim(timeout=10**400)  # past any float: as long as infinity
        assert attempt is not None and attempt.msg_id == msg_id
        attempt.close()
        assert client.statistics().accepted == 1
        assert [e.msg_id for e in client.list()] == [msg_id]


def test_operator_actions_over_the_socket(tmp_path: Path) -> None:
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client:
        ids = [client.accept("a@example.org", [f"r{i}@example.net"], BODY) for i in range(4)]
        client.hold(ids[0], reason="their MX is down")
        entry = {e.msg_id: e for e in client.list()}[ids[0]]
        assert entry.held == "their MX is down" and entry.state == "held"
        client.release(ids[0])
        client.delete(ids[1])
        client.bounce(ids[2], reason="554 5.7.1 relaying stopped")
        result = client.act(OperatorAction.HOLD, [ids[3], "6B06814FD9D372D3"])
        assert result.changed == (ids[3],) and result.unknown == ("6B06814FD9D372D3",)
        assert sorted(e.msg_id for e in client.list()) == sorted([ids[0], ids[3]])
        assert client.retry_now() == 0  # nothing deferred
        assert client.checkpoint()["written"] is True  # the actions since the open


def test_a_dropped_connection_closes_its_attempts_keeping_what_was_reported(
    tmp_path: Path,
) -> None:
    d = make_spool(str(tmp_path / "spool"))
    with owner(d):
        with connect(d) as client:
            msg_id = client.accept("a@example.org", ["b@example.net", "c@example.net"], BODY)
            attempt = client.claim(timeout=5)
            assert attempt is not None
            attempt.delivered(["b@example.net"], "250 2.0.0 ok")
        # The connection is gone with the attempt open: c is deferred, b stays delivered.
        with connect(d) as client:
            client.retry_now(msg_id)
            again = client.claim(timeout=5)
            assert again is not None and again.msg_id == msg_id
            assert again.envelope.recipients == ("c@example.net",)
            again.close()


def test_many_threads_share_one_connection(tmp_path: Path) -> None:
    d = make_spool(str(tmp_path / "spool"))
    ids: list[str] = []
    with owner(d), connect(d) as client:

        def produce(n: int) -> None:
            for i in range(25):
                ids.append(client.accept("a@example.org", [f"t{n}.{i}@example.net"], BODY))

        threads = [threading.Thread(target=produce, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(ids)) == 200
        assert client.statistics().accepted == 200
        assert client.statistics().fsyncs < 200  # group commit across the connection


def test_no_owner_and_a_stale_socket_are_told_apart_from_a_running_one(tmp_path: Path) -> None:
    d = make_spool(str(tmp_path / "spool"))
    assert not owner_running(d)
    with pytest.raises(OwnerUnreachable):
        connect(d)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(socket_path(d))  # a socket nobody listens on: a killed owner's leftover
    stale.close()
    with pytest.raises(OwnerUnreachable):
        connect(d)
    with owner(d):  # the next owner replaces it
        assert owner_running(d)


def test_calls_after_the_owner_stops_raise_owner_unreachable(tmp_path: Path) -> None:
    d = make_spool(str(tmp_path / "spool"))
    with owner(d):
        client = connect(d)
        client.accept("a@example.org", ["b@example.net"], BODY)
    with pytest.raises(OwnerUnreachable):
        client.statistics()
    client.close()


def test_a_long_spool_path_is_served_through_the_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    d = make_spool(str(deep / "spool"))
    assert len(socket_path(d)) > 108
    with owner(d), connect(d) as client:
        assert client.accept("a@example.org", ["b@example.net"], BODY)


def test_a_claim_longer_than_one_request_waits_in_several(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The owner waits at most CLAIM_WAIT_MAX per request; the client asks again.
    monkeypatch.setattr(spool.client, "CLAIM_WAIT_MAX", 0.2)
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client, connect(d) as producer:
        timer = threading.Timer(1.0, producer.accept, ("a@example.org", ["b@example.net"], BODY))
        timer.start()
        try:
            attempt = client.claim(timeout=30)
        finally:
            timer.join()
        assert attempt is not None
        attempt.delivered(attempt.envelope.recipients, "250 ok")
        attempt.close()
        assert client.claim(timeout=0.5) is None  # nothing left: the wait ends empty


def test_clients_waiting_for_work_do_not_hold_up_a_stop(tmp_path: Path) -> None:
    """Three clients wait in a claim of 50 s when SIGTERM comes. Before: the stop waited
    for each connection in turn, 10 s apiece, and a waiting claim was not told; now their
    claims end empty within a second and the owner is gone in a few."""
    d = make_spool(str(tmp_path / "spool"))
    results: list[object] = []
    with owner(d) as proc:
        clients = [connect(d) for _ in range(3)]

        def wait_for_work(client: spool.client.Client) -> None:
            try:
                results.append(client.claim(timeout=50))
            except OwnerUnreachable as e:
                results.append(e)

        waiters = [threading.Thread(target=wait_for_work, args=(c,)) for c in clients]
        for waiter in waiters:
            waiter.start()
        time.sleep(1)  # the claims reach the owner and wait there
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        took = time.monotonic() - started
        for waiter in waiters:
            waiter.join(10)
        for client in clients:
            client.close()
    assert took < 15, f"the stop took {took:.1f} s"  # 30 s and more before
    assert len(results) == 3 and all(r is None or isinstance(r, OwnerUnreachable) for r in results)


def test_a_claim_with_the_bodies_and_a_settle_in_one_round_trip_each(tmp_path: Path) -> None:
    # What a worker does per message: two round trips (claim with data, settle) instead
    # of five (claim, read_data, delivered, failed, close_attempt).
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client:
        first = client.accept("a@example.org", ["b@example.net", "c@example.net"], BODY)
        second = client.accept("a@example.org", ["d@example.net"], BODY + b"2")
        got = client.claim_many(2, timeout=5, with_data=True)
        assert [a.msg_id for a in got] == [first, second]
        assert [a._data for a in got] == [BODY, BODY + b"2"]  # came with the claim
        one, two = got
        one.settle(
            [
                ("delivered", ["b@example.net"], "250 2.0.0 ok"),
                ("deferred", ["c@example.net"], "451 4.7.1 later"),
            ]
        )
        with pytest.raises(SpoolMisuse):  # a recipient not in the attempt: refused
            two.settle([("delivered", ["nobody@example.net"], "250 ok")])
        with two:  # still open: closed by hand, its recipient deferred
            pass
        stats = client.statistics()
        assert (stats.delivered, stats.in_flight) == (1, 0)
        left = {e.msg_id: e.recipients for e in client.list()}
        assert left == {first: ("c@example.net",), second: ("d@example.net",)}


def test_a_worker_of_the_older_protocol_still_claims_reports_and_closes(tmp_path: Path) -> None:
    # A worker from before ``claim``'s data flag and ``settle``: a claim without the flag
    # (envelopes only), read_data, a report per status and close_attempt, one each.
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client:
        first = client.accept("a@example.org", ["b@example.net", "c@example.net"], BODY)
        [envelope] = client._call("claim", timeout=5.0, max=1)
        assert envelope["msg_id"] == first and "data" not in envelope
        assert client._call("read_data", msg_id=first) == BODY
        client._call(
            "report", msg_id=first, status="delivered", recipients=["b@example.net"], reply="250 ok"
        )
        client._call(
            "report", msg_id=first, status="failed", recipients=["c@example.net"], reply="550 no"
        )
        client._call("close_attempt", msg_id=first)
        stats = client.statistics()
        assert (stats.delivered, stats.failed, stats.in_flight) == (1, 1, 0)
        assert list(client.list()) == []


def test_a_closed_remote_attempt_cannot_speak_for_a_later_attempt(tmp_path: Path) -> None:
    # Found by review: the owner knows attempts by message id, so a handle kept after its
    # settle reported for the next attempt of the same message (and closed it).
    d = make_spool(str(tmp_path / "spool"))
    with owner(d), connect(d) as client:
        msg = client.accept("a@example.org", ["b@example.net", "c@example.net"], BODY)
        stale = client.claim(timeout=5)
        assert stale is not None
        stale.settle([])  # all deferred, the attempt over
        assert client.retry_now(msg) == 1
        fresh = client.claim(timeout=5)
        assert fresh is not None and fresh.msg_id == msg
        for call in (
            lambda: stale.settle([("delivered", ["c@example.net"], "250 stale")]),
            lambda: stale.delivered(["c@example.net"], "250 stale"),
            stale.read_data,
        ):
            with pytest.raises(SpoolClosed):
                call()
        fresh.delivered(["b@example.net", "c@example.net"], "250 2.0.0 ok")
        fresh.close()
        assert client.statistics().delivered == 2
