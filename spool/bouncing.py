"""The owner's bouncer: every finished message with failed recipients gets its bounce.

With outcome tracking on (``spool serve --bounces``, recorded in the spool), a thread of
the owner takes each outcome (``Spool.next_outcome``), and for one that names failed (or
expired) recipients queues an RFC 3464 notice (``dsn.py``) from the null sender to the
message's sender, then acknowledges the outcome:

- **at least once.** The notice is accepted (durable) before the acknowledgement is
  written: a crash between the two sends the notice again after the restart (the outcome
  is handed out again), never loses it. Postfix's bounce(8) has the same window.
- **never a bounce of a bounce.** A message from the null sender ``<>`` (a bounce itself)
  whose recipients fail is logged and dropped, as every MTA does.
- **a full disk waits.** A notice refused for space (``DiskFull``) is tried again later;
  its outcome stays unacknowledged meanwhile, its body kept.
"""

from __future__ import annotations

import logging
from typing import Final

from spool.background import BackgroundLoop
from spool.dsn import delivery_status_notification
from spool.errors import (
    BodyGone,
    DiskFull,
    InvalidMessage,
    MessageTooLarge,
)
from spool.outcomes import MessageOutcome
from spool.spool import Spool

log = logging.getLogger("spool.bounce")
WAIT: Final = 1.0  # seconds each look for outcomes waits (the stop is seen this often)
RETRY_AFTER: Final = 30.0  # seconds before a notice refused for space is tried again


class Bouncer(BackgroundLoop):
    """Sends the bounces of one open spool's outcomes, in a thread, until ``stop`` (which
    waits for the outcome in hand: its notice and acknowledgement, or neither)."""

    name = "spool-bouncer"

    def __init__(self, spool: Spool, reporting_mta: str) -> None:
        super().__init__(log)
        self.spool = spool
        self.reporting_mta = reporting_mta
        self.sent = 0

    def step(self) -> float:
        """Bounce the next outcome if one comes within ``WAIT``."""
        outcome = self.spool.next_outcome(timeout=WAIT)
        if outcome is not None and not self.handle(outcome):
            return RETRY_AFTER
        return 0.0

    def handle(self, outcome: MessageOutcome) -> bool:
        """Send ``outcome``'s bounce if it needs one, then acknowledge it; False if the
        notice must wait (the disk is too full)."""
        failed = outcome.failed
        if failed and outcome.sender:
            try:
                original: bytes | None = self.spool.outcome_body(outcome)
            except BodyGone:
                original = None
            notice = delivery_status_notification(
                outcome, original, reporting_mta=self.reporting_mta
            )
            try:
                try:
                    bounce_id = self.spool.accept("", [outcome.sender], notice)
                except MessageTooLarge:  # the original's headers alone were too many
                    notice = delivery_status_notification(
                        outcome, None, reporting_mta=self.reporting_mta
                    )
                    bounce_id = self.spool.accept("", [outcome.sender], notice)
            except DiskFull as exc:
                log.warning("%s: bounce waits for disk space: %s", outcome.msg_id, exc)
                return False
            except InvalidMessage as exc:  # not expected: the sender was checked at accept
                log.error("%s: no bounce can be queued (%s): dropped", outcome.msg_id, exc)
                self.spool.ack_outcome(outcome.msg_id)
                return True
            self.sent += 1
            log.info(
                "%s: sender non-delivery notification: %s (%d failed)",
                outcome.msg_id, bounce_id, len(failed),
            )  # fmt: skip
        elif failed:
            log.info(
                "%s: a bounce that failed (%d recipients): dropped, never bounced",
                outcome.msg_id, len(failed),
            )  # fmt: skip
        self.spool.ack_outcome(outcome.msg_id)
        return True
