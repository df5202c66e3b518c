"""What the SMTP front end did since the owner started, for ``--metrics`` and ``status``.

Each process serving SMTP keeps an ``SmtpTally``: connections, the replies of the relay's
own policy by command and class (MAIL, RCPT and DATA: 2xx, 4xx, 5xx; aiosmtpd's replies to
bad syntax and sequence are its own and not counted), and the bytes of the messages
accepted. In the owner's process the scrape reads it directly. A front-end process of its
own (``--smtp-processes``) sends its figures to the owner over the control socket
(``smtp_tally``, docs/protocol.md) when they changed, at most every ``SEND_EVERY``
seconds, and once more at its stop; the owner keeps the last figures of every process it
heard from (``SmtpTallies``), so the sums only grow, though a process killed loses what
it counted since its last report.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Final

COMMANDS: Final = ("mail", "rcpt", "data")
CLASSES: Final = ("2xx", "4xx", "5xx")
KEYS: Final = (
    "connections",
    *(f"{command}_{klass}" for command in COMMANDS for klass in CLASSES),
    "accepted_bytes",
)
SEND_EVERY: Final = 2.0  # seconds between a front-end process's reports, at most


class SmtpTally:
    """The figures of one process's SMTP front end (its listeners may run on several
    threads: a lock keeps each increment whole)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KEYS, 0)

    def connection(self) -> None:
        self._add("connections", 1)

    def reply(self, command: str, reply: str) -> None:
        """Count ``reply`` (its first digit) to ``command`` (mail, rcpt, data)."""
        self._add(f"{command}_{reply[:1]}xx", 1)

    def accepted(self, size: int) -> None:
        self._add("accepted_bytes", size)

    def _add(self, key: str, n: int) -> None:
        if key in self._counts:
            with self._lock:
                self._counts[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class SmtpTallies:
    """The owner's sum of its own front end's tally and the last report of each front-end
    process (by pid)."""

    def __init__(self, own: SmtpTally | None = None) -> None:
        self.own = own
        self._lock = threading.Lock()
        self._reported: dict[int, dict[str, int]] = {}

    def record(self, pid: int, counts: Mapping[str, int]) -> None:
        with self._lock:
            self._reported[pid] = {k: counts.get(k, 0) for k in KEYS}

    def total(self) -> dict[str, int]:
        with self._lock:
            parts = list(self._reported.values())
        if self.own is not None:
            parts.append(self.own.snapshot())
        return {k: sum(p[k] for p in parts) for k in KEYS}
