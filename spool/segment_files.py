"""Read descriptors of the log's segments, kept open between the single-frame reads of an
open spool (a body for an attempt, an inline body copied to its own file, an outcome's
body).

Opening a segment for every body costs an ``open``, an ``fstat``, a header read and a
``close`` (about as much CPU as the rest of a delivery's bookkeeping); a descriptor kept
open makes it one ``pread``. Only reads, so nothing here changes what is durable.

What a held descriptor costs: a deleted file keeps its blocks until its last descriptor
closes. So descriptors are few (``KEEP_OPEN``, the least recently used closed first),
and a segment's descriptor is closed when the checkpoint retires the segment, before it
is deleted or archived (``retire_below``). A read racing the retirement, on another
thread, holds the descriptor until its read ends; a read of a segment already retired
opens the file for that read alone, as an offline reader does (and finds it missing
once it is deleted). Not usable after ``close``: the spool closes it last.

Thread-safe: reads run on the callers' threads without the spool's lock. A descriptor is
closed only when no read uses it (a count per descriptor), so a read never uses a number
that was closed and reused for another file.
"""

from __future__ import annotations

import os
import threading
from typing import Final

import attrs

from spool import format as fmt
from spool.framing import Frame
from spool.fs import FileSystem
from spool.reader import frame_in, open_segment_checked
from spool.records import Position

# Attempts read bodies in queue order, from the oldest segment or two. Few, because each
# is one descriptor fewer for the writer: a process near its limit (RLIMIT_NOFILE) must
# not fail its writer for the sake of a read.
KEEP_OPEN: Final = 2


@attrs.define
class _Open:
    """One segment's descriptor, its frames' salt and its path (for errors), and the reads
    using it now."""

    fd: int
    salt: int
    path: str
    users: int = 0
    closing: bool = False  # close it once ``users`` is back to 0


class SegmentFiles:
    """The read descriptors of one open spool's log directory."""

    def __init__(self, fs: FileSystem, log_dir: str, keep_open: int = KEEP_OPEN) -> None:
        self._fs = fs
        self._log_dir = log_dir
        self._keep_open = keep_open
        self._lock = threading.Lock()
        self._open: dict[int, _Open] = {}  # least recently used first
        self._retired_below = 0  # segments below this number are retired: never kept
        self._closed = False

    def read_frame(self, at: Position, size_hint: int = 0) -> Frame:
        """The checked frame at ``at`` (as ``reader.read_frame_at``, with its errors)."""
        entry = self._acquire(at.segment)
        try:
            return frame_in(self._fs, entry.fd, entry.path, at.offset, entry.salt, size_hint)
        finally:
            self._release(entry)

    def retire_below(self, segment: int) -> None:
        """Segments below ``segment`` are about to be deleted or archived: close their
        descriptors now (those in use, when their read ends), and keep none of them
        again."""
        with self._lock:
            self._retired_below = max(self._retired_below, segment)
            for number in [n for n in self._open if n < segment]:
                self._let_go_locked(number)

    def close(self) -> None:
        """Close every descriptor (those in use, when their read ends)."""
        with self._lock:
            self._closed = True
            for number in list(self._open):
                self._let_go_locked(number)

    @property
    def open_count(self) -> int:
        """How many descriptors are kept open (for tests)."""
        with self._lock:
            return len(self._open)

    def _acquire(self, segment: int) -> _Open:
        with self._lock:
            entry = self._open.pop(segment, None)
            if entry is not None:
                self._open[segment] = entry  # now the most recently used
                entry.users += 1
                return entry
            keep = not self._closed and segment >= self._retired_below
        # Opened without the lock: an open may block (a slow disk), and reads of the
        # segments already open must not wait for it.
        path = os.path.join(self._log_dir, fmt.segment_name(segment))
        fd, salt = open_segment_checked(self._fs, path, segment)
        entry = _Open(fd, salt, path, users=1, closing=True)  # for this read alone, unless kept
        if keep:
            with self._lock:
                # Not if closed or retired meanwhile, or opened by another read meanwhile.
                if (
                    not self._closed
                    and segment >= self._retired_below
                    and segment not in self._open
                ):
                    self._open[segment] = entry
                    entry.closing = False
                    self._evict_locked()
        return entry

    def _release(self, entry: _Open) -> None:
        with self._lock:
            entry.users -= 1
            close = entry.closing and entry.users == 0
        if close:
            self._fs.close(entry.fd)

    def _evict_locked(self) -> None:
        """Close the least recently used descriptors no read uses, down to the limit."""
        over = len(self._open) - self._keep_open
        for number in [n for n, e in self._open.items() if e.users == 0][: max(0, over)]:
            self._let_go_locked(number)

    def _let_go_locked(self, number: int) -> None:
        """Stop keeping ``number``'s descriptor: closed now if unused, else by its last
        read."""
        entry = self._open.pop(number)
        entry.closing = True
        if entry.users == 0:
            self._fs.close(entry.fd)
