"""Delivery status notifications (RFC 3464): the bounce a failed recipient's sender gets,
and the warning one gets while a message is still being retried (``delay_warning``).

Built with the standard library's ``email`` package: a ``multipart/report;
report-type=delivery-status`` of three parts, as every MTA sends them:

1. ``text/plain``: what happened, for a person, one line per failed recipient;
2. ``message/delivery-status``: the per-message fields (``Reporting-MTA``, the spool's
   queue id, ``Arrival-Date``) and, per failed recipient, ``Final-Recipient``, ``Action:
   failed``, ``Status`` (the reply's enhanced code, RFC 3463, made permanent; ``5.0.0``
   when the reply has none), ``Diagnostic-Code: smtp; <reply>`` and ``Last-Attempt-Date``;
3. ``text/rfc822-headers``: the original message's header section (the body is not
   returned: it may be large, and the headers are what a sender needs to recognise it).

A recipient whose address is not ASCII is named ``utf-8; ...`` (RFC 6533).
"""

from __future__ import annotations

import email.policy
import email.utils
import re
import time
from collections.abc import Sequence
from email.message import Message
from email.mime.base import MIMEBase
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from typing import Final

from spool.addresses import needs_smtputf8
from spool.outcomes import MessageOutcome

SUBJECT: Final = "Undelivered Mail Returned to Sender"
DELAY_SUBJECT: Final = "Delayed Mail (still being retried)"
_ENHANCED: Final = re.compile(r"^\d{3}[ -]([245])\.(\d{1,3}\.\d{1,3})\b")
_BASIC: Final = re.compile(r"^([245])\d{2}\b")


def status_of(reply: str, klass: str = "5") -> str:
    """The RFC 3463 status from a reply: the enhanced code it carries, its class made
    ``klass`` (5: the recipient failed for good; 4: still being tried), else
    ``klass.0.0``."""
    m = _ENHANCED.match(reply)
    if m:
        return f"{klass}.{m.group(2)}"
    return f"{klass}.0.0"


def seven_bit(text: str) -> str:
    """``text`` for a 7-bit delivery-status field: each non-ASCII character (and the
    backslash) as ``\\x{HEX}``, the utf-8-addr-xtext of RFC 6533."""
    return "".join(c if c.isascii() and c != "\\" else f"\\x{{{ord(c):X}}}" for c in text)


def _text(text: str, subtype: str) -> MIMEText:
    """A text part, readable as it is (7-bit) when it is ASCII."""
    return MIMEText(text, subtype, "us-ascii" if text.isascii() else "utf-8")


def header_section(message: bytes) -> bytes:
    """The header section of ``message`` (up to the first empty line), CRLF line ends."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        at = message.find(sep)
        if at != -1:
            return message[:at].replace(b"\r\n", b"\n").replace(b"\n", b"\r\n") + b"\r\n"
    return message.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")


def delivery_status_notification(
    outcome: MessageOutcome, original: bytes | None, *, reporting_mta: str
) -> bytes:
    """The bounce of ``outcome``'s failed recipients, to its sender, as message bytes.
    ``original`` is the message as accepted (None when it is no longer kept: the report
    then says so instead of quoting its headers)."""
    failed = outcome.failed
    if not failed or not outcome.sender:
        raise ValueError("a bounce needs failed recipients and a sender that is not <>")
    report = _report(outcome.sender, SUBJECT, reporting_mta)
    lines = [
        f"This is the mail system at host {reporting_mta}.",
        "",
        "Your message could not be delivered to one or more recipients.",
        "",
        *(f"<{o.recipient}>: {o.reply}" for o in failed),
        "",
    ]
    if original is None:
        lines += ["The message itself is no longer in the queue.", ""]
    report.attach(_text("\n".join(lines), "plain"))
    blocks = [_per_message(outcome.msg_id, outcome.accepted_at, reporting_mta)]
    for o in failed:
        block = _per_recipient(o.recipient, "failed", status_of(o.reply), o.reply)
        block["Last-Attempt-Date"] = email.utils.formatdate(o.at, localtime=True)
        blocks.append(block)
    _attach_status(report, blocks)
    if original is not None:
        headers = header_section(original).decode("utf-8", errors="replace")
        report.attach(_text(headers, "rfc822-headers"))
    return _as_bytes(report, outcome.sender, reporting_mta)


def delay_warning(
    msg_id: str,
    sender: str,
    accepted_at: float,
    pending: Sequence[tuple[str, str | None]],
    *,
    reporting_mta: str,
    retry_until: float | None,
) -> bytes:
    """The warning a sender gets when a message is still queued after the delay warning
    time (Postfix's ``delay_warning_time``): a report with ``Action: delayed`` for each
    ``pending`` recipient (its last reply, None when not attempted yet), and
    ``Will-Retry-Until`` when the message expires at ``retry_until``. The original's
    headers are not quoted (the third part of a report is optional, RFC 6522)."""
    if not pending or not sender:
        raise ValueError("a delay warning needs pending recipients and a sender that is not <>")
    report = _report(sender, DELAY_SUBJECT, reporting_mta)
    hours = (time.time() - accepted_at) / 3600
    lines = [
        f"This is the mail system at host {reporting_mta}.",
        "",
        "####################################################################",
        "# THIS IS A WARNING ONLY.  YOU DO NOT NEED TO RESEND YOUR MESSAGE. #",
        "####################################################################",
        "",
        f"Your message could not be delivered for {hours:.1f} hours to the recipients below.",
    ]
    if retry_until is not None:
        until = email.utils.formatdate(retry_until, localtime=True)
        lines.append(f"It will be tried again until {until}.")
    lines.append("")
    lines += [f"<{r}>: {reply or 'not attempted yet'}" for r, reply in pending]
    lines.append("")
    report.attach(_text("\n".join(lines), "plain"))
    blocks = [_per_message(msg_id, accepted_at, reporting_mta)]
    for recipient, reply in pending:
        block = _per_recipient(recipient, "delayed", status_of(reply or "", "4"), reply)
        if retry_until is not None:
            block["Will-Retry-Until"] = email.utils.formatdate(retry_until, localtime=True)
        blocks.append(block)
    _attach_status(report, blocks)
    return _as_bytes(report, sender, reporting_mta)


def _report(sender: str, subject: str, reporting_mta: str) -> MIMEMultipart:
    """The envelope of a report to ``sender``: its headers, no parts yet."""
    report = MIMEMultipart("report", report_type="delivery-status")
    report["From"] = f"Mail Delivery System <MAILER-DAEMON@{reporting_mta}>"
    report["To"] = f"<{sender}>"
    report["Subject"] = subject
    report["Date"] = email.utils.formatdate(localtime=True)
    report["Message-ID"] = email.utils.make_msgid(domain=reporting_mta)
    report["Auto-Submitted"] = "auto-replied"  # RFC 3834: never answered automatically
    return report


def _per_message(msg_id: str, accepted_at: float | None, reporting_mta: str) -> Message:
    per_message = Message()
    per_message["Reporting-MTA"] = f"dns; {reporting_mta}"
    per_message["X-Spool-Queue-ID"] = msg_id
    if accepted_at is not None:
        per_message["Arrival-Date"] = email.utils.formatdate(accepted_at, localtime=True)
    return per_message


def _per_recipient(recipient: str, action: str, status: str, reply: str | None) -> Message:
    block = Message()
    kind = "utf-8" if needs_smtputf8(recipient) else "rfc822"
    block["Final-Recipient"] = f"{kind}; {seven_bit(recipient)}"
    block["Action"] = action
    block["Status"] = status
    if reply is not None:
        block["Diagnostic-Code"] = f"smtp; {seven_bit(reply)}"
    return block


def _attach_status(report: MIMEMultipart, blocks: list[Message]) -> None:
    status = MIMEBase("message", "delivery-status")
    payload: list[Message | str] = [*blocks]
    status.set_payload(payload)
    report.attach(status)


def _as_bytes(report: MIMEMultipart, sender: str, reporting_mta: str) -> bytes:
    # A sender whose address is not ASCII is written as is (it came over SMTPUTF8).
    utf8 = needs_smtputf8(sender) or not reporting_mta.isascii()
    return report.as_bytes(policy=email.policy.SMTPUTF8 if utf8 else email.policy.SMTP)
