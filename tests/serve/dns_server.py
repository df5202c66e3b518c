"""A small authoritative DNS server on loopback for the mx agent's tests: real UDP
queries and answers (dnspython builds and parses them), from a zone given as a dict."""

from __future__ import annotations

import socket
import threading

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

Zone = dict[str, dict[str, list[str]]]  # name -> record type -> record texts


class DnsServer:
    """Answers from ``zone`` (names with their final dot, lower case): a name not in it
    is NXDOMAIN, a type it lacks an empty answer, a name in ``servfail`` SERVFAIL, and a
    name in ``silent`` nothing at all."""

    def __init__(
        self,
        zone: Zone,
        servfail: frozenset[str] = frozenset(),
        silent: frozenset[str] = frozenset(),
    ) -> None:
        self.zone, self.servfail, self.silent = zone, servfail, silent
        self.queries: list[tuple[str, str]] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(data)
            response = dns.message.make_response(query)
            question = query.question[0]
            name = question.name.to_text().lower()
            rdtype = dns.rdatatype.to_text(question.rdtype)
            self.queries.append((name, rdtype))
            if name in self.silent:
                continue  # a server that never answers for it
            if name in self.servfail:
                response.set_rcode(dns.rcode.SERVFAIL)
            elif name not in self.zone:
                response.set_rcode(dns.rcode.NXDOMAIN)
            else:
                texts = self.zone[name].get(rdtype, [])
                if texts:
                    response.answer.append(dns.rrset.from_text_list(name, 60, "IN", rdtype, texts))
            self._sock.sendto(response.to_wire(), peer)
