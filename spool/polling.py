"""Generators over a taking call, for worker loops: ``Spool.attempts`` and ``outcomes``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from spool.arguments import check_seconds
from spool.errors import SpoolClosed

T = TypeVar("T")


def until_closed(take: Callable[[float], T | None], poll: float) -> Iterator[T]:
    """What ``take(poll)`` returns, for ever, until the spool closes; ``poll`` checked
    at the call, not at the first ``next``."""
    check_seconds(poll, "poll")

    def generate() -> Iterator[T]:
        while True:
            try:
                item = take(poll)
            except SpoolClosed:
                return
            if item is not None:
                yield item

    return generate()
