"""``lmtp:HOST:PORT`` or ``lmtp:/path/to/socket``: hand mail to a local store over LMTP.

LMTP (RFC 2033) is SMTP with ``LHLO`` for ``EHLO`` and, after the data, **one reply per
accepted recipient**, in RCPT order: so each recipient is settled by its own mailbox's
answer (2xx delivered, 4xx deferred, 5xx failed), not by one reply for all. The rest is as
the ``smtp`` agent: one connection per delivery loop, reused; per-recipient RCPT replies;
a broken or refused connection or a timeout defers every recipient.
"""

from __future__ import annotations

import smtplib

from spool.agents.smtp import TIMEOUT, SmtpAgent, _reply, port_number
from spool.errors import SpoolMisuse


class LmtpAgent(SmtpAgent):
    session = smtplib.LMTP  # LHLO for EHLO

    def _open(self) -> smtplib.SMTP:
        if not self.host.startswith("/"):
            return self._connect()  # TCP: the smtp agent's connect timeout; no STARTTLS
        lmtp = smtplib.LMTP(self.host, self.port, timeout=self.timeout)  # a Unix socket
        code, text = lmtp.ehlo()  # smtplib's LMTP sends LHLO here
        if code != 250:
            lmtp.close()
            raise smtplib.SMTPHeloError(code, text)
        return lmtp

    def _final_replies(self, smtp: smtplib.SMTP, accepted: list[str]) -> dict[str, str]:
        """LMTP: each accepted recipient settled by its own reply to the data."""
        replies: dict[str, str] = {}
        for rcpt in accepted:  # one reply per accepted recipient, in RCPT order
            try:
                code, text = smtp.getreply()
            except (OSError, smtplib.SMTPException) as e:
                # Cut short: each reply already read stands (a 250 is a delivery); the
                # recipients still waiting for theirs are deferred, the session dropped.
                left = self.failure_reply(e)
                replies.update((r, left) for r in accepted if r not in replies)
                return replies
            replies[rcpt] = _reply(code, text)
        return replies


def make(argument: str) -> LmtpAgent:
    if argument.startswith("/"):
        return LmtpAgent(argument, 0, TIMEOUT)  # a Unix socket (smtplib.LMTP's convention)
    host, _, port_text = argument.rpartition(":")
    port = port_number(port_text)
    if not host.strip("[]") or port is None:
        raise SpoolMisuse("give the LMTP server as lmtp:HOST:PORT or lmtp:/path/to/socket")
    return LmtpAgent(host.strip("[]"), port, TIMEOUT)
