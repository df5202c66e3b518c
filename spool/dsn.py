"""Delivery status notifications (RFC 3464): the bounce a failed recipient's sender gets.

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
from email.message import Message
from email.mime.base import MIMEBase
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from typing import Final

from spool.addresses import needs_smtputf8
from spool.outcomes import MessageOutcome

SUBJECT: Final = "Undelivered Mail Returned to Sender"
_ENHANCED: Final = re.compile(r"^\d{3}[ -]([245])\.(\d{1,3}\.\d{1,3})\b")
_BASIC: Final = re.compile(r"^([245])\d{2}\b")


def status_of(reply: str) -> str:
    """The RFC 3463 status of a failure from its reply: the enhanced code it carries (its
    class made 5: the recipient failed for good), else ``5.0.0``."""
    m = _ENHANCED.match(reply)
    if m:
        return f"5.{m.group(2)}"
    return "5.0.0"


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
    report = MIMEMultipart("report", report_type="delivery-status")
    report["From"] = f"Mail Delivery System <MAILER-DAEMON@{reporting_mta}>"
    report["To"] = f"<{outcome.sender}>"
    report["Subject"] = SUBJECT
    report["Date"] = email.utils.formatdate(localtime=True)
    report["Message-ID"] = email.utils.make_msgid(domain=reporting_mta)
    report["Auto-Submitted"] = "auto-replied"  # RFC 3834: never answered automatically
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
    status = MIMEBase("message", "delivery-status")
    per_message = Message()
    per_message["Reporting-MTA"] = f"dns; {reporting_mta}"
    per_message["X-Spool-Queue-ID"] = outcome.msg_id
    if outcome.accepted_at is not None:
        per_message["Arrival-Date"] = email.utils.formatdate(outcome.accepted_at, localtime=True)
    blocks: list[Message | str] = [per_message]
    for o in failed:
        block = Message()
        kind = "utf-8" if needs_smtputf8(o.recipient) else "rfc822"
        block["Final-Recipient"] = f"{kind}; {seven_bit(o.recipient)}"
        block["Action"] = "failed"
        block["Status"] = status_of(o.reply)
        block["Diagnostic-Code"] = f"smtp; {seven_bit(o.reply)}"
        block["Last-Attempt-Date"] = email.utils.formatdate(o.at, localtime=True)
        blocks.append(block)
    status.set_payload(blocks)
    report.attach(status)
    if original is not None:
        headers = header_section(original).decode("utf-8", errors="replace")
        report.attach(_text(headers, "rfc822-headers"))
    # A sender whose address is not ASCII is written as is (it came over SMTPUTF8).
    utf8 = needs_smtputf8(outcome.sender) or not reporting_mta.isascii()
    return report.as_bytes(policy=email.policy.SMTPUTF8 if utf8 else email.policy.SMTP)
