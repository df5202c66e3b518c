"""Checks of the values callers pass, made before anything is written.

Addresses have their own module (``addresses.py``); this one checks the texts that reach a
record (a server's reply, an operator's reason) and message ids. Each check raises
``SpoolMisuse`` (a ``ValueError``) with a sentence that says what was wrong.

Texts are limited in bytes, not characters: a record's size is what must fit a frame, and
a reply of 4,096 "€" is 12 KiB of UTF-8.
"""

from __future__ import annotations

import math

from spool.errors import SpoolMisuse
from spool.options import TEXT_MAX


def check_text(value: object, what: str) -> str:
    """``value`` if it is a non-empty str of at most ``TEXT_MAX`` bytes of UTF-8 without
    NUL, else ``SpoolMisuse`` naming ``what``."""
    if not isinstance(value, str):
        raise SpoolMisuse(f"{what} must be a str, not {type(value).__name__}")
    if not value:
        raise SpoolMisuse(f"{what} must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise SpoolMisuse(f"{what} is not valid text (it holds a lone surrogate)") from None
    if size > TEXT_MAX:
        raise SpoolMisuse(f"{what} of {size} bytes (UTF-8); at most {TEXT_MAX} bytes are kept")
    if "\x00" in value:
        raise SpoolMisuse(f"{what} holds a NUL character")
    return value


def check_msg_id(value: object) -> str:
    """``value`` if it can name a message (a str), else ``SpoolMisuse``. An id that names
    no message is the caller's ``UnknownMessage`` to raise."""
    if not isinstance(value, str):
        raise SpoolMisuse(f"a message id is a str, not {type(value).__name__}")
    return value


def check_seconds(value: object, what: str) -> float:
    """A time to wait: None (not at all) or a number of seconds, 0 or more, else
    ``SpoolMisuse``."""
    if value is None:
        return 0.0
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise SpoolMisuse(f"{what} must be a number of seconds (0 or more) or None, not {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf  # an integer past any float: as long as infinity
