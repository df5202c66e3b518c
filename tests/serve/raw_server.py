"""A scripted SMTP/LMTP server for replies aiosmtpd will not give (252 to RCPT, a
connection cut between LMTP replies, a 421 to RSET): real sockets, a handler per case."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Script = Callable[["Session"], None]


class Session(socketserver.StreamRequestHandler):
    """One connection: ``server.script(self)`` talks; ``said`` reads one command line."""

    def said(self) -> bytes:
        return self.rfile.readline()

    def say(self, *lines: bytes) -> None:
        self.wfile.write(b"".join(line + b"\r\n" for line in lines))

    def read_data(self) -> bytes:
        body = b""
        while (line := self.rfile.readline()) not in (b".\r\n", b""):
            body += line
        return body

    def handle(self) -> None:
        server: Any = self.server
        server.sessions += 1
        server.script(self)


@contextmanager
def raw_server(script: Script) -> Iterator[Any]:
    server: Any = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Session)
    server.daemon_threads = True
    server.script, server.sessions, server.messages = script, 0, []
    server.batches = []  # for scripts that keep the commands of each transaction
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
