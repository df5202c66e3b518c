"""The log writer: every append goes through here, and concurrent durable appends share fsyncs.

Group commit, after LevelDB's ``DBImpl::Write``. ``append`` assigns the records their
position under the writer lock, frames them there with the salt of the segment they land
in (every segment gets a random salt in its header; docs/format.md, "Salts"), and queues
them. A durable caller then waits until the
durable end passes its frames; the first waiter that finds no flush running becomes the
leader: it takes every queued frame, pads the batch to a sector boundary, writes it with
one ``pwrite`` per segment touched, ``fdatasync``s once, and wakes everyone. Non-durable
appends (start, deferred deltas, replacement envelopes, finish) ride along with the next
batch, or a background flusher writes them every ``sync_every`` frames or
``sync_interval`` seconds, whichever comes first (NSQ diskqueue's SyncEvery/SyncTimeout).

Commit point: ``accept()`` and ``delivered()``/``failed()`` commit at the instant the
``fdatasync`` covering their frame returns. Before that a crash may lose the frame (and
the caller has not been told it is safe); after it no crash can.

Crash safety (the invariants are numbered in docs/design.md):
    (W1) A frame's caller is woken as durable only after an fdatasync covering the frame
         returned; a new segment also needs its directory entry fsynced first.
    (W2) Each batch is one write per segment starting at a sector boundary and padded to
         one, so no write touches a sector an earlier fsync made durable.
    (W3) A new segment file is created only after every earlier segment is fully
         fdatasynced, so a torn frame can only be in the newest segment.
    (W4) Frames are never rewritten; the file only grows, but for (W6).
    (W6) Zeros written ahead: a batch that reaches past what its segment already holds
         writes a run of zeros after itself (``FIRST_AHEAD``, doubling up to
         ``write_ahead``; never past ``segment_size``), covered by the same ``fdatasync``.
         The batches after it overwrite those zeros instead of growing the file, so their
         ``fdatasync`` has no new size or extents to commit to the file system's journal
         (an append's ``fdatasync`` must; that is most of the gap between appending and
         overwriting, docs/performance.md). Zeros after the log's end read as a torn tail (sectors
         never written are zeros), which is what recovery already cuts; a clean close
         cuts them itself. Only the newest segment can end in them: a segment rolls over
         only once its frames reach ``segment_size``, past the last zero written ahead.

Errors:
    Any OSError from write or fsync puts the writer in a sticky failed state: the waiting
    callers and every later caller get ``SpoolFailed`` (no retry of a failed fsync: the
    page cache may already have dropped the dirty pages). Reopening the spool recovers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from spool import format as fmt
from spool.errors import SpoolClosed, SpoolFailed
from spool.framing import encode_frame, padding_for
from spool.fs import FileSystem
from spool.histogram import BATCH_RECORDS_BOUNDS, FSYNC_SECONDS_BOUNDS, Histogram
from spool.records import Position
from spool.segment_header import new_salt, segment_header

Part = tuple[int, bytes]  # (frame type, payload): one record or BODY frame to append

# Zeros written past a batch that reaches beyond what its segment holds (W6): one file-size
# change, and one journal commit, per this much log. The ``write_ahead`` option's default.
DEFAULT_WRITE_AHEAD = 1 << 20
FIRST_AHEAD = 64 << 10  # a segment's first run of zeros; each next one twice as long


@attrs.define
class _Chunk:
    """Queued bytes for one segment, starting at ``offset``."""

    segment: int
    salt: int
    offset: int
    parts: list[bytes]
    size: int = 0


@attrs.frozen
class WriterStats:
    """Counters since open, for ``Spool.statistics()``."""

    fsyncs: int
    batches: int
    frames: int
    bytes_written: int
    segments_created: int
    fsync_seconds: tuple[int, ...]  # counts per bucket of FSYNC_SECONDS_BOUNDS
    fsync_seconds_sum: float
    batch_records: tuple[int, ...]  # counts per bucket of BATCH_RECORDS_BOUNDS


class LogWriter:
    """Appends frames to the segment files of ``log_dir``. Thread-safe.

    ``first_segment`` is the number the writer creates on its first batch: the spool
    starts a fresh segment at every open, so recovery never appends after a cut tail.
    ``on_durable`` is called (outside the lock) with the new durable end after every batch.
    """

    def __init__(
        self,
        fs: FileSystem,
        log_dir: str,
        *,
        first_segment: int,
        segment_size: int,
        sync_every: int = 1000,
        sync_interval: float = 1.0,
        write_ahead: int = DEFAULT_WRITE_AHEAD,
        on_durable: Callable[[Position], None] | None = None,
    ) -> None:
        assert first_segment >= 1 and segment_size > fmt.SEGMENT_HEADER_SIZE
        self._fs = fs
        self._dir = log_dir
        self._segment_size = segment_size
        self._sync_every = sync_every
        self._sync_interval = sync_interval
        self._write_ahead = write_ahead
        self._on_durable = on_durable
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # callers waiting for a flush to end
        # The background flusher's own condition, so that the callers' wake-ups do not
        # wake it and its own do not wake them (``_flush_loop``); ``_flusher_idle``: it
        # sleeps with nothing queued, and the next frame nobody will wait for wakes it.
        self._flusher_cond = threading.Condition(self._lock)
        self._flusher_idle = False
        self._salt = new_salt()  # of the segment at the tail
        # The first segment's header is queued with the first frame (or ``create_segment``):
        # an open that appends nothing creates no file.
        self._header_due = True
        self._pending: list[_Chunk] = []
        self._pending_frames = 0
        self._tail = Position(first_segment, fmt.SEGMENT_HEADER_SIZE)
        # Nothing of the first segment exists yet: its start is "durable" vacuously.
        self._durable = Position(first_segment, 0)
        self._fd: int | None = None
        self._fd_segment = 0
        self._written_to = 0  # how far the current segment holds frames or zeros (W6)
        self._ahead = min(FIRST_AHEAD, write_ahead)  # the next run of zeros: doubles
        self._flushing = False
        self._failed: SpoolFailed | None = None
        self._closed = False
        self._fsyncs = self._batches = self._frames = self._bytes = self._created = 0
        self._fsync_seconds = Histogram(FSYNC_SECONDS_BOUNDS)
        # Waiters that must not block (asyncio callers, ``durable_future``): completed by
        # whichever thread ends the batch that covers them; ``_flush_asked`` makes the
        # flusher write at once instead of after ``sync_interval``.
        self._futures: list[tuple[Position, concurrent.futures.Future[None]]] = []
        self._flush_asked = False
        self._batch_records = Histogram(BATCH_RECORDS_BOUNDS)
        self._flusher = threading.Thread(target=self._flush_loop, name="spool-flusher", daemon=True)
        self._flusher.start()

    # --- public ------------------------------------------------------------------------

    @property
    def durable(self) -> Position:
        """End of the durable prefix of the log (every frame before it survives a crash).

        Before anything is appended that is the tail: there is nothing to wait for (the
        first segment's file does not exist yet, and readers stop where a file is missing).
        """
        return self._tail if self._header_due else self._durable

    @property
    def tail(self) -> Position:
        """Where the next appended frame will go (queued frames included)."""
        return self._tail

    @property
    def untouched(self) -> bool:
        """Nothing was appended (and no segment created) since this writer started."""
        return self._header_due

    def create_segment(self) -> None:
        """Create the first segment now, empty, and make it durable (a checkpoint whose
        positions must point into it calls this when nothing was appended yet)."""
        with self._lock:
            self._check_usable()
            self._queue_header_locked()
            self._wait_durable_locked(self._tail)

    def append(self, parts: Sequence[Part], *, durable: bool) -> Position:
        """Append ``parts`` (one or more frames, kept contiguous) and return their start.

        With ``durable`` the call returns only after an fdatasync covers the frames (W1);
        otherwise they are written with the next batch. Raises ``SpoolFailed`` if the
        writer has failed, ``SpoolClosed`` after ``close``.
        """
        start, end = self.enqueue(parts, waited=durable)
        if durable:
            self.wait_durable(end)
        return start

    def enqueue(self, parts: Sequence[Part], *, waited: bool = False) -> tuple[Position, Position]:
        """Frame and queue ``parts``; return (start, end) without waiting for the disk.

        Callers that must update their own state atomically with the position assignment
        call this under their lock, then ``wait_durable(end)`` outside it. Each payload
        must fit a frame (callers check: ``FRAME_PAYLOAD_MAX``).

        ``waited``: the caller waits for ``end`` next (``wait_durable`` leads a flush,
        ``durable_future`` asks the flusher for one), so the idle flusher is not woken for
        these frames: a wake-up per durable call cost a single producer about a third of
        its accept's CPU. A caller that may be stopped between this and its wait without
        running code (a task cancelled while a worker thread queues for it) must not pass
        it; frames queued ``waited`` whose caller never waits all the same (an exception
        in between) go with the next batch, or with the idle flusher's next look
        (``IDLE_LOOK``).
        """
        with self._lock:
            self._check_usable()
            self._queue_header_locked()
            if self._tail.offset >= self._segment_size:
                self._roll_locked()
            frames = b"".join(encode_frame(t, p, self._salt) for t, p in parts)
            start = self._tail
            chunk = self._pending[-1] if self._pending else None
            if chunk is None or chunk.segment != start.segment:
                chunk = _Chunk(start.segment, self._salt, start.offset, [])
                self._pending.append(chunk)
            chunk.parts.append(frames)
            chunk.size += len(frames)
            self._tail = Position(start.segment, start.offset + len(frames))
            self._pending_frames += 1
            if (self._flusher_idle and not waited) or self._pending_frames == self._sync_every:
                self._flusher_cond.notify()  # the flusher starts its interval, or flushes now
            return start, self._tail

    def check_usable(self) -> None:
        """Raise ``SpoolFailed`` or ``SpoolClosed`` if nothing more can be appended."""
        with self._lock:
            self._check_usable()

    def wait_durable(self, end: Position) -> None:
        """Return once every frame before ``end`` is durable; lead a flush if none runs."""
        with self._lock:
            self._wait_durable_locked(end)

    def durable_future(self, end: Position) -> concurrent.futures.Future[None]:
        """A future done once every frame before ``end`` is durable (its exception
        ``SpoolFailed`` or ``SpoolClosed`` if that can no longer happen). Never blocks: the
        background flusher leads the flush at once, and the frames share it with every
        other waiter, blocking or not (``asyncio.wrap_future`` makes it awaitable)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._header_due or self._durable >= end:
                future.set_result(None)  # nothing appended yet, or already durable
                return future
            if self._failed is not None or self._closed:
                future.set_exception(self._failed or SpoolClosed("the spool is closed"))
                return future
            self._futures.append((end, future))
            self._flush_asked = True
            self._flusher_cond.notify()
        return future

    def sync(self) -> Position:
        """Write and fdatasync everything queued; return the durable end."""
        with self._lock:
            self._check_usable()
            self._wait_durable_locked(self._tail)
            return self._durable

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(
                self._fsyncs,
                self._batches,
                self._frames,
                self._bytes,
                self._created,
                self._fsync_seconds.snapshot(),
                self._fsync_seconds.sum,
                self._batch_records.snapshot(),
            )

    def close(self) -> None:
        """Flush what is queued (if the writer has not failed) and release the file."""
        with self._lock:
            if self._closed:
                return
            if self._failed is None:
                with contextlib.suppress(SpoolFailed):
                    self._wait_durable_locked(self._tail)
            self._closed = True
            self._cond.notify_all()
            self._flusher_cond.notify()
            self._end_futures_locked()
        self._flusher.join()
        if self._fd is not None:
            self._cut_zeros_ahead()
            self._fs.close(self._fd)
            self._fd = None

    # --- internals -----------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise SpoolClosed("the spool is closed")

    def _queue_header_locked(self) -> None:
        """Queue the first segment's header if it is not yet (the file comes at flush)."""
        if self._header_due:
            self._header_due = False
            seg = self._tail.segment
            header = segment_header(seg, self._salt)
            self._pending.insert(0, _Chunk(seg, self._salt, 0, [header], len(header)))

    def _roll_locked(self) -> None:
        """Start the next segment: queue its header; the file is created at flush time."""
        nxt = self._tail.segment + 1
        self._salt = new_salt()
        header = segment_header(nxt, self._salt)
        self._pending.append(_Chunk(nxt, self._salt, 0, [header], fmt.SEGMENT_HEADER_SIZE))
        self._tail = Position(nxt, fmt.SEGMENT_HEADER_SIZE)

    def _wait_durable_locked(self, end: Position) -> None:
        if self._header_due:
            return  # nothing appended yet: every position up to the tail is vacuously durable
        while self._durable < end:
            if self._failed is not None:
                raise self._failed
            if self._closed:
                # Queued while ``close`` made the rest durable, and not covered by it: the
                # file is being closed outside the lock, so no flush may start now.
                raise SpoolClosed("the spool closed before this was made durable")
            if self._flushing:
                self._cond.wait()
            else:
                self._flush_locked()

    def _flush_locked(self) -> None:
        """Leader: take the queue, write and fdatasync it with the lock released."""
        if not self._pending or self._flushing:
            return
        last = self._pending[-1]
        pad = padding_for(last.offset + last.size, last.salt)  # (W2)
        if pad:
            last.parts.append(pad)
            last.size += len(pad)
            self._tail = Position(last.segment, last.offset + last.size)
        batch, self._pending = self._pending, []
        frames, self._pending_frames = self._pending_frames, 0
        self._flush_asked = False  # asked for again by any waiter this batch misses
        target = self._tail
        self._flushing = True
        self._lock.release()
        error: OSError | None = None
        interrupted: BaseException | None = None
        written = 0
        latencies: list[float] = []
        try:
            for chunk in batch:
                written += self._write_chunk(chunk, latencies)
        except OSError as exc:
            error = exc
        except BaseException as exc:  # a signal's handler raised (Ctrl-C) mid-batch
            interrupted = exc
        finally:
            self._lock.acquire()
            self._flushing = False
        if error is not None or interrupted is not None:
            # What reached the disk is unknown, and the batch is gone from the queue: a
            # later batch written after it would leave a hole that recovery stops at,
            # losing what that batch acknowledged. So the writer fails for good, as for a
            # failed write; the next open finds the end of the log.
            if error is not None:
                reason = f"failed: {error.strerror or error}"
            else:
                reason = f"was interrupted ({type(interrupted).__name__})"
            self._failed = SpoolFailed(
                f"writing the log in {self._dir} {reason}",
                error.errno if error is not None else None,
            )
            self._cond.notify_all()
            self._flusher_cond.notify()
            self._end_futures_locked()
            if interrupted is not None:
                raise interrupted
            raise self._failed
        self._batches += 1
        self._frames += frames
        self._batch_records.observe(frames)
        for seconds in latencies:
            self._fsync_seconds.observe(seconds)
        self._bytes += written
        self._durable = target
        self._cond.notify_all()
        if self._pending_frames:
            self._flusher_cond.notify()  # queued behind this batch: its interval starts
        if self._futures:
            self._end_futures_locked()
        if self._on_durable is not None:
            self._lock.release()
            try:
                self._on_durable(target)
            finally:
                self._lock.acquire()

    def _end_futures_locked(self) -> None:
        """Complete the ``durable_future`` waiters the durable end now covers (all of them,
        with the error, once the writer has failed or closed)."""
        waiting, self._futures = self._futures, []
        for end, future in waiting:
            if future.done():
                continue  # cancelled by its waiter (an asyncio task cancelled, a timeout)
            try:
                if self._durable >= end:
                    future.set_result(None)
                elif self._failed is not None or self._closed:
                    future.set_exception(self._failed or SpoolClosed("the spool is closed"))
                else:
                    self._futures.append((end, future))
            except concurrent.futures.InvalidStateError:
                pass  # cancelled meanwhile: nobody waits for it any more

    def _write_chunk(self, chunk: _Chunk, latencies: list[float]) -> int:
        """Write one segment's share of a batch and fdatasync it (its latency added to
        ``latencies``). Lock not held."""
        data = b"".join(chunk.parts)
        new_file = chunk.segment != self._fd_segment
        if new_file:
            # (W3): the previous segment's last batch was fdatasynced before this line runs
            # (batches are written in order and each chunk is synced before the next).
            # A crash right after the create leaves an empty or torn newest segment, which
            # recovery removes: nothing in it was acknowledged.
            path = os.path.join(self._dir, fmt.segment_name(chunk.segment))
            fd = self._fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            if self._fd is not None:
                self._fs.close(self._fd)
            self._fd, self._fd_segment = fd, chunk.segment
            self._written_to = 0
            self._ahead = min(FIRST_AHEAD, self._write_ahead)
            self._created += 1
        assert self._fd is not None
        # A crash during this write leaves a torn tail in the newest segment (W3), cut off
        # by recovery; nobody waiting on it has been told it is durable (W1). Where it
        # overwrites zeros written ahead (W6), a sector it did not reach still holds zeros,
        # as an appended sector that never reached the disk would: the same torn tail.
        self._fs.pwrite(self._fd, data, chunk.offset)
        end = chunk.offset + len(data)
        if end > self._written_to:
            self._write_zeros_ahead(end)
        started = time.perf_counter()
        self._fs.fdatasync(self._fd)
        latencies.append(time.perf_counter() - started)
        self._fsyncs += 1
        if new_file:
            # The segment's directory entry must be durable before any frame in it is
            # acknowledged (W1); a crash before this leaves the file possibly missing,
            # which loses only unacknowledged frames.
            self._fs.fsync_dir(self._dir)
            self._fsyncs += 1
        return len(data)

    def _write_zeros_ahead(self, end: int) -> None:
        """Write zeros from ``end`` (where the batch just written ends, past what the
        segment held) to a run past it, never past the segment size (W6). The runs of a
        segment start at ``FIRST_AHEAD`` and double up to ``write_ahead``: an open, or a
        spool that writes little, writes few zeros (a restart cuts them and syncs that).

        A crash before the batch's ``fdatasync`` leaves some of them, or none: zeros past
        the log's end either way, a torn tail that recovery cuts. A full disk (ENOSPC,
        EDQUOT: the write refused, nothing left dirty in doubt) costs only the speed-up:
        the batch itself is written, what zeros reached the file lie past the log's end as
        well, and the next batch to pass them tries again. Any other error fails the
        writer, as a failed write of the batch would (no sync after a write that failed)."""
        self._written_to = end
        ahead = min(end + self._ahead, self._segment_size)
        self._ahead = min(2 * self._ahead, self._write_ahead)
        if ahead <= end:
            return
        assert self._fd is not None
        try:
            self._fs.pwrite(self._fd, bytes(ahead - end), end)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return
        self._written_to = ahead

    def _cut_zeros_ahead(self) -> None:
        """At close, cut the zeros written ahead (W6) so that a closed log ends where its
        frames do, and the next open finds no tail to cut (a quiet reopen writes nothing).

        A crash before the ``fdatasync`` leaves the zeros, or some of them: the next
        recovery reads them as a torn tail and cuts them. A failure here changes nothing
        acknowledged, so it is left to that recovery too."""
        assert self._fd is not None
        end = self._tail
        if self._failed is not None or end.segment != self._fd_segment:
            return
        if self._written_to <= end.offset:
            return
        with contextlib.suppress(OSError):
            self._fs.ftruncate(self._fd, end.offset)
            self._fs.fdatasync(self._fd)
            self._fsyncs += 1
            self._written_to = end.offset

    def _flush_loop(self) -> None:
        """Background flusher: writes queued non-durable frames every N frames or T s, and
        at once when a ``durable_future`` waits for them.

        It never holds the lock without waiting: with nothing queued it sleeps until a
        frame that no caller will wait for is queued (``enqueue``; a caller that waits
        leads its own flush, or asks for one with ``durable_future``) or its next look
        (``IDLE_LOOK``, or the interval if longer), and while another thread leads a
        flush it waits for that flush to end (which wakes it only if frames are queued
        behind the batch). So no ``sync_interval``, however small, can keep the lock from
        the callers. It sleeps on a condition of its own: one wake-up of it per durable
        call (two before: the frame queued, the flush's end) cost a single producer about
        a third of its accept's CPU (docs/performance.md)."""
        with self._lock:
            while not self._closed and self._failed is None:
                if not self._pending_frames:
                    # Woken by the next frame nobody will wait for; and it looks anyway
                    # every ``IDLE_LOOK`` (or interval): a frame queued ``waited`` whose
                    # caller never waited (a cancelled task) is written then, not at the
                    # next flush someone asks for.
                    self._flusher_idle = True
                    try:
                        self._flusher_cond.wait(min(max(self._sync_interval, IDLE_LOOK), WAIT_MAX))
                    finally:
                        self._flusher_idle = False
                    continue
                if self._flushing:
                    self._flusher_cond.wait(WAIT_MAX)  # the flush's end wakes it
                    continue
                deadline = time.monotonic() + self._sync_interval
                while (
                    not self._closed
                    and not self._flush_asked
                    and self._pending_frames < self._sync_every
                    and (left := deadline - time.monotonic()) > 0
                ):
                    self._flusher_cond.wait(min(left, WAIT_MAX))
                if self._closed or self._failed is not None:
                    return
                if self._pending_frames and not self._flushing:
                    try:
                        self._flush_locked()
                    except SpoolFailed:
                        return


# The longest single wait on a condition: longer timeouts overflow the platform's limit;
# every loop that waits checks its own deadline again.
WAIT_MAX = 3600.0
# How often an idle flusher looks for frames queued without waking it (seconds).
IDLE_LOOK = 1.0
