"""Restart positions: where recovery and the queue runners start.

A small text file, ``positions``, in the one format of every metadata file
(``metafile.py``): a JSON object on one line, then a line ``crc32c <hex>`` over that JSON
line. Text on purpose: an operator can read it with ``cat``.

The file is only a hint about what is consistent. Stale positions make recovery scan
more; a missing or damaged file makes it scan from the oldest segment. It is never an
error to lose it.

Crash safety:
    (P1) Written only after an fdatasync covering everything up to ``consistent``: every
         position it names is inside the durable log.
    (P2) Replaced atomically (``metafile.replace_metafile``): write ``positions.tmp``,
         fdatasync it, rename it over ``positions``, fsync the directory. A crash before
         the rename leaves the old file (and a stray temp file, overwritten next time);
         after it, the new one.
    (P3) A segment the positions retire is deleted only after the directory fsync of P2.

Errors:
    ``load_positions`` returns None for a missing, damaged, or foreign file.
"""

from __future__ import annotations

from typing import Any

import attrs

from spool import format as fmt
from spool.fs import FileSystem
from spool.metafile import decode_metafile, encode_metafile, read_metafile, replace_metafile
from spool.records import Position, RecordError

POSITIONS_VERSION = 1
# Positions naming unsettled body files (``RestartPositions.unsettled``) say version 2: a
# build that predates the key reads only version 1, so it takes them for damaged and
# scans the whole log (finding the envelopes) instead of removing those files as an
# accept's leftovers.
POSITIONS_VERSION_UNSETTLED = 2


def pin_body(pins: dict[int, int], segment: int) -> None:
    """Count one more live message whose body is inline in ``segment``."""
    pins[segment] = pins.get(segment, 0) + 1


def unpin_body(pins: dict[int, int], segment: int) -> None:
    """Count one fewer, never below zero: a count that is already 0 (the pin of a body
    whose first envelope was never counted: a full scan that could not see it, or damage
    a repair set aside) must not stop the spool or cancel another message's pin. An
    undercount could free a live body's segment; this keeps the error on the side of
    keeping segments longer. The open spool (``body_keeping.py``) and recovery's replay
    (``recovery.py``) count through these two, so the two counts agree."""
    pins[segment] = max(pins.get(segment, 0) - 1, 0)


@attrs.frozen
class RestartPositions:
    """Everything recovery needs to avoid scanning the whole log.

    ``consistent``: the durable end of the log when written; a bad frame before it is
    corruption. ``working_start``: the earliest start record whose message had no
    replacement or finish yet (recovery scans from here). ``cursors``: one per retry
    class. ``superseded``: envelopes ahead of some runner that something other than that
    runner superseded. ``body_refs``: per segment, live messages whose body is inline
    there. ``front``: the true-garbage front; segments before its segment are deletable.
    ``outcome_front``: finish records before it have had their outcomes acknowledged;
    ``outcome_acked``: messages whose finish lies after the front and was acknowledged.
    ``retry_intervals``: the owner's, so that offline tools can tell when mail is due.
    ``settings``: a copy of the spool's recorded settings (``options.py``), from which
    ``spool check --repair`` restores a damaged settings file. ``unsettled``: messages
    whose body files stay in incoming/ though these positions pass their envelopes
    (something else stood in their way in bodies/): no leftovers, whatever recovery scans.
    """

    consistent: Position
    working_start: Position
    cursors: tuple[Position, ...]
    superseded: frozenset[Position]
    body_refs: dict[int, int]
    front: Position
    outcome_front: Position
    written_at: float
    outcome_acked: frozenset[str] = frozenset()
    retry_intervals: tuple[float, ...] = ()
    settings: dict[str, Any] = attrs.field(factory=dict, eq=False)
    unsettled: frozenset[str] = frozenset()

    def to_obj(self) -> dict[str, Any]:
        return {
            "version": POSITIONS_VERSION_UNSETTLED if self.unsettled else POSITIONS_VERSION,
            "consistent": self.consistent.to_list(),
            "working_start": self.working_start.to_list(),
            "cursors": [c.to_list() for c in self.cursors],
            "superseded": sorted(p.to_list() for p in self.superseded),
            "body_refs": {str(k): v for k, v in sorted(self.body_refs.items()) if v},
            "front": self.front.to_list(),
            "outcome_front": self.outcome_front.to_list(),
            "outcome_acked": sorted(self.outcome_acked),
            "retry_intervals": list(self.retry_intervals),
            "written_at": self.written_at,
            **({"settings": self.settings} if self.settings else {}),
            **({"unsettled": sorted(self.unsettled)} if self.unsettled else {}),
        }

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> RestartPositions:
        if obj.get("version") not in (POSITIONS_VERSION, POSITIONS_VERSION_UNSETTLED):
            raise RecordError(f"positions version {obj.get('version')!r}")
        return cls(
            consistent=Position.from_obj(obj["consistent"]),
            working_start=Position.from_obj(obj["working_start"]),
            cursors=tuple(Position.from_obj(c) for c in obj["cursors"]),
            superseded=frozenset(Position.from_obj(p) for p in obj["superseded"]),
            body_refs={int(k): int(v) for k, v in obj["body_refs"].items()},
            front=Position.from_obj(obj["front"]),
            outcome_front=Position.from_obj(obj["outcome_front"]),
            written_at=float(obj["written_at"]),
            outcome_acked=frozenset(str(m) for m in obj["outcome_acked"]),
            retry_intervals=tuple(float(i) for i in obj.get("retry_intervals", ())),
            settings=dict(obj.get("settings", {})),
            unsettled=_message_ids(obj.get("unsettled", ())),
        )


def _message_ids(values: Any) -> frozenset[str]:
    """``values`` as message ids (they name body file paths): anything else is damage."""
    ids = frozenset(values)
    if not all(isinstance(m, str) and fmt.is_message_id(m) for m in ids):
        raise RecordError("positions name something that is no message id")
    return ids


def encode_positions(positions: RestartPositions) -> bytes:
    return encode_metafile(positions.to_obj())


def decode_positions(raw: bytes) -> RestartPositions | None:
    """Parse a positions file; None if it is damaged in any way."""
    obj = decode_metafile(raw)
    if obj is None:
        return None
    try:
        return RestartPositions.from_obj(obj)
    except (ValueError, KeyError, TypeError, AttributeError, RecordError):
        return None


def load_positions(
    fs: FileSystem, root: str, name: str = fmt.POSITIONS_NAME
) -> RestartPositions | None:
    """Read ``<root>/positions`` (or ``<root>/<name>``); None when missing or damaged
    (recovery then scans all)."""
    raw = read_metafile(fs, root, name)
    return None if raw is None else decode_positions(raw)


def store_positions(fs: FileSystem, root: str, positions: RestartPositions) -> None:
    """Atomically replace ``<root>/positions`` (P2). The caller has done P1."""
    # A crash before the directory fsync inside may undo the rename: only the old
    # positions remain, which are stale but consistent (P1), so recovery merely scans more.
    replace_metafile(fs, root, fmt.POSITIONS_NAME, positions.to_obj())


def unretired(segments: list[int], positions: RestartPositions | None) -> list[int]:
    """``segments`` without the retired ones: those wholly behind the garbage front of
    durable ``positions``. They are leftovers of a deletion a crash interrupted (any subset
    of the unlinks may have happened, so they need not be contiguous) and hold only garbage;
    the next checkpoint deletes them. The newest segment is always kept."""
    if positions is None or not segments or positions.front.segment <= segments[0]:
        return segments
    return [s for s in segments if s >= positions.front.segment] or segments[-1:]
