"""Opening a spool: the directory, the owner lock, the settings, recovery, the pieces.

``open_spool`` does what ``Spool.open`` promises, in this order: an archive directory the
caller names must work; the spool directory is made or checked (``directory.py``); the
owner lock is taken (``lock.py``); the options are resolved against the recorded settings
and recorded if they changed (``options.py``); recovery runs (``recovery.py``); the pieces
of the open spool are built on what it found; recovery's decisions are appended and made
durable; the first checkpoint is written; the checkpoint thread starts. A failure at any
step stops what was started and releases the lock, and raises the typed error.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any

import attrs

from spool import format as fmt
from spool.attempts import AttemptBook
from spool.body_keeping import BodyKeeper
from spool.checkpoints import Checkpointer
from spool.clock import Clock, SpoolTime
from spool.directory import prepare_archive, prepare_directory
from spool.errors import CorruptSpool, DiskFull, SpoolError, SpoolFailed
from spool.fs import FileSystem
from spool.lock import OwnerLock
from spool.operator import OperatorDesk
from spool.options import RECORDED, SpoolOptions, archive_path, options_for_open, store_settings
from spool.outcome_desk import OutcomeDesk
from spool.outcomes import OutcomeReader
from spool.records import Position
from spool.recovery import RecoveryReport, recover
from spool.runners import Runner
from spool.scheduling import Scheduler
from spool.state import SpoolState
from spool.writer import LogWriter


@attrs.frozen
class OpenedSpool:
    """The pieces of an open spool, for the facade to hold."""

    owner: OwnerLock
    state: SpoolState
    recovery: RecoveryReport
    scheduler: Scheduler
    bodies: BodyKeeper
    book: AttemptBook
    desk: OperatorDesk
    outcome_desk: OutcomeDesk
    checkpointer: Checkpointer

    def close(self) -> None:
        """``Spool.close``: close the attempts in flight (their unreported recipients
        deferred), write a last checkpoint, stop the threads, release the lock. Goes on
        past a failed spool (recovery defers those attempts instead), so the lock is
        always released."""
        st = self.state
        if os.getpid() != st.pid:
            # A forked child: the files, the lock and the threads are the parent's. Touch
            # nothing (an unlock here would unlock the parent: flock belongs to the open
            # file description both share); just stop this copy from being used.
            st.closed = True
            return
        with st.lock:
            if st.closed:
                return
            # No attempt starts from here on: a claim waiting for a free slot would take
            # the one close_all frees while the lock is let go for the last checkpoint,
            # and its attempt would be left open (a crash to the next open).
            st.closing = True
            with contextlib.suppress(SpoolError):
                self.book.close_all()
        with contextlib.suppress(SpoolError):
            # What is still pending first (a deferral's replacement, the replacements of
            # the attempts just closed): its batch ends padded to a sector, and positions
            # captured after it name that end. Captured before it, they would end short of
            # the padding, and the next open would find a suffix to recover and start a
            # new segment for it. A crash here leaves the records durable or not, as any
            # group commit does.
            st.writer.sync()
            self.checkpointer.checkpoint()
        with st.lock:
            st.closed = True
            st.cond.notify_all()
        st.checkpoint_due.set()
        self.checkpointer.join()
        st.writer.close()
        self.scheduler.close()
        self.outcome_desk.reader.close()
        st.segment_files.close()
        self.owner.release()


def open_spool(
    path: str, fs: FileSystem, given: dict[str, Any], clock: Clock, *, repairing: bool = False
) -> OpenedSpool:
    """Open (creating or recovering) the spool at ``path``; see the module docstring.
    ``repairing``: the open of ``spool check --repair`` itself, which a repair in progress
    does not refuse."""
    named = given.get("archive_dir", RECORDED)
    if named is not RECORDED and named is not None:
        # An archive the caller names must work before anything is made or recorded.
        prepare_archive(fs, os.path.normpath(os.path.join(path, os.fspath(named))))
    prepare_directory(fs, path)
    owner = OwnerLock(fs, os.path.join(path, fmt.LOCK_NAME), path)
    started: list[Any] = []  # what a failed open must stop
    try:
        flag = os.path.join(path, fmt.REPAIRING_NAME)
        if not repairing and fs.exists(flag):
            # A repair stopped between its first change and its last settlement: a
            # message it would restore from the copy it kept might be lost to the owner's
            # checkpoints. Refused (nothing written) until a repair runs to its end.
            raise CorruptSpool(flag, 0, "a repair of this spool was interrupted")
        for name in (fmt.POSITIONS_NAME, fmt.SETTINGS_NAME):
            entry = os.path.join(path, name)
            if fs.exists(entry) and not fs.is_regular(entry):
                # Not one the spool wrote (a directory, a FIFO): its first checkpoint could
                # not replace it; `spool check` names it and the repair moves it aside. A
                # dangling or looping link reads as no file, and the rename replaces it.
                raise CorruptSpool(entry, 0, "not a regular file")
        options, changed = options_for_open(fs, path, given)
        archive = archive_path(path, options)
        if archive is not None:
            prepare_archive(fs, archive)  # refused before the settings are recorded
        if changed:
            try:
                # Atomic (options.py): a crash leaves the old settings or the new ones.
                store_settings(fs, path, options)
            except OSError as exc:
                raise SpoolFailed(
                    f"recording the settings of {path} failed: {exc.strerror or exc}",
                    exc.errno,
                ) from exc
        state = SpoolState(path, fs, options, SpoolTime(clock), archive)
        started.append(state.segment_files)  # recovery may read bodies through it
        try:
            return _recover_and_start(owner, state, started, settings_changed=changed)
        except OSError as exc:
            raise _environment_error(f"recovering {path}", exc) from exc
        except SpoolFailed as exc:
            # The writer's own failure (recovery's records, the first checkpoint): a full
            # disk is DiskFull here too, not "close and reopen".
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(
                    f"no space left while recovering {path}: free some space and open it again"
                ) from exc
            raise
    except BaseException:
        # The checkpoint thread starts last, so a failed open never has one.
        for part in started:
            with contextlib.suppress(Exception):
                part.close()
        owner.release()
        raise


def _recover_and_start(
    owner: OwnerLock, state: SpoolState, started: list[Any], settings_changed: bool
) -> OpenedSpool:
    options: SpoolOptions = state.options
    found = recover(state.fs, state.path, options=options, clock=state.time.now)
    # Everything recovery read was written by earlier opens, under their own clocks.
    state.time.epoch = Position(found.next_segment, 0)
    reader = OutcomeReader(state.fs, state.log_dir, found.outcome_front, found.outcome_acked)
    started.append(reader)
    runners = []
    for k in range(options.last_class + 1):
        runners.append(
            Runner(
                state.fs,
                state.log_dir,
                k,
                options.interval(k),
                k == options.last_class,
                found.cursors[k],
                state.time.written_at,
            )
        )
        started.append(runners[-1])
    scheduler = Scheduler(state, runners, found.superseded)
    state.writer = LogWriter(
        state.fs,
        state.log_dir,
        first_segment=found.next_segment,
        segment_size=options.segment_size,
        sync_every=options.sync_every,
        sync_interval=options.sync_interval,
        write_ahead=options.write_ahead,
        on_durable=scheduler.on_durable,
    )
    started.append(state.writer)
    bodies = BodyKeeper(state, found.body_refs, found.incoming_named, found.bodies_to_remove)
    book = AttemptBook(state, scheduler, bodies)
    # The positions (which carry a copy of the settings) need writing at this open only
    # if recovery or the settings changed what they describe.
    checkpointer = Checkpointer(
        state,
        scheduler,
        bodies,
        book,
        reader,
        positions_current=found.positions_current and not settings_changed,
        oldest_segment=found.oldest_on_disk,
    )
    if found.to_write:
        # Durable before the spool serves anything.
        with state.lock:
            end = book.append_recovered(found.to_write)
        if end is not None:
            state.writer.wait_durable(end)
    checkpointer.checkpoint()
    with state.lock:
        limit = state.writer.durable
        for runner in runners:
            runner.prime(limit, scheduler.pending_past)
    checkpointer.start_background()
    return OpenedSpool(
        owner=owner,
        state=state,
        recovery=found.report,
        scheduler=scheduler,
        bodies=bodies,
        book=book,
        desk=OperatorDesk(state, scheduler, bodies, book),
        outcome_desk=OutcomeDesk(state, scheduler, bodies, reader),
        checkpointer=checkpointer,
    )


def _environment_error(doing: str, exc: OSError) -> SpoolError:
    """The typed error for an OSError of the disk: ``DiskFull`` when out of space (free some
    and open again), ``SpoolFailed`` otherwise."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left while {doing}: free some space and open it again")
    return SpoolFailed(f"{doing} failed: {exc.strerror or exc}", exc.errno)
