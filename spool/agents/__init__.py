"""Delivery agents: what a worker process hands each message to (``spool serve --agent``).

An agent is an object with ``deliver(envelope, data) -> {recipient: reply}`` and
``close()``. The reply is an SMTP reply line ("250 2.0.0 ok", "451 4.3.0 try later",
"550 5.1.1 no such user"), and its first digit decides the recipient's outcome: 2
delivered, 4 deferred, 5 failed (``status_of``). A recipient the agent leaves out is
deferred. Each agent's module says how it maps what it sees to replies (docs/serve.md).

Specs: ``demo``, ``maildir:PATH``, ``pipe:COMMAND``, ``smtp:HOST:PORT``, ``routes:PATH``
(a transport map), ``mx`` (each domain's exchangers, from DNS), ``lmtp:HOST:PORT`` or
``lmtp:/path/to/socket``, ``python:MODULE:CALLABLE``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol

from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse

Replies = Mapping[str, str]


class Agent(Protocol):
    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies: ...

    def close(self) -> None: ...


# An agent that sends a message in groups (one per domain or next hop) may say so with a
# true ``reports_groups`` attribute: it is then called ``deliver(envelope, data, report)``
# and calls ``report(replies)`` with each group's replies as soon as that group is done;
# the worker makes their delivered and failed outcomes durable before it returns, so that
# a worker killed in a later group (its lease) never has them sent again.
Report = Callable[[Replies], None]


def status_of(reply: str) -> str:
    """``delivered``, ``deferred`` or ``failed`` by the reply's first digit (anything but
    2 and 5 defers: a reply the agent could not classify is retried, never lost)."""
    first = reply[:1]
    return "delivered" if first == "2" else "failed" if first == "5" else "deferred"


def each_group(send: Callable[[], Replies], part: MessageEnvelope) -> Replies:
    """``send()``'s replies for one group of a message's recipients; an agent error
    defers that group only, so that the groups already sent keep their replies (else the
    whole message would be deferred and its delivered recipients sent again)."""
    try:
        return send()
    except Exception as e:  # the agent's own failure: this group waits, never is lost
        return dict.fromkeys(part.recipients, f"451 4.3.0 delivery agent error: {e!r}"[:900])


AGENTS = {
    "demo": "spool.agents.demo",
    "maildir": "spool.agents.maildir",
    "pipe": "spool.agents.pipe",
    "smtp": "spool.agents.smtp",
    "routes": "spool.agents.routes",
    "lmtp": "spool.agents.lmtp",
    "python": "spool.agents.python",
    "mx": "spool.agents.mx",
}


def load_agent(spec: str) -> Agent:
    """The agent ``spec`` names. ``SpoolMisuse`` for an unknown or malformed spec."""
    kind, _, rest = spec.partition(":")
    module = AGENTS.get(kind)
    if module is None:
        raise SpoolMisuse(f"unknown agent {kind!r}: use one of {', '.join(sorted(AGENTS))}")
    agent: Agent = importlib.import_module(module).make(rest)
    return agent


# The owner's SMTP listeners, for the workers' agents to know "myself" by (an exchanger
# that is this relay: ``mx``). The owner sets it before it starts its workers, which
# inherit it: ``HOST:PORT`` (``[IPv6]:PORT``) of each ``--smtp`` listener, space-separated.
LISTENERS_ENV: Final = "SPOOL_SMTP_LISTENERS"


def listeners_text(listeners: Sequence[tuple[str, int]]) -> str:
    """``listeners`` as ``LISTENERS_ENV`` holds them."""
    return " ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in listeners)


def own_listeners() -> list[tuple[str, int]]:
    """The (host, port) of each of the owner's SMTP listeners (none when it has none, or
    when the agent runs outside ``spool serve``); a malformed entry is left out."""
    found = []
    for item in os.environ.get(LISTENERS_ENV, "").split():
        host, _, port = item.rpartition(":")
        if host and port.isdigit():
            found.append((host.strip("[]"), int(port)))
    return found
