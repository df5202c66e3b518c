"""``routes:PATH``: relay each recipient by its domain, through a transport map.

The map is a text file in the shape of Postfix's transport(5), one route a line::

    # domain            next hop
    example.com         smtp:mx1.example.com:25
    .example.com        smtp:[10.0.0.5]:2525     # any subdomain of example.com
    *                   smtp:smarthost.example:587,tls=verify

A domain matches its own line first, then the lines of its parent domains written with a
leading dot (nearest first), then ``*``. Domains are compared in A-labels, without regard
to case. A message's recipients are grouped by next hop, and each group is one SMTP
transaction through ``SmtpAgent`` (``smtp.py``), whose connection to that next hop is
kept and reused for the worker's later messages. A next hop takes the ``smtp`` agent's
TLS options (``,tls=LEVEL[,cafile=PEM]``). A recipient no line matches is deferred
with ``451 4.3.5`` (the map needs fixing; the mail waits instead of bouncing). The map is
read when the agent starts: each worker replaced (``--max-use``) reads it again.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs

from spool.addresses import check_mailbox, domain_of
from spool.agents import Replies, Report, each_group
from spool.agents.smtp import NextHop, SmtpAgent, parse_next_hop, tls_context
from spool.attempts import MessageEnvelope
from spool.errors import InvalidAddress, SpoolMisuse


def parse_transport_map(text: str, source: str = "transport map") -> dict[str, NextHop]:
    """``{pattern: next hop}`` from the text of a map; ``SpoolMisuse`` naming the line
    for anything else (an unknown transport, a bad next hop, a domain given twice)."""
    routes: dict[str, NextHop] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{source} line {number}"
        if len(fields) != 2:
            raise SpoolMisuse(
                f"{where}: give a domain and a next hop, as: example.com smtp:HOST:PORT"
            )
        pattern, hop = fields
        kind, _, target = hop.partition(":")
        if kind != "smtp":
            raise SpoolMisuse(f"{where}: the next hop must be smtp:HOST:PORT, not {hop!r}")
        try:
            next_hop = parse_next_hop(target)
            if next_hop.cafile is not None:  # one that cannot be read: refused now
                tls_context(next_hop.tls, next_hop.cafile)
        except SpoolMisuse as e:
            raise SpoolMisuse(f"{where}: {e}") from None
        key = pattern if pattern == "*" else _domain_key(pattern, where)
        if key in routes:
            raise SpoolMisuse(f"{where}: {pattern} is routed twice")
        routes[key] = next_hop
    return routes


def _domain_key(pattern: str, where: str) -> str:
    dot = "." if pattern.startswith(".") else ""
    try:
        address = check_mailbox("postmaster@" + pattern.removeprefix(".").rstrip("."))
        return dot + domain_of(address)
    except InvalidAddress as e:
        raise SpoolMisuse(f"{where}: {pattern!r} is not a domain ({e.reason})") from None


def route_of(routes: Mapping[str, NextHop], domain: str) -> NextHop | None:
    """The next hop for ``domain`` (in A-labels, lower case): the domain's own line, its
    parents' dotted lines nearest first, then ``*``."""
    if domain in routes:
        return routes[domain]
    labels = domain.split(".")
    for i in range(1, len(labels)):
        parent = "." + ".".join(labels[i:])
        if parent in routes:
            return routes[parent]
    return routes.get("*")


class RoutingAgent:
    """Recipients grouped by next hop; one cached ``SmtpAgent`` per next hop."""

    def __init__(self, routes: Mapping[str, NextHop], source: str) -> None:
        self.routes = dict(routes)
        self.source = source
        self._hops: dict[NextHop, SmtpAgent] = {}

    reports_groups = True  # each next hop's replies reported as it is done (spool.agents)

    def deliver(
        self, envelope: MessageEnvelope, data: bytes, report: Report | None = None
    ) -> Replies:
        groups: dict[NextHop, list[str]] = {}
        replies: dict[str, str] = {}
        for rcpt in envelope.recipients:
            domain = domain_of(rcpt)
            hop = route_of(self.routes, domain)
            if hop is None:
                replies[rcpt] = f"451 4.3.5 no route to {domain} in {self.source}"
            else:
                groups.setdefault(hop, []).append(rcpt)
        for hop, rcpts in groups.items():
            part = attrs.evolve(envelope, recipients=tuple(rcpts))
            done = each_group(functools.partial(self._to_hop, hop, part, data), part)
            replies.update(done)
            if report is not None:
                report(done)
        return replies

    def _to_hop(self, hop: NextHop, part: MessageEnvelope, data: bytes) -> Replies:
        agent = self._hops.get(hop)
        if agent is None:
            agent = self._hops[hop] = SmtpAgent(hop.host, hop.port, tls=hop.tls, cafile=hop.cafile)
        return agent.deliver(part, data)

    def close(self) -> None:
        for agent in self._hops.values():
            agent.close()
        self._hops.clear()


def make(argument: str) -> RoutingAgent:
    if not argument:
        raise SpoolMisuse("give the transport map as routes:PATH")
    try:
        with open(argument, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpoolMisuse(f"cannot read the transport map {argument}: {e.strerror or e}") from None
    return RoutingAgent(parse_transport_map(text, argument), argument)
