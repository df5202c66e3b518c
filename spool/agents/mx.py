"""``mx[:OPTIONS]``: relay each recipient to its own domain's mail exchangers, found in DNS.

What an MTA on the internet does (RFC 5321 section 5.1), with ``dnspython`` for the
lookups (never a hand-written resolver; ``pip install 'mailspool[mx]'``). Off unless this
agent is chosen: a smarthost (``smtp:``) or a transport map (``routes:``) needs no DNS.

- A message's recipients are grouped by domain (in A-labels); each group is one SMTP
  transaction through ``SmtpAgent`` (``smtp.py``: per-recipient replies, STARTTLS by the
  ``tls`` level), over a connection per mail exchanger address that the worker keeps.
- The domain's MX records, lowest preference first (records of equal preference in
  random order, to spread the load); no MX record: the domain itself (the implicit MX).
  Each exchanger's addresses (A, then AAAA), at most ``ADDRESS_LIMIT`` in all (Postfix's
  ``smtp_mx_address_limit``). An address that cannot be reached, times out, drops the
  session or fails the TLS level is left for the next; the last one's reason defers the
  group when none is left.
- An address literal (``x@[192.0.2.1]``, ``x@[IPv6:2001:db8::1]``) is its own exchanger.
- Mail never loops back to this relay (Postfix's "loops back to myself"): under ``spool
  serve --smtp``, an exchanger address on which the owner listens at this agent's port
  (or any address of this host, for a wildcard listener) is this relay. Exchangers of
  its preference or higher are dropped (this relay is a backup MX: only better ones are
  tried), and when none is left the recipients fail ``554 5.4.6``.
- Each domain is its own group: an error in one (an agent failure, a timeout) defers that
  group only, never the groups already sent (``each_group``).
- Replies of the domain's own making: a domain that does not exist (NXDOMAIN) fails
  ``550 5.1.2``; a null MX (RFC 7505) fails ``556 5.1.10``; exchangers without an
  address fail ``550 5.4.4``; a lookup that fails for now (SERVFAIL, a timeout) defers
  ``451 4.4.3``; all the lookups of one domain take at most ``DOMAIN_BUDGET`` seconds.

Options, comma-separated after ``mx:``: ``port=N`` (25), ``tls=LEVEL`` and
``cafile=PEM`` (as the ``smtp`` agent), ``nameserver=IP[:PORT]`` (the system's resolvers
by default).
"""

from __future__ import annotations

import functools
import ipaddress
import random
import smtplib
import socket
import time
from collections.abc import Sequence
from typing import Final

import attrs

from spool.addresses import domain_of
from spool.agents import Replies, Report, each_group, own_listeners
from spool.agents.smtp import TLS_LEVELS, SmtpAgent, TlsRefused, port_number, tls_context
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse

try:
    import dns.exception
    import dns.resolver
except ImportError:  # the [mx] extra is not installed: ``make`` says so
    dns = None  # type: ignore[assignment]

ADDRESS_LIMIT: Final = 5  # exchanger addresses tried per delivery, as Postfix
LIFETIME: Final = 30.0  # seconds a lookup may take, all its nameservers and retries
DOMAIN_BUDGET: Final = 60.0  # seconds all the lookups of one domain may take together
USAGE: Final = "mx[:port=N][,tls=LEVEL][,cafile=PEM][,nameserver=IP[:PORT]]"


@attrs.frozen
class Exchanger:
    """One address to try: the exchanger's name (for TLS) and an address of it."""

    name: str
    address: str


class MxAgent:
    """Recipients grouped by domain; each group to its domain's exchangers in order."""

    def __init__(
        self,
        port: int = 25,
        *,
        tls: str = "may",
        cafile: str | None = None,
        nameserver: tuple[str, int] | None = None,
        myself: Sequence[tuple[str, int]] = (),
    ) -> None:
        """``myself``: the (host, port) of this relay's own SMTP listeners (``spool
        serve`` passes the owner's): exchangers there are never connected to."""
        self.port, self.tls, self.cafile = port, tls, cafile
        self.myself = _hosts_at(myself, port)
        try:
            resolver = dns.resolver.Resolver(configure=nameserver is None)
        except dns.resolver.NoResolverConfiguration:
            raise SpoolMisuse(
                "the system names no DNS resolver (/etc/resolv.conf): give one with "
                "mx:nameserver=IP[:PORT]"
            ) from None
        if nameserver is not None:
            resolver.nameservers = [nameserver[0]]
            resolver.port = nameserver[1]
        resolver.lifetime = LIFETIME
        resolver.cache = dns.resolver.Cache()  # the records' own TTLs, per worker
        self.resolver = resolver
        self._agents: dict[Exchanger, SmtpAgent] = {}

    reports_groups = True  # each domain's replies reported as it is done (spool.agents)

    def deliver(
        self, envelope: MessageEnvelope, data: bytes, report: Report | None = None
    ) -> Replies:
        groups: dict[str, list[str]] = {}
        for rcpt in envelope.recipients:
            groups.setdefault(domain_of(rcpt), []).append(rcpt)
        replies: dict[str, str] = {}
        for domain, rcpts in groups.items():
            part = attrs.evolve(envelope, recipients=tuple(rcpts))
            send = functools.partial(self._to_domain, domain, part, data)
            done = each_group(send, part)
            replies.update(done)
            if report is not None:
                report(done)
        return replies

    def _to_domain(self, domain: str, part: MessageEnvelope, data: bytes) -> Replies:
        found = self.exchangers(domain)
        if isinstance(found, str):
            return dict.fromkeys(part.recipients, found)
        reply = ""
        for exchanger in found:
            agent = self._agents.get(exchanger)
            if agent is None:
                agent = self._agents[exchanger] = SmtpAgent(
                    exchanger.name,
                    self.port,
                    tls=self.tls,
                    cafile=self.cafile,
                    address=exchanger.address,
                )
            try:
                return agent.transaction(part, data)
            except (TlsRefused, smtplib.SMTPException, OSError) as e:
                reply = agent.failure_reply(e)  # and on to the next exchanger
        return dict.fromkeys(part.recipients, reply)

    def exchangers(self, domain: str) -> list[Exchanger] | str:
        """The addresses to try for ``domain``, in order, or the reply that settles its
        recipients without a connection. All its lookups together take at most
        ``DOMAIN_BUDGET`` seconds."""
        if domain.startswith("["):
            literal = _literal(domain)
            if not isinstance(literal, str) and self.is_myself(literal[0].address):
                return f"554 5.4.6 mail for {domain} loops back to myself"
            return literal
        deadline = time.monotonic() + DOMAIN_BUDGET
        try:
            answer = self._resolve(domain, "MX", deadline)
            records = [(r.preference, r.exchange.to_text(omit_final_dot=True)) for r in answer]
        except dns.resolver.NXDOMAIN:
            return f"550 5.1.2 {domain}: no such domain (DNS says NXDOMAIN)"
        except dns.resolver.NoAnswer:
            records = [(0, domain)]  # no MX: the domain is its own exchanger
        except dns.exception.DNSException as e:
            return f"451 4.4.3 DNS lookup of {domain} MX failed: {_said(e)}"
        if any(name in ("", ".") for _, name in records):
            return f"556 5.1.10 {domain} accepts no mail (null MX, RFC 7505)"
        random.shuffle(records)  # then sorted by preference: ties in random order
        records.sort(key=lambda r: r[0])
        found: list[Exchanger] = []
        preferences: list[int] = []  # of each address in ``found``
        failed: str | None = None  # why a lookup failed for now, if one did
        for preference, name in records:
            for rdtype in ("A", "AAAA"):
                if time.monotonic() >= deadline:
                    failed = failed or "timed out"
                    break
                try:
                    addresses = self._resolve(name, rdtype, deadline)
                except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                    continue
                except dns.exception.DNSException as e:
                    failed = _said(e)
                    continue
                found += [Exchanger(name, r.address) for r in addresses]
            preferences += [preference] * (len(found) - len(preferences))
            if len(found) >= ADDRESS_LIMIT:
                break
        mine = [p for p, e in zip(preferences, found, strict=True) if self.is_myself(e.address)]
        if mine:
            # This relay is one of the domain's exchangers: only better ones may take the
            # mail from it (RFC 5321 5.1), and if there are none it would come back here.
            found = [e for p, e in zip(preferences, found, strict=True) if p < min(mine)]
            if not found:
                return f"554 5.4.6 mail for {domain} loops back to myself"
        if found:
            unique = {e.address: e for e in reversed(found)}  # an address under two names
            return [e for e in found if unique[e.address] is e][:ADDRESS_LIMIT]
        if failed is not None:
            return f"451 4.4.3 DNS lookup of the exchangers of {domain} failed: {failed}"
        return f"550 5.4.4 {domain}: no address for its mail exchangers"

    def is_myself(self, address: str) -> bool:
        """Whether ``address`` (at this agent's port) is one of this relay's listeners."""
        try:
            normal = str(ipaddress.ip_address(address))
        except ValueError:
            return False
        return normal in self.myself or ("*" in self.myself and _local_address(normal))

    def _resolve(self, name: str, rdtype: str, deadline: float) -> dns.resolver.Answer:
        """One lookup, within what is left of the domain's budget."""
        left = max(0.1, min(LIFETIME, deadline - time.monotonic()))
        return self.resolver.resolve(name, rdtype, lifetime=left)

    def close(self) -> None:
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()


WILDCARDS: Final = ("", "0.0.0.0", "::")


def _hosts_at(listeners: Sequence[tuple[str, int]], port: int) -> frozenset[str]:
    """The addresses of the listeners on ``port`` ("*" for a wildcard one); a listener
    given by name counts with each address the name has now."""
    hosts: set[str] = set()
    for host, at in listeners:
        if at != port:
            continue
        if host in WILDCARDS:
            hosts.add("*")
            continue
        try:
            hosts.add(str(ipaddress.ip_address(host)))
        except ValueError:  # a name ("localhost"): its addresses
            try:
                infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
            except OSError:
                continue
            hosts.update(str(ipaddress.ip_address(info[4][0])) for info in infos)
    return frozenset(hosts)


@functools.lru_cache(maxsize=256)
def _local_address(address: str) -> bool:
    """Whether ``address`` is one of this host's: only those can be bound to."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def _literal(domain: str) -> list[Exchanger] | str:
    """An address literal (RFC 5321 4.1.3): that address is the exchanger."""
    inner = domain[1:-1] if domain.endswith("]") else ""
    inner = inner[5:] if inner.lower().startswith("ipv6:") else inner
    try:
        address = str(ipaddress.ip_address(inner))
    except ValueError:
        return f"550 5.1.2 {domain}: not an address literal this agent can reach"
    return [Exchanger(address, address)]


def _said(e: Exception) -> str:
    """A DNS failure in a few words (dnspython's texts list every server and try)."""
    if isinstance(e, dns.exception.Timeout):
        return "timed out"
    if isinstance(e, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or refused)"
    return str(e)[:200]


def make(argument: str) -> MxAgent:
    if dns is None:
        raise SpoolMisuse("the mx agent needs dnspython: pip install 'mailspool[mx]'")
    fields: dict[str, str] = {}
    # cafile= takes the rest of the text (a path may hold commas), so it comes last.
    head, sep, cafile = ("," + argument).partition(",cafile=")
    if sep:
        fields["cafile"] = cafile
    for option in head[1:].split(",") if head[1:] else []:
        name, eq, value = option.partition("=")
        if not eq or name not in ("port", "tls", "nameserver") or name in fields or not value:
            raise SpoolMisuse(f"{option!r}: give the agent as {USAGE}")
        fields[name] = value
    port = _port(fields.get("port", "25"), "port")
    tls = fields.get("tls", "may")
    if tls not in TLS_LEVELS:
        raise SpoolMisuse(f"tls={tls}: use one of {', '.join(TLS_LEVELS)}")
    if "cafile" in fields and tls != "verify":
        raise SpoolMisuse("cafile is for tls=verify")
    nameserver = _nameserver(fields["nameserver"]) if "nameserver" in fields else None
    tls_context(tls, fields.get("cafile"))  # a cafile that cannot be read: refused now
    return MxAgent(
        port,
        tls=tls,
        cafile=fields.get("cafile"),
        nameserver=nameserver,
        myself=own_listeners(),
    )


def _nameserver(text: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT``, ``[IPv6]`` or ``[IPv6]:PORT``; port 53 when none is given."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else "53" if not rest else "x"
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, "53"  # an IPv4 address, or an IPv6 one without brackets
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise SpoolMisuse(f"nameserver={text}: give an IP address[:PORT]") from None
    return host, _port(port, "the nameserver's port")


def _port(text: str, what: str) -> int:
    port = port_number(text)
    if port is None:
        raise SpoolMisuse(f"{what} must be 1 to 65535, not {text!r}")
    return port
