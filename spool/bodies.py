"""Message bodies: inline BODY frames in the log, or one file each for large bodies.

A body up to ``inline_body_max`` is written as a BODY frame right after the message's
first envelope, in the same batch and the same fdatasync: one fsync per accept. Runners
step over it by its length without reading it. A larger body is written to
``incoming/<msg_id>`` first (data, fdatasync, directory fsync), then the envelope naming
it; the first checkpoint after that envelope is durable moves the file to
``bodies/<msg_id>``. Readers look in ``incoming/`` first, then in ``bodies/`` (a file only
ever moves that way, so a read racing the move finds it).
Retries never rewrite a body: replacement envelopes carry a reference to where it is.
See docs/design.md, "Bodies", for why and for how inline bodies stop pinning segments.

Crash safety:
    A body file is complete and durable (file and directory synced) before the envelope
    that names it is appended, so no durable envelope names a missing body. A crash after
    the file and before the envelope leaves an orphan in ``incoming/``: every envelope
    that can name a file there lies in the suffix recovery scans (a checkpoint moves the
    files whose envelopes its positions cover to ``bodies/`` before it writes them), so
    recovery removes each file there that no scanned envelope names (docs/design.md,
    "Bodies"). A body file is unlinked only after the finish record of its message (or,
    with outcome tracking, the acknowledgement of its outcome) is durable.

Errors:
    ``CorruptSpool`` when a body fails its checks on read.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from crc32c import crc32c

from spool import format as fmt
from spool.errors import CorruptSpool
from spool.fs import FileSystem
from spool.reader import read_frame_at
from spool.records import BODY_FILE, BODY_INLINE, BodyRef, Position, decode_body
from spool.segment_files import SegmentFiles


def body_file_header(data: bytes) -> bytes:
    """The 32-byte header of a body file holding ``data``."""
    head = fmt.BODY_HEADER.pack(fmt.BODY_MAGIC, fmt.FORMAT_VERSION, 0, len(data), crc32c(data), 0)[
        :-4
    ]
    return head + crc32c(head).to_bytes(4, "little")


def write_body_file(
    fs: FileSystem, body_dir: str, msg_id: str, data: bytes, *, replace: bool = False
) -> BodyRef:
    """Write ``data`` durably to ``bodies/<msg_id>`` and return its reference.

    ``body_dir`` is ``incoming/`` (bodies.py docstring). ``replace`` overwrites a file
    left by an earlier promotion whose envelope a crash lost (no durable envelope names
    such a file, so replacing it is safe), or whatever else is at that name.
    """
    path = os.path.join(body_dir, msg_id)
    if replace:
        # What is there is replaced, never written through: a symbolic or hard link's
        # other name may be anything, another message's body file too. Only this name
        # goes; a crash before the new file is durable leaves none, as below.
        with contextlib.suppress(FileNotFoundError):
            fs.unlink(path)
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
    try:
        # A crash before the fsyncs below leaves a partial or missing file that no
        # durable envelope names (the envelope comes after): an orphan, removed later.
        fs.pwrite(fd, body_file_header(data) + data, 0)
        fs.fdatasync(fd)
    finally:
        fs.close(fd)
    fs.fsync_dir(body_dir)
    return BodyRef(BODY_FILE, len(data))


def body_file_paths(root: str, msg_id: str) -> tuple[str, str]:
    """The two places the body file of ``msg_id`` can be, in the order to look."""
    return os.path.join(root, fmt.INCOMING_DIR, msg_id), os.path.join(root, fmt.BODY_DIR, msg_id)


def is_body_entry(fs: FileSystem, path: str) -> bool:
    """Whether ``path`` is a regular file itself, not a link to one: the only entry in
    incoming/ or bodies/ that can be a body file (``_body_files_found``)."""
    return not fs.is_link(path) and fs.is_regular(path)


def read_raw_body_file(fs: FileSystem, root: str, msg_id: str) -> tuple[bytes, str]:
    """The whole of ``msg_id``'s body file and its path, wherever it is: the first that
    checks, else the first found (unchecked); ``FileNotFoundError`` if neither place holds
    one.

    Only a regular file is a body file: a directory, FIFO, socket, device or looping link
    in either place is passed over as if absent (``spool check`` names it, the repair
    moves it aside), and none of them is ever waited on (``FileSystem.open`` does not
    block). Both places hold one only when the spool copied the body again (the copies
    agree, and a checkpoint moves the new one over the old), or when something else put
    a file there: then the one that checks is the body, the settled one if both do
    (``spool check`` names the other, the repair moves it aside)."""
    raw, path, _two = read_body_files(fs, root, msg_id)
    return raw, path


def read_body_files(fs: FileSystem, root: str, msg_id: str) -> tuple[bytes, str, bool]:
    """``read_raw_body_file``, and whether two valid files differ (``copies_differ``),
    each file read once."""
    return _pick(list(_body_files_found(fs, root, msg_id)), root, msg_id)


def _pick(found: list[tuple[bytes, str]], root: str, msg_id: str) -> tuple[bytes, str, bool]:
    """``read_raw_body_file``'s choice among the files ``found``, and whether two valid
    ones differ (``copies_differ``)."""
    valid = [(raw, path) for raw, path in found if check_body_file(raw) is None]
    two = len(valid) == 2 and not _same_body(valid[0][0], valid[1][0])
    if valid:
        return (*valid[-1], two)  # the settled one, if both check
    if not found:
        raise FileNotFoundError(errno.ENOENT, "no body file", body_file_paths(root, msg_id)[1])
    return (*found[0], False)


TWO_BODIES = (
    "two different valid body files (in incoming/ and bodies/): spool check --repair holds "
    "the message and keeps both"
)


def copies_differ(fs: FileSystem, root: str, msg_id: str) -> bool:
    """Whether incoming/ and bodies/ each hold a valid body file of ``msg_id``, and they
    differ: no copy the spool made (its copies agree), and which is the message's cannot
    be told."""
    try:
        return read_body_files(fs, root, msg_id)[2]
    except FileNotFoundError:
        return False


def copies_agree(fs: FileSystem, root: str, msg_id: str) -> bool:
    """Whether ``msg_id``'s body file in incoming/ holds the same body as the one in
    bodies/ (``_same_body``): a second copy the spool made of the same body (a body
    promoted again after a repair's hold, a restored envelope), which may replace the
    first. Anything else beside a settled body file is not the spool's."""
    found = list(_body_files_found(fs, root, msg_id))
    return len(found) == 2 and _same_body(found[0][0], found[1][0])


def _same_body(one: bytes, other: bytes) -> bool:
    """Whether two body files hold the same message data: the same bytes, or two valid
    files whose headers differ only in what does not change the data (a body file of an
    earlier format version beside the copy this version wrote again)."""
    if one == other:
        return True
    size = fmt.BODY_HEADER_SIZE
    return (
        one[size:] == other[size:]
        and check_body_file(one) is None
        and check_body_file(other) is None
    )


def _body_files_found(fs: FileSystem, root: str, msg_id: str) -> Iterator[tuple[bytes, str]]:
    """The content and path of each regular file named ``msg_id`` in incoming/, then
    bodies/ (a file moving from the one to the other meanwhile is seen once or twice).
    A symbolic link is none: the spool never makes one there, and one in incoming/ to the
    settled file would read as a copy that agrees, which a checkpoint moves over it."""
    for path in body_file_paths(root, msg_id):
        try:
            fd = fs.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue  # not staged (or moved on to bodies/ meanwhile), or not there at all
        except OSError:
            continue  # a link (ELOOP), a socket (ENXIO): not a body file
        try:
            if fs.is_file(fd):
                yield fs.pread(fd, fs.size(fd), 0), path
        finally:
            fs.close(fd)


def read_body_file(fs: FileSystem, root: str, msg_id: str) -> bytes:
    """The data of ``msg_id``'s body file, checked against its header. Two valid files
    that differ are ``CorruptSpool``: which is the message's cannot be told, and none is
    delivered until ``spool check --repair`` holds it for the operator."""
    try:
        raw, path, two = read_body_files(fs, root, msg_id)
    except FileNotFoundError:
        path = body_file_paths(root, msg_id)[1]
        raise CorruptSpool(path, 0, "body file is missing") from None
    if two:
        raise CorruptSpool(path, 0, TWO_BODIES)
    problem = check_body_file(raw)
    if problem is not None:
        raise CorruptSpool(path, 0, problem)
    return raw[fmt.BODY_HEADER_SIZE :]


def check_body_file(raw: bytes) -> str | None:
    """None if ``raw`` is a valid body file, else what is wrong."""
    if len(raw) < fmt.BODY_HEADER_SIZE:
        return "body file shorter than its header"
    magic, version, _r, length, data_crc, crc = fmt.BODY_HEADER.unpack_from(raw)
    if crc32c(raw[: fmt.BODY_HEADER_SIZE - 4]) != crc or magic != fmt.BODY_MAGIC:
        return "body file header is damaged"
    if version not in fmt.FORMAT_VERSIONS_READ:
        return f"body file format version {version}"
    data = raw[fmt.BODY_HEADER_SIZE :]
    if len(data) != length:
        return f"body file holds {len(data)} bytes, header says {length}"
    if crc32c(data) != data_crc:
        return "body data checksum mismatch"
    return None


def read_inline_body(
    fs: FileSystem,
    log_dir: str,
    msg_id: str,
    at: Position,
    segments: SegmentFiles | None = None,
    size: int = 0,
) -> bytes:
    """The data of the BODY frame at ``at``, checked to belong to ``msg_id``; read through
    an open spool's ``segments`` if given (its descriptors stay open), else by opening the
    segment for this read. ``size``: the body's, when known (then one read)."""
    hint = fmt.FRAME_HEADER_SIZE + fmt.MSG_ID_LENGTH + size if size else 0
    if segments is None:
        frame = read_frame_at(fs, log_dir, at, hint)
    else:
        frame = segments.read_frame(at, hint)
    path = os.path.join(log_dir, fmt.segment_name(at.segment))
    if frame.type != fmt.T_BODY:
        raise CorruptSpool(path, at.offset, f"expected a body frame, found type {frame.type}")
    owner, data = decode_body(frame.payload)
    if owner != msg_id:
        raise CorruptSpool(path, at.offset, f"body belongs to {owner}, not {msg_id}")
    return data


def read_body(
    fs: FileSystem, root: str, msg_id: str, ref: BodyRef, segments: SegmentFiles | None = None
) -> bytes:
    """Read a message body wherever it lives. ``ref.at`` must be resolved for inline.
    ``segments``: an open spool's read descriptors (``read_inline_body``)."""
    if ref.kind == BODY_INLINE:
        assert ref.at is not None, "inline body reference not resolved"
        log_dir = os.path.join(root, fmt.LOG_DIR)
        return read_inline_body(fs, log_dir, msg_id, ref.at, segments, ref.size)
    return read_body_file(fs, root, msg_id)
