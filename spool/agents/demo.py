"""``demo``: plays a remote MTA, for ``make run`` and trying the system out.

Each recipient is delivered (75%), deferred as if greylisted (18%) or refused as unknown
(7%), at random; nothing leaves the machine.
"""

from __future__ import annotations

import random

from spool.agents import Replies
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse

DELIVERED = "250 2.0.0 ok: queued as demo"
GREYLISTED = "451 4.7.1 greylisted, try again later"
NO_SUCH_USER = "550 5.1.1 no such user"


class DemoAgent:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        replies = {}
        for rcpt in envelope.recipients:
            roll = self._rng.random()
            replies[rcpt] = (
                DELIVERED if roll < 0.75 else GREYLISTED if roll < 0.93 else NO_SUCH_USER
            )
        return replies

    def close(self) -> None:
        pass


def make(argument: str) -> DemoAgent:
    if argument:
        raise SpoolMisuse("the demo agent takes no argument: --agent demo")
    return DemoAgent()
