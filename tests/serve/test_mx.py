"""The ``mx`` agent: each recipient domain's mail exchangers from DNS (RFC 5321 5.1),
against a real DNS server and real SMTP next hops on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

import spool
from spool.agents import each_group, load_agent, mx
from spool.agents.mx import MxAgent
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse
from tests.serve.dns_server import DnsServer, Zone
from tests.serve.running import owner, read
from tests.serve.sink import Recorder, free_port, self_signed, server_context, start_sink

DATA = b"Subject: mx\r\n\r\nhello\r\n"
OK = "250 2.0.0 queued"


def zone() -> Zone:
    """Every case of a destination. Nothing listens on 127.0.0.2: a dead exchanger."""
    return {
        "backup.test.": {"MX": ["10 dead.backup.test.", "20 live.backup.test."]},
        "dead.backup.test.": {"A": ["127.0.0.2"]},
        "live.backup.test.": {"A": ["127.0.0.1"]},
        "implicit.test.": {"A": ["127.0.0.1"]},  # no MX: the domain is its exchanger
        "nullmx.test.": {"MX": ["0 ."]},
        "down.test.": {"MX": ["10 dead.backup.test."]},
        "noaddress.test.": {"MX": ["10 nowhere.noaddress.test."]},
        "nowhere.noaddress.test.": {"TXT": ['"no address"']},
        "broken.test.": {"MX": ["10 ns-broken.test."]},
        "pref.test.": {"MX": ["20 second.pref.test.", "10 first.pref.test."]},
        "first.pref.test.": {"A": ["127.0.0.1"]},
        "second.pref.test.": {"A": ["127.0.0.3"]},
        "tls.test.": {"MX": ["10 mx.tls.test."]},
        "loop.test.": {"MX": ["10 us.loop.test."]},
        "us.loop.test.": {"A": ["127.0.0.1"]},
        "secondary.test.": {"MX": ["20 us.loop.test.", "10 first.secondary.test."]},
        "first.secondary.test.": {"A": ["127.0.0.2"]},  # nothing listens there
        "tie.test.": {"MX": ["10 us.loop.test.", "10 first.secondary.test."]},
        "mx.tls.test.": {"A": ["127.0.0.1"]},
    }


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    with DnsServer(zone(), servfail=frozenset({"servfail.test.", "ns-broken.test."})) as server:
        yield server


@pytest.fixture
def sink() -> Iterator[tuple[Recorder, int]]:
    controller, recorder, port = start_sink()
    try:
        yield recorder, port
    finally:
        controller.stop()


def envelope(*recipients: str) -> MessageEnvelope:
    return MessageEnvelope("6B49D20000000001", "a@example.org", recipients, 0, 0.0, len(DATA))


def agent_for(dns_server: DnsServer, port: int) -> MxAgent:
    agent = load_agent(f"mx:port={port},nameserver=127.0.0.1:{dns_server.port}")
    assert isinstance(agent, MxAgent)
    return agent


def relay_as(myself: list[tuple[str, int]], dns_server: DnsServer, port: int) -> MxAgent:
    """The agent of a relay listening on ``myself``."""
    return MxAgent(port, nameserver=("127.0.0.1", dns_server.port), myself=myself)


def test_each_domain_goes_to_its_first_exchanger_that_answers(
    dns_server: DnsServer, sink: tuple[Recorder, int]
) -> None:
    recorder, port = sink
    agent = agent_for(dns_server, port)
    try:
        replies = agent.deliver(
            envelope("b@backup.test", "c@implicit.test", "d@Implicit.TEST"), DATA
        )
        assert replies == {"b@backup.test": OK, "c@implicit.test": OK, "d@Implicit.TEST": OK}
        # One transaction per domain; the dead primary was tried first, then the backup.
        assert sorted(r for _f, rcpts, _d in recorder.received for r in rcpts) == [
            "b@backup.test", "c@implicit.test", "d@Implicit.TEST",
        ]  # fmt: skip
        assert len(recorder.received) == 2
        replies = agent.deliver(envelope("e@backup.test"), DATA)  # the connection is kept
        assert replies == {"e@backup.test": OK}
        assert recorder.connections == 2
    finally:
        agent.close()
    assert ("backup.test.", "MX") in dns_server.queries
    assert ("dead.backup.test.", "A") in dns_server.queries  # the primary, tried first
    assert ("implicit.test.", "MX") in dns_server.queries  # asked, found none, used A


def test_the_lowest_preference_is_tried_first(
    dns_server: DnsServer, sink: tuple[Recorder, int]
) -> None:
    first, port = sink
    second = Recorder()
    other = Controller(second, hostname="127.0.0.3", port=port)  # both answer
    other.start()
    try:
        agent = agent_for(dns_server, port)
        try:
            for i in range(5):  # never by chance
                assert agent.deliver(envelope(f"b{i}@pref.test"), DATA) == {f"b{i}@pref.test": OK}
        finally:
            agent.close()
    finally:
        other.stop()
    assert len(first.received) == 5 and second.received == []


@pytest.mark.parametrize(
    ("recipient", "reply"),
    [
        ("b@nosuch.test", "550 5.1.2 nosuch.test: no such domain"),
        ("b@nullmx.test", "556 5.1.10 nullmx.test accepts no mail (null MX"),
        ("b@noaddress.test", "550 5.4.4 noaddress.test: no address"),
        ("b@servfail.test", "451 4.4.3 DNS lookup of servfail.test MX failed"),
        ("b@broken.test", "451 4.4.3 DNS lookup of the exchangers of broken.test failed"),
        ("b@down.test", "451 4.4.1 cannot reach dead.backup.test[127.0.0.2]:"),
    ],
)
def test_what_dns_says_settles_a_domain_without_a_connection(
    dns_server: DnsServer, sink: tuple[Recorder, int], recipient: str, reply: str
) -> None:
    recorder, port = sink
    agent = agent_for(dns_server, port)
    try:
        replies = agent.deliver(envelope(recipient, "ok@implicit.test"), DATA)
    finally:
        agent.close()
    assert replies[recipient].startswith(reply), replies
    assert replies["ok@implicit.test"] == OK  # the other domain is not held up
    assert [rcpts for _f, rcpts, _d in recorder.received] == [("ok@implicit.test",)]


def test_verify_checks_the_exchangers_name_not_the_address_it_connects_to(
    tmp_path: Path, dns_server: DnsServer
) -> None:
    # The agent connects to the address DNS gave; the certificate must name the exchanger
    # (RFC 7672 2.2.2's reference identity, Postfix's smtp_tls_verify_cert_match=hostname):
    # a certificate for 127.0.0.1 and another name is refused although it chains.
    named = self_signed(tmp_path, "mx.tls.test")
    other = self_signed(tmp_path, "other.test")  # names 127.0.0.1 and localhost too
    for (cert, key), expected in [(named, "250 2.0.0 queued"), (other, "451 4.7.5 TLS with")]:
        controller, recorder, port = start_sink(server_context(cert, key))
        try:
            agent = load_agent(
                f"mx:port={port},nameserver=127.0.0.1:{dns_server.port},tls=verify,cafile={cert}"
            )
            try:
                [reply] = agent.deliver(envelope("b@tls.test"), DATA).values()
            finally:
                agent.close()
        finally:
            controller.stop()
        assert reply.startswith(expected), reply
        assert recorder.encrypted == ([True] if expected.startswith("250") else [])
        if not expected.startswith("250"):
            assert "mx.tls.test" in reply and "Hostname mismatch" in reply, reply


@pytest.mark.parametrize("listener", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_mail_whose_best_exchanger_is_this_relay_fails_rather_than_loop(
    dns_server: DnsServer, sink: tuple[Recorder, int], listener: str
) -> None:
    # The sink stands where this relay listens: a connection there would be mail to
    # itself, coming back until its Received: fields ran out (Postfix: "loops back to
    # myself"). A wildcard listener is every address of this host; a name, its addresses.
    recorder, port = sink
    agent = relay_as([(listener, port)], dns_server, port)
    try:
        replies = agent.deliver(
            envelope("a@loop.test", "b@tie.test", "c@[127.0.0.1]", "d@implicit.test"), DATA
        )
    finally:
        agent.close()
    for rcpt in ("a@loop.test", "b@tie.test", "c@[127.0.0.1]", "d@implicit.test"):
        domain = rcpt.split("@")[1]
        assert replies[rcpt] == f"554 5.4.6 mail for {domain} loops back to myself", replies
    assert recorder.received == [] and recorder.connections == 0


def test_a_relay_that_is_a_backup_exchanger_tries_only_better_ones(
    dns_server: DnsServer, sink: tuple[Recorder, int]
) -> None:
    recorder, port = sink
    agent = relay_as([("127.0.0.1", port)], dns_server, port)
    try:
        [reply] = agent.deliver(envelope("a@secondary.test"), DATA).values()
    finally:
        agent.close()
    # The primary is down: deferred, kept here, never sent on to this relay itself.
    assert reply.startswith("451 4.4.1 cannot reach first.secondary.test[127.0.0.2]"), reply
    assert recorder.received == []
    agent = relay_as([("127.0.0.1", port + 1)], dns_server, port)  # listening elsewhere
    try:  # the same exchanger is then another host: delivered to it
        assert agent.deliver(envelope("a@secondary.test"), DATA) == {"a@secondary.test": OK}
    finally:
        agent.close()


def test_the_workers_know_the_owners_listeners(tmp_path: Path, dns_server: DnsServer) -> None:
    # End to end: the owner listens on SMTP, and loop.test's exchanger is this very
    # listener. The message fails once, with the reason, and is not accepted again and
    # again through the relay's own front door.
    d = str(tmp_path / "spool")
    port = free_port()
    agent = f"mx:port={port},nameserver=127.0.0.1:{dns_server.port}"
    with owner(d, "--smtp", f"127.0.0.1:{port}", "--agent", agent), spool.connect(d) as client:
        client.accept("a@example.org", ["x@loop.test"], DATA)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and client.statistics().failed == 0:
            time.sleep(0.1)
        stats = client.statistics()
    assert (stats.accepted, stats.failed, stats.delivered) == (1, 1, 0)
    assert "loops back to myself" in read(d + ".log")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("mx:port=0", "port must be 1 to 65535"),
        ("mx:port=25,port=26", "give the agent as mx"),
        ("mx:relay=x", "give the agent as mx"),
        ("mx:tls=maybe", "use one of none, may, encrypt, verify"),
        ("mx:cafile=/x.pem", "cafile is for tls=verify"),
        ("mx:tls=verify,cafile=/nonexistent.pem", "cannot read the certificates"),
        ("mx:nameserver=dns.example", "give an IP address"),
        ("mx:nameserver=127.0.0.1:99999", "port must be 1 to 65535"),
    ],
)
def test_bad_options_are_refused_when_the_agent_is_made(spec: str, says: str) -> None:
    with pytest.raises(SpoolMisuse, match=says):
        load_agent(spec)


def test_the_bare_spec_takes_the_systems_resolvers() -> None:
    try:
        agent = load_agent("mx")
    except SpoolMisuse as e:  # a machine with no /etc/resolv.conf (some containers)
        assert "names no DNS resolver" in str(e)
    else:
        assert isinstance(agent, MxAgent) and (agent.port, agent.tls) == (25, "may")
    with pytest.raises(SpoolMisuse, match="give the agent as mx"):
        load_agent("mx:port=25,,tls=may")


def test_nameserver_forms() -> None:
    for text, expected in [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
    ]:
        agent = load_agent(f"mx:nameserver={text}")
        assert isinstance(agent, MxAgent)
        resolver = agent.resolver
        assert (resolver.nameservers[0], resolver.port) == expected, text


def test_workers_relay_to_each_domains_exchanger(
    tmp_path: Path, dns_server: DnsServer, sink: tuple[Recorder, int]
) -> None:
    recorder, port = sink
    d = str(tmp_path / "spool")
    agent = f"mx:port={port},nameserver=127.0.0.1:{dns_server.port}"
    with owner(d, "--agent", agent, "--workers", "2"), spool.connect(d) as client:
        for i in range(6):
            client.accept("a@example.org", [f"r{i}@backup.test", f"s{i}@nosuch.test"], DATA)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = client.statistics()
            if (stats.delivered, stats.failed) == (6, 6):
                break
            time.sleep(0.1)
        assert (stats.delivered, stats.failed) == (6, 6)
    assert sorted(r for _f, rcpts, _d in recorder.received for r in rcpts) == sorted(
        f"r{i}@backup.test" for i in range(6)
    )


def test_a_recipient_one_domain_cannot_take_leaves_the_others_delivered(
    dns_server: DnsServer, sink: tuple[Recorder, int]
) -> None:
    # Found by review: a non-ASCII local part raised in smtplib for its domain after the
    # other domain had been sent; the whole message was deferred and the delivered
    # recipient sent again on every retry.
    recorder, port = sink  # no SMTPUTF8 offered
    agent = agent_for(dns_server, port)
    try:
        replies = agent.deliver(envelope("x@backup.test", "ü@implicit.test"), DATA)
    finally:
        agent.close()
    assert replies["x@backup.test"] == OK
    assert replies["ü@implicit.test"].startswith("553 5.6.7 SMTPUTF8 is required")
    assert [rcpts for _f, rcpts, _d in recorder.received] == [("x@backup.test",)]


def test_an_agent_error_in_one_group_defers_that_group_only() -> None:
    part = envelope("a@one.test")
    assert each_group(lambda: {"a@one.test": OK}, part) == {"a@one.test": OK}

    def broken() -> dict[str, str]:
        raise UnicodeEncodeError("ascii", "ü", 0, 1, "not ASCII")

    [reply] = each_group(broken, part).values()
    assert reply.startswith("451 4.3.0 delivery agent error: UnicodeEncodeError")


def test_an_address_literal_is_its_own_exchanger(
    dns_server: DnsServer, sink: tuple[Recorder, int]
) -> None:
    # Found by review: x@[127.0.0.1] was looked up as a domain and bounced (NXDOMAIN).
    recorder, port = sink
    agent = agent_for(dns_server, port)
    try:
        replies = agent.deliver(envelope("x@[127.0.0.1]", "y@[IPv6:::2]", "z@[bad]"), DATA)
    finally:
        agent.close()
    assert replies["x@[127.0.0.1]"] == OK
    assert replies["y@[IPv6:::2]"].startswith("451 4.4.1 cannot reach ::2[::2]")
    assert replies["z@[bad]"].startswith("550 5.1.2 [bad]: not an address literal")
    assert [rcpts for _f, rcpts, _d in recorder.received] == [("x@[127.0.0.1]",)]
    assert not any(name.startswith("[") for name, _t in dns_server.queries)


def test_a_silent_nameserver_costs_a_domain_its_budget_not_more(
    sink: tuple[Recorder, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: each lookup had 30 s, so three silent exchangers held a worker
    # 192 s for one domain, long enough to reach an attempt's lease with several.
    monkeypatch.setattr(mx, "DOMAIN_BUDGET", 2.0)
    zone = {"slow.test.": {"MX": ["10 a.slow.test.", "20 b.slow.test.", "30 c.slow.test."]}}
    silent = frozenset({"a.slow.test.", "b.slow.test.", "c.slow.test."})
    _recorder, port = sink
    with DnsServer(zone, silent=silent) as server:
        agent = agent_for(server, port)
        started = time.monotonic()
        try:
            [reply] = agent.deliver(envelope("x@slow.test"), DATA).values()
        finally:
            agent.close()
    assert time.monotonic() - started < 6
    assert reply == "451 4.4.3 DNS lookup of the exchangers of slow.test failed: timed out"
