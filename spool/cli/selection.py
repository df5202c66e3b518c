"""Which messages a command means: the filters ``list`` and the operator actions share,
after ``exiqgrep`` (``-f``, ``-r``, ``-o``, ``-y``, ``-z``) and ``postqueue -j | jq``."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import attrs
import click

from spool.cli.common import AGE, REGEX
from spool.queue_view import ACTIVE, DEFERRED, HELD, INCOMING, QueueEntry

STATES = (INCOMING, DEFERRED, HELD, ACTIVE)


@attrs.frozen
class Selection:
    """The filters given; a message must pass every one (none given: every message)."""

    sender: str | None = None
    recipient: str | None = None
    sender_regex: re.Pattern[str] | None = None
    recipient_regex: re.Pattern[str] | None = None
    domain: str | None = None
    states: frozenset[str] = frozenset()
    older_than: float | None = None
    younger_than: float | None = None
    now: float = attrs.Factory(time.time)

    @property
    def given(self) -> bool:
        """Whether any filter was given."""
        return any(
            v is not None
            for v in (
                self.sender,
                self.recipient,
                self.sender_regex,
                self.recipient_regex,
                self.domain,
                self.older_than,
                self.younger_than,
            )
        ) or bool(self.states)

    def __call__(self, entry: QueueEntry) -> bool:
        """Whether ``entry`` passes every filter."""
        if self.sender is not None and not _sender_matches(self.sender, entry.sender):
            return False
        rcpts = entry.recipients
        if self.recipient is not None:
            wanted = self.recipient.lower()
            if not any(wanted in r.lower() for r in rcpts):
                return False
        if self.sender_regex is not None and not self.sender_regex.search(entry.sender):
            return False
        if self.recipient_regex is not None and not any(
            self.recipient_regex.search(r) for r in rcpts
        ):
            return False
        if self.domain is not None and not any(_domain(r) == self.domain for r in rcpts):
            return False
        if self.states and entry.state not in self.states:
            return False
        age = self.now - entry.accepted_at
        if self.older_than is not None and age < self.older_than:
            return False
        return self.younger_than is None or age < self.younger_than


def _sender_matches(wanted: str, sender: str) -> bool:
    """``--sender TEXT``: senders containing TEXT; ``''`` or ``<>``: the null sender only."""
    if wanted in ("", "<>"):
        return sender == ""
    return wanted.lower() in sender.lower()


def _domain(address: str) -> str:
    return address.rpartition("@")[2].lower()


def selection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The filter options, in the order ``--help`` shows them."""
    options = [
        click.option(
            "--sender",
            metavar="TEXT",
            help="Only senders containing TEXT; '' (or '<>') is the null sender.",
        ),
        click.option(
            "--recipient",
            metavar="TEXT",
            help="Only messages with a pending recipient containing TEXT (@example.com).",
        ),
        click.option(
            "--domain",
            metavar="DOMAIN",
            help="Only messages with a pending recipient at exactly this domain.",
        ),
        click.option(
            "--sender-regex",
            type=REGEX,
            help="Only senders matching this regular expression (case-insensitive).",
        ),
        click.option(
            "--recipient-regex",
            type=REGEX,
            help="Only messages with a pending recipient matching this regular expression.",
        ),
        click.option(
            "--state",
            "states",
            type=click.Choice(STATES),
            multiple=True,
            help="Only messages in this state (repeatable; active: in flight).",
        ),
        click.option("--held", is_flag=True, help="Only held messages (--state held)."),
        click.option("--older-than", type=AGE, help="Only messages older than AGE (30m, 2h, 3d)."),
        click.option("--younger-than", type=AGE, help="Only messages younger than AGE."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def selection_from(params: dict[str, Any]) -> Selection:
    """The Selection of a command's filter options (removed from ``params``)."""
    states = set(params.pop("states", ()) or ())
    if params.pop("held", False):
        states.add(HELD)
    domain = params.pop("domain", None)
    return Selection(
        sender=params.pop("sender", None),
        recipient=params.pop("recipient", None),
        sender_regex=params.pop("sender_regex", None),
        recipient_regex=params.pop("recipient_regex", None),
        domain=None if domain is None else domain.strip().lstrip("@").lower(),
        states=frozenset(states),
        older_than=params.pop("older_than", None),
        younger_than=params.pop("younger_than", None),
    )
