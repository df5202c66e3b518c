"""``routes:PATH``: recipients relayed by domain through a transport map, to real SMTP
sinks (aiosmtpd), each next hop's connection kept for the next message."""

from __future__ import annotations

from pathlib import Path

import pytest

from spool.agents import load_agent
from spool.agents.routes import parse_transport_map, route_of
from spool.agents.smtp import NextHop
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse
from tests.serve.sink import start_sink

DATA = b"Subject: routed\r\n\r\nhello\r\n"


def test_a_domain_takes_its_own_line_then_its_parents_then_the_default() -> None:
    routes = parse_transport_map(
        """
        # domain        next hop
        example.com     smtp:one:25
        .example.com    smtp:[10.0.0.5]:2525   # subdomains only
        BÜCHER.example  smtp:two:25
        *               smtp:default:587
        """
    )
    assert route_of(routes, "example.com") == NextHop("one", 25)
    assert route_of(routes, "mx.eu.example.com") == NextHop("10.0.0.5", 2525)
    assert route_of(routes, "xn--bcher-kva.example") == NextHop("two", 25)
    assert route_of(routes, "elsewhere.example") == NextHop("default", 587)
    assert route_of(parse_transport_map("a.example smtp:h:25"), "b.example") is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("example.com", "give a domain and a next hop"),
        ("example.com lmtp:h:24", "must be smtp:HOST:PORT"),
        ("example.com smtp:h:99999", "must be smtp:HOST:PORT"),
        ("exa_mple.com smtp:h:25", "is not a domain"),
        ("a.example smtp:h:25\nA.EXAMPLE smtp:h:26", "routed twice"),
    ],
)
def test_a_bad_map_names_its_line(text: str, says: str) -> None:
    with pytest.raises(SpoolMisuse, match=says) as e:
        parse_transport_map(text, "routes.txt")
    assert "routes.txt line" in str(e.value)


def test_recipients_go_to_their_domains_next_hop_over_kept_connections(tmp_path: Path) -> None:
    one, sink_one, port_one = start_sink()
    two, sink_two, port_two = start_sink()
    try:
        (tmp_path / "transport").write_text(
            f"a.example smtp:127.0.0.1:{port_one}\n.b.example smtp:127.0.0.1:{port_two}\n"
        )
        agent = load_agent(f"routes:{tmp_path / 'transport'}")
        try:
            for n in range(3):
                envelope = MessageEnvelope(
                    f"6B49D2000000000{n}", "s@example.org",
                    ("x@a.example", "y@mx.b.example", "nouser@a.example", "z@c.example"),
                    0, 1.8e9, len(DATA),
                )  # fmt: skip
                replies = agent.deliver(envelope, DATA)
                assert replies["x@a.example"].startswith("250")
                assert replies["y@mx.b.example"].startswith("250")
                assert replies["nouser@a.example"].startswith("550")
                assert replies["z@c.example"].startswith("451 4.3.5 no route to c.example")
        finally:
            agent.close()
    finally:
        one.stop()
        two.stop()
    assert [r for _, r, _ in sink_one.received] == [("x@a.example",)] * 3
    assert [r for _, r, _ in sink_two.received] == [("y@mx.b.example",)] * 3
    assert sink_one.connections == sink_two.connections == 1  # kept across messages


def test_an_unreadable_map_is_refused_when_the_agent_starts(tmp_path: Path) -> None:
    with pytest.raises(SpoolMisuse, match="cannot read the transport map"):
        load_agent(f"routes:{tmp_path / 'missing'}")
    with pytest.raises(SpoolMisuse, match="routes:PATH"):
        load_agent("routes:")
