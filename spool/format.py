"""On-disk constants: the only place the numbers of the format live.

The prose specification, with byte offsets and a worked example, is ``docs/format.md``.
Change nothing here without changing that document and the golden tests.
"""

from __future__ import annotations

import enum
import re
import struct
from typing import Final

# Version 2 salts every frame's CRC with a random number from its segment's header (the
# field version 1 reserved and wrote as 0), so that bytes inside a message body cannot
# pass for a frame (docs/format.md, "Salts"). Readers read both: a version 1 segment is
# one whose salt is 0, and its frames check exactly as before.
FORMAT_VERSION: Final = 2
FORMAT_VERSIONS_READ: Final = frozenset({1, 2})

# Sector size the write path pads every group commit to, so that no write ever touches a
# sector holding bytes an earlier fsync made durable (docs/fault-model.md).
SECTOR: Final = 512
# The damage model's burst (docs/fault-model.md, assumption 8): up to this many bytes in a
# row hit at once, whatever their bits.
BURST: Final = 4

# --- segment files -------------------------------------------------------------------
# Header: magic(8) version(u32) header_size(u32) segment_number(u64) salt(u32) crc(u32)
SEGMENT_MAGIC: Final = b"SPOOLLOG"
SEGMENT_HEADER: Final = struct.Struct("<8sIIQII")
SEGMENT_HEADER_SIZE: Final = SEGMENT_HEADER.size
SEGMENT_SUFFIX: Final = ".seg"
SEGMENT_NAME_DIGITS: Final = 20
assert SEGMENT_HEADER_SIZE == 32

# --- frames ----------------------------------------------------------------------------
# Frame header: crc32c(u32) payload_length(u32) type(u8); the CRC covers the length,
# the type and the payload, so a torn or shifted frame never passes. It starts from the
# segment's salt (framing.frame_crc), so a frame is valid only in its own segment.
FRAME_HEADER: Final = struct.Struct("<IIB")
FRAME_HEADER_SIZE: Final = FRAME_HEADER.size
assert FRAME_HEADER_SIZE == 9

# The largest payload a reader accepts; a longer length field is damage, not data.
FRAME_PAYLOAD_MAX: Final = 8 * 1024 * 1024


class FrameType(enum.IntEnum):
    """The frame types (the byte after a frame's length and CRC). 0 is never written: a
    zeroed region can never parse as a record."""

    NONE = 0
    ENVELOPE = 1
    BODY = 2
    START = 3
    DELTA = 4
    FINISH = 5
    CONTROL = 6
    PAD = 15


# The short names the modules use; each is the enum member itself.
T_NONE: Final = FrameType.NONE
T_ENVELOPE: Final = FrameType.ENVELOPE
T_BODY: Final = FrameType.BODY
T_START: Final = FrameType.START
T_DELTA: Final = FrameType.DELTA
T_FINISH: Final = FrameType.FINISH
T_CONTROL: Final = FrameType.CONTROL
T_PAD: Final = FrameType.PAD

FRAME_TYPES: Final[frozenset[int]] = frozenset(t for t in FrameType if t is not FrameType.NONE)
TYPE_NAMES: Final[dict[int, str]] = {t: FrameType(t).name.lower() for t in FRAME_TYPES}

# --- the spool directory ---------------------------------------------------------------
LOCK_NAME: Final = "lock"
LOG_DIR: Final = "log"
BODY_DIR: Final = "bodies"
# New body files are written here and moved to BODY_DIR by the checkpoint after their
# envelope is durable, so recovery finds orphans by listing this small directory only.
INCOMING_DIR: Final = "incoming"
POSITIONS_NAME: Final = "positions"
SETTINGS_NAME: Final = "settings"
CORRUPT_DIR: Final = "corrupt"
# Present while `spool check --repair` is between its first change and its last
# settlement: an open that is not the repair's own refuses the spool until a repair ends.
REPAIRING_NAME: Final = "repairing"
# The running owner's control socket (``spool serve``; docs/protocol.md). Present only while
# an owner serves; a stale one (its owner killed) is replaced by the next owner's.
SOCKET_NAME: Final = "control.sock"
# The ids of the messages whose senders got a delay warning (``spool serve
# --delay-warning``; docs/format.md): written by the owner only, never read by recovery.
DELAY_WARNED_NAME: Final = "delay-warned"

# --- body files (bodies too large to keep inline in the log) ---------------------------
# Header: magic(8) version(u32) reserved(u32) length(u64) crc32c-of-data(u32) crc(u32)
BODY_MAGIC: Final = b"SPOOLBDY"
BODY_HEADER: Final = struct.Struct("<8sIIQII")
BODY_HEADER_SIZE: Final = BODY_HEADER.size
assert BODY_HEADER_SIZE == 32

# --- message ids ----------------------------------------------------------------------
MSG_ID_LENGTH: Final = 16  # hex digits: 8 bytes, 4 of time and 4 of a counter
_MSG_ID: Final = re.compile(r"[0-9A-F]{16}")


def is_id_shaped(text: str) -> bool:
    """Whether ``text`` could be a message id some characters of which are damaged: 16
    printable ASCII characters, none a ``/`` (so never a path of more than one name)."""
    return len(text) == MSG_ID_LENGTH and all("!" <= c <= "~" and c != "/" for c in text)


def is_message_id(text: str) -> bool:
    """Whether ``text`` is a message id as the spool makes them (16 upper-case hex
    digits). Ids read from damaged bytes may be anything (empty, ``/``, NUL): only a
    well-formed one may name a message or a body file path."""
    return _MSG_ID.fullmatch(text) is not None


def segment_name(number: int) -> str:
    """File name of log segment ``number`` (zero padded, so names sort by number)."""
    assert 0 < number < 10**SEGMENT_NAME_DIGITS, number
    return f"{number:0{SEGMENT_NAME_DIGITS}d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """Segment number of a file name, or None when the name is not a segment's."""
    stem, dot, ext = name.partition(".")
    if "." + ext != SEGMENT_SUFFIX or not dot or len(stem) != SEGMENT_NAME_DIGITS:
        return None
    if not stem.isdigit():
        return None
    number = int(stem)
    return number if number > 0 else None
