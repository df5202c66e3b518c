"""Rows straight from a record's CBOR map, for the maps the spool writes: the analytics'
decoding shortcut.

``events.segment_rows`` decodes every record of a segment. Through the record codec
(``records.decode``, then ``events.record_rows``) that costs about twice what the
analytics need: the checks are done one call a field, and an attrs record is built only
to be read once. ``lean_rows`` builds the same rows from the map itself, but only for a
map whose every field has exactly the type the spool writes (text as ``str``, times as
``float``, counts as non-negative ``int``, positions as two such ints, no field of a
wrong type anywhere). For such a map the codec's verdict is known: it accepts it, with
these very values. For any other map, and for control records (rare), ``lean_rows``
returns None and the codec decides, as it does everywhere: it accepts (coercing what it
coerces) or raises. So the record codec stays the one decoder of the spool's records;
this module only recognises the cases where its answer is "as written".

``tests/analytics/test_lean_rows.py`` holds the two to each other: on every map a
hypothesis strategy builds (each field right, wrong, missing or of a near type) and on
mutated real payloads, ``lean_rows`` either gives None or exactly the rows of the codec's
record, and never rows for a map the codec refuses.
"""

from __future__ import annotations

from typing import Any, Final, TypeGuard

from spool import format as fmt
from spool import records as rec

# The reply of a recipient that failed because its message was too long in the queue
# (``attempts.EXPIRED_REPLY`` starts with it): such a failure is the kind ``expired``.
EXPIRED_PREFIX: Final = "554 5.4.7 message expired"
_STATUSES: Final = rec.STATUSES
_FINAL_STATUSES: Final = rec.FINAL_STATUSES
_BODY_KINDS: Final = (rec.BODY_INLINE, rec.BODY_FILE)
_FAILED: Final = rec.FAILED
_DELTA, _START, _ENVELOPE, _FINISH = fmt.T_DELTA, fmt.T_START, fmt.T_ENVELOPE, fmt.T_FINISH

Row = tuple[Any, ...]


def kind_of(status: str, reply: str) -> str:
    """A recipient's status as the analytics name it: ``expired`` is a failure for age."""
    if status == _FAILED and reply.startswith(EXPIRED_PREFIX):
        return "expired"
    return status


def lean_rows(server: str, seg: int, off: int, ftype: int, obj: dict[str, Any]) -> list[Row] | None:
    """The rows of the record ``obj`` (a CBOR map of frame type ``ftype``) at byte ``off``
    of segment ``seg``, as ``events.record_rows`` gives them for the codec's record; None
    unless every field has exactly the type the spool writes (then the codec decides)."""
    get = obj.get
    if ftype == _DELTA:  # (the most frequent first)
        msg_id, status, to, reply, at = get("id"), get("st"), get("to"), get("reply"), get("ts")
        if not (
            type(msg_id) is str
            and type(status) is str
            and status in _STATUSES
            and type(reply) is str
            and type(at) is float
            and _texts(to)
        ):
            return None
        kind = kind_of(status, reply)
        return [
            (
                server, seg, off, at, msg_id, "delta", kind,
                None, r, status, reply, None, None, None, None, None,
            )
            for r in to
        ]  # fmt: skip
    if ftype == _START:
        msg_id, envelope_at, klass, at = get("id"), get("env"), get("cls"), get("ts")
        if not (
            type(msg_id) is str
            and type(at) is float
            and type(klass) is int
            and klass >= 0
            and _position(envelope_at)
        ):
            return None
        return [(
            server, seg, off, at, msg_id, "start", "started",
            None, None, None, None, None, klass, None, None, None,
        )]  # fmt: skip
    if ftype == _ENVELOPE:
        return _envelope_rows(server, seg, off, obj)
    if ftype == _FINISH:
        return _finish_rows(server, seg, off, obj)
    return None  # a control record (or no record at all): the codec decides


def _envelope_rows(server: str, seg: int, off: int, obj: dict[str, Any]) -> list[Row] | None:
    get = obj.get
    msg_id, sender, to, accepted_at, written_at = (
        get("id"), get("from"), get("to"), get("acc"), get("ts")
    )  # fmt: skip
    attempts, klass, held, reply = get("att"), get("cls"), get("held"), get("reply")
    size = _body_size(get("body"))
    if not (
        type(msg_id) is str
        and type(sender) is str
        and type(accepted_at) is float
        and type(written_at) is float
        and type(attempts) is int
        and attempts >= 0
        and type(klass) is int
        and klass >= 0
        and (held is None or type(held) is str)
        and (reply is None or type(reply) is str)
        and size is not None
        and _texts(to)
        and ("crash" not in obj or (type(obj["crash"]) is int and obj["crash"] >= 0))
        and ("sup" not in obj or _position(obj["sup"]))
        and ("prom" not in obj or _position(obj["prom"]))
        and ("out" not in obj or _outcomes(obj["out"]))
    ):
        return None
    kind = "requeued" if "sup" in obj else "accepted"
    return [
        (
            server, seg, off, written_at, msg_id, "envelope", kind,
            sender, r, None, reply, attempts, klass, held, size, accepted_at,
        )
        for r in to
    ]  # fmt: skip


def _finish_rows(server: str, seg: int, off: int, obj: dict[str, Any]) -> list[Row] | None:
    get = obj.get
    msg_id, at, outcomes = get("id"), get("ts"), get("out")
    reason, sender, accepted_at = get("why", ""), get("from"), get("acc")
    size = _body_size(get("body"))
    if not (
        type(msg_id) is str
        and type(at) is float
        and type(reason) is str
        and type(sender) is str
        and type(accepted_at) is float
        and size is not None
        and outcomes  # none: the one row of a finish naming no recipient (the codec's)
        and _outcomes(outcomes)
        and ("prom" not in obj or _position(obj["prom"]))
    ):
        return None
    return [
        (
            server, seg, off, at, msg_id, "finish", "finished", sender, recipient,
            kind_of(status, reply), reply, None, None, None, size, accepted_at,
        )
        for recipient, status, reply, _at in outcomes
    ]  # fmt: skip


def _texts(value: Any) -> TypeGuard[list[str]]:
    if type(value) is not list:
        return False
    for item in value:  # noqa: SIM110 (a loop: ``all`` of a generator costs twice this)
        if type(item) is not str:
            return False
    return True


def _position(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) == 2
        and type(value[0]) is int
        and type(value[1]) is int
        and value[0] >= 0 <= value[1]
    )


def _body_size(value: Any) -> int | None:
    """The size of a body reference the spool writes, or None."""
    if type(value) is not dict or value.get("k") not in _BODY_KINDS:
        return None
    size = value.get("n")
    if type(size) is not int or size < 0 or ("at" in value and not _position(value["at"])):
        return None
    return size


def _outcomes(value: Any) -> TypeGuard[list[list[Any]]]:
    if type(value) is not list:
        return False
    for item in value:
        if not (
            type(item) is list
            and len(item) == 4
            and type(item[0]) is str
            and type(item[1]) is str  # (before ``in``: a list is not hashable)
            and item[1] in _FINAL_STATUSES
            and type(item[2]) is str
            and type(item[3]) is float
        ):
            return False
    return True
