"""SMTP front-end processes: ``spool serve --smtp HOST:PORT --smtp-processes N``.

In the owner's process, the SMTP front end shares one interpreter lock with everything the
owner does, and under SMTP load it is most of the owner's time (docs/performance.md: 73%
of it, parsing commands and addresses and creating each connection's session). With
``--smtp-processes N`` the owner binds each listener itself and hands the listening
sockets to N processes of this module (``SmtpProcesses``, supervised as the workers
are). Each runs aiosmtpd on its own event loop with the owner's policy
(``smtp_in.SpoolHandler``: relay control, limits, ``Received:``) and accepts every
message through the control socket (``AsyncClient.accept``): the 250 still comes only
once the owner's accept returned, durable. The kernel hands each new connection to one
of the processes waiting on the shared socket.

A process exits on SIGTERM (the owner's stop: 421 to each session, to one in DATA once
it is answered, within ``STOP_GRACE``), or when its connection to the owner ends (421 at
once: nothing can be accepted without the owner). One that dies is restarted with the
workers' backoff; its sessions are cut, and their clients send again.

Crash safety: this process writes nothing. A message it was given is in the spool only
if the owner's accept returned; a process killed between that return and the 250 leaves
a client that sends the message again (a duplicate, never a loss), as with any MTA whose
reply is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Final

import click

from spool.async_client import AsyncClient, aconnect
from spool.errors import CannotListen, SpoolError
from spool.logs import setup_logging
from spool.smtp_in import (
    LOOPBACK,
    STOP_GRACE,
    SmtpSession,
    SpoolHandler,
    shut_sessions,
    size_limit,
    tls_context,
)
from spool.smtp_tally import SEND_EVERY
from spool.supervisor import ProcessGroup

log = logging.getLogger("spool.smtp")
OWNER_CHECK: Final = 0.5  # seconds between looks at the connection to the owner
BACKLOG: Final = 1024  # connections queued on a listener before the processes take them


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` that child processes inherit;
    ``CannotListen`` if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as e:
        raise CannotListen("--smtp", host, port, e) from None
    sock.set_inheritable(True)
    return sock


class SmtpProcesses(ProcessGroup):
    """The owner's side: the listeners bound, and N front-end processes on them."""

    kind = "smtp process"
    _done = "work"

    def __init__(
        self,
        directory: str,
        listeners: Sequence[tuple[str, int]],
        processes: int,
        *,
        hostname: str,
        max_recipients: int,
        max_message_size: int,
        mynetworks: Sequence[str] = LOOPBACK,
        relay_domains: Sequence[str] = (),
        tls: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(processes)
        self.directory = directory
        self.listeners = list(listeners)
        self.hostname = hostname
        self.max_recipients = max_recipients
        self.size_limit = size_limit(max_message_size, hostname)
        self.mynetworks = list(mynetworks)
        self.relay_domains = list(relay_domains)
        self.tls = tls
        self.sockets: list[socket.socket] = []

    def start(self) -> None:
        """Bind every listener (``CannotListen`` if one cannot be: none is left bound),
        then start the processes."""
        try:
            for host, port in self.listeners:
                self.sockets.append(bind_listener(host, port))
                log.info("smtp on %s:%d (%d processes)", host, port, len(self.slots))
        except BaseException:
            self._close_sockets()
            raise
        super().start()

    def _command(self) -> list[str]:
        command = [
            sys.executable, "-m", "spool.smtp_process", self.directory,
            "--hostname", self.hostname,
            "--max-recipients", str(self.max_recipients),
            "--size-limit", str(self.size_limit),
        ]  # fmt: skip
        for sock in self.sockets:
            command += ["--fd", str(sock.fileno())]
        for network in self.mynetworks:
            command += ["--mynetworks", network]
        for domain in self.relay_domains:
            command += ["--relay-domain", domain]
        if self.tls is not None:
            command += ["--tls-cert", self.tls[0], "--tls-key", self.tls[1]]
        return command

    def _popen(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            pass_fds=[s.fileno() for s in self.sockets],
        )

    def stop(self) -> None:
        """Stop the processes (each says 421 to its sessions), then close the listeners."""
        super().stop()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


async def serve_sockets(
    directory: str,
    sockets: Sequence[socket.socket],
    *,
    hostname: str,
    max_recipients: int,
    size: int,
    mynetworks: Sequence[str],
    relay_domains: Sequence[str],
    tls: tuple[str, str] | None,
) -> None:
    """The front-end process's loop: SMTP on ``sockets`` into ``directory``'s owner,
    until SIGTERM or the owner goes away."""
    client = await aconnect(directory)
    handler = SpoolHandler(
        client,
        hostname=hostname,
        max_recipients=max_recipients,
        mynetworks=mynetworks,
        relay_domains=relay_domains,
    )
    context = None if tls is None else tls_context(*tls)
    loop = asyncio.get_running_loop()

    def session() -> SmtpSession:
        return SmtpSession(
            handler,
            hostname=hostname,
            data_size_limit=size,
            enable_SMTPUTF8=True,
            tls_context=context,  # STARTTLS offered when given, never required
            loop=loop,
        )

    servers = [await loop.create_server(session, sock=sock) for sock in sockets]
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    sent: dict[str, int] = {}
    next_report = time.monotonic()
    while not stopping.is_set() and not client.client.closed:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), OWNER_CHECK)
        if time.monotonic() >= next_report:
            sent = await _report_tally(client, handler, sent)
            next_report = time.monotonic() + SEND_EVERY
    owner_gone = not stopping.is_set()
    if owner_gone:
        log.warning("the owner went away: closing the SMTP sessions")
    for server in servers:
        server.close()  # no new connections
    await shut_sessions(handler.sessions, time.monotonic() + (0 if owner_gone else STOP_GRACE))
    if not owner_gone:
        await _report_tally(client, handler, sent)  # the last figures, sessions all answered
    await client.close()


async def _report_tally(
    client: AsyncClient, handler: SpoolHandler, sent: dict[str, int]
) -> dict[str, int]:
    """Send the owner this process's figures if they changed; the figures it has."""
    counts = handler.tally.snapshot()
    if counts == sent:
        return sent
    try:
        await client.smtp_tally(counts)
    except SpoolError as e:  # an owner gone (noticed by the loop), or an older one
        log.debug("SMTP figures not taken: %s", e)
        return sent
    return counts


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--fd", "fds", type=int, multiple=True, required=True, help="A listening socket.")
@click.option("--hostname", required=True, help="The name greeted with and written in Received.")
@click.option("--max-recipients", type=int, required=True)
@click.option("--size-limit", type=int, required=True, help="SIZE, in bytes.")
@click.option(
    "--mynetworks", multiple=True, help="Clients that may relay anywhere [default: none]."
)
@click.option("--relay-domain", "relay_domains", multiple=True)
@click.option("--tls-cert", type=click.Path(dir_okay=False))
@click.option("--tls-key", type=click.Path(dir_okay=False))
def main(
    directory: str,
    fds: tuple[int, ...],
    hostname: str,
    max_recipients: int,
    size_limit: int,
    mynetworks: tuple[str, ...],
    relay_domains: tuple[str, ...],
    tls_cert: str | None,
    tls_key: str | None,
) -> None:
    """Accept SMTP on the listening sockets FD into the spool DIRECTORY's running owner
    (started by ``spool serve --smtp-processes``, not by hand)."""
    setup_logging(
        os.environ.get("SPOOL_LOG_FORMAT", "text"),
        "spool-smtp",
        os.environ.get("SPOOL_LOG_FILE") or None,
    )
    # aiosmtpd logs every command at INFO, addresses included (as in the owner's process).
    logging.getLogger("mail.log").setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to act on
    sockets = [socket.socket(fileno=fd) for fd in fds]
    tls = (tls_cert, tls_key) if tls_cert and tls_key else None
    try:
        asyncio.run(
            serve_sockets(
                directory,
                sockets,
                hostname=hostname,
                max_recipients=max_recipients,
                size=size_limit,
                mynetworks=mynetworks,  # the owner's list, passed whole (empty: nobody)
                relay_domains=relay_domains,
                tls=tls,
            )
        )
    except SpoolError as e:
        click.echo(f"spool-smtp: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
