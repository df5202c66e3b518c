"""spool: a crash-only, log-structured mail spool.

The public API is what this module exports: ``Spool.open`` in process (``AsyncSpool`` for
asyncio), or ``connect`` to a running ``spool serve`` with the same calls (``aconnect``);
``records`` for the records ``show`` returns, ``Position`` and ``RestartPositions`` for
where they are; everything else is internal.
See README.md for an embedding example and docs/ for the design, the format and the fault
model.
"""

from spool import records
from spool.async_client import AsyncAttempt, AsyncClient, aconnect
from spool.async_spool import AsyncSpool, AsyncSpoolAttempt
from spool.client import Client, RemoteAttempt, connect
from spool.errors import (
    AttemptExpired,
    BadSpoolDirectory,
    BodyGone,
    CorruptSpool,
    DiskFull,
    InvalidAddress,
    InvalidMessage,
    MessageTooLarge,
    OwnerUnreachable,
    PeerRefused,
    ProtocolError,
    SpoolClosed,
    SpoolError,
    SpoolFailed,
    SpoolLocked,
    SpoolMisuse,
    UnknownMessage,
)
from spool.options import SpoolOptions
from spool.outcomes import MessageOutcome
from spool.positions import RestartPositions
from spool.queue_view import QueueEntry
from spool.records import Position
from spool.recovery import RecoveryReport
from spool.spool import (
    ActionResult,
    Attempt,
    MessageEnvelope,
    OperatorAction,
    Spool,
    SpoolStatistics,
)

__all__ = [
    "ActionResult",
    "AsyncAttempt",
    "AsyncClient",
    "AsyncSpool",
    "AsyncSpoolAttempt",
    "Attempt",
    "AttemptExpired",
    "BadSpoolDirectory",
    "BodyGone",
    "Client",
    "CorruptSpool",
    "DiskFull",
    "InvalidAddress",
    "InvalidMessage",
    "MessageEnvelope",
    "MessageOutcome",
    "MessageTooLarge",
    "OperatorAction",
    "OwnerUnreachable",
    "PeerRefused",
    "Position",
    "ProtocolError",
    "QueueEntry",
    "RecoveryReport",
    "RemoteAttempt",
    "RestartPositions",
    "Spool",
    "SpoolClosed",
    "SpoolError",
    "SpoolFailed",
    "SpoolLocked",
    "SpoolMisuse",
    "SpoolOptions",
    "SpoolStatistics",
    "UnknownMessage",
    "aconnect",
    "connect",
    "records",
]
