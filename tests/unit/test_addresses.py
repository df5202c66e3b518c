"""RFC 5321 checks: what accept() refuses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spool import MessageEnvelope
from spool.addresses import (
    ascii_form,
    check_mailbox,
    check_mailbox_fully,
    check_sender,
    domain_of,
    mailbox_key,
    needs_smtputf8,
)
from spool.errors import InvalidAddress

VALID = [
    "bob@example.net",
    "a.b-c+tag@sub.example.co.uk",
    '"john doe"@example.org',
    "postmaster@[192.0.2.1]",
    "x@localhost",
    "l" * 64 + "@example.org",
    # SMTPUTF8 (RFC 6531): UTF-8 local parts, U-label domains.
    "jörg@example.org",
    '"jö rg"@example.org',
    "bob@bücher.example",
    "用户@例子.广告",
    "ü" * 32 + "@example.org",  # 64 octets
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
    ("ü" * 33 + "@example.org", "local part longer"),  # 66 octets, 33 characters
    ("b\x85ob@example.org", "dot-string"),  # a C1 control
    ("bob@\u2603.example", "IDNA2008"),  # a snowman is no letter
    ("bob@-bücher.example", "IDNA2008"),
    ("b\ud800ob@example.org", "surrogate"),
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


def test_only_a_non_ascii_local_part_needs_an_smtputf8_next_hop() -> None:
    assert needs_smtputf8("jörg@example.org")
    assert not needs_smtputf8("bob@bücher.example")
    assert ascii_form("bob@bücher.example") == "bob@xn--bcher-kva.example"
    assert ascii_form("jörg@example.org") is None
    assert ascii_form("bob@example.org") == "bob@example.org"


def test_domains_compare_in_their_a_label_form() -> None:
    assert mailbox_key("bob@BÜCHER.example") == mailbox_key("bob@xn--bcher-kva.EXAMPLE")
    assert mailbox_key("Bob@bücher.example") != mailbox_key("bob@bücher.example")


def test_the_envelope_names_the_recipients_that_need_smtputf8() -> None:
    rcpts = ("jörg@example.org", "bob@bücher.example", "ann@example.org")
    plain = MessageEnvelope("6B00000000000000", "a@example.org", rcpts, 0, 0.0, 1)
    assert plain.smtputf8_recipients == ("jörg@example.org",)
    utf8_sender = MessageEnvelope("6B00000000000000", "ä@example.org", rcpts, 0, 0.0, 1)
    assert utf8_sender.smtputf8_recipients == rcpts


_EDGES = 'aZ09.-_+!~@"[]\\ é\r\n\x00'


def _verdict(check: object, address: str) -> str | None:
    try:
        assert callable(check)
        return str(check(address))
    except InvalidAddress as exc:
        return f"refused: {exc}"


@settings(max_examples=3000, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=_EDGES, max_size=40),
        st.builds(
            lambda local, labels: local + "@" + ".".join(labels),
            st.text(alphabet="aZ09.-_+!~", min_size=0, max_size=70),
            st.lists(st.text(alphabet="aZ09-", min_size=0, max_size=66), min_size=1, max_size=6),
        ),
    )
)
def test_the_plain_ascii_path_decides_as_the_full_checks(address: str) -> None:
    # The one-match path must accept only what the checks one by one accept, and say so
    # with the same result; and a mailbox's key must not depend on which path checked it.
    fast, full = _verdict(check_mailbox, address), _verdict(check_mailbox_fully, address)
    assert fast == full
    if not fast.startswith("refused"):
        local = address.rpartition("@")[0]
        assert mailbox_key(address) == f"{local}@{domain_of(address)}"


def test_the_plain_ascii_path_keeps_the_length_limits() -> None:
    longest = "l" * 64 + "@" + ".".join(["a" * 63, "a" * 63, "b" * 63])  # 256 octets
    assert len(longest) == 256 and check_mailbox(longest) == longest
    for address, why in [
        (longest + "c", "longer than 256"),
        ("l" * 65 + "@example.org", "local part longer"),
        ("bob@" + "a" * 64 + ".org", "labels"),
    ]:
        with pytest.raises(InvalidAddress, match=why):
            check_mailbox(address)
