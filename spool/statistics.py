"""The counters an open spool reports (``Spool.statistics``), for monitoring and the
benchmarks."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from spool.attempts import AttemptBook
from spool.reader import list_segments
from spool.state import SpoolState


def _counts(values: Iterable[int]) -> tuple[int, ...]:
    """A histogram's counts as a tuple (they cross the control socket as a list)."""
    return tuple(values)


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
    # The log writer's histograms (spool/histogram.py: counts per bucket, the last one above
    # every bound): fdatasync latency, and records made durable per group-commit batch.
    fsync_seconds: tuple[int, ...] = attrs.field(default=(), converter=_counts)
    fsync_seconds_sum: float = 0.0
    batch_records: tuple[int, ...] = attrs.field(default=(), converter=_counts)


def collect_statistics(st: SpoolState, book: AttemptBook) -> SpoolStatistics:
    """The counters since open. Takes the lock."""
    st.check_process()
    w = st.writer.stats()
    with st.lock:
        c = st.counts
        segments = len(list_segments(st.fs, st.log_dir))
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
            in_flight=len(book.in_flight),
            checkpoints=c["checkpoints"],
            bodies_promoted=c["bodies_promoted"],
            deleted=c["deleted"],
            leases_expired=c["leases_expired"],
            clock_skew=st.time.skew(),
            fsync_seconds=w.fsync_seconds,
            fsync_seconds_sum=w.fsync_seconds_sum,
            batch_records=w.batch_records,
        )
