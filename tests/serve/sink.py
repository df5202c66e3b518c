"""A local SMTP/LMTP sink for the relay agents' tests, on aiosmtpd (a real server)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller, UnixSocketController
from aiosmtpd.lmtp import LMTP
from aiosmtpd.smtp import Envelope, Session


class Recorder:
    """Keeps every message; refuses RCPT for nouser* (550) and grey* (451), and greyonce*
    the first time it is asked for each (451)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[tuple[str, tuple[str, ...], bytes]] = []
        self.encrypted: list[bool] = []  # per message: whether its session was under TLS
        self.mail_options: list[list[str]] = []  # per message: its MAIL FROM parameters
        self.connections = 0
        self.greylisted: set[str] = set()

    async def handle_EHLO(
        self, server: Any, session: Session, envelope: Envelope, hostname: str, responses: Any
    ) -> Any:
        with self.lock:
            self.connections += 1
        session.host_name = hostname
        # aiosmtpd reads pipelined commands in order; offered as Postfix offers it, so the
        # agents' tests take the path they take in production (RFC 2920).
        return [*responses[:-1], "250-PIPELINING", responses[-1]]

    async def handle_RCPT(
        self, server: Any, session: Session, envelope: Envelope, address: str, options: Any
    ) -> str:
        local = address.split("@")[0]
        if local.startswith("greyonce"):  # greylisting as it is met: once, then accepted
            with self.lock:
                first = address not in self.greylisted
                self.greylisted.add(address)
            if first:
                return "451 4.7.1 greylisted, try again later"
        elif local.startswith("nouser"):
            return "550 5.1.1 no such user"
        elif local.startswith("grey"):
            return "451 4.7.1 greylisted"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 ok"

    async def handle_DATA(self, server: Any, session: Session, envelope: Envelope) -> str:
        content = envelope.original_content or b""
        with self.lock:
            self.received.append((envelope.mail_from, tuple(envelope.rcpt_tos), content))
            self.encrypted.append(session.ssl is not None)
            self.mail_options.append(list(envelope.mail_options))
        return "250 2.0.0 queued"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_sink(
    tls: ssl.SSLContext | None = None, *, utf8: bool = False
) -> tuple[Controller, Recorder, int]:
    """A running sink, its recorder and its port; ``controller.stop()`` when done. With
    ``tls``, the sink offers STARTTLS with that context; with ``utf8``, SMTPUTF8."""
    recorder = Recorder()
    port = free_port()
    controller = Controller(
        recorder, hostname="127.0.0.1", port=port, tls_context=tls, enable_SMTPUTF8=utf8
    )
    controller.start()
    return controller, recorder, port


def self_signed(directory: Path, name: str = "mx.test") -> tuple[str, str]:
    """A self-signed certificate for ``name``, localhost and 127.0.0.1 (all three in its
    subjectAltName, which a host name is checked against), and its key (made with the
    ``openssl`` command): the certificate's path, the key's."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = str(directory / f"{name}.cert.pem"), str(directory / f"{name}.key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name},DNS:localhost,IP:127.0.0.1",
         "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def server_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


class LmtpRecorder(Recorder):
    """An LMTP store: after the data, one reply per accepted recipient (full*: 452,
    gone*: 550, others 250), as RFC 2033 asks."""

    async def handle_DATA(self, server: Any, session: Session, envelope: Envelope) -> str:
        await super().handle_DATA(server, session, envelope)
        replies = []
        for rcpt in envelope.rcpt_tos:
            local = rcpt.split("@")[0]
            if local.startswith("full"):
                replies.append("452 4.2.2 mailbox full")
            elif local.startswith("gone"):
                replies.append("550 5.1.1 mailbox gone")
            else:
                replies.append(f"250 2.0.0 <{rcpt}> delivered")
        return "\r\n".join(replies)


class LmtpController(Controller):
    def factory(self) -> LMTP:
        return LMTP(self.handler)


class UnixLmtpController(UnixSocketController):
    def factory(self) -> LMTP:
        return LMTP(self.handler)


def start_lmtp_sink(unix_path: str | None = None) -> tuple[Controller, LmtpRecorder, int]:
    """A running LMTP store (TCP, or a Unix socket at ``unix_path``), its recorder and port."""
    recorder = LmtpRecorder()
    controller: Any
    if unix_path is not None:
        controller = UnixLmtpController(recorder, unix_socket=unix_path)
        port = 0
    else:
        port = free_port()
        controller = LmtpController(recorder, hostname="127.0.0.1", port=port)
    controller.start()
    return controller, recorder, port
