"""SMTP in: ``spool serve DIR --smtp HOST:PORT`` accepts mail over SMTP into the spool.

The SMTP protocol is aiosmtpd's (never hand-written); this module is the policy around it,
as Postfix's smtpd(8) restrictions are around its protocol engine:

- **250 only once durable.** DATA is answered after ``await AsyncSpool.accept`` returned:
  the message's records are fsynced (concurrent sessions share the group commit).
- **Relay control.** Clients in ``mynetworks`` (loopback by default) may send to any
  domain; others only to ``relay_domains`` (none by default): ``554 5.7.1 ... Relay access
  denied`` at RCPT, so the spool is never an open relay.
- **Limits, announced and enforced.** ``SIZE`` is the spool's ``max_message_size`` less
  the most the ``Received:`` header can take (``received_room``): a larger ``MAIL FROM ...
  SIZE=`` or DATA gets ``552 5.3.4``; recipients past ``max_recipients`` get ``452
  4.5.3`` (the client sends the rest in another transaction, RFC 5321 4.5.3.1.10). A
  recipient given twice is taken once.
- **Addresses** are the spool's own rules (``addresses.py``): ``501 5.1.7`` for a bad
  sender, ``501 5.1.3`` for a bad recipient; ``MAIL FROM:<>`` is the null sender.
- **The spool's errors** as an MTA answers them: ``DiskFull`` ``452 4.3.1`` (try later),
  a refused message ``554 5.6.0``, a failed or closing spool ``451 4.3.0``.
- A ``Received:`` header (RFC 5321 4.4) is prepended to every message; one with
  ``HOPCOUNT_LIMIT`` of them already is a loop (``554 5.4.6``); bare LFs are stored as
  CRLF. An untrusted client may not use source routing in a local part (``%``, ``!``).
- **A stop says 421** (RFC 5321 3.8) to every session, to one in DATA once it is answered.

PIPELINING, 8BITMIME and SMTPUTF8 are offered (the spool takes UTF-8 addresses), and
STARTTLS with a certificate (``--tls-cert``/``--tls-key``), never required.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import ipaddress
import logging
import re
import socket
import ssl
import time
from collections.abc import Iterable, Sequence
from typing import Any, AnyStr, Final, Protocol

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session, syntax

from spool.addresses import check_mailbox, check_sender, domain_of, mailbox_key
from spool.async_spool import AsyncSpool
from spool.dsn import header_section
from spool.errors import (
    CannotListen,
    DiskFull,
    InvalidAddress,
    InvalidMessage,
    MessageTooLarge,
    OwnerUnreachable,
    SpoolClosed,
    SpoolFailed,
)
from spool.smtp_tally import SmtpTally

log = logging.getLogger("spool.smtp")

# The Received: header's variable parts are bounded: the HELO name as written there is cut
# to HELO_MAX characters, an address is at most 256 octets (RFC 5321 4.5.3.1.3), an IP
# literal and a date are short. Room for the rest, its fixed words included:
HELO_MAX: Final = 255
RECEIVED_FIXED: Final = 512
LOOPBACK: Final = ("127.0.0.0/8", "::1/128")


def received_room(hostname: str) -> int:
    """The most bytes the ``Received:`` header can take with this host name: what the
    announced SIZE leaves under the spool's ``max_message_size``."""
    return RECEIVED_FIXED + HELO_MAX + len(hostname.encode("utf-8"))


def size_limit(max_message_size: int, hostname: str) -> int:
    """The SIZE announced and enforced: the spool's limit less the ``Received:`` header's."""
    return max(1, max_message_size - received_room(hostname))


TOO_BIG: Final = "552 5.3.4 Message size exceeds fixed limit"
# aiosmtpd's own replies for a message over SIZE, given the enhanced status codes of RFC
# 3463 as every MTA gives them (its hooks are not called for these).
_ENHANCED: Final = {
    "552 Error: message size exceeds fixed maximum message size": TOO_BIG,
    "552 Error: Too much mail data": TOO_BIG,
    "500 Line too long (see RFC5321 4.5.3.1.6)": (
        "500 5.6.0 Line too long: at most 998 octets a line (RFC 5321 4.5.3.1.6)"
    ),
}


HOPCOUNT_LIMIT: Final = 50  # Received: fields before a message is taken for a loop (Postfix)
ROUTING: Final = "%!@"  # characters of source routing in a local part (quoted "@" too)
_RECEIVED: Final = re.compile(rb"(?im)^received:")
_BARE_LF: Final = re.compile(rb"(?<!\r)\n")

SHUTTING_DOWN: Final = b"421 4.3.2 Service shutting down, closing transmission channel\r\n"
STOP_GRACE: Final = 5.0  # seconds a stop waits for transactions in DATA to be answered


class SmtpSession(SMTP):
    """aiosmtpd's SMTP with enhanced status codes on the replies it makes itself, known
    to its front end while connected, so that a stop can say 421 (``SmtpFrontEnd.stop``)."""

    in_data = False  # from DATA until its reply is written: a stop waits for it

    async def push(self, status: AnyStr) -> None:
        if isinstance(status, str):
            status = _ENHANCED.get(status, status)
        await super().push(status)

    counted = False  # whether this connection is in the tally (STARTTLS comes here again)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.event_handler.sessions.add(self)  # (again after STARTTLS: the same session)
        if not self.counted:
            self.counted = True
            self.event_handler.tally.connection()

    def connection_lost(self, error: Exception | None) -> None:
        self.event_handler.sessions.discard(self)
        super().connection_lost(error)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        self.in_data = True
        try:
            await super().smtp_DATA(arg)
        finally:
            self.in_data = False

    def shut(self) -> None:
        """Say 421 and close (RFC 5321 3.8: a server shutting down answers so)."""
        if self.transport is not None:
            self.transport.write(SHUTTING_DOWN)  # type: ignore[attr-defined]
            self.transport.close()


async def shut_sessions(sessions: set[SmtpSession], deadline: float) -> None:
    """Say 421 to this loop's sessions: at once to those between transactions, and to one
    in DATA once its reply is written (its message may be durable already: cutting it
    before the 250 would have it sent twice), or at ``deadline`` (time.monotonic())."""
    loop = asyncio.get_running_loop()
    while True:
        mine = [s for s in sessions if s.loop is loop]
        for session in mine:
            if not session.in_data or time.monotonic() >= deadline:
                session.shut()
                sessions.discard(session)
        if not any(s.loop is loop for s in sessions):
            return
        await asyncio.sleep(0.02)


class Accepting(Protocol):
    """What takes the messages: ``AsyncSpool`` in the owner's process, ``AsyncClient``
    in an SMTP front-end process of its own (``smtp_process.py``)."""

    async def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str: ...


class SpoolHandler:
    """The aiosmtpd handler: relay control, limits, and the durable accept."""

    def __init__(
        self,
        spool: Accepting,
        *,
        hostname: str,
        max_recipients: int,
        mynetworks: Sequence[str] = LOOPBACK,
        relay_domains: Iterable[str] = (),
    ) -> None:
        self.spool = spool
        self.hostname = hostname
        self.sessions: set[SmtpSession] = set()  # connected, on any listener's loop
        self.mynetworks = [ipaddress.ip_network(n, strict=False) for n in mynetworks]
        # Compared as domain_of() gives a recipient's domain: A-labels, lower case.
        self.relay_domains = {domain_of("postmaster@" + d.rstrip(".")) for d in relay_domains}
        self.max_recipients = max_recipients
        self.tally = SmtpTally()  # for --metrics and status (smtp_tally.py)

    def trusted(self, peer: Any) -> bool:
        """Whether the client's address is in ``mynetworks`` (a Unix socket peer is local)."""
        if not isinstance(peer, tuple):
            return True
        try:
            address = ipaddress.ip_address(peer[0].split("%")[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.mynetworks)

    async def handle_EHLO(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]:
        session.host_name = hostname
        # aiosmtpd reads pipelined commands in order; say so (RFC 2920).
        return [*responses[:-1], "250-PIPELINING", responses[-1]]

    async def handle_MAIL(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str:
        reply = self._mail(envelope, address, mail_options)
        self.tally.reply("mail", reply)
        return reply

    def _mail(self, envelope: Envelope, address: str, mail_options: list[str]) -> str:
        sender = "" if address == "<>" else address
        try:
            check_sender(sender)
        except InvalidAddress as e:
            return f"501 5.1.7 Bad sender address syntax ({e.reason})"
        envelope.mail_from = address  # "<>" for the null sender: aiosmtpd needs it non-empty
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 Ok"

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        reply = self._rcpt(session, envelope, address, rcpt_options)
        self.tally.reply("rcpt", reply)
        return reply

    def _rcpt(
        self, session: Session, envelope: Envelope, address: str, rcpt_options: list[str]
    ) -> str:
        try:
            check_mailbox(address)
        except InvalidAddress as e:
            return f"501 5.1.3 Bad recipient address syntax ({e.reason})"
        trusted = self.trusted(session.peer)
        if not trusted and domain_of(address) not in self.relay_domains:
            return f"554 5.7.1 <{address}>: Relay access denied"
        if not trusted and any(c in address.rpartition("@")[0] for c in ROUTING):
            # u%other@ours or other!u@ours: a next hop that honours the old routing
            # syntax would relay on (Postfix's allow_untrusted_routing = no).
            return f"554 5.7.1 <{address}>: Relay access denied"
        key = mailbox_key(address)
        if any(mailbox_key(r) == key for r in envelope.rcpt_tos):
            return "250 2.1.5 Ok"  # taken once, as every MTA does
        if len(envelope.rcpt_tos) >= self.max_recipients:
            return "452 4.5.3 Too many recipients"
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        reply = await self._data(session, envelope)
        self.tally.reply("data", reply)
        return reply

    async def _data(self, session: Session, envelope: Envelope) -> str:
        content = envelope.original_content or b""
        if hops(content) >= HOPCOUNT_LIMIT:
            # A loop (two relays sending to each other, or to themselves): refused before
            # it is stored, as RFC 5321 6.3 asks and Postfix's hopcount_limit does.
            return "554 5.4.6 Too many hops: mail forwarding loop"
        if content.count(b"\n") != content.count(b"\r\n"):  # a copy only when one is bare
            content = _BARE_LF.sub(b"\r\n", content)  # lines as SMTP sends them (RFC 5321 2.3.8)
        data = self.received(session, envelope) + content
        try:
            sender = "" if envelope.mail_from == "<>" else (envelope.mail_from or "")
            msg_id = await self.spool.accept(sender, envelope.rcpt_tos, data)
        except DiskFull:
            return "452 4.3.1 Insufficient system storage"
        except MessageTooLarge:
            return TOO_BIG
        except InvalidMessage as e:
            return f"554 5.6.0 Message refused: {e}"
        except (SpoolFailed, SpoolClosed, OwnerUnreachable) as e:
            log.error("accept failed: %s", e)
            return "451 4.3.0 Local error in processing, try again later"
        self.tally.accepted(len(data))
        return f"250 2.0.0 Ok: queued as {msg_id}"

    def received(self, session: Session, envelope: Envelope) -> bytes:
        """The ``Received:`` header for this message (RFC 5321 4.4), folded."""
        peer = session.peer
        ip = peer[0] if isinstance(peer, tuple) else "local"
        helo = (session.host_name or "unknown")[:HELO_MAX]
        protocol = "ESMTP" if session.extended_smtp else "SMTP"
        if envelope.smtp_utf8:
            protocol = "UTF8SMTP"
        if session.ssl is not None:
            protocol += "S"  # RFC 3848: ESMTPS, UTF8SMTPS
        rcpt = envelope.rcpt_tos[0] if len(envelope.rcpt_tos) == 1 else None
        lines = [
            f"Received: from {helo} ([{ip}])",
            f"\tby {self.hostname} (spool) with {protocol}",
            *([f"\tfor <{rcpt}>"] if rcpt else []),
        ]
        lines[-1] += f"; {email.utils.formatdate(localtime=True)}"
        return ("\r\n".join(lines) + "\r\n").encode("utf-8")


def hops(message: bytes) -> int:
    """The ``Received:`` fields in the header section of ``message`` (each MTA adds one)."""
    return len(_RECEIVED.findall(header_section(message)))


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The server side of STARTTLS from a PEM certificate (chain) and its key; ``OSError``
    or ``ssl.SSLError`` if they cannot be read or do not match."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:25`` for IPv6) as (host, port); ValueError if it is not."""
    host, _, port = text.rpartition(":")
    if not host.strip("[]") or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"give the SMTP address as HOST:PORT, not {text!r}")
    return host.strip("[]"), int(port)


class SmtpFrontEnd:
    """aiosmtpd listeners on one event loop thread, accepting into ``spool``."""

    def __init__(
        self,
        spool: AsyncSpool,
        listeners: Sequence[tuple[str, int]],
        *,
        hostname: str | None = None,
        mynetworks: Sequence[str] = LOOPBACK,
        relay_domains: Iterable[str] = (),
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.hostname = hostname or socket.getfqdn()
        self.handler = SpoolHandler(
            spool,
            hostname=self.hostname,
            max_recipients=spool.spool.options.max_recipients,
            mynetworks=mynetworks,
            relay_domains=relay_domains,
        )
        self.size_limit = size_limit(spool.spool.options.max_message_size, self.hostname)
        size = self.size_limit
        self.controllers = [
            _Controller(
                self.handler,
                hostname=host,
                port=port,
                server_hostname=self.hostname,
                data_size_limit=size,
                enable_SMTPUTF8=True,
                tls_context=tls,  # STARTTLS offered when given (never required: port 25 rules)
            )
            for host, port in listeners
        ]

    def start(self) -> None:
        """Bind every listener (``CannotListen`` if one cannot be: nothing is left
        listening)."""
        # aiosmtpd logs every command at INFO ("mail.log"), addresses included: the owner's
        # log keeps its own lines (the delivery log names each accepted message).
        logging.getLogger("mail.log").setLevel(logging.WARNING)
        started: list[_Controller] = []
        try:
            for c in self.controllers:
                try:
                    c.start()
                except OSError as e:
                    raise CannotListen("--smtp", c.hostname, c.port, e) from None
                started.append(c)
                log.info("smtp on %s:%d", c.hostname, c.port)
        except BaseException:
            for c in started:
                c.stop()
            raise

    def stop(self) -> None:
        """Stop listening, say 421 to every session (one in DATA once it is answered, up
        to ``STOP_GRACE``), then stop the listeners' loops."""
        deadline = time.monotonic() + STOP_GRACE
        running = [c for c in self.controllers if c.server is not None]
        for c in running:
            assert c.server is not None
            c.loop.call_soon_threadsafe(c.server.close)  # no new connections
        for c in running:
            told = asyncio.run_coroutine_threadsafe(
                shut_sessions(self.handler.sessions, deadline), c.loop
            )
            with contextlib.suppress(Exception):  # a loop already gone: nothing to tell
                told.result(STOP_GRACE + 1)
        for c in self.controllers:
            c.stop()


class _Controller(Controller):
    """aiosmtpd's Controller building this module's ``SmtpSession``."""

    checked = False  # whether the Controller's own check that it is up was made

    def factory(self) -> SMTP:
        session = SmtpSession(self.handler, **self.SMTP_kwargs)
        if not self.checked:
            # ``start`` connects once to see the server up (aiosmtpd's _trigger_server):
            # the first session of each listener is that, not a client, and not counted.
            self.checked = True
            session.counted = True
        return session
