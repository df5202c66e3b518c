"""Awaitable calls over the socket (and in process, AsyncSpool), and the docs' aiosmtpd handler
answering 250 only after ``await accept(...)`` returned (docs/serve.md, "asyncio")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import smtplib
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import Envelope, Session

import spool
from spool import DiskFull, InvalidMessage, ProtocolError
from tests.serve.running import owner
from tests.serve.sink import free_port


class SpoolHandler:
    """The example of docs/serve.md: 250 once the message is durable in the spool."""

    def __init__(self, client: spool.AsyncClient | spool.AsyncSpool) -> None:
        self.client = client

    async def handle_DATA(self, server: Any, session: Session, envelope: Envelope) -> str:
        try:
            msg_id = await self.client.accept(
                envelope.mail_from, envelope.rcpt_tos, envelope.original_content or b""
            )
        except DiskFull:
            return "452 4.3.1 insufficient system storage"
        except InvalidMessage as e:
            return f"554 5.6.0 {e}"
        return f"250 2.0.0 ok: queued as {msg_id}"


def send_64(port: int) -> list[str]:
    """64 messages over 16 concurrent SMTP sessions; the ids the 250 replies name."""

    def send(i: int) -> str:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
            smtp.ehlo()
            smtp.mail("a@example.org")
            smtp.rcpt(f"r{i}@example.net")
            code, text = smtp.data(f"Subject: {i}\r\n\r\nhello {i}\r\n".encode())
            assert code == 250, text
            return text.decode().rsplit(" ", 1)[1]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(send, range(64)))


def test_an_aiosmtpd_handler_answers_250_after_a_durable_accept(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    with owner(d):
        loop = asyncio.new_event_loop()
        client = loop.run_until_complete(spool.aconnect(d))
        port = free_port()
        controller = Controller(SpoolHandler(client), hostname="127.0.0.1", port=port, loop=loop)
        controller.start()
        try:
            ids = send_64(port)
        finally:
            controller.stop()
        with spool.connect(d) as sync_client:
            live = {e.msg_id: e for e in sync_client.list()}
            stats = sync_client.statistics()
        client.client.close()  # the controller closed its loop when it stopped
    assert sorted(live) == sorted(ids)
    assert stats.fsyncs < 64  # concurrent sessions shared fsyncs


def test_the_docs_aiosmtpd_handler_works_in_process(tmp_path: Path) -> None:
    # docs/serve.md's handler, unchanged, on an AsyncSpool: real SMTP sessions, 250 only
    # after the awaited accept, and the sessions share fsyncs.
    loop = asyncio.new_event_loop()
    sp = loop.run_until_complete(spool.AsyncSpool.open(tmp_path / "spool"))
    port = free_port()
    handler = SpoolHandler(sp)  # the same awaitable calls as over the socket
    controller = Controller(handler, hostname="127.0.0.1", port=port, loop=loop)
    controller.start()
    try:
        ids = send_64(port)
    finally:
        controller.stop()
    stats = sp.spool.statistics()
    live = {e.msg_id for e in sp.spool.list()}
    sp.spool.close()
    assert live == set(ids) and stats.accepted == 64
    assert stats.fsyncs < 64  # concurrent sessions shared fsyncs


def test_awaitable_attempts_and_operator_calls(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")

    async def scenario() -> None:
        async with await spool.aconnect(d) as client:
            kept = await client.accept("a@example.org", ["b@example.net", "c@example.net"], b"x")
            held = await client.accept("a@example.org", ["d@example.net"], b"y")
            await client.hold(held, reason="wait")
            attempt = await client.claim(timeout=5)
            assert attempt is not None and attempt.msg_id == kept
            async with attempt:
                assert await attempt.read_data() == b"x"
                await attempt.delivered(["b@example.net"], "250 2.0.0 ok")
                await attempt.failed(["c@example.net"], "550 5.1.1 no such user")
            assert await client.claim() is None  # the other one is held
            entries = await client.list()
            assert [(e.msg_id, e.held) for e in entries] == [(held, "wait")]
            stats = await client.statistics()
            assert (stats.delivered, stats.failed) == (1, 1)
            await client.release(held)
            assert await client.retry_now() == 0
            kinds = [type(r).__name__ for _pos, r in await client.show(kept)]
            assert kinds == ["Envelope", "Start", "Delta", "Delta", "Finish"]
            with pytest.raises(spool.UnknownMessage):
                await client.show("6B49D2000F5A1C33")
            status = await client.status()
            assert status["pid"] > 0 and status["workers"] == []
            assert (await client.checkpoint())["written"] is True

    with owner(d):
        asyncio.run(scenario())


def test_a_connection_the_owner_stops_reading_never_blocks_the_event_loop(
    tmp_path: Path,
) -> None:
    # The owner reads at most 32 requests of a connection at once: 32 waiting claims
    # hold its turn, and large accepts sent meanwhile fill the socket. The send used to
    # run on the event loop, which then stood still until the claims timed out.
    d = str(tmp_path / "spool")
    body = b"x" * 400_000

    async def scenario() -> tuple[int, int]:
        async with await spool.aconnect(d) as client:
            claims = [asyncio.create_task(client.claim(timeout=3)) for _ in range(32)]
            await asyncio.sleep(0.2)
            accepts = [
                asyncio.create_task(client.accept("a@example.org", [f"r{i}@example.net"], body))
                for i in range(20)
            ]
            ticks, started = 0, asyncio.get_running_loop().time()
            while asyncio.get_running_loop().time() - started < 1.5:
                await asyncio.sleep(0.01)
                ticks += 1
            ids = await asyncio.gather(*accepts)
            await asyncio.gather(*claims)
            return ticks, len(set(ids))

    with owner(d):
        ticks, accepted = asyncio.run(scenario())
    assert accepted == 20
    assert ticks >= 50  # the loop ran all along (blocked, it would tick a handful of times)


def test_awaitable_claim_with_the_bodies_and_settle(tmp_path: Path) -> None:
    # The two round trips of a worker's message, awaitable: a claim that brings the
    # bodies, then one settle of all the recipients' reports and the close.
    d = str(tmp_path / "spool")

    async def scenario() -> None:
        async with await spool.aconnect(d) as client:
            first = await client.accept("a@example.org", ["b@example.net", "c@example.net"], b"1")
            second = await client.accept("a@example.org", ["d@example.net"], b"2")
            one, two = await client.claim_many(2, timeout=5, with_data=True)
            assert [one.msg_id, two.msg_id] == [first, second]
            assert (one._data, two._data) == (b"1", b"2")  # came with the claim
            assert await two.read_data() == b"2"
            await one.settle(
                [
                    ("delivered", ["b@example.net"], "250 2.0.0 ok"),
                    ("failed", ["c@example.net"], "550 5.1.1 no such user"),
                ]
            )
            with pytest.raises(ProtocolError):  # an unknown status: refused, still open
                await two.settle([("bounced", ["d@example.net"], "550 5.0.0 no")])
            async with two:  # closed by hand: its recipient deferred
                pass
            stats = await client.statistics()
            assert (stats.delivered, stats.failed, stats.in_flight) == (1, 1, 0)
            assert [e.msg_id for e in await client.list()] == [second]

    with owner(d):
        asyncio.run(scenario())


def test_a_closed_awaitable_attempt_cannot_speak_for_a_later_attempt(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")

    async def scenario() -> None:
        async with await spool.aconnect(d) as client:
            msg = await client.accept("a@example.org", ["b@example.net"], b"x")
            stale = await client.claim(timeout=5)
            assert stale is not None
            await stale.settle([])
            assert await client.retry_now(msg) == 1
            fresh = await client.claim(timeout=5)
            assert fresh is not None and fresh.msg_id == msg
            with pytest.raises(spool.SpoolClosed):
                await stale.settle([("delivered", ["b@example.net"], "250 stale")])
            with pytest.raises(spool.SpoolClosed):
                await stale.read_data()
            await fresh.delivered(["b@example.net"], "250 2.0.0 ok")
            await fresh.close()
            assert (await client.statistics()).delivered == 1

    with owner(d):
        asyncio.run(scenario())
