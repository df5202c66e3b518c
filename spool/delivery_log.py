"""The delivery log: one line per event an operator greps for, in the style of Postfix's
maillog, through Python's ``logging`` (so an embedder routes it where it wants; ``spool
serve`` writes it to standard error or ``--log-file``).

Loggers, one per component, all under ``spool``:

* ``spool.accept``: ``6B49D2000F5A1C33: from=<alice@example.org>, size=2048, nrcpt=2``
* ``spool.delivery``: one line per recipient and outcome, when the spool records it::

    6B49D2000F5A1C33: to=<bob@example.net>, delay=3.2, delays=0.1/3.1, dsn=2.0.0,
    status=sent (250 2.0.0 ok)

  ``delay`` is the time since acceptance; ``delays=a/b`` splits it into the time queued
  before this attempt and the time of the attempt until the report (Postfix's four parts
  need an SMTP client's view; the spool sees these two). ``dsn`` is the reply's enhanced
  status code, or the class of its basic code (``4.0.0``). ``status`` is ``sent``,
  ``deferred``, ``bounced`` (a permanent failure, a bounce to the sender follows when
  outcomes are tracked), ``expired`` (too long in the queue) or ``deleted`` (by the
  operator, no bounce).
* ``spool.queue``: ``6B49D2000F5A1C33: removed`` when a message is finished, and
  ``held (crash loop ...)`` when recovery or an attempt holds it.
* ``spool.operator``: ``6B49D2000F5A1C33: placed on hold (reason)``, ``released from
  hold``, ``due now (operator retry)``.

Every line is logged at INFO, after what it reports is recorded (``sent`` and ``bounced``
after they are durable). Logging is never in the way of the spool: a handler or filter
that raises (an embedder's) is ignored here, so that a call whose outcome is recorded
never raises because its log line could not be written.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable
from typing import Final

from spool import records as rec

ACCEPT: Final = logging.getLogger("spool.accept")
DELIVERY: Final = logging.getLogger("spool.delivery")
QUEUE: Final = logging.getLogger("spool.queue")
OPERATOR: Final = logging.getLogger("spool.operator")

# The maillog status word of each outcome.
STATUS: Final = {
    rec.DELIVERED: "sent",
    rec.DEFERRED: "deferred",
    rec.FAILED: "bounced",
    rec.DELETED: "deleted",
}
ENHANCED: Final = re.compile(r"\b([245])\.(\d{1,3})\.(\d{1,3})\b")


def _line(logger: logging.Logger, text: str, *args: object) -> None:
    # A broken handler must not fail a call whose outcome is recorded.
    with contextlib.suppress(Exception):
        logger.info(text, *args)


def dsn_of(reply: str) -> str:
    """The reply's enhanced status code (RFC 3463), else its basic code's class."""
    found = ENHANCED.search(reply)
    if found:
        return ".".join(found.groups())
    first = reply.lstrip()[:1]
    return f"{first}.0.0" if first in ("2", "4", "5") else "4.0.0"


def accepted(msg_id: str, sender: str, size: int, nrcpt: int) -> None:
    if ACCEPT.isEnabledFor(logging.INFO):
        _line(ACCEPT, "%s: from=<%s>, size=%d, nrcpt=%d", msg_id, sender, size, nrcpt)


def outcome(
    msg_id: str,
    recipients: Iterable[str],
    status: str,
    reply: str,
    *,
    accepted_at: float,
    started_at: float,
    now: float,
    expired: bool = False,
) -> None:
    """One line per recipient: what the spool recorded for it."""
    if not DELIVERY.isEnabledFor(logging.INFO):
        return
    word = "expired" if expired else STATUS.get(status, status)
    queued = max(0.0, started_at - accepted_at)
    attempt = max(0.0, now - started_at)
    dsn = dsn_of(reply)
    for rcpt in recipients:
        _line(
            DELIVERY,
            "%s: to=<%s>, delay=%.2f, delays=%.2f/%.2f, dsn=%s, status=%s (%s)",
            msg_id, rcpt, queued + attempt, queued, attempt, dsn, word, reply,
        )  # fmt: skip


def removed(msg_id: str, reason: str) -> None:
    _line(QUEUE, "%s: removed (%s)", msg_id, reason)


def held(msg_id: str, reason: str, by_operator: bool) -> None:
    _line(OPERATOR if by_operator else QUEUE, "%s: placed on hold (%s)", msg_id, reason)


def released(msg_id: str) -> None:
    _line(OPERATOR, "%s: released from hold", msg_id)


def made_due(msg_id: str) -> None:
    _line(OPERATOR, "%s: due now (operator retry)", msg_id)
