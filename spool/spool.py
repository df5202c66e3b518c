"""The ``Spool`` facade: accept, claim, report, checkpoint. What delivery agents embed.

A ``Spool`` owns one spool directory (see ``lock.py``). Opening it runs recovery
(``recovery.py``), starts the log writer on a fresh segment (``writer.py``) and one queue
runner per retry class (``runners.py``). Everything is thread-safe: many threads accept,
many attempts are in flight at once.

Commit points (docs/design.md numbers the invariants):
    ``accept`` returns after the fdatasync covering the envelope (and its inline body, or
    after the body file's own fsyncs) returned: from then on no crash loses the message.
    ``Attempt.delivered``/``failed`` return after the fdatasync covering their delta:
    from then on no crash lets those recipients be attempted again.
    Start records, deferred deltas, replacement envelopes and finish records are
    bookkeeping: written without waiting, flushed with the next batch. A crash that loses
    them is repaired by recovery from the start record and the durable deltas.

Crash safety:
    The spool writes through the writer (log), ``bodies.py`` (large bodies),
    ``positions.py`` (restart positions) and the segment deletion in ``_collect_garbage``;
    each argues its own crash behaviour where it writes.

Errors:
    Bad input raises an ``InvalidMessage`` subclass before anything is written. Disk
    errors make the spool fail-stop (``SpoolFailed``); low free space refuses new mail
    with ``DiskFull`` while deliveries go on.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import enum
import errno
import itertools
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import attrs

from spool import format as fmt
from spool import records as rec
from spool.addresses import check_mailbox, check_sender, mailbox_key, needs_smtputf8
from spool.arguments import check_msg_id, check_seconds, check_text
from spool.bodies import body_file_paths, read_body, read_inline_body, write_body_file
from spool.clock import Clock, SpoolTime, SystemClock, as_clock
from spool.errors import (
    AttemptExpired,
    BadSpoolDirectory,
    BodyGone,
    CorruptSpool,
    DiskFull,
    InvalidMessage,
    MessageTooLarge,
    SpoolClosed,
    SpoolError,
    SpoolFailed,
    SpoolMisuse,
    UnknownMessage,
)
from spool.fs import FileSystem
from spool.lock import OwnerLock
from spool.options import (
    DEFAULT_ATTEMPT_TIMEOUT,
    RECORDED,
    Recorded,
    SpoolOptions,
    load_settings,
    resolve_options,
    store_settings,
)
from spool.outcomes import MessageOutcome, OutcomeReader
from spool.positions import RestartPositions, store_positions
from spool.queue_view import QueueEntry, history, live_messages
from spool.reader import list_segments, read_frame_at
from spool.records import Position
from spool.recovery import (
    ENVELOPE_LOST_REASON,
    RecoveredState,
    RecoveryReport,
    recover,
    resolve_body,
)
from spool.runners import NotDue, Runner
from spool.writer import WAIT_MAX, LogWriter, Part

UNREPORTED_REPLY: Final = "451 4.4.0 delivery attempt ended without a result"
EXPIRED_REPLY: Final = "554 5.4.7 message expired: too long in the queue"
DELETED_REPLY: Final = "message deleted by the operator (no bounce)"
BOUNCED_REPLY: Final = "554 5.0.0 delivery cancelled by the operator"
HELD_REASON: Final = "held by the operator"
LOCATE_RETRIES: Final = 20


class OperatorAction(enum.Enum):
    """What an operator can do to a queued message (``hold``, ``release``, ...)."""

    HOLD = "hold"
    RELEASE = "release"
    DELETE = "delete"  # silently: no bounce (postsuper -d, exim -Mrm)
    BOUNCE = "bounce"  # give up: the pending recipients fail, a bounce goes out (exim -Mg)
    RETRY = "retry"


# What an ended message's pending recipients become, with the reply a reason defaults to.
ENDINGS: Final = {
    OperatorAction.DELETE: (rec.DELETED, DELETED_REPLY),
    OperatorAction.BOUNCE: (rec.FAILED, BOUNCED_REPLY),
}


# The control record that makes an action on a message in flight durable.
IN_FLIGHT: Final = {
    OperatorAction.HOLD: rec.IN_FLIGHT_HOLD,
    OperatorAction.RELEASE: rec.IN_FLIGHT_RELEASE,
    OperatorAction.DELETE: rec.IN_FLIGHT_DELETE,
    OperatorAction.BOUNCE: rec.IN_FLIGHT_BOUNCE,
}


@attrs.frozen
class ActionResult:
    """What ``Spool.act`` did, message by message (ids in the order they were given)."""

    changed: tuple[str, ...]  # the action took effect (durable)
    unchanged: tuple[str, ...]  # nothing to do: already held, not deferred, ...
    unknown: tuple[str, ...]  # not in the spool (never was, or finished)
    refused: dict[str, str]  # the action does not apply (a release of mail not held): why


@attrs.define
class _ActionTally:
    changed: list[str] = attrs.Factory(list)
    unchanged: list[str] = attrs.Factory(list)
    unknown: list[str] = attrs.Factory(list)
    refused: dict[str, str] = attrs.Factory(dict)

    def add(self, msg_id: str, changed: bool | int) -> None:
        (self.changed if changed else self.unchanged).append(msg_id)

    def freeze(self) -> ActionResult:
        return ActionResult(
            tuple(self.changed), tuple(self.unchanged), tuple(self.unknown), dict(self.refused)
        )


@attrs.frozen
class MessageEnvelope:
    """What a delivery agent sees of a message it is attempting. Plain values only."""

    msg_id: str
    sender: str
    recipients: tuple[str, ...]
    attempts: int
    accepted_at: float
    body_size: int

    @property
    def smtputf8_recipients(self) -> tuple[str, ...]:
        """The recipients only an SMTPUTF8-capable next hop can take (RFC 6531): those
        with a non-ASCII local part, or every one when the sender has one. Send the others
        to any hop with their domains in A-labels (``spool.addresses.ascii_form``)."""
        if needs_smtputf8(self.sender):
            return self.recipients
        return tuple(r for r in self.recipients if needs_smtputf8(r))


@attrs.frozen
class SpoolStatistics:
    """Counters since open, for monitoring and the benchmarks."""

    accepted: int
    delivered: int
    failed: int
    deferred: int
    expired: int
    fsyncs: int
    batches: int
    frames: int
    frames_per_fsync_mean: float
    bytes_written: int
    segments: int
    segments_deleted: int
    in_flight: int
    checkpoints: int
    bodies_promoted: int
    deleted: int
    leases_expired: int  # attempts the spool closed past ``attempt_timeout``
    clock_skew: float  # wall clock minus the spool's time: how far it stepped (clock.py)


@attrs.define
class _InFlight:
    """Spool-side state of one attempt."""

    envelope: rec.Envelope
    envelope_at: Position
    body: rec.BodyRef
    start_at: Position
    unreported: set[str]
    outcomes: list[rec.Outcome]
    deferred: dict[str, str]
    started_at: float = 0.0  # the spool's time when the attempt started (its lease)
    closed: bool = False
    lease_expired: bool = False  # closed by the spool past ``attempt_timeout``
    hold: str | None = None  # operator hold requested while in flight
    # Operator delete or bounce requested while in flight: (status, reply) for the rest.
    delete: tuple[str, str] | None = None


class Attempt:
    """One delivery attempt on one message, handed out by ``Spool.claim``.

    Report each recipient once: ``delivered`` and ``failed`` are durable when they return,
    ``deferred`` is not (a deferred recipient is retried whatever happens). Leaving the
    ``with`` block (or ``close``) writes the replacement envelope for what remains, or the
    finish record. Recipients not reported by then count as deferred; so do those of an
    attempt that is garbage-collected without being closed. Thread-safe.
    """

    def __init__(self, spool: Spool, state: _InFlight) -> None:
        self._spool = spool
        self._state = state
        env = state.envelope
        self.envelope = MessageEnvelope(
            env.msg_id, env.sender, env.recipients, env.attempts, env.accepted_at, env.body.size
        )

    @property
    def msg_id(self) -> str:
        return self.envelope.msg_id

    def read_data(self) -> bytes:
        """The message body (header and data as accepted)."""
        self._spool._check_process()
        self._spool._check_attempt(self._state)
        return read_body(self._spool._fs, self._spool.path, self.msg_id, self._state.body)

    def delivered(self, recipients: Iterable[str], reply: str) -> None:
        """These recipients were delivered. Durable on return: never attempted again."""
        self._spool._report(self._state, rec.DELIVERED, recipients, reply)

    def failed(self, recipients: Iterable[str], reply: str) -> None:
        """These recipients failed permanently (5xx). Durable on return."""
        self._spool._report(self._state, rec.FAILED, recipients, reply)

    def deferred(self, recipients: Iterable[str], reply: str) -> None:
        """These recipients failed temporarily (4xx); they are retried later."""
        self._spool._report(self._state, rec.DEFERRED, recipients, reply)

    def close(self) -> None:
        """End the attempt (idempotent). Called by ``with``; see the class docstring."""
        self._spool._check_process()
        self._spool._close_attempt(self._state)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never take locks in a finalizer: hand the state to the spool, which closes it
        # from a normal thread (next claim, checkpoint or close).
        with contextlib.suppress(Exception):
            if not self._state.closed:
                self._spool._abandoned.append(self._state)


class Spool:
    """An open, owned spool directory. Create with ``Spool.open``."""

    def __init__(self, *_: object, **__: object) -> None:
        raise TypeError("use Spool.open(path, ...)")

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        retry_intervals: Iterable[float] | Recorded = RECORDED,
        max_lifetime: float | Recorded = RECORDED,
        crash_limit: int | Recorded = RECORDED,
        outcomes: bool | Recorded = RECORDED,
        archive_dir: str | os.PathLike[str] | Recorded | None = RECORDED,
        segment_size: int | Recorded = RECORDED,
        inline_body_max: int | Recorded = RECORDED,
        max_message_size: int | Recorded = RECORDED,
        max_recipients: int | Recorded = RECORDED,
        min_free_bytes: int | Recorded = RECORDED,
        max_in_flight: int = 10_000,
        sync_every: int = 1000,
        sync_interval: float = 1.0,
        checkpoint_interval: float = 30.0,
        checkpoint_every: int = 100_000,
        attempt_timeout: float = DEFAULT_ATTEMPT_TIMEOUT,
        clock: Clock | Callable[[], float] | None = None,
        fs: FileSystem | None = None,
    ) -> Spool:
        """Open (creating or recovering) the spool at ``path``. docs/api.md lists options.

        Sizes are in bytes, times in seconds. The spool's settings (the first group) default
        to the values the spool recorded, so every opener behaves as the owner does; naming
        one changes it for good (``options.py``). ``clock`` gives the wall and monotonic
        clocks (``clock.py`` says how the spool's time follows them); tests inject one.
        ``fs`` is the file-system seam.
        Raises ``SpoolMisuse`` for an invalid option before touching the directory.
        """
        given: dict[str, Any] = {
            "retry_intervals": retry_intervals,
            "max_lifetime": max_lifetime,
            "crash_limit": crash_limit,
            "outcomes": outcomes,
            "archive_dir": archive_dir,
            "segment_size": segment_size,
            "inline_body_max": inline_body_max,
            "max_message_size": max_message_size,
            "max_recipients": max_recipients,
            "min_free_bytes": min_free_bytes,
            "max_in_flight": max_in_flight,
            "sync_every": sync_every,
            "sync_interval": sync_interval,
            "checkpoint_interval": checkpoint_interval,
            "checkpoint_every": checkpoint_every,
            "attempt_timeout": attempt_timeout,
        }
        resolve_options({}, given)  # every value checked before the directory is touched
        if clock is None:
            clock = SystemClock()
        elif not isinstance(clock, Clock) and not callable(clock):
            raise SpoolMisuse(
                f"clock must be a Clock or a callable returning seconds, not {clock!r}"
            )
        self = object.__new__(cls)
        self._init(os.fspath(path), fs or FileSystem(), given, as_clock(clock))
        return self

    # --- opening -----------------------------------------------------------------------

    def _init(self, path: str, fs: FileSystem, given: dict[str, Any], clock: Clock) -> None:
        self.path = path
        self._fs = fs
        self._time = SpoolTime(clock)
        self._pid = os.getpid()
        self._log_dir = os.path.join(path, fmt.LOG_DIR)
        self._body_dir = os.path.join(path, fmt.BODY_DIR)
        self._incoming_dir = os.path.join(path, fmt.INCOMING_DIR)
        named = given.get("archive_dir", RECORDED)
        if named is not RECORDED and named is not None:
            # An archive the caller names must work before anything is made or recorded.
            self._prepare_archive(os.path.normpath(os.path.join(path, os.fspath(named))))
        self._prepare_directory()
        self._owner = OwnerLock(fs, os.path.join(path, fmt.LOCK_NAME), path)
        try:
            self.options = self._settle_options(given)
            try:
                self._recover_and_start()
            except OSError as exc:
                raise _environment_error(f"recovering {path}", exc) from exc
            except SpoolFailed as exc:
                # The writer's own failure (recovery's records, the first checkpoint): a
                # full disk is DiskFull here too, not "close and reopen".
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(
                        f"no space left while recovering {path}: free some space and open it again"
                    ) from exc
                raise
        except BaseException:
            self._abort_open()
            raise

    def _abort_open(self) -> None:
        """Undo a failed open: stop what was started, release the lock (never raises)."""
        # The checkpoint thread starts last, so a failed open never has one.
        parts = [getattr(self, "_writer", None), getattr(self, "_outcomes", None)]
        for part in [*parts, *getattr(self, "_runners", ())]:
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        self._owner.release()

    def _settle_options(self, given: dict[str, Any]) -> SpoolOptions:
        """The options of this open, with the settings recorded if they changed (lock held).

        Settings that cannot work (an archive directory that cannot be made) are refused
        before they are recorded, so a refused open changes nothing."""
        recorded = load_settings(self._fs, self.path)
        options = resolve_options(recorded, given)
        self.archive_path = (
            None
            if options.archive_dir is None
            else os.path.normpath(os.path.join(self.path, options.archive_dir))
        )
        if self.archive_path is not None:
            self._prepare_archive(self.archive_path)
        has_file = os.path.exists(os.path.join(self.path, fmt.SETTINGS_NAME))
        self._settings_changed = (
            not has_file or resolve_options(recorded, {}).settings() != options.settings()
        )
        if self._settings_changed:
            try:
                store_settings(self._fs, self.path, options)
            except OSError as exc:
                raise SpoolFailed(
                    f"recording the settings of {self.path} failed: {exc.strerror or exc}",
                    exc.errno,
                ) from exc
        return options

    @property
    def retry_intervals(self) -> tuple[float, ...]:
        """The retry classes' intervals after the first attempt (``options``)."""
        return self.options.retry_intervals

    @property
    def max_lifetime(self) -> float:
        return self.options.max_lifetime

    def _prepare_directory(self) -> None:
        """Create the spool directory (0700) or check an existing one is ours and private."""
        path = self.path
        try:
            st = os.stat(path)
        except NotADirectoryError:
            raise BadSpoolDirectory(path, "a component of the path is not a directory") from None
        except FileNotFoundError:
            parent = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(parent, mode=0o755, exist_ok=True)
                # A crash after this mkdir leaves an empty directory: a valid empty spool.
                # The new name is durable only once its parent directory is fsynced (fault
                # model 4); until then nothing is written inside, so a crash loses nothing
                # acknowledged.
                with contextlib.suppress(FileExistsError):  # another opener made it first
                    self._fs.mkdir(path, 0o700)
                self._fs.fsync_dir(parent)
            except OSError as exc:
                raise BadSpoolDirectory(path, f"cannot create it: {exc.strerror or exc}") from exc
            st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise BadSpoolDirectory(path, "exists and is not a directory")
        if st.st_uid != os.geteuid():
            raise BadSpoolDirectory(
                path, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
            )
        if st.st_mode & 0o022:
            raise BadSpoolDirectory(
                path, f"mode {stat.S_IMODE(st.st_mode):04o} lets others write; chmod 700 it"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise BadSpoolDirectory(path, "not writable by this user (read-only file system?)")
        for sub in (fmt.LOG_DIR, fmt.BODY_DIR, fmt.INCOMING_DIR):
            sub_path = os.path.join(path, sub)
            if not os.path.isdir(sub_path):
                # A crash before the fsync below may lose the new directory; the next open
                # creates it again. Nothing is written into it before this fsync returns.
                try:
                    with contextlib.suppress(FileExistsError):  # a racing opener made it
                        self._fs.mkdir(sub_path, 0o700)
                    self._fs.fsync_dir(path)
                except OSError as exc:
                    raise BadSpoolDirectory(
                        path, f"cannot create {sub}/: {exc.strerror or exc}"
                    ) from exc

    def _prepare_archive(self, archive_dir: str) -> None:
        """Create the archive directory (and its parents) if it does not exist yet."""
        if os.path.isdir(archive_dir):
            if not os.access(archive_dir, os.W_OK | os.X_OK):
                raise BadSpoolDirectory(archive_dir, "the archive directory is not writable")
            return
        if os.path.exists(archive_dir):
            raise BadSpoolDirectory(archive_dir, "the archive path exists and is not a directory")
        parent = os.path.dirname(os.path.abspath(archive_dir))
        try:
            os.makedirs(parent, mode=0o700, exist_ok=True)
            # Nothing is archived into it before this returns; a crash before the parent's
            # fsync may lose the new directory, and the next open creates it again.
            self._fs.mkdir(archive_dir, 0o700)
            self._fs.fsync_dir(parent)
        except OSError as exc:
            raise BadSpoolDirectory(
                archive_dir, f"cannot create the archive directory: {exc.strerror or exc}"
            ) from exc

    def _recover_and_start(self) -> None:
        options = self.options
        state = recover(self._fs, self.path, options=options, clock=self._time.now)
        # Everything recovery read was written by earlier opens, under their own clocks.
        self._time.epoch = Position(state.next_segment, 0)
        self.recovery: RecoveryReport = state.report
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._checkpoint_lock = threading.Lock()
        self._abandoned: collections.deque[_InFlight] = collections.deque()
        self._in_flight: dict[str, _InFlight] = {}
        self._superseded: set[Position] = state.superseded
        self._body_refs: dict[int, int] = dict(state.body_refs)
        self._first_segment = state.first_segment
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count(secrets.randbits(32))  # next() is atomic in CPython
        # Free space: seen at the last look, and what accepts wrote since (see
        # ``_reserve_space``).
        self._free_checked_at = -1.0
        self._free_seen = 0
        self._written_since_look = 0
        self._prefer_incoming = True
        self._deferred_turn = 0
        self._since_checkpoint = 0
        self._doomed_bodies: list[str] = list(state.bodies_to_remove)
        # Body files in incoming/ named by an appended envelope, with the log end after it:
        # moved to bodies/ by the first checkpoint whose positions cover that end.
        self._staged: dict[str, Position] = dict.fromkeys(state.incoming_named, Position(0, 0))
        self._outcomes = OutcomeReader(
            self._fs, self._log_dir, state.outcome_front, state.outcome_acked
        )
        self._fresh_envelopes: list[tuple[int, Position]] = []  # see _note_envelope
        self._writer = LogWriter(
            self._fs,
            self._log_dir,
            first_segment=state.next_segment,
            segment_size=options.segment_size,
            sync_every=options.sync_every,
            sync_interval=options.sync_interval,
            on_durable=self._on_durable,
        )
        self._runners = [
            Runner(
                self._fs,
                self._log_dir,
                k,
                options.interval(k),
                k == options.last_class,
                state.cursors[k],
                self._time.written_at,
            )
            for k in range(options.last_class + 1)
        ]

        # The positions (which carry a copy of the settings) need writing at this open
        # only if recovery or the settings changed what they describe.
        self._positions_current = state.positions_current and not self._settings_changed
        self._write_recovery_records(state)
        self.checkpoint()
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="spool-checkpoint", daemon=True
        )
        self._checkpointer.start()

    def _write_recovery_records(self, state: RecoveredState) -> None:
        """Append what recovery decided; durable before the spool serves anything."""
        if not state.to_write:
            return
        with self._lock:
            for r in state.to_write:
                if isinstance(r, rec.Envelope) and r.supersedes is not None:
                    self._superseded.add(r.supersedes)
                copied_from = None
                if isinstance(r, rec.Finish):
                    # As at the end of an attempt: a bounce's inline body is copied to a
                    # file (an orphan in incoming/ if a crash comes before the finish).
                    body, copied_from = self._finish_body(r.msg_id, r.body, r.outcomes)
                    r = attrs.evolve(r, body=body, promoted_from=copied_from)
                # A crash before these are durable leaves the same start records unsettled:
                # the next recovery decides them again (decision table, case R1/R2).
                _, end = self._enqueue(r)
                if isinstance(r, rec.Finish) and copied_from is not None:
                    self._promoted(
                        rec.BodyRef(rec.BODY_INLINE, r.body.size, copied_from), r.msg_id, end
                    )
                elif isinstance(r, rec.Finish):
                    self._release_finished_body(r)
        self._writer.wait_durable(end)

    # --- accepting ---------------------------------------------------------------------

    def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str:
        """Queue a message; return its id once it is on stable storage.

        Raises ``InvalidAddress``, ``MessageTooLarge`` or ``InvalidMessage`` for bad input
        and ``DiskFull`` under ``min_free_bytes``; in each case nothing is written.
        Thread-safe; concurrent calls share fsyncs.
        """
        self._check_process()
        check_sender(sender)
        rcpts = self._check_recipients(recipients)
        if not isinstance(data, bytes):
            raise InvalidMessage(f"data must be bytes, not {type(data).__name__}")
        if len(data) > self.options.max_message_size:
            raise MessageTooLarge(
                f"message of {len(data)} bytes exceeds max_message_size "
                f"({self.options.max_message_size} bytes)"
            )
        self._check_open()
        now = self._now()
        # Accept second, then a counter: unique among this owner's messages (2**32 a
        # second); the counter starts at random so that owners in the same second differ.
        msg_id = f"{int(now) & 0xFFFFFFFF:08X}{next(self._ids) & 0xFFFFFFFF:08X}"
        inline = len(data) <= self.options.inline_body_max
        body = rec.BodyRef(rec.BODY_INLINE if inline else rec.BODY_FILE, len(data))
        env = rec.Envelope(msg_id, sender, rcpts, accepted_at=now, written_at=now, body=body)
        try:
            parts = [self._encode(env)]  # checked before anything, the body file too, is written
        except SpoolMisuse as exc:
            raise MessageTooLarge(f"{exc}; send fewer recipients per message") from None
        if inline:
            parts.append((fmt.T_BODY, rec.encode_body(msg_id, data)))
        # Its frames (the body, inline or in its file, included) and a batch's padding.
        need = sum(len(p) + fmt.FRAME_HEADER_SIZE for _, p in parts) + 2 * fmt.SECTOR
        if not inline:
            with self._lock:
                self._reserve_space(need + file_blocks(len(data)))  # before the file
            self._writer.check_usable()  # a failed writer would leave the file an orphan
            try:
                write_body_file(self._fs, self._incoming_dir, msg_id, data)
            except OSError as exc:
                raise self._body_write_failed(msg_id, exc) from exc
        with self._lock:
            if inline:
                self._reserve_space(need)  # refused: nothing appended
            start, end = self._append(parts, env.klass)
            if inline:
                self._body_refs[start.segment] = self._body_refs.get(start.segment, 0) + 1
            else:
                self._staged[msg_id] = end
            self._counts["accepted"] += 1
        self._writer.wait_durable(end)  # the commit point of accept
        return msg_id

    def _body_write_failed(self, msg_id: str, exc: OSError) -> SpoolError:
        """The error for a body file that could not be written; its remains are removed
        (no envelope names it yet), so the refused accept changes nothing."""
        if exc.errno != errno.EEXIST:
            with contextlib.suppress(OSError):
                self._fs.unlink(os.path.join(self._incoming_dir, msg_id))
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull(
                f"no space in {self._body_dir} for the body of a new message; new mail is "
                "refused for now (answer 452), deliveries go on"
            )
        return SpoolFailed(f"writing a body file in {self._body_dir} failed: {exc}", exc.errno)

    def _check_recipients(self, recipients: Iterable[str]) -> tuple[str, ...]:
        if isinstance(recipients, str | bytes):
            raise InvalidMessage("recipients must be a list of addresses, not one string")
        if not isinstance(recipients, Iterable) or isinstance(recipients, dict):
            raise InvalidMessage(
                f"recipients must be a list of addresses, not {type(recipients).__name__}"
            )
        rcpts = tuple(recipients)
        if not rcpts:
            raise InvalidMessage("a message needs at least one recipient")
        if len(rcpts) > self.options.max_recipients:
            raise MessageTooLarge(
                f"{len(rcpts)} recipients exceed max_recipients ({self.options.max_recipients})"
            )
        for r in rcpts:
            check_mailbox(r)
        keys = [mailbox_key(r) for r in rcpts]
        if len(set(keys)) != len(keys):
            dupes = sorted({r for r, k in zip(rcpts, keys, strict=True) if keys.count(k) > 1})
            raise InvalidMessage(f"duplicate recipients: {', '.join(dupes)}")
        return rcpts

    def _reserve_space(self, need: int) -> None:
        """Refuse (``DiskFull``) an accept that would leave less than ``min_free_bytes``;
        nothing is written then. Lock held."""
        if not self._room_for(need):
            raise DiskFull(
                f"free space in {self.path} would fall under min_free_bytes "
                f"({self.options.min_free_bytes}) with this message; new mail is refused "
                "for now (answer 452), deliveries go on and free space"
            )

    def _room_for(self, need: int) -> bool:
        """Whether ``need`` more bytes leave at least ``min_free_bytes`` free; if so they are
        counted as written.

        The file system is asked at most every quarter second, and again whenever the
        estimate comes near the threshold; in between, what was written since the last look
        (accepts, body copies) is subtracted from what it showed, so no burst, however fast,
        runs past the threshold into ENOSPC. What is left is the reserve that deliveries
        write their records into. Lock held.
        """
        reserve = self.options.min_free_bytes
        if reserve <= 0:
            return True
        now = time.monotonic()
        estimate = self._free_seen - self._written_since_look
        if now - self._free_checked_at > 0.25 or estimate - need < reserve:
            self._free_seen = estimate = self._fs.free_bytes(self.path)
            self._written_since_look = 0
            self._free_checked_at = now
        if estimate - need < reserve:
            return False
        self._written_since_look += need
        return True

    # --- claiming ----------------------------------------------------------------------

    def claim(self, timeout: float | None = None) -> Attempt | None:
        """The next due message as an ``Attempt``, or None.

        With ``timeout`` (seconds) waits that long for work to become due. Fair between
        fresh and deferred mail; never hands a message to two attempts at once.
        """
        self._check_process()
        deadline = time.monotonic() + check_seconds(timeout, "timeout")
        synced = False
        while True:
            with self._lock:
                self._check_open()
                self._close_abandoned()
                attempt_or_wake = self._try_claim()
                if isinstance(attempt_or_wake, Attempt):
                    return attempt_or_wake
                behind = self._writer.durable < self._writer.tail
                left = deadline - time.monotonic()
                # One flush per call is enough for (R1); more would only add fsyncs while
                # other threads keep appending (later flushes wake this wait anyway).
                if not behind or synced:
                    if left <= 0:
                        return None
                    if attempt_or_wake is not None:
                        left = min(left, max(0.001, attempt_or_wake - self._time.now()))
                    self._cond.wait(min(left, WAIT_MAX))
                    continue
            # Runners read only the durable log. Replacement envelopes are written without
            # waiting; when nothing else is due, flush them so due mail is never missed.
            self._writer.sync()
            synced = True

    def attempts(self, poll: float = 1.0) -> Iterator[Attempt]:
        """Yield attempts forever, until the spool closes (for worker loops)."""
        check_seconds(poll, "poll")
        while True:
            try:
                attempt = self.claim(timeout=poll)
            except SpoolClosed:
                return
            if attempt is not None:
                yield attempt

    def _runner_order(self) -> list[Runner]:
        """Alternate fresh and deferred mail; round-robin among the deferred classes."""
        deferred = self._runners[1:]
        k = self._deferred_turn % len(deferred)
        rotated = deferred[k:] + deferred[:k]
        if self._prefer_incoming:
            return [self._runners[0], *rotated]
        return [*rotated, self._runners[0]]

    def _try_claim(self) -> Attempt | float | None:
        """Start an attempt, or return when the next envelope is due (None: no work known)."""
        if len(self._in_flight) >= self.options.max_in_flight:
            return None
        now = self._now()
        limit = self._writer.durable
        wake: float | None = None
        for runner in self._runner_order():
            while True:
                found = runner.next_due(now, limit, self._superseded, self._pending_past)
                if found is None:
                    break
                if isinstance(found, NotDue):
                    wake = found.at if wake is None else min(wake, found.at)
                    break
                pos, env, size = found
                if env.msg_id in self._in_flight:
                    continue
                if env.held is not None:
                    # Held mail waits for release, but must not pin its segment: the
                    # last runner, passing it, re-appends it at the head (envelope only).
                    self._reappend(pos, env, size, now)
                    continue
                state = self._start(pos, env, size, now)
                if self._time.accepted_at(pos, env) + self.max_lifetime <= now:
                    self._expire(state, now)
                    continue
                if runner.klass == 0:
                    self._prefer_incoming = False
                else:
                    self._prefer_incoming = True
                    self._deferred_turn = runner.klass
                return Attempt(self, state)
        return wake

    def _start(self, pos: Position, env: rec.Envelope, size: int, now: float) -> _InFlight:
        """Write the start record (supersedes the envelope) and track the attempt."""
        env = self._accepted_as_of_now(pos, env)
        body = resolve_body(env, pos, size)
        start = rec.Start(env.msg_id, pos, env.klass, now)
        # Not waited for: if a crash loses it, the envelope is still live and is attempted
        # again; deltas that depend on it come later in the log and so are lost with it.
        start_at, _ = self._enqueue(start)
        state = _InFlight(env, pos, body, start_at, set(env.recipients), [], {}, now)
        self._in_flight[env.msg_id] = state
        return state

    def _expire(self, state: _InFlight, now: float) -> None:
        """Fail every pending recipient of a message past ``max_lifetime``."""
        rcpts = tuple(sorted(state.unreported))
        self._enqueue(rec.Delta(state.envelope.msg_id, rec.FAILED, rcpts, EXPIRED_REPLY, now))
        state.outcomes.extend(rec.Outcome(r, rec.FAILED, EXPIRED_REPLY, now) for r in rcpts)
        state.unreported.clear()
        self._counts["expired"] += 1
        self._counts["failed"] += len(rcpts)
        self._settle(state, now, "expired")

    # --- reporting ---------------------------------------------------------------------

    def _check_attempt(self, state: _InFlight) -> None:
        self._check_open()
        if state.lease_expired:
            raise AttemptExpired(
                f"the attempt on {state.envelope.msg_id} ran past attempt_timeout "
                f"({self.options.attempt_timeout:g} s) and was closed as deferred; the "
                "message will be attempted again, so report nothing more for this attempt"
            )
        if state.closed:
            raise SpoolClosed(f"the attempt on {state.envelope.msg_id} is closed")

    def _report(self, state: _InFlight, status: str, recipients: Iterable[str], reply: str) -> None:
        self._check_process()
        if isinstance(recipients, str | bytes) or not isinstance(recipients, Iterable):
            raise SpoolMisuse("recipients must be a list of addresses, not one string")
        rcpts = tuple(recipients)
        if not all(isinstance(r, str) for r in rcpts):
            raise SpoolMisuse(f"recipients must be addresses (str): {rcpts!r}")
        check_text(reply, "reply")
        now = self._now()
        with self._lock:
            self._check_attempt(state)
            if not rcpts:
                raise SpoolMisuse("no recipients given")
            for r in rcpts:
                if r not in state.unreported:
                    known = r in state.envelope.recipients
                    why = "was already reported in this attempt" if known else "is not pending"
                    raise SpoolMisuse(f"recipient {r!r} {why} for {state.envelope.msg_id}")
            if len(set(rcpts)) != len(rcpts):
                raise SpoolMisuse("a recipient is listed twice")
            _, end = self._enqueue(rec.Delta(state.envelope.msg_id, status, rcpts, reply, now))
            state.unreported.difference_update(rcpts)
            if status == rec.DEFERRED:
                state.deferred.update(dict.fromkeys(rcpts, reply))
            else:
                state.outcomes.extend(rec.Outcome(r, status, reply, now) for r in rcpts)
            self._counts[status] += len(rcpts)
        if status != rec.DEFERRED:
            self._writer.wait_durable(end)  # the commit point of delivered()/failed()

    def _close_attempt(self, state: _InFlight) -> None:
        with self._lock:
            if state.closed or self._closed:
                return
            now = self._now()
            if state.unreported:
                rcpts = tuple(sorted(state.unreported))
                self._enqueue(
                    rec.Delta(state.envelope.msg_id, rec.DEFERRED, rcpts, UNREPORTED_REPLY, now)
                )
                state.deferred.update(dict.fromkeys(rcpts, UNREPORTED_REPLY))
                state.unreported.clear()
                self._counts["deferred"] += len(rcpts)
            # Not waited for: recovery rebuilds the same outcome from the durable deltas
            # and the operator's control records (an action taken in flight).
            self._settle(state, now, "all recipients settled")

    def _settle(self, state: _InFlight, now: float, reason: str) -> None:
        """Write the replacement envelope or the finish record; the attempt is over.

        Neither is waited for: until they are durable the start record is unsettled, and
        recovery rebuilds the same outcome from the envelope and the durable deltas.
        """
        env = state.envelope
        if state.delete is not None:
            self._end_rest(state, *state.delete, now)
            reason = (
                "deleted by the operator"
                if state.delete[0] == rec.DELETED
                else "bounced by the operator"
            )
        outcomes = env.outcomes + tuple(state.outcomes)
        remaining = tuple(r for r in env.recipients if r in state.deferred)
        record: rec.Record
        promoted_from = None
        if remaining:
            attempts = env.attempts + 1
            klass = (
                self.options.last_class if state.hold else self.options.class_for_attempts(attempts)
            )
            body, promoted_from = self._promote(env, state.body, klass, state.hold, now)
            record = rec.Envelope(
                msg_id=env.msg_id,
                sender=env.sender,
                recipients=remaining,
                accepted_at=env.accepted_at,
                written_at=now,
                body=body,
                attempts=attempts,
                klass=klass,
                held=state.hold,
                crashes=0,
                supersedes=state.envelope_at,
                outcomes=outcomes,
                last_reply=state.deferred[remaining[-1]],
                promoted_from=promoted_from,
            )
        else:
            body, promoted_from = self._finish_body(env.msg_id, state.body, outcomes)
            record = rec.Finish(
                env.msg_id,
                now,
                body,
                outcomes,
                reason,
                env.sender,
                env.accepted_at,
                promoted_from,
            )
        _, end = self._enqueue(record)
        if promoted_from is not None:
            self._promoted(state.body, env.msg_id, end)
        elif isinstance(record, rec.Finish):
            self._release_finished_body(record)
        state.closed = True
        del self._in_flight[env.msg_id]
        self._cond.notify_all()

    def _end_rest(self, state: _InFlight, status: str, reply: str, now: float) -> None:
        """End every recipient still pending or deferred in this attempt (operator delete:
        ``deleted``, no bounce; operator bounce: ``failed``)."""
        rcpts = tuple(sorted(state.unreported | set(state.deferred)))
        if not rcpts:
            return
        self._enqueue(rec.Delta(state.envelope.msg_id, status, rcpts, reply, now))
        state.outcomes.extend(rec.Outcome(r, status, reply, now) for r in rcpts)
        state.unreported.clear()
        state.deferred.clear()
        if status == rec.FAILED:
            self._counts["failed"] += len(rcpts)

    def _promote(
        self, env: rec.Envelope, body: rec.BodyRef, klass: int, held: str | None, now: float
    ) -> tuple[rec.BodyRef, Position | None]:
        """Copy an inline body to its own file if it would otherwise pin an old segment.

        The garbage front trails the head by about the longest retry interval; a message
        whose next attempt comes later than that after its body was written (or a held
        one) would hold the body's segment back. Its body is copied once to a body file,
        and replacement envelopes refer to the file from then on (no copy at each retry).
        Returns the reference the next envelope uses and, if it is a new copy, where the
        inline body was: the caller calls ``_promoted`` once that envelope is queued (the
        inline body stays pinned until then, so a refused record changes nothing).
        """
        if body.kind != rec.BODY_INLINE:
            return body, None
        due = now + self.options.interval(klass)
        if held is None and due - env.accepted_at <= self.options.longest_interval:
            return body, None
        assert body.at is not None
        if not self._room_for(file_blocks(body.size)):
            # The copy would eat into the reserve deliveries need: keep the body inline
            # (its segment stays pinned longer; nothing is lost); a later rewrite retries.
            return body, None
        return self._copy_to_file(env.msg_id, body)

    def _copy_to_file(self, msg_id: str, body: rec.BodyRef) -> tuple[rec.BodyRef, Position | None]:
        """Copy an inline body to ``incoming/<msg_id>``: the file's reference and where the
        inline body was, or the inline reference and None when it cannot be copied. Lock
        held; the caller appends the record naming the copy, then calls ``_promoted``."""
        assert body.at is not None
        try:
            data = read_inline_body(self._fs, self._log_dir, msg_id, body.at)
        except CorruptSpool:
            # Damaged: left where it is, for `spool check` to find (a repair bounces it).
            return body, None
        try:
            # Durable before the record naming it is appended (see bodies.py).
            ref = write_body_file(self._fs, self._incoming_dir, msg_id, data, replace=True)
        except OSError:
            # No room (or an I/O error) for the copy: keep the body inline. Its segment
            # stays pinned for longer, nothing is lost; a later record tries again. The
            # remains of the copy are removed (no record names them).
            with contextlib.suppress(OSError):
                self._fs.unlink(os.path.join(self._incoming_dir, msg_id))
            return body, None
        return ref, body.at

    def _finish_body(
        self, msg_id: str, body: rec.BodyRef, outcomes: tuple[rec.Outcome, ...]
    ) -> tuple[rec.BodyRef, Position | None]:
        """The body a finish names, and where the inline body was if it was copied.

        With outcome tracking, a message whose outcome names a failed recipient needs its
        body for the bounce: an inline one is copied to a body file (kept until the outcome
        is acknowledged; its segment is then free to go). Without room for the copy it stays
        inline, and lasts as long as its segment. Lock held.
        """
        if (
            not self.options.outcomes
            or body.kind != rec.BODY_INLINE
            or not any(o.status == rec.FAILED for o in outcomes)
            or not self._room_for(file_blocks(body.size))
        ):
            return body, None
        return self._copy_to_file(msg_id, body)

    def _release_finished_body(self, finish: rec.Finish) -> None:
        """The message is finished: free its body, unless a bounce may still need it (a body
        file with outcome tracking goes when the outcome is acknowledged). Lock held."""
        if self.options.outcomes and finish.body.kind == rec.BODY_FILE:
            return
        self._release_body(finish.body, finish.msg_id)

    def _promoted(self, inline: rec.BodyRef, msg_id: str, end: Position) -> None:
        """A record naming the copy is queued (it ends at ``end``): the inline body is free,
        and the copy moves to bodies/ once a checkpoint covers the record."""
        self._staged[msg_id] = end
        self._release_body(inline, msg_id)
        self._counts["bodies_promoted"] += 1

    def _release_body(self, body: rec.BodyRef, msg_id: str) -> None:
        """The message no longer uses this body: unpin its segment or doom its file."""
        if body.kind == rec.BODY_INLINE:
            assert body.at is not None, "inline body reference not resolved"
            seg = body.at.segment
            # Never below zero, never a KeyError: a count that is already 0 (a spool whose
            # pins were rebuilt by a full scan that could not see every first envelope)
            # must not stop the spool; an undercount can only keep segments longer.
            self._body_refs[seg] = max(self._body_refs.get(seg, 0) - 1, 0)
        else:
            # Unlinked at the next checkpoint, after the finish record is durable.
            self._doomed_bodies.append(msg_id)

    def _reappend(self, pos: Position, env: rec.Envelope, size: int, now: float) -> None:
        """Copy a held envelope to the head of the log so that its segment can go."""
        env = self._accepted_as_of_now(pos, env)
        old = resolve_body(env, pos, size)
        body, promoted_from = self._promote(env, old, env.klass, env.held, now)
        # Not waited for: if lost, the old envelope is still live and is re-appended again.
        _, end = self._enqueue(
            attrs.evolve(
                env, written_at=now, body=body, supersedes=pos, promoted_from=promoted_from
            )
        )
        if promoted_from is not None:
            self._promoted(old, env.msg_id, end)

    def _encode(self, record: rec.Record) -> Part:
        """``record`` encoded (frame type and payload), checked to fit one frame.

        Every call encodes what it writes before it changes any state, so a record that
        cannot be written refuses the call and changes nothing. The limits on what callers
        give (options.py: recipients, text sizes) keep every record inside a frame; this
        check makes sure, with a typed error rather than an assertion. An envelope whose
        acceptance was stamped after this write (by an earlier open's clock) is written
        with the write's time as its acceptance (``clock.py``).
        """
        if isinstance(record, rec.Envelope) and record.accepted_at > record.written_at:
            record = attrs.evolve(record, accepted_at=record.written_at)
        ftype, payload = rec.encode(record)
        if len(payload) > fmt.FRAME_PAYLOAD_MAX:
            subject = record.target if isinstance(record, rec.Control) else record.msg_id
            raise SpoolMisuse(
                f"the {fmt.TYPE_NAMES[ftype]} record of {subject} needs {len(payload)} bytes, "
                f"over the frame limit ({fmt.FRAME_PAYLOAD_MAX})"
            )
        return ftype, payload

    def _enqueue(self, record: rec.Record) -> tuple[Position, Position]:
        """Encode and queue one record (not waited for). Lock held."""
        part = self._encode(record)
        return self._append([part], record.klass if isinstance(record, rec.Envelope) else None)

    def _append(self, parts: list[Part], envelope_class: int | None) -> tuple[Position, Position]:
        """Queue encoded records; every record reaches the writer through here. Counts
        toward the next checkpoint, and counts an envelope (``envelope_class``) for its
        runner. Lock held."""
        self._since_checkpoint += 1
        if self._since_checkpoint == self.options.checkpoint_every:
            self._cond.notify_all()
        start, end = self._writer.enqueue(parts)
        if envelope_class is not None:
            self._note_envelope(envelope_class, start)
        return start, end

    def _note_envelope(self, klass: int, at: Position) -> None:
        """Count an appended envelope for the runner of its class (runners.py: idle runners
        skip to the head). Every envelope appended must come through here. Lock held."""
        owner = min(klass, self.options.last_class)
        self._runners[owner].appended()
        self._fresh_envelopes.append((owner, at))

    def _pending_past(self, owner: int, limit: Position) -> int:
        """How many envelopes of runner ``owner`` were appended at or after ``limit`` (only
        not-yet-durable ones are still listed; older ones are behind it). Lock held."""
        return sum(1 for k, at in self._fresh_envelopes if k == owner and at >= limit)

    def _close_abandoned(self) -> None:
        while self._abandoned:
            self._close_attempt(self._abandoned.popleft())

    def _end_expired_leases(self) -> None:
        """Close every attempt open longer than ``attempt_timeout`` as deferred (its
        unreported recipients deferred, as a close does): a hung worker must not pin the
        log. Later reports on it raise ``AttemptExpired``. Lock held."""
        deadline = self._now() - self.options.attempt_timeout
        for state in [s for s in self._in_flight.values() if s.started_at <= deadline]:
            self._close_attempt(state)
            state.lease_expired = True
            self._counts["leases_expired"] += 1

    # --- checkpoints and garbage -------------------------------------------------------

    def checkpoint(self) -> RestartPositions:
        """Write restart positions now (after syncing what they describe); free space.

        Thread-safe; checkpoints run one at a time. Also run every ``checkpoint_interval``
        seconds and every ``checkpoint_every`` records by a background thread.
        """
        self._check_process()
        with self._checkpoint_lock:
            with self._lock:
                self._check_open()
                self._close_abandoned()
                self._end_expired_leases()
                positions = self._capture_positions()
                if (
                    self._positions_current
                    and self._writer.untouched
                    and not (self._doomed_bodies or self._in_flight or self._staged)
                ):
                    # Nothing happened since the positions on disk were written: they
                    # still describe the log; writing them again would change nothing.
                    return positions
                self._positions_current = False
                doomed, self._doomed_bodies = self._doomed_bodies, []
                for msg_id in doomed:
                    self._staged.pop(msg_id, None)
                movable = [m for m, end in self._staged.items() if end <= positions.consistent]
                for msg_id in movable:
                    del self._staged[msg_id]
                self._since_checkpoint = 0
            if self._writer.untouched:
                # The positions will point into this open's first segment: create it.
                # A crash right after leaves an empty segment, which recovery removes.
                self._writer.create_segment()
            self._writer.sync()  # (P1): everything before positions.consistent is durable
            try:
                self._remove_bodies(doomed)
                self._settle_staged(movable)
                store_positions(self._fs, self.path, positions)
                self._counts["checkpoints"] += 1
                self._collect_garbage(positions)
            except OSError as exc:
                # Nothing the log relies on: the old positions stay (a temp file is never
                # renamed after a failed sync) and the next checkpoint tries again.
                with self._lock:
                    self._doomed_bodies.extend(doomed)
                    self._staged.update(dict.fromkeys(movable, Position(0, 0)))
                raise SpoolFailed(
                    f"checkpoint of {self.path} failed: {exc.strerror or exc}", exc.errno
                ) from exc
            return positions

    def _capture_positions(self) -> RestartPositions:
        tail = self._writer.tail
        cursors = tuple(r.cursor for r in self._runners)
        working = min((s.start_at for s in self._in_flight.values()), default=tail)
        low = min(cursors)
        self._superseded = {p for p in self._superseded if p >= low}
        self._body_refs = {seg: n for seg, n in self._body_refs.items() if n > 0}
        pinned = [Position(seg, 0) for seg in self._body_refs]
        # (G1) An attempt in flight needs the envelope it started from: recovery reads it
        # to write the replacement if the attempt never closes. Its start record comes
        # later (``working``), so the envelope's own position pins its segment.
        pinned.extend(s.envelope_at for s in self._in_flight.values())
        if self.options.outcomes:
            outcome_front = self._outcomes.front()
            acked = self._outcomes.acked_ahead()
            pinned.append(outcome_front)
        else:
            outcome_front, acked = tail, frozenset()
        return RestartPositions(
            consistent=tail,
            working_start=working,
            cursors=cursors,
            superseded=frozenset(self._superseded),
            body_refs=dict(self._body_refs),
            front=min([*cursors, working, *pinned]),
            outcome_front=outcome_front,
            written_at=self._now(),
            outcome_acked=acked,
            retry_intervals=self.retry_intervals,
            settings={**self.options.settings(), "retry_intervals": list(self.retry_intervals)},
        )

    def _remove_bodies(self, msg_ids: list[str]) -> None:
        """Unlink body files of finished messages (their finish records are durable now) and
        orphans recovery found, from incoming/ or bodies/."""
        touched: set[str] = set()
        for msg_id in msg_ids:
            for path in body_file_paths(self.path, msg_id):
                # A crash before the directory fsync may bring a file back: recovery
                # removes the bodies of the finishes (and acknowledgements) it scans, and
                # every file in incoming/ that no scanned envelope names.
                with contextlib.suppress(FileNotFoundError):
                    self._fs.unlink(path)
                    touched.add(os.path.dirname(path))
        for directory in sorted(touched):
            self._fs.fsync_dir(directory)

    def _settle_staged(self, names: list[str]) -> None:
        """Move body files from incoming/ to bodies/: their envelopes are durable (the log
        was synced up to past them) and the positions about to be written put them before
        the working suffix, which recovery no longer scans for orphans."""
        for msg_id in names:
            # A crash before the fsyncs may undo the rename: the file is back in incoming/,
            # and the positions that no longer scan its envelope are not written yet (they
            # come after these fsyncs), so recovery still finds the envelope naming it.
            with contextlib.suppress(FileNotFoundError):  # removed: its message finished
                self._fs.rename(
                    os.path.join(self._incoming_dir, msg_id), os.path.join(self._body_dir, msg_id)
                )
        if names:
            self._fs.fsync_dir(self._body_dir)
            self._fs.fsync_dir(self._incoming_dir)

    def _collect_garbage(self, positions: RestartPositions) -> None:
        """Delete (or archive) segments wholly behind the garbage front (P3)."""
        doomed = [s for s in list_segments(self._fs, self._log_dir) if s < positions.front.segment]
        for seg in doomed:
            # The positions naming the front are durable (P2), so a crash at any point of
            # this loop leaves only retired segments, which recovery ignores and the next
            # checkpoint deletes (or archives) again.
            path = os.path.join(self._log_dir, fmt.segment_name(seg))
            if self.archive_path is not None:
                archive_file(self._fs, path, self.archive_path)
            else:
                self._fs.unlink(path)
            self._counts["segments_deleted"] += 1
        if doomed:
            self._fs.fsync_dir(self._log_dir)
            self._first_segment = positions.front.segment

    def _checkpoint_loop(self) -> None:
        """Background checkpoints: every ``checkpoint_interval`` s or ``checkpoint_every``
        records."""
        while True:
            with self._lock:
                self._cond.wait_for(
                    lambda: self._closed or self._since_checkpoint >= self.options.checkpoint_every,
                    timeout=self.options.checkpoint_interval,
                )
                if self._closed:
                    return
            with contextlib.suppress(SpoolError):
                self.checkpoint()

    # --- outcomes ------------------------------------------------------------------------

    def next_outcome(self, timeout: float | None = None) -> MessageOutcome | None:
        """The next finished message whose outcome is not yet acknowledged, or None.

        Needs ``Spool.open(..., outcomes=True)``. Acknowledge it with ``ack_outcome`` once
        its bounce is sent; until then it is handed out again after a restart.
        """
        self._check_process()
        self._check_outcomes()
        deadline = time.monotonic() + check_seconds(timeout, "timeout")
        while True:
            with self._lock:
                self._check_open()
                outcome = self._outcomes.next(self._writer.durable)
                behind = self._writer.durable < self._writer.tail
                left = deadline - time.monotonic()
                if outcome is not None:
                    return outcome
                if not behind:
                    if left <= 0:
                        return None
                    self._cond.wait(min(left, WAIT_MAX))
                    continue
            # Finish records are bookkeeping, written without waiting; an outcome is
            # handed out only once its finish is durable, so flush them now.
            self._writer.sync()

    def outcomes(self, poll: float = 1.0) -> Iterator[MessageOutcome]:
        """Yield outcomes forever, until the spool closes."""
        check_seconds(poll, "poll")
        while True:
            try:
                outcome = self.next_outcome(timeout=poll)
            except SpoolClosed:
                return
            if outcome is not None:
                yield outcome

    def ack_outcome(self, msg_id: str) -> None:
        """Acknowledge an outcome handed out by ``next_outcome``. Durable on return.

        ``UnknownMessage`` if no outcome of ``msg_id`` is waiting for an acknowledgement.
        """
        self._check_process()
        self._check_outcomes()
        check_msg_id(msg_id)
        with self._lock:
            self._check_open()
            if not self._outcomes.waiting(msg_id):
                raise UnknownMessage(msg_id, "the outcomes waiting for an acknowledgement")
            part = self._encode(rec.Control(rec.OUTCOME_ACK, msg_id, self._now()))
            body = self._outcomes.ack(msg_id)
            _, end = self._append([part], None)
            if body.kind == rec.BODY_FILE:
                # Unlinked at the next checkpoint, after the acknowledgement is durable; a
                # crash first leaves the file for recovery, which removes the bodies of
                # acknowledgements it scans.
                self._doomed_bodies.append(msg_id)
        self._writer.wait_durable(end)

    def outcome_body(self, outcome: MessageOutcome) -> bytes:
        """The message an outcome is about, as accepted, for the bounce to return.

        Kept until the outcome is acknowledged when it is in a file, as it always is for an
        outcome that names a failed recipient (unless the disk was too full to copy it);
        ``BodyGone`` once it is no longer kept.
        """
        self._check_process()
        self._check_outcomes()
        if not isinstance(outcome, MessageOutcome):
            raise SpoolMisuse(f"outcome must be a MessageOutcome, not {outcome!r}")
        body = outcome.body
        if body is None or outcome.reason == ENVELOPE_LOST_REASON:
            raise BodyGone(outcome.msg_id, "it was lost with its envelope")
        with self._lock:
            self._check_open()
            kept = self._outcomes.waiting(outcome.msg_id)
        try:
            return read_body(self._fs, self.path, outcome.msg_id, body)
        except CorruptSpool as exc:
            if kept and body.kind == rec.BODY_FILE:
                raise  # it must be there: damage, not age
            why = "its outcome was acknowledged" if not kept else "its log segment was removed"
            raise BodyGone(outcome.msg_id, why) from exc

    def _check_outcomes(self) -> None:
        if not self.options.outcomes:
            raise SpoolMisuse(
                f"outcomes are not tracked in {self.path}: open it with outcomes=True once "
                "(the setting is recorded in the spool)"
            )

    # --- operator actions ----------------------------------------------------------------

    def list(self) -> Iterator[QueueEntry]:
        """The live messages (walks the live part of the log; for operators, not hot paths)."""
        self._check_process()
        self.sync()
        intervals = self.options.class_intervals()
        entries = live_messages(self._fs, self.path, intervals)
        with self._lock:
            active = set(self._in_flight)
        for entry in sorted(entries.values(), key=lambda e: (e.accepted_at, e.msg_id)):
            if entry.msg_id in active and entry.state != "active":
                entry = attrs.evolve(entry, state="active")
            yield entry

    def show(self, msg_id: str) -> builtins.list[tuple[Position, rec.Record]]:
        """Every record of ``msg_id`` still in the log. ``UnknownMessage`` if there is none."""
        check_msg_id(msg_id)
        self.sync()
        found = history(self._fs, self.path, msg_id)
        if not found:
            raise UnknownMessage(msg_id)
        return found

    def hold(self, msg_id: str, reason: str = HELD_REASON) -> None:
        """Stop attempting ``msg_id`` until ``release``. Durable on return.

        ``UnknownMessage`` if it is not in the spool; ``SpoolMisuse`` for a ``reason`` that is
        not a non-empty text of at most ``TEXT_MAX`` bytes (nothing is written then).
        """
        self._operator_action(msg_id, OperatorAction.HOLD, check_text(reason, "hold reason"))

    def release(self, msg_id: str) -> None:
        """Release a held message; it is due at once. ``SpoolMisuse`` if it is not held."""
        self._operator_action(msg_id, OperatorAction.RELEASE, None)

    def delete(self, msg_id: str, reason: str = DELETED_REPLY) -> None:
        """Remove ``msg_id`` silently, as ``postsuper -d`` does: its pending recipients end
        ``deleted`` (no bounce: its outcome names no failed recipient), with ``reason``.

        A message in flight is finished when its attempt ends: recipients it reports
        delivered or failed keep that outcome, the rest are deleted. Durable on return,
        in flight too (a control record; recovery applies it if a crash ends the attempt).
        """
        self._operator_action(msg_id, OperatorAction.DELETE, check_text(reason, "delete reason"))

    def bounce(self, msg_id: str, reason: str = BOUNCED_REPLY) -> None:
        """Give up on ``msg_id``, as ``exim -Mg`` does: its pending recipients fail with
        ``reason`` (a 5xx reply a bounce quotes), so its outcome asks for a bounce.

        In flight, as ``delete``.
        """
        self._operator_action(msg_id, OperatorAction.BOUNCE, check_text(reason, "bounce reason"))

    def retry_now(self, msg_id: str | None = None) -> int:
        """Make one deferred message (or all, with None) due now; return how many."""
        if msg_id is not None:
            return self._operator_action(msg_id, OperatorAction.RETRY, None)
        return len(self.act(OperatorAction.RETRY).changed)

    def act(
        self,
        action: OperatorAction,
        msg_ids: Iterable[str] | None = None,
        *,
        where: Callable[[QueueEntry], bool] | None = None,
        reason: str | None = None,
    ) -> ActionResult:
        """Apply ``action`` to many messages with one walk of the log; durable on return.

        The messages are ``msg_ids`` (every live message if None), narrowed by ``where``
        (a test of the ``QueueEntry`` that ``list`` shows). ``reason`` is the hold reason
        or the delete reply (the defaults of ``hold`` and ``delete`` if None). Each message
        is acted on under the lock on its own, so deliveries go on meanwhile; one fsync
        covers them all. ``SpoolMisuse`` for an invalid argument, before anything is written.
        """
        self._check_process()
        if not isinstance(action, OperatorAction):
            raise SpoolMisuse(f"action must be an OperatorAction, not {action!r}")
        wanted: builtins.list[str] | None = None
        if msg_ids is not None:
            if isinstance(msg_ids, str | bytes):
                raise SpoolMisuse("msg_ids must be a list of message ids, not one string")
            wanted = [check_msg_id(m) for m in msg_ids]
        if where is not None and not callable(where):
            raise SpoolMisuse(f"where must be a test of a QueueEntry, not {where!r}")
        if reason is None:
            reason = HELD_REASON if action is OperatorAction.HOLD else None
            if action in ENDINGS:
                reason = ENDINGS[action][1]
        elif action is OperatorAction.HOLD or action in ENDINGS:
            check_text(reason, f"{action.value} reason")
        else:
            raise SpoolMisuse(f"{action.value} takes no reason")
        result = _ActionTally()
        todo: builtins.list[str] = []
        end: Position | None = None
        for _ in range(LOCATE_RETRIES):
            self.sync()
            entries = live_messages(self._fs, self.path, self.options.class_intervals())
            names, todo = (builtins.list(entries) if wanted is None else wanted), []
            for msg_id in dict.fromkeys(names):  # each once, in the order given
                entry = entries.get(msg_id)
                with self._lock:
                    self._check_open()
                    state = self._in_flight.get(msg_id)
                    if where is not None and (entry is None or not where(entry)):
                        if entry is None and state is None:
                            result.unknown.append(msg_id)
                        continue
                    try:
                        if state is not None:
                            written = self._mark_in_flight(state, action, reason)
                        elif entry is None:
                            result.unknown.append(msg_id)
                            continue
                        elif not self._still_live(entry):
                            todo.append(msg_id)  # a runner took it meanwhile: look again
                            continue
                        else:
                            written = self._supersede(entry, action, reason)
                    except SpoolMisuse as exc:
                        if msg_ids is None:
                            result.unchanged.append(msg_id)  # not named: it does not apply
                        else:
                            result.refused[msg_id] = str(exc)
                        continue
                if written is not None:
                    end = written
                result.add(msg_id, written is not None)
            if not todo:
                break
            wanted = todo
        for msg_id in todo:
            result.refused[msg_id] = "it kept changing under the operator action; try again"
        if end is not None:
            self._writer.wait_durable(end)
        return result.freeze()

    def _operator_action(self, msg_id: str, action: OperatorAction, reason: str | None) -> int:
        """One message's action (``hold``, ...): 1 if something changed, else 0."""
        check_msg_id(msg_id)
        result = self.act(action, [msg_id], reason=reason)
        if result.unknown:
            raise UnknownMessage(msg_id)
        if result.refused:
            raise SpoolMisuse(result.refused[msg_id])
        return len(result.changed)

    def _still_live(self, entry: QueueEntry) -> bool:
        """Whether ``entry`` is still the message's live envelope (under the lock)."""
        if entry.state == "active" or entry.envelope_at in self._superseded:
            return False
        runner = self._runners[min(entry.klass, self.options.last_class)]
        return runner.cursor <= entry.envelope_at

    def _mark_in_flight(
        self, state: _InFlight, action: OperatorAction, reason: str | None
    ) -> Position | None:
        """Record an action on a message in flight; return the end to wait for (None: nothing
        to do). The attempt's end applies it (``_settle``); until then a control record
        makes it durable, and recovery applies it if a crash ends the attempt first. Lock
        held."""
        if action is OperatorAction.RETRY:
            return None  # it is being attempted right now
        if action is OperatorAction.RELEASE and state.hold is None:
            raise SpoolMisuse(f"{state.envelope.msg_id} is not held")
        part = self._encode(
            rec.Control(IN_FLIGHT[action], state.envelope.msg_id, self._now(), why=reason or "")
        )
        # A crash before this record is durable loses the action with the call that
        # asked for it (it had not returned); the attempt's own records settle as usual.
        _, end = self._append([part], None)
        if action is OperatorAction.HOLD:
            state.hold = reason
        elif action in ENDINGS:
            assert reason is not None
            state.delete = (ENDINGS[action][0], reason)
        else:
            state.hold = None
        return end

    def _supersede(
        self, entry: QueueEntry, action: OperatorAction, reason: str | None
    ) -> Position | None:
        """Write the record(s) an operator action needs; return the end to wait for.

        Everything the action writes is built and encoded before the envelope is marked
        superseded or a body pin is released, so a refused record changes nothing.
        """
        frame = read_frame_at(self._fs, self._log_dir, entry.envelope_at)
        try:
            env = rec.decode(frame.type, frame.payload)
        except rec.RecordError as exc:
            raise CorruptSpool(
                os.path.join(self._log_dir, fmt.segment_name(entry.envelope_at.segment)),
                entry.envelope_at.offset,
                str(exc),
            ) from None
        if not isinstance(env, rec.Envelope):
            raise CorruptSpool(
                os.path.join(self._log_dir, fmt.segment_name(entry.envelope_at.segment)),
                entry.envelope_at.offset,
                "the queue view named a record that is not an envelope",
            )
        now = self._now()
        pos = entry.envelope_at
        env = self._accepted_as_of_now(pos, env)
        if action in ENDINGS:
            assert reason is not None
            state = self._start(pos, env, frame.size, now)
            self._superseded.add(pos)
            state.delete = (ENDINGS[action][0], reason)
            self._settle(state, now, f"{action.value}d by the operator")
            self._counts["deleted"] += 1
            return self._writer.tail
        if action is OperatorAction.HOLD:
            if env.held is not None:
                return None
            new = attrs.evolve(env, held=reason, klass=self.options.last_class)
        elif action is OperatorAction.RELEASE:
            if env.held is None:
                raise SpoolMisuse(f"{env.msg_id} is not held")
            new = attrs.evolve(env, held=None, klass=0, crashes=0)
        else:
            if env.held is not None or env.klass == 0:
                return None  # held, or already due now
            new = attrs.evolve(env, klass=0)
        old = resolve_body(env, pos, frame.size)
        body, promoted = old, None
        if new.held is not None:
            body, promoted = self._promote(env, old, new.klass, new.held, now)
        new = attrs.evolve(new, written_at=now, supersedes=pos, body=body, promoted_from=promoted)
        part = self._encode(new)
        self._superseded.add(pos)
        _, end = self._append([part], new.klass)
        if promoted is not None:
            self._promoted(old, env.msg_id, end)
        self._cond.notify_all()
        return end

    def _restore_envelope(
        self, env: rec.Envelope, data: bytes, replaces: Position, reason: str
    ) -> None:
        """Queue ``env`` again, held with ``reason``, its body ``data`` in a body file.

        For ``spool check --repair`` only: ``env`` was read from a record that failed its
        check (``replaces`` is where the repair's marker now stands) and nothing after it
        carries the message on. It may hold the damage, so it waits, held, for the
        operator. It supersedes what ``env`` superseded (so no earlier envelope comes back
        to life, and the attempt it closed is settled), or the marker for a first envelope.
        The body goes to a file so that no segment pin is involved (the pin of a body whose
        first envelope was lost was never counted). Durable on return.
        """
        self._check_process()
        reason = check_text(reason, "hold reason")
        # (B1) The body file is durable before the envelope naming it is appended.
        body = write_body_file(self._fs, self._incoming_dir, env.msg_id, data, replace=True)
        with self._lock:
            self._check_open()
            new = attrs.evolve(
                env,
                body=body,
                held=reason,
                klass=self.options.last_class,
                written_at=self._now(),
                crashes=0,
                supersedes=env.supersedes or replaces,
                promoted_from=None,
            )
            part = self._encode(new)
            if new.supersedes is not None:
                self._superseded.add(new.supersedes)  # ahead of its runner, maybe
            _, end = self._append([part], new.klass)
            self._staged[env.msg_id] = end
        self._writer.wait_durable(end)

    # --- introspection and lifecycle ---------------------------------------------------

    def statistics(self) -> SpoolStatistics:
        """Counters since open (thread-safe)."""
        self._check_process()
        w = self._writer.stats()
        with self._lock:
            c = self._counts
            segments = len(list_segments(self._fs, self._log_dir))
            return SpoolStatistics(
                accepted=c["accepted"],
                delivered=c["delivered"],
                failed=c["failed"],
                deferred=c["deferred"],
                expired=c["expired"],
                fsyncs=w.fsyncs,
                batches=w.batches,
                frames=w.frames,
                frames_per_fsync_mean=w.frames / w.fsyncs if w.fsyncs else 0.0,
                bytes_written=w.bytes_written,
                segments=segments,
                segments_deleted=c["segments_deleted"],
                in_flight=len(self._in_flight),
                checkpoints=c["checkpoints"],
                bodies_promoted=c["bodies_promoted"],
                deleted=c["deleted"],
                leases_expired=c["leases_expired"],
                clock_skew=self._time.skew(),
            )

    def sync(self) -> None:
        """Make everything written so far durable (bookkeeping records included)."""
        self._check_process()
        self._check_open()
        self._writer.sync()

    def close(self) -> None:
        """Close open attempts (their unreported recipients are deferred), sync, unlock.

        Not needed for safety (crash-only: a kill is as good as a close), but a clean
        close leaves nothing in flight for the next open to recover.
        """
        if os.getpid() != self._pid:
            # A forked child: the files, the lock and the threads are the parent's. Touch
            # nothing (an unlock here would unlock the parent: flock belongs to the open
            # file description both share); just stop this copy from being used.
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            # On a failed spool these records cannot be written; recovery defers the
            # attempts instead, so close goes on and releases the lock.
            with contextlib.suppress(SpoolError):
                for state in list(self._in_flight.values()):
                    self._close_attempt(state)
                self._close_abandoned()
        with contextlib.suppress(SpoolError):
            self.checkpoint()
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        self._checkpointer.join()
        self._writer.close()
        for runner in self._runners:
            runner.close()
        self._outcomes.close()
        self._owner.release()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers -------------------------------------------------------------------------

    def _check_process(self) -> None:
        """Refuse use from a forked child: parent and child would append at the same
        offsets with the same message ids, and one of them would overwrite mail the other
        had acknowledged. Checked before any lock is taken (a fork may copy a held lock)."""
        if os.getpid() != self._pid:
            raise SpoolMisuse(
                f"spool {self.path} was opened by process {self._pid}; process "
                f"{os.getpid()} is a fork of it and must not use it. Open spools after "
                "forking, in the one process that owns them, and talk to that owner"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise SpoolClosed(f"spool {self.path} is closed; open it again to continue")

    def _now(self) -> float:
        """The spool's time (``clock.py``): it never goes back within an open."""
        return self._time.now()

    def _accepted_as_of_now(self, pos: Position, env: rec.Envelope) -> rec.Envelope:
        """``env`` as its rewrite carries it: an acceptance an earlier open stamped in the
        future counts from this open (``clock.py``), here and in every later envelope."""
        accepted_at = self._time.accepted_at(pos, env)
        if accepted_at == env.accepted_at:
            return env
        return attrs.evolve(env, accepted_at=accepted_at)

    def _on_durable(self, end: Position) -> None:
        with self._lock:
            # Envelopes before the durable end are behind any idle runner's skip point.
            self._fresh_envelopes = [(k, at) for k, at in self._fresh_envelopes if at >= end]
            self._cond.notify_all()


def file_blocks(size: int) -> int:
    """What a body file of ``size`` bytes takes on disk at most: its header and data
    rounded up to whole 4 KiB blocks, and a block for its directory entry and inode."""
    block = 4096
    return -(-(size + 64) // block) * block + block


def _environment_error(doing: str, exc: OSError) -> SpoolError:
    """The typed error for an OSError of the disk: ``DiskFull`` when out of space (free some
    and open again), ``SpoolFailed`` otherwise."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left while {doing}: free some space and open it again")
    return SpoolFailed(f"{doing} failed: {exc.strerror or exc}", exc.errno)


def archive_file(fs: FileSystem, path: str, archive_dir: str) -> None:
    """Move a retired segment into ``archive_dir`` (rename, or copy+unlink across devices).

    A crash midway leaves the segment in the log directory (retired, archived again by the
    next checkpoint) and possibly a complete or partial copy in the archive, overwritten
    then: the archive copy is fsynced before the original is unlinked.
    """
    target = os.path.join(archive_dir, os.path.basename(path))
    try:
        fs.rename(path, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with open(path, "rb") as src:
            data = src.read()
        fd = fs.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            fs.pwrite(fd, data, 0)
            fs.fdatasync(fd)
        finally:
            fs.close(fd)
        fs.unlink(path)
    fs.fsync_dir(archive_dir)
