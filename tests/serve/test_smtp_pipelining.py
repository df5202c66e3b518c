"""Outbound PIPELINING (RFC 2920): where the next hop offers it, the smtp and lmtp agents
send MAIL, every RCPT and DATA in one write. The scripted next hop here answers nothing
until it has read DATA, so an agent that waited for each reply would time out."""

from __future__ import annotations

from typing import Any

from spool.agents.lmtp import LmtpAgent
from spool.agents.smtp import SmtpAgent
from spool.attempts import MessageEnvelope
from tests.serve.raw_server import Session, raw_server

DATA = b"Subject: pipelined\r\n\r\nhello\n.a line with a leading dot\r\n"
SENT = b"Subject: pipelined\r\n\r\nhello\r\n..a line with a leading dot\r\n"


def envelope(*recipients: str) -> MessageEnvelope:
    return MessageEnvelope("6B49D20000000001", "a@example.org", recipients, 0, 0.0, len(DATA))


def pipelining_next_hop(
    *, mail_reply: bytes = b"250 2.1.0 ok", lmtp: bool = False, always_354: bool = False
) -> Any:
    """A session that offers PIPELINING and replies to a transaction only once DATA is
    read. RCPT to nouser* is refused (550), to grey* deferred (451); ``server.batches``
    keeps the commands of each transaction, ``server.messages`` each body read."""

    def script(s: Session) -> None:
        server: Any = s.server
        s.say(b"220 raw.test " + (b"LMTP" if lmtp else b"ESMTP"))
        while line := s.said():
            verb = line[:4].upper()
            if verb in (b"EHLO", b"LHLO"):
                s.say(b"250-raw.test", b"250 PIPELINING")
            elif verb == b"MAIL":
                batch = [line]
                while batch[-1][:4].upper() != b"DATA" and (more := s.said()):
                    batch.append(more)
                server.batches.append([b.strip().split(b":")[0] for b in batch])
                replies, accepted = [mail_reply], []
                for rcpt in batch[1:-1]:
                    local = rcpt.split(b"<")[1]
                    if local.startswith(b"nouser"):
                        replies.append(b"550 5.1.1 no such user")
                    elif local.startswith(b"grey"):
                        replies.append(b"451 4.7.1 greylisted")
                    else:
                        replies.append(b"250 2.1.5 ok")
                        accepted.append(local.split(b"@")[0])
                if not mail_reply.startswith(b"2"):
                    accepted = []
                if not accepted and not always_354:
                    s.say(*replies, b"554 5.5.1 no valid recipients")
                    continue
                s.say(*replies, b"354 go on")
                server.messages.append(s.read_data())
                if lmtp:
                    s.say(*(b"250 2.0.0 <" + local + b"> delivered" for local in accepted))
                else:
                    s.say(b"250 2.0.0 queued" if accepted else b"554 5.5.1 nothing to deliver")
            elif verb == b"QUIT":
                s.say(b"221 bye")
                return
            else:
                s.say(b"250 ok")

    return script


def test_mail_every_rcpt_and_data_go_in_one_write_where_pipelining_is_offered() -> None:
    with raw_server(pipelining_next_hop()) as server:
        agent = SmtpAgent("127.0.0.1", server.server_address[1], 5.0, tls="none")
        try:
            first = agent.deliver(envelope("b@example.net", "nouser@example.net"), DATA)
            second = agent.deliver(envelope("grey@example.net", "c@example.net"), DATA)
        finally:
            agent.close()
    assert first == {
        "b@example.net": "250 2.0.0 queued",
        "nouser@example.net": "550 5.1.1 no such user",
    }
    assert second == {
        "grey@example.net": "451 4.7.1 greylisted",
        "c@example.net": "250 2.0.0 queued",
    }
    assert server.batches == [[b"MAIL FROM", b"RCPT TO", b"RCPT TO", b"DATA"]] * 2
    assert server.messages == [SENT, SENT]  # lines ended CRLF, the leading dot doubled
    assert server.sessions == 1  # the connection kept for the second message


def test_a_refused_mail_settles_every_recipient_and_no_body_is_sent() -> None:
    hop = pipelining_next_hop(mail_reply=b"452 4.3.1 insufficient system storage")
    with raw_server(hop) as server:
        agent = SmtpAgent("127.0.0.1", server.server_address[1], 5.0, tls="none")
        try:
            replies = agent.deliver(envelope("b@example.net", "c@example.net"), DATA)
        finally:
            agent.close()
    assert replies == dict.fromkeys(
        ["b@example.net", "c@example.net"], "452 4.3.1 insufficient system storage"
    )
    assert server.messages == []


def test_a_354_with_no_recipient_accepted_gets_an_empty_message_not_the_body() -> None:
    # RFC 2920 3.1: a server may answer the pipelined DATA with 354 though it refused every
    # recipient; the client ends the data at once, and nobody is counted delivered.
    with raw_server(pipelining_next_hop(always_354=True)) as server:
        agent = SmtpAgent("127.0.0.1", server.server_address[1], 5.0, tls="none")
        try:
            refused = agent.deliver(envelope("nouser@example.net", "grey@example.net"), DATA)
            later = agent.deliver(envelope("b@example.net"), DATA)
        finally:
            agent.close()
    assert refused == {
        "nouser@example.net": "550 5.1.1 no such user",
        "grey@example.net": "451 4.7.1 greylisted",
    }
    assert later == {"b@example.net": "250 2.0.0 queued"}
    assert server.messages == [b"", SENT] and server.sessions == 1


def test_lmtp_pipelines_and_settles_each_recipient_by_its_own_reply() -> None:
    with raw_server(pipelining_next_hop(lmtp=True)) as server:
        agent = LmtpAgent("127.0.0.1", server.server_address[1], 5.0)
        try:
            replies = agent.deliver(
                envelope("b@example.net", "nouser@example.net", "c@example.net"), DATA
            )
        finally:
            agent.close()
    assert replies == {
        "b@example.net": "250 2.0.0 <b> delivered",
        "nouser@example.net": "550 5.1.1 no such user",
        "c@example.net": "250 2.0.0 <c> delivered",
    }
    assert server.batches == [[b"MAIL FROM", *[b"RCPT TO"] * 3, b"DATA"]]
    assert server.messages == [SENT]
