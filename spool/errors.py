"""Every exception the spool raises, in one place.

Three kinds, after Postfix's diagnostics classes:

* bad input (``InvalidAddress``, ``MessageTooLarge``, ``SpoolLocked``, ``BadSpoolDirectory``):
  the call is refused and nothing is written; fix the input and call again;
* environment (``SpoolFailed``, ``DiskFull``): the disk said no. ``DiskFull`` is the
  temporary back-pressure of ``min_free_bytes`` (answer SMTP 452, never 5xx) and changes
  nothing. ``SpoolFailed`` is sticky: a write or fsync failed, the on-disk state is
  unknown, every later write raises it; close and reopen the spool (reopening recovers);
* bad data (``CorruptSpool``): a file failed its checksum where no crash can explain it;
  a file that cannot be read at all (``SegmentUnreadable``) is not bad data, and is never
  set aside.

Bugs are ``AssertionError``: let them crash the process; the next open recovers.
Each message says what to do next.
"""

from __future__ import annotations

import errno
import os


class SpoolError(Exception):
    """Base class of every spool error; never raised itself."""


class SpoolLocked(SpoolError):
    """Another process (or another handle in this process) owns the spool."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        owner = f"process {pid}" if pid else "another process"
        super().__init__(
            f"{path} is locked by {owner}; stop that owner or talk to it, "
            "a spool has exactly one owner at a time"
        )


class BadSpoolDirectory(SpoolError):
    """The path cannot be a spool: not a directory, foreign owner, unsafe permissions."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class SpoolClosed(SpoolError):
    """The spool or the attempt was closed; open the spool again to continue."""


class AttemptExpired(SpoolClosed):
    """The attempt ran past ``attempt_timeout`` and the spool closed it (its unreported
    recipients deferred): the message will be attempted again. Nothing was written for
    this call. A delivery that really succeeded after the lease ran out is repeated by the
    next attempt: set ``attempt_timeout`` above the longest delivery an agent may take."""


class SpoolMisuse(SpoolError, ValueError):
    """A call that cannot be made as given (a bad argument, an attempt already closed, a
    spool used in a process it was not opened in); nothing was written. Fix the call."""


class UnknownMessage(SpoolError, KeyError):
    """No message with this id is in the spool (an operator action, ``show``)."""

    def __init__(self, msg_id: str, where: str = "the spool") -> None:
        self.msg_id = msg_id
        super().__init__(f"no message {msg_id} in {where}")

    def __str__(self) -> str:
        # KeyError quotes its argument; this error is a sentence.
        return str(self.args[0])


class BodyGone(SpoolError):
    """The body of a finished message is no longer kept (``Spool.outcome_body``).

    With outcome tracking, a body is kept until its outcome is acknowledged when it is in
    a file, and a message whose outcome names a failed recipient has its body in a file;
    an inline body of any other outcome lasts only as long as its log segment.
    """

    def __init__(self, msg_id: str, why: str) -> None:
        self.msg_id = msg_id
        super().__init__(f"the body of {msg_id} is no longer kept: {why}")


class InvalidMessage(SpoolError, ValueError):
    """The message cannot be accepted as given; nothing was written."""


class InvalidAddress(InvalidMessage):
    """An address breaks RFC 5321 syntax or limits."""

    def __init__(self, address: object, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"invalid address {address!r}: {reason}")


class MessageTooLarge(InvalidMessage):
    """The data or the recipient list exceeds a configured limit (SMTP 552)."""


class CorruptSpool(SpoolError):
    """A file failed its check where no crash can explain it.

    Names the file and offset. Nothing is skipped silently: run ``spool check DIR`` to see
    every problem and ``spool check --repair DIR`` to move unreadable files aside.
    """

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(
            f"corrupt spool file {path} at offset {offset}: {reason}; "
            "run `spool check` to list problems, `spool check --repair` to set them aside"
        )


class DiskFull(SpoolError):
    """Free space is under ``min_free_bytes``: new mail is refused for now (SMTP 452).

    Deliveries go on and free space; nothing was written.
    """


class SpoolFailed(SpoolError):
    """Sticky: a write or fsync failed, so what reached the disk is unknown.

    Every later write raises this too. Close the spool and open it again: opening
    recovers. ``errno`` is the operating system's error number (ENOSPC, EIO, ...).
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        self.errno = errno
        super().__init__(f"{message}; close and reopen the spool to recover")


class ProtocolError(SpoolError):
    """A control-socket frame that cannot be read, or a request that cannot be served as
    sent (unknown operation, wrong argument types, out of order). Nothing was changed.
    docs/protocol.md says what a frame must hold."""


class OwnerUnreachable(SpoolError):
    """No owner answers on the spool's control socket (``spool serve`` is not running, or
    it stopped while a request was in flight: that request may or may not have been done;
    ask again once it runs, or open the spool directly when no owner runs)."""


class PeerRefused(SpoolError):
    """The owner refused this connection: it comes from another user than the spool's.
    Run the command as the spool's owner (or root)."""


class CannotListen(SpoolError):
    """``spool serve`` cannot listen where it was asked (``--smtp``, ``--metrics``): the
    address is in use (another process, or an owner already running), not this host's, or
    a port below 1024 without the privilege. Stop what listens there or give another
    address; nothing was started."""

    def __init__(self, what: str, host: str, port: int, error: OSError) -> None:
        self.what, self.host, self.port = what, host, port
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        reason = os.strerror(error.errno) if error.errno else str(error)
        super().__init__(
            f"cannot listen on {where} for {what}: {reason}: stop what listens there or "
            "give another address"
        )


class NotASpool(SpoolError):
    """``spool report``: a source is neither a spool directory nor an archive of segments,
    or is given twice (the same directory, a spool with its own archive, one server name
    for two directories). Name each spool once (its archive is read with it)."""


class ReportRefused(SpoolError):
    """``spool report``: the output directory is not one a report may replace (it holds
    other files, or a source). Name a new directory or an earlier report's."""


class JavaMissing(SpoolError):
    """``spool report``: Spark needs a Java runtime (17 or later) and none is on the PATH
    or in JAVA_HOME. Install one, or set JAVA_HOME."""


class SegmentUnreadable(SpoolError):
    """A file of the log that cannot be read: its permissions shut this user out, or the
    device failed reading it. Not damage: nothing is known to be wrong with its bytes, so
    nothing sets it aside (``spool check --repair`` would take the mail in it out of the
    queue), and nothing was written. Make it readable to the spool's user; after an I/O
    error, see the system log and copy the spool to a sound disk first."""

    def __init__(self, path: str, reason: str, errno_: int | None = None) -> None:
        if errno_ in (errno.EACCES, errno.EPERM):
            advice = "its owner or mode shuts this user out: make it readable to the spool's user"
        elif errno_ == errno.EIO:
            advice = (
                "the device failed reading it: see the system log (dmesg) and copy the spool "
                "to a sound disk before anything else"
            )
        else:
            advice = "mend the cause and run the command again"
        super().__init__(
            f"cannot read {path}: {reason}; {advice}. Not damage: do not set it aside "
            "with spool check --repair"
        )
        self.path = path

    @classmethod
    def from_os_error(cls, path: str, exc: OSError) -> SegmentUnreadable:
        return cls(path, exc.strerror or str(exc), exc.errno)


class ReportFailed(SpoolError):
    """``spool report``: a Spark task failed (the spool error it raised is in the message:
    damage names file and offset; ``--on-damage skip`` reads past it)."""


def remote_error(name: str, message: str) -> SpoolError:
    """The error an owner reported over the control socket, as this process's own type
    (``ProtocolError`` for a name this module does not define)."""
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, SpoolError)):
        cls, message = ProtocolError, f"{name}: {message}"
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    if isinstance(error, UnknownMessage):
        error.msg_id = ""
    return error
