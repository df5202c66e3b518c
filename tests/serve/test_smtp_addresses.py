"""Addresses on the way out (RFC 6531): domains sent in A-labels, a non-ASCII local part
only where the next hop offers SMTPUTF8, else that recipient fails ``553 5.6.7``."""

from __future__ import annotations

import pytest

from spool.agents import load_agent
from spool.attempts import MessageEnvelope
from tests.serve.sink import start_sink

DATA = b"Subject: addresses\r\n\r\nhello\r\n"
OK = "250 2.0.0 queued"


def relay(sender: str, recipients: tuple[str, ...], *, utf8: bool) -> tuple[dict, list]:
    controller, recorder, port = start_sink(utf8=utf8)
    envelope = MessageEnvelope("6B49D20000000001", sender, recipients, 0, 0.0, len(DATA))
    agent = load_agent(f"smtp:127.0.0.1:{port}")
    try:
        replies = dict(agent.deliver(envelope, DATA))
    finally:
        agent.close()
        controller.stop()
    return replies, recorder.received


@pytest.mark.parametrize("utf8", [False, True])
def test_an_idn_domain_goes_out_in_a_labels(utf8: bool) -> None:
    # Found by review: smtplib refused the U-label domain (UnicodeEncodeError): the
    # message was deferred as an agent error until it expired.
    replies, received = relay("a@exämple.org", ("x@bücher.test",), utf8=utf8)
    assert replies == {"x@bücher.test": OK}
    assert received == [("a@xn--exmple-cua.org", ("x@xn--bcher-kva.test",), DATA)]


def test_a_non_ascii_local_part_needs_smtputf8_at_the_next_hop() -> None:
    replies, received = relay("a@example.org", ("dörte@example.net", "b@example.net"), utf8=False)
    assert replies["b@example.net"] == OK
    assert replies["dörte@example.net"].startswith("553 5.6.7 SMTPUTF8 is required")
    assert [r for _f, r, _d in received] == [("b@example.net",)]
    replies, received = relay("a@example.org", ("dörte@example.net",), utf8=True)
    assert replies == {"dörte@example.net": OK}
    assert [r for _f, r, _d in received] == [("dörte@example.net",)]


def test_a_non_ascii_sender_goes_only_where_smtputf8_is_offered() -> None:
    replies, received = relay("ü@example.org", ("b@example.net",), utf8=False)
    assert replies["b@example.net"].startswith("553 5.6.7 SMTPUTF8 is required")
    assert received == []
    replies, received = relay("ü@example.org", ("b@example.net",), utf8=True)
    assert replies == {"b@example.net": OK}
    assert [f for f, _r, _d in received] == ["ü@example.org"]
