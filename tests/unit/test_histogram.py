"""The writer's histograms: buckets by Prometheus's ``le`` rule, and what the writer feeds
them (one latency per fdatasync, one size per batch)."""

from __future__ import annotations

from pathlib import Path

from spool import Spool
from spool.histogram import BATCH_RECORDS_BOUNDS, FSYNC_SECONDS_BOUNDS, Histogram, cumulative


def test_a_value_counts_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    h = Histogram((1, 2, 4))
    for value in (0, 1, 1.5, 2, 3, 4, 5, 100):
        h.observe(value)
    assert h.snapshot() == (2, 2, 2, 2) and h.sum == 116.5
    assert cumulative((1, 2, 4), h.snapshot()) == [
        ("1.0", 2), ("2.0", 4), ("4.0", 6), ("+Inf", 8),
    ]  # fmt: skip


def test_the_statistics_time_every_fsync_and_size_every_batch(tmp_path: Path) -> None:
    with Spool.open(tmp_path / "spool") as sp:
        for n in range(5):
            sp.accept("a@example.org", ["b@example.net"], b"x%d" % n)
        s = sp.statistics()
    assert len(s.fsync_seconds) == len(FSYNC_SECONDS_BOUNDS) + 1
    assert len(s.batch_records) == len(BATCH_RECORDS_BOUNDS) + 1
    # Every fdatasync of a batch is timed (a new segment's directory fsync is not a batch).
    assert 5 <= sum(s.fsync_seconds) <= s.fsyncs and s.fsync_seconds_sum > 0
    assert sum(s.batch_records) == s.batches
    # Each accept alone in its batch: one append (its envelope and BODY frame together).
    assert s.batch_records[BATCH_RECORDS_BOUNDS.index(1)] >= 5
