"""RFC 5321 checks: what accept() refuses."""

from __future__ import annotations

import pytest

from spool.addresses import check_mailbox, check_sender
from spool.errors import InvalidAddress

VALID = [
    "bob@example.net",
    "a.b-c+tag@sub.example.co.uk",
    '"john doe"@example.org',
    "postmaster@[192.0.2.1]",
    "x@localhost",
    "l" * 64 + "@example.org",
]
INVALID = [
    ("", "missing"),
    ("bob", "missing"),
    ("@example.org", "missing"),
    ("bob@", "missing domain"),
    ("bob@exa mple.org", "labels"),
    ("bob@-example.org", "labels"),
    ("b..ob@example.org", "dot-string"),
    (".bob@example.org", "dot-string"),
    ("bob\r\n@example.org", "CR, LF"),
    ("bob@example.org\n", "CR, LF"),
    ("bob\x00@example.org", "NUL"),
    ("l" * 65 + "@example.org", "local part longer"),
    ("bob@" + ("a" * 60 + ".") * 5 + "org", "longer than"),
    ("bob@" + "a" * 64 + ".org", "labels"),
    ("jörg@example.org", "SMTPUTF8"),
    ("bob@[1.2.3.4", "literal"),
]


@pytest.mark.parametrize("address", VALID)
def test_valid_mailboxes_pass(address: str) -> None:
    assert check_mailbox(address) == address


@pytest.mark.parametrize(("address", "why"), INVALID)
def test_invalid_mailboxes_say_why(address: str, why: str) -> None:
    with pytest.raises(InvalidAddress, match=why):
        check_mailbox(address)


def test_null_sender_is_a_sender_but_not_a_recipient() -> None:
    assert check_sender("") == ""
    with pytest.raises(InvalidAddress):
        check_mailbox("")


@pytest.mark.parametrize("address", [None, 42, b"bob@example.org"])
def test_non_string_addresses_are_refused(address: object) -> None:
    with pytest.raises(InvalidAddress, match="must be a str"):
        check_mailbox(address)
