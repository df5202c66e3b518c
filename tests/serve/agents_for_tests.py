"""Agents the worker tests load with ``--agent python:tests.serve.agents_for_tests:NAME``."""

from __future__ import annotations

import os
import time
from typing import Any

from spool import MessageEnvelope


def by_local_part(envelope: MessageEnvelope, data: bytes) -> dict[str, str]:
    """ok*: delivered; grey*: deferred; nouser*: failed; hang*: never returns; boom*: the
    agent raises; anything else is left out (deferred by the worker)."""
    replies = {}
    for rcpt in envelope.recipients:
        local = rcpt.split("@")[0]
        if local.startswith("hang"):
            time.sleep(3600)
        if local.startswith("boom"):
            raise RuntimeError("agent bug")
        if local.startswith("ok"):
            replies[rcpt] = "250 2.0.0 ok"
        elif local.startswith("grey"):
            replies[rcpt] = "451 4.7.1 greylisted"
        elif local.startswith("nouser"):
            replies[rcpt] = "550 5.1.1 no such user"
    return replies


def bad_replies(envelope: MessageEnvelope, data: bytes) -> dict[str, Any]:
    """Replies no spool can record: not text, too long, not a reply line."""
    bad: list[Any] = [250, "250 " + "x" * 5000, "250 ok\x00", "ok"]
    return {r: bad[i % len(bad)] for i, r in enumerate(envelope.recipients)}


def die_on_crash(envelope: MessageEnvelope, data: bytes) -> dict[str, str]:
    """Kills its worker on recipients named crash*; delivers the rest."""
    if any(r.startswith("crash") for r in envelope.recipients):
        os._exit(3)
    return dict.fromkeys(envelope.recipients, "250 2.0.0 ok")


def grey_once(envelope: MessageEnvelope, data: bytes) -> dict[str, str]:
    """Defers every recipient on a message's first attempt, delivers them on the next."""
    if envelope.attempts == 0:
        return dict.fromkeys(envelope.recipients, "451 4.7.1 greylisted, try again")
    return dict.fromkeys(envelope.recipients, "250 2.0.0 ok")


def slow_by_local_part(envelope: MessageEnvelope, data: bytes) -> dict[str, str]:
    """``by_local_part`` after two seconds: a delivery still in hand when a stop begins."""
    time.sleep(2)
    return by_local_part(envelope, data)


class GroupsThenHang:
    """An agent sending in groups (``reports_groups``): each recipient its own group, in
    order; ok* delivered and reported at once, hang* never returns. What the ``mx`` and
    ``routes`` agents do per domain and per next hop."""

    reports_groups = True

    def deliver(self, envelope: MessageEnvelope, data: bytes, report: Any = None) -> dict[str, str]:
        replies = {}
        for rcpt in envelope.recipients:
            if rcpt.startswith("hang"):
                time.sleep(3600)
            replies[rcpt] = "250 2.0.0 ok"
            if report is not None:
                report({rcpt: replies[rcpt]})
        return replies

    def close(self) -> None:
        pass
