"""Replies of the next hop that once were misread (third review of the relay): any 2xx
to RCPT accepts, LMTP replies already read stand when the session is cut, a 421 to RSET
opens a new session, an 8-bit body is announced."""

from __future__ import annotations

import time

import pytest

from spool.agents import load_agent
from spool.agents.lmtp import LmtpAgent
from spool.agents.mx import MxAgent
from spool.agents.routes import parse_transport_map
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse
from spool.worker import _recordable, _well_formed
from tests.serve.dns_server import DnsServer
from tests.serve.raw_server import Session, raw_server
from tests.serve.sink import start_sink

DATA = b"Subject: replies\r\n\r\nhello\r\n"


def envelope(*recipients: str) -> MessageEnvelope:
    return MessageEnvelope("6B49D20000000001", "a@example.org", recipients, 0, 0.0, len(DATA))


def smtp_session(rcpt_reply: bytes, rset_reply: bytes | None = None) -> object:
    def script(s: Session) -> None:
        s.say(b"220 raw.test ESMTP")
        while line := s.said():
            verb = line[:4].upper()
            if verb in (b"EHLO", b"LHLO"):
                s.say(b"250 raw.test")
            elif verb == b"RCPT":
                s.say(rcpt_reply)
            elif verb == b"DATA":
                s.say(b"354 go on")
                s.server.messages.append(s.read_data())  # type: ignore[attr-defined]
                s.say(b"250 2.0.0 queued")
            elif verb == b"RSET" and rset_reply is not None:
                s.say(rset_reply)
                return  # and closed, as a next hop's idle timeout does
            elif verb == b"QUIT":
                s.say(b"221 bye")
                return
            else:
                s.say(b"250 ok")

    return script


def test_any_2xx_to_rcpt_accepts_and_the_data_is_sent() -> None:
    # Before: 252 was not taken as accepted, yet its reply was returned: the recipient
    # counted as delivered with no DATA ever sent (lost).
    with raw_server(smtp_session(b"252 2.1.5 cannot verify, will attempt")) as server:
        agent = load_agent(f"smtp:127.0.0.1:{server.server_address[1]},tls=none")
        try:
            assert agent.deliver(envelope("b@example.net"), DATA) == {
                "b@example.net": "250 2.0.0 queued"
            }
        finally:
            agent.close()
        assert len(server.messages) == 1


def test_a_421_to_rset_opens_a_new_session_for_the_next_message() -> None:
    # Before: the kept session's idle timeout (421 to RSET) deferred the next message.
    with raw_server(smtp_session(b"250 ok", rset_reply=b"421 4.4.2 timeout")) as server:
        agent = load_agent(f"smtp:127.0.0.1:{server.server_address[1]},tls=none")
        try:
            for rcpt in ("b@example.net", "c@example.net"):
                assert agent.deliver(envelope(rcpt), DATA) == {rcpt: "250 2.0.0 queued"}
        finally:
            agent.close()
        assert server.sessions == 2 and len(server.messages) == 2


def test_lmtp_replies_read_before_the_session_is_cut_stand() -> None:
    # Before: a 250 for one recipient, then the connection lost before the next reply:
    # both deferred, and the delivered one delivered again on the retry.
    def script(s: Session) -> None:
        s.say(b"220 raw.test LMTP")
        while line := s.said():
            verb = line[:4].upper()
            if verb == b"LHLO":
                s.say(b"250 raw.test")
            elif verb == b"DATA":
                s.say(b"354 go on")
                s.read_data()
                s.say(b"250 2.0.0 <b@example.net> delivered")
                return  # cut before the second recipient's reply
            else:
                s.say(b"250 ok")

    with raw_server(script) as server:
        agent = load_agent(f"lmtp:127.0.0.1:{server.server_address[1]}")
        try:
            replies = agent.deliver(envelope("b@example.net", "c@example.net"), DATA)
        finally:
            agent.close()
    assert replies["b@example.net"] == "250 2.0.0 <b@example.net> delivered"
    assert replies["c@example.net"].startswith("451 4.4.")


def test_an_8bit_body_is_announced_where_8bitmime_is_offered() -> None:
    controller, recorder, port = start_sink()
    agent = load_agent(f"smtp:127.0.0.1:{port}")
    try:
        body = "Subject: café\r\n\r\ncafé\r\n".encode()
        assert agent.deliver(envelope("b@example.net"), body) == {
            "b@example.net": "250 2.0.0 queued"
        }
        agent.deliver(envelope("c@example.net"), DATA)
    finally:
        agent.close()
        controller.stop()
    assert recorder.mail_options == [["BODY=8BITMIME"], []]


def test_a_transport_map_with_a_cafile_that_cannot_be_read_is_refused() -> None:
    # Before: accepted when loaded; the first message to that hop raised after the other
    # hops were sent, and the whole message was retried (sent again to them).
    with pytest.raises(SpoolMisuse, match="line 2: cannot read the certificates"):
        parse_transport_map(
            "a.test smtp:h:25,tls=none\nb.test smtp:h:25,tls=verify,cafile=/nonexistent/ca.pem"
        )


def test_an_address_under_two_exchanger_names_is_tried_once() -> None:
    zone = {
        "dup.test.": {"MX": ["10 one.dup.test.", "20 two.dup.test."]},
        "one.dup.test.": {"A": ["127.0.0.1"]},
        "two.dup.test.": {"A": ["127.0.0.1", "127.0.0.2"]},
    }
    with DnsServer(zone) as server:
        agent = load_agent(f"mx:nameserver=127.0.0.1:{server.port}")
        assert isinstance(agent, MxAgent)
        found = agent.exchangers("dup.test")
    assert isinstance(found, list)
    assert [(e.name, e.address) for e in found] == [
        ("one.dup.test", "127.0.0.1"),
        ("two.dup.test", "127.0.0.2"),
    ]


def test_a_reply_with_a_nul_is_still_a_delivery() -> None:
    # Found by review: a NUL in the 250 after DATA made the reply unrecordable; the
    # worker deferred the recipient and the next hop got the message on every retry.
    def script(s: Session) -> None:
        s.say(b"220 raw.test ESMTP")
        while line := s.said():
            verb = line[:4].upper()
            if verb == b"DATA":
                s.say(b"354 go on")
                s.read_data()
                s.say(b"250 2.0.0 Ok: queued as \x00ABC\x07")
            elif verb == b"QUIT":
                s.say(b"221 bye")
                return
            else:
                s.say(b"250 raw.test" if verb == b"EHLO" else b"250 ok")

    with raw_server(script) as server:
        agent = load_agent(f"smtp:127.0.0.1:{server.server_address[1]},tls=none")
        try:
            replies = agent.deliver(envelope("b@example.net"), DATA)
        finally:
            agent.close()
    assert replies == {"b@example.net": "250 2.0.0 Ok: queued as ABC"}
    assert _recordable("250 ok\x00") == "250 ok\ufffd" and _well_formed(_recordable("250 ok\x00"))


def test_a_reply_that_times_out_is_said_to_have_timed_out() -> None:
    # smtplib reports a read that timed out as a lost connection (4.4.1 "cannot reach").
    def script(s: Session) -> None:
        s.say(b"220 raw.test LMTP")
        while line := s.said():
            verb = line[:4].upper()
            if verb == b"DATA":
                s.say(b"354 go on")
                s.read_data()
                s.say(b"250 2.0.0 delivered")
                time.sleep(3)  # and the second reply never comes in time
                return
            s.say(b"250 raw.test" if verb == b"LHLO" else b"250 ok")

    with raw_server(script) as server:
        agent = LmtpAgent("127.0.0.1", server.server_address[1], 1.0)
        try:
            replies = agent.deliver(envelope("b@example.net", "c@example.net"), DATA)
        finally:
            agent.close()
    assert replies["b@example.net"] == "250 2.0.0 delivered"
    assert replies["c@example.net"].startswith("451 4.4.2 timed out talking to 127.0.0.1:")
