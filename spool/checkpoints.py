"""Checkpoints and garbage collection: restart positions, body removal, retired segments.

A checkpoint captures the positions (``positions.py``: where each runner is, the working
suffix, the garbage front, the outcome front), syncs the log up to them (P1), removes the
body files of ended messages, moves staged body files to ``bodies/``, stores the
positions (P2), and deletes or archives the segments wholly behind the garbage front (P3).
Each step says what a crash right there leaves and why recovery handles it.

Checkpoints run one at a time (the checkpoint lock, always taken before the spool's lock);
a background thread runs one every ``checkpoint_interval`` seconds or ``checkpoint_every``
records.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import attrs

from spool import format as fmt
from spool.attempts import AttemptBook
from spool.bodies import body_file_paths, copies_agree, is_body_entry, read_body_files
from spool.body_keeping import BodyKeeper
from spool.directory import archive_file
from spool.errors import SpoolError, SpoolFailed
from spool.outcomes import OutcomeReader
from spool.positions import RestartPositions, store_positions
from spool.reader import list_segments
from spool.records import Position
from spool.scheduling import Scheduler
from spool.state import SpoolState
from spool.writer import WAIT_MAX


class Checkpointer:
    """Writes restart positions and frees what they leave behind."""

    def __init__(
        self,
        state: SpoolState,
        scheduler: Scheduler,
        bodies: BodyKeeper,
        book: AttemptBook,
        outcomes: OutcomeReader,
        positions_current: bool,
        oldest_segment: int,
    ) -> None:
        self.state = state
        self.scheduler = scheduler
        self.bodies = bodies
        self.book = book
        self.outcomes = outcomes
        self.lock = threading.Lock()  # one checkpoint at a time; taken before state.lock
        # Whether the positions on disk still describe the log (nothing happened since).
        self.positions_current = positions_current
        # The oldest segment on disk at open: while the positions are current, a front
        # past it means segments to free, which only new positions may do (P2, P3).
        self.oldest_segment = oldest_segment
        self._thread: threading.Thread | None = None

    def checkpoint(self) -> RestartPositions:
        """Write restart positions now (after syncing what they describe); free space.
        Takes the checkpoint lock, then the spool's lock."""
        state, bodies, writer = self.state, self.bodies, self.state.writer
        with self.lock:
            with state.lock:
                state.check_open()
                self.book.close_abandoned()
                self.book.end_expired_leases()
                positions = self.capture_positions()
                if (
                    self.positions_current
                    and writer.untouched
                    and not (bodies.doomed or self.book.in_flight or bodies.staged)
                    and positions.front.segment <= self.oldest_segment
                ):
                    # Nothing happened since the positions on disk were written, and the
                    # runners and the outcome reader have freed no segment: writing them
                    # again would change nothing. (A front that moved past the oldest
                    # segment must be written, or a quiet spool keeps its space for ever.)
                    return positions
                self.positions_current = False
                doomed, bodies.doomed = bodies.doomed, []
                for msg_id in doomed:
                    bodies.staged.pop(msg_id, None)
                movable = [m for m, end in bodies.staged.items() if end <= positions.consistent]
                for msg_id in movable:
                    del bodies.staged[msg_id]
                self.scheduler.since_checkpoint = 0
            if writer.untouched:
                # The positions will point into this open's first segment: create it.
                # A crash right after leaves an empty segment, which recovery removes.
                writer.create_segment()
            writer.sync()  # (P1): everything before positions.consistent is durable
            try:
                self._remove_bodies(doomed)
                unsettled = self._settle_staged(movable)
                if unsettled:
                    # Named in the positions (recovery takes them for no leftovers) and
                    # tried again at the next checkpoint.
                    positions = attrs.evolve(positions, unsettled=frozenset(unsettled))
                    with state.lock:
                        bodies.staged.update(dict.fromkeys(unsettled, Position(0, 0)))
                store_positions(state.fs, state.path, positions)
                state.counts["checkpoints"] += 1
                self._collect_garbage(positions)
            except OSError as exc:
                # Nothing the log relies on: the old positions stay (a temp file is never
                # renamed after a failed sync) and the next checkpoint tries again.
                with state.lock:
                    bodies.doomed.extend(doomed)
                    bodies.staged.update(dict.fromkeys(movable, Position(0, 0)))
                raise SpoolFailed(
                    f"checkpoint of {state.path} failed: {exc.strerror or exc}", exc.errno
                ) from exc
            return positions

    def capture_positions(self) -> RestartPositions:
        """The positions that describe the log as queued so far. Lock held."""
        state = self.state
        tail = state.writer.tail
        cursors = self.scheduler.cursors()
        in_flight = self.book.in_flight.values()
        working = min((f.start_at for f in in_flight), default=tail)
        self.scheduler.prune_superseded(min(cursors))
        body_refs = self.bodies.live_pins()
        pinned = [Position(seg, 0) for seg in body_refs]
        # (G1) An attempt in flight needs the envelope it started from: recovery reads it
        # to write the replacement if the attempt never closes. Its start record comes
        # later (``working``), so the envelope's own position pins its segment.
        pinned.extend(f.envelope_at for f in in_flight)
        if state.options.outcomes:
            outcome_front = self.outcomes.front()
            acked = self.outcomes.acked_ahead()
            pinned.append(outcome_front)
        else:
            outcome_front, acked = tail, frozenset()
        intervals = state.options.retry_intervals
        return RestartPositions(
            consistent=tail,
            working_start=working,
            cursors=cursors,
            superseded=frozenset(self.scheduler.superseded),
            body_refs=body_refs,
            front=min([*cursors, working, *pinned]),
            outcome_front=outcome_front,
            written_at=state.now(),
            outcome_acked=acked,
            retry_intervals=intervals,
            settings={**state.options.settings(), "retry_intervals": list(intervals)},
        )

    def _remove_bodies(self, msg_ids: list[str]) -> None:
        """Unlink body files of finished messages (their finish records are durable now) and
        orphans recovery found, from incoming/ or bodies/."""
        fs = self.state.fs
        touched: set[str] = set()
        for msg_id in msg_ids:
            for path in self._own_body_files(msg_id):
                # A crash before the directory fsync may bring a file back: recovery
                # removes the bodies of the finishes (and acknowledgements) it scans, and
                # every file in incoming/ that no scanned envelope names.
                # A directory of that name is no body file: left for ``spool check``.
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    fs.unlink(path)
                    touched.add(os.path.dirname(path))
        for directory in sorted(touched):
            fs.fsync_dir(directory)

    def _own_body_files(self, msg_id: str) -> list[str]:
        """The names a finished message's body file goes by: both places, unless each
        holds something and they are not the spool's two copies of one body. Then only
        the body's own file (``read_body_files``): the other is not the spool's, which
        ``spool check`` names and the repair keeps in corrupt/; with two valid files
        that differ, which is the body cannot be told, so neither goes."""
        fs, root = self.state.fs, self.state.path
        both = body_file_paths(root, msg_id)
        if not all(fs.lexists(p) for p in both) or copies_agree(fs, root, msg_id):
            return list(both)
        try:
            _raw, path, two = read_body_files(fs, root, msg_id)
        except FileNotFoundError:
            return list(both)  # no file in either place: links or directories, no data
        return [] if two else [path]

    def _settle_staged(self, names: list[str]) -> list[str]:
        """Move body files from incoming/ to bodies/: their envelopes are durable (the log
        was synced up to past them) and the positions about to be written put them before
        the working suffix, which recovery no longer scans for orphans. Returns the body
        files that stay in incoming/ because something else is in their way in bodies/,
        which those positions must name (``RestartPositions.unsettled``)."""
        fs, incoming, bodies = self.state.fs, self.state.incoming_dir, self.state.body_dir
        unsettled = []
        for msg_id in names:
            staged = os.path.join(incoming, msg_id)
            if not is_body_entry(fs, staged):
                continue  # removed (its message finished), or no body file (a link)
            # A crash before the fsyncs may undo the rename: the file is back in incoming/,
            # and the positions that no longer scan its envelope are not written yet (they
            # come after these fsyncs), so recovery still finds the envelope naming it.
            if fs.lexists(os.path.join(bodies, msg_id)) and not copies_agree(
                fs, self.state.path, msg_id
            ):
                # Not the spool's copy: never moved over (``spool check`` names it).
                unsettled.append(msg_id)
                continue
            with contextlib.suppress(FileNotFoundError):  # removed: its message finished
                fs.rename(staged, os.path.join(bodies, msg_id))
        if names:
            fs.fsync_dir(bodies)
            fs.fsync_dir(incoming)
        return unsettled

    def _collect_garbage(self, positions: RestartPositions) -> None:
        """Delete (or archive) segments wholly behind the garbage front (P3)."""
        state = self.state
        log_dir = state.log_dir
        doomed = [s for s in list_segments(state.fs, log_dir) if s < positions.front.segment]
        # Their read descriptors first: a deleted file held open would keep its space.
        state.segment_files.retire_below(positions.front.segment)
        for seg in doomed:
            # The positions naming the front are durable (P2), so a crash at any point of
            # this loop leaves only retired segments, which recovery ignores and the next
            # checkpoint deletes (or archives) again.
            path = os.path.join(log_dir, fmt.segment_name(seg))
            if state.archive_path is not None:
                archive_file(state.fs, path, state.archive_path)
            else:
                state.fs.unlink(path)
            state.counts["segments_deleted"] += 1
        if doomed:
            state.fs.fsync_dir(log_dir)

    def start_background(self) -> None:
        """Start the thread that checkpoints every ``checkpoint_interval`` s or
        ``checkpoint_every`` records."""
        self._thread = threading.Thread(target=self._loop, name="spool-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # It waits on an event of its own, not on the spool's condition: that one is
        # notified for every durable batch and every closed attempt, and waking this
        # thread each time cost the callers a thread switch apiece.
        state = self.state
        due = state.checkpoint_due
        while True:
            deadline = time.monotonic() + state.options.checkpoint_interval
            while not due.is_set() and (left := deadline - time.monotonic()) > 0:
                due.wait(min(left, WAIT_MAX))
            due.clear()
            with state.lock:
                if state.closed:
                    return
            with contextlib.suppress(SpoolError):
                self.checkpoint()

    def join(self) -> None:
        """Wait for the background thread to end (after the spool is marked closed)."""
        if self._thread is not None:
            self._thread.join()
