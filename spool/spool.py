"""The ``Spool`` facade: accept, claim, report, checkpoint. What delivery agents embed.

A ``Spool`` owns one spool directory (see ``lock.py``). Opening it runs recovery
(``recovery.py``), starts the log writer on a fresh segment (``writer.py``) and one queue
runner per retry class (``runners.py``). Everything is thread-safe: many threads accept,
many attempts are in flight at once.

The facade holds the lock (``state.py``) and delegates each concern to one piece, each in
its own module and each running under that lock: scheduling (``scheduling.py``), bodies
and free space (``body_keeping.py``), the attempt lifecycle (``attempts.py``), checkpoints
and garbage collection (``checkpoints.py``), operator actions (``operator.py``) and
outcomes (``outcome_desk.py``); ``opening.py`` builds them and closes them. What stays
here is the public surface: the options of ``open``, the docstrings users read, and one
delegation per method.

Commit points (docs/design.md numbers the invariants):
    ``accept`` returns after the fdatasync covering the envelope (and its inline body, or
    after the body file's own fsyncs) returned: from then on no crash loses the message.
    ``Attempt.delivered``/``failed`` return after the fdatasync covering their delta:
    from then on no crash lets those recipients be attempted again.
    Start records, deferred deltas, replacement envelopes and finish records are
    bookkeeping: written without waiting, flushed with the next batch. A crash that loses
    them is repaired by recovery from the start record and the durable deltas.

Crash safety: this module writes nothing itself. The writer (log), ``bodies.py``,
``positions.py``, ``options.py`` and ``checkpoints.py`` each argue theirs where they write.

Errors:
    Bad input raises an ``InvalidMessage`` subclass before anything is written. Disk
    errors make the spool fail-stop (``SpoolFailed``); low free space refuses new mail
    with ``DiskFull`` while deliveries go on.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from spool import records as rec
from spool.accepting import Acceptor
from spool.arguments import check_msg_id, check_text
from spool.attempts import EXPIRED_REPLY, UNREPORTED_REPLY, Attempt, MessageEnvelope
from spool.clock import Clock, SystemClock, as_clock
from spool.errors import SpoolMisuse, UnknownMessage
from spool.fs import FileSystem
from spool.opening import open_spool
from spool.operator import BOUNCED_REPLY, DELETED_REPLY, HELD_REASON, ActionResult, OperatorAction
from spool.options import (
    DEFAULT_ATTEMPT_TIMEOUT,
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_SYNC_EVERY,
    DEFAULT_SYNC_INTERVAL,
    OPTION_NAMES,
    RECORDED,
    Recorded,
    SpoolOptions,
    resolve_options,
)
from spool.outcomes import MessageOutcome
from spool.polling import until_closed
from spool.positions import RestartPositions
from spool.queue_view import QueueEntry, history
from spool.records import Position
from spool.recovery import RecoveryReport
from spool.statistics import SpoolStatistics, collect_statistics
from spool.writer import DEFAULT_WRITE_AHEAD

__all__ = [
    "BOUNCED_REPLY",
    "DELETED_REPLY",
    "EXPIRED_REPLY",
    "HELD_REASON",
    "UNREPORTED_REPLY",
    "ActionResult",
    "Attempt",
    "MessageEnvelope",
    "OperatorAction",
    "Spool",
    "SpoolStatistics",
]


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
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        sync_every: int = DEFAULT_SYNC_EVERY,
        sync_interval: float = DEFAULT_SYNC_INTERVAL,
        checkpoint_interval: float = DEFAULT_CHECKPOINT_INTERVAL,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        attempt_timeout: float = DEFAULT_ATTEMPT_TIMEOUT,
        write_ahead: int = DEFAULT_WRITE_AHEAD,
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
        # The options as named above (``locals()`` is read here, in ``open``'s scope).
        given: dict[str, Any] = {k: v for k, v in locals().items() if k in OPTION_NAMES}
        resolve_options({}, given)  # every value checked before the directory is touched
        if clock is None:
            clock = SystemClock()
        elif not isinstance(clock, Clock) and not callable(clock):
            raise SpoolMisuse(
                f"clock must be a Clock or a callable returning seconds, not {clock!r}"
            )
        self = object.__new__(cls)
        self._open(os.fspath(path), fs or FileSystem(), given, as_clock(clock))
        return self

    @classmethod
    def _open_for_repair(cls, path: str, fs: FileSystem) -> Spool:
        """For ``spool check --repair`` only: open with the recorded options although a
        repair is in progress (``format.REPAIRING_NAME``), to settle what it touched (with
        ``OperatorDesk.restore_envelope`` and ``rebind_body`` besides the public calls)."""
        self = object.__new__(cls)
        self._open(path, fs, {}, as_clock(SystemClock()), repairing=True)
        return self

    # --- opening -----------------------------------------------------------------------

    def _open(
        self,
        path: str,
        fs: FileSystem,
        given: dict[str, Any],
        clock: Clock,
        *,
        repairing: bool = False,
    ) -> None:
        self.path = path
        opened = open_spool(path, fs, given, clock, repairing=repairing)
        self.recovery: RecoveryReport = opened.recovery
        self._opened = opened
        self._state = opened.state
        self._book = opened.book
        self._desk = opened.desk
        self._outcome_desk = opened.outcome_desk
        self._checkpointer = opened.checkpointer
        self._acceptor = Acceptor(opened.state, opened.scheduler, opened.bodies)

    @property
    def options(self) -> SpoolOptions:
        """The options of this open (``options.py``)."""
        return self._state.options

    @property
    def retry_intervals(self) -> tuple[float, ...]:
        """The retry classes' intervals after the first attempt (``options``)."""
        return self._state.options.retry_intervals

    @property
    def max_lifetime(self) -> float:
        return self._state.options.max_lifetime

    @property
    def archive_path(self) -> str | None:
        """Where retired segments go (None: they are deleted)."""
        return self._state.archive_path

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (a closed spool raises ``SpoolClosed``)."""
        return self._state.closed

    # --- accepting ---------------------------------------------------------------------

    def accept(self, sender: str, recipients: Iterable[str], data: bytes) -> str:
        """Queue a message; return its id once it is on stable storage.

        Raises ``InvalidAddress``, ``MessageTooLarge`` or ``InvalidMessage`` for bad input
        and ``DiskFull`` under ``min_free_bytes``; in each case nothing is written.
        Thread-safe; concurrent calls share fsyncs.
        """
        return self._acceptor.accept(sender, recipients, data)

    # --- claiming ----------------------------------------------------------------------

    def claim(self, timeout: float | None = None) -> Attempt | None:
        """The next due message as an ``Attempt``, or None.

        With ``timeout`` (seconds) waits that long for work to become due. Fair between
        fresh and deferred mail; never hands a message to two attempts at once.
        """
        return self._book.claim(timeout)

    def attempts(self, poll: float = 1.0) -> Iterator[Attempt]:
        """Yield attempts forever, until the spool closes (for worker loops)."""
        return until_closed(self.claim, poll)

    # --- checkpoints and outcomes (checkpoints.py, outcome_desk.py) -------------------

    def checkpoint(self) -> RestartPositions:
        """Write restart positions now (after syncing what they describe); free space.

        Thread-safe; checkpoints run one at a time. Also run every ``checkpoint_interval``
        seconds and every ``checkpoint_every`` records by a background thread.
        """
        self._state.check_process()
        return self._checkpointer.checkpoint()

    def next_outcome(self, timeout: float | None = None) -> MessageOutcome | None:
        """The next finished message whose outcome is not yet acknowledged, or None.

        Needs ``Spool.open(..., outcomes=True)``. Acknowledge it with ``ack_outcome`` once
        its bounce is sent; until then it is handed out again after a restart.
        """
        return self._outcome_desk.next(timeout)

    def outcomes(self, poll: float = 1.0) -> Iterator[MessageOutcome]:
        """Yield outcomes forever, until the spool closes."""
        return until_closed(self.next_outcome, poll)

    def ack_outcome(self, msg_id: str) -> None:
        """Acknowledge an outcome handed out by ``next_outcome``. Durable on return.

        ``UnknownMessage`` if no outcome of ``msg_id`` is waiting for an acknowledgement.
        """
        self._outcome_desk.ack(msg_id)

    def outcome_body(self, outcome: MessageOutcome) -> bytes:
        """The message an outcome is about, as accepted, for the bounce to return.

        Kept until the outcome is acknowledged when it is in a file, as it always is for an
        outcome that names a failed recipient (unless the disk was too full to copy it);
        ``BodyGone`` once it is no longer kept.
        """
        return self._outcome_desk.body(outcome)

    # --- operator actions (operator.py) --------------------------------------------------

    def list(self) -> Iterator[QueueEntry]:
        """The live messages (walks the live part of the log; for operators, not hot paths)."""
        return self._desk.listing()

    def show(self, msg_id: str) -> builtins.list[tuple[Position, rec.Record]]:
        """Every record of ``msg_id`` still in the log. ``UnknownMessage`` if there is none."""
        check_msg_id(msg_id)
        self.sync()
        found = history(self._state.fs, self.path, msg_id)
        if not found:
            raise UnknownMessage(msg_id)
        return found

    def hold(self, msg_id: str, reason: str = HELD_REASON) -> None:
        """Stop attempting ``msg_id`` until ``release``. Durable on return.

        ``UnknownMessage`` if it is not in the spool; ``SpoolMisuse`` for a ``reason`` that is
        not a non-empty text of at most ``TEXT_MAX`` bytes (nothing is written then).
        """
        self._desk.one(msg_id, OperatorAction.HOLD, check_text(reason, "hold reason"))

    def release(self, msg_id: str) -> None:
        """Release a held message; it is due at once. ``SpoolMisuse`` if it is not held."""
        self._desk.one(msg_id, OperatorAction.RELEASE, None)

    def delete(self, msg_id: str, reason: str = DELETED_REPLY) -> None:
        """Remove ``msg_id`` silently, as ``postsuper -d`` does: its pending recipients end
        ``deleted`` (no bounce: its outcome names no failed recipient), with ``reason``.

        A message in flight is finished when its attempt ends: recipients it reports
        delivered or failed keep that outcome, the rest are deleted. Durable on return,
        in flight too (a control record; recovery applies it if a crash ends the attempt).
        """
        self._desk.one(msg_id, OperatorAction.DELETE, check_text(reason, "delete reason"))

    def bounce(self, msg_id: str, reason: str = BOUNCED_REPLY) -> None:
        """Give up on ``msg_id``, as ``exim -Mg`` does: its pending recipients fail with
        ``reason`` (a 5xx reply a bounce quotes), so its outcome asks for a bounce.

        In flight, as ``delete``.
        """
        self._desk.one(msg_id, OperatorAction.BOUNCE, check_text(reason, "bounce reason"))

    def retry_now(self, msg_id: str | None = None) -> int:
        """Make one deferred message (or all, with None) due now; return how many."""
        if msg_id is not None:
            return self._desk.one(msg_id, OperatorAction.RETRY, None)
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
        return self._desk.act(action, msg_ids, where, reason)

    # --- introspection and lifecycle ---------------------------------------------------

    def statistics(self) -> SpoolStatistics:
        """Counters since open (thread-safe)."""
        return collect_statistics(self._state, self._book)

    def sync(self) -> None:
        """Make everything written so far durable (bookkeeping records included)."""
        self._state.check_process()
        self._state.check_open()
        self._state.writer.sync()

    def close(self) -> None:
        """Close open attempts (their unreported recipients are deferred), sync, unlock.

        Not needed for safety (crash-only: a kill is as good as a close), but a clean
        close leaves nothing in flight for the next open to recover.
        """
        self._opened.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
