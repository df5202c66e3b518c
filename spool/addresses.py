"""Address checks after RFC 5321: what ``accept`` refuses before anything is written.

A mailbox is ``local-part@domain``. The local part is a dot-string of atext characters or a
quoted string, at most 64 octets; the domain is a dot-separated list of LDH labels (each
at most 63 octets) or an address literal in brackets, at most 255 octets; the whole path at
most 256 octets. CR, LF and NUL are refused anywhere. Non-ASCII addresses need SMTPUTF8,
which this spool does not claim to support: they are refused with a message that says so.
The null reverse-path ``""`` is a valid sender (bounces), never a valid recipient.
"""

from __future__ import annotations

import re
from typing import Final

from spool.errors import InvalidAddress

LOCAL_PART_MAX: Final = 64
DOMAIN_MAX: Final = 255
PATH_MAX: Final = 256

_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_DOT_STRING = re.compile(rf"{_ATEXT}+(?:\.{_ATEXT}+)*\Z")
_QUOTED_STRING = re.compile(r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"\Z')
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
_ADDRESS_LITERAL = re.compile(r"\[[\x21-\x5a\x5e-\x7e]+\]\Z")


def check_mailbox(address: object) -> str:
    """Return ``address`` if it is a valid RFC 5321 mailbox, else raise InvalidAddress."""
    if not isinstance(address, str):
        raise InvalidAddress(address, "an address must be a str")
    if any(c in address for c in "\r\n\x00"):
        raise InvalidAddress(address, "CR, LF and NUL are not allowed in an address")
    if not address.isascii():
        raise InvalidAddress(
            address, "non-ASCII addresses need SMTPUTF8, which this spool does not support"
        )
    if len(address) > PATH_MAX:
        raise InvalidAddress(address, f"longer than {PATH_MAX} octets")
    local, at, domain = address.rpartition("@")
    if not at or not local:
        raise InvalidAddress(address, "missing local part or '@'")
    if len(local) > LOCAL_PART_MAX:
        raise InvalidAddress(address, f"local part longer than {LOCAL_PART_MAX} octets")
    if not (_DOT_STRING.match(local) or _QUOTED_STRING.match(local)):
        raise InvalidAddress(address, "local part is neither a dot-string nor a quoted string")
    if not domain:
        raise InvalidAddress(address, "missing domain")
    if len(domain) > DOMAIN_MAX:
        raise InvalidAddress(address, f"domain longer than {DOMAIN_MAX} octets")
    if domain.startswith("["):
        if not _ADDRESS_LITERAL.match(domain):
            raise InvalidAddress(address, "malformed address literal")
    elif not all(_LABEL.match(label) for label in domain.split(".")):
        raise InvalidAddress(address, "domain is not a sequence of letter-digit-hyphen labels")
    return address


def check_sender(sender: object) -> str:
    """A sender is a mailbox or the null reverse-path ``""``."""
    if sender == "":
        return ""
    return check_mailbox(sender)


def domain_of(address: str) -> str:
    """The domain part, lower-cased (for grouping by destination)."""
    return address.rpartition("@")[2].lower()


def mailbox_key(address: str) -> str:
    """The identity of a checked mailbox for duplicate detection: domains are not case
    sensitive (RFC 5321 2.4), local parts are kept as written (only the destination
    host may interpret them)."""
    local, _, domain = address.rpartition("@")
    return f"{local}@{domain.lower()}"
