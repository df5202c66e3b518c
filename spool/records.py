"""Record types of the log and their CBOR payloads.

One attrs class per record type. ``encode`` turns a record into ``(frame type, payload)``;
``decode`` does the reverse and raises ``RecordError`` for a payload that passed its CRC
but is not a valid record (a bug or a foreign writer, never a crash). Field names in the
CBOR maps are short strings, listed with their meaning in ``docs/format.md``.

Garbage marks are implied, not written: a START record supersedes the envelope it names,
a replacement ENVELOPE supersedes the envelope in its ``supersedes`` field, and a FINISH
settles the message. Nothing is ever marked in place.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import attrs
import cbor2

from spool import format as fmt
from spool.errors import CorruptSpool


class RecordError(ValueError):
    """A payload that passed its CRC does not decode to a valid record."""


class Position(NamedTuple):
    """A place in the log: segment number and byte offset inside that segment file.

    A named tuple rather than an attrs class: positions are compared on every record a
    runner or the writer touches, and tuple comparison is several times cheaper.
    """

    segment: int
    offset: int

    def to_list(self) -> list[int]:
        return [self.segment, self.offset]

    @classmethod
    def from_obj(cls, obj: Any) -> Position:
        # Unrolled (no generator): every record a reader decodes names a position or two.
        if isinstance(obj, list) and len(obj) == 2:
            segment, offset = obj
            if isinstance(segment, int) and isinstance(offset, int) and segment >= 0 <= offset:
                return _new_position(cls, (segment, offset))
        raise RecordError(f"bad position {obj!r}")

    def __str__(self) -> str:
        return f"{self.segment}:{self.offset}"


_new_position = tuple.__new__  # a named tuple's own __new__ is a Python function


# Delta statuses.
DELIVERED: Final = "delivered"
FAILED: Final = "failed"
DEFERRED: Final = "deferred"
DELETED: Final = "deleted"  # ended by the operator without a bounce (``Spool.delete``)
STATUSES: Final = frozenset({DELIVERED, FAILED, DEFERRED, DELETED})
FINAL_STATUSES: Final = frozenset({DELIVERED, FAILED, DELETED})

# Body kinds: the BODY frame right after the first envelope, or a file in bodies/.
BODY_INLINE: Final = "inline"
BODY_FILE: Final = "file"


@attrs.frozen
class BodyRef:
    """Where a message body lives.

    ``at`` is the position of the BODY frame for inline bodies; None in the first envelope
    of a message, whose BODY frame follows it directly.
    """

    kind: str
    size: int
    at: Position | None = None

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"k": self.kind, "n": self.size}
        if self.at is not None:
            obj["at"] = self.at.to_list()
        return obj

    @classmethod
    def from_obj(cls, obj: Any) -> BodyRef:
        if not isinstance(obj, dict) or obj.get("k") not in (BODY_INLINE, BODY_FILE):
            raise RecordError(f"bad body reference {obj!r}")
        at = Position.from_obj(obj["at"]) if "at" in obj else None
        size = obj.get("n")
        if not isinstance(size, int) or size < 0:
            raise RecordError(f"bad body size {size!r}")
        return cls(obj["k"], size, at)


@attrs.frozen
class Outcome:
    """The final result of one recipient: delivered, failed or deleted, with the last reply."""

    recipient: str
    status: str
    reply: str
    at: float

    def to_obj(self) -> list[Any]:
        return [self.recipient, self.status, self.reply, self.at]

    @classmethod
    def from_obj(cls, obj: Any) -> Outcome:
        if not isinstance(obj, list) or len(obj) != 4 or obj[1] not in FINAL_STATUSES:
            raise RecordError(f"bad outcome {obj!r}")
        return cls(str(obj[0]), obj[1], str(obj[2]), float(obj[3]))


@attrs.frozen
class Envelope:
    """What a queue runner needs to route a message; never the body itself.

    ``recipients`` are the ones still pending. ``klass`` is the retry class whose runner
    picks the envelope up (0: fresh mail or due now). ``outcomes`` carries the results of
    earlier attempts so the finish record can report every recipient.
    """

    msg_id: str
    sender: str
    recipients: tuple[str, ...]
    accepted_at: float
    written_at: float
    body: BodyRef
    attempts: int = 0
    klass: int = 0
    held: str | None = None
    crashes: int = 0
    supersedes: Position | None = None
    outcomes: tuple[Outcome, ...] = ()
    last_reply: str | None = None
    promoted_from: Position | None = None


@attrs.frozen
class Start:
    """A delivery attempt on the envelope at ``envelope_at`` began (supersedes it)."""

    msg_id: str
    envelope_at: Position
    klass: int
    at: float


@attrs.frozen
class Delta:
    """These recipients were delivered, failed permanently, or deferred, with the reply."""

    msg_id: str
    status: str
    recipients: tuple[str, ...]
    reply: str
    at: float


@attrs.frozen
class Finish:
    """No work is left on the message; ``outcomes`` holds every recipient's result.

    ``sender`` and ``accepted_at`` repeat the envelope's, so that a bounce (an RFC 3464
    notice) is built from the finish alone; None in finish records of older versions.
    ``promoted_from``: the inline body was copied to a body file as the message finished
    (kept for its bounce, outcome tracking); where the inline BODY frame was, so that
    recovery releases its segment as it does for a promoted envelope.
    """

    msg_id: str
    at: float
    body: BodyRef
    outcomes: tuple[Outcome, ...]
    reason: str = ""
    sender: str | None = None
    accepted_at: float | None = None
    promoted_from: Position | None = None


@attrs.frozen
class Control:
    """An operator or bookkeeping action that is not itself an envelope change.

    ``action`` is one of ``CONTROL_ACTIONS``; ``target`` its subject (a message id, or ""
    for a ``damaged`` marker that names no message). A ``damaged`` marker is written by
    ``spool check --repair`` in place of damaged bytes (``damage.py``): its frame covers
    exactly those bytes; ``body`` is how many of them were ``target``'s BODY frame (0 if
    none), ``lost`` the kind of the one record the bytes held when that is known
    (``envelope``, ``start``, ...; ``target`` is then its message), ``sup`` the one envelope
    a START identified exactly had used up (the marker then stands for that START), and
    ``copy`` names the copy of the damaged segment in ``corrupt/``. A ``used-up`` note, which
    a repair appends, names in ``sup`` envelopes that STARTs lost to damage had used up
    (their messages finished later, so nothing else says so), wherever those STARTs were.

    ``hold``, ``release``, ``delete`` and ``bounce`` record an operator action on a message
    in flight (``target``), with its reason in ``why``: the spool applies it when the
    attempt ends, and recovery applies it when a crash ended the attempt first, so the
    action is durable when the call returns (docs/design.md, "Operator actions").
    """

    action: str
    target: str
    at: float
    body: int = 0
    copy: str = ""
    lost: str = ""
    sup: tuple[Position, ...] = ()
    why: str = ""


OUTCOME_ACK: Final = "outcome-ack"
DAMAGED: Final = "damaged"
IN_FLIGHT_HOLD: Final = "hold"
IN_FLIGHT_RELEASE: Final = "release"
IN_FLIGHT_DELETE: Final = "delete"  # the rest of its recipients end "deleted" (no bounce)
IN_FLIGHT_BOUNCE: Final = "bounce"  # the rest of its recipients end "failed" (a bounce)
IN_FLIGHT_ACTIONS: Final = frozenset(
    {IN_FLIGHT_HOLD, IN_FLIGHT_RELEASE, IN_FLIGHT_DELETE, IN_FLIGHT_BOUNCE}
)
USED_UP: Final = "used-up"  # a repair's note: the envelopes in ``sup`` are used up
CONTROL_ACTIONS: Final = frozenset({OUTCOME_ACK, DAMAGED, USED_UP}) | IN_FLIGHT_ACTIONS

Record = Envelope | Start | Delta | Finish | Control


def _rcpts(obj: Any) -> tuple[str, ...]:
    if isinstance(obj, list):
        for r in obj:
            if not isinstance(r, str):
                break
        else:
            return tuple(obj)
    raise RecordError(f"bad recipient list {obj!r}")


def encode(record: Record) -> tuple[int, bytes]:
    """(frame type, CBOR payload) of a record."""
    if isinstance(record, Envelope):
        obj: dict[str, Any] = {
            "id": record.msg_id,
            "from": record.sender,
            "to": list(record.recipients),
            "acc": record.accepted_at,
            "ts": record.written_at,
            "body": record.body.to_obj(),
            "att": record.attempts,
            "cls": record.klass,
        }
        if record.held is not None:
            obj["held"] = record.held
        if record.crashes:
            obj["crash"] = record.crashes
        if record.supersedes is not None:
            obj["sup"] = record.supersedes.to_list()
        if record.outcomes:
            obj["out"] = [o.to_obj() for o in record.outcomes]
        if record.last_reply is not None:
            obj["reply"] = record.last_reply
        if record.promoted_from is not None:
            obj["prom"] = record.promoted_from.to_list()
        return fmt.T_ENVELOPE, cbor2.dumps(obj)
    if isinstance(record, Start):
        obj = {
            "id": record.msg_id,
            "env": record.envelope_at.to_list(),
            "cls": record.klass,
            "ts": record.at,
        }
        return fmt.T_START, cbor2.dumps(obj)
    if isinstance(record, Delta):
        obj = {
            "id": record.msg_id,
            "st": record.status,
            "to": list(record.recipients),
            "reply": record.reply,
            "ts": record.at,
        }
        return fmt.T_DELTA, cbor2.dumps(obj)
    if isinstance(record, Finish):
        obj = {
            "id": record.msg_id,
            "ts": record.at,
            "body": record.body.to_obj(),
            "out": [o.to_obj() for o in record.outcomes],
            "why": record.reason,
        }
        if record.sender is not None:
            obj["from"] = record.sender
        if record.accepted_at is not None:
            obj["acc"] = record.accepted_at
        if record.promoted_from is not None:
            obj["prom"] = record.promoted_from.to_list()
        return fmt.T_FINISH, cbor2.dumps(obj)
    assert isinstance(record, Control), record
    return fmt.T_CONTROL, cbor2.dumps(control_map(record))


def control_map(record: Control) -> dict[str, Any]:
    """The CBOR map of a control record (``damage.py`` adds a ``pad`` key to size it)."""
    obj: dict[str, Any] = {"act": record.action, "tgt": record.target, "ts": record.at}
    if record.body:
        obj["body"] = record.body
    if record.copy:
        obj["copy"] = record.copy
    if record.lost:
        obj["lost"] = record.lost
    if record.sup:
        obj["sup"] = [p.to_list() for p in record.sup]
    if record.why:
        obj["why"] = record.why
    return obj


def _map(payload: bytes) -> dict[str, Any]:
    try:
        obj = cbor2.loads(payload)
    except Exception as exc:  # cbor2 raises several types for malformed input
        raise RecordError(f"payload is not CBOR: {exc}") from exc
    if not isinstance(obj, dict):
        raise RecordError("payload is not a CBOR map")
    return obj


def record_map(payload: bytes) -> dict[str, Any] | None:
    """The CBOR map a record payload holds, or None if it holds none (``decode`` then
    says why): for a reader that builds what it needs from the map itself where every
    field is as the spool writes it (the analytics, ``analytics/lean_rows.py``)."""
    try:
        return _map(payload)
    except RecordError:
        return None


def decode(ftype: int, payload: bytes) -> Record:
    """Decode a record payload. Raises RecordError on anything malformed."""
    obj = _map(payload)
    try:
        return _decode_map(ftype, obj)
    # OverflowError: an integer beyond any float where a time is (CBOR has bignums).
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, RecordError):
            raise
        raise RecordError(f"{fmt.TYPE_NAMES.get(ftype, ftype)} record: {exc!r}") from exc


def decode_stored(ftype: int, payload: bytes, path: str, offset: int) -> Record:
    """Decode a record read from the spool file ``path`` at ``offset``: a frame that
    passed its checksum but does not decode is damage no crash explains, so it raises
    ``CorruptSpool`` naming the file and offset (the one place that turns one into the
    other, for recovery, the runners, the outcome reader, the queue view and the spool)."""
    try:
        return decode(ftype, payload)
    except RecordError as exc:
        raise CorruptSpool(path, offset, str(exc)) from None


def _str(obj: Any) -> str:
    if type(obj) is str:  # the common case first: a record has several of them
        return obj
    if not isinstance(obj, str):
        raise RecordError(f"expected text, got {obj!r}")
    return obj


def _num(obj: Any) -> float:
    if type(obj) is float:  # what the spool writes (float(x) of a float is x)
        return obj
    if not isinstance(obj, int | float) or isinstance(obj, bool):
        raise RecordError(f"expected a number, got {obj!r}")
    return float(obj)


def _int(obj: Any) -> int:
    if type(obj) is int and obj >= 0:  # the common case first (True is not ``int``)
        return obj
    if not isinstance(obj, int) or isinstance(obj, bool) or obj < 0:
        raise RecordError(f"expected a non-negative integer, got {obj!r}")
    return obj


def _outcomes(obj: Any) -> tuple[Outcome, ...]:
    """The outcomes of an ``out`` field (a list comprehension, not a generator: most
    records have none or one, and a generator costs more than its work)."""
    if type(obj) is list and not obj:
        return ()
    return tuple([Outcome.from_obj(o) for o in obj])


def _positions(obj: Any) -> tuple[Position, ...]:
    if not isinstance(obj, list):
        raise RecordError(f"bad position list {obj!r}")
    return tuple(Position.from_obj(p) for p in obj)


def _decode_map(ftype: int, obj: dict[str, Any]) -> Record:
    # Positional arguments in the fields' order: a call with fourteen keywords costs
    # twice what the record's construction does (every record a reader reads).
    if ftype == fmt.T_ENVELOPE:
        held = obj.get("held")
        reply = obj.get("reply")
        return Envelope(
            _str(obj["id"]),  # msg_id
            _str(obj["from"]),  # sender
            _rcpts(obj["to"]),  # recipients
            _num(obj["acc"]),  # accepted_at
            _num(obj["ts"]),  # written_at
            BodyRef.from_obj(obj["body"]),  # body
            _int(obj["att"]),  # attempts
            _int(obj["cls"]),  # klass
            None if held is None else _str(held),  # held
            _int(obj.get("crash", 0)),  # crashes
            Position.from_obj(obj["sup"]) if "sup" in obj else None,  # supersedes
            _outcomes(obj["out"]) if "out" in obj else (),  # outcomes
            None if reply is None else _str(reply),  # last_reply
            Position.from_obj(obj["prom"]) if "prom" in obj else None,  # promoted_from
        )
    if ftype == fmt.T_START:
        return Start(
            _str(obj["id"]), Position.from_obj(obj["env"]), _int(obj["cls"]), _num(obj["ts"])
        )
    if ftype == fmt.T_DELTA:
        status = _str(obj["st"])
        if status not in STATUSES:
            raise RecordError(f"unknown delta status {status!r}")
        return Delta(
            _str(obj["id"]), status, _rcpts(obj["to"]), _str(obj["reply"]), _num(obj["ts"])
        )
    if ftype == fmt.T_FINISH:
        return Finish(
            _str(obj["id"]),  # msg_id
            _num(obj["ts"]),  # at
            BodyRef.from_obj(obj["body"]),  # body
            _outcomes(obj["out"]),  # outcomes
            _str(obj.get("why", "")),  # reason
            _str(obj["from"]) if "from" in obj else None,  # sender
            _num(obj["acc"]) if "acc" in obj else None,  # accepted_at
            Position.from_obj(obj["prom"]) if "prom" in obj else None,  # promoted_from
        )
    if ftype == fmt.T_CONTROL:
        action = _str(obj["act"])
        if action not in CONTROL_ACTIONS:
            raise RecordError(f"unknown control action {action!r}")
        return Control(
            action,
            _str(obj["tgt"]),
            _num(obj["ts"]),
            body=_int(obj.get("body", 0)),
            copy=_str(obj.get("copy", "")),
            lost=_str(obj.get("lost", "")),
            sup=_positions(obj.get("sup", [])),
            why=_str(obj.get("why", "")),
        )
    raise RecordError(f"frame type {ftype} carries no record")


def encode_body(msg_id: str, data: bytes) -> bytes:
    """BODY frame payload: the message id in ASCII (fixed length) followed by the data."""
    ident = msg_id.encode("ascii")
    assert len(ident) == fmt.MSG_ID_LENGTH, msg_id
    return ident + data


def decode_body(payload: bytes) -> tuple[str, bytes]:
    """(msg_id, data) of a BODY frame payload."""
    if len(payload) < fmt.MSG_ID_LENGTH:
        raise RecordError("body frame shorter than a message id")
    try:
        msg_id = payload[: fmt.MSG_ID_LENGTH].decode("ascii")
    except UnicodeDecodeError as exc:
        raise RecordError("body frame message id is not ASCII") from exc
    return msg_id, payload[fmt.MSG_ID_LENGTH :]
