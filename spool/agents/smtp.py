"""``smtp:HOST:PORT``: relay every message to one smarthost with ``smtplib``.

One connection per worker, reused across messages (``RSET`` between them) and opened again
when it breaks. Each recipient gets its own ``RCPT TO`` reply: 2xx goes on to DATA, 4xx is
deferred and 5xx failed with that reply. The reply to the data then settles every
recipient that was accepted: 2xx delivered, 4xx deferred, 5xx failed. A refused ``MAIL
FROM`` settles them all with its reply; a broken connection, a timeout or a refused
connection defers them all (451 4.4.1 / 4.4.2), as an MTA does.

Where the next hop offers PIPELINING (RFC 2920), ``MAIL``, every ``RCPT`` and ``DATA`` go
in one write and their replies are read in order, as Postfix's smtp(8) sends them: two
round trips a message (the commands, then the body) instead of three and one per
recipient, plus the ``RSET`` that probes a kept connection either way. A next hop that
does not offer it is asked one command at a time.

TLS, as Postfix's ``smtp_tls_security_level``, given after the port
(``smtp:HOST:PORT,tls=LEVEL[,cafile=PEM]``):

- ``may`` (the default): STARTTLS when the server offers it, its certificate not checked
  (opportunistic: an encrypted session beats a plain one even unauthenticated); a
  handshake that fails is logged and the next hop is used in plain text from then on.
- ``encrypt``: STARTTLS required, the certificate not checked; not offered or failed:
  every recipient deferred (``451 4.7.4`` / ``451 4.7.5``).
- ``verify``: as ``encrypt``, and the certificate must chain to the system's trusted
  authorities (or to ``cafile``) and name HOST.
- ``none``: never STARTTLS.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import smtplib
import socket
import ssl
from typing import Final, NoReturn

import attrs

from spool.addresses import ascii_form, needs_smtputf8
from spool.agents import Replies
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse

log = logging.getLogger("spool.smtp")
TIMEOUT: Final = 300.0  # seconds per command, as Postfix's smtp_data_done_timeout
CONNECT_TIMEOUT: Final = 30.0  # seconds for the TCP connect, as smtp_connect_timeout
TLS_LEVELS: Final = ("none", "may", "encrypt", "verify")


@attrs.frozen
class NextHop:
    """Where and how to relay: ``HOST:PORT[,tls=LEVEL][,cafile=PEM]``."""

    host: str
    port: int
    tls: str = "may"
    cafile: str | None = None


def parse_next_hop(text: str, usage: str = "smtp:HOST:PORT[,tls=LEVEL][,cafile=PEM]") -> NextHop:
    """The next hop ``text`` names (``HOST:PORT`` and its options), or ``SpoolMisuse``
    saying the shape ``usage``. ``cafile=`` takes the rest of the text (a path may hold
    commas), so it comes last."""
    head, sep, cafile = text.partition(",cafile=")
    target, *options = head.split(",")
    host, _, port_text = target.rpartition(":")
    port = port_number(port_text)
    if port is None or not _host_ok(host):
        raise SpoolMisuse(f"the next hop must be {usage}, not {text!r}")
    host = host.removeprefix("[").removesuffix("]")
    fields: dict[str, str] = {}
    for option in options:
        name, eq, value = option.partition("=")
        if not eq or name != "tls" or name in fields or not value:
            raise SpoolMisuse(f"{option!r} in {text!r}: the options are tls=LEVEL and cafile=PEM")
        fields[name] = value
    if sep and not cafile:
        raise SpoolMisuse(f"cafile= in {text!r} names no file")
    tls = fields.get("tls", "may")
    if tls not in TLS_LEVELS:
        raise SpoolMisuse(f"tls={tls} in {text!r}: use one of {', '.join(TLS_LEVELS)}")
    if sep and tls != "verify":
        raise SpoolMisuse(f"cafile in {text!r} is for tls=verify")
    return NextHop(host, port, tls, cafile or None)


_HOST_NAME: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def _host_ok(host: str) -> bool:
    """A host name, an IP address, or an IP address in brackets."""
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else None
    try:
        ipaddress.ip_address(host if inner is None else inner)
        return True
    except ValueError:
        return inner is None and _HOST_NAME.fullmatch(host) is not None


def port_number(text: str) -> int | None:
    """``text`` as a TCP port (1 to 65535, ASCII digits only), or None."""
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        return None
    return int(text)


def _as_sent(address: str) -> str:
    """``address`` for MAIL or RCPT: its domain in A-labels, its local part as it is (a
    non-ASCII one goes only where SMTPUTF8 is offered)."""
    return address if not address or needs_smtputf8(address) else ascii_form(address) or address


class _PlainFromNowOn(Exception):
    """``may``: the handshake failed; open a plain session instead."""


class TlsRefused(Exception):
    """The next hop's TLS policy was not met: the reply every recipient is deferred with."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.reply = reply


def _reply(code: int, text: bytes | str) -> str:
    """A next hop's reply as one line of text: its lines joined, control characters
    (a NUL among them) made spaces, at most 900 characters."""
    said = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    said = "".join(" " if c < " " or c == "\x7f" else c for c in said)
    return f"{code} {' '.join(said.split())}"[:900]


class SmtpAgent:
    session: type[smtplib.SMTP] = smtplib.SMTP  # smtplib.LMTP for the lmtp agent

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = TIMEOUT,
        *,
        tls: str = "may",
        cafile: str | None = None,
        address: str | None = None,
    ) -> None:
        """A next hop ``host``:``port``, connected to at ``address`` when given (an IP
        address found for ``host``: the name stays the one TLS verifies)."""
        if tls not in TLS_LEVELS:
            raise SpoolMisuse(f"tls={tls}: use one of {', '.join(TLS_LEVELS)}")
        self.host, self.port, self.timeout = host, port, timeout
        self.address = address
        self.tls = tls
        self._context = tls_context(tls, cafile)
        self._plain = tls == "none"  # "may" turns plain after a failed handshake
        self._smtp: smtplib.SMTP | None = None

    def _connect(self) -> smtplib.SMTP:
        """A new session, greeted (EHLO), not yet under TLS. The TCP connect may take
        ``CONNECT_TIMEOUT`` (Postfix's ``smtp_connect_timeout``), every reply ``timeout``:
        an exchanger that drops packets costs 30 s, not 300."""
        where = (self.address or self.host, self.port)
        sock = socket.create_connection(where, min(self.timeout, CONNECT_TIMEOUT))
        smtp = self.session(timeout=self.timeout)
        try:
            sock.settimeout(self.timeout)
            smtp.sock = sock  # as smtplib's connect() does, with a socket of ours
            # The name STARTTLS sends (SNI) and checks the certificate against.
            smtp._host = self.host  # type: ignore[attr-defined]
            code, text = smtp.getreply()  # the greeting
            if code != 220:
                raise smtplib.SMTPConnectError(code, text)
            smtp.ehlo_or_helo_if_needed()
        except BaseException:
            smtp.close()
            raise
        return smtp

    def _open(self) -> smtplib.SMTP:
        smtp = self._connect()
        try:
            if not self._plain:
                self._starttls(smtp)
        except _PlainFromNowOn:
            smtp.close()
            return self._connect()  # at once: this message need not wait for a retry
        except BaseException:
            smtp.close()
            raise
        return smtp

    def _starttls(self, smtp: smtplib.SMTP) -> None:
        """STARTTLS by this next hop's level, or ``TlsRefused``; under ``may``, nothing
        (not offered, or refused for now: the session goes on in plain text) or
        ``_PlainFromNowOn`` (the handshake failed: the session is unusable)."""
        where = f"{self.host}:{self.port}"
        if not smtp.has_extn("starttls"):
            if self.tls == "may":
                return
            raise TlsRefused(f"451 4.7.4 TLS is required, but was not offered by {where}")
        try:
            smtp.starttls(context=self._context)
        except smtplib.SMTPResponseException as e:
            # STARTTLS answered with an error (454 4.7.0 TLS not available: RFC 3207 makes
            # it temporary), the session still in plain text and usable.
            if self.tls == "may":
                return
            said = _reply(e.smtp_code, e.smtp_error)
            raise TlsRefused(f"451 4.7.4 {where} refused STARTTLS: {said}"[:900]) from e
        except (OSError, smtplib.SMTPException) as e:  # ssl.SSLError, a dropped connection
            self._handshake_failed(where, e)
        try:
            smtp.ehlo()  # under TLS 1.3 a refused handshake may show only here
        except (OSError, smtplib.SMTPException) as e:
            self._handshake_failed(where, e)

    def _handshake_failed(self, where: str, e: Exception) -> NoReturn:
        if self.tls == "may":
            # Opportunistic: a failed handshake is no reason to keep the mail; this next
            # hop is used in plain text for the rest of the worker's life.
            log.warning("%s: TLS handshake failed (%s): relaying in plain text", where, e)
            self._plain = True
            raise _PlainFromNowOn from e
        raise TlsRefused(f"451 4.7.5 TLS with {where} failed: {e}"[:900]) from e

    def _connection(self) -> smtplib.SMTP:
        if self._smtp is not None:
            code, _text = self._smtp.rset()
            if code == 250:
                return self._smtp
            self._drop()  # a 421 (the next hop's idle timeout): a new session
        self._smtp = self._open()
        return self._smtp

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        try:
            return self.transaction(envelope, data)
        except (TlsRefused, smtplib.SMTPException, OSError) as e:
            return dict.fromkeys(envelope.recipients, self.failure_reply(e))

    def _where(self) -> str:
        if self.host.startswith("/"):
            return self.host  # a Unix socket (lmtp:/path)
        host = self.host if self.address is None else f"{self.host}[{self.address}]"
        return f"{host}:{self.port}"

    def failure_reply(self, e: Exception) -> str:
        """The reply that defers the recipients of a transaction ``e`` ended (the
        connection dropped, so that the next transaction opens a new one)."""
        self._drop()
        if isinstance(e, TlsRefused):
            return e.reply
        # smtplib reports a reply that timed out as a lost connection: look beneath it.
        timed_out = any(isinstance(x, TimeoutError) for x in (e, e.__context__, e.__cause__))
        code = "451 4.4.2 timed out talking to" if timed_out else "451 4.4.1 cannot reach"
        return f"{code} {self._where()}: {e}"[:900]

    def transaction(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        """One SMTP transaction: each recipient's reply. Raises what ended the session
        (``TlsRefused``, ``smtplib.SMTPException``, ``OSError``) instead of replying for it:
        a caller with other next hops tries the next (``failure_reply`` otherwise)."""
        try:
            smtp = self._connection()
        except smtplib.SMTPServerDisconnected:
            self._drop()
            smtp = self._connection()
        text: bytes | str
        # Addresses as the next hop can take them (RFC 6531): domains in A-labels; a
        # non-ASCII local part only with SMTPUTF8, which it must offer.
        utf8 = smtp.has_extn("smtputf8")
        refused = f"553 5.6.7 SMTPUTF8 is required, but was not offered by {self._where()}"
        if needs_smtputf8(envelope.sender) and not utf8:
            return dict.fromkeys(envelope.recipients, refused)
        needed = bool(envelope.smtputf8_recipients)
        options = ["SMTPUTF8"] if needed and utf8 else []
        if smtp.has_extn("8bitmime") and not data.isascii():
            options.append("BODY=8BITMIME")  # RFC 6152
        replies = {r: refused for r in envelope.recipients if needs_smtputf8(r) and not utf8}
        asked = [r for r in envelope.recipients if r not in replies]
        if smtp.has_extn("pipelining"):
            replies.update(self._pipelined(smtp, envelope.sender, options, asked, data))
            return replies
        code, text = smtp.mail(_as_sent(envelope.sender), options)
        if code // 100 != 2:
            smtp.rset()
            return {r: _reply(code, text) for r in envelope.recipients}
        accepted = []
        for rcpt in asked:
            code, text = smtp.rcpt(_as_sent(rcpt))
            if code // 100 == 2:  # 250, 251, 252: accepted (as Postfix takes any 2xx)
                accepted.append(rcpt)
            else:
                replies[rcpt] = _reply(code, text)
        if not accepted:
            smtp.rset()
            return replies
        code, text = smtp.docmd("DATA")
        if code != 354:  # DATA itself refused
            smtp.rset()
            return replies | dict.fromkeys(accepted, _reply(code, text))
        _send_body(smtp, data)
        return replies | self._final_replies(smtp, accepted)

    def _pipelined(
        self, smtp: smtplib.SMTP, sender: str, options: list[str], asked: list[str], data: bytes
    ) -> dict[str, str]:
        """RFC 2920: ``MAIL``, a ``RCPT`` for each of ``asked`` and ``DATA`` in one write,
        their replies read in order; the body follows a 354 only if a recipient was
        accepted after an accepted ``MAIL``. Each of ``asked`` gets its reply."""
        params = "".join(" " + option for option in options)
        lines = [f"MAIL FROM:{smtplib.quoteaddr(_as_sent(sender))}{params}"]
        lines += [f"RCPT TO:{smtplib.quoteaddr(_as_sent(rcpt))}" for rcpt in asked]
        lines.append("DATA")
        encoding = "utf-8" if "SMTPUTF8" in options else "ascii"  # as smtplib.mail() does
        smtp.send("".join(line + "\r\n" for line in lines).encode(encoding))
        mail_code, mail_text = smtp.getreply()
        replies: dict[str, str] = {}
        accepted = []
        for rcpt in asked:
            code, text = smtp.getreply()
            if mail_code // 100 != 2:  # every RCPT after a refused MAIL is moot
                replies[rcpt] = _reply(mail_code, mail_text)
            elif code // 100 == 2:  # 250, 251, 252: accepted (as Postfix takes any 2xx)
                accepted.append(rcpt)
            else:
                replies[rcpt] = _reply(code, text)
        code, text = smtp.getreply()  # DATA's
        if code != 354:  # refused (503/554 with no recipient): nothing was sent
            return replies | dict.fromkeys(accepted, _reply(code, text))
        if not accepted:
            # A next hop that took DATA with nothing to deliver it to: an empty message,
            # ended at once and its reply disregarded (RFC 2920 section 3.1).
            smtp.send(b".\r\n")
            smtp.getreply()
            return replies
        _send_body(smtp, data)
        return replies | self._final_replies(smtp, accepted)

    def _final_replies(self, smtp: smtplib.SMTP, accepted: list[str]) -> dict[str, str]:
        """SMTP: the one reply to the data settles every accepted recipient."""
        code, text = smtp.getreply()
        return dict.fromkeys(accepted, _reply(code, text))

    def _drop(self) -> None:
        if self._smtp is not None:
            try:
                self._smtp.close()
            finally:
                self._smtp = None

    def close(self) -> None:
        if self._smtp is not None:
            with contextlib.suppress(smtplib.SMTPException, OSError):
                self._smtp.quit()
            self._drop()


_LINE_END: Final = re.compile(rb"\r\n|\n|\r(?!\n)")
_LEADING_DOT: Final = re.compile(rb"(?m)^\.")


def _send_body(smtp: smtplib.SMTP, data: bytes) -> None:
    """The message after a 354: lines ended CRLF, dot-stuffed (RFC 5321 4.5.2), and the
    ending dot, as ``smtplib.SMTP.data`` sends it."""
    body = _LEADING_DOT.sub(b"..", _LINE_END.sub(b"\r\n", data))
    if not body.endswith(b"\r\n"):
        body += b"\r\n"
    smtp.send(body + b".\r\n")


def tls_context(level: str, cafile: str | None) -> ssl.SSLContext | None:
    """The client context of a TLS level (None for ``none``); ``SpoolMisuse`` for a
    ``cafile`` that cannot be read."""
    if level == "none":
        return None
    if level == "verify":
        try:
            return ssl.create_default_context(cafile=cafile)
        except (OSError, ssl.SSLError) as e:
            raise SpoolMisuse(f"cannot read the certificates of cafile={cafile}: {e}") from None
    context = ssl.create_default_context()
    context.check_hostname = False  # "may" and "encrypt": encrypted, not authenticated
    context.verify_mode = ssl.CERT_NONE
    return context


def make(argument: str) -> SmtpAgent:
    hop = parse_next_hop(argument)
    return SmtpAgent(hop.host, hop.port, tls=hop.tls, cafile=hop.cafile)
