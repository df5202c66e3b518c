"""``smtp:HOST:PORT``: relay every message to one smarthost with ``smtplib``.

One connection per worker, reused across messages (``RSET`` between them) and opened again
when it breaks. Each recipient gets its own ``RCPT TO`` reply: 2xx goes on to DATA, 4xx is
deferred and 5xx failed with that reply. The reply to the data then settles every
recipient that was accepted: 2xx delivered, 4xx deferred, 5xx failed. A refused ``MAIL
FROM`` settles them all with its reply; a broken connection, a timeout or a refused
connection defers them all (451 4.4.1 / 4.4.2), as an MTA does.
"""

from __future__ import annotations

import contextlib
import smtplib
import socket
from typing import Final

from spool.agents import Replies
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse

TIMEOUT: Final = 300.0  # seconds per command, as Postfix's smtp_data_done_timeout


def _reply(code: int, text: bytes | str) -> str:
    said = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    return f"{code} {' '.join(said.split())}"[:900]


class SmtpAgent:
    def __init__(self, host: str, port: int, timeout: float = TIMEOUT) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._smtp: smtplib.SMTP | None = None

    def _open(self) -> smtplib.SMTP:
        smtp = smtplib.SMTP(self.host, self.port, timeout=self.timeout)
        smtp.ehlo_or_helo_if_needed()
        return smtp

    def _connection(self) -> smtplib.SMTP:
        if self._smtp is None:
            self._smtp = self._open()
        else:
            self._smtp.rset()
        return self._smtp

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        try:
            return self._transaction(envelope, data)
        except (smtplib.SMTPException, OSError) as e:
            self._drop()
            timed_out = isinstance(e, socket.timeout | TimeoutError)
            code = "451 4.4.2 timed out talking to" if timed_out else "451 4.4.1 cannot reach"
            return {r: f"{code} {self.host}:{self.port}: {e}"[:900] for r in envelope.recipients}

    def _transaction(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        try:
            smtp = self._connection()
        except smtplib.SMTPServerDisconnected:
            self._drop()
            smtp = self._connection()
        text: bytes | str
        code, text = smtp.mail(envelope.sender)
        if code != 250:
            smtp.rset()
            return {r: _reply(code, text) for r in envelope.recipients}
        replies: dict[str, str] = {}
        accepted = []
        for rcpt in envelope.recipients:
            code, text = smtp.rcpt(rcpt)
            if code in (250, 251):
                accepted.append(rcpt)
            else:
                replies[rcpt] = _reply(code, text)
        if not accepted:
            smtp.rset()
            return replies
        replies.update(self._data(smtp, data, accepted))
        return replies

    def _data(self, smtp: smtplib.SMTP, data: bytes, accepted: list[str]) -> dict[str, str]:
        """SMTP: the one reply to the data settles every accepted recipient."""
        text: bytes | str
        try:
            code, text = smtp.data(data)
        except smtplib.SMTPDataError as e:  # DATA itself refused (no 354)
            code, text = e.smtp_code, e.smtp_error
            smtp.rset()
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


def make(argument: str) -> SmtpAgent:
    host, _, port = argument.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpoolMisuse("give the smarthost as smtp:HOST:PORT")
    return SmtpAgent(host.strip("[]"), int(port))
