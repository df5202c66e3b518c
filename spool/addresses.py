"""Address checks after RFC 5321 and RFC 6531: what ``accept`` refuses before anything is
written.

A mailbox is ``local-part@domain``. The local part is a dot-string of atext characters or a
quoted string, at most 64 octets; the domain is a dot-separated list of LDH labels (each
at most 63 octets) or an address literal in brackets, at most 255 octets; the whole path at
most 256 octets. CR, LF and NUL are refused anywhere. The null reverse-path ``""`` is a
valid sender (bounces), never a valid recipient.

Internationalised addresses (SMTPUTF8, RFC 6531 and 6532) are accepted: a local part may
hold any non-ASCII character but the C1 controls, and a domain may be written in U-labels,
which must be valid IDNA2008 names (checked and converted with the ``idna`` package; the
standard library's codec is IDNA2003). Lengths count UTF-8 octets, the domain's in its
A-label form. A domain is compared in its A-label form, case-insensitively, so
``bob@bücher.example`` and ``bob@xn--bcher-kva.example`` are the same recipient.

Only a non-ASCII local part needs an SMTPUTF8-capable next hop: a U-label domain can be
sent as its A-labels (``ascii_form``). ``needs_smtputf8`` says which addresses need it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import idna

from spool.errors import InvalidAddress, InvalidMessage, MessageTooLarge

LOCAL_PART_MAX: Final = 64
DOMAIN_MAX: Final = 255
PATH_MAX: Final = 256

# RFC 6531 adds UTF8-non-ascii to atext and qtext; the C1 controls are not text.
_UTF8_NON_ASCII = r"[^\x00-\x9f]"
_ATEXT = rf"(?:[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]|{_UTF8_NON_ASCII})"
_DOT_STRING = re.compile(rf"{_ATEXT}+(?:\.{_ATEXT}+)*\Z")
_QUOTED_STRING = re.compile(
    rf'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|{_UTF8_NON_ASCII}|\\[\x20-\x7e])*"\Z'
)
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
_ADDRESS_LITERAL = re.compile(r"\[[\x21-\x5a\x5e-\x7e]+\]\Z")

# The common case in one match: an ASCII dot-string of at most 64 characters, "@", and LDH
# labels. Everything it matches passes every check of ``check_mailbox`` (a property test
# holds the two together); anything else takes the checks one by one.
_ASCII_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_ASCII_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PLAIN_MAILBOX = re.compile(
    rf"(?=[^@]{{1,{LOCAL_PART_MAX}}}@){_ASCII_ATEXT}+(?:\.{_ASCII_ATEXT}+)*"
    rf"@(?:{_ASCII_LABEL}\.)*{_ASCII_LABEL}\Z"
)


def check_mailbox(address: object) -> str:
    """Return ``address`` if it is a valid RFC 5321 mailbox, else raise InvalidAddress."""
    if type(address) is str and len(address) <= PATH_MAX and _PLAIN_MAILBOX.match(address):
        return address  # ASCII: characters are octets, and the domain fits in the path
    return check_mailbox_fully(address)


def check_mailbox_fully(address: object) -> str:
    """``check_mailbox`` without its one-match path for plain ASCII mailboxes."""
    if not isinstance(address, str):
        raise InvalidAddress(address, "an address must be a str")
    if any(c in address for c in "\r\n\x00"):
        raise InvalidAddress(address, "CR, LF and NUL are not allowed in an address")
    try:
        octets = len(address.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidAddress(address, "not valid Unicode (a lone surrogate)") from None
    if octets > PATH_MAX:
        raise InvalidAddress(address, f"longer than {PATH_MAX} octets")
    local, at, domain = address.rpartition("@")
    if not at or not local:
        raise InvalidAddress(address, "missing local part or '@'")
    if len(local.encode("utf-8")) > LOCAL_PART_MAX:
        raise InvalidAddress(address, f"local part longer than {LOCAL_PART_MAX} octets")
    if not (_DOT_STRING.match(local) or _QUOTED_STRING.match(local)):
        raise InvalidAddress(address, "local part is neither a dot-string nor a quoted string")
    if not domain:
        raise InvalidAddress(address, "missing domain")
    if domain.startswith("["):
        if not _ADDRESS_LITERAL.match(domain):
            raise InvalidAddress(address, "malformed address literal")
        return address
    ascii_domain = _a_labels(address, domain)
    if len(ascii_domain) > DOMAIN_MAX:
        raise InvalidAddress(address, f"domain longer than {DOMAIN_MAX} octets")
    if not all(_LABEL.match(label) for label in ascii_domain.split(".")):
        raise InvalidAddress(address, "domain is not a sequence of letter-digit-hyphen labels")
    return address


def _a_labels(address: str, domain: str) -> str:
    """``domain`` in A-labels (ASCII); U-labels must be valid IDNA2008, else InvalidAddress."""
    if domain.isascii():
        return domain
    try:
        return idna.encode(domain, uts46=True).decode("ascii")
    except idna.IDNAError as exc:
        raise InvalidAddress(
            address, f"domain is not a valid internationalised domain name (IDNA2008): {exc}"
        ) from None


def needs_smtputf8(address: str) -> bool:
    """Whether a checked address can only be relayed to an SMTPUTF8-capable next hop: its
    local part is not ASCII (a U-label domain can travel as A-labels)."""
    return not address.rpartition("@")[0].isascii()


def ascii_form(address: str) -> str | None:
    """A checked address as a next hop without SMTPUTF8 takes it (its domain in A-labels),
    or None when there is none (a non-ASCII local part)."""
    if needs_smtputf8(address):
        return None
    local, _, domain = address.rpartition("@")
    return f"{local}@{_a_labels(address, domain)}"


def check_sender(sender: object) -> str:
    """A sender is a mailbox or the null reverse-path ``""``."""
    if sender == "":
        return ""
    return check_mailbox(sender)


def domain_of(address: str) -> str:
    """The domain part in A-labels, lower-cased (for grouping by destination)."""
    domain = address.rpartition("@")[2]
    return (domain if domain.startswith("[") else _a_labels(address, domain)).lower()


def mailbox_key(address: str) -> str:
    """The identity of a checked mailbox for duplicate detection: domains are compared in
    A-labels and not case sensitive (RFC 5321 2.4), local parts are kept as written (only
    the destination host may interpret them)."""
    local, _, domain = address.rpartition("@")
    if domain.isascii():
        return f"{local}@{domain.lower()}"  # as ``domain_of``: A-labels already
    return f"{local}@{domain_of(address)}"


def check_recipients(recipients: object, limit: int) -> tuple[str, ...]:
    """The recipients of a new message, checked: a list (not one string) of at most
    ``limit`` valid mailboxes, none twice (compared as ``mailbox_key`` does)."""
    if isinstance(recipients, str | bytes):
        raise InvalidMessage("recipients must be a list of addresses, not one string")
    if not isinstance(recipients, Iterable) or isinstance(recipients, dict):
        raise InvalidMessage(
            f"recipients must be a list of addresses, not {type(recipients).__name__}"
        )
    rcpts = tuple(recipients)
    if not rcpts:
        raise InvalidMessage("a message needs at least one recipient")
    if len(rcpts) > limit:
        raise MessageTooLarge(f"{len(rcpts)} recipients exceed max_recipients ({limit})")
    for r in rcpts:
        check_mailbox(r)
    keys = [mailbox_key(r) for r in rcpts]
    if len(set(keys)) != len(keys):
        dupes = sorted({r for r, k in zip(rcpts, keys, strict=True) if keys.count(k) > 1})
        raise InvalidMessage(f"duplicate recipients: {', '.join(dupes)}")
    return rcpts
