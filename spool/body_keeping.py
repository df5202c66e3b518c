"""Bodies of an open spool: segment pins, body files on their way, free space.

A message's body is inline (a BODY frame after its first envelope, which pins that
segment: ``body_refs`` counts the live messages per segment) or in a body file
(``bodies.py``): in ``incoming/`` until a checkpoint covers the envelope naming it
(``staged``), then in ``bodies/``, and unlinked by the checkpoint after its message ended
(``doomed``). An inline body that would pin an old segment for long, or that a bounce will
need after the message ended, is copied to a body file once (*promotion*).

Free space: accepts are refused (``DiskFull``) before they would take the disk under
``min_free_bytes``, so that deliveries always have room for their records.

Not thread-safe on its own: every method runs with the spool's lock held (``state.py``),
except ``write_accepted_body``, which writes a new message's body file before the lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterable

from spool import records as rec
from spool.bodies import read_inline_body, write_body_file
from spool.errors import CorruptSpool, DiskFull, SegmentUnreadable, SpoolError, SpoolFailed
from spool.positions import pin_body, unpin_body
from spool.records import Position
from spool.state import SpoolState


def file_blocks(size: int) -> int:
    """What a body file of ``size`` bytes takes on disk at most: its header and data
    rounded up to whole 4 KiB blocks, and a block for its directory entry and inode."""
    block = 4096
    return -(-(size + 64) // block) * block + block


class BodyKeeper:
    """Segment pins, staged and doomed body files, and the free-space reserve."""

    def __init__(
        self,
        state: SpoolState,
        body_refs: dict[int, int],
        staged: Iterable[str],
        doomed: Iterable[str],
    ) -> None:
        self.state = state
        self.body_refs = dict(body_refs)  # live inline bodies per segment
        # Body files in incoming/ named by an appended envelope, with the log end after it:
        # moved to bodies/ by the first checkpoint whose positions cover that end.
        self.staged: dict[str, Position] = dict.fromkeys(staged, Position(0, 0))
        # Body files to unlink at the next checkpoint (their message ended).
        self.doomed: list[str] = list(doomed)
        # Free space: seen at the last look, and what accepts wrote since (``room_for``).
        self.free_checked_at = -1.0
        self._free_seen = 0
        self._written_since_look = 0

    def pin_inline(self, segment: int) -> None:
        """A new message's inline body lies in ``segment``."""
        pin_body(self.body_refs, segment)

    def reserve_space(self, need: int) -> None:
        """Refuse (``DiskFull``) an accept that would leave less than ``min_free_bytes``;
        nothing is written then."""
        if not self.room_for(need):
            raise DiskFull(
                f"free space in {self.state.path} would fall under min_free_bytes "
                f"({self.state.options.min_free_bytes}) with this message; new mail is "
                "refused for now (answer 452), deliveries go on and free space"
            )

    def room_for(self, need: int) -> bool:
        """Whether ``need`` more bytes leave at least ``min_free_bytes`` free; if so they are
        counted as written.

        The file system is asked at most every quarter second, and again whenever the
        estimate comes near the threshold; in between, what was written since the last look
        (accepts, body copies) is subtracted from what it showed, so no burst, however fast,
        runs past the threshold into ENOSPC. What is left is the reserve that deliveries
        write their records into.
        """
        reserve = self.state.options.min_free_bytes
        if reserve <= 0:
            return True
        now = time.monotonic()
        estimate = self._free_seen - self._written_since_look
        if now - self.free_checked_at > 0.25 or estimate - need < reserve:
            self._free_seen = estimate = self.state.fs.free_bytes(self.state.path)
            self._written_since_look = 0
            self.free_checked_at = now
        if estimate - need < reserve:
            return False
        self._written_since_look += need
        return True

    def write_accepted_body(self, msg_id: str, data: bytes) -> None:
        """Write a new message's body file to ``incoming/`` (durable on return, before the
        envelope naming it is appended: see bodies.py). Lock not held. A failure removes
        what was written (no envelope names it yet) and raises the typed error."""
        try:
            write_body_file(self.state.fs, self.state.incoming_dir, msg_id, data)
        except OSError as exc:
            raise self._body_write_failed(msg_id, exc) from exc

    def _body_write_failed(self, msg_id: str, exc: OSError) -> SpoolError:
        if exc.errno != errno.EEXIST:
            with contextlib.suppress(OSError):
                self.state.fs.unlink(os.path.join(self.state.incoming_dir, msg_id))
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull(
                f"no space in {self.state.body_dir} for the body of a new message; new mail "
                "is refused for now (answer 452), deliveries go on"
            )
        return SpoolFailed(f"writing a body file in {self.state.body_dir} failed: {exc}", exc.errno)

    def promote(
        self, env: rec.Envelope, body: rec.BodyRef, klass: int, held: str | None, now: float
    ) -> tuple[rec.BodyRef, Position | None]:
        """Copy an inline body to its own file if it would otherwise pin an old segment.

        The garbage front trails the head by about the longest retry interval; a message
        whose next attempt comes later than that after its body was written (or a held
        one) would hold the body's segment back. Its body is copied once to a body file,
        and replacement envelopes refer to the file from then on (no copy at each retry).
        Returns the reference the next envelope uses and, if it is a new copy, where the
        inline body was: the caller calls ``promoted`` once that envelope is queued (the
        inline body stays pinned until then, so a refused record changes nothing).
        """
        if body.kind != rec.BODY_INLINE:
            return body, None
        options = self.state.options
        due = now + options.interval(klass)
        if held is None and due - env.accepted_at <= options.longest_interval:
            return body, None
        if not self.room_for(file_blocks(body.size)):
            # The copy would eat into the reserve deliveries need: keep the body inline
            # (its segment stays pinned longer; nothing is lost); a later rewrite retries.
            return body, None
        return self._copy_to_file(env.msg_id, body)

    def finish_body(
        self, msg_id: str, body: rec.BodyRef, outcomes: tuple[rec.Outcome, ...]
    ) -> tuple[rec.BodyRef, Position | None]:
        """The body a finish names, and where the inline body was if it was copied.

        With outcome tracking, a message whose outcome names a failed recipient needs its
        body for the bounce: an inline one is copied to a body file (kept until the outcome
        is acknowledged; its segment is then free to go). Without room for the copy it stays
        inline, and lasts as long as its segment.
        """
        if (
            not self.state.options.outcomes
            or body.kind != rec.BODY_INLINE
            or not any(o.status == rec.FAILED for o in outcomes)
            or not self.room_for(file_blocks(body.size))
        ):
            return body, None
        return self._copy_to_file(msg_id, body)

    def _copy_to_file(self, msg_id: str, body: rec.BodyRef) -> tuple[rec.BodyRef, Position | None]:
        """Copy an inline body to ``incoming/<msg_id>``: the file's reference and where the
        inline body was, or the inline reference and None when it cannot be copied. The
        caller appends the record naming the copy, then calls ``promoted``."""
        if body.at is None:
            raise AssertionError("inline body reference not resolved")
        try:
            data = read_inline_body(
                self.state.fs,
                self.state.log_dir,
                msg_id,
                body.at,
                self.state.segment_files,
                body.size,
            )
        except CorruptSpool:
            # Damaged: left where it is, for `spool check` to find (a repair bounces it).
            return body, None
        except (SegmentUnreadable, OSError):
            # Its segment cannot be read now (permissions, an I/O error, no descriptor
            # left): the body stays inline, its segment pinned a while longer, and the
            # attempt closes as it would have (a later record tries the copy again).
            return body, None
        try:
            # Durable before the record naming it is appended (see bodies.py).
            ref = write_body_file(
                self.state.fs, self.state.incoming_dir, msg_id, data, replace=True
            )
        except OSError:
            # No room (or an I/O error) for the copy: keep the body inline. Its segment
            # stays pinned for longer, nothing is lost; a later record tries again. The
            # remains of the copy are removed (no record names them).
            with contextlib.suppress(OSError):
                self.state.fs.unlink(os.path.join(self.state.incoming_dir, msg_id))
            return body, None
        return ref, body.at

    def promoted(self, inline: rec.BodyRef, msg_id: str, end: Position) -> None:
        """A record naming the copy is queued (it ends at ``end``): the inline body is free,
        and the copy moves to bodies/ once a checkpoint covers the record."""
        self.staged[msg_id] = end
        # A file of that name doomed earlier (an orphan recovery found: a copy a crash cut
        # short before its record) is this copy now, written again: it must stay.
        if msg_id in self.doomed:  # rarely: no new list for every copy (a list scan in C)
            self.doomed = [m for m in self.doomed if m != msg_id]
        self.release_body(inline, msg_id)
        self.state.counts["bodies_promoted"] += 1

    def finished(self, finish: rec.Finish, end: Position, inline: rec.BodyRef) -> None:
        """A finish record ending at ``end`` is queued. ``inline`` is the body the message
        had; if the finish names a copy of it (``promoted_from``), the inline body is free
        and the copy is kept for the bounce; otherwise the body is released, unless a
        bounce may still need it (a body file with outcome tracking goes when the outcome
        is acknowledged)."""
        if finish.promoted_from is not None:
            self.promoted(inline, finish.msg_id, end)
        elif not (self.state.options.outcomes and finish.body.kind == rec.BODY_FILE):
            self.release_body(finish.body, finish.msg_id)

    def release_body(self, body: rec.BodyRef, msg_id: str) -> None:
        """The message no longer uses this body: unpin its segment or doom its file."""
        if body.kind == rec.BODY_INLINE:
            if body.at is None:
                raise AssertionError("inline body reference not resolved")
            unpin_body(self.body_refs, body.at.segment)
        else:
            # Unlinked at the next checkpoint, after the finish record is durable.
            self.doomed.append(msg_id)

    def live_pins(self) -> dict[int, int]:
        """The segments inline bodies pin, zero counts dropped (at a checkpoint)."""
        self.body_refs = {seg: n for seg, n in self.body_refs.items() if n > 0}
        return dict(self.body_refs)
